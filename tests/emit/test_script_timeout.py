"""The emitted script under a stopped rank: the run ends within about --timeout, rank 0 saying which rank."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pyplan.emit.script import render_script, write_script
from tests.emit.test_script import _document

TIMEOUT_S = 5

# Batches for --data (gpt-tiny, global batch 8) whose iterator takes rank 1 out at its second step: `stop` stops
# the process (SIGSTOP) after writing its pid next to this file, `leave` exits with status 0 as if it had finished.
FAULTS = """
import os
import signal
from pathlib import Path

from pyplan.load import load_model


def batches(fault):
    spec = load_model("zoo:gpt-tiny")
    for step in range(1000):
        if step == 1 and os.environ["RANK"] == "1":
            fault()
        yield spec.example_inputs(8), spec.target(8)


def stop_here():
    Path(__file__).with_name("stopped.pid").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


def stop():
    return batches(stop_here)


def leave():
    return batches(lambda: os._exit(0))
"""


def _launch(tmp_path: Path, fault: str) -> subprocess.Popen[bytes]:
    """The 2-rank pp=2 script under torchrun, each rank's output in its own file under tmp_path/logs, torchrun's
    in tmp_path/torchrun.log."""
    script = tmp_path / "train.py"
    write_script(script, _document())
    (tmp_path / "faults.py").write_text(FAULTS)
    argv = ["--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), "--redirects", "3"]
    args = ["--steps", "100", "--timeout", str(TIMEOUT_S), "--data", f"{tmp_path / 'faults.py'}:{fault}"]
    with open(tmp_path / "torchrun.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *argv, str(script), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )


def _end(proc: subprocess.Popen[bytes], stopped: Path) -> None:
    """After a failed check: the stopped rank killed, then torchrun stopped with its ranks."""
    if stopped.exists() and stopped.read_text():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(stopped.read_text()), signal.SIGKILL)
    if proc.poll() is None:
        proc.terminate()  # torchrun stops its ranks on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _stderr(tmp_path: Path, rank: int) -> str:
    found = list((tmp_path / "logs").glob(f"*/attempt_0/{rank}/stderr.log"))
    return found[0].read_text() if found else ""


def _wait(condition: Callable[[], object], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {limit_s} s"
        time.sleep(0.05)


def _assert_one_line(stderr: str) -> None:
    """Rank 0's stderr is the one line naming rank 1 (the heartbeat's silence: --timeout, or 4 beats after a
    collective failed)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-3000:]
    pattern = r"error: rank 1 stopped answering \(no heartbeat for [0-9.]+ s: stopped, killed or exited early\); "
    assert re.fullmatch(pattern + "ending the run", lines[0]), lines[0]


def test_the_script_takes_a_timeout(tmp_path: Path) -> None:
    text = render_script(_document())
    assert '"--timeout", type=float, default=600.0' in text
    assert "timeout=timedelta(seconds=args.timeout)" in text.split("dist.init_process_group(")[1].split("\n")[0]
    # A bad timeout (0, negative, inf, nan: one comparison refuses them all) is bad input: one line and exit
    # status 2, before any process group is made.
    script = tmp_path / "train.py"
    script.write_text(text)
    done = subprocess.run(
        [sys.executable, str(script), "--timeout", "nan"], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (2, "error: --timeout takes seconds in (0, 1e9], got nan\n")


@pytest.mark.distributed
def test_a_stopped_rank_ends_the_run_with_one_line(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "stop")
    pid_file = tmp_path / "stopped.pid"
    try:
        _wait(lambda: (pid_file.exists() and pid_file.read_text() != "") or proc.poll() is not None, 120)
        assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
        stopped = time.monotonic()
        _wait(lambda: "stopped answering" in _stderr(tmp_path, 0), TIMEOUT_S + 15)
        took = time.monotonic() - stopped
        # torchrun ends a stopped rank only 30 s after its SIGTERM: end it now, as it would.
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        proc.wait(60)
    finally:
        _end(proc, pid_file)
    assert proc.returncode != 0
    assert TIMEOUT_S - 1 < took < TIMEOUT_S + 10
    _assert_one_line(_stderr(tmp_path, 0))


@pytest.mark.distributed
def test_a_rank_that_leaves_early_ends_the_run_with_one_line(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "leave")
    try:
        proc.wait(120)
    finally:
        _end(proc, tmp_path / "stopped.pid")
    assert proc.returncode != 0
    _assert_one_line(_stderr(tmp_path, 0))
    assert "Traceback" not in _stderr(tmp_path, 1)
