"""``--speculative-config`` on ``run`` and ``conform`` with our engine (vllm-v1)."""

from __future__ import annotations

from tests.cli.helpers import Invoke, WriteWorkload, metrics_of, requests_of, run_json

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 3}'
)
ENGINE = ("--semantics", "vllm-v1", "--num-gpu-blocks", "16", "--block-size", "4")


def _workload() -> list[dict[str, object]]:
    # Prompts that repeat a short pattern: prompt lookup finds n-grams in them.
    return [
        {"id": f"r{i}", "prompt": [7 + i, 40, 41, 9] * 4, "max_tokens": 12, "arrival_step": i}
        for i in range(5)
    ]


def test_drafts_are_reported_and_greedy_outputs_equal_a_run_without_them(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    path = write_workload(_workload())
    plain = run_json(invoke, str(path), *ENGINE, "--dtype", "float64")
    drafted = run_json(
        invoke, str(path), *ENGINE, "--dtype", "float64", "--speculative-config", NGRAM
    )
    assert "speculative" not in metrics_of(plain)
    # The same outputs (drafts take KV slots: the preemptions may differ).
    assert [(r["id"], r["output"], r["finish_reason"]) for r in requests_of(drafted)] == [
        (r["id"], r["output"], r["finish_reason"]) for r in requests_of(plain)
    ]
    figures = metrics_of(drafted)["speculative"]
    assert isinstance(figures, dict)
    assert set(figures) == {
        "draft_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "tokens_per_forward",
    }
    drafts, accepted = figures["draft_tokens"], figures["accepted_tokens"]
    assert 0 < accepted <= drafts
    assert figures["acceptance_rate"] == accepted / drafts
    assert figures["mean_accepted_length"] > 1
    assert figures["tokens_per_forward"] > 0
    summary = invoke("run", str(path), *ENGINE, "--speculative-config", NGRAM, "--device", "cpu")
    assert summary.code == 0, summary.err
    assert f"speculative decoding: {accepted} of {drafts} drafts accepted" in summary.out


def test_conform_holds_our_engine_to_the_spec_with_drafts(
    invoke: Invoke, write_workload: WriteWorkload
) -> None:
    path = write_workload(_workload())
    result = invoke("conform", str(path), *ENGINE, "--speculative-config", NGRAM, "--device", "cpu")
    assert result.code == 0, result.err
    assert "conform: ok" in result.out and "accepted" in result.out
