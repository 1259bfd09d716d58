"""Writing files atomically: a temporary file beside the target, renamed over it, so no reader ever sees half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | Path, data: str | bytes, *, make_parents: bool = False) -> None:
    """Write `data` (text or bytes) to `path` through a temporary file in the same directory, flushed to disk and
    renamed over `path`: an interrupted write leaves the old file or none, never a half-written one.
    `make_parents` creates the directory first."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if make_parents:
        directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
