"""Timing blocks beside companion processes (TimingOptions.corun), as the other ranks on one CPU run."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pyplan import TimingOptions, linearize, trace
from pyplan.hardware import Cluster
from pyplan.profile.capture import timing_options
from pyplan.profile.measure import _companions, block_times

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="companions are forked")


def _children() -> set[int]:
    """This process's live children (Linux /proc; empty elsewhere)."""
    out: set[int] = set()
    for task in Path("/proc/self/task").glob("*"):
        with contextlib.suppress(OSError):
            out |= {int(pid) for pid in (task / "children").read_text().split()}
    return out


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def test_companions_run_the_work_until_the_block_ends() -> None:
    read, write = os.pipe()

    def work() -> None:
        os.write(write, b"x")
        time.sleep(0.01)

    before = _children()
    with _companions(2, work):
        time.sleep(0.3)
        assert len(_children() - before) == 2
    os.close(write)
    seen = b""
    while chunk := os.read(read, 4096):
        seen += chunk
    os.close(read)
    # Two companions wrote for 0.3 s, one byte each 10 ms; both are gone (their pipe ends closed, read saw EOF).
    assert len(seen) >= 2 * 5
    assert _children() <= before


def test_a_companion_that_fails_is_an_error_not_a_quiet_profile() -> None:
    def work() -> None:
        raise ValueError("broken")

    before = _children()
    with pytest.raises(RuntimeError, match="stopped; time with corun=0"), _companions(1, work):
        time.sleep(0.2)
    assert _children() <= before


def test_no_companion_forks_nothing() -> None:
    calls = []
    with _companions(0, lambda: calls.append(1)):
        pass
    assert calls == []


def test_blocks_timed_beside_a_companion_that_runs_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    chain = linearize(trace(model, lambda b: (torch.randn(b, 64),), batch_size=4), min_blocks=4)
    before, cpu = _children(), _children_cpu_s()
    times = block_times(chain, lambda b: (torch.randn(b, 64),), [2, 8], options=TimingOptions(repeats=3, corun=1))
    assert _children_cpu_s() > cpu  # the companion computed while the blocks were timed
    assert len(times) == len(chain)
    assert all(f(8) > 0 and b(8) > 0 for f, b in times)
    assert _children() <= before


def test_chain_for_times_beside_the_other_ranks_of_this_machine() -> None:
    cores = os.cpu_count() or 1
    assert timing_options(Cluster.from_catalog("local", 1)).corun == 0
    assert timing_options(Cluster.from_catalog("local", 2)).corun == min(2, cores) - 1
    assert timing_options(Cluster.from_catalog("local", 64)).corun == min(64, cores) - 1
