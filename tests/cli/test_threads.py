"""torch's intra-op threads: chosen from the model by default, ``--threads`` / ``threads=``
to choose, ``OMP_NUM_THREADS`` kept (docs/cli.md, "Threads")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import impl.engine
from impl import LLMEngine
from impl.engine import available_cpus, default_num_threads
from model import build_tiny_model
from spec.types import ConfigError, SchedulerConfig
from tests.cli.helpers import Invoke

CONFIG = SchedulerConfig(num_gpu_blocks=8, block_size=4)
CPUS = available_cpus()
needs_two_cpus = pytest.mark.skipif(CPUS < 2, reason="one CPU: every choice is 1 thread")


@pytest.fixture
def no_omp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@needs_two_cpus
@pytest.mark.usefixtures("no_omp")
def test_tiny_model_gets_one_thread() -> None:
    torch.set_num_threads(2)
    engine = LLMEngine(CONFIG)
    assert engine.num_threads == 1
    assert torch.get_num_threads() == 1


@needs_two_cpus
@pytest.mark.usefixtures("no_omp")
def test_large_cpu_model_gets_the_idle_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_tiny_model(seed=0)
    size = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(impl.engine, "SMALL_MODEL_PARAMETERS", size)  # as if it were large
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))  # an idle machine
    assert default_num_threads(model) == CPUS
    assert LLMEngine(CONFIG, model=model).num_threads == CPUS
    monkeypatch.setattr(os, "getloadavg", lambda: (CPUS - 0.8, 0.0, 0.0))  # one CPU idle
    assert default_num_threads(model) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * CPUS, 0.0, 0.0))  # overloaded
    assert default_num_threads(model) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.0, 0.0))
    monkeypatch.setattr(impl.engine, "SMALL_MODEL_PARAMETERS", size + 1)  # small again
    assert default_num_threads(model) == 1


@needs_two_cpus
def test_omp_num_threads_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert LLMEngine(CONFIG).num_threads == 2
    assert torch.get_num_threads() == 2
    assert LLMEngine(CONFIG, threads=1).num_threads == 1  # asking outright still wins


@pytest.mark.parametrize("threads", [0, -1, CPUS + 1, True, 1.0])
def test_bad_thread_count(threads: object) -> None:
    with pytest.raises(ConfigError, match="threads must be None or an int in 1"):
        LLMEngine(CONFIG, threads=threads)  # type: ignore[arg-type]


@needs_two_cpus
@pytest.mark.usefixtures("no_omp")
@pytest.mark.parametrize(("option", "expected"), [((), 1), (("--threads", "2"), 2)])
def test_cli_threads(
    invoke: Invoke, tmp_path: Path, option: tuple[str, ...], expected: int
) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "prompt": [1, 2], "max_tokens": 2}) + "\n")
    commands = [("run", str(workload), "-q"), ("conform", str(workload))]
    if not option:  # the demo at two threads takes seconds: the point of the default
        commands.append(("demo",))
    for argv in commands:
        torch.set_num_threads(1 if expected == 2 else 2)  # the opposite of what is expected
        assert invoke(*argv, *option).code == 0
        assert torch.get_num_threads() == expected, argv
