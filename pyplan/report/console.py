"""The rich console the CLI prints to: the terminal's width, or wide enough for the tables when piped."""

from __future__ import annotations

import sys

from rich.console import Console

__all__ = ["make_console"]

_PIPED_WIDTH = 160


def make_console(*, stderr: bool = False) -> Console:
    # No emoji codes: a model reference such as hf:llama:... would print as a llama.
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr, emoji=False)
    return Console(stderr=stderr, width=_PIPED_WIDTH, emoji=False)
