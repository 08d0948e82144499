"""A Hypothesis stateful machine per peer: the stateful suite's rules, through ``Lockstep``.

Design card. The spec, under the peer's semantics profile, and the peer's real scheduler
(``make_peer``) receive the same operations through ``kvsched.peers.lockstep.Lockstep``,
the one lockstep comparison: decisions, whole plans and states (queues in order,
computed tokens, outputs, free blocks, each request's blocks) after every operation.
The rules are the suite's where the peer supports them (tests/stateful/rules.py): adds,
bursts, identical requests, oversize requests, aborts in every state a peer has
(waiting, waiting after a preemption, running mid-prefill, running decoding; no
swapped state), id reuse after finish or abort, and the suite's request strategy
(tests/stateful/strategies.py). Not used: faults (a peer has no rollback), bad
requests (the peers' front ends validate, not their schedulers) and duplicate live ids
(likewise).

Configurations: the suite's ``profile_configs`` (tests/stateful/strategies.py), which
derives each bound from the profile's constraints (``SchedulerConfig.__post_init__``):
block sizes 1-16 (nano-vllm >= 2), pools of 8-64 tokens, budgets from 1 (vLLM: from
``max_num_seqs``, V6; nano-vllm: half the time below ``max_num_seqs``), ``max_num_seqs``
from 1, chunked prefill on or off (nano-vllm: off, N2), ``lifo`` (vLLM also ``priority``),
recompute only (V7), vLLM's ``max_model_len`` drawn or its default (>= 2).

``PrefixPeerMachine`` turns prefix caching on and adds the requests that share prefixes
(N7, V9-V11): the example's system prompt cut anywhere (or at whole blocks) under
suffixes of their own, earlier prompts sent again, and an earlier prompt followed by the
oracle's answer to it (the next turn of a chat). Lockstep then compares the peer's pool
too (ids, free queue order, keys: each adapter projects it onto ``PrefixCacheState``),
so every hit, key and free-queue position is held to the profile's cache rules
(spec/profiles.py). vLLM runs without it (``VllmMachine``) and with it
(``VllmPrefixMachine``); nano-vllm caches always, so its machine is a prefix machine.
The suite's rules give nano-vllm's requests each their own first token (never reused
within an example), so none of them hits; "identical" requests differ only there.
nano-vllm has one EOS for the engine, drawn per example.

A divergence fails the example with ``describe``'s report, and Hypothesis shrinks it to
a minimal program, unless it is the signature of a known peer bug
(``kvsched.peers.known``): then the example ends there, counted as the event
``known peer bug: <id>`` (never silently). The teardown drains within
``spec.drain_step_bound`` (under ``lifo``; it covers both profiles) or the suite's derived
bound (``priority``), and a state that repeats is a livelock: either is a failure of the peer.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import ClassVar, Final

from hypothesis import strategies as st
from hypothesis.stateful import (
    MultipleResults,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

import spec
from kvsched.peers import PROFILES, make_peer
from kvsched.peers.known import KnownBug, classify
from kvsched.peers.lockstep import Diverged, Lockstep, describe
from spec.oracle import HashOracle
from spec.types import RequestState, SamplingParams, SchedulerConfig, SchedulerState, StepPlan
from tests.oracles.pool import spec_pool_violations
from tests.stateful.base import REQUESTS, RecordedMachine, checked
from tests.stateful.failures import fail, require
from tests.stateful.machine import ProgressKey, drain_bound, progress_key
from tests.stateful.nano_cache import NANO_CACHE_EVENTS
from tests.stateful.prefix import (
    PREFIX_EVENTS,
    SYSTEM_PROMPT_LEN,
    prefix_events,
    shared_prompts,
    system_prompt,
)
from tests.stateful.rules import abort_label, find_live
from tests.stateful.step import profile_events, step_events
from tests.stateful.strategies import (
    BLOCK_SIZES,
    NEW_REQUESTS,
    NewRequest,
    fit_sizes,
    profile_configs,
    r4_caps,
)
from tests.stateful.toy import toy_solo

#: The oracle's vocabulary: prompt tokens and outputs (small, so EOS is often hit).
VOCAB: Final = 16
ORACLE: Final = HashOracle(vocab_size=VOCAB, salt=11)
#: nano-vllm: each request's first token, ``FIRST_TOKEN + n`` for the n-th request of
#: the example, outside the oracle's range (no prefix-cache hit, N7).
FIRST_TOKEN: Final = 10_000


#: The suite's requests, fitting the configuration (R4); ``add_oversize`` draws the
#: others, in a rule of their own: an oversize request meets nano-vllm's N2/N6 at once,
#: which ends the example, and a quarter of all requests would end most examples.
FITTING: Final = NEW_REQUESTS.map(lambda req: replace(req, oversize=False))
OVERSIZE: Final = NEW_REQUESTS.map(lambda req: replace(req, oversize=True))


#: Paths a ``ci`` run of a peer machine must reach (the suite's labels).
REQUIRED_NANO: Final = frozenset(
    {
        *(f"config: block_size={bs}" for bs in BLOCK_SIZES if bs >= 2),
        # "config: max_num_seqs=1" is counted, not required: whether the ci stream draws it
        # depends on which test modules the process collected (docs/stateful-testing.md,
        # "Known nondeterminism").
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
        # Each rule of the profile made a difference against the real peer.
        "nano-vllm/prefill-first: a prefill-only step with requests running",
        "nano-vllm/decode-unbudgeted: a decode step over the token budget",
        "nano-vllm/victim-next: a victim lifo would not have chosen",
        "nano-vllm/seq-limit-per-step: more than max_num_seqs running",
        "config: prefix caching on",
        *NANO_CACHE_EVENTS,
    }
)
#: nano-vllm never shows several victims in one step: N5 ends the example at its first
#: preempting step (the victim stays in ``running``) before the step's events count.
REQUIRED_VLLM: Final = {
    e for e in REQUIRED_NANO if not e.startswith("nano-vllm") and e != "config: prefix caching on"
} | {
    "vllm-v1/max-model-len: length at max_model_len",
    # Not required: vllm-v1/priority-victim-any-running (a victim already scheduled in
    # the step) needs a worse-priority request admitted before better ones under
    # pressure; the ci run reaches it in one step only, too rare to require
    # (tests/peers/repros/priority_victim_scheduled does, and the stateful suite's
    # machines against our engine).
    "vllm-v1/full-sequence-admission: the gate held a request back",
    "preempt: several victims in one step",
    "config: block_size=1",
    "config: chunked prefill on",
    "config: chunked prefill off",
    "config: policy=priority",
    "admission held back by a preemption",
    "chunked prefill: partial chunk",
    "chunked prefill: last chunk of a resumed prefill",
    "abort: running mid-prefill",
}

#: With prefix caching (``VllmPrefixMachine``): every prefix event of the stateful suite
#: (tests/stateful/prefix.py) against vLLM's own cache. Not required: the
#: full-sequence gate holding a request back (vllm-v1/full-sequence-admission, with or
#: without a hit), reached in one step of the ci run; its repros check it
#: (tests/peers/repros/full_sequence_hit_*.jsonl).
REQUIRED_VLLM_PREFIX: Final = {
    "config: prefix caching on",
    "preempt: recompute",
    "chunked prefill: partial chunk",
    "finish: length",
    "vllm-v1/max-model-len: length at max_model_len",
    *PREFIX_EVENTS,
}


class PeerMachine(RecordedMachine):
    PEER: ClassVar[str]
    #: Configs with ``enable_prefix_caching`` (``PrefixPeerMachine``).
    PREFIX_CACHING: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.stopped: KnownBug | None = None
        self.next_id = 0
        self.num_added = 0  # requests given to both sides (nano-vllm's first tokens)
        self.eos = 0
        self.shared = False  # the request being submitted shares a prefix on purpose

    # --- set-up and helpers ---------------------------------------------------------------

    @initialize(
        target=REQUESTS,
        config=st.runner().flatmap(
            lambda machine: profile_configs(
                PROFILES[machine.PEER], prefix_caching=machine.PREFIX_CACHING
            )
        ),
        eos=st.integers(0, VOCAB - 1),
        initial=st.lists(FITTING, min_size=1, max_size=8),
    )
    @checked
    def init_peer(
        self, config: SchedulerConfig, eos: int, initial: list[NewRequest]
    ) -> MultipleResults[str]:
        # nano-vllm caches always. A hit needs the request it shares blocks with still
        # running, and nano-vllm admits a request only when its whole prompt fits the
        # budget and all its blocks are free, hit or not (N8): in the suite's configs
        # (pools of 8-64 tokens, budgets mostly below a block or two) requests that share
        # a prefix almost never run together. So its examples with an even pool get a
        # roomy one: four times the blocks, a budget of the whole pool, at least 4
        # requests a step; the others keep the suite's config (and its pressure).
        if self.PEER == "nano-vllm" and config.num_gpu_blocks % 2 == 0:
            blocks = config.num_gpu_blocks * 4
            config = replace(
                config,
                num_gpu_blocks=blocks,
                max_num_batched_tokens=blocks * config.block_size,
                max_num_seqs=max(config.max_num_seqs, 4),
            )
        self.config = config
        self.eos = eos
        peer = make_peer(self.PEER, config, eos_token_id=eos)
        self.lock = Lockstep(peer, config, ORACLE)
        self.ready = True
        self.record.stats.examples += 1
        self.note(f"config: policy={config.policy}")
        self.note(f"config: block_size={config.block_size}")
        self.note(f"config: chunked prefill {'on' if config.enable_chunked_prefill else 'off'}")
        if config.max_num_seqs == 1:
            self.note("config: max_num_seqs=1")
        self.start_cache(config)
        accepted: list[str] = []
        with self.lockstep():
            accepted = self.add_all(initial)
        return multiple(*accepted)

    @contextmanager
    def lockstep(self) -> Iterator[None]:
        """A divergence inside fails the example, unless it is a known peer bug: then the
        example ends here (every later rule is a no-op), counted as an event."""
        try:
            yield
        except Diverged as e:
            bug = classify(self.PEER, e.divergence)
            if bug is None:
                fail("lockstep", f"{self.PEER}: {describe(e.divergence)}")
            self.stopped = bug
            self.note(f"known peer bug: {bug.id}")

    def fresh_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def resolve(self, req: NewRequest) -> tuple[tuple[int, ...], SamplingParams]:
        """The suite's sizes (fitting unless ``oversize``); tokens from ``salt``."""
        prompt_len, max_tokens = fit_sizes(self.config, req)
        rng = random.Random(req.salt)
        prompt = tuple(rng.randrange(VOCAB) for _ in range(prompt_len))
        priority = req.priority if self.config.policy == "priority" else 0
        params = SamplingParams(max_tokens=max_tokens, priority=priority)
        if self.PEER == "nano-vllm":
            # One EOS for the engine: a request without one ignores it.
            return prompt, replace(
                params, eos_token_id=self.eos, ignore_eos=req.ignore_eos or req.eos is None
            )
        if req.eos is not None:
            # An EOS the request really samples: one of its solo outputs.
            outputs = toy_solo(prompt, params, ORACLE)
            eos = outputs[req.eos % len(outputs)]
            params = replace(params, eos_token_id=eos, ignore_eos=req.ignore_eos)
        return prompt, params

    def submit(self, request_id: str, prompt: tuple[int, ...], params: SamplingParams) -> bool:
        """Add on both sides (Lockstep compares acceptance); whether it was accepted."""
        if self.PEER == "nano-vllm" and not self.shared:
            prompt = (FIRST_TOKEN + self.num_added, *prompt[1:])
        self.num_added += 1
        self.lock.add(request_id, prompt, params)
        if not spec.is_live(self.lock.state, request_id):
            self.note("reject: RequestTooLargeError")
            return False
        if params.eos_token_id is not None and not params.ignore_eos:
            self.note("add: with EOS")
        return True

    def add_all(self, reqs: list[NewRequest]) -> list[str]:
        accepted = []
        for req in reqs:
            request_id = self.fresh_id()
            if self.submit(request_id, *self.resolve(req)):
                accepted.append(request_id)
        return accepted

    def do_step(self) -> StepPlan:
        before = self.lock.state
        # The spec's decisions again (pure), for the events of the profile rules they used.
        mid, draft = spec.schedule(before)
        try:
            plan = self.lock.step()
        except Diverged as e:
            if e.divergence.field.startswith(("state", "blocks")):
                # The plans agreed (they are compared first); count what they decided.
                self.note_all(profile_events(before, mid, draft))
            raise
        self.record.stats.steps += 1
        self.note_all(step_events(self.config, before, plan, self.lock.state))
        self.note_all(profile_events(before, mid, plan))
        self.note_all(self.cache_events(before, mid, plan))
        return plan

    def start_cache(self, config: SchedulerConfig) -> None:
        """Set up what the prefix-caching rules need (``PrefixPeerMachine``)."""

    def cache_events(
        self, before: SchedulerState, mid: SchedulerState, plan: StepPlan
    ) -> Iterable[str]:
        """The prefix-cache events of a step (``PrefixPeerMachine``)."""
        return ()

    def note_all(self, labels: Iterable[str]) -> None:
        for label in labels:
            self.note(label)

    def running(self) -> bool:
        return self.ready and self.stopped is None

    # --- rules ------------------------------------------------------------------------------

    @precondition(lambda self: self.running())
    @rule(target=REQUESTS, req=FITTING)
    @checked
    def add_request(self, req: NewRequest) -> MultipleResults[str]:
        return self.add_requests([req])

    @precondition(lambda self: self.running())
    @rule(target=REQUESTS, req=OVERSIZE)
    @checked
    def add_oversize(self, req: NewRequest) -> MultipleResults[str]:
        """A request the suite does not clamp to fit: R4 (or vllm-v1/max-model-len)."""
        return self.add_requests([req])

    @precondition(lambda self: self.running())
    @rule(target=REQUESTS, reqs=st.lists(FITTING, min_size=2, max_size=6))
    @checked
    def add_burst(self, reqs: list[NewRequest]) -> MultipleResults[str]:
        return self.add_requests(reqs)

    @precondition(lambda self: self.running())
    @rule(target=REQUESTS, req=FITTING, copies=st.integers(2, 6))
    @checked
    def add_identical(self, req: NewRequest, copies: int) -> MultipleResults[str]:
        """The same request several times: exact ties for the scheduler (nano-vllm:
        identical but for the first token, see above)."""
        self.note("add: identical requests")
        return self.add_requests([req] * copies)

    def add_requests(self, reqs: list[NewRequest]) -> MultipleResults[str]:
        accepted: list[str] = []
        with self.lockstep():
            accepted = self.add_all(reqs)
        return multiple(*accepted)

    @precondition(lambda self: self.running())
    @rule(request_id=REQUESTS, req=FITTING)
    @checked
    def add_with_used_id(self, request_id: str, req: NewRequest) -> None:
        """Reuse the id of a finished or aborted request (a live id is a duplicate, which
        the peers' front ends refuse, not their schedulers: not drawn)."""
        if spec.is_live(self.lock.state, request_id):
            return
        with self.lockstep():
            if self.submit(request_id, *self.resolve(req)):
                self.note("add: reused the id of a finished request")

    @precondition(lambda self: self.running())
    @rule(request_id=consumes(REQUESTS))
    @checked
    def abort(self, request_id: str) -> None:
        """Abort an id added earlier if it is still live."""
        if spec.is_live(self.lock.state, request_id):
            self.abort_id(request_id)

    @precondition(lambda self: self.running() and spec.has_unfinished_requests(self.lock.state))
    @rule(queue=st.sampled_from(("waiting", "running")), pick=st.integers(0, 2**16))
    @checked
    def abort_live(self, queue: str, pick: int) -> None:
        """Abort a live request of ``queue``, or of the other one if it is empty."""
        state = self.lock.state
        candidates = getattr(state, queue) or state.waiting or state.running
        self.abort_id(candidates[pick % len(candidates)].request_id)

    # The two states below last a step or two (a victim is re-prefilled as soon as it
    # fits, a chunked prefill ends in a few chunks): rules of their own, enabled exactly
    # while one exists, abort there far more often than a pick among all live requests.

    @precondition(lambda self: self.running() and bool(self.preempted_waiting()))
    @rule(pick=st.integers(0, 2**16))
    @checked
    def abort_preempted(self, pick: int) -> None:
        """Abort a request waiting after a preemption."""
        victims = self.preempted_waiting()
        self.abort_id(victims[pick % len(victims)].request_id)

    @precondition(lambda self: self.running() and bool(self.prefilling()))
    @rule(pick=st.integers(0, 2**16))
    @checked
    def abort_prefilling(self, pick: int) -> None:
        """Abort a running request in the middle of a chunked prefill."""
        partial = self.prefilling()
        self.abort_id(partial[pick % len(partial)].request_id)

    def preempted_waiting(self) -> tuple[RequestState, ...]:
        return tuple(r for r in self.lock.state.waiting if r.num_preemptions)

    def prefilling(self) -> tuple[RequestState, ...]:
        return tuple(r for r in self.lock.state.running if r.num_tokens - r.num_computed_tokens > 1)

    def abort_id(self, request_id: str) -> None:
        where = find_live(self.lock.state, request_id)
        assert where is not None
        with self.lockstep():
            self.lock.abort(request_id)
            self.lock.compare_states()
            self.note(abort_label(*where))

    @rule()
    @checked
    def step(self) -> None:
        """One step (after a known peer bug ended the example: nothing, the one rule
        that stays valid)."""
        if self.running():
            with self.lockstep():
                self.do_step()

    @precondition(lambda self: self.running())
    @rule(n=st.integers(2, 10))
    @checked
    def run_steps(self, n: int) -> None:
        with self.lockstep():
            for _ in range(n):
                self.do_step()

    @precondition(lambda self: self.running())
    @rule(limit=st.integers(1, 40), abort_victim=st.sampled_from((True, True, False)))
    @checked
    def run_until_preemption(self, limit: int, abort_victim: bool) -> None:
        """Step until a step preempts; then maybe abort its last victim at once, while
        it waits after the preemption."""
        plan: StepPlan | None = None
        with self.lockstep():
            for _ in range(limit):
                plan = self.do_step()
                if plan.preempted:
                    break
        if self.running() and abort_victim and plan is not None and plan.preempted:
            victim = plan.preempted[-1].request_id
            if spec.is_live(self.lock.state, victim):
                self.abort_id(victim)

    # --- teardown: a bounded drain ---------------------------------------------------------

    def teardown(self) -> None:
        if not self.running() or not self.settled:
            return  # a rule failed (report that), or a known peer bug ended the example
        start = self.lock.state
        bound = drain_bound(start, lifo_proof=self.PEER == "vllm" and self.config.policy == "lifo")
        seen: set[ProgressKey] = set()
        steps = 0
        with self.lockstep():
            while self.lock.unfinished():
                if steps >= bound:
                    fail(
                        "drain_bound",
                        f"{self.PEER}: {spec.num_unfinished_requests(self.lock.state)} "
                        f"requests still live after {steps} drain steps (bound {bound}): "
                        "the peer hangs",
                    )
                self.do_step()
                steps += 1
                self.record.stats.drain_steps += 1
                key = progress_key(self.lock.state)
                if key in seen:
                    fail("no_livelock", f"{self.PEER}: state repeats after {steps} drain steps")
                seen.add(key)
            self.lock.finish()
            wrong = spec_pool_violations(self.lock.state)
            require(not wrong, "pools_empty_after_drain", lambda: f"{self.PEER}: {wrong}")


