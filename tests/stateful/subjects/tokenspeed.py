"""TokenSpeed's scheduler (``tokenspeed-scheduler`` 0.1.42, ``kvsched.peers.tokenspeed``:
``submit_requests`` / ``next_execution_plan`` / ``advance``) under the ``tokenspeed``
profile; and our ``impl.Scheduler`` under the same profile, driven by the toy model
(``TOKENSPEED_SCHEDULER``), where the engine's side of the rules (impl/reserve_step.py)
is held to the spec's.

The profile's constraints (``SchedulerConfig._check_tokenspeed``): chunked prefill,
``lifo`` (submission order), recompute with no CPU pool, no prefix cache, a cache of at
most 4097 tokens. An admission reserves its whole generation, so nothing is preempted:
the preemption events are not required.
"""

from __future__ import annotations

from typing import Final

from hypothesis import strategies as st

from spec.types import SchedulerConfig, Semantics
from tests.stateful.sizes import Size, Sizes
from tests.stateful.strategies import BLOCK_SIZES, printable_config
from tests.stateful.subject import Capabilities
from tests.stateful.subjects import OURS
from tests.stateful.subjects.peer import PEER_EVENTS, PEER_SIZES, VOCAB, Peer
from tests.stateful.subjects.scheduler import VOCAB as TOY_VOCAB
from tests.stateful.subjects.scheduler import ToyScheduler


@st.composite
def tokenspeed_configs(draw: st.DrawFn) -> SchedulerConfig:
    """A GPU cache of 8-64 tokens (at least two pages), every block size."""
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    return draw(
        printable_config(
            num_gpu_blocks=max(2, draw(st.integers(8, 64)) // block_size),
            block_size=block_size,
            max_num_batched_tokens=draw(st.integers(1, 64)),
            max_num_seqs=draw(st.sampled_from((2, 3, 4, 6, 8, 1))),
            enable_chunked_prefill=True,
            policy="lifo",
            semantics=Semantics.TOKENSPEED,
        )
    )


#: Each rule of the profile made a difference (tests/stateful/offload_reserve_events.py).
#: Not required: tokenspeed/head-of-line-chunk (a chunk is cut only by the budget, which
#: it then spends: in the drawn configs it holds the line exactly when R5 would).
TOKENSPEED_RULE_EVENTS: Final = frozenset(
    {
        "tokenspeed/reserve-generation: the step differs without it",
        "tokenspeed/skip-not-fit: the step differs without it",
        "tokenspeed/submission-order: the step differs without it",
        "tokenspeed/prefill-first: a prefill step with decoding requests left out",
        "tokenspeed/submit-refusal: refused a request kvsched's R4 accepts",
        "tokenspeed/finished-id-held: a finished or aborted id refused before the next plan",
    }
)

#: Nothing is preempted (tokenspeed/reserve-generation).
NO_PREEMPTION: Final = frozenset(
    {
        "preempt: recompute",
        "re-prefill of prompt + kept outputs",
        "abort: waiting after a preemption",
    }
)

REQUIRED_TOKENSPEED: Final = (PEER_EVENTS - NO_PREEMPTION) | {
    *TOKENSPEED_RULE_EVENTS,
    "config: block_size=1",
    "chunked prefill: partial chunk",
    "abort: running mid-prefill",
}

TOKENSPEED = Peer(
    name="tokenspeed",
    machine="TokenSpeedMachine",
    peer="tokenspeed",
    # SubmitRequests refuses a live id and one too large for the cache (every add may
    # draw one); an empty prompt too, but no token outside a vocabulary it does not
    # know. TS7: a prompt's pages are de-duplicated when published (not modelled), so
    # no two prompts share a first page.
    caps=Capabilities(
        duplicate_ids=True,
        unknown_ids=True,
        oversize_in_every_add=True,
        first_token_of_its_own=True,
    ),
    configs=tokenspeed_configs(),
    sizes=PEER_SIZES,
    required=REQUIRED_TOKENSPEED,
    vocab=VOCAB,
)

TOKENSPEED_SCHEDULER = ToyScheduler(
    name="tokenspeed-scheduler",
    machine="TokenSpeedSchedulerDifferential",
    caps=OURS,
    configs=tokenspeed_configs(),
    sizes=Sizes(
        ci=Size(300, 40),
        dev=Size(40, 30),
        nightly=Size(5_000, 100),
        mutation=Size(300, 40),
    ),
    required=REQUIRED_TOKENSPEED | {"reject: TokenOutOfVocabError"},
    vocab=TOY_VOCAB,
)
