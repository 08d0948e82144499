"""Every benchmark script runs with ``--quick`` on the CPU and prints its table.

Nothing here asserts a timing: the figures are for people (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from bench import (
    kv_utilization,
    preemption_cost,
    prefix_caching,
    profile_step,
    scheduler_overhead,
    seed_workload,
    throughput,
)

Main = Callable[[Sequence[str] | None], int]


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The scripts set torch's thread count (``--threads``); give the worker its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


QUICK: list[tuple[Main, str]] = [
    (scheduler_overhead.main, "nano-vllm us"),
    (seed_workload.main, "seed tutorial"),
    (kv_utilization.main, "block util"),
    (preemption_cost.main, "recompute"),
    (profile_step.main, "Scheduler.step"),
    (prefix_caching.main, "outputs equal"),
]


@pytest.mark.parametrize(("main", "expected"), QUICK, ids=lambda v: getattr(v, "__module__", v))
def test_quick_run_prints_its_table(
    main: Main, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--quick", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "command: python -m bench." in printed
    assert expected in printed
    assert "| " in printed  # a table


def test_throughput_quick_run_against_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert throughput.main(["--quick", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "HF generate_batch" in printed
    assert "kvsched (batch-invariant)" in printed
