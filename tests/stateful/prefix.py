"""Prefix caching in the differential machines: shared-prefix workloads and their events.

``PrefixRules`` is mixed into a machine (``PrefixSchedulerDifferential``,
``PrefixEngineDifferential``) and draws its configs with prefix caching on. Its rules send
prompts that share tokens: the example's one system prompt under different
suffixes, the system prompt cut at exactly ``k`` blocks, and earlier prompts sent
again (after they finished, after their blocks were reclaimed, after a preemption:
whatever the run has done to them by then). Its coverage events (``PREFIX_EVENTS``)
are computed from the spec's states, so they say what the rules of
docs/semantics.md (PC1-PC9) did, not what the engine reports.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Final

from hypothesis import strategies as st
from hypothesis.stateful import MultipleResults, multiple, precondition, rule

from spec.types import PreemptionMode, SchedulerConfig, SchedulerState, StepPlan
from tests.stateful.base import REQUESTS, checked
from tests.stateful.coverage import REQUIRED_EVENTS
from tests.stateful.machine import DifferentialMachine
from tests.stateful.nano_cache import NANO_CACHE_EVENTS, nano_cache_events
from tests.stateful.rules import init_rule
from tests.stateful.strategies import NEW_REQUESTS, NewRequest, engine_configs

SYSTEM_PROMPT_LEN: Final = 64

PREFIX_EVENTS: Final = frozenset(
    {
        "config: prefix caching on",
        "prefix: hit",
        "prefix: partial hit (fewer blocks than it could hit)",
        "prefix: full-prompt hit (every block it may hit)",
        "prefix: full-prompt hit on exactly k blocks (last block recomputed)",
        "prefix: hit on blocks keyed in the same step",
        "prefix: hit on a free cached block",
        "prefix: block shared by running requests",
        "prefix: cached block reclaimed",
        "prefix: resumed request hit its own freed blocks",
        "prefix: resent prompt hit",
    }
)

#: The machines with caching on never swap (caching refuses swap mode); every profile
#: may cache, so every other event stays required.
_UNREACHABLE_WITH_CACHING: Final = frozenset(
    {
        "config: mode=swap",
        "preempt: swap",
        "preempt: swap fell back to recompute (CPU pool full)",
        "swap-in",
        "abort: swapped",
        "fault: swap-out copy",
        "fault: swap-in copy",
    }
)

#: Not required: "vllm-v1/full-sequence-admission: the gate held back a request with a
#: hit" (the hit credited, its rest of the sequence still too large) was not reached in
#: a ci run of the scheduler machine (386 vllm-v1 examples, 246 gate refusals, none of a
#: request with a hit: the chunk must be cut by the budget right then); the peer machine
#: and tests/peers/repros/full_sequence_hit_*.jsonl check the rule against vLLM.
PREFIX_REQUIRED_EVENTS: Final = (
    (REQUIRED_EVENTS - _UNREACHABLE_WITH_CACHING) | PREFIX_EVENTS | NANO_CACHE_EVENTS
)


class PrefixRules(DifferentialMachine):
    """Shared-prefix rules and prefix-cache coverage, on top of a differential machine."""

    system_prompt: tuple[int, ...] = ()
    victim_blocks: dict[int, frozenset[int]]  # arrival -> blocks it gave up when preempted
    sent: list[tuple[tuple[int, ...], NewRequest]]

    init_engine = init_rule(engine_configs(prefix_caching=True))

    def start_engine(
        self, config: SchedulerConfig, initial: list[NewRequest]
    ) -> MultipleResults[str]:
        self.system_prompt = system_prompt(config, self.VOCAB)
        self.victim_blocks = {}
        self.sent = []
        started = super().start_engine(config, initial)
        self.note("config: prefix caching on")
        return started

    def send(self, prompt: tuple[int, ...], req: NewRequest) -> str | None:
        """Submit ``prompt`` with ``req``'s parameters (resolved for its clamped sizes)."""
        _, params = self.resolve(replace(req, prompt_len=len(prompt), eos=None))
        request_id = self.fresh_id()
        if not self.submit(request_id, prompt, params):
            return None
        self.sent.append((prompt, req))
        return request_id

    @rule(
        target=REQUESTS,
        req=NEW_REQUESTS,
        prefix_len=st.integers(1, SYSTEM_PROMPT_LEN),
        exact_blocks=st.booleans(),
        copies=st.integers(1, 4),
    )
    @checked
    def add_shared_prefix(
        self, req: NewRequest, prefix_len: int, exact_blocks: bool, copies: int
    ) -> MultipleResults[str]:
        """``shared_prompts``: the system prompt's first ``prefix_len`` tokens, then each
        copy's own suffix; or, ``exact_blocks``, the system prompt cut at whole blocks."""
        resolved, _ = self.resolve(req)
        prompts = shared_prompts(
            self.system_prompt,
            len(resolved),  # clamped to fit the configuration (R4)
            self.config.block_size,
            prefix_len=prefix_len,
            exact_blocks=exact_blocks,
            copies=copies,
            salt=req.salt,
            vocab=self.VOCAB,
        )
        accepted = [self.send(prompt, req) for prompt in prompts]
        return multiple(*(request_id for request_id in accepted if request_id is not None))

    @precondition(lambda self: bool(self.sent))
    @rule(target=REQUESTS, pick=st.integers(0, 2**16))
    @checked
    def resend(self, pick: int) -> MultipleResults[str]:
        """A prompt sent before, again, wherever its first copy is now (running, finished,
        preempted, its blocks reclaimed or not)."""
        prompt, req = self.sent[pick % len(self.sent)]
        request_id = self.send(prompt, req)
        return multiple() if request_id is None else multiple(request_id)

    def record_step(self, before: SchedulerState, mid: SchedulerState, plan: StepPlan) -> None:
        super().record_step(before, mid, plan)
        prompts_sent_before = {
            a.prompt for arrival, a in self.accepted.items() if arrival in self.outcomes
        }
        for label in prefix_events(
            before,
            mid,
            plan,
            self.lock.state,
            victim_blocks=self.victim_blocks,
            prompts_sent_before=prompts_sent_before,
        ):
            self.note(label)


