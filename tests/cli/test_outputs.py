"""The JSON document, the human summary and the plot, on a hand-made result."""

from __future__ import annotations

import json
from pathlib import Path

from kvsched.plot import plot_timeline
from kvsched.report import METRIC_KEYS, dumps, to_document
from kvsched.results import RequestOutcome, RunMetrics, RunResult, StepSample
from kvsched.summary import render_summary
from tests.cli.helpers import PNG_MAGIC


def _result() -> RunResult:
    return RunResult(
        outcomes=(
            RequestOutcome(request_id="a", output=(5, 1), finish_reason="stop"),
            RequestOutcome(request_id="b", error="request 'b' has an empty prompt"),
            RequestOutcome(
                request_id="c", output=(2, 3, 4), finish_reason="length", num_preemptions=2
            ),
        ),
        metrics=RunMetrics(
            steps=3,
            preemptions=2,
            swap_out_blocks=0,
            swap_in_blocks=0,
            recomputed_tokens=7,
            peak_gpu_blocks_used=4,
            num_gpu_blocks=4,
            kv_utilization=0.75,
            tokens_per_s=123.0,
            preemptions_by_mode={"recompute": 2},
        ),
        timeline=tuple(
            StepSample(
                step=i,
                gpu_blocks_used=u,
                num_running=r,
                num_waiting=w,
                num_swapped=0,
                num_preempted=p,
            )
            for i, (u, r, w, p) in enumerate([(2, 2, 1, 0), (4, 1, 1, 2), (0, 0, 0, 0)])
        ),
    )


def test_document_shape() -> None:
    doc = to_document(_result())
    assert set(doc) == {"requests", "metrics", "interrupted"}
    assert doc["interrupted"] is None
    assert doc["requests"] == [
        {
            "id": "a",
            "line": None,
            "state": "finished",
            "output": [5, 1],
            "finish_reason": "stop",
            "num_preemptions": 0,
            "error": None,
        },
        {
            "id": "b",
            "line": None,
            "state": "rejected",
            "output": [],
            "finish_reason": "rejected",
            "num_preemptions": 0,
            "error": "request 'b' has an empty prompt",
        },
        {
            "id": "c",
            "line": None,
            "state": "finished",
            "output": [2, 3, 4],
            "finish_reason": "length",
            "num_preemptions": 2,
            "error": None,
        },
    ]
    metrics = doc["metrics"]
    assert isinstance(metrics, dict)
    assert list(metrics) == list(METRIC_KEYS)
    assert metrics["preemptions_by_mode"] == {"recompute": 2, "restart": 0, "swap": 0}
    text = dumps(_result())
    assert json.loads(text) == doc
    assert text.count("\n") == 8  # one line per request
    empty = RunResult(outcomes=(), metrics=_result().metrics)
    assert json.loads(dumps(empty)) == to_document(empty)


def test_summary() -> None:
    text = render_summary(_result())
    assert "3 requests, 2 finished (1 length, 1 stop), 1 rejected, in 3 steps" in text
    assert "preemptions: 2 (recompute 2)" in text
    assert "peak 4 of 4 GPU blocks" in text
    assert "  b: request 'b' has an empty prompt" in text


def test_plot_writes_png(tmp_path: Path) -> None:
    out = tmp_path / "kv.png"
    with out.open("wb") as f:
        plot_timeline(_result(), f, file_format="png")
    assert out.read_bytes()[:8] == PNG_MAGIC
