"""The far end of the subprocess protocol: one peer, driven over stdin/stdout.

``PYTHON -m kvsched.peers.server`` runs in the peer's own virtual environment, with the
kvsched source tree on ``PYTHONPATH`` (``kvsched.peers.remote`` sets it). It imports
the wire format, the protocol and the spec's plain types, and the peer's adapter only
when ``create`` names it, so it starts in an environment that has nothing but the
peer installed (no torch unless the peer needs it).

The protocol owns the file descriptor that was stdout; what the peer's libraries
print goes to stderr (fd 1 is pointed there), so a log line can never corrupt a
message. Calls are answered in order, one at a time; end of input ends the server.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Callable
from typing import IO

from kvsched.peers import make_peer, registry
from kvsched.peers.protocol import SchedulerUnderTest
from kvsched.peers.wire import (
    PORTABLE_ORACLES,
    PROTOCOL_VERSION,
    Call,
    Failure,
    PeerProtocolError,
    Reply,
    TokenAnswer,
    TokenQuery,
    dumps,
    loads,
)
from spec.types import SamplingParams, SchedulerConfig


class Server:
    def __init__(self, reader: IO[str], writer: IO[str]) -> None:
        self.reader = reader
        self.writer = writer
        self.peers: dict[int, SchedulerUnderTest] = {}  # by the handle ``create`` gave
        self.hot: dict[int, Callable[[], None]] = {}  # each peer's hot_step, once timed
        self.next_handle = 0

    def send(self, message: Reply | Failure | TokenQuery) -> None:
        self.writer.write(dumps(message))
        self.writer.flush()

    def serve(self) -> None:
        for line in self.reader:
            try:
                call = loads(line)
            except PeerProtocolError as e:  # answered, if it says which call it was
                if e.call_id is None:
                    raise
                self.send(Failure.of(e.call_id, e))
                continue
            if not isinstance(call, Call):
                raise PeerProtocolError(f"expected a call, got {call}")
            try:
                value = self.handle(call)
            except Exception as e:  # every failure crosses as a typed message
                self.send(Failure.of(call.id, e))
            else:
                self.send(Reply(call.id, value))

    def handle(self, call: Call) -> object:
        args = call.args
        if call.op == "hello":
            return hello(str(args["engine"]))
        if call.op == "run_script":  # a reproduction, shrunk where the peer is
            code, output = run_script(str(args["text"]))
            return {"code": code, "output": output}
        if call.op == "create":
            config = args["config"]
            if not isinstance(config, SchedulerConfig):
                raise PeerProtocolError("create: 'config' is not a SchedulerConfig")
            eos = args.get("eos_token_id")
            peer = make_peer(
                str(args["engine"]), config, eos_token_id=eos if isinstance(eos, int) else None
            )
            self.next_handle += 1
            self.peers[self.next_handle] = peer
            return {"peer": self.next_handle, "name": peer.name, "semantics": peer.semantics}
        handle = args.get("peer")
        if not isinstance(handle, int) or handle not in self.peers:
            raise PeerProtocolError(f"{call.op}: no peer {handle!r} here")
        peer = self.peers[handle]
        if call.op == "drop":
            del self.peers[handle]
            self.hot.pop(handle, None)
            return None
        if call.op == "time":  # bench/scheduler_overhead.py: the peer's own calls, timed here
            run = self.hot.get(handle)
            if run is None:
                run = self.hot[handle] = hot_step(peer, int(args["token"]))  # type: ignore[call-overload]
            steps = int(args["steps"])  # type: ignore[call-overload]
            start = time.process_time()
            for _ in range(steps):
                run()
            return time.process_time() - start
        if call.op == "add_request":
            params = args["params"]
            if not isinstance(params, SamplingParams):
                raise PeerProtocolError("add_request: 'params' is not a SamplingParams")
            prompt = args["prompt_token_ids"]
            if not isinstance(prompt, list):
                raise PeerProtocolError("add_request: 'prompt_token_ids' is not a list")
            peer.add_request(str(args["request_id"]), prompt, params)
            return None
        if call.op == "abort_request":
            return peer.abort_request(str(args["request_id"]))
        if call.op == "step":
            return peer.step(self.oracle(call.id, args.get("oracle_sent")))
        if call.op == "has_unfinished_requests":
            return peer.has_unfinished_requests()
        if call.op == "observe":
            return peer.observe()
        raise PeerProtocolError(f"unknown call {call.op!r}")

    def oracle(self, call_id: int, sent: object) -> Callable[[tuple[int, ...]], int]:
        """The oracle sent along (rebuilt here), or one that asks the caller per token."""
        if isinstance(sent, PORTABLE_ORACLES):
            return sent

        def ask(prefix: tuple[int, ...]) -> int:
            self.send(TokenQuery(call_id, tuple(prefix)))
            answer = loads(self.reader.readline())
            if not isinstance(answer, TokenAnswer) or answer.id != call_id:
                raise PeerProtocolError(f"expected the token for call {call_id}, got {answer}")
            return answer.token

        return ask


def run_script(text: str) -> tuple[int, str]:
    """Run a reproduction script here (its ``main()``, in a namespace of its own): its
    exit status and what it printed. A peer in another environment runs it there
    (its server's ``run_script`` call)."""
    namespace: dict[str, object] = {"__name__": "__kvsched_repro__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(text, "<repro>", "exec"), namespace)
            main = namespace["main"]
            assert callable(main)
            code = int(main())
    except Exception as e:  # the script failed in a way it does not report: not a repro
        return 2, f"{out.getvalue()}{type(e).__name__}: {e}"
    return code, out.getvalue()


def hot_step(peer: SchedulerUnderTest, token: int) -> Callable[[], None]:
    """The peer's own calls for one step (its adapter's ``hot_step``), if it has them."""
    make = getattr(peer, "hot_step", None)
    if make is None:
        raise PeerProtocolError(f"{peer.name} has no hot_step to time")
    run: Callable[[], None] = make(token)
    return run


def hello(engine: str) -> dict[str, object]:
    """What this end is: the protocol, the Python, the peer's distribution and version."""
    found = registry.installed(registry.entry(engine))
    return {
        "protocol": PROTOCOL_VERSION,
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "distribution": None if found is None else found[0],
        "version": None if found is None else found[1],
    }


def main() -> None:
    protocol_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the peer's prints and logs go to stderr, never into the protocol
    sys.stdout = sys.stderr
    Server(sys.stdin, protocol_out).serve()


if __name__ == "__main__":
    main()
