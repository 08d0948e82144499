"""``--enable-prefix-caching`` on run, and ``kvsched workload --shared-prefix``."""

from __future__ import annotations

import json

from tests.cli.helpers import Invoke, WriteWorkload, metrics_of, requests_of, run_json

SHARED = list(range(1, 33))  # 32 tokens: two blocks of 16


def _workload() -> list[dict[str, object]]:
    return [
        {"id": f"r{i}", "prompt": [*SHARED, 100 + i], "max_tokens": 3, "arrival_step": 2 * i}
        for i in range(4)
    ]


def test_hits_are_reported_and_outputs_equal_a_run_without_caching(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    path = write_workload(_workload())
    off = run_json(invoke, str(path), "--dtype", "float64")
    on = run_json(invoke, str(path), "--dtype", "float64", "--enable-prefix-caching")
    assert "prefix_cache" not in metrics_of(off)
    assert requests_of(on) == requests_of(off)
    cache = metrics_of(on)["prefix_cache"]
    # r0 misses; r1..r3 each hit the 32 shared tokens (the two full blocks).
    assert cache == {"queries": 4 * 33, "hits": 3 * 32, "hit_rate": 96 / 132, "reclaimed_blocks": 0}
    summary = invoke("run", str(path), "--device", "cpu", "--enable-prefix-caching")
    assert summary.code == 0
    assert "prefix cache: hit rate 72.7% (96 of 132 tokens)" in summary.out


def test_swap_with_caching_is_a_one_line_error(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    path = write_workload(_workload())
    result = invoke(
        "run", str(path), "--enable-prefix-caching", "--preemption-mode", "swap", "--device", "cpu"
    )
    assert result.code != 0
    assert "swap" in result.err and "Traceback" not in result.err


def test_workload_shared_prefix(invoke: Invoke) -> None:
    result = invoke(
        "workload", "--num-requests", "6", "--shared-prefix", "5", "--num-system-prompts", "2"
    )
    assert result.code == 0, result.err
    prompts = [json.loads(line)["prompt"] for line in result.out.splitlines()]
    assert prompts[0][:5] == prompts[2][:5] == prompts[4][:5]
    assert prompts[1][:5] == prompts[3][:5] != prompts[0][:5]
    plain = invoke("workload", "--num-requests", "6")
    own = [json.loads(line)["prompt"] for line in plain.out.splitlines()]
    assert [p[5:] for p in prompts] == own  # the rest of the workload is unchanged
