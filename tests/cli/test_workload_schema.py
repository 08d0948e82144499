"""The workload JSONL schema: what parses, and the one-line errors for what does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsched.errors import WorkloadError
from kvsched.workload import WorkloadRequest, dump_workload, parse_line, read_workload
from spec.types import SamplingParams


def _parse(obj: object) -> WorkloadRequest:
    return parse_line(json.dumps(obj), path="w.jsonl", lineno=3)


def test_minimal_line_takes_defaults() -> None:
    r = _parse({"id": "a", "prompt": [1, 2], "max_tokens": 4})
    assert r == WorkloadRequest(
        request_id="a", prompt=(1, 2), params=SamplingParams(max_tokens=4), arrival_step=0
    )


def test_full_line() -> None:
    r = _parse(
        {
            "id": "a",
            "prompt": [7],
            "max_tokens": 2,
            "eos_token_id": 3,
            "ignore_eos": True,
            "priority": -1,
            "temperature": 1,
            "seed": 9,
            "arrival_step": 5,
        }
    )
    assert r.params == SamplingParams(
        max_tokens=2, eos_token_id=3, ignore_eos=True, priority=-1, temperature=1.0, seed=9
    )
    assert r.arrival_step == 5
    assert isinstance(r.params.temperature, float)


def test_value_ranges_are_left_to_the_engine() -> None:
    r = _parse({"id": "a", "prompt": [], "max_tokens": 0})
    assert r.prompt == ()
    assert r.params.max_tokens == 0
    assert _parse({"id": "b", "prompt": [-1, 10**9], "max_tokens": 1}).prompt == (-1, 10**9)


BASE = {"id": "a", "prompt": [1], "max_tokens": 4}
DROP = object()  # an ``edit`` value that removes the field


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"max_tokens": "4"}, "field 'max_tokens': expected int, got str"),
        ({"max_tokens": True}, "field 'max_tokens': expected int, got bool"),
        ({"max_tokens": 4.0}, "field 'max_tokens': expected int, got float"),
        ({"id": 1}, "field 'id': expected str, got int"),
        ({"prompt": "1 2"}, "field 'prompt': expected list of int, got str"),
        ({"prompt": [1, False]}, "field 'prompt': item 1: expected int, got bool"),
        ({"ignore_eos": 1}, "field 'ignore_eos': expected bool, got int"),
        ({"eos_token_id": "x"}, "field 'eos_token_id': expected int or null, got str"),
        ({"seed": 1.5}, "field 'seed': expected int or null, got float"),
        ({"priority": None}, "field 'priority': expected int, got null"),
        ({"temperature": "hot"}, "field 'temperature': expected float, got str"),
        ({"arrival_step": -1}, "field 'arrival_step': expected an int in 0..100000, got -1"),
        ({"max_tokens": DROP}, "field 'max_tokens': missing required field"),
        ({"id": DROP}, "field 'id': missing required field"),
        ({"top_p": 0.9}, "field 'top_p': unknown field"),
    ],
)
def test_schema_errors_name_file_line_and_field(edit: dict[str, object], message: str) -> None:
    obj = {k: v for k, v in {**BASE, **edit}.items() if v is not DROP}
    with pytest.raises(WorkloadError) as info:
        _parse(obj)
    assert str(info.value) == f"w.jsonl:3: {message}"
    assert info.value.line == 3


def test_line_must_be_an_object() -> None:
    with pytest.raises(WorkloadError, match=r"^w\.jsonl:3: expected a JSON object, got list$"):
        _parse([1, 2])


@pytest.mark.parametrize("text", ["{not json", '{"id": "a", "prompt": [NaN], "max_tokens": 1}'])
def test_invalid_json(text: str) -> None:
    with pytest.raises(WorkloadError, match=r"^w\.jsonl:3: not valid JSON"):
        parse_line(text, path="w.jsonl", lineno=3)


def test_file_round_trip_and_blank_lines(tmp_path: Path) -> None:
    requests = [
        WorkloadRequest(request_id="x", prompt=(1, 2, 3), params=SamplingParams(max_tokens=2)),
        WorkloadRequest(
            request_id="y",
            prompt=(4,),
            params=SamplingParams(max_tokens=5, eos_token_id=1, seed=3, temperature=0.5),
            arrival_step=2,
        ),
    ]
    path = tmp_path / "w.jsonl"
    with path.open("w") as f:
        dump_workload(requests, f)
        f.write("\n   \n")
    assert read_workload(path) == requests


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "prompt": [1], "max_tokens": 1}\n\n{"id": "b"}\n')
    with pytest.raises(WorkloadError, match=r"w\.jsonl:3: field 'prompt': missing"):
        read_workload(path)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": [1], "max_tokens": 1}\n\xff\xfe\n')
    with pytest.raises(WorkloadError, match=r"w\.jsonl:2: not UTF-8"):
        read_workload(path)
