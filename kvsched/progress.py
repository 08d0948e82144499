"""The progress bar of ``kvsched run``: rich, on stderr, only when stderr is a terminal."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    """Requests done out of the workload, and the step count; a no-op when disabled."""

    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self._progress: Progress | None = None
        self._task = None
        if enabled:
            console = Console(file=stream if stream is not None else sys.stderr)
            self._progress = Progress(
                TextColumn("[bold]kvsched run"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("requests · step {task.fields[step]}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self._task = self._progress.add_task("run", total=total, step=0)

    @staticmethod
    def wanted(*, quiet: bool, stream: TextIO | None = None) -> bool:
        s = stream if stream is not None else sys.stderr
        return not quiet and s.isatty()

    def update(self, steps: int, done: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, step=steps)

    def __enter__(self) -> RunProgress:
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