class PrefixPeerMachine(PeerMachine):
    """A peer machine with prefix caching on and requests that share prefixes (N7, N8,
    N12; V9-V11): the example's system prompt (tests/stateful/prefix.py's
    ``shared_prompts``), prompts sent again (after they finished, were preempted or had
    their blocks reclaimed) and next turns. Its events are the stateful suite's prefix
    events (nano-vllm's cache rules included), from the spec's states (lockstep has just
    found the peer's pool equal to them)."""

    PREFIX_CACHING = True
    system_prompt: tuple[int, ...] = ()

    def start_cache(self, config: SchedulerConfig) -> None:
        self.system_prompt = system_prompt(config, VOCAB)
        self.victim_blocks: dict[int, frozenset[int]] = {}
        self.sent: list[tuple[tuple[int, ...], NewRequest]] = []
        self.finished_prompts: set[tuple[int, ...]] = set()
        self.note("config: prefix caching on")

    def cache_events(
        self, before: SchedulerState, mid: SchedulerState, plan: StepPlan
    ) -> Iterable[str]:
        events = list(
            prefix_events(
                before,
                mid,
                plan,
                self.lock.state,
                victim_blocks=self.victim_blocks,
                prompts_sent_before=set(self.finished_prompts),
            )
        )
        prompts = {r.request_id: r.request.prompt_token_ids for r in mid.running}
        self.finished_prompts.update(prompts[f.request_id] for f in plan.finished)
        return events

    def send(self, prompts: list[tuple[int, ...]], req: NewRequest) -> MultipleResults[str]:
        """Submit each prompt as is (nano-vllm: its first token too), with ``req``'s
        parameters, both cut to what R4 accepts: the prompt only past the cap,
        so that it keeps its shared blocks, the outputs first."""
        accepted: list[str] = []
        with self.lockstep():
            for whole in prompts:
                if not self.running():
                    break
                prompt_cap, total_cap = r4_caps(self.config)
                cut = min(c for c in (prompt_cap, total_cap, len(whole)) if c is not None)
                prompt = whole[:cut]
                _, params = self.resolve(replace(req, prompt_len=len(prompt)))
                if total_cap is not None:
                    max_tokens = max(1, min(req.max_tokens, total_cap - len(prompt) + 1))
                    params = replace(params, max_tokens=max_tokens)
                request_id = self.fresh_id()
                self.shared = True
                try:
                    if self.submit(request_id, prompt, params):
                        accepted.append(request_id)
                        self.sent.append((prompt, req))
                finally:
                    self.shared = False
        return multiple(*accepted)

    @precondition(lambda self: self.running())
    @rule(
        target=REQUESTS,
        req=FITTING,
        num_blocks=st.integers(1, 4),
        own=st.integers(0, 8),
        copies=st.integers(1, 4),
    )
    @checked
    def add_shared_prefix(
        self, req: NewRequest, num_blocks: int, own: int, copies: int
    ) -> MultipleResults[str]:
        """The system prompt's first ``num_blocks`` blocks (of the largest block size at
        most: it has 4), then each copy's own ``own`` tokens; none: the copies are the
        same whole blocks (N12, and a full-prompt hit on exactly k blocks)."""
        shared = min(num_blocks * self.config.block_size, SYSTEM_PROMPT_LEN)
        self.note("add: shared prefix")
        prompts = shared_prompts(
            self.system_prompt,
            shared + own,
            self.config.block_size,
            prefix_len=shared,
            exact_blocks=own == 0,
            copies=copies,
            salt=req.salt,
            vocab=VOCAB,
        )
        return self.send(prompts, req)

    @precondition(lambda self: self.running() and bool(self.sent))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16))
    @checked
    def resend(self, pick: int) -> MultipleResults[str]:
        """A prompt sent before, again, wherever its first copy is now."""
        prompt, req = self.sent[pick % len(self.sent)]
        return self.send([prompt], req)

    @precondition(lambda self: self.running() and bool(self.sent))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16), turns=st.integers(1, 8))
    @checked
    def add_next_turn(self, pick: int, turns: int) -> MultipleResults[str]:
        """An earlier prompt followed by the oracle's first ``turns`` answers to it: the
        blocks its first copy's decodes filled (and keyed) are this prompt's too."""
        prompt, req = self.sent[pick % len(self.sent)]
        tokens = list(prompt)
        for _ in range(turns):
            tokens.append(ORACLE(tuple(tokens)))
        self.note("add: next turn of an earlier prompt")
        return self.send([tuple(tokens)], req)