def system_prompt(config: SchedulerConfig, vocab: int) -> tuple[int, ...]:
    """The example's one system prompt, from its config (so a shrunk example keeps it)."""
    rng = random.Random(config.num_gpu_blocks * 131 + config.max_num_batched_tokens)
    return tuple(rng.randrange(vocab) for _ in range(SYSTEM_PROMPT_LEN))


def shared_prompts(
    system_prompt: tuple[int, ...],
    length: int,
    block_size: int,
    *,
    prefix_len: int,
    exact_blocks: bool,
    copies: int,
    salt: int,
    vocab: int,
) -> list[tuple[int, ...]]:
    """``copies`` prompts of ``length`` tokens: ``system_prompt``'s first ``prefix_len``
    tokens, then each copy's own suffix (from ``salt``); or, ``exact_blocks``, only the
    system prompt cut at a whole number of blocks (the same prompt every copy)."""
    prompts = []
    for copy in range(copies):
        if exact_blocks and length >= block_size:
            prompt = system_prompt[: length // block_size * block_size]
        else:
            shared = min(prefix_len, length)
            own = random.Random(salt + copy).choices(range(vocab), k=length - shared)
            prompt = (*system_prompt[:shared], *own)
        prompts.append(tuple(prompt))
    return prompts


def prefix_events(
    before: SchedulerState,
    mid: SchedulerState,
    plan: StepPlan,
    after: SchedulerState,
    *,
    victim_blocks: dict[int, frozenset[int]],
    prompts_sent_before: set[tuple[int, ...]],
) -> Iterator[str]:
    """The prefix-cache events of one step, from the spec's states: ``before`` it, ``mid``
    (after its decisions), its ``plan`` and ``after`` it. ``victim_blocks`` (arrival ->
    the blocks it gave up when last preempted) is read and updated with this step's
    victims; ``prompts_sent_before`` are the prompts of requests already finished.
    nano-vllm's cache rules' events come with them (tests/stateful/nano_cache.py).
    Shared with the peer prefix machines (tests/peers) and scripts/explore_peers.py."""
    cache_before, cache_mid = before.prefix_cache, mid.prefix_cache
    if cache_before is None or cache_mid is None:
        return
    bs = before.config.block_size
    waiting = {r.request_id: r for r in before.waiting}
    running_mid = {r.request_id: r for r in mid.running}
    keyed_before = {block for _, block in cache_before.cached}
    free_before = set(cache_before.free_queue)
    for chunk in plan.scheduled:
        request = waiting.get(chunk.request_id)
        if request is None or chunk.start == 0:
            continue
        hit = running_mid[chunk.request_id].block_ids[: chunk.start // bs]
        yield "prefix: hit"
        if chunk.start < (request.num_tokens - 1) // bs * bs:
            yield "prefix: partial hit (fewer blocks than it could hit)"
        else:
            yield "prefix: full-prompt hit (every block it may hit)"
            if request.num_tokens % bs == 0 and not request.output_token_ids:
                yield "prefix: full-prompt hit on exactly k blocks (last block recomputed)"
        if not set(hit) <= keyed_before:
            yield "prefix: hit on blocks keyed in the same step"
        if set(hit) & free_before:
            yield "prefix: hit on a free cached block"
        if set(hit) & victim_blocks.get(request.request.arrival, frozenset()):
            yield "prefix: resumed request hit its own freed blocks"
        if request.request.prompt_token_ids in prompts_sent_before:
            yield "prefix: resent prompt hit"
    if set(cache_before.cached) - set(cache_mid.cached):
        yield "prefix: cached block reclaimed"
    yield from nano_cache_events(before, mid, plan, after)
    held = [block for r in after.running for block in r.block_ids]
    if len(set(held)) < len(held):
        yield "prefix: block shared by running requests"
    for preemption in plan.preempted:
        if preemption.mode is not PreemptionMode.SWAP:
            victim = next(r for r in before.running if r.request_id == preemption.request_id)
            victim_blocks[victim.request.arrival] = frozenset(victim.block_ids)
