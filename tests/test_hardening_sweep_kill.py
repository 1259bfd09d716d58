"""A killed sweep leaves no process behind, within the README's 5 s, even while its workers run C code that holds the
GIL (a thread of the worker could not run then: the kernel ends the workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_signals import _alive, _descendants

# The README's figure: every process of a killed sweep gone within this many seconds.
PROMISED_S = 5.0

# A model whose model() says it has begun, then computes for minutes in one call into C code that holds the GIL
# (built-in sum over a range never releases it).
HOLDS_THE_GIL = """
from pathlib import Path

import torch
from torch import nn


def model():
    Path(__file__).with_suffix(".started").write_text("")
    sum(range(10**11))
    return nn.Linear(8, 8)


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""

# The process that starts the sweep: two such models planned by two workers.
SWEEP = """
import sys

import pyplan

cluster = pyplan.Cluster.from_catalog(gpu="a100-80g", gpus=8)
pyplan.plan_many(sys.argv[1:], [cluster], pyplan.Workload(global_batch=8), jobs=2)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_a_killed_sweep_ends_workers_that_hold_the_gil(tmp_path: Path, signum: signal.Signals) -> None:
    models = [tmp_path / "first.py", tmp_path / "second.py"]
    for model in models:
        model.write_text(HOLDS_THE_GIL)
    proc = subprocess.Popen(
        [sys.executable, "-c", SWEEP, *map(str, models)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not all(m.with_suffix(".started").exists() for m in models):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "the workers did not start their models within 120 s"
            time.sleep(0.05)
        tree = _descendants(proc.pid)
        assert len(tree) >= 4, tree  # the sweep, the resource tracker and the two workers
        killed = time.monotonic()
        proc.send_signal(signum)
        while _alive(tree) and time.monotonic() < killed + PROMISED_S:
            time.sleep(0.02)
        took = time.monotonic() - killed
        assert not _alive(tree), f"alive {took:.1f} s after {signum.name}: {_alive(tree)}"
    finally:
        for pid in _alive(tree | _descendants(proc.pid)) - {proc.pid}:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signum
