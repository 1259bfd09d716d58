"""The rich console the CLI prints to: the terminal's width, or when piped $COLUMNS, else wide enough for the
tables; and the progress of a long command, as a spinner on a terminal or as lines in a log."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console
from rich.text import Text

__all__ = ["QUIET_S", "make_console", "spinner"]

_PIPED_WIDTH = 160
QUIET_S = 10.0  # off a terminal, a command that ends sooner prints no progress (its output, or its one-line error)


def make_console(*, stderr: bool = False) -> Console:
    # No emoji codes: a model reference such as hf:llama:... would print as a llama.
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, emoji=False)
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) >= 40 else _PIPED_WIDTH
    return Console(stderr=stderr, width=width, emoji=False)


@contextlib.contextmanager
def spinner(label: str, *, quiet_s: float = QUIET_S) -> Iterator[Callable[[str], None]]:
    """The step under way (`say(step)`): on a terminal a spinner; elsewhere (a log, nohup) one line per step on
    stderr with the seconds since the start, from `quiet_s` on. Labels and steps are shown as written (no markup,
    no emoji codes)."""
    if sys.stderr.isatty():
        with make_console(stderr=True).status(Text(label)) as status:
            yield lambda step: status.update(Text(f"{label}: {step}"))
        return
    with _Log(label, sys.stderr, quiet_s) as log:
        yield log.say


class _Log:
    """Progress lines `[12.3 s] label: step`: none while the command is younger than `quiet_s`, then the step under
    way and each step as it starts, and at the end the time in all."""

    def __init__(self, label: str, stream: TextIO, quiet_s: float) -> None:
        self.label, self.stream = label, stream
        self.start = time.monotonic()
        self.step = "started"
        self.state = "quiet"  # then "speaking" from quiet_s on, and "closed" once the command ends
        self.lock = threading.Lock()
        self.timer = threading.Timer(quiet_s, self._wake)
        self.timer.daemon = True

    def __enter__(self) -> _Log:
        self.timer.start()
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self.timer.cancel()
        with self.lock:
            if self.state == "speaking" and kind is None:
                self._print("done")
            self.state = "closed"

    def say(self, step: str) -> None:
        with self.lock:
            self.step = step
            if self.state == "speaking":
                self._print(step)

    def _wake(self) -> None:
        with self.lock:
            if self.state == "quiet":
                self.state = "speaking"
                self._print(self.step)

    def _print(self, what: str) -> None:
        elapsed = time.monotonic() - self.start
        print(f"[{elapsed:.1f} s] {self.label}: {what}", file=self.stream, flush=True)
