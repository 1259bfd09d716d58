"""Run under torchrun: the parts of one launch, each a script beside this file, in one process group.

`torchrun --nproc-per-node N tests/runtime/_launch.py OUT_DIR PART...` runs each part's `run_part(path)` in turn,
path = OUT_DIR/PART.json, where rank 0 writes the part's results. A part that fails writes path.rank<r>.error and
ends the process (its other ranks may be blocked in a collective); the parts after it do not run, and
tests/runtime/conftest.py launches them again without it. A torchrun launch costs 7-10 s of start-up on 2 cores
(TORCH_FACTS.md): the tests share one launch per world size instead of one each.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist


def main(argv: list[str]) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    folder, parts = argv[0], argv[1:]
    for part in parts:
        path = os.path.join(folder, f"{part}.json")
        try:
            importlib.import_module(part).run_part(path)
        except Exception as exc:
            # What the part did not record itself, in the form the parts' own records take.
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            with open(f"{path}.rank{rank}.error", "w") as f:
                json.dump([{"part": part, "ok": False, "why": f"rank {rank}: {type(exc).__name__}: {exc}"}], f)
            os._exit(1)
        dist.barrier()
    dist.destroy_process_group()
    # Meshes sometimes abort the process at exit after a clean shutdown (TORCH_FACTS.md); exit at once.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
