"""A peer's real scheduler (``kvsched.peers.make_peer``) against the spec under its
semantics profile (docs/peers.md has what the runs found).

Tokens come from the driver's pure oracle (``ORACLE``): the peer samples with it, and
a request's solo outputs are the oracle alone on its own prefix. A peer is an optional
install: its test skips when it is missing, and fails under ``CI=true``
(tests/peers/conftest.py). A divergence that is a known peer bug's signature
(``kvsched.peers.known``) ends the example there, counted; any other fails it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvsched.peers import make_peer
from kvsched.peers.known import KnownBug, classify
from kvsched.peers.lockstep import Divergence, Lockstep
from spec.oracle import Drafter, HashOracle, OracleDrafter, PromptLookupDrafter, TokenOracle
from spec.types import SchedulerConfig
from tests.peers.conftest import require_peer
from tests.stateful.sizes import Size, Sizes
from tests.stateful.strategies import BLOCK_SIZES
from tests.stateful.subject import Note, Side, Subject

#: The oracle's vocabulary: prompt tokens and outputs (small, so EOS is often hit).
VOCAB = 16
ORACLE = HashOracle(vocab_size=VOCAB, salt=11)

PEER_SIZES = Sizes(
    ci=Size(200, 30),
    dev=Size(30, 25),
    nightly=Size(5_000, 50),
    mutation=Size(30, 25),
)

#: What every peer's ci run must reach (each adds its profile's rules): the peers have
#: no swap, no faults, no bad requests (tests/stateful/subject.py, ``Capabilities``).
PEER_EVENTS: Final = frozenset(
    {
        *(f"config: block_size={bs}" for bs in BLOCK_SIZES if bs >= 2),
        "config: max_num_seqs=1",
        "preempt: recompute",
        "re-prefill of prompt + kept outputs",
        "max_num_seqs reached with requests waiting",
        "finish: stop",
        "finish: length",
        "finish: EOS sampled but ignored",
        "add: with EOS",
        "add: identical requests",
        "add: reused the id of a finished request",
        "abort: waiting",
        "abort: waiting after a preemption",
        "abort: running (decoding)",
    }
)


def engine_eos(config: SchedulerConfig) -> int:
    """The example's one EOS (``Capabilities.engine_eos``), from its config (so a shrunk
    example keeps it)."""
    return (config.num_gpu_blocks * 7 + config.max_num_batched_tokens * 3) % VOCAB


def speculative_config(config: SchedulerConfig) -> PromptLookupDrafter | None:
    """The example's n-gram ``speculative_config`` (vllm-v1/spec-*, with
    ``num_speculative_tokens``): prompt lookup of 1 to 1-3 tokens, from its config (so a
    shrunk example keeps it)."""
    if not config.num_speculative_tokens:
        return None
    return PromptLookupDrafter(
        num_speculative_tokens=config.num_speculative_tokens,
        prompt_lookup_min=1,
        prompt_lookup_max=1 + config.num_gpu_blocks % 3,
        max_model_len=config.max_model_len,
    )


def example_drafter(
    config: SchedulerConfig, speculative: PromptLookupDrafter | None, oracle: TokenOracle = ORACLE
) -> Drafter | None:
    """Who proposes the example's drafts, on both sides: prompt lookup (vLLM's n-gram
    proposer, which ``PromptLookupDrafter`` restates: scripts/crosscheck_prompt_lookup.py)
    on half the configs; on the others the oracle's own tokens, right up to a point
    from the config, so that runs are accepted whole and in part (prompt lookup on
    random prompts is mostly rejected). None: prompt lookup."""
    if speculative is None or config.max_num_batched_tokens % 2:
        return None
    k = speculative.num_speculative_tokens
    return OracleDrafter(oracle, k, (config.num_gpu_blocks + config.max_num_seqs) % (k + 2))


@dataclass(frozen=True, kw_only=True)
class Peer(Subject):
    #: The ``--engine`` name ``make_peer`` builds (and tests/peers/conftest.py knows).
    peer: str

    def start(self, config: SchedulerConfig, note: Note) -> Side:
        eos = engine_eos(config) if self.caps.engine_eos else None
        speculative = speculative_config(config)
        drafter = example_drafter(config, speculative)
        peer = make_peer(
            self.peer, config, eos_token_id=eos, speculative=speculative, drafter=drafter
        )
        lock = Lockstep(peer, config, ORACLE, drafter=drafter or speculative)
        return Side(lock, eos=eos)

    def require(self) -> None:
        require_peer(self.peer)

    def known_bug(self, divergence: Divergence) -> KnownBug | None:
        return classify(self.peer, divergence)
