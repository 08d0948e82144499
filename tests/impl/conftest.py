"""Fixtures for the engine tests: one tiny float64 model per worker, and solo runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from impl import LLMEngine
from model import LlamaForCausalLM, build_tiny_model
from spec.types import SamplingParams, SchedulerConfig

SoloFn = Callable[[Sequence[int], SamplingParams], tuple[int, ...]]


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """The tiny model is far faster on one thread (2 threads on 2 shared cores spin)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model64() -> LlamaForCausalLM:
    """The tiny Llama in float64: batch-invariant to the bit, so outputs compare with ==."""
    return build_tiny_model(seed=0, dtype=torch.float64, device="cpu")


@pytest.fixture(scope="session")
def solo(model64: LlamaForCausalLM) -> SoloFn:
    """Outputs of one request run alone in a roomy engine (memoised per worker)."""
    cache: dict[tuple[tuple[int, ...], SamplingParams], tuple[int, ...]] = {}

    def run(prompt: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        key = (tuple(prompt), params)
        if key not in cache:
            engine = LLMEngine(SchedulerConfig(num_gpu_blocks=128, block_size=4), model=model64)
            (result,) = engine.generate([("solo", list(prompt), params)])
            assert result.num_preemptions == 0
            cache[key] = result.output_token_ids
        return cache[key]

    return run
