"""The emitted script's wait for a batch counts against --timeout: a --data function or iterator that blocks ends the
run with one line naming what did not come, instead of a run the heartbeat keeps alive forever."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyplan.emit.script import write_script
from pyplan.plan import Layout
from tests.emit.test_script import MICRO, B, _document

TIMEOUT_S = 3

# --data functions for gpt-tiny (global batch 8): `never` blocks before it returns an iterator; `stuck` gives one
# batch and then none (on every rank, or on rank 1 alone: `stuck_on_rank_1`), blocked as a reader of a queue or a
# socket would be.
DATA = """
import os
import threading

from pyplan.load import load_model


def never():
    threading.Event().wait()


def _batches(blocks):
    spec = load_model("zoo:gpt-tiny")
    yield spec.example_inputs(8), spec.target(8)
    if blocks:
        threading.Event().wait()
    while True:
        yield spec.example_inputs(8), spec.target(8)


def stuck():
    return _batches(True)


def stuck_on_rank_1():
    return _batches(os.environ["RANK"] == "1")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_process_script(tmp_path: Path) -> Path:
    """gpt-tiny planned on one process (no pipeline, no replicas) as a training script, with DATA beside it."""
    document = _document()
    n = document.plan.layout.cut_positions[-1]
    layout = Layout(1, 1, MICRO, B // MICRO, "GPipe", (0, n))
    script = tmp_path / "train.py"
    write_script(script, _document(layout=layout))
    (tmp_path / "data.py").write_text(DATA)
    return script


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("never", "--data {data}:never: never() did not return"),
        ("stuck", "--data {data}:stuck gave no batch for step 1"),
    ],
    ids=["function", "iterator"],
)
def test_a_blocked_data_function_ends_a_run_within_the_timeout(tmp_path: Path, function: str, said: str) -> None:
    script = _one_process_script(tmp_path)
    data = tmp_path / "data.py"
    # One process as torchrun starts a rank of one (no launcher: a second's start saved).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--timeout", str(TIMEOUT_S), "--data", f"{data}:{function}"],
        capture_output=True,
        text=True,
        timeout=120,  # without the limit, the run would wait for its batch without end
        env=env,
        cwd=tmp_path,
    )
    took = time.monotonic() - began
    expected = (
        f"error: {said.format(data=data)} within --timeout {TIMEOUT_S} s (the wait for a batch counts against it); "
        "ending the run"
    )
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [expected]), done.stderr[-3000:]
    assert took < 60  # startup, at most a step, the timeout and the watch's second


def _stderr_of_ranks(logs: Path) -> dict[int, str]:
    return {int(p.parent.name): p.read_text() for p in logs.glob("*/attempt_0/*/stderr.log")}


@pytest.mark.distributed
def test_a_rank_blocked_in_its_data_ends_the_run_with_one_line(tmp_path: Path) -> None:
    """Rank 1's iterator blocks at step 1 while rank 0 waits for it in the step's collectives and both keep beating:
    rank 1 ends the run, saying why, and rank 0, which then sees rank 1 gone, says nothing more."""
    script = tmp_path / "train.py"
    write_script(script, _document())  # a pipeline of 2 stages
    (tmp_path / "data.py").write_text(DATA)
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3"]
    args = ["--steps", "3", "--timeout", str(TIMEOUT_S), "--data", f"{tmp_path / 'data.py'}:stuck_on_rank_1"]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *argv, str(script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    lines = {rank: [x for x in text.splitlines() if x.strip()] for rank, text in _stderr_of_ranks(logs).items()}
    said = f"--data {tmp_path / 'data.py'}:stuck_on_rank_1 gave no batch for step 1"
    pattern = re.escape(f"error: {said} within --timeout {TIMEOUT_S} s") + r" \(.*\); ending the run"
    assert len(lines[1]) == 1 and re.fullmatch(pattern, lines[1][0]), lines
    assert lines[0] == [], lines
