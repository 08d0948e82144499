"""Files the commands write: checked before any work, written whole or not at all.

``check_output_path`` refuses an output path before the work that would fill it
(wrong type, no such directory, not writable). ``replacing`` writes through a
temporary file in the target's directory that is renamed over the target only once
it is complete, so a failed write (a full disk, a file-size limit, an interrupt)
leaves nothing behind, neither a truncated file nor the temporary one. Every failure
is a ``CLIInputError`` naming the option and the file.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, TextIO

from kvsched.errors import CLIInputError
from kvsched.text import one_line

TEMP_PREFIX = ".kvsched-"  # the temporary file: .kvsched-NAME-XXXXXXXX.part


def _named(option: str, path: str) -> str:
    return one_line(f"{option} {path}")


def _target(path: str) -> Path:
    """Where ``path`` leads: a symbolic link is followed, so the link itself is kept."""
    return Path(os.path.realpath(path))


def _special(target: Path) -> bool:
    """An existing file that is not a regular one (``/dev/stdout``, a FIFO): written in
    place, since renaming a new file over it would replace the device or pipe."""
    return target.exists() and not target.is_file()


def _temporary(target: Path) -> tuple[int, str]:
    """A new file beside ``target``, mode as ``open`` would give (umask applied)."""
    fd, name = tempfile.mkstemp(
        dir=target.parent, prefix=f"{TEMP_PREFIX}{target.name}-", suffix=".part"
    )
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, name


def check_output_path(option: str, path: str, *, formats: Sequence[str] | None = None) -> None:
    """Refuse an output file that cannot be written, before any work is done."""
    target = _target(path)
    named = _named(option, path)
    if formats is not None and Path(path).suffix.lower().lstrip(".") not in formats:
        known = ", ".join("." + f for f in formats)
        suffix = Path(path).suffix
        raise CLIInputError(f"{named}: unsupported file type {suffix!r} (use {known})")
    parent = Path(path).parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise CLIInputError(f"{named}: directory {one_line(str(parent))} {what}")
    if target.is_dir():
        raise CLIInputError(f"{named}: is a directory")
    # Doing what ``replacing`` will do is the one test that holds for root, read-only
    # mounts and full quotas alike.
    try:
        if _special(target):
            with open(target, "ab"):
                pass
        else:
            fd, name = _temporary(target)
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        raise CLIInputError(f"{named}: cannot be written: {e.strerror}") from None


@contextlib.contextmanager
def replacing(option: str, path: str) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` when the block ends without an error.

    On any error (or an interrupt) the temporary file is removed and ``path`` is left
    as it was; an ``OSError`` becomes a ``CLIInputError`` naming ``option`` and ``path``.
    """
    target = _target(path)
    named = _named(option, path)
    if _special(target):
        try:
            with open(target, "wb") as f:
                yield f
        except OSError as e:
            raise CLIInputError(f"{named}: cannot be written: {e.strerror or e}") from None
        return
    try:
        fd, name = _temporary(target)
    except OSError as e:
        raise CLIInputError(f"{named}: cannot be written: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, target)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(name)
        reason = e.strerror or str(e)
        raise CLIInputError(f"{named}: cannot be written: {reason} (nothing written)") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


@contextlib.contextmanager
def writing_stdout() -> Iterator[TextIO]:
    """stdout, flushed at the end; a failure to write it names stdout.

    A broken pipe (``| head``) is let through: ``kvsched.cli`` ends quietly on it.
    """
    try:
        yield sys.stdout
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise CLIInputError(f"stdout: cannot be written: {e.strerror or e}") from None


def emit(text: str) -> None:
    """Print a result (a line or several) on stdout (``writing_stdout``)."""
    with writing_stdout() as out:
        print(text, file=out)
