"""SIGINT and SIGTERM: a run stops at a step boundary and keeps what it has done.

While a run is in progress (``Signals.deferred``), the first signal only sets a flag
(``requested``) that the drive loop reads after each step: the step in progress
completes, the command writes what finished (the ``--json`` document, the plot up to
that step), prints one line and exits ``128 + signal`` (130 for SIGINT, 143 for
SIGTERM). The handlers then go back to the system's default action, so a second
signal ends the process at once, even in the middle of a long forward (Python runs a
handler only between bytecodes; the default action needs no Python at all).

Outside a run (reading the inputs, building the engine, writing the results) there is
nothing partial to keep: a signal raises ``Interrupted`` there, which unwinds (a file
being written is removed, ``kvsched.files``) to the one-line message.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal stopped the command outside a run (or a driver asked to stop)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum``: 130 SIGINT, 143 SIGTERM."""
    return 128 + signum


class Signals:
    """The command's SIGINT and SIGTERM handlers (``handled`` installs them).

    In a thread other than the main one (where Python allows no handlers) nothing is
    installed and nothing is ever requested.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._deferring = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._deferring:
            raise Interrupted(signum)
        if self.received is None:
            self.received = signum
            for s in SIGNALS:  # the next signal ends the process, wherever it is
                signal.signal(s, signal.SIG_DFL)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A run: a signal sets ``requested`` instead of raising."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def requested(self) -> str | None:
        """The signal that asked the run to stop (``"SIGINT"``), read at each step boundary."""
        return None if self.received is None else signal_name(self.received)


@contextlib.contextmanager
def handled() -> Iterator[Signals]:
    """The handlers for the ``with`` block; the previous ones back after it."""
    signals = Signals()
    signals.install()
    try:
        yield signals
    finally:
        signals.restore()
