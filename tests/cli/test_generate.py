"""Generated workloads: deterministic from the seed, inside their distributions."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from kvsched.distributions import DistributionSyntaxError, IntDistribution, parse_distribution
from kvsched.workload import GeneratorSettings, generate_workload, read_workload
from tests.cli.helpers import Invoke


def _settings(seed: int, **kw: object) -> GeneratorSettings:
    base: dict[str, object] = {
        "num_requests": 50,
        "seed": seed,
        "prompt_len": parse_distribution("3:9", minimum=1),
        "max_tokens": parse_distribution("longtail:2:100", minimum=1),
        "arrival_spread": 10,
    }
    base.update(kw)
    return GeneratorSettings(**base)  # type: ignore[arg-type]


def test_same_seed_same_workload() -> None:
    assert generate_workload(_settings(7)) == generate_workload(_settings(7))
    assert generate_workload(_settings(7)) != generate_workload(_settings(8))


def test_values_in_range_and_arrival_order() -> None:
    requests = generate_workload(_settings(1, vocab_size=16))
    assert len({r.request_id for r in requests}) == 50
    assert all(3 <= len(r.prompt) <= 9 for r in requests)
    assert all(1 <= t < 16 for r in requests for t in r.prompt)
    assert all(2 <= r.params.max_tokens <= 100 for r in requests)
    arrivals = [r.arrival_step for r in requests]
    assert arrivals == sorted(arrivals)
    assert max(arrivals) <= 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", IntDistribution(kind="uniform", low=5, high=5)),
        ("2:9", IntDistribution(kind="uniform", low=2, high=9)),
        ("uniform:2:9", IntDistribution(kind="uniform", low=2, high=9)),
        ("longtail:1:50", IntDistribution(kind="longtail", low=1, high=50)),
        ("longtail:1:50:2.5", IntDistribution(kind="longtail", low=1, high=50, alpha=2.5)),
    ],
)
def test_parse_distribution(text: str, expected: IntDistribution) -> None:
    assert parse_distribution(text, minimum=1) == expected
    assert parse_distribution(str(expected), minimum=1) == expected


@pytest.mark.parametrize(
    "text", ["", "x", "1:", "9:2", "0:3", "longtail:1", "longtail:1:5:-1", "1:2:3", "uniform:4"]
)
def test_bad_distribution(text: str) -> None:
    with pytest.raises(DistributionSyntaxError):
        parse_distribution(text, minimum=1)


def test_longtail_is_skewed_and_bounded() -> None:
    d = parse_distribution("longtail:4:200", minimum=1)
    rng = random.Random(0)
    draws = [d.sample(rng) for _ in range(4000)]
    assert min(draws) >= 4
    assert max(draws) <= 200
    counts = Counter(x < 20 for x in draws)
    assert counts[True] > 3 * counts[False]  # most are short ...
    assert max(draws) > 100  # ... a few are long


def test_workload_command_is_deterministic_and_parses_back(invoke: Invoke, tmp_path: Path) -> None:
    argv = ["workload", "--num-requests", "12", "--seed", "5", "--arrival-spread", "4",
            "--prompt-len", "longtail:2:30", "--max-tokens", "3:9", "--priority", "0:2",
            "--eos-token-id", "2", "--temperature", "0.7"]  # fmt: skip
    first = invoke(*argv)
    assert (first.code, first.err) == (0, "")
    assert invoke(*argv).out == first.out
    assert invoke(*argv[:4], "6", *argv[5:]).out != first.out  # another seed
    out = tmp_path / "w.jsonl"
    assert invoke(*argv, "-o", str(out)).out == ""
    assert out.read_text() == first.out
    requests = read_workload(out)
    assert len(requests) == 12
    assert all(r.params.eos_token_id == 2 and r.params.temperature == 0.7 for r in requests)
    assert {r.params.priority for r in requests} <= {0, 1, 2}
    assert all(0 <= r.arrival_step <= 4 for r in requests)
    assert len({r.params.seed for r in requests}) == 12


def test_help(invoke: Invoke) -> None:
    for argv in (["--help"], ["run", "--help"], ["workload", "--help"]):
        result = invoke(*argv)
        assert result.code == 0
        assert "usage: kvsched" in result.out
    assert "--enable-chunked-prefill, --no-enable-chunked-prefill" in invoke("conform", "-h").out
