"""Each ZeRO stage's model state per rank, as the runtime holds it, against the plan's to the byte (dp = 2, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan import load_model
from pyplan.plan import Workload
from pyplan.solve.state import stage_state_bytes, zero1_shares

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zero_state.py")


def test_zero1_gives_each_tensor_to_the_emptiest_replica_largest_first() -> None:
    assert zero1_shares([5, 1, 3, 3], 2) == [[0, 1], [2, 3]]
    assert zero1_shares([4, 4, 4], 2) == [[0, 2], [1]]


@pytest.mark.distributed
def test_each_rank_holds_the_model_state_the_plan_counts(tmp_path: Path) -> None:
    out = tmp_path / "held.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    held = json.loads(out.read_text())
    shapes = [tuple(p.shape) for p in load_model("zoo:gpt-tiny").build().parameters()]
    for key, ranks in held.items():
        zero, precision = key.split("/")
        plan = stage_state_bytes(shapes, Workload(global_batch=8, precision=precision), 2, int(zero))
        # The plan counts the fullest replica (ZeRO-1's greedy split gives the ranks different shares).
        assert max(ranks) == plan, (key, ranks, plan)
