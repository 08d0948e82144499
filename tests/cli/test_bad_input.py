"""Checkpoints that do not load (exit 2) and typed engine failures on good input (exit 1).

The rest of the bad-input campaign is the table of test_bad_input_table.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
