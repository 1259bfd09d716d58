"""The workload's optimizers by name (no torch.distributed import: `pyplan calibrate` times them alone)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pyplan.errors import PlanError

__all__ = ["LR_DECAYS", "OptimizerFactory", "OptimizerSpec", "hand_hyperparameters", "lr_factor", "optimizer_factory"]

LR_DECAYS = ("none", "linear", "cosine")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its arguments: a factory that ZeRO's sharded optimizer can also be built from."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def optimizer_factory(name: str, lr: float) -> OptimizerSpec:
    """The workload's optimizer by name (pyplan.model_state.OPTIMIZERS) at learning rate `lr`."""
    makers = {
        "sgd": OptimizerSpec(torch.optim.SGD, {"lr": lr}),
        "sgd-momentum": OptimizerSpec(torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "adam": OptimizerSpec(torch.optim.Adam, {"lr": lr}),
        "adamw": OptimizerSpec(torch.optim.AdamW, {"lr": lr}),
    }
    if name not in makers:
        raise PlanError(f"unknown optimizer '{name}'; choose one of {', '.join(makers)}")
    return makers[name]


def hand_hyperparameters(outer: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """Give `inner` (the optimizer over one replica's share) the hyperparameters of `outer`'s first group, which
    learning-rate schedules change (ZeRO-1 over DTensors, master weights)."""
    for group in inner.param_groups:
        group.update({k: v for k, v in outer.param_groups[0].items() if k != "params"})


def lr_factor(step: int, steps: int, warmup: int, decay: str, floor: float = 0.1) -> float:
    """The share of the learning rate at optimizer step `step` (from 0) of `steps`: a linear warm-up over `warmup`
    steps, then constant ("none") or decaying to `floor` at the last step ("linear", "cosine"), as torchtitan's
    scheduler does. For torch.optim.lr_scheduler.LambdaLR."""
    if decay not in LR_DECAYS:
        raise PlanError(f"unknown learning-rate decay '{decay}'; choose one of {', '.join(LR_DECAYS)}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay == "none" or steps - warmup <= 1:
        return 1.0
    done = min(1.0, (step - warmup) / (steps - warmup - 1))
    shape = 1.0 - done if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return floor + (1.0 - floor) * shape
