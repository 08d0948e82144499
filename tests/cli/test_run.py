"""``kvsched run``: the JSON document, rejected requests, EOS, --reference and --plot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvsched import report
from tests.cli.helpers import (
    PNG_MAGIC,
    Invoke,
    WriteWorkload,
    metrics_of,
    requests_of,
    run_json,
)

# 24 token slots for requests of up to 19 tokens each: preemption is certain.
SMALL = ["--num-gpu-blocks", "6", "--block-size", "4"]


def _preempting_workload() -> list[dict[str, object]]:
    return [
        {
            "id": f"r{i}",
            "prompt": [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)],
            "max_tokens": 8 + i % 5,
            "ignore_eos": True,
            "arrival_step": i // 3,
        }
        for i in range(6)
    ]


def documented_keys(name: str) -> set[str]:
    """The keys kvsched/report.py's documentation of the document lists under ``name``
    (the keys of a nested object, such as ``metrics.prefix_cache``, left out)."""
    assert report.__doc__ is not None
    found = re.search(rf'"{name}": \[?\{{([^{{}}]*)', report.__doc__)
    assert found is not None, name
    return set(re.findall(r'"(\w+)"(?!:)', found.group(1)))


def _outputs(doc: dict[str, object]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for r in requests_of(doc):
        output = r["output"]
        assert isinstance(output, list)
        outputs[str(r["id"])] = output
    return outputs


def test_document_shape_and_preemption(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload(_preempting_workload())
    doc = run_json(invoke, str(path), *SMALL)
    assert set(doc) == {"requests", "metrics", "interrupted"}
    assert doc["interrupted"] is None
    requests = requests_of(doc)
    assert [r["id"] for r in requests] == [f"r{i}" for i in range(6)]
    for number, (r, line) in enumerate(zip(requests, _preempting_workload(), strict=True), 1):
        assert set(r) == documented_keys("requests")
        assert r["line"] == number
        assert r["finish_reason"] == "length"
        assert r["state"] == "finished"
        assert r["error"] is None
        output = r["output"]
        assert isinstance(output, list)
        assert len(output) == line["max_tokens"]
        assert all(isinstance(t, int) and 0 <= t < 256 for t in output)
    metrics = metrics_of(doc)
    assert set(metrics) == documented_keys("metrics")
    assert metrics["num_gpu_blocks"] == 6
    assert metrics["peak_gpu_blocks_used"] == 6
    preemptions = metrics["preemptions"]
    assert isinstance(preemptions, int)
    assert preemptions > 0
    assert preemptions == sum(int(str(r["num_preemptions"])) for r in requests)
    assert isinstance(metrics["recomputed_tokens"], int)
    assert metrics["recomputed_tokens"] > 0
    assert 0 < float(str(metrics["kv_utilization"])) <= 1


@pytest.mark.parametrize("mode", ["recompute", "restart", "swap"])
def test_preempting_run_equals_reference(
    invoke: Invoke, write_workload: WriteWorkload, mode: str
) -> None:
    path = write_workload(_preempting_workload())
    reference = run_json(invoke, str(path), "--reference")
    assert metrics_of(reference)["preemptions"] == 0
    options = [*SMALL, "--preemption-mode", mode, "--num-cpu-blocks", "4"]
    doc = run_json(invoke, str(path), *options)
    assert _outputs(doc) == _outputs(reference)
    if mode == "swap":
        assert metrics_of(doc)["swap_out_blocks"] != 0


def test_reference_equals_a_huge_cache(
    invoke: Invoke, write_workload: WriteWorkload, tmp_path: Path
) -> None:
    out = tmp_path / "gen.jsonl"
    generated = invoke(
        "workload", "--num-requests", "10", "--seed", "3", "--arrival-spread", "5",
        "--prompt-len", "2:12", "--max-tokens", "longtail:1:20", "-o", str(out),
    )  # fmt: skip
    assert generated.code == 0
    reference = run_json(invoke, str(out), "--reference")
    huge = run_json(invoke, str(out), "--num-gpu-blocks", "4096")
    assert requests_of(reference) == requests_of(huge)
    assert metrics_of(huge)["preemptions"] == 0


def test_rejected_requests_and_eos(invoke: Invoke, write_workload: WriteWorkload) -> None:
    probe = write_workload([{"id": "p", "prompt": [3, 1, 4, 1, 5], "max_tokens": 12}])
    solo = requests_of(run_json(invoke, str(probe), "--reference"))[0]["output"]
    assert isinstance(solo, list)
    # The first output that did not appear before it: EOS stops generation right there.
    k = next(i for i in range(1, len(solo)) if solo[i] not in solo[:i])
    eos = solo[k]
    lines: list[dict[str, object]] = [
        {"id": "eos", "prompt": [3, 1, 4, 1, 5], "max_tokens": 12, "eos_token_id": eos},
        {"id": "ignored", "prompt": [3, 1, 4, 1, 5], "max_tokens": 12, "eos_token_id": eos,
         "ignore_eos": True},
        {"id": "empty", "prompt": [], "max_tokens": 3},
        {"id": "oov", "prompt": [1, 999], "max_tokens": 3},
        {"id": "zero", "prompt": [1, 2], "max_tokens": 0},
        {"id": "eos", "prompt": [9, 9], "max_tokens": 2},  # "eos" is live: duplicate
        {"id": "huge", "prompt": [1, 2, 3], "max_tokens": 10_000},
        {"id": "eos", "prompt": [3, 1, 4, 1, 5], "max_tokens": 3, "arrival_step": 40},
    ]  # fmt: skip
    doc = run_json(invoke, str(write_workload(lines)), *SMALL)
    requests = requests_of(doc)
    assert [r["id"] for r in requests] == [line["id"] for line in lines]
    by_position = dict(enumerate(requests))
    assert by_position[0]["finish_reason"] == "stop"
    assert by_position[0]["output"] == solo[: k + 1]
    assert by_position[1]["finish_reason"] == "length"
    assert by_position[1]["output"] == solo
    for i, fragment in [(2, "empty"), (3, "999"), (4, "max_tokens"), (5, "eos"), (6, "huge")]:
        r = by_position[i]
        assert r["finish_reason"] == "rejected"
        assert r["output"] == []
        assert isinstance(r["error"], str)
        assert fragment in r["error"]
    assert by_position[7]["finish_reason"] == "length"  # the id is free again by step 40
    assert by_position[7]["output"] == solo[:3]
    assert all(r["error"] is None for r in requests if r["finish_reason"] != "rejected")


def test_human_summary_and_no_progress_off_a_tty(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    lines = [*_preempting_workload(), {"id": "empty", "prompt": [], "max_tokens": 1}]
    result = invoke("run", str(write_workload(lines)), *SMALL, "--device", "cpu")
    assert result.code == 0
    assert result.err == ""  # stderr is not a terminal: no progress bar
    assert result.out.startswith("run: 7 requests, 6 finished (6 length), 1 rejected, in ")
    assert "preemptions: " in result.out
    assert "peak 6 of 6 GPU blocks" in result.out
    assert "  empty (line 7): EmptyPromptError: " in result.out


def test_plot_writes_png(invoke: Invoke, write_workload: WriteWorkload, tmp_path: Path) -> None:
    png = tmp_path / "kv.png"
    path = write_workload(_preempting_workload())
    result = invoke("run", str(path), *SMALL, "--quiet", "--device", "cpu", "--plot", str(png))
    assert result.code == 0, result.err
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_empty_workload(invoke: Invoke, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    doc = run_json(invoke, str(path))
    assert requests_of(doc) == []
    assert metrics_of(doc)["steps"] == 0


def test_local_hf_checkpoint(invoke: Invoke, write_workload: WriteWorkload, tmp_path: Path) -> None:
    """``--model DIR``: a tiny Llama saved by transformers runs, and conforms."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    checkpoint = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(checkpoint))
    lines = [
        {"id": f"r{i}", "prompt": [(5 * i + j) % 64 for j in range(4 + i)], "max_tokens": 6}
        for i in range(4)
    ]
    lines.append({"id": "oov", "prompt": [1, 64], "max_tokens": 2})
    path = write_workload(lines)
    options = ["--model", str(checkpoint), *SMALL]
    doc = run_json(invoke, str(path), *options)
    requests = requests_of(doc)
    assert [r["finish_reason"] for r in requests] == ["length"] * 4 + ["rejected"]
    outputs = _outputs(doc)
    assert all(0 <= t < 64 for output in outputs.values() for t in output)
    reference = run_json(invoke, str(path), "--model", str(checkpoint), "--reference")
    assert outputs == _outputs(reference)
    result = invoke("conform", str(path), *options, "--device", "cpu")
    assert result.code == 0, result.out
