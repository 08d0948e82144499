"""A peer in another virtual environment, driven through ``kvsched.peers.server``.

``RemotePeer`` is a ``SchedulerUnderTest`` like any in-process adapter: lockstep,
``conform`` and the peer machines cannot tell them apart. It starts
``PYTHON -m kvsched.peers.server`` with this kvsched source tree first on
``PYTHONPATH`` (the environment needs only the peer itself), says ``hello`` (protocol
versions must match: both ends run this tree), ``create``s the adapter there and then
forwards each call (``kvsched.peers.wire`` has the messages). A typed error raised
there is raised here as the same class; the server's stderr (the peer's logs) is kept
in a temporary file and its tail is quoted if the process dies.

Costs a round trip of JSON per call, an ``observe`` the whole state: the price is
measured in docs/benchmarks.md (``bench/scheduler_overhead.py``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvsched.peers.protocol import Observation
from kvsched.peers.wire import (
    PORTABLE_ORACLES,
    Call,
    Failure,
    PeerProtocolError,
    Reply,
    TokenAnswer,
    TokenQuery,
    dumps,
    loads,
)
from spec.scheduler import TokenOracle
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, StepPlan

SOURCE_ROOT = Path(__file__).resolve().parents[2]
_STDERR_TAIL = 2000


class RemotePeer:
    """``engine``'s adapter, run by ``python`` (another environment's interpreter)."""

    def __init__(
        self,
        python: str | os.PathLike[str],
        engine: str,
        config: SchedulerConfig,
        *,
        eos_token_id: int | None = None,
    ) -> None:
        self.python = str(python)
        if not Path(self.python).exists():
            raise PeerProtocolError(f"--peer-python {self.python}: no such interpreter")
        # Lives as long as the process (closed by ``_stop``), so not a ``with`` block.
        self._stderr = tempfile.TemporaryFile(  # noqa: SIM115
            mode="w+", encoding="utf-8", errors="replace"
        )
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SOURCE_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        self._process = subprocess.Popen(
            [self.python, "-m", "kvsched.peers.server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
            encoding="utf-8",
            bufsize=1,
        )
        self._finalizer = weakref.finalize(self, _stop, self._process, self._stderr)
        self._next_id = 0
        self._oracle: TokenOracle | None = None
        self.hello: dict[str, Any] = self._call("hello", engine=engine)
        created: dict[str, str] = self._call(
            "create", engine=engine, config=config, eos_token_id=eos_token_id
        )
        self.name = created["name"]
        self.semantics = created["semantics"]

    # --- the protocol, call by call ------------------------------------------------------

    def _call(self, op: str, **args: object) -> Any:
        self._next_id += 1
        call_id = self._next_id
        stdin, stdout = self._pipes()
        try:
            stdin.write(dumps(Call(call_id, op, dict(args))))
            stdin.flush()
        except BrokenPipeError:
            raise self._died(op) from None
        while True:
            line = stdout.readline()
            if not line:
                raise self._died(op)
            message = loads(line)
            if message.id != call_id:
                raise PeerProtocolError(f"answer to call {message.id} while waiting for {call_id}")
            if isinstance(message, Reply):
                return message.value
            if isinstance(message, Failure):
                raise message.error()
            if isinstance(message, TokenQuery) and self._oracle is not None:
                token = self._oracle(message.prefix)
                stdin.write(dumps(TokenAnswer(call_id, token)))
                stdin.flush()
                continue
            raise PeerProtocolError(f"unexpected message during {op}: {message}")

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        stdin, stdout = self._process.stdin, self._process.stdout
        if stdin is None or stdout is None or stdin.closed:
            raise PeerProtocolError(f"the peer process ({self.python}) is closed")
        return stdin, stdout

    def _died(self, op: str) -> PeerProtocolError:
        code = self._process.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-_STDERR_TAIL:].strip()
        return PeerProtocolError(
            f"the peer process ({self.python} -m kvsched.peers.server) exited with code "
            f"{code} during {op}" + (f"; its stderr ends:\n{tail}" if tail else "")
        )

    def close(self) -> None:
        """End the peer process (also done when this object is collected)."""
        self._finalizer()

    # --- SchedulerUnderTest --------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._call(
            "add_request",
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
        )

    def abort_request(self, request_id: str) -> FinishedRequest | None:
        finished: FinishedRequest | None = self._call("abort_request", request_id=request_id)
        return finished

    def step(self, next_token: TokenOracle) -> StepPlan:
        # A pure oracle of the spec's crosses whole; any other is asked token by token.
        portable = isinstance(next_token, PORTABLE_ORACLES)
        self._oracle = None if portable else next_token
        try:
            plan: StepPlan = self._call("step", oracle=next_token if portable else None)
        finally:
            self._oracle = None
        return plan

    def has_unfinished_requests(self) -> bool:
        return bool(self._call("has_unfinished_requests"))

    def observe(self) -> Observation:
        observed: Observation = self._call("observe")
        return observed


def _stop(process: subprocess.Popen[str], stderr: IO[str]) -> None:
    if process.stdin is not None and not process.stdin.closed:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
    stderr.close()


__all__ = ["SOURCE_ROOT", "RemotePeer"]
