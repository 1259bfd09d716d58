"""keep_freed_memory: a CPU rank reuses what its last step freed instead of faulting fresh pages in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# A step-like cycle: allocate two tensors of 40 MiB (above the most glibc's adaptive mmap threshold grows to, 32 MiB),
# touch them, free them; the faults of the later cycles are what every steady step pays. (Smaller blocks show it
# too, with a pattern of sizes as a training step has; glibc's adaptive threshold hides it for one size repeated.)
_PROBE = """
import json, resource, torch
from pyplan.runtime.heap import keep_freed_memory
kept = keep_freed_memory() if KEEP else False
def cycle():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(10 * 2**20) for _ in range(2)]
    del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
cycle()
again = keep_freed_memory() if KEEP else False
print(json.dumps({"kept": kept, "again": again, "faults": [cycle() for _ in range(4)][2:]}))
"""


def _run(keep: bool, env: dict[str, str] | None = None) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PYPLAN_")} | (env or {})
    out = subprocess.run(
        [sys.executable, "-c", f"KEEP = {keep}\n" + _PROBE],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults() -> None:
    default, kept = _run(False), _run(True)
    assert kept["kept"] and kept["again"]
    pages = 80 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    # glibc's default maps each block afresh and unmaps it on free; kept, the pages stay with the process.
    assert min(default["faults"]) > pages // 2
    assert max(kept["faults"]) < pages // 20


def test_off_on_request() -> None:
    got = _run(True, {"PYPLAN_KEEP_HEAP": "0"})
    assert got["kept"] is False and got["again"] is False
