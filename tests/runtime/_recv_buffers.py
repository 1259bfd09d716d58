"""Run under torchrun (4 ranks, pp 4; tests/runtime/_launch.py): the receive buffers each stage holds under every
schedule, and the training.

For each schedule a chain of 8 layers of different widths (float64) is cut into one stage per layer pair (pp·v
stages), trained 2 steps of 64 micro-batches, and compared with one process training on the same global batch.
Rank 0 writes to the file `run_part` is given one record per schedule: {"schedule", "v", "m", "stages": {stage:
{"input": [count, bytes], "gradient": [count, bytes]}} (the most receive buffers alive when a computation started,
each rank's stages merged), "cut_bytes": [bytes of one micro-batch's values at each stage boundary], "loss": the
largest relative error of a micro-batch's loss, "grad": the largest relative error of a gradient after the last
step, "param": the same for a parameter}.
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pyplan import cut_points, trace
from pyplan.plan import Layout
from pyplan.runtime.recv import GRADIENT, INPUT
from pyplan.runtime.trainer import OptimizerSpec, build_trainer
from pyplan.spec import ModelSpec

PP, M, B, STEPS = 4, 64, 1, 2
WIDTHS = (6, 10, 14, 18, 22, 18, 14, 10, 6)  # 8 layers: each stage boundary a different size
SCHEDULES = (
    ("GPipe", 1),
    ("1F1B", 1),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
)
OPTIMIZER = OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


def _build() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers)


def _inputs(n: int) -> tuple[torch.Tensor]:
    return (torch.randn(n, WIDTHS[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64),)


def _target(n: int) -> torch.Tensor:
    return torch.randn(n, WIDTHS[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)


SPEC = ModelSpec(name="widths", build=_build, example_inputs=_inputs, loss=nn.functional.mse_loss, target=_target)


@functools.cache
def _cuts(num_stages: int) -> tuple[int, ...]:
    """Cuts after every 8 / num_stages layers (a Linear and its Tanh each)."""
    points = cut_points(trace(_build().double(), _inputs, batch_size=B))
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    assert len(inner) >= 2 * (len(WIDTHS) - 1) - 1, inner
    per = 2 * (len(WIDTHS) - 1) // num_stages
    return (0, *(inner[per * k - 1] for k in range(1, num_stages)), len(points.order))


def _reference(steps: int) -> tuple[nn.Module, list[list[float]]]:
    """One process: gradient accumulation over the same micro-batches, mean loss."""
    torch.manual_seed(0)
    model = _build().double()
    opt = OPTIMIZER(model.parameters())
    x, y = _inputs(M * B)[0], _target(M * B)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        step = []
        for k in range(M):
            loss = nn.functional.mse_loss(model(x[k * B : (k + 1) * B]), y[k * B : (k + 1) * B])
            (loss / M).backward()
            step.append(loss.item())
        opt.step()
        losses.append(step)
    return model, losses


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def run(schedule: str, v: int, reference: nn.Module, ref_losses: list[list[float]]) -> dict[str, Any]:
    layout = Layout(
        dp=1,
        pp=PP,
        micro_batch_size=B,
        num_microbatches=M,
        schedule=schedule,
        stages_per_rank=v,
        cut_positions=_cuts(PP * v),
    )
    torch.manual_seed(0)
    trainer: Any = build_trainer(SPEC, _build().double(), layout, OPTIMIZER)
    x, y = _inputs(M * B), _target(M * B)
    loss_err = 0.0
    for step in range(STEPS):
        got = trainer.step(x, y)
        if trainer.has_last:
            want = torch.tensor(ref_losses[step], dtype=torch.float64)
            loss_err = max(loss_err, _error(torch.stack(got).detach(), want))
    ref = dict(reference.named_parameters())
    grad_err = param_err = 0.0
    for module in trainer.modules:
        for name, p in module.piece.named_parameters():
            grad_err = max(grad_err, _error(p.grad, ref[name].grad))
            param_err = max(param_err, _error(p.detach(), ref[name].detach()))
    peaks = {
        s: {kind: [h.count, h.nbytes] for (t, kind), h in trainer.receives.peak.items() if t == s}
        for s in trainer.stage_indices
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"peaks": peaks, "errors": [loss_err, grad_err, param_err]})
    stages = {s: {INPUT: [0, 0], GRADIENT: [0, 0]} | kinds for g in gathered for s, kinds in g["peaks"].items()}
    errors = [max(g["errors"][i] for g in gathered) for i in range(3)]
    layers = len(WIDTHS) - 1
    boundary = [WIDTHS[s * layers // layout.num_stages] * 8 * B for s in range(layout.num_stages + 1)]
    return dict(schedule=schedule, v=v, m=M, stages=stages, cut_bytes=boundary, loss=errors[0], grad=errors[1],
                param=errors[2])  # fmt: skip


def run_part(path: str) -> None:
    """Every schedule, in the launch's process group (tests/runtime/_launch.py)."""
    reference, ref_losses = _reference(STEPS)
    records = [run(schedule, v, reference, ref_losses) for schedule, v in SCHEDULES]
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(records, f)
