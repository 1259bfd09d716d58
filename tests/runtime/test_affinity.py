"""pin_rank: each local rank on its own slice of the cores, unless turned off (PYPLAN_PIN_CPUS=0)."""

from __future__ import annotations

import os

import pytest

from tests.runtime._forked import forked_probes

_SETUP = """
import os, torch
from pyplan.runtime.affinity import pin_rank
"""
_PROBE = """
torch.set_num_threads(4)
first = pin_rank()
again = pin_rank()
result = {"first": list(first), "again": list(again), "cores": sorted(os.sched_getaffinity(0)),
          "threads": torch.get_num_threads()}
"""

CORES = sorted(os.sched_getaffinity(0))
SLICES = [(0, {}), (1, {}), (1, {"PYPLAN_PIN_CPUS": "1"})]
UNPINNED = [
    {"PYPLAN_PIN_CPUS": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
    {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(len(CORES) + 1)},
    {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},  # one rank: nothing to keep apart
    {},  # no local rank and no process group: nothing to go by
]


def _env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PYPLAN_PIN")} | env


@pytest.fixture(scope="module")
def pinned() -> list[dict]:
    """pin_rank under each environment of SLICES, then of UNPINNED, each in a process of its own (pinning the test
    process would slow the rest of the suite), forked from one that imported torch once."""
    envs = [_env({**env, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}) for rank, env in SLICES]
    return forked_probes(_SETUP, _PROBE, envs + [_env(env) for env in UNPINNED])


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
@pytest.mark.parametrize(("rank", "env"), SLICES)
def test_each_local_rank_gets_its_own_slice(pinned: list[dict], rank: int, env: dict[str, str]) -> None:
    got = pinned[SLICES.index((rank, env))]
    per = len(CORES) // 2
    assert got["first"] == CORES[rank * per : (rank + 1) * per]
    assert got["cores"] == got["first"]
    assert got["again"] == got["first"]  # a second trainer in the process keeps the slice
    assert got["threads"] == min(4, per)


def test_nothing_is_pinned_when_turned_off_or_when_ranks_outnumber_cores(pinned: list[dict]) -> None:
    for env, got in zip(UNPINNED, pinned[len(SLICES) :], strict=True):
        assert got["first"] == [] and got["cores"] == CORES and got["threads"] == 4, env
