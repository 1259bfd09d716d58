"""The progress of a long command: a spinner on a terminal, lines with the elapsed time in a log; names as written."""

from __future__ import annotations

import io
import re
import sys
import time

import pytest

from pyplan.report.console import spinner

LABEL = "planning hf:llama:hidden_size=64 [bold]x[/bold]"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_spinner_shows_model_references_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich reads `:llama:` as an emoji code and `[bold]` as markup; the spinner shows neither."""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with spinner(LABEL) as say:
        say("tracing :smile:")
        time.sleep(0.2)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())
    assert f"{LABEL}: tracing :smile:" in shown
    assert "🦙" not in shown and "😄" not in shown


def test_off_a_terminal_each_step_is_a_line_with_the_elapsed_time(capsys: pytest.CaptureFixture[str]) -> None:
    with spinner(LABEL, quiet_s=0.05) as say:
        say("tracing")
        time.sleep(0.3)  # the step under way is printed once the command is older than quiet_s
        say("searching")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == [f"{LABEL}: {s}" for s in ("tracing", "searching", "done")]
    seconds = [float(re.match(r"\[(\d+\.\d) s\] ", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert seconds == sorted(seconds) and seconds[-1] >= 0.3


def test_a_quick_command_prints_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """A command that ends (or fails) sooner than quiet_s prints only its output, or its one-line error; one that
    fails later says no `done`."""
    with spinner(LABEL, quiet_s=5.0) as say:
        say("tracing")
    with pytest.raises(ValueError), spinner(LABEL, quiet_s=5.0):
        raise ValueError
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError), spinner(LABEL, quiet_s=0.01):
        time.sleep(0.2)
        raise ValueError
    assert re.fullmatch(rf"\[0\.0 s\] {re.escape(LABEL)}: started\n", capsys.readouterr().err)
