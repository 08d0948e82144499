"""Bad input to the command line: exit 2, one line on stderr naming the culprit, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from impl.engine import LLMEngine
from spec.types import SampledTokensError, StepPlan
from tests.cli.helpers import Invoke, Outcome, WriteWorkload

GOOD = {"id": "a", "prompt": [1, 2, 3], "max_tokens": 2}


def _assert_one_line(result: Outcome, *fragments: str) -> None:
    assert result.code == 2, (result.out, result.err)
    assert result.out == ""
    assert "Traceback" not in result.err
    assert result.err.endswith("\n")
    assert result.err.count("\n") == 1, result.err
    for fragment in fragments:
        assert fragment in result.err, result.err


@pytest.mark.parametrize("command", ["run", "conform"])
def test_missing_file(invoke: Invoke, tmp_path: Path, command: str) -> None:
    missing = tmp_path / "missing.jsonl"
    result = invoke(command, str(missing))
    _assert_one_line(result, f"kvsched: {missing}: No such file or directory")


def test_workload_is_a_directory(invoke: Invoke, tmp_path: Path) -> None:
    _assert_one_line(invoke("run", str(tmp_path)), f"kvsched: {tmp_path}: Is a directory")


def _line(**edit: object) -> str:
    return json.dumps({**GOOD, "id": "c", **edit})


@pytest.mark.parametrize(
    ("third_line", "expected"),
    [
        ("{not json", ":3: not valid JSON"),
        ('"just a string"', ":3: expected a JSON object, got str"),
        (json.dumps({"id": "c", "prompt": [1]}), ":3: field 'max_tokens': missing required field"),
        (_line(colour=1), ":3: field 'colour': unknown field"),
        (_line(max_tokens="4"), ":3: field 'max_tokens': expected int, got str"),
        (_line(max_tokens=True), ":3: field 'max_tokens': expected int, got bool"),
        (_line(prompt=[1, True]), ":3: field 'prompt': item 1: expected int, got bool"),
        (_line(arrival_step=-2), ":3: field 'arrival_step'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "conform"])
def test_bad_workload_line(
    invoke: Invoke, tmp_path: Path, command: str, third_line: str, expected: str
) -> None:
    path = tmp_path / "workload.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "b"}) + "\n" + third_line)
    _assert_one_line(invoke(command, str(path)), f"kvsched: {path}{expected}")


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--num-gpu-blocks", "0"], "argument --num-gpu-blocks: must be a positive integer"),
        (["--num-gpu-blocks", "-3"], "argument --num-gpu-blocks: must be a positive integer"),
        (["--block-size", "zero"], "argument --block-size: expected an integer, got 'zero'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens"),
        (["--num-cpu-blocks", "-1"], "argument --num-cpu-blocks: must be a non-negative integer"),
        (["--policy", "fifo"], "argument --policy: invalid choice: 'fifo'"),
        (["--preemption-mode", "drop"], "argument --preemption-mode: invalid choice: 'drop'"),
        (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "conform"])
def test_bad_engine_option(
    invoke: Invoke,
    write_workload: WriteWorkload,
    command: str,
    options: list[str],
    expected: str,
) -> None:
    path = write_workload([GOOD])
    _assert_one_line(invoke(command, str(path), *options), f"kvsched {command}: error: {expected}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload([GOOD])
    _assert_one_line(invoke("run", str(path), "--device", "cuda"), "--device", "CUDA")


def _bad_checkpoints(root: Path) -> dict[str, Path]:
    empty = root / "empty"
    empty.mkdir()
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("{this is not json")
    not_llama = root / "not-llama"
    not_llama.mkdir()
    (not_llama / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 32,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
            }
        )
    )
    bad_weights = root / "bad-weights"
    bad_weights.mkdir()
    (bad_weights / "config.json").write_text((no_weights / "config.json").read_text())
    (bad_weights / "model.safetensors").write_bytes(b"\x00" * 7)
    return {
        "missing": root / "nowhere",
        "empty": empty,
        "garbage": garbage,
        "not-llama": not_llama,
        "no-weights": no_weights,
        "bad-weights": bad_weights,
    }


@pytest.mark.parametrize(
    "which", ["missing", "empty", "garbage", "not-llama", "no-weights", "bad-weights"]
)
def test_checkpoint_that_does_not_load(
    invoke: Invoke, write_workload: WriteWorkload, tmp_path: Path, which: str
) -> None:
    checkpoint = _bad_checkpoints(tmp_path)[which]
    path = write_workload([GOOD])
    result = invoke("run", str(path), "--model", str(checkpoint), "--device", "cpu")
    _assert_one_line(result, f"kvsched: --model {checkpoint}: ")


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--prompt-len", "9:2"], "argument --prompt-len: '9:2': MIN 9 is greater than MAX 2"),
        (["--prompt-len", "0:4"], "argument --prompt-len: '0:4': values must be >= 1"),
        (["--max-tokens", "longtail:5"], "argument --max-tokens: 'longtail:5': expected"),
        (["--num-requests", "-1"], "argument --num-requests: must be a non-negative integer"),
        (["--vocab-size", "1"], "argument --vocab-size: must be an integer >= 2"),
        (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    ],
)
def test_bad_generator_option(invoke: Invoke, options: list[str], expected: str) -> None:
    _assert_one_line(invoke("workload", *options), f"kvsched workload: error: {expected}")


def test_generator_output_in_missing_directory(invoke: Invoke, tmp_path: Path) -> None:
    out = tmp_path / "no" / "w.jsonl"
    _assert_one_line(invoke("workload", "-o", str(out)), f"kvsched: {out}: No such file")


def test_plot_into_missing_directory(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload([GOOD])
    result = invoke("run", str(path), "--plot", "/nonexistent-dir/kv.png")
    _assert_one_line(result, "--plot /nonexistent-dir/kv.png: directory /nonexistent-dir")


def test_unknown_option(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload([GOOD])
    result = invoke("run", str(path), "--bogus")
    _assert_one_line(result, "kvsched: error: unrecognized arguments: --bogus")


def test_no_command(invoke: Invoke) -> None:
    _assert_one_line(invoke(), "kvsched: error: the following arguments are required: COMMAND")


def test_plot_with_reference(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload([GOOD])
    result = invoke("run", str(path), "--reference", "--plot", "kv.png")
    _assert_one_line(result, "kvsched: --plot draws a shared run's timeline; not with --reference")


def test_engine_failure_on_good_input_is_exit_1(
    invoke: Invoke, write_workload: WriteWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A typed error from the engine on valid input is its bug: one line, exit 1, not 2."""

    def broken_step(self: LLMEngine) -> StepPlan:
        raise SampledTokensError("step 0: 1 request samples, got 0 tokens")

    monkeypatch.setattr(LLMEngine, "step", broken_step)
    result = invoke("run", str(write_workload([GOOD])), "--device", "cpu")
    assert result.code == 1
    assert (
        result.err
        == "kvsched: error: SampledTokensError: step 0: 1 request samples, got 0 tokens\n"
    )


def test_engine_that_never_drains(
    invoke: Invoke, write_workload: WriteWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(LLMEngine, "step", lambda self: StepPlan(step=0))
    result = invoke("run", str(write_workload([GOOD])), "--device", "cpu")
    assert result.code == 1
    assert result.err.startswith("kvsched: error: DrainError: the engine did not drain")
    assert result.err.count("\n") == 1
