"""Run under torchrun (2 ranks; tests/runtime/_launch.py): the model state each rank holds after a step, per ZeRO
stage and precision; and training state checkpointed under one layout and resumed under another.

Rank 0 writes to the file `run_part` is given {"held": {"<zero>/<precision>": [held bytes of rank 0, of rank 1,
...]}, "resumed": {"<from> -> <to>": [largest relative error of a parameter against one process, on any rank;
|gradient norm of each step - one process's| / one process's, largest over the steps]}, "mixed": ZeRO-3
bf16-mixed's largest relative gradient error against its arithmetic in one process, "master": {"<layout>": the same
for bf16-master}, "master_resumed": {"<from> -> <to>": largest relative error of a master weight against 3 steps
without a checkpoint}}: held bytes are the unique storages of the rank's parameters, gradients and optimizer state
(local shards of sharded tensors; beside 16-bit weights, the fp32 gradients and master weights)."""

from __future__ import annotations

import json
import os
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from pyplan import cut_points, load_model, trace
from pyplan.graph.trace import call_at, input_tensors
from pyplan.plan import Layout
from pyplan.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from pyplan.runtime.master import MasterWeights
from pyplan.runtime.trainer import build_trainer, optimizer_factory, replica_slice
from pyplan.spec import ModelSpec

MODEL, BATCH, MICRO, CLIP = "zoo:gpt-tiny", 8, 2, 1.0


def _held(tensors: list[torch.Tensor]) -> int:
    storages: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def run_part(path: str) -> None:
    """Every check, in the launch's process group (tests/runtime/_launch.py)."""
    spec = load_model(MODEL)
    end = len(cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO)).order)
    call, target = call_at(spec.example_inputs, BATCH), spec.target(BATCH)
    held, master = {}, {}
    for precision in ("fp32", "bf16-mixed", "bf16-master", "bf16-master-bf16-grads"):
        for zero in (0, 1) if precision.startswith("bf16-master") else (0, 1, 3):
            layout = Layout(dp=2, pp=1, micro_batch_size=MICRO, num_microbatches=BATCH // (2 * MICRO), schedule="1F1B",
                            cut_positions=(0, end), zero_stage=zero)  # fmt: skip
            torch.manual_seed(0)
            trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", 1e-3), precision=precision)
            mine = replica_slice(layout, trainer.dp_rank)
            trainer.step(tuple(t[mine] for t in input_tensors(call)), target[mine])
            params = list({id(p): p for m in trainer.modules for p in m.parameters()}.values())
            if isinstance(trainer.optimizer, MasterWeights):
                state = [v for s in trainer.optimizer.master_state.values() for v in s.values() if torch.is_tensor(v)]
                grads = [g for _, g in trainer.optimizer.gradients()]
            else:
                optimizer = getattr(trainer.optimizer, "optim", trainer.optimizer)  # ZeroRedundancyOptimizer's own
                state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
                grads = [p.grad for p in params if p.grad is not None]
            held[f"{zero}/{precision}"] = _held(params) + _held(grads) + _held(state)
            if zero == 3 and precision == "bf16-mixed":
                got = {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}
                mixed = _bf16_gradient_error(spec, layout, got, call, target)
            if precision.startswith("bf16-master"):
                grads_by_name = _main_grads(trainer)
                key = f"dp 2 ZeRO-{zero}" + (" bf16 grads" if precision.endswith("grads") else "")
                master[key] = _bf16_gradient_error(spec, layout, grads_by_name, call, target)
                master[key + " dtype"] = str({g.dtype for g in grads_by_name.values()})
    # Buckets of 64 KiB: several, all-reduced in order as the backward makes them, most before it ends.
    master["buckets"] = _small_buckets(spec, end, call, target)
    # A pipeline of 2 stages in bf16-master: its boundaries in bf16.
    points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO))
    middle = [c.position for c in points.candidates if 0 < c.position < end]
    layout = Layout(1, 2, MICRO, BATCH // MICRO, "1F1B", (0, middle[len(middle) // 2], end))
    torch.manual_seed(0)
    trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", 1e-3), precision="bf16-master")
    trainer.step(input_tensors(call), target)
    # The tied embedding apart: one process sums its two uses' gradients in bf16, the pipeline in fp32.
    grads = _main_grads(trainer)
    tied = {n: grads.pop(n) for n in ("transformer.wte.weight", "lm_head.weight") if n in grads}
    master["pp 2"] = _bf16_gradient_error(spec, layout, grads, call, target)
    master["pp 2 tied"] = _bf16_gradient_error(spec, layout, tied, call, target)
    everyone: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    resumed = _resumed(spec, end, os.path.dirname(path))
    master_resumed = _master_resumed(spec, end, os.path.dirname(path))
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"held": {k: [h[k] for h in everyone] for k in held}, "resumed": resumed, "mixed": mixed,
                       "master": master, "master_resumed": master_resumed}, f)  # fmt: skip


