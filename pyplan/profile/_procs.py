"""Two spawned processes that measure something together; rank 0 writes the figures as JSON."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from pyplan.errors import PlanError


def run_two(
    worker: Callable[..., None], args: tuple[Any, ...], *, what: str, timeout_s: float, done_if_written: bool = False
) -> Any:
    """Spawn `worker(rank, out, init, *args)` on ranks 0 and 1 (`out`: where rank 0 writes its JSON, `init`: a
    file for init_process_group) and return what rank 0 wrote. Errors and timeouts are one-line PlanErrors about
    `what`. With `done_if_written`, a process that dies after rank 0 wrote its file (atomically) is not an error:
    gloo's threads now and then abort a process as it exits (SIGABRT, "terminate called without an active
    exception")."""

    with tempfile.TemporaryDirectory(prefix="pyplan-") as tmp:
        out = os.path.join(tmp, "out.json")
        ctx = mp.start_processes(
            worker, args=(out, os.path.join(tmp, "store"), *args), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise PlanError(f"the {what} took over {timeout_s:.0f} s")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise PlanError(f"the {what} failed: {last}") from None
        except mp.ProcessExitedException as exc:
            if not (done_if_written and os.path.exists(out)):
                raise PlanError(f"the {what} failed: {exc}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return json.loads(Path(out).read_text())
