"""Helpers shared by the CLI tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


Invoke = Callable[..., Outcome]
WriteWorkload = Callable[[Iterable[dict[str, object]]], Path]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_json(invoke: Invoke, *argv: str) -> dict[str, object]:
    """``kvsched run ARGV --json --device cpu``, which must succeed; the document."""
    result = invoke("run", *argv, "--json", "--device", "cpu")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert isinstance(doc, dict)
    return doc


def requests_of(doc: dict[str, object]) -> list[dict[str, object]]:
    requests = doc["requests"]
    assert isinstance(requests, list)
    return requests


def metrics_of(doc: dict[str, object]) -> dict[str, object]:
    metrics = doc["metrics"]
    assert isinstance(metrics, dict)
    return metrics
