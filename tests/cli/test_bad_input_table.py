# ruff: noqa: E501  (the case tables read best one case a line)
"""The bad-input table of docs/cli.md, case by case, through ``kvsched.cli:main``.

Every case is answered in one of three ways, never by a traceback or a hang:

- ``Exit2``: one line on stderr naming the culprit, exit 2, nothing on stdout, and
  nothing done (no output file written);
- ``Rejected``: the run goes on; the request's ``--json`` entry is ``rejected`` with
  its error, and the good request ``a`` beside it is served;
- ``Served``: not an error (a blank line, a BOM ...): every request is served.

The case names are the first column of docs/cli.md's table; a test checks that the
two lists are the same, so the table cannot drift from what is tested.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

import pytest
import torch

import kvsched.cli
import kvsched.commands
import kvsched.model_setup
from impl.engine import available_cpus
from kvsched.workload import MAX_ARRIVAL_STEP, MAX_LINE_BYTES, dump_workload
from tests.cli.helpers import PNG_MAGIC, Invoke, Outcome, requests_of

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"id": "a", "prompt": [1, 2, 3], "max_tokens": 2}


@dataclass(frozen=True)
class Exit2:
    fragment: str


@dataclass(frozen=True)
class Rejected:
    fragment: str


@dataclass(frozen=True)
class Served:
    warning: str | None = None


Answer = Exit2 | Rejected | Served


def line(**edit: object) -> bytes:
    """A request ``c`` that is GOOD but for ``edit`` (a value ``...`` drops the field)."""
    obj = {**GOOD, "id": "c", **edit}
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def raw(text: str) -> bytes:
    return text.encode()


# --- the workload file: (case, bytes of the line after GOOD's, answer) -------------------

HUGE = 10**30
FILE_CASES: list[tuple[str, bytes, Answer]] = [
    ("line-not-json", raw("{not json"), Exit2(":2: not valid JSON")),
    ("line-not-object", raw("[1, 2]"), Exit2(":2: expected a JSON object, got list")),
    ("line-nested-too-deep", raw("[" * 100_000), Exit2(":2: not valid JSON: nested too deeply")),
    ("line-not-utf8", b'{"id": "c\xff"}', Exit2(":2: not UTF-8 text")),
    ("literal-nan", raw('{"id": "c", "prompt": [1], "max_tokens": NaN}'), Exit2("NaN is not")),
    ("literal-infinity", raw('{"id": "c", "prompt": [1], "max_tokens": Infinity}'), Exit2("Inf")),
    ("field-twice", raw('{"id": "c", "id": "d", "prompt": [1], "max_tokens": 2}'), Exit2("'id' given twice")),
    ("unknown-field", line(colour="red"), Exit2(":2: field 'colour': unknown field")),
    ("id-missing", line(id=...), Exit2(":2: field 'id': missing required field")),
    ("id-int", line(id=7), Exit2(":2: field 'id': expected str, got int")),
    ("id-null", line(id=None), Exit2(":2: field 'id': expected str, got null")),
    ("id-empty", line(id=""), Served()),
    ("id-terminal-escapes", line(id="\x1b]0;owned\x07\x1b[31mred"), Served()),
    ("id-newline", line(id="c\nd"), Served()),
    ("id-nul", line(id="c\x00"), Served()),
    ("id-lone-surrogate", line(id="\ud800"), Served()),
    ("id-bidi-override", line(id="\u202ecba"), Served()),
    ("field-name-escapes", raw('{"id": "c", "prompt": [1], "max_tokens": 2, "\\u001b[31m": 1}'), Exit2(":2: field '\\x1b[31m': unknown field")),
    ("id-duplicate-live", line(id="a"), Rejected("DuplicateRequestError: request 'a' is already live (line 1)")),
    ("prompt-missing", line(prompt=...), Exit2(":2: field 'prompt': missing required field")),
    ("prompt-string", line(prompt="1 2 3"), Exit2(":2: field 'prompt': expected list of int, got str")),
    ("prompt-float-token", line(prompt=[1, 2.5]), Exit2(":2: field 'prompt': item 1: expected int, got float")),
    ("prompt-bool-token", line(prompt=[True]), Exit2(":2: field 'prompt': item 0: expected int, got bool")),
    ("prompt-empty", line(prompt=[]), Rejected("EmptyPromptError")),
    ("prompt-negative-token", line(prompt=[1, -1]), Rejected("TokenOutOfVocabError")),
    ("prompt-token-past-vocab", line(prompt=[256]), Rejected("TokenOutOfVocabError")),
    ("prompt-huge-token", line(prompt=[HUGE]), Rejected("TokenOutOfVocabError")),
    ("prompt-longer-than-cache", line(prompt=[1] * 1100), Rejected("RequestTooLargeError")),
    ("max-tokens-missing", line(max_tokens=...), Exit2(":2: field 'max_tokens': missing required field")),
    ("max-tokens-string", line(max_tokens="4"), Exit2(":2: field 'max_tokens': expected int, got str")),
    ("max-tokens-bool", line(max_tokens=True), Exit2(":2: field 'max_tokens': expected int, got bool")),
    ("max-tokens-float", line(max_tokens=2.0), Exit2(":2: field 'max_tokens': expected int, got float")),
    ("max-tokens-zero", line(max_tokens=0), Rejected("InvalidMaxTokensError")),
    ("max-tokens-negative", line(max_tokens=-5), Rejected("InvalidMaxTokensError")),
    ("max-tokens-huge", line(max_tokens=HUGE), Rejected("RequestTooLargeError")),
    ("eos-string", line(eos_token_id="2"), Exit2(":2: field 'eos_token_id': expected int or null, got str")),
    ("eos-negative", line(eos_token_id=-4), Served()),
    ("eos-past-vocab", line(eos_token_id=HUGE), Served()),
    ("ignore-eos-int", line(ignore_eos=1), Exit2(":2: field 'ignore_eos': expected bool, got int")),
    ("priority-float", line(priority=0.5), Exit2(":2: field 'priority': expected int, got float")),
    ("priority-huge", line(priority=-HUGE), Served()),
    ("temperature-negative", line(temperature=-1), Rejected("InvalidSamplingParamsError")),
    ("temperature-string", line(temperature="hot"), Exit2(":2: field 'temperature': expected float, got str")),
    ("temperature-overflow", raw('{"id": "c", "prompt": [1], "max_tokens": 2, "temperature": 1e999}'), Exit2(":2: field 'temperature': expected a finite float, got inf")),
    ("temperature-huge", line(temperature=1e308, seed=3), Served()),
    ("seed-float", line(seed=1.5), Exit2(":2: field 'seed': expected int or null, got float")),
    ("seed-huge", line(temperature=0.7, seed=HUGE), Served()),
    ("seed-negative", line(temperature=0.7, seed=-HUGE), Served()),
    ("arrival-negative", line(arrival_step=-2), Exit2(f":2: field 'arrival_step': expected an int in 0..{MAX_ARRIVAL_STEP}, got -2")),
    ("arrival-far-future", line(arrival_step=10**12), Exit2(f"expected an int in 0..{MAX_ARRIVAL_STEP}")),
    ("arrival-float", line(arrival_step=1.0), Exit2(":2: field 'arrival_step': expected int, got float")),
    ("line-too-long", line(prompt=[1] * (MAX_LINE_BYTES // 3)), Exit2(f":2: line longer than {MAX_LINE_BYTES:,} bytes")),
]  # fmt: skip

# Whole files: (case, file bytes, answer).
WHOLE_FILE_CASES: list[tuple[str, bytes, Answer]] = [
    ("blank-lines", b"\n" + json.dumps(GOOD).encode() + b"\n  \n\t\n" + line() + b"\n\n", Served()),
    ("crlf", json.dumps(GOOD).encode() + b"\r\n" + line() + b"\r\n", Served()),
    ("bom", b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n" + line() + b"\n", Served()),
    ("no-final-newline", json.dumps(GOOD).encode() + b"\n" + line(), Served()),
    (
        "id-reused-after-finish",
        json.dumps(GOOD).encode() + b"\n" + line(id="a", arrival_step=20) + b"\n",
        Served(),
    ),
    ("empty-file", b"", Served()),
]  # fmt: skip


def _assert_exit2(result: Outcome, fragment: str) -> None:
    assert result.code == 2, (result.code, result.out, result.err)
    assert result.out == ""
    assert "Traceback" not in result.err
    assert result.err.count("\n") == 1 and result.err.endswith("\n"), result.err
    assert result.err.startswith("kvsched"), result.err
    assert fragment in result.err, result.err


def _run_json(invoke: Invoke, path: Path, *options: str) -> tuple[Outcome, list[dict[str, object]]]:
    result = invoke("run", str(path), "--json", "--device", "cpu", *options)
    assert result.code == 0, result.err
    assert "Traceback" not in result.err
    return result, requests_of(json.loads(result.out))


@pytest.mark.parametrize(("case", "data", "answer"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_workload_line(
    invoke: Invoke, tmp_path: Path, case: str, data: bytes, answer: Answer
) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + data + b"\n")
    if isinstance(answer, Exit2):
        for command in ("run", "conform"):
            _assert_exit2(
                invoke(command, str(path), "--device", "cpu"),
                f"{path}{answer.fragment}" if answer.fragment.startswith(":") else answer.fragment,
            )
        return
    _, requests = _run_json(invoke, path)
    assert [r["line"] for r in requests] == [1, 2]
    good, other = requests
    assert good["finish_reason"] == "length"
    if isinstance(answer, Rejected):
        assert other["finish_reason"] == "rejected"
        assert isinstance(other["error"], str)
        assert answer.fragment in other["error"], other["error"]
    else:
        assert other["finish_reason"] in ("length", "stop"), other
    # conform answers the same way: spec and engine agree on the refusal or the run.
    conform = invoke("conform", str(path), "--device", "cpu")
    assert conform.code == 0, conform.out + conform.err
    expected_rejected = 1 if isinstance(answer, Rejected) else 0
    assert f"2 requests, {expected_rejected} rejected" in conform.out


@pytest.mark.parametrize(
    ("case", "data", "answer"), WHOLE_FILE_CASES, ids=[c[0] for c in WHOLE_FILE_CASES]
)
def test_whole_file(invoke: Invoke, tmp_path: Path, case: str, data: bytes, answer: Answer) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(data)
    assert isinstance(answer, Served)
    result, requests = _run_json(invoke, path)
    assert result.err == ""
    assert all(r["finish_reason"] in ("length", "stop") for r in requests), requests
    if case == "empty-file":
        assert requests == []
    elif case == "id-reused-after-finish":  # two served entries for "a", told apart by line
        assert [(r["id"], r["line"]) for r in requests] == [("a", 1), ("a", 2)]
    else:
        assert [r["id"] for r in requests] == ["a", "c"]


def test_max_tokens_huge_in_a_reference_run(invoke: Invoke, tmp_path: Path) -> None:
    """``--reference`` sizes a cache per request: one that would not fit the memory
    free is rejected rather than allocated (case ``reference-cache-too-large``)."""
    path = tmp_path / "w.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + line(max_tokens=HUGE) + b"\n")
    _, requests = _run_json(invoke, path, "--reference")
    assert requests[0]["finish_reason"] == "length"
    assert requests[1]["finish_reason"] == "rejected"
    assert "RequestTooLargeError: alone, its whole life needs" in str(requests[1]["error"])


def test_huge_swap_pool_in_a_reference_run(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``reference-cpu-pool-huge``: alone, nothing is preempted; no pool is made."""
    path = tmp_path / "w.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n")
    options = ("--reference", "--preemption-mode", "swap", "--num-cpu-blocks", str(10**12))
    _, requests = _run_json(invoke, path, *options)
    assert requests[0]["finish_reason"] == "length"


