"""The workload file: one request per line of JSONL, its schema, parser and generator.

A line is a JSON object::

    {"id": "r0", "prompt": [5, 17, 3], "max_tokens": 8, "eos_token_id": null,
     "ignore_eos": false, "priority": 0, "temperature": 0.0, "seed": 0,
     "arrival_step": 0}

``id``, ``prompt`` and ``max_tokens`` are required; the rest take the defaults of
``SamplingParams`` (and ``arrival_step`` 0: the engine step at which the request is
added). Blank lines are skipped; CRLF line ends and a UTF-8 byte-order mark are
accepted; a line may hold at most ``MAX_LINE_BYTES`` (16 MiB). The file is read and
checked one line at a time (``iter_workload``). The schema checks field names (no
unknown field, none given twice) and types (``true`` is not an int; an int is
accepted where a float is expected): value ranges such as an empty prompt,
``max_tokens`` below 1 or a token outside the vocabulary are the engine's to refuse,
so such a request reaches the engine and is reported as rejected (so is a negative
``temperature``: R4's engine-only check). Checked here is the command line's own
range: ``arrival_step`` in ``0 .. MAX_ARRIVAL_STEP``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from kvsched.distributions import IntDistribution
from kvsched.errors import WorkloadError
from spec.types import SamplingParams

REQUIRED_FIELDS = ("id", "prompt", "max_tokens")
OPTIONAL_FIELDS = (
    "eos_token_id",
    "ignore_eos",
    "priority",
    "temperature",
    "seed",
    "arrival_step",
)
FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS

# Every step up to the last arrival is run, idle ones included (about 45 us each for
# the tiny model): this keeps the longest idle wait a file can ask for to seconds.
MAX_ARRIVAL_STEP = 100_000

# The longest line a workload file may have: a prompt of about two million token ids.
# The file is read a line at a time, so this bounds the memory one read can take.
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadRequest:
    """One line of a workload: a request and the step it arrives at."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_step: int = 0
    # Where it was read from (None: generated); not part of the request's identity.
    line: int | None = dataclasses.field(default=None, compare=False)

    def to_json(self) -> dict[str, object]:
        p = self.params
        return {
            "id": self.request_id,
            "prompt": list(self.prompt),
            "max_tokens": p.max_tokens,
            "eos_token_id": p.eos_token_id,
            "ignore_eos": p.ignore_eos,
            "priority": p.priority,
            "temperature": p.temperature,
            "seed": p.seed,
            "arrival_step": self.arrival_step,
        }


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "bool",
        int: "int",
        float: "float",
        str: "str",
        list: "list",
        dict: "object",
    }.get(type(value), type(value).__name__)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Line:
    """Field readers for one parsed line; each error names path, line and field."""

    def __init__(self, path: str, lineno: int, obj: Mapping[str, object]) -> None:
        self.path = path
        self.lineno = lineno
        self.obj = obj

    def fail(self, field: str, message: str) -> WorkloadError:
        return WorkloadError(self.path, message, line=self.lineno, field=field)

    def _get(self, field: str, expected: str, ok: Callable[[object], bool]) -> object:
        value = self.obj[field]
        if not ok(value):
            raise self.fail(field, f"expected {expected}, got {_type_name(value)}")
        return value

    def str_(self, field: str) -> str:
        value = self._get(field, "str", lambda v: isinstance(v, str))
        assert isinstance(value, str)
        return value

    def int_(self, field: str, default: int) -> int:
        if field not in self.obj:
            return default
        value = self._get(field, "int", _is_int)
        assert isinstance(value, int)
        return value

    def opt_int(self, field: str) -> int | None:
        if field not in self.obj:
            return None
        value = self._get(field, "int or null", lambda v: v is None or _is_int(v))
        assert value is None or isinstance(value, int)
        return value

    def bool_(self, field: str, default: bool) -> bool:
        if field not in self.obj:
            return default
        value = self._get(field, "bool", lambda v: isinstance(v, bool))
        assert isinstance(value, bool)
        return value

    def float_(self, field: str, default: float) -> float:
        if field not in self.obj:
            return default
        value = self._get(field, "float", lambda v: isinstance(v, float) or _is_int(v))
        assert isinstance(value, int | float)
        if not math.isfinite(value):
            raise self.fail(field, f"expected a finite float, got {value}")
        return float(value)

    def token_list(self, field: str) -> tuple[int, ...]:
        value = self._get(field, "list of int", lambda v: isinstance(v, list))
        assert isinstance(value, list)
        for i, item in enumerate(value):
            if not _is_int(item):
                raise self.fail(field, f"item {i}: expected int, got {_type_name(item)}")
        return tuple(value)


