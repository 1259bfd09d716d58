"""pin_rank: each local rank on its own slice of the cores, unless turned off (PYPLAN_PIN_CPUS=0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, os, torch
from pyplan.runtime.affinity import pin_rank
torch.set_num_threads(4)
first = pin_rank()
again = pin_rank()
print(json.dumps({"first": list(first), "again": list(again), "cores": sorted(os.sched_getaffinity(0)),
                  "threads": torch.get_num_threads()}))
"""


def _pin(env: dict[str, str]) -> dict[str, list[int] | int]:
    """pin_rank in a fresh process (pinning the test process would slow the rest of the suite)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYPLAN_PIN")} | env
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
@pytest.mark.parametrize(("rank", "env"), [(0, {}), (1, {}), (1, {"PYPLAN_PIN_CPUS": "1"})])
def test_each_local_rank_gets_its_own_slice(rank: int, env: dict[str, str]) -> None:
    got = _pin({**env, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})
    per = len(CORES) // 2
    assert got["first"] == CORES[rank * per : (rank + 1) * per]
    assert got["cores"] == got["first"]
    assert got["again"] == got["first"]  # a second trainer in the process keeps the slice
    assert got["threads"] == min(4, per)


def test_nothing_is_pinned_when_turned_off_or_when_ranks_outnumber_cores() -> None:
    for env in (
        {"PYPLAN_PIN_CPUS": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(len(CORES) + 1)},
        {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},  # one rank: nothing to keep apart
        {},  # no local rank and no process group: nothing to go by
    ):
        got = _pin(env)
        assert got["first"] == [] and got["cores"] == CORES and got["threads"] == 4, env
