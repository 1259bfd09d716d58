"""Each CPU rank on cores of its own (unless PYPLAN_PIN_CPUS=0).

On a CPU, a rank of one compute thread shares the machine with the other ranks and with gloo's I/O threads. Left
to the scheduler, a rank's threads wander between cores: a gloo thread that wakes up to move a message may wait for
a core another rank's compute holds, and the rank posting its next send waits for that thread. Pinned, a rank's
gloo threads run on its own cores. Measured on this project's 2-core VM (2 ranks, one thread each, gloo):
  - pipelines ran faster pinned: in benchmarks/accuracy.py's 1x2 plans at 8 micro-batches, vgg-tiny GPipe 31.9 ms a
    step pinned against 40.6 ms unpinned, 1F1B 29.0 against 42.5 ms; gpt-tiny GPipe 42.1 against 60.3 ms, 1F1B 38.4
    against 59.5 ms. Unpinned, rank 0's gloo thread spent 9 ms of kernel time a GPipe step (1 ms pinned);
  - data parallel alike (2x1 plans within the runs' noise: vgg-tiny 23.2 against 23.2 ms, resnet-tiny 38.8 against
    39.4 ms);
  - a message in a stream of them, each rank computing between messages as pipeline stages do, took as long pinned
    as unpinned (0.08-0.13 ms up to 256 KiB); but a rank that waits longer, as after a barrier, is woken on its
    own idle core, which a VM may have halted: 0.9-1.9 ms a message pinned. `pyplan calibrate` times messages in
    a stream (pyplan/profile/calibrate.py, _p2p_stream).
So CPU ranks are pinned by default; `pyplan calibrate` and the runtime both follow PYPLAN_PIN_CPUS, so that the
calibrated costs are those of the runtime as it runs.

`pin_rank` gives local rank r of w the r-th of w equal slices of the cores this process may use, sets every thread
of the process to it (threads started later inherit it) and caps torch's intra-op threads at the slice's size. It
does nothing when the ranks outnumber the cores (the slices would be empty), for a single rank, or with
PYPLAN_PIN_CPUS=0.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

__all__ = ["pin_rank"]

ENV = "PYPLAN_PIN_CPUS"
_PINNED = "PYPLAN_PINNED_CPUS"  # "pid:cores" once pinned: a second trainer in the process keeps the first's slice


def _local_rank_and_size() -> tuple[int, int] | None:
    """This process's local rank and the local world size: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else the
    global rank and world size of a process group small enough to be one machine's."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])

    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        if size <= len(os.sched_getaffinity(0)):
            return dist.get_rank(), size
    return None


def pin_rank() -> tuple[int, ...]:
    """Pin this process (every thread) to its local rank's slice of the usable cores, unless PYPLAN_PIN_CPUS=0;
    returns the slice, empty when nothing was pinned (see the module docstring)."""
    if os.environ.get(ENV, "1") == "0" or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return ()
    pid, _, pinned = os.environ.get(_PINNED, "").partition(":")
    if pid == str(os.getpid()):
        return tuple(int(c) for c in pinned.split(","))
    where = _local_rank_and_size()
    if where is None:
        return ()
    rank, size = where
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // size
    if size < 2 or per == 0 or not 0 <= rank < size:
        return ()  # one rank (nothing to keep apart), or more ranks than cores
    mine = tuple(cores[rank * per : (rank + 1) * per])
    for tid in os.listdir("/proc/self/task"):
        # A thread may have ended meanwhile, or be one the process may not move.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), mine)
    if torch.get_num_threads() > per:
        torch.set_num_threads(per)
    os.environ[_PINNED] = f"{os.getpid()}:{','.join(map(str, mine))}"
    return mine
