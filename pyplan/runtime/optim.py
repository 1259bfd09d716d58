"""The workload's optimizers by name (no torch.distributed import: `pyplan calibrate` times them alone)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pyplan.errors import PlanError

__all__ = ["OptimizerFactory", "OptimizerSpec", "optimizer_factory"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its arguments: a factory that ZeRO's sharded optimizer can also be built from."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def optimizer_factory(name: str, lr: float) -> OptimizerSpec:
    """The workload's optimizer by name (pyplan.profile.memory.OPTIMIZERS) at learning rate `lr`."""
    makers = {
        "sgd": OptimizerSpec(torch.optim.SGD, {"lr": lr}),
        "sgd-momentum": OptimizerSpec(torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "adam": OptimizerSpec(torch.optim.Adam, {"lr": lr}),
        "adamw": OptimizerSpec(torch.optim.AdamW, {"lr": lr}),
    }
    if name not in makers:
        raise PlanError(f"unknown optimizer '{name}'; choose one of {', '.join(makers)}")
    return makers[name]
