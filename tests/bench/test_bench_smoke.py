"""Every benchmark script runs with ``--quick`` on the CPU and prints its table.

Nothing here asserts a timing: the figures are for people (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bench import throughput
from bench.run_all import SCRIPTS, Main


@pytest.fixture(autouse=True)
def _keep_torch_threads() -> Iterator[None]:
    """The scripts set torch's thread count (``--threads``); give the worker its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


#: What each script's quick run prints (``throughput`` has its own test below, since it
#: needs transformers).
EXPECTED = {
    "scheduler_overhead": "nano-vllm us",
    "seed_workload": "seed tutorial",
    "kv_utilization": "block util",
    "preemption_cost": "recompute",
    "profile_step": "Scheduler.step",
    "prefix_caching": "outputs equal",
    "speculative": "outputs equal",
    "queue_scaling": "memory per waiting request",
    "startup": "kvsched --version",
    "async_overlap": "outputs vs sync",
}
QUICK: list[tuple[Main, str]] = [
    (main, EXPECTED[name]) for name, main, _, _ in SCRIPTS if name in EXPECTED
]


def test_every_script_of_run_all_is_smoke_tested() -> None:
    assert {name for name, *_ in SCRIPTS} == {*EXPECTED, "throughput"}


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


def test_scheduler_overhead_runs_past_255_requests(capsys: pytest.CaptureFixture[str]) -> None:
    """At 256 running the first block of every prompt is still its own: nano-vllm's cache
    never hits a whole prompt (its N12, which once ended this run), so every size the
    script advertises runs. Two steps of one round, nano-vllm only: a smoke test."""
    from bench import scheduler_overhead  # noqa: PLC0415

    prompts = {tuple(scheduler_overhead.prompt(i)[:16]) for i in range(65_025)}
    assert len(prompts) == 65_025
    argv = ["--device", "cpu", "--sizes", "256", "--steps", "2", "--repeats", "1"]
    assert scheduler_overhead.main([*argv, "--spec-steps", "1", "--peers", "nano-vllm"]) == 0
    assert "| 256 " in capsys.readouterr().out