def test_plot_that_fails_after_the_run_keeps_the_results(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case ``plot-fails-late`` (say the disk fills up while the plot is written): the
    results are printed before the plot is drawn, then one line and exit 2, and no
    file is left, neither a truncated plot nor its temporary file."""

    def disk_full(result: object, out: BinaryIO, **kwargs: object) -> None:
        out.write(PNG_MAGIC)
        out.flush()
        raise OSError(errno.ENOSPC, "No space left on device")  # a write names no file

    monkeypatch.setattr(kvsched.commands, "plot_timeline", disk_full)
    path = tmp_path / "w.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n")
    png = tmp_path / "kv.png"
    result = invoke("run", str(path), "--json", "--plot", str(png))
    assert result.code == 2
    assert requests_of(json.loads(result.out))[0]["finish_reason"] == "length"
    assert result.err == (
        f"kvsched: --plot {png}: cannot be written: No space left on device (nothing written)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.jsonl"]


def test_prompt_over_the_budget_without_chunking(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``prompt-over-budget-unchunked``: it could never be scheduled, so R4 refuses it."""
    path = tmp_path / "w.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + line(prompt=[1] * 40) + b"\n")
    options = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "32")
    _, requests = _run_json(invoke, path, *options)
    assert requests[0]["finish_reason"] == "length"
    assert requests[1]["finish_reason"] == "rejected"


