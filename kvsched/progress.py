"""Progress and notices of the commands, on stderr.

A progress bar (rich) is drawn only when stderr is a terminal and ``-q`` is not
given, so pipes, files and CI logs stay clean; it is transient (erased when done).
Notices (``wrote kv.png ...``) are one line each on stderr, silenced by ``-q``;
warnings are never silenced. rich is imported only when a bar is drawn (it takes a
good part of the start-up time otherwise).
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from kvsched.text import one_line

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

PROG = "kvsched"


def wanted(*, quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw progress: not ``-q``, and stderr is a terminal."""
    s = stream if stream is not None else sys.stderr
    return not quiet and s.isatty()


class CommandProgress:
    """``label [bar] done/total unit · step N  elapsed``; a no-op when disabled."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        enabled: bool,
        unit: str = "requests",
        show_steps: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
            from rich.console import Console  # noqa: PLC0415  (see above)
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            console = Console(file=stream if stream is not None else sys.stderr)
            self._progress = Progress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(f"{unit} · step {{task.fields[step]}}" if show_steps else unit),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._task = self._progress.add_task(label, total=total, step=0)

    def update(self, steps: int, done: int) -> None:
        """``steps`` engine steps so far, ``done`` units finished (a ``StepCallback``)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, step=steps)

    def __enter__(self) -> CommandProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()


def notice(message: str, *, quiet: bool) -> None:
    """A one-line report of what a command did (``wrote w.jsonl (64 requests)``)."""
    if not quiet:
        print(f"{PROG}: {one_line(message)}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"{PROG}: warning: {one_line(message)}", file=sys.stderr)
