"""The rich console the CLI prints to: the terminal's width, or when piped $COLUMNS, else wide enough for the
tables."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from rich.console import Console

__all__ = ["make_console", "spinner"]

_PIPED_WIDTH = 160


def make_console(*, stderr: bool = False) -> Console:
    # No emoji codes: a model reference such as hf:llama:... would print as a llama.
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, emoji=False)
    columns = os.environ.get("COLUMNS", "")
    width = int(columns) if columns.isdigit() and int(columns) >= 40 else _PIPED_WIDTH
    return Console(stderr=stderr, width=width, emoji=False)


@contextlib.contextmanager
def spinner(label: str) -> Iterator[Callable[[str], None]]:
    """A spinner on the terminal naming the step under way (`say(step)`); nothing where stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield lambda step: None
        return
    with make_console(stderr=True).status(label) as status:
        yield lambda step: status.update(f"{label}: {step}")