def _small_buckets(spec: ModelSpec, end: int, call: Any, target: torch.Tensor) -> list[float]:
    """bf16-master at dp 2 with 64 KiB buckets: [buckets, buckets launched before the backward ended, the largest
    relative gradient error against one process's bf16 arithmetic]."""
    layout = Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end), zero_stage=1)
    with mock.patch("pyplan.runtime.master._BUCKET_BYTES", 2**16):
        torch.manual_seed(0)
        trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", 1e-3), precision="bf16-master")
    buckets = trainer.optimizer._buckets
    early: list[int] = []
    finish = buckets.finish
    buckets.finish = lambda: (early.append(len(buckets.launched)), finish())[1]
    mine = replica_slice(layout, trainer.dp_rank)
    trainer.step(tuple(t[mine] for t in input_tensors(call)), target[mine])
    err = _bf16_gradient_error(spec, layout, _main_grads(trainer), call, target)
    return [len(buckets.buffers), early[0], err]


def _main_grads(trainer: Any) -> dict[str, torch.Tensor]:
    """The fp32 gradients beside a pipeline trainer's 16-bit weights, by the parameters' names in the model."""
    return {
        name: trainer.optimizer.main_grad(p)
        for m in trainer.modules
        for name, p in m.piece.named_parameters()
        if trainer.optimizer.main_grad(p) is not None
    }


def _bf16_gradient_error(
    spec: ModelSpec, layout: Layout, got: dict[str, torch.Tensor], call: Any, target: torch.Tensor
) -> float:
    """Training in bf16 with fp32 gradients (ZeRO-3 under FSDP2's mixed-precision policy; bf16-master) against its
    arithmetic in one process: a bf16 copy of the initial weights computes each replica's micro-batches (logits cast
    to fp32 for the loss), each gradient cast to fp32 and averaged over the replicas. The largest relative error of a
    parameter's gradient (`got`: this rank's, by name), over the ranks."""
    torch.manual_seed(0)
    reference = spec.build().to(torch.bfloat16)
    inputs, m, b = input_tensors(call), layout.num_microbatches, layout.micro_batch_size
    named = dict(reference.named_parameters(remove_duplicate=False))  # a tied weight under each of its names
    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named.items()}
    for r in range(layout.dp):
        mine = replica_slice(layout, r)
        for k in range(m):
            part = slice(k * b, (k + 1) * b)
            reference.zero_grad()
            args = tuple(t[mine][part] for t in inputs)
            (spec.loss(reference(*args).float(), target[mine][part]) / m).backward()
            for n, p in named.items():
                expected[n] += p.grad.float() / layout.dp
    worst = torch.tensor(
        [max(((g - expected[n]).abs().max() / expected[n].abs().max()).item() for n, g in got.items())]
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _master_resumed(spec: ModelSpec, end: int, folder: str) -> dict[str, float]:
    """bf16-master: 2 steps under one layout, a checkpoint, the third under another layout loaded from it, against
    3 steps under the second layout without a checkpoint: the fp32 master weights come back (rounding the bf16
    weights up would miss by up to 2^-9 of a weight)."""
    inputs, target = input_tensors(call_at(spec.example_inputs, BATCH)), spec.target(BATCH)
    layouts = {
        "dp 2": Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end)),
        "dp 2 ZeRO-1": Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end), zero_stage=1),
    }

    def masters(trainer: Any) -> dict[str, torch.Tensor]:
        names = {id(p): n for m in trainer.modules for n, p in m.piece.named_parameters()}
        return {names[id(p)]: s["master"] for p, s in trainer.optimizer.master_state.items()}

    out = {}
    for first, then in (("dp 2 ZeRO-1", "dp 2"), ("dp 2", "dp 2 ZeRO-1")):
        path = os.path.join(folder, "master_" + first.replace(" ", "_"))
        got: dict[str, torch.Tensor] = {}
        for layout, steps, resume in ((layouts[then], 3, False), (layouts[first], 2, False), (layouts[then], 1, True)):
            torch.manual_seed(1 if resume else 0)
            trainer = build_trainer(
                spec, spec.build(), layout, optimizer_factory("adamw", 1e-2), precision="bf16-master"
            )
            if resume:
                assert load_checkpoint(trainer, latest_checkpoint(path)) == 2
            mine = replica_slice(layout, trainer.dp_rank)
            for _ in range(steps):
                trainer.step(tuple(t[mine] for t in inputs), target[mine], max_norm=CLIP)
            if steps == 3:
                expected = masters(trainer)
            elif not resume:
                save_checkpoint(trainer, 2, path, keep=1)
            else:
                got = masters(trainer)
        err = max(((m - expected[n]).abs().max() / expected[n].abs().max()).item() for n, m in got.items())
        worst = torch.tensor([err])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[f"{first} -> {then}"] = worst.item()
    return out