def _reject_constant(token: str) -> object:
    raise ValueError(f"{token} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj: dict[str, object] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"field {key!r} given twice")
        obj[key] = value
    return obj


def parse_line(text: str, *, path: str, lineno: int) -> WorkloadRequest:
    """Parse one non-blank line of a workload file."""
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except ValueError as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        col = f" (column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise WorkloadError(path, f"not valid JSON: {msg}{col}", line=lineno) from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise WorkloadError(path, "not valid JSON: nested too deeply", line=lineno) from None
    if not isinstance(obj, dict):
        raise WorkloadError(path, f"expected a JSON object, got {_type_name(obj)}", line=lineno)
    for field in obj:
        if field not in FIELDS:
            raise WorkloadError(path, "unknown field", line=lineno, field=field)
    for field in REQUIRED_FIELDS:
        if field not in obj:
            raise WorkloadError(path, "missing required field", line=lineno, field=field)
    line = _Line(path, lineno, obj)
    request_id = line.str_("id")
    prompt = line.token_list("prompt")
    max_tokens = line.int_("max_tokens", 0)
    params = SamplingParams(
        max_tokens=max_tokens,
        eos_token_id=line.opt_int("eos_token_id"),
        ignore_eos=line.bool_("ignore_eos", False),
        priority=line.int_("priority", 0),
        temperature=line.float_("temperature", 0.0),
        seed=line.opt_int("seed"),
    )
    arrival_step = line.int_("arrival_step", 0)
    if not 0 <= arrival_step <= MAX_ARRIVAL_STEP:
        raise line.fail(
            "arrival_step", f"expected an int in 0..{MAX_ARRIVAL_STEP}, got {arrival_step}"
        )
    return WorkloadRequest(
        request_id=request_id,
        prompt=prompt,
        params=params,
        arrival_step=arrival_step,
        line=lineno,
    )


def parse_lines(lines: Iterable[str], *, path: str) -> list[WorkloadRequest]:
    """Parse a workload's lines; blank lines are skipped (and still counted)."""
    return [
        parse_line(text, path=path, lineno=lineno)
        for lineno, text in enumerate(lines, start=1)
        if text.strip()
    ]


def _text_lines(f: BinaryIO, name: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of a binary file.

    Lines end at LF, CRLF or a lone CR, as ``bytes.splitlines`` has them. The file is
    read a line at a time, each read taking ``MAX_LINE_BYTES`` at most: a longer line
    (``/dev/zero`` has no line end at all) is refused after reading that much of it,
    so no input can exhaust the memory.
    """
    lineno = 0
    while True:
        try:
            raw = f.readline(MAX_LINE_BYTES + 1)
        except OSError as e:  # a read error mid-file names no file by itself
            raise WorkloadError(
                name, f"cannot be read: {e.strerror or e}", line=lineno + 1
            ) from None
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            raise WorkloadError(name, f"line longer than {MAX_LINE_BYTES:,} bytes", line=lineno + 1)
        if lineno == 0:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 BOM
        for piece in raw.splitlines():
            lineno += 1
            try:
                yield lineno, piece.decode("utf-8")
            except UnicodeDecodeError as e:
                raise WorkloadError(name, f"not UTF-8 text: {e.reason}", line=lineno) from None


def iter_workload(path: str | Path) -> Iterator[WorkloadRequest]:
    """The requests of a workload file, read and validated one line at a time.

    ``OSError`` if the file cannot be opened; a ``WorkloadError`` names the file and the
    line of the first one that is unreadable, too long, not UTF-8 or not a request.
    """
    name = str(path)
    with open(path, "rb") as f:
        for lineno, text in _text_lines(f, name):
            if text.strip():
                yield parse_line(text, path=name, lineno=lineno)


def read_workload(path: str | Path) -> list[WorkloadRequest]:
    """Read and validate a whole workload file (``iter_workload``, kept in a list)."""
    return list(iter_workload(path))


ProgressCallback = Callable[[int], None]  # requests done so far
PROGRESS_EVERY = 1000  # requests between two progress callbacks


def dump_workload(
    requests: Iterable[WorkloadRequest], out: TextIO, *, on_progress: ProgressCallback | None = None
) -> None:
    """Write ``requests`` as JSONL (the inverse of ``read_workload``)."""
    for i, r in enumerate(requests, start=1):
        out.write(json.dumps(r.to_json()) + "\n")
        if on_progress is not None and i % PROGRESS_EVERY == 0:
            on_progress(i)


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratorSettings:
    """What ``kvsched workload`` draws; every draw comes from one ``Random(seed)``."""

    num_requests: int
    seed: int
    prompt_len: IntDistribution
    max_tokens: IntDistribution
    arrival_spread: int = 0
    vocab_size: int = 256
    priority: IntDistribution | None = None
    eos_token_id: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    # Shared prefixes (for prefix caching): every prompt starts with one of
    # ``num_system_prompts`` system prompts of ``shared_prefix`` tokens (0: none).
    shared_prefix: int = 0
    num_system_prompts: int = 1


def generate_workload(
    s: GeneratorSettings, *, on_progress: ProgressCallback | None = None
) -> list[WorkloadRequest]:
    """A random workload, a pure function of the settings (and so of the seed).

    Prompt tokens are uniform over ``1 .. vocab_size - 1`` (0 is left out, as the
    seed tutorial does). With ``shared_prefix``, each prompt is a system prompt
    followed by its own ``prompt_len`` tokens. Arrival steps are uniform over
    ``0 .. arrival_spread`` and the requests are listed in arrival order (ties keep
    their drawing order).
    """
    rng = random.Random(s.seed)
    # Drawn from their own generator, so the rest of the workload is the same with or
    # without them; request i gets system prompt i mod num_system_prompts.
    system_rng = random.Random(f"system-prompts-{s.seed}")
    system_prompts = [
        tuple(system_rng.randint(1, s.vocab_size - 1) for _ in range(s.shared_prefix))
        for _ in range(s.num_system_prompts if s.shared_prefix else 0)
    ]
    drawn: list[WorkloadRequest] = []
    for i in range(s.num_requests):
        n = s.prompt_len.sample(rng)
        own = tuple(rng.randint(1, s.vocab_size - 1) for _ in range(n))
        prompt = (*system_prompts[i % len(system_prompts)], *own) if system_prompts else own
        params = SamplingParams(
            max_tokens=s.max_tokens.sample(rng),
            eos_token_id=s.eos_token_id,
            ignore_eos=s.ignore_eos,
            priority=s.priority.sample(rng) if s.priority is not None else 0,
            temperature=s.temperature,
            seed=rng.randrange(2**31),
        )
        arrival = rng.randint(0, s.arrival_spread) if s.arrival_spread > 0 else 0
        drawn.append(
            WorkloadRequest(request_id=f"r{i}", prompt=prompt, params=params, arrival_step=arrival)
        )
        if on_progress is not None and (i + 1) % PROGRESS_EVERY == 0:
            on_progress(i + 1)
    return sorted(drawn, key=lambda r: r.arrival_step)
