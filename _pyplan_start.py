"""The `pyplan` command's entry (pyproject.toml's console script): its SIGINT handling, set before torch is imported.

Importing anything from the `pyplan` package runs pyplan/__init__.py first, which imports torch (2 s or more on a
small machine), and Ctrl-C meanwhile would end in a traceback. So the entry lives in this module, outside the
package, and imports the standard library alone before it imports the command.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

__all__ = ["main"]


class _Interrupts:
    """SIGINT in the `pyplan` command. While the command is starting (torch and pyplan importing), Ctrl-C ends the
    process at once: there is nothing to undo, and an import may swallow a KeyboardInterrupt (a bare `except:`), so
    that the Ctrl-C would be lost. Once the command runs, the first Ctrl-C raises KeyboardInterrupt: the command
    stops what it does and ends with the line "interrupted" and exit status 130 (pyplan/cli/main.py, or `main` here
    while the command line is parsed). A Ctrl-C after that one, while the command is ending or after it returned,
    ends the process at once with status 130, saying "interrupted" unless it was said."""

    def __init__(self) -> None:
        self.starting = True
        self.raised = False
        self.said = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.starting or self.raised:
            self.leave()
        self.raised = True
        raise KeyboardInterrupt

    def leave(self) -> NoReturn:
        """End the process now: what stdout holds written, the one line, status 130."""
        with contextlib.suppress(Exception):  # a signal that came during a write to stdout makes this flush refuse
            sys.stdout.flush()
        if not self.said:
            os.write(2, b"interrupted\n")
            self.said = True
        os._exit(130)


def main() -> int:
    """The `pyplan` command (pyproject.toml's console script): `pyplan.cli.main.main` under SIGINT handling installed
    before torch is imported, so that Ctrl-C at any moment ends with "interrupted" and exit status 130, never a
    traceback. Where SIGINT is ignored (a background job of a non-interactive shell), it stays ignored."""
    interrupts = _Interrupts()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupts)
    # No collection while torch and pyplan import (0.2-0.3 s of CPU scanning what lives to the end): the collector
    # starts again, the imports' objects frozen out of it, in one_command_collector.
    gc.disable()
    from pyplan.cli.main import main as command
    from pyplan.cli.main import one_command_collector

    one_command_collector()
    interrupts.starting = False
    try:
        code = command()
    except KeyboardInterrupt:
        interrupts.leave()
    finally:
        # The command has ended (or exits: --help); a Ctrl-C from here on, the interpreter ending, ends it at once.
        interrupts.raised = True
    interrupts.said = code == 130
    return code
