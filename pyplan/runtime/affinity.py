"""Each CPU rank on cores of its own, on request (PYPLAN_PIN_CPUS=1).

On a CPU, a rank of one compute thread shares the machine with the other ranks and with gloo's I/O threads. Left
to the scheduler, a rank's threads wander between cores: a gloo thread that wakes up to move a message may wait for
a core another rank's compute holds, and the rank posting its next send waits for that thread. Pinned, a rank's
gloo threads run on its own cores. Measured on this project's 2-core VM, both ways:
  - pipelines ran faster pinned: gpt-tiny on 1 x 2 stages, GPipe, 8 micro-batches, 44-51 ms a step unpinned and
    38-40 ms pinned; resnet-tiny 1 x 2, GPipe, 8 micro-batches, 67-74 ms and 52-58 ms; data parallel alike;
  - but a rank that sleeps in a receive is woken on its own, idle core, which a VM may have halted: gloo's
    ping-pong latency went from 0.12 ms to 1.5-2 ms pinned (a woken thread on a halted virtual CPU).
So pinning is off by default; `pyplan calibrate` and the runtime both follow PYPLAN_PIN_CPUS, so that the
calibrated costs are those of the runtime as it runs.

`pin_rank` gives local rank r of w the r-th of w equal slices of the cores this process may use, sets every thread
of the process to it (threads started later inherit it) and caps torch's intra-op threads at the slice's size. It
does nothing when the ranks outnumber the cores (the slices would be empty) or unless PYPLAN_PIN_CPUS=1.
"""

from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["pin_rank"]

ENV = "PYPLAN_PIN_CPUS"
_PINNED = "PYPLAN_PINNED_CPUS"  # "pid:cores" once pinned: a second trainer in the process keeps the first's slice


def _local_rank_and_size() -> tuple[int, int] | None:
    """This process's local rank and the local world size: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else the
    global rank and world size of a process group small enough to be one machine's."""
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        if size <= len(os.sched_getaffinity(0)):
            return dist.get_rank(), size
    return None


def pin_rank() -> tuple[int, ...]:
    """With PYPLAN_PIN_CPUS=1, pin this process (every thread) to its local rank's slice of the usable cores;
    returns the slice, empty when nothing was pinned (see the module docstring)."""
    if os.environ.get(ENV, "0") != "1" or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
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