def _resumed(spec: ModelSpec, end: int, folder: str) -> dict[str, list[float]]:
    """AdamW with the gradient clipped to a norm every step binds: 2 steps under one layout, a checkpoint, the third
    step under another layout loaded from it, against one process training 3 steps (float64)."""
    torch.set_default_dtype(torch.float64)
    inputs, target = input_tensors(call_at(spec.example_inputs, BATCH)), spec.target(BATCH)
    torch.manual_seed(0)
    reference = spec.build()
    opt = optimizer_factory("adamw", 1e-2)(reference.parameters())
    norms = []
    for _ in range(3):
        opt.zero_grad()
        for k in range(BATCH // MICRO):
            part = slice(k * MICRO, (k + 1) * MICRO)
            (spec.loss(reference(*(t[part] for t in inputs)), target[part]) / (BATCH // MICRO)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        opt.step()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO))
    inner = [c.position for c in points.candidates if 0 < c.position < end]
    layouts = {
        "pp 2": Layout(1, 2, MICRO, BATCH // MICRO, "1F1B", (0, inner[len(inner) // 2], end)),
        "dp 2": Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end)),
        "dp 2 ZeRO-1": Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end), zero_stage=1),
        "dp 2 ZeRO-3": Layout(2, 1, MICRO, BATCH // MICRO // 2, "1F1B", (0, end), zero_stage=3),
    }
    out = {}
    for first, then in (
        ("pp 2", "dp 2 ZeRO-3"),
        ("dp 2 ZeRO-3", "pp 2"),
        ("dp 2 ZeRO-1", "dp 2"),
        ("dp 2", "dp 2 ZeRO-1"),
    ):
        seen = []
        path = os.path.join(folder, first.replace(" ", "_"))
        for layout, steps in ((layouts[first], 2), (layouts[then], 1)):
            torch.manual_seed(0 if steps == 2 else 1)  # resumed: other weights, which only the checkpoint replaces
            trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", 1e-2))
            if steps == 1:
                assert load_checkpoint(trainer, latest_checkpoint(path)) == 2
            mine = replica_slice(layout, trainer.dp_rank)
            for _ in range(steps):
                trainer.step(tuple(t[mine] for t in inputs), target[mine], max_norm=CLIP)
                seen.append(trainer.grad_norm)
            if steps == 2:
                save_checkpoint(trainer, 2, path, keep=1)
        err = max(
            ((p - expected[n]).abs().max() / expected[n].abs().max()).item() for n, p in trainer.parameters().items()
        )
        worst = torch.tensor([err])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[f"{first} -> {then}"] = [worst.item(), max(abs(a - b) / b for a, b in zip(seen, norms, strict=True))]
    torch.set_default_dtype(torch.float32)
    return out