# --- options: (case, argv with {w} for a good workload file and {d} for tmp_path) --------

CPUS = available_cpus()
OPTION_CASES: list[tuple[str, tuple[str, ...], str]] = [
    ("no-command", (), "usage: kvsched"),
    ("unknown-command", ("serve",), "argument COMMAND: invalid choice: 'serve'"),
    ("unknown-option", ("run", "{w}", "--bogus"), "unrecognized arguments: --bogus"),
    ("flag-with-value", ("run", "{w}", "--json=yes"), "argument --json: ignored explicit argument 'yes'"),
    ("workload-missing-argument", ("run",), "the following arguments are required: WORKLOAD.jsonl"),
    ("workload-file-missing", ("run", "{d}/missing.jsonl"), "missing.jsonl: No such file or directory"),
    ("workload-file-is-directory", ("run", "{d}"), ": Is a directory"),
    ("num-gpu-blocks-zero", ("run", "{w}", "--num-gpu-blocks", "0"), "argument --num-gpu-blocks: must be a positive integer"),
    ("num-gpu-blocks-negative", ("run", "{w}", "--num-gpu-blocks", "-3"), "argument --num-gpu-blocks: must be a positive integer"),
    ("num-gpu-blocks-not-int", ("run", "{w}", "--num-gpu-blocks", "1e3"), "argument --num-gpu-blocks: expected an integer, got '1e3'"),
    ("num-gpu-blocks-huge", ("run", "{w}", "--num-gpu-blocks", str(10**12)), "--num-gpu-blocks 1000000000000: a KV cache of"),
    ("block-size-zero", ("run", "{w}", "--block-size", "0"), "argument --block-size: must be a positive integer"),
    ("block-size-huge", ("run", "{w}", "--block-size", str(10**9)), "GiB, more than the"),
    ("max-num-batched-tokens-zero", ("run", "{w}", "--max-num-batched-tokens", "0"), "argument --max-num-batched-tokens"),
    ("max-num-seqs-zero", ("run", "{w}", "--max-num-seqs", "0"), "argument --max-num-seqs"),
    ("num-cpu-blocks-negative", ("run", "{w}", "--num-cpu-blocks", "-1"), "argument --num-cpu-blocks: must be a non-negative integer"),
    ("num-cpu-blocks-huge", ("run", "{w}", "--preemption-mode", "swap", "--num-cpu-blocks", str(10**12)), "--num-gpu-blocks 64 + --num-cpu-blocks 1000000000000: a KV cache of"),
    ("preemption-mode-unknown", ("run", "{w}", "--preemption-mode", "drop"), "argument --preemption-mode: invalid choice: 'drop'"),
    ("policy-unknown", ("conform", "{w}", "--policy", "fifo"), "argument --policy: invalid choice: 'fifo'"),
    ("dtype-unknown", ("run", "{w}", "--dtype", "int8"), "argument --dtype: invalid choice: 'int8'"),
    ("device-unknown", ("run", "{w}", "--device", "tpu"), "argument --device: invalid choice: 'tpu'"),
    ("model-missing", ("run", "{w}", "--model", "{d}/nowhere"), "--model {d}/nowhere: checkpoint directory"),
    ("cli-seed-not-int", ("run", "{w}", "--seed", "x"), "argument --seed: expected an integer, got 'x'"),
    ("cli-seed-huge", ("run", "{w}", "--seed", str(2**64)), "argument --seed: must be an integer in -2**63..2**64-1"),
    ("threads-zero", ("run", "{w}", "--threads", "0"), f"argument --threads: must be an integer in 1..{CPUS}"),
    ("threads-more-than-cpus", ("demo", "--threads", str(CPUS + 1)), f"argument --threads: must be an integer in 1..{CPUS}"),
    ("plot-unsupported-type", ("run", "{w}", "--plot", "{d}/kv.txt"), "--plot {d}/kv.txt: unsupported file type '.txt' (use .png, .svg, .pdf)"),
    ("plot-no-extension", ("run", "{w}", "--plot", "{d}/kv"), "unsupported file type ''"),
    ("plot-missing-directory", ("run", "{w}", "--plot", "{d}/no/kv.png"), "--plot {d}/no/kv.png: directory {d}/no does not exist"),
    ("plot-under-a-file", ("run", "{w}", "--plot", "{w}/kv.png"), "is not a directory"),
    ("plot-is-a-directory", ("run", "{w}", "--plot", "{d}/sub.png"), "--plot {d}/sub.png: is a directory"),
    ("plot-not-writable", ("run", "{w}", "--plot", "/proc/kv.png"), "--plot /proc/kv.png: cannot be written"),
    ("plot-with-reference", ("run", "{w}", "--reference", "--plot", "{d}/kv.png"), "not with --reference"),
    ("gen-num-requests-negative", ("workload", "--num-requests", "-1"), "argument --num-requests: must be a non-negative integer"),
    ("gen-num-requests-huge", ("workload", "--num-requests", str(10**9)), "--num-requests 1000000000: at most 1,000,000 requests"),
    ("gen-prompt-tokens-huge", ("workload", "--num-requests", "1000", "--prompt-len", str(10**6)), "more than 100,000,000 prompt tokens"),
    ("gen-prompt-len-reversed", ("workload", "--prompt-len", "9:2"), "argument --prompt-len: '9:2': MIN 9 is greater than MAX 2"),
    ("gen-prompt-len-zero", ("workload", "--prompt-len", "0:4"), "argument --prompt-len: '0:4': values must be >= 1"),
    ("gen-max-tokens-bad-syntax", ("workload", "--max-tokens", "longtail:5"), "argument --max-tokens: 'longtail:5': expected"),
    ("gen-arrival-spread-huge", ("workload", "--arrival-spread", str(10**9)), f"at most {MAX_ARRIVAL_STEP:,}"),
    ("gen-seed-not-int", ("workload", "--seed", "x"), "argument --seed: expected an integer, got 'x'"),
    ("gen-priority-bad", ("workload", "--priority", "x"), "argument --priority: 'x': 'x' is not an integer"),
    ("gen-vocab-size-one", ("workload", "--vocab-size", "1"), "argument --vocab-size: must be an integer >= 2"),
    ("gen-temperature-negative", ("workload", "--temperature", "-1"), "argument --temperature: must be a finite number >= 0"),
    ("gen-temperature-nan", ("workload", "--temperature", "nan"), "argument --temperature: must be a finite number >= 0"),
    ("gen-eos-negative", ("workload", "--eos-token-id", "-1"), "argument --eos-token-id: must be a non-negative integer"),
    ("gen-output-missing-directory", ("workload", "-o", "{d}/no/w.jsonl"), "-o {d}/no/w.jsonl: directory {d}/no does not exist"),
    ("gen-output-is-directory", ("workload", "-o", "{d}"), "-o {d}: is a directory"),
    ("gen-output-not-writable", ("workload", "-o", "/proc/w.jsonl"), "-o /proc/w.jsonl: cannot be written"),
    ("workload-dev-zero", ("run", "/dev/zero"), f"/dev/zero:1: line longer than {MAX_LINE_BYTES:,} bytes"),
    ("workload-read-error", ("run", "/proc/self/mem"), "/proc/self/mem:1: cannot be read: Input/output error"),
    ("path-with-newline", ("run", "{d}/a\nb.jsonl"), "a\\nb.jsonl: No such file or directory"),
    ("peer-with-another-peers-semantics", ("conform", "{w}", "--engine", "vllm", "--semantics", "nano-vllm"), "--engine vllm --semantics nano-vllm: vllm's scheduler follows the vllm-v1 rules"),
    ("nano-vllm-with-vllm-semantics", ("conform", "{w}", "--engine", "nano-vllm", "--semantics", "vllm-v1"), "use --semantics nano-vllm (the default with --engine nano-vllm) or --semantics kvsched"),
    ("refusal-names-flags", ("run", "{w}", "--enable-prefix-caching", "--preemption-mode", "swap"), "kvsched: --enable-prefix-caching needs recompute or restart preemption, not swap"),
    ("vllm-v1-budget-below-seqs", ("run", "{w}", "--semantics", "vllm-v1", "--max-num-batched-tokens", "8", "--max-num-seqs", "16"), "--max-num-batched-tokens (8) must be >= --max-num-seqs (16)"),
    ("nano-vllm-chunked", ("run", "{w}", "--semantics", "nano-vllm", "--enable-chunked-prefill"), "no chunked prefill (use --no-enable-chunked-prefill)"),
    ("vllm-peer-swap", ("conform", "{w}", "--engine", "vllm", "--preemption-mode", "swap"), "--semantics vllm-v1: preemption by recompute only"),
    ("max-model-len-without-vllm-v1", ("run", "{w}", "--max-model-len", "8"), "--max-model-len is a vllm-v1 and vllm-v0 setting"),
    ("long-prefill-threshold-negative", ("run", "{w}", "--semantics", "vllm-v1", "--long-prefill-token-threshold", "-1"), "argument --long-prefill-token-threshold: must be a non-negative integer"),
    ("long-prefill-threshold-without-vllm-v1", ("run", "{w}", "--long-prefill-token-threshold", "8"), "--long-prefill-token-threshold is a vllm-v1 setting; the kvsched profile has no long-prefill cap"),
    ("long-prefill-threshold-over-model-len", ("run", "{w}", "--semantics", "vllm-v1", "--max-model-len", "16", "--long-prefill-token-threshold", "32"), "--long-prefill-token-threshold (32) cannot be greater than --max-model-len (16)"),
    ("async-without-vllm-v1", ("run", "{w}", "--async-scheduling"), "--async-scheduling is a vllm-v1 setting; the kvsched profile schedules each step after the previous one's outputs"),
    ("speculative-config-not-json", ("run", "{w}", "--speculative-config", "{{"), "argument --speculative-config: not JSON"),
    ("speculative-config-not-ngram", ("run", "{w}", "--speculative-config", '{{"method": "eagle", "num_speculative_tokens": 2}}'), 'argument --speculative-config: method must be "ngram"'),
    ("speculative-config-no-drafts", ("run", "{w}", "--speculative-config", '{{"method": "ngram"}}'), "argument --speculative-config: num_speculative_tokens is required"),
    ("speculative-config-unknown-key", ("run", "{w}", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}}'), "argument --speculative-config: unknown key(s) ['model']"),
    ("speculative-without-vllm-v1", ("run", "{w}", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 2}}'), "--speculative-config is a vllm-v1 setting; the kvsched profile has no speculative decoding"),
    ("speculative-with-async", ("run", "{w}", "--semantics", "vllm-v1", "--async-scheduling", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 2}}'), "async scheduling is not supported with n-gram speculative decoding"),
    ("speculative-budget-below-drafts", ("conform", "{w}", "--engine", "vllm", "--max-num-batched-tokens", "1", "--max-num-seqs", "1", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 1}}'), "--semantics vllm-v1: --max-num-batched-tokens (1) below 1 + --speculative-config (2): a padded decode never fits the budget, so vLLM 0.32 never schedules it and never drains (vllm-v1/spec-padded-new-decode; use --max-num-batched-tokens >= 2)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "argv", "fragment"), OPTION_CASES, ids=[c[0] for c in OPTION_CASES]
)
def test_option(
    invoke: Invoke, tmp_path: Path, case: str, argv: tuple[str, ...], fragment: str
) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "sub.png").mkdir()
    before = sorted(tmp_path.rglob("*"))
    args = [a.format(w=workload, d=tmp_path) for a in argv]
    result = invoke(*args)
    if case == "no-command":  # the list of commands, as argparse's usage error does
        assert result.code == 2 and result.out == ""
        for command in ("demo", "workload", "run", "conform"):
            assert re.search(rf"^\s+{command}\s", result.err, re.M), result.err
        return
    _assert_exit2(result, fragment.format(w=workload, d=tmp_path))
    assert sorted(tmp_path.rglob("*")) == before  # nothing was written


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``device-cuda-absent``."""
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps(GOOD) + "\n")
    _assert_exit2(invoke("run", str(workload), "--device", "cuda"), "--device")


def test_swap_without_cpu_blocks_warns_once(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``swap-without-cpu-blocks``: served, one warning, even for ``--reference``
    (one engine per request)."""
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "b"}) + "\n")
    for extra in ((), ("--reference",)):
        result = invoke("run", str(workload), "--preemption-mode", "swap", "--json", *extra)
        assert result.code == 0
        assert result.err == (
            "kvsched: warning: --preemption-mode swap with --num-cpu-blocks 0: there is no "
            "CPU pool, so every preemption falls back to recompute\n"
        )


