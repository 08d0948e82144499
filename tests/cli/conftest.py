"""Fixtures of the CLI tests: call ``main`` in-process, write workload files."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from kvsched.cli import main
from tests.cli.helpers import Invoke, Outcome, WriteWorkload


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model runs fastest on one thread; two xdist workers on two cores each
    spinning up several torch threads slow each other down several times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def invoke(capsys: pytest.CaptureFixture[str]) -> Invoke:
    """``invoke("run", "w.jsonl", "--json")``: exit code, stdout and stderr."""

    def run(*argv: str) -> Outcome:
        code = main(list(argv))
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err)

    return run


@pytest.fixture
def write_workload(tmp_path: Path) -> WriteWorkload:
    """Write JSON objects as a workload file in ``tmp_path``; its path."""
    counter = itertools.count()

    def write(lines: Iterable[dict[str, object]]) -> Path:
        path = tmp_path / f"w{next(counter)}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path

    return write
