"""nano-vllm's real scheduler and block manager (``nano-vllm-fork``, ``kvsched.peers.nano``)
under the ``nano-vllm`` profile, which caches always: ``lifo``, recompute only, no
chunked prefill, block sizes >= 2, one EOS for the engine.

A hit needs the request it shares blocks with still running, and nano-vllm admits a
request only when its whole prompt fits the budget and all its blocks are free, hit or
not (N8): in the drawn configs (pools of 8-64 tokens, budgets mostly below a block or
two) requests that share a prefix almost never run together. So the examples with an
even pool get a roomy one (``roomy``); the others keep the drawn config and its
pressure. Requests not sent to share a prefix get a first token of their own
(``Capabilities.first_token_of_its_own``): N12 ends an example at its first hit on
every block of a prompt.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Final

from hypothesis import strategies as st

from spec.types import SchedulerConfig, Semantics
from tests.stateful.nano_cache import NANO_CACHE_EVENTS
from tests.stateful.strategies import printable_config, profile_configs
from tests.stateful.subject import Capabilities
from tests.stateful.subjects.peer import PEER_EVENTS, PEER_SIZES, VOCAB, Peer


def roomy(config: SchedulerConfig) -> st.SearchStrategy[SchedulerConfig]:
    """An even pool four times as large, a budget of the whole pool, at least 4 seats
    (printed as the call that makes it)."""
    if config.num_gpu_blocks % 2 == 0:
        blocks = config.num_gpu_blocks * 4
        config = replace(
            config,
            num_gpu_blocks=blocks,
            max_num_batched_tokens=blocks * config.block_size,
            max_num_seqs=max(config.max_num_seqs, 4),
        )
    return printable_config(**{f.name: getattr(config, f.name) for f in fields(config)})


REQUIRED_NANO: Final = PEER_EVENTS | {
    # Each rule of the profile made a difference against the real peer.
    "nano-vllm/prefill-first: a prefill-only step with requests running",
    "nano-vllm/decode-unbudgeted: a decode step over the token budget",
    "nano-vllm/victim-next: a victim lifo would not have chosen",
    "nano-vllm/seq-limit-per-step: more than max_num_seqs running",
    "config: prefix caching on",
    *NANO_CACHE_EVENTS,
}

NANO_VLLM = Peer(
    name="nano-vllm",
    machine="NanoVllmMachine",
    peer="nano-vllm",
    caps=Capabilities(caching=True, engine_eos=True, first_token_of_its_own=True),
    configs=profile_configs(Semantics.NANO_VLLM, prefix_caching=True).flatmap(roomy),
    sizes=PEER_SIZES,
    required=REQUIRED_NANO,
    vocab=VOCAB,
)
