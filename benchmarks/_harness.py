"""The plumbing the benchmark scripts share: options, timing, child processes, JSON results, tables, verdicts.

The scripts import it as a sibling (`sys.path` holds benchmarks/, as when run as `python benchmarks/NAME.py`).
Nothing here imports torch or rich at import time: workers started under torchrun import this module too.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rich.table import Table

__all__ = [
    "argument_parser",
    "last_json",
    "machine",
    "new_table",
    "peak_rss_bytes",
    "run_child",
    "target_line",
    "timed",
    "verdict",
    "write_json",
]

T = TypeVar("T")


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose description is the first line of the script's docstring `doc`; bad arguments exit 2."""
    return argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)


def timed(fn: Callable[[], T], repeat: int = 1) -> tuple[T, float]:
    """`fn()` run `repeat` times: what the last run returned, and the median of the runs' wall-clock seconds."""
    times: list[float] = []
    while True:
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= repeat:
            return out, statistics.median(times)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def machine() -> str:
    """What a result's header says of the machine: `N cores, torch VERSION`."""
    import torch

    return f"{os.cpu_count()} cores, torch {torch.__version__}"


def run_child(
    script: str, *args: str, timeout_s: float | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """`script` run again with `args` in a fresh Python process of its own (its imports, memory and peak resident
    memory its own), its stdout and stderr captured as text. At `timeout_s` the child is killed and
    subprocess.TimeoutExpired raised; with `check`, a non-zero exit raises subprocess.CalledProcessError."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=check)


def last_json(stdout: str) -> Any:
    """The JSON value a child printed last: the last line of `stdout` (lines before it are whatever else it
    printed)."""
    return json.loads(stdout.strip().splitlines()[-1])


def write_json(
    path: str | Path, data: Any, *, indent: int | None = None, default: Callable[[Any], Any] | None = None
) -> None:
    """Write `data` as JSON to `path` atomically (a sibling `.tmp` file renamed over it), so that a process killed
    mid-write leaves the previous version, or none; `indent` and `default` as json.dumps takes them."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=default))
    tmp.replace(path)


def new_table(
    title: str,
    columns: Iterable[str],
    *,
    left: Collection[str] = (),
    caption: str | None = None,
    show_lines: bool = False,
    **column: Any,
) -> Table:
    """A rich Table with `columns`, those in `left` left-justified and the rest right-justified; `column` holds
    further options of every column (rich's `add_column`: `no_wrap`, `overflow`, ...)."""
    from rich.table import Table

    table = Table(title=title, caption=caption, show_lines=show_lines)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", **column)
    return table


def verdict(met: bool) -> str:
    """How a result says whether a target is met."""
    return "met" if met else "MISSED"


def target_line(what: str, met: bool, detail: str = "") -> str:
    """`target WHAT: met (DETAIL)`, or MISSED: the line a script prints under its table for each target."""
    return f"target {what}: {verdict(met)}" + (f" ({detail})" if detail else "")
