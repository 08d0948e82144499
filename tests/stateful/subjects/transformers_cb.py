"""transformers' continuous batching (``transformers`` 5.19.0, ``kvsched.peers.transformers_cb``:
its ``ContinuousBatchProcessor`` loop with an oracle model runner) under the
``transformers`` profile; and our ``impl.Scheduler`` under the same profile, driven by
the toy model (``TRANSFORMERS_SCHEDULER``), where the engine's side of the rules
(impl/offload_step.py) is held to the spec's.

The profile's constraints (``SchedulerConfig._check_transformers``): chunked prefill
always, ``lifo`` (its one FIFO order), soft reset (recompute) or CPU offload (swap), no
block sharing, pages of at least 4 tokens.
"""

from __future__ import annotations

from typing import Final

from hypothesis import strategies as st

from spec.types import PreemptionMode, SchedulerConfig, Semantics
from tests.stateful.sizes import Size, Sizes
from tests.stateful.strategies import BLOCK_SIZES, printable_config
from tests.stateful.subject import Capabilities
from tests.stateful.subjects import OURS
from tests.stateful.subjects.peer import PEER_EVENTS, PEER_SIZES, VOCAB, Peer
from tests.stateful.subjects.scheduler import VOCAB as TOY_VOCAB
from tests.stateful.subjects.scheduler import ToyScheduler

#: initialization.py:38-40: a page holds at least 4 tokens.
PAGE_SIZES: Final = tuple(bs for bs in BLOCK_SIZES if bs >= 4)


@st.composite
def transformers_configs(draw: st.DrawFn) -> SchedulerConfig:
    """A GPU cache of 8-64 tokens (at least two pages); CPU offload (swap) half the time,
    into a CPU pool from none (every victim soft-reset) to twice the GPU's."""
    block_size = draw(st.sampled_from(PAGE_SIZES))
    num_gpu_blocks = max(2, draw(st.integers(8, 64)) // block_size)
    mode = draw(st.sampled_from((PreemptionMode.RECOMPUTE, PreemptionMode.SWAP)))
    num_cpu_blocks = draw(st.integers(0, 2 * num_gpu_blocks)) if mode is PreemptionMode.SWAP else 0
    return draw(
        printable_config(
            num_gpu_blocks=num_gpu_blocks,
            block_size=block_size,
            max_num_batched_tokens=draw(st.integers(1, 64)),
            max_num_seqs=draw(st.sampled_from((2, 3, 4, 6, 8, 1))),
            enable_chunked_prefill=True,
            preemption_mode=mode,
            num_cpu_blocks=num_cpu_blocks,
            policy="lifo",
            semantics=Semantics.TRANSFORMERS,
        )
    )


#: Each rule of the profile made a difference (tests/stateful/offload_reserve_events.py).
TRANSFORMERS_RULE_EVENTS: Final = frozenset(
    {
        "transformers/safety-margin: the step differs without it",
        "transformers/skip-not-fit: the step differs without it",
        "transformers/offload-starved: the step differs without it",
        "transformers/offloaded-interleaved: the step differs without it",
        "transformers/admission-frozen: the step differs unfrozen",
        # Not required: transformers/seq-limit-per-step (more than max_num_seqs running)
        # needs a starved request left running (its blocks storable next step) beside
        # admissions that fill the step's seats; no ci run of either subject reached it
        # (0 of 352 examples of our scheduler's).
        "transformers/victims-at-tail: a victim requeued behind waiting requests",
    }
)

REQUIRED_TRANSFORMERS: Final = (
    PEER_EVENTS - {"config: block_size=2"}  # pages of at least 4 tokens
) | {
    *TRANSFORMERS_RULE_EVENTS,
    "config: mode=swap",
    "preempt: swap",  # transformers/offload-starved into the CPU pool
    "preempt: swap fell back to recompute (CPU pool full)",  # its soft reset
    "swap-in",
    "chunked prefill: partial chunk",
    "abort: running mid-prefill",
}

TRANSFORMERS_CB = Peer(
    name="transformers",
    machine="TransformersMachine",
    peer="transformers",
    # Its adapter refuses an unknown id's abort; it refuses no malformed request but the
    # empty and the zero-length, and accepts one that never fits (T12: the example ends).
    caps=Capabilities(swap=True, unknown_ids=True),
    configs=transformers_configs(),
    sizes=PEER_SIZES,
    required=REQUIRED_TRANSFORMERS,
    vocab=VOCAB,
)

TRANSFORMERS_SCHEDULER = ToyScheduler(
    name="transformers-scheduler",
    machine="TransformersSchedulerDifferential",
    caps=OURS,
    configs=transformers_configs(),
    sizes=Sizes(
        ci=Size(300, 40),
        dev=Size(40, 30),
        nightly=Size(5_000, 100),
        mutation=Size(300, 40),
    ),
    required=REQUIRED_TRANSFORMERS | {"fault: in a step that preempted"},
    vocab=TOY_VOCAB,
)
