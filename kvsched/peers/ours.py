"""Ours through the scheduler-under-test protocol: ``impl.Scheduler`` and ``impl.LLMEngine``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from impl.engine import LLMEngine
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from impl.speculative import drafts_run
from kvsched.peers.protocol import Observation
from spec.oracle import Drafter, TokenOracle
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, StepPlan


def _blocks(scheduler: Scheduler) -> dict[str, int]:
    return {rid: len(seq.block_table) for rid, seq in scheduler.requests.items()}


class SchedulerAdapter:
    """``impl.Scheduler`` without a model: the driver's oracle samples, or ``forward``
    (a stand-in for the model, reading the KV through the block tables) does.

    Under speculative decoding ``drafter`` (a pure function, as the spec's drafters)
    proposes each request's drafts from its tokens, and the oracle verifies them as a
    greedy model would, or ``verify`` (the stand-in's verify forward: each sampling
    chunk's run) does."""

    name = "kvsched"
    semantics = "kvsched"

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        vocab_size: int | None = None,
        forward: Callable[[SchedulerOutput], Sequence[int]] | None = None,
        verify: Callable[[SchedulerOutput], Sequence[Sequence[int]]] | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        self.scheduler = Scheduler(config, vocab_size=vocab_size)
        self.forward = forward
        self.verify = verify
        if config.num_speculative_tokens and drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        self.drafter = drafter

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        return self.scheduler.abort_request(request_id)

    def step(self, next_token: TokenOracle) -> StepPlan:
        drafter = self.drafter
        if drafter is not None:
            return self.scheduler.step_verified(
                self.verify or (lambda out: greedy_runs(out, next_token)),
                lambda tokens: drafter(tuple(tokens)),
            )
        if self.forward is not None:
            return self.scheduler.step(self.forward)

        def sample(out: SchedulerOutput) -> list[int]:
            # Async scheduling: a request on its placeholder samples after the token the
            # step in flight brings it (out.pending).
            pending = out.pending
            return [
                next_token(
                    (*seq.token_ids, pending[seq]) if seq in pending else tuple(seq.token_ids)
                )
                for seq in out.samples()
            ]

        return self.scheduler.step(sample)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def observe(self) -> Observation:
        return Observation(state=self.scheduler.observe(), blocks=_blocks(self.scheduler))


def greedy_runs(out: SchedulerOutput, next_token: TokenOracle) -> list[list[int]]:
    """What a greedy model sampling ``next_token`` returns for each sampling request of
    ``out``: its drafts while they agree with it, then its own next token."""
    runs = []
    for seq, n in zip(out.scheduled, out.num_scheduled, strict=True):
        if seq.samples_at(seq.num_computed + n):
            tokens = tuple(seq.token_ids)
            run: list[int] = []
            for draft in drafts_run(seq, seq.num_computed, n):
                if draft != next_token((*tokens, *run)):
                    break
                run.append(draft)
            run.append(next_token((*tokens, *run)))
            runs.append(run)
    return runs


class EngineAdapter:
    """``impl.LLMEngine``: its model samples, so the oracle is not used."""

    name = "kvsched"
    semantics = "kvsched"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        return self.engine.abort_request(request_id)

    def step(self, next_token: TokenOracle) -> StepPlan:
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def observe(self) -> Observation:
        return Observation(state=self.engine.observe(), blocks=_blocks(self.engine.scheduler))
