"""Writing files atomically: a temporary file beside the target, renamed over it, so no reader ever sees half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pyplan.errors import PlanError

__all__ = ["write_atomic"]


def check_writable(path: str | Path) -> None:
    """Raise the one-line error `write_atomic` would give for `path` (a directory, a missing or read-only
    directory), before any work: a command checks its outputs before it plans."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise PlanError(f"cannot write '{path}': it is a directory; give a file path in a writable directory")
    fix = "give a file path in a writable directory"
    if not directory.is_dir():
        raise PlanError(f"cannot write '{path}': no such file or directory ('{directory}'); {fix}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PlanError(f"cannot write '{path}': '{directory}' is not writable; {fix}")


def write_atomic(path: str | Path, data: str | bytes, *, make_parents: bool = False) -> None:
    """Write `data` (text or bytes) to `path` through a temporary file in the same directory, flushed to disk and
    renamed over `path`: an interrupted write leaves the old file or none, never a half-written one.
    `make_parents` creates the directory first."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    try:
        if make_parents:
            directory.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(21, "it is a directory")
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise PlanError(f"cannot write '{path}': {_reason(exc)}; give a file path in a writable directory") from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            # The mode a plain open() gives (mkstemp's is 0600): readable as the user's umask allows.
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(f.fileno(), 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise PlanError(f"cannot write '{path}': {_reason(exc)}") from None
        raise


def _reason(exc: OSError) -> str:
    """What the OS said, in words: "No such file or directory", "Permission denied", "No space left on device"."""
    return (exc.strerror or str(exc)).lower() if exc.errno != 21 else "it is a directory"
