"""``kvsched conform``: agreement on preempting workloads, and teeth against a broken engine."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import impl.policies
import impl.sequence
import spec.policies
from impl.policies import POLICIES
from spec.types import RequestState
from tests.cli.helpers import Invoke, WriteWorkload

MODES = ["recompute", "restart", "swap"]


def _workload() -> list[dict[str, object]]:
    """Requests that overflow 6 blocks of 4 tokens, arrive over time, with priorities."""
    lines: list[dict[str, object]] = [
        {
            "id": f"r{i}",
            "prompt": [(11 * i + 3 * j) % 250 + 1 for j in range(3 + i % 5)],
            "max_tokens": 4 + (3 * i) % 7,
            "ignore_eos": i % 3 != 0,
            "eos_token_id": 0 if i % 3 == 0 else None,
            "priority": i % 3,
            "arrival_step": (i // 2) * 2,
        }
        for i in range(8)
    ]
    return [
        *lines,
        {"id": "empty", "prompt": [], "max_tokens": 2},
        {"id": "oov", "prompt": [5, 256], "max_tokens": 2},  # the engine's check alone
    ]


def _conform(invoke: Invoke, path: Path, *options: str) -> tuple[int, str, str]:
    result = invoke(
        "conform", str(path), "--device", "cpu", "--num-gpu-blocks", "6", "--block-size", "4",
        "--max-num-batched-tokens", "16", *options,
    )  # fmt: skip
    return result.code, result.out, result.err


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode", MODES)
def test_agrees(invoke: Invoke, write_workload: WriteWorkload, mode: str, policy: str) -> None:
    path = write_workload(_workload())
    code, out, err = _conform(
        invoke, path, "--preemption-mode", mode, "--policy", policy, "--num-cpu-blocks", "3"
    )
    assert (code, err) == (0, ""), out
    assert out.count("\n") == 1
    assert out.startswith("conform: ok: spec and engine agree at all ")
    assert "(10 requests, 2 rejected, " in out
    found = re.search(r" (\d+) preemptions?; ", out)
    assert found is not None
    # A policy with an admission gate (``reserve``) may avoid every preemption here;
    # tests/policies/test_conform_policies.py runs it on a workload where it preempts.
    if spec.policies.get_policy(policy).can_admit is spec.policies.always_admit:
        assert int(found.group(1)) > 0
    assert f"policy {policy}, {mode} mode" in out


def test_chunked_prefill_off(invoke: Invoke, write_workload: WriteWorkload) -> None:
    path = write_workload(_workload())
    code, out, _ = _conform(invoke, path, "--no-enable-chunked-prefill")
    assert code == 0, out


#: Three requests that fill 4 blocks of one token in step 0; in step 1 each decode needs
#: a block. LIFO: ``a``'s need evicts ``c`` (the last), then ``b``'s need has only ``b``
#: itself left: victims ``c, b``, and only ``a`` runs. Evicting the candidate right after
#: the requester instead gives victims ``b, c`` and again only ``a`` runs: the chunks,
#: the tokens and every step before are the same, the victim is the one difference.
VICTIM_WORKLOAD: list[dict[str, object]] = [
    {"id": "a", "prompt": [1, 2], "max_tokens": 3, "ignore_eos": True},
    {"id": "b", "prompt": [3], "max_tokens": 3, "ignore_eos": True},
    {"id": "c", "prompt": [4], "max_tokens": 3, "ignore_eos": True},
]
VICTIM_OPTIONS = ("--device", "cpu", "--num-gpu-blocks", "4", "--block-size", "1")


def test_a_wrong_victim_diverges_at_the_victim(
    invoke: Invoke, write_workload: WriteWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LIFO broken to evict the first candidate after the requester, not the last one."""
    path = write_workload(VICTIM_WORKLOAD)
    agreed = invoke("conform", str(path), *VICTIM_OPTIONS)
    assert agreed.out == (
        "conform: ok: spec and engine agree at all 6 steps (3 requests, 0 rejected, "
        "3 preemptions; policy lifo, recompute mode)\n"
    )
    monkeypatch.setattr(
        impl.policies.LifoPolicy,
        "select_victim",
        lambda self, running, start: start + 1 if start + 1 < len(running) else start,
    )
    result = invoke("conform", str(path), *VICTIM_OPTIONS)
    assert (result.code, result.err) == (1, "")
    assert result.out == (
        "conform: DIVERGED at step 1: plan.preempted[0].request_id: spec 'c', engine 'b' "
        "(policy lifo, recompute mode)\n"
    )


def test_a_wrong_token_count_diverges(
    invoke: Invoke, write_workload: WriteWorkload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose ``observe()`` overstates one request's computed tokens."""
    original = impl.sequence.Sequence.to_state

    def to_state(self: impl.sequence.Sequence) -> RequestState:
        state = original(self)
        if self.request_id != "r3":
            return state
        return dataclasses.replace(state, num_computed_tokens=state.num_computed_tokens + 1)

    monkeypatch.setattr(impl.sequence.Sequence, "to_state", to_state)
    code, out, _ = _conform(invoke, write_workload(_workload()))
    assert code == 1
    assert out.startswith("conform: DIVERGED at step ")
    assert ": state." in out
    assert ".num_computed_tokens: spec " in out


def test_the_long_prefill_cap_reaches_spec_and_engine(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    """``--long-prefill-token-threshold 2`` under vllm-v1: both sides cut the two
    12-token prompts to 2-token chunks (vllm-v1/long-prefill-cap) and agree, in more
    steps than the uncut run (12 + 4 tokens in its first step)."""
    path = write_workload(
        {"id": f"r{i}", "prompt": list(range(1 + i, 13 + i)), "max_tokens": 2} for i in range(2)
    )
    steps = {}
    for threshold in ("0", "2"):
        code, out, err = _conform(
            invoke, path, "--semantics", "vllm-v1", "--num-gpu-blocks", "16", "--max-num-seqs", "4",
            "--long-prefill-token-threshold", threshold,
        )  # fmt: skip
        assert (code, err) == (0, ""), out
        found = re.search(r"agree at all (\d+) steps", out)
        assert found is not None, out
        steps[threshold] = int(found[1])
    assert steps["2"] > steps["0"], steps
