"""Run under torchrun with 2 processes by benchmarks/hf_types.py: step (3), a 2-stage pipeline against one process.

argv: a JSON file of [{"type", "ref", "dtype"}, ...] and the JSON-lines file the records are appended to. For each
model in turn, every rank builds its stage of the model cut in two at the middle cut, trains 2 steps of 1F1B over 4
micro-batches of 2 with SGD, and the last stage compares its losses of steps 0 and 1 with one process training the
same model on the same batch (float64 to 1e-9, float32 to 1e-5, relative). Rank 1 appends one record per model. A
model that raises writes its record and ends the launch (the other rank may be waiting in a send); one that hangs
past the time limit ends it through faulthandler: benchmarks/hf_types.py reruns the models left in a new launch.
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from pyplan import Layout, cut_points, load_model, trace
from pyplan._torch import tree_map_only
from pyplan.graph.trace import Call, call_at, input_tensors, output_tensors
from pyplan.runtime.trainer import OptimizerSpec, build_trainer
from pyplan.spec import default_loss

STEPS = 2
MICRO_BATCH, MICRO_BATCHES = 2, 4
TOL = {"float64": 1e-9, "float32": 1e-5}
SGD = OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})
HANG_S = float(os.environ.get("HF_TYPES_HANG_S", "600"))


def _cast(call: Call, dtype: torch.dtype) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, call)


def middle_cut(ref: str) -> tuple[int, int, int]:
    """Cut positions of 2 stages: the candidate cut nearest the middle of the traced order."""
    spec = load_model(ref)
    points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO_BATCH))
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    if not inner:
        raise ValueError("no cut between the first and the last operation: one stage only")
    return 0, inner[len(inner) // 2], len(points.order)


def pipeline(ref: str, dtype_name: str) -> dict[str, Any]:
    """Train `ref` as 2 stages on this rank; on the last stage, its losses against one process."""
    dtype = getattr(torch, dtype_name)
    spec = load_model(ref)
    layout = Layout(
        dp=1,
        pp=2,
        micro_batch_size=MICRO_BATCH,
        num_microbatches=MICRO_BATCHES,
        schedule="1F1B",
        cut_positions=middle_cut(ref),
    )
    torch.manual_seed(0)
    model = spec.build().to(dtype)
    reference = copy.deepcopy(model)
    trainer = build_trainer(
        spec, model, layout, SGD, example_inputs=lambda n: _cast(call_at(spec.example_inputs, n), dtype)
    )
    batch = MICRO_BATCH * MICRO_BATCHES
    call = _cast(call_at(spec.example_inputs, batch), dtype)
    target = spec.target(batch) if spec.target is not None else None
    loss_fn = spec.loss or default_loss
    optimizer = SGD(reference.parameters())
    got, want = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        step = []
        for k in range(MICRO_BATCHES):
            sl = slice(k * MICRO_BATCH, (k + 1) * MICRO_BATCH)
            args, kwargs = tree_map_only(torch.Tensor, lambda t, sl=sl: t[sl], call)
            loss = loss_fn(output_tensors(reference(*args, **kwargs)), target[sl] if target is not None else None)
            (loss / MICRO_BATCHES).backward()
            step.append(loss.item())
        optimizer.step()
        want.append(sum(step) / MICRO_BATCHES)
        losses = trainer.step(input_tensors(call), target)
        if trainer.has_last:
            got.append(sum(t.item() for t in losses) / MICRO_BATCHES)
    if not trainer.has_last:
        return {}
    err = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want, strict=True))
    ok = err <= TOL[dtype_name]
    why = "" if ok else f"loss differs by {err:.1e} (relative) from one process, tolerance {TOL[dtype_name]:.0e}"
    return {"ok": ok, "why": why, "losses": got, "reference": want, "rel_err": err, "dtype": dtype_name}


def _append(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    jobs_path, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    with open(jobs_path) as f:
        jobs = json.load(f)
    for job in jobs:
        # A hang (a mismatched send or receive) ends the launch after printing every rank's stack.
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        started = time.perf_counter()
        try:
            result = pipeline(job["ref"], job["dtype"])
        except Exception as exc:
            text = str(exc).strip()
            why = f"rank {rank}: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            _append(out_path, {"type": job["type"], "step": "pipeline", "ok": False, "why": why})
            sys.stderr.flush()
            os._exit(1)
        if result:
            _append(out_path, {"type": job["type"], "step": "pipeline", **result,
                               "s": round(time.perf_counter() - started, 2)})  # fmt: skip
        dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    os._exit(0)  # meshes sometimes abort the process at exit after a clean shutdown (TORCH_FACTS.md)


if __name__ == "__main__":
    main()