def _table_cases() -> set[str]:
    text = (ROOT / "docs" / "cli.md").read_text()
    return set(re.findall(r"^\| `([a-z0-9-]+)` \|", text, re.M))


def test_docs_table_lists_exactly_the_tested_cases() -> None:
    names = [c[0] for c in FILE_CASES] + [c[0] for c in WHOLE_FILE_CASES]
    names += [c[0] for c in OPTION_CASES]
    names += [
        "reference-cache-too-large",
        "prompt-over-budget-unchunked",
        "device-cuda-absent",
        "swap-without-cpu-blocks",
        "reference-cpu-pool-huge",
        "plot-fails-late",
        "model-unloadable",  # tests/cli/test_bad_input.py
        "summary-escapes-ids",
        "json-round-trips-ids",
        "summary-strict-encoding",
        "plot-title-escapes",
        "gen-output-fails-midway",
        "gen-output-file-size-limit",
        "stdout-full",
        "stdout-closed-pipe",
        "kv-allocation-fails",
        "kv-pool-large",
        "interrupt-run",  # tests/cli/test_interrupts.py
        "interrupt-conform",
        "interrupt-twice",
        "interrupt-outside-a-run",
    ]
    assert len(set(names)) == len(names), "a case name is used twice"
    assert _table_cases() == set(names)
    text = (ROOT / "docs" / "cli.md").read_text()
    assert f"checks that this table lists exactly the cases it tests ({len(names)} cases)" in text


