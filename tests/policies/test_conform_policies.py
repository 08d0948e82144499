"""``kvsched conform`` agrees for every registered policy on a preempting workload."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import impl
from kvsched.cli import main
from tests.policies import workloads

MODES = ["recompute", "restart", "swap"]


@pytest.fixture(scope="module")
def workload_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("policies") / "preempting.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in workloads.jsonl_lines()))
    return path


@pytest.mark.parametrize("policy", sorted(impl.POLICIES))
@pytest.mark.parametrize("mode", MODES)
def test_conform_agrees_and_preempts(
    workload_file: Path, policy: str, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "conform", str(workload_file), "--device", "cpu", *workloads.cli_options(),
        "--preemption-mode", mode, "--policy", policy,
    ]  # fmt: skip
    code = main(argv)
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), out
    assert out.startswith("conform: ok: spec and engine agree at all "), out
    assert f"({len(workloads.REQUESTS)} requests, 0 rejected, " in out
    found = re.search(r" (\d+) preemptions?; ", out)
    assert found is not None and int(found.group(1)) > 0, out
    assert f"policy {policy}, {mode} mode" in out
