"""The command line's own typed errors: bad input given to ``kvsched`` itself.

They subclass the project's ``KVSchedError`` so the top level catches them with the
rest of the project's typed errors; each renders as one line, naming the file, the
line and the field where there is one (``workload.jsonl:3: field 'max_tokens': ...``).
"""

from __future__ import annotations

from spec.types import KVSchedError


class CLIInputError(KVSchedError):
    """Input given to the command line is unusable (exit code 2)."""


class WorkloadError(CLIInputError):
    """A workload file does not follow the JSONL schema."""

    def __init__(
        self, path: str, message: str, *, line: int | None = None, field: str | None = None
    ) -> None:
        where = path if line is None else f"{path}:{line}"
        what = message if field is None else f"field {field!r}: {message}"
        super().__init__(f"{where}: {what}")
        self.path = path
        self.line = line
        self.field = field


class DrainError(KVSchedError):
    """The engine did not finish the workload within the step bound (a liveness bug)."""