# --- output: escaped, complete or absent ----------------------------------------------

STRANGE_IDS = ["\x1b]0;owned\x07\x1b[31mred", "c\nd", "c\x00", "\ud800", "\u202ecba", "it's"]


def _strange_workload(tmp_path: Path) -> Path:
    """GOOD, then each strange id twice: served, then refused as a duplicate (listed)."""
    lines = [GOOD]
    for rid in STRANGE_IDS:
        lines += [{**GOOD, "id": rid, "max_tokens": 6}, {**GOOD, "id": rid}]
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


def test_summary_prints_ids_escaped(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``summary-escapes-ids``: no control character, line break or lone surrogate of
    an id reaches the terminal; each strange id reads as its Python literal."""
    result = invoke("run", str(_strange_workload(tmp_path)), "--device", "cpu")
    assert result.code == 0, result.err
    assert result.out.isascii() or all(c.isprintable() for c in result.out.replace("\n", ""))
    assert all(c == "\n" or c.isprintable() for c in result.out), result.out
    for rid in STRANGE_IDS:
        assert f"  {rid!r} (line " in result.out


def test_json_round_trips_ids(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``json-round-trips-ids``: the document is ASCII and reads back every id."""
    result = invoke("run", str(_strange_workload(tmp_path)), "--json", "--device", "cpu")
    assert result.code == 0, result.err
    assert result.out.isascii()
    ids = [r["id"] for r in requests_of(json.loads(result.out))]
    assert ids == ["a", *(rid for rid in STRANGE_IDS for _ in range(2))]


def test_a_lone_surrogate_on_a_strict_terminal(tmp_path: Path) -> None:
    """Case ``summary-strict-encoding``: a real process whose stdout encodes strictly
    prints the run's summary (the id escaped), then exits 0."""
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({**GOOD, "id": "\ud800", "prompt": []}) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvsched", "run", str(path), "--device", "cpu"],
        cwd=ROOT,
        env={**os.environ, "PYTHONIOENCODING": "utf-8:strict", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert "  '\\ud800' (line 1): EmptyPromptError: " in result.stdout


def test_plot_title_from_a_strange_file_name(invoke: Invoke, tmp_path: Path) -> None:
    """Case ``plot-title-escapes``: ``$...$`` and control characters in the workload's
    name are drawn as written (matplotlib would read ``$`` as mathematics)."""
    path = tmp_path / "a$\\frac{$\x1b.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    png = tmp_path / "kv.png"
    result = invoke("run", str(path), "--plot", str(png), "-q")
    assert (result.code, result.err) == (0, "")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_workload_output_fails_midway(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case ``gen-output-fails-midway``: the disk fills up while ``-o`` is written: one
    line naming the file, exit 2, and neither the file nor its temporary one is left."""
    real = dump_workload

    def disk_full(requests: object, out: TextIO, **kwargs: object) -> None:
        real(list(requests)[:3], out)  # type: ignore[call-overload]
        out.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvsched.cli, "dump_workload", disk_full)
    target = tmp_path / "w.jsonl"
    result = invoke("workload", "--num-requests", "10", "-o", str(target))
    _assert_exit2(
        result, f"-o {target}: cannot be written: No space left on device (nothing written)"
    )
    assert list(tmp_path.iterdir()) == []


def _limited_file_size() -> None:
    """In the child: files may not grow past 64 KiB (a full quota, as the kernel has it)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then write() fails with EFBIG


def test_workload_output_over_a_file_size_limit(tmp_path: Path) -> None:
    """Case ``gen-output-file-size-limit``: the same with a real failing write()."""
    target = tmp_path / "w.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "kvsched", "workload", "--num-requests", "2000", "-o", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=_limited_file_size,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        f"kvsched: -o {target}: cannot be written: File too large (nothing written)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_stdout_on_a_full_disk(tmp_path: Path) -> None:
    """Case ``stdout-full``: ``kvsched workload > /dev/full`` names stdout."""
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "kvsched", "workload", "--num-requests", "100"],
            cwd=ROOT,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 2
    assert result.stderr == "kvsched: stdout: cannot be written: No space left on device\n"


def test_run_results_on_a_full_stdout(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case ``stdout-full`` for ``run``: the results that cannot be printed name stdout."""

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    monkeypatch.setattr(sys, "stdout", Full())
    result = invoke("run", str(path), "--json", "--device", "cpu")
    assert result.code == 2
    assert result.err == "kvsched: stdout: cannot be written: No space left on device\n"


def test_stdout_closed_early(tmp_path: Path) -> None:
    """Case ``stdout-closed-pipe``: ``kvsched workload | head -1`` ends quietly (141)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsched", "workload", "--num-requests", "100000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b'{"id": "r0"')
    proc.stdout.close()
    err = proc.stderr.read()
    assert (proc.wait(timeout=120), err) == (141, b"")


def test_kv_allocation_that_fails(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case ``kv-allocation-fails``: the memory check passes (in a container MemAvailable
    may be the host's), the allocation does not: a typed error with the size asked for."""
    monkeypatch.setattr(kvsched.model_setup, "free_memory_bytes", lambda device: 2**62)
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    result = invoke("run", str(path), "--device", "cpu", "--block-size", str(10**9))
    _assert_exit2(result, "kvsched: --num-gpu-blocks 64: allocating the KV cache (")
    block = 2 * 2 * 10**9 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    assert (
        f"({64 * block:,} bytes) failed: DefaultCPUAllocator: can't allocate memory" in result.err
    )
    assert "ask for fewer blocks (--num-gpu-blocks, --block-size)" in result.err


def test_a_large_pool_warns_with_its_size(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Case ``kv-pool-large``: a pool far larger than the workload can use is served,
    with a warning giving its size in bytes (the threshold, 1 GiB, lowered here so the
    test allocates 4 MiB, not gigabytes)."""
    monkeypatch.setattr(kvsched.model_setup, "LARGE_POOL_BYTES", 2**20)
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    result = invoke("run", str(path), "--json", "--num-gpu-blocks", "500", "--device", "cpu")
    assert result.code == 0
    block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    assert result.err == (
        f"kvsched: warning: --num-gpu-blocks 500: the KV cache takes {500 * block:,} bytes "
        "(0.0 GiB) on cpu; this workload can use at most 1 block\n"
    )
