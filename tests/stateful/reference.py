"""The reference model: the spec's pure functions behind the engine's verbs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import spec
from spec.types import (
    FinishedRequest,
    SamplingParams,
    SchedulerConfig,
    SchedulerState,
    StepPlan,
    TokenOutOfVocabError,
)


class SpecModel:
    """The spec behind the engine's verbs: add, abort, observe, and a step in two halves.

    ``schedule()`` decides (phases A-C) without changing anything; ``commit`` applies
    the sampled tokens (phase D) and only then advances the state, so a step whose
    real counterpart failed is simply never committed. R4's vocabulary check (the
    engine's, check 3) is done here with the machine's vocabulary.
    """

    def __init__(self, config: SchedulerConfig, vocab_size: int) -> None:
        self.state = spec.init_state(config)
        self.vocab_size = vocab_size

    def add_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> None:
        if (
            len(prompt) >= 1
            and params.max_tokens >= 1
            and any(not 0 <= token < self.vocab_size for token in prompt)
        ):
            raise TokenOutOfVocabError(f"request {request_id!r}: a token is outside the vocab")
        self.state = spec.add_request(self.state, request_id, prompt, params)

    def abort_request(self, request_id: str) -> FinishedRequest:
        self.state, finished = spec.abort_request(self.state, request_id)
        return finished

    def observe(self) -> SchedulerState:
        return self.state

    def schedule(self) -> tuple[SchedulerState, StepPlan]:
        return spec.schedule(self.state)

    def commit(self, mid: SchedulerState, draft: StepPlan, tokens: Mapping[str, int]) -> StepPlan:
        self.state, plan = spec.complete_step(mid, draft, tokens)
        return plan
