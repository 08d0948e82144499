"""The subprocess protocol's messages and their JSON encoding, shared by both ends.

A peer installed in another virtual environment runs ``kvsched.peers.server`` there;
``kvsched.peers.remote.RemotePeer`` drives it from here through the same
``SchedulerUnderTest`` protocol as an in-process adapter. Each message is one JSON
object on one line, with the protocol version in ``"v"``:

- a ``Call`` (here -> there): ``{"v", "id", "op", "args"}``; ``op`` is ``hello``,
  ``create`` or a method of ``SchedulerUnderTest``;
- its answer (there -> here): a ``Reply`` (``{"v", "id", "value"}``), a ``Failure``
  (``{"v", "id", "error": {"type", "message"}}``, one of the project's typed errors,
  raised again here as the same class), or, while a ``step`` runs with an oracle that
  cannot cross (not one of ``spec.oracle``'s), any number of ``TokenQuery``
  (``{"v", "id", "prefix"}``), each answered by a ``TokenAnswer`` (``{"v", "id",
  "token"}``) before the step goes on.

Values cross as JSON with a tag for what JSON lacks (``encode`` / ``decode``): the
spec's frozen dataclasses (``{"$": name, ...fields}``), enums (``{"$e": name, "v"}``),
tuples (``{"$t": [...]}``) and frozensets (``{"$s": [...]}``); lists and ``str``-keyed
dicts are themselves. Only the types named in ``TYPES`` decode, so a message cannot
build anything else. This module imports nothing of a peer, nor torch.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any, Final

from kvsched.errors import CLIInputError
from kvsched.peers.protocol import (
    Hidden,
    Observation,
    PeerFailure,
    PeerNotInstalledError,
    PeerUnsupportedError,
)
from spec import oracle as oracles
from spec import types as spec_types

#: Bumped whenever a message or an encoded type changes shape.
PROTOCOL_VERSION: Final = 2

# What may cross: the spec's plain data (configs, requests, states, plans), the oracles
# that can be rebuilt on the far side, and the observation's wrapper.
_DATACLASSES: Final[tuple[type[Any], ...]] = (
    spec_types.SchedulerConfig,
    spec_types.SamplingParams,
    spec_types.Request,
    spec_types.RequestState,
    spec_types.SchedulerState,
    spec_types.PrefixCacheState,
    spec_types.InFlightBatch,
    spec_types.ScheduledChunk,
    spec_types.Preemption,
    spec_types.SampledToken,
    spec_types.FinishedRequest,
    spec_types.StepPlan,
    oracles.HashOracle,
    oracles.ConstantOracle,
    oracles.SuccessorOracle,
    Observation,
)
_ENUMS: Final[tuple[type[enum.Enum], ...]] = (
    spec_types.PreemptionMode,
    spec_types.Semantics,
    spec_types.FinishReason,
    Hidden,
)
TYPES: Final[dict[str, type[Any]]] = {t.__name__: t for t in (*_DATACLASSES, *_ENUMS)}
#: Oracles a step can hand over whole (pure, frozen, rebuilt there); any other callable
#: is asked token by token.
PORTABLE_ORACLES: Final = (oracles.HashOracle, oracles.ConstantOracle, oracles.SuccessorOracle)


class PeerProtocolError(CLIInputError):
    """The two ends disagree (version, message shape) or the peer process died.

    ``call_id`` is the call a malformed message answered or made, where it was read.
    """

    def __init__(self, message: str, *, call_id: int | None = None) -> None:
        super().__init__(message)
        self.call_id = call_id


# Raised again on this side as themselves: the project's typed errors a peer raises on
# purpose (a refused request, an unsupported config, a failed step, a missing package).
_ERRORS: Final[dict[str, type[Exception]]] = {
    cls.__name__: cls
    for cls in (
        spec_types.ConfigError,
        spec_types.InvalidRequestError,
        spec_types.EmptyPromptError,
        spec_types.InvalidMaxTokensError,
        spec_types.TokenOutOfVocabError,
        spec_types.InvalidSamplingParamsError,
        spec_types.DuplicateRequestError,
        spec_types.RequestTooLargeError,
        spec_types.UnknownRequestError,
        spec_types.SampledTokensError,
        PeerFailure,
        PeerUnsupportedError,
        PeerProtocolError,
    )
}


# --- values ------------------------------------------------------------------------------


def encode(value: object) -> object:
    """``value`` as JSON-ready data (``decode`` is its inverse)."""
    if isinstance(value, enum.Enum):  # first: a StrEnum is a str too
        return {"$e": type(value).__name__, "v": value.value}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"$t": [encode(v) for v in value]}
    if isinstance(value, frozenset):
        return {"$s": sorted((encode(v) for v in value), key=repr)}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and type(value).__name__ in TYPES:
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$": type(value).__name__, **fields}
    raise PeerProtocolError(f"cannot send a {type(value).__name__} to a peer process")


def decode(data: object) -> Any:
    """The value ``encode`` made ``data`` from; ``PeerProtocolError`` on anything else."""
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        raise PeerProtocolError(f"not a protocol value: {data!r}")
    if "$t" in data:
        return tuple(decode(v) for v in data["$t"])
    if "$s" in data:
        return frozenset(decode(v) for v in data["$s"])
    if "$e" in data:
        return _known(data["$e"])(data["v"])
    if "$" in data:
        cls = _known(data["$"])
        return cls(**{k: decode(v) for k, v in data.items() if k != "$"})
    return {k: decode(v) for k, v in data.items()}


def _known(name: object) -> type[Any]:
    cls = TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise PeerProtocolError(f"unknown type {name!r} in a protocol message")
    return cls


# --- messages ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Call:
    id: int
    op: str
    args: dict[str, object]


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    value: object


@dataclass(frozen=True, slots=True)
class Failure:
    id: int
    type: str
    message: str

    @classmethod
    def of(cls, call_id: int, error: BaseException) -> Failure:
        """A typed error as it crosses; anything else as a ``PeerFailure`` naming it."""
        name = type(error).__name__
        if name in _ERRORS or isinstance(error, PeerNotInstalledError):
            return cls(call_id, name, _message(error))
        return cls(call_id, "PeerFailure", f"{name}: {error}")

    def error(self) -> Exception:
        """The error to raise on this side."""
        if self.type == "PeerNotInstalledError":
            return PeerProtocolError(self.message)
        cls = _ERRORS.get(self.type)
        if cls is None:
            return PeerProtocolError(f"{self.type}: {self.message}")
        return cls(self.message)


def _message(error: BaseException) -> str:
    return str(error.args[0]) if len(error.args) == 1 else str(error)


@dataclass(frozen=True, slots=True)
class TokenQuery:
    id: int
    prefix: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenAnswer:
    id: int
    token: int


Message = Call | Reply | Failure | TokenQuery | TokenAnswer


def dumps(message: Message) -> str:
    """One line of JSON, newline included."""
    body: dict[str, object] = {"v": PROTOCOL_VERSION, "id": message.id}
    match message:
        case Call(op=op, args=args):
            body |= {"op": op, "args": encode(args)}
        case Reply(value=value):
            body["value"] = encode(value)
        case Failure(type=kind, message=text):
            body["error"] = {"type": kind, "message": text}
        case TokenQuery(prefix=prefix):
            body["prefix"] = list(prefix)
        case TokenAnswer(token=token):
            body["token"] = token
    return json.dumps(body, separators=(",", ":")) + "\n"


def loads(line: str) -> Message:
    """The message on one line; ``PeerProtocolError`` if it is not one of this version."""
    try:
        body = json.loads(line)
    except json.JSONDecodeError as e:
        raise PeerProtocolError(f"not a protocol line: {line[:200]!r} ({e})") from None
    if not isinstance(body, dict) or not isinstance(body.get("id"), int):
        raise PeerProtocolError(f"not a protocol message: {line[:200]!r}")
    if body.get("v") != PROTOCOL_VERSION:
        raise PeerProtocolError(
            f"peer protocol version {body.get('v')!r}, this side speaks {PROTOCOL_VERSION}: "
            "the two ends run different kvsched sources"
        )
    call_id: int = body["id"]
    try:
        return _message_of(call_id, body)
    except PeerProtocolError as e:
        raise PeerProtocolError(f"message {call_id}: {e}", call_id=call_id) from None
    except (KeyError, TypeError, ValueError) as e:  # a field of the wrong shape or value
        raise PeerProtocolError(
            f"malformed message {call_id}: {type(e).__name__}: {e}", call_id=call_id
        ) from None


def _message_of(call_id: int, body: dict[str, Any]) -> Message:
    if "op" in body:
        args = decode(body.get("args", {}))
        if not isinstance(body["op"], str) or not isinstance(args, dict):
            raise PeerProtocolError(f"malformed call {call_id}", call_id=call_id)
        return Call(call_id, body["op"], args)
    if "value" in body:
        return Reply(call_id, decode(body["value"]))
    if "error" in body:
        error = body["error"]
        return Failure(call_id, str(error.get("type")), str(error.get("message")))
    if "prefix" in body:
        return TokenQuery(call_id, tuple(int(t) for t in body["prefix"]))
    if "token" in body:
        return TokenAnswer(call_id, int(body["token"]))
    raise PeerProtocolError(f"message {call_id} is of no known kind", call_id=call_id)


__all__ = [
    "PORTABLE_ORACLES",
    "PROTOCOL_VERSION",
    "TYPES",
    "Call",
    "Failure",
    "Message",
    "PeerProtocolError",
    "Reply",
    "TokenAnswer",
    "TokenQuery",
    "decode",
    "dumps",
    "encode",
    "loads",
]
