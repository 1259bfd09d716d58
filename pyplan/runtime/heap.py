"""A CPU rank keeps the memory its step frees, instead of handing it back to the kernel and faulting it in again.

torch's CPU allocator is the C library's malloc. glibc serves a large block (above its mmap threshold, 128 KiB to
32 MiB as it adapts) with a fresh mapping and unmaps it on free, and gives the top of its heap back to the kernel
when more than the trim threshold lies free there. A training step grows to its peak (every micro-batch's
activations under GPipe) and frees it all, so the next step touches fresh pages again, each a page fault the
kernel zeroes. Measured on this project's 2-core VM (one process, one thread, `build_trainer` on one stage, ten
steps after three):
  - resnet-tiny, b = 8, m = 2: GPipe 750-1,100 minor faults a step, 34-37 ms a step against 1F1B's 33-34 ms;
    with the heap kept, 0-25 faults and 32.5-33 ms against 32-32.5 ms;
  - gpt-tiny, b = 16, m = 2: 40-220 faults, 23.7-25.8 ms; kept, 10-20 faults, 22.1-23.4 ms.
About 3 µs of kernel time a fault: the steps' profile (blocks timed one at a time, their memory reused) never pays
it, so a pipeline that grows its memory ran slower than predicted, and GPipe slower than 1F1B with the same work.

`keep_freed_memory` turns both off for the process (`mallopt`: no mmap for large blocks, no trimming), once; what a
step frees is reused by the next step, and the process holds its peak until it exits, which a training process
reaches every step anyway. It does nothing where the C library has no `mallopt` (macOS, Windows) and on request
(PYPLAN_KEEP_HEAP=0). The runtime calls it on CPU ranks; `pyplan calibrate` runs its probes the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_memory"]

ENV = "PYPLAN_KEEP_HEAP"
_DONE = "PYPLAN_HEAP_KEPT"  # set to the pid once done: a second trainer in the process does nothing

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make this process's malloc keep freed memory (see the module docstring); True when it does (now or from an
    earlier call), False where it cannot or PYPLAN_KEEP_HEAP=0."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if os.environ.get(_DONE) == str(os.getpid()):
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; a C library that knows neither option (musl's is a no-op) says 0 or ignores it.
    kept = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    if kept:
        os.environ[_DONE] = str(os.getpid())
    return kept
