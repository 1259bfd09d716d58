"""The capture limit: a model whose code never returns (its import, model(), example_inputs() or the forward that
tracing runs) ends `pyplan plan` and `pyplan inspect` with one line naming it, exit 2, instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyplan.cli.limits import CAPTURE_TIMEOUT_ENV, DEFAULT_CAPTURE_TIMEOUT_S, capture_timeout_s
from pyplan.errors import PlanError

# A model file whose code blocks where HANG says: on import, in model() (a wait no one ends), in example_inputs (a
# sleep that swallows the first interruption, as a retry loop would), or in the forward (a loop in Python).
HANGS = """
import os
import threading
import time

import torch
from torch import nn

HANG = os.environ.get("HANG", "")
if HANG == "import":
    threading.Event().wait()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        while HANG == "forward":
            pass
        return self.b(torch.relu(self.a(x)))


def model():
    if HANG == "model":
        threading.Event().wait()
    return Net()


def example_inputs(batch_size):
    if HANG == "example_inputs":
        try:
            time.sleep(3600)
        except BaseException:
            pass
        time.sleep(3600)
    return (torch.randn(batch_size, 8),)
"""

LIMIT_S = 2
FIX = f"the capture limit; if it needs longer, set {CAPTURE_TIMEOUT_ENV}=SECONDS (0: no limit)"


def _pyplan(tmp_path: Path, hang: str, *argv: str) -> tuple[subprocess.CompletedProcess[str], float]:
    (tmp_path / "hangs.py").write_text(HANGS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HANG": hang, CAPTURE_TIMEOUT_ENV: str(LIMIT_S)}
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pyplan.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,  # without the limit the command would never end
        env=env,
        cwd=tmp_path,
    )
    return done, time.monotonic() - began


@pytest.mark.parametrize(
    ("hang", "said"),
    [
        ("import", "importing hangs.py did not finish"),
        ("model", "model() of hangs.py did not return"),
        ("example_inputs", "example_inputs(4) of hangs.py did not return"),
        ("forward", "tracing and profiling hangs.py (its forward under torch.export) did not finish"),
    ],
    ids=["import", "model", "example_inputs", "forward"],
)
def test_pyplan_plan_ends_a_capture_that_never_returns(tmp_path: Path, hang: str, said: str) -> None:
    done, took = _pyplan(tmp_path, hang, "plan", "hangs.py", "--gpus", "2", "--gpu", "a100-80g")
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {said} within {LIMIT_S} s, {FIX}"]), done
    assert took < 60  # the start (torch's import) and the limit


def test_pyplan_inspect_ends_a_trace_that_never_returns(tmp_path: Path) -> None:
    done, _ = _pyplan(tmp_path, "forward", "inspect", "hangs.py")
    said = "tracing hangs.py (its forward under torch.export) did not finish"
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"error: {said} within {LIMIT_S} s, {FIX}"]), done


def test_the_limit_is_read_from_the_environment() -> None:
    assert capture_timeout_s({}) == DEFAULT_CAPTURE_TIMEOUT_S
    assert capture_timeout_s({CAPTURE_TIMEOUT_ENV: " 90 "}) == 90.0
    assert capture_timeout_s({CAPTURE_TIMEOUT_ENV: "0"}) is None
    for bad in ("soon", "-1", "nan", "inf", "1e10"):
        with pytest.raises(PlanError, match=f"^{CAPTURE_TIMEOUT_ENV} takes the seconds .* got '{bad}'$"):
            capture_timeout_s({CAPTURE_TIMEOUT_ENV: bad})
