"""Ours through the scheduler-under-test protocol: ``impl.Scheduler`` and ``impl.LLMEngine``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from impl.engine import LLMEngine
from impl.scheduler import Scheduler
from impl.scheduler_output import SchedulerOutput
from kvsched.peers.protocol import Observation
from spec.oracle import TokenOracle
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, StepPlan


def _blocks(scheduler: Scheduler) -> dict[str, int]:
    return {rid: len(seq.block_table) for rid, seq in scheduler.requests.items()}


class SchedulerAdapter:
    """``impl.Scheduler`` without a model: the driver's oracle samples, or ``forward``
    (a stand-in for the model, reading the KV through the block tables) does."""

    name = "kvsched"
    semantics = "kvsched"

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        vocab_size: int | None = None,
        forward: Callable[[SchedulerOutput], Sequence[int]] | None = None,
    ) -> None:
        self.scheduler = Scheduler(config, vocab_size=vocab_size)
        self.forward = forward

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        return self.scheduler.abort_request(request_id)

    def step(self, next_token: TokenOracle) -> StepPlan:
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
