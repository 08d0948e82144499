"""What the one lockstep machine needs from a system under test: its *subject*.

Design card (zarr's testing/stateful.py: one machine, the store passed in).
``LockstepMachine`` (tests/stateful/machine.py) holds every rule, invariant, the bounded
drain and the solo-output check, once. A subject (tests/stateful/subjects/, one file per
system under test) says what is under test:

- ``start(config, note)``: one example's real side, a ``Side``: the scheduler under test
  in lockstep with the spec (``kvsched.peers.lockstep.Lockstep``), the outputs of a
  request run alone, its faults and its own checks (per step, and once drained);
- ``configs``: the configurations its examples draw;
- ``caps``: what it supports (``Capabilities``); the machine's preconditions read them;
- ``sizes`` (per Hypothesis profile) and ``required`` (the coverage events a ci or
  nightly run must reach);
- ``require()``: skip the test (fail it under ``CI=true``) where the subject cannot run
  (a peer that is not installed);
- ``known_bug(divergence)``: the known peer bug a divergence is the signature of (the
  example ends there, counted as an event), else None.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from impl.scheduler import Scheduler
from kvsched.peers.known import KnownBug
from kvsched.peers.lockstep import Advance, Divergence, Lockstep
from spec.types import SamplingParams, SchedulerConfig
from tests.stateful.sizes import Sizes
from tests.stateful.toy import toy_solo

Note = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a subject supports. A rule that needs something runs only where the subject
    has it (its precondition says so); a new feature adds a field here, the rules that
    exercise it, and sets it on the subjects that have it."""

    #: A fault can be armed in a forward (or a swap copy): the step must roll back.
    faults: bool = False
    #: Swap preemption: its configs may draw swap mode (the swap-copy faults need it).
    swap: bool = False
    #: Prefix caching: every config has it on, and the shared-prefix rules run.
    caching: bool = False
    #: R4's refusals of malformed requests (empty prompt, ``max_tokens`` 0, a token
    #: outside the vocabulary, never fits), in R4's order.
    bad_requests: bool = False
    #: A live id is refused with ``DuplicateRequestError`` (a peer's front end does it,
    #: not its scheduler: it is only given the ids of finished requests again).
    duplicate_ids: bool = False
    #: An unknown id's abort is refused with ``UnknownRequestError``.
    unknown_ids: bool = False
    #: Every add may draw a request that does not fit (a quarter do); otherwise only
    #: ``add_oversize`` sends one (nano-vllm's N2/N6 ends the example at the first).
    oversize_in_every_add: bool = False
    #: A request keeps its drawn priority under every policy (a peer gets one only under
    #: ``priority``, the one policy that reads it; nano-vllm has none).
    priorities: bool = False
    #: One EOS for the whole engine (``Side.eos``), nano-vllm's: a request stops on it
    #: unless it ignores EOS.
    engine_eos: bool = False
    #: Every request not sent to share a prefix gets a first token of its own (outside
    #: the vocabulary), so it hits nothing: nano-vllm's N12 ends an example at a hit on
    #: every block of a prompt, which identical requests would meet at once.
    first_token_of_its_own: bool = False


class Side:
    """One example's system under test, in lockstep with the spec (``lock``).

    ``scheduler`` is our ``impl.Scheduler`` where the side has one (the block-table
    invariants read it); ``eos`` the engine's EOS under ``Capabilities.engine_eos``.
    """

    def __init__(
        self, lock: Lockstep, *, scheduler: Scheduler | None = None, eos: int | None = None
    ) -> None:
        self.lock = lock
        self.scheduler = scheduler
        self.eos = eos

    def solo(self, prompt: tuple[int, ...], params: SamplingParams) -> tuple[int, ...]:
        """The outputs of this request run alone (the reference for every output): by
        default the lockstep's token oracle on the request's own prefix."""
        return toy_solo(prompt, params, self.lock.next_token)

    def added(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        """A request both sides accepted (the engine's side learns its solo run, which
        its drafter may draft from)."""

    def solo_holds(self, params: SamplingParams) -> bool:
        """Whether a request's outputs must equal its solo run's token for token (the
        engine's rejection sampling at temperature > 0 matches them in distribution only)."""
        return True

    def arm_fault(self, kind: str, when_preempting: bool) -> None:
        """Arm ``kind`` (one of ``strategies.FAULT_KINDS``); under ``Capabilities.faults``
        only. The step it fires in raises ``InjectedFault`` and is rolled back."""
        raise NotImplementedError(f"{type(self).__name__} has no faults")

    def faults_armed(self) -> bool:
        """Whether a fault is armed (only then can a step fail and need a snapshot)."""
        return False

    def fault_snapshot(self) -> dict[str, object]:
        """What a rolled-back step must leave unchanged besides the observed state, by
        the name of the invariant that says so (taken before a step while a fault is
        armed: the engine's K/V is costly to copy)."""
        return {}

    def after_step(self, advance: Advance) -> None:
        """The side's own checks of a step both sides agreed on."""

    def check_drained(self) -> None:
        """The side's own checks once nothing is live (the engine's: every metric
        against the spec's trace)."""


@dataclass(frozen=True, kw_only=True)
class Subject(abc.ABC):
    #: The test's id and the mutation check's machine name (scripts/mutation_check.py).
    name: str
    #: The machine class's name: a failing program starts ``state = <machine>()``.
    machine: str
    caps: Capabilities
    configs: st.SearchStrategy[SchedulerConfig]
    sizes: Sizes
    required: frozenset[str]
    #: Prompt tokens are drawn below it (and a bad request's out-of-vocab token is it).
    vocab: int

    @abc.abstractmethod
    def start(self, config: SchedulerConfig, note: Note) -> Side:
        """A fresh real side for ``config`` (``note`` counts a coverage event)."""

    def require(self) -> None:
        """Skip (under ``CI=true``: fail) the test if the subject cannot run here."""
        return

    def known_bug(self, divergence: Divergence) -> KnownBug | None:
        return None
