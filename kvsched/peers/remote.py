"""A peer in another virtual environment, driven through ``kvsched.peers.server``.

``RemotePeer`` is a ``SchedulerUnderTest`` like any in-process adapter: lockstep,
``conform`` and the peer machines cannot tell them apart. A ``PeerProcess`` starts
``PYTHON -m kvsched.peers.server`` with this kvsched source tree first on
``PYTHONPATH`` (the environment needs only the peer itself) and says ``hello``
(protocol versions must match: both ends run this tree); each ``RemotePeer`` is an
adapter ``create``d there, and forwards each call (``kvsched.peers.wire`` has the
messages). A typed error raised
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
from spec.oracle import TokenOracle
from spec.types import FinishedRequest, SamplingParams, SchedulerConfig, StepPlan

SOURCE_ROOT = Path(__file__).resolve().parents[2]
_STDERR_TAIL = 2000


class PeerProcess:
    """``PYTHON -m kvsched.peers.server`` for one engine; ``peer`` makes its peers there.

    One process serves any number of peers (a run each: ``scripts/explore_peers.py``
    drives a thousand through one, paying the peer's import once); calls go one at a
    time. ``hello`` says what runs there (``installed``: the peer's package and version).
    """

    def __init__(self, python: str | os.PathLike[str], engine: str) -> None:
        self.python = str(python)
        self.engine = engine
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
        self.hello: dict[str, Any] = self.call("hello", engine=engine)
        distribution, version = self.hello["distribution"], self.hello["version"]
        #: The peer's package there, as ``kvsched.peers.registry.installed`` says.
        self.installed: tuple[str, str] | None = (
            None if version is None else (str(distribution), str(version))
        )

    def peer(self, config: SchedulerConfig, *, eos_token_id: int | None = None) -> RemotePeer:
        """A new peer in this process (``eos_token_id``: nano-vllm's engine-wide EOS)."""
        return RemotePeer(self, config, eos_token_id=eos_token_id)

    def run_script(self, text: str) -> tuple[int, str]:
        """Run a reproduction script there (``kvsched.peers.repro.run_script``)."""
        ran: dict[str, Any] = self.call("run_script", text=text)
        return int(ran["code"]), str(ran["output"])

    def call(self, op: str, *, oracle: TokenOracle | None = None, **args: object) -> Any:
        """One call and its answer; ``oracle`` answers the token queries it makes."""
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
            if isinstance(message, TokenQuery) and oracle is not None:
                stdin.write(dumps(TokenAnswer(call_id, oracle(message.prefix))))
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
        """End the process (also done when this object is collected)."""
        self._finalizer()


class RemotePeer:
    """One peer in a ``PeerProcess``: a ``SchedulerUnderTest`` like an in-process adapter."""

    def __init__(
        self, process: PeerProcess, config: SchedulerConfig, *, eos_token_id: int | None = None
    ) -> None:
        self.process = process
        self.python = process.python
        self.installed = process.installed
        created: dict[str, Any] = process.call(
            "create", engine=process.engine, config=config, eos_token_id=eos_token_id
        )
        self.handle: int = created["peer"]
        self.name: str = created["name"]
        self.semantics: str = created["semantics"]

    def _call(self, op: str, *, oracle: TokenOracle | None = None, **args: object) -> Any:
        return self.process.call(op, oracle=oracle, peer=self.handle, **args)

    def close(self) -> None:
        """Forget this peer in its process (the process stays for the next)."""
        self._call("drop")

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
        if isinstance(next_token, PORTABLE_ORACLES):
            plan: StepPlan = self._call("step", oracle_sent=next_token)
        else:
            plan = self._call("step", oracle=next_token, oracle_sent=None)
        return plan

    def time_steps(self, token: int, steps: int) -> float:
        """CPU seconds, measured there, of ``steps`` calls of the adapter's ``hot_step``
        (the peer's own calls, every request sampling ``token``; no protocol in them)."""
        return float(self._call("time", token=token, steps=steps))

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


__all__ = ["SOURCE_ROOT", "PeerProcess", "RemotePeer"]
