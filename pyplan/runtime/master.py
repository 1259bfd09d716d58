"""16-bit weights trained through fp32 master weights: the "bf16-master" precisions, Megatron-LM's bf16.

The model computes in its own 16-bit weights (no autocast). Each parameter's gradient is added, as autograd makes it,
into a gradient of its own (`main_grads`, fp32 or, as NeMo's performance recipes run, bf16), and autograd's freed:
micro-batches accumulate, and the replicas average, in that dtype. The optimizer steps fp32 copies of the weights
(the master weights) with those gradients (an fp32 copy of 16-bit ones while it steps) and its states in fp32, and
the weights are the master weights rounded back. Under ZeRO-1 each replica keeps the master weights and states of its
share of the tensors only (`zero1_shares`, the split the plan counts) and the owner of each tensor broadcasts its new
16-bit weights. Per parameter element: 2 + 4 (or 2) bytes on every replica, 12 (master weight and AdamW's two
states) on one or on every replica, as `pyplan.model_state.PRECISIONS` counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pyplan.runtime.optim import OptimizerSpec
from pyplan.solve.state import zero1_shares

__all__ = ["MasterWeights"]


class MasterWeights(torch.optim.Optimizer):
    """The optimizer of a model whose weights are 16-bit: gradients accumulated beside them in `grad_dtype`
    (`main_grads`), fp32 master weights stepped by `spec`'s optimizer (`optim`), the weights rounded from them.
    `group` (a process group of the replicas) shards the master weights and states as ZeRO-1; None keeps all of
    them here. Its own param_groups hold every parameter, for learning-rate schedules; their hyperparameters go to
    `optim` at each step. The replicas' mean of the gradients is the trainer's to make, on `main_grads`, before
    `step`."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        spec: OptimizerSpec,
        group: dist.ProcessGroup | None = None,
        *,
        grad_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._all = list(params)
        self._index = {id(p): i for i, p in enumerate(self._all)}
        self._group, self._grad_dtype = group, grad_dtype
        replicas = dist.get_world_size(group) if group is not None else 1
        shares = zero1_shares([p.numel() for p in self._all], replicas)
        self._owner = {i: r for r, share in enumerate(shares) for i in share}
        self._mine = sorted(shares[dist.get_rank(group)] if group is not None else range(len(self._all)))
        self.main_grads: list[torch.Tensor | None] = [None] * len(self._all)
        for i, p in enumerate(self._all):
            p.register_post_accumulate_grad_hook(self._accumulate(i))
        super().__init__(self._all, dict(spec.kwargs))
        with torch.no_grad():
            self.masters = {i: self._all[i].detach().float() for i in self._mine}
        self.optim: torch.optim.Optimizer | None = (
            spec.cls(list(self.masters.values()), **spec.kwargs) if self.masters else None
        )

    def _accumulate(self, i: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            g = self.main_grads[i]
            if g is None:
                self.main_grads[i] = p.grad.to(self._grad_dtype)  # autograd's own where the dtypes agree
            else:
                g.add_(p.grad)
            p.grad = None

        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        for i, g in enumerate(self.main_grads):
            if set_to_none:
                self.main_grads[i] = None
            elif g is not None:
                g.zero_()
        for p in self._all:
            p.grad = None

    def gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter with its fp32 gradient, where it has one."""
        return [(p, g) for p, g in zip(self._all, self.main_grads) if g is not None]

    def main_grad(self, p: nn.Parameter, *, create: bool = False) -> torch.Tensor | None:
        """`p`'s fp32 gradient; with `create`, zeros where the backward made none (a collective must see one)."""
        i = self._index[id(p)]
        if self.main_grads[i] is None and create:
            self.main_grads[i] = torch.zeros_like(p, dtype=self._grad_dtype)
        return self.main_grads[i]

    @property
    def master_state(self) -> dict[nn.Parameter, dict[str, Any]]:
        """Per parameter this replica steps: its optimizer state and its master weight ("master"), the tensors a
        checkpoint saves and loads in place."""
        inner = self.optim.state if self.optim is not None else {}
        return {self._all[i]: {**inner.get(m, {}), "master": m} for i, m in self.masters.items()}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MasterWeights takes no closure")
        if self.optim is not None:
            for group in self.optim.param_groups:
                group.update({k: v for k, v in self.param_groups[0].items() if k != "params"})
            for i, m in self.masters.items():
                g = self.main_grads[i]
                m.grad = g.float() if g is not None else None  # itself if fp32
            self.optim.step()
            for i, m in self.masters.items():
                m.grad = None
                self._all[i].copy_(m)
        if self._group is not None:
            for i, p in enumerate(self._all):
                dist.broadcast(p.data, group=self._group, group_src=self._owner[i])
