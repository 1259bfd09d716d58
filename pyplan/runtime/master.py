"""16-bit weights trained through fp32 master weights: the "bf16-master" precisions, Megatron-LM's bf16.

The model computes in its own 16-bit weights (no autocast). Each parameter's gradient is added, as autograd makes it,
into a gradient of its own (`main_grads`, fp32 or, as NeMo's performance recipes run, bf16), and autograd's freed:
micro-batches accumulate, and the replicas average, in that dtype. Over replicas the gradients are views into flat
buckets of about 25 MiB (DDP's size), each all-reduced as soon as the backward has made its gradients, in a fixed
order, while the backward goes on (`_Buckets`), as DDP and Megatron-LM overlap them. The optimizer steps fp32
copies of the weights (the master weights) with those gradients (an fp32 copy of 16-bit ones while it steps) and
its states in fp32, and the weights are the master weights rounded back. Under ZeRO-1 each replica keeps the master
weights and states of its share of the tensors only (`zero1_shares`, the split the plan counts) and the owner of
each tensor broadcasts its new 16-bit weights. Per parameter element: 2 + 4 (or 2) bytes on every replica, 12
(master weight and AdamW's two states) on one or on every replica, as `pyplan.model_state.PRECISIONS` counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pyplan.runtime.optim import OptimizerSpec, hand_hyperparameters
from pyplan.runtime.tensor_parallel import own_values, placed_like
from pyplan.solve.state import zero1_shares

__all__ = ["MasterWeights"]


_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb


class _Buckets:
    """Gradients as views into flat buffers that are all-reduced over the replicas while the backward runs. The
    parameters go into buckets in reverse order (the backward makes the last layers' gradients first); a bucket is
    all-reduced (asynchronously) once each of its gradients has had all its accumulations of the step and every
    bucket before it has been; the rest at `finish`, which waits for them all. Every replica launches the buckets in
    the same order, whatever order its backward made them in."""

    def __init__(
        self, params: list[nn.Parameter], dtype: torch.dtype, group: dist.ProcessGroup, accumulations: list[int]
    ) -> None:
        self.group, self.accumulations = group, accumulations
        size = torch.empty(0, dtype=dtype).element_size()
        members: list[list[int]] = [[]]
        filled = 0
        for i in reversed(range(len(params))):
            if members[-1] and filled + params[i].numel() * size > _BUCKET_BYTES:
                members.append([])
                filled = 0
            members[-1].append(i)
            filled += params[i].numel() * size
        self.buffers = [
            torch.zeros(sum(params[i].numel() for i in m), dtype=dtype, device=params[m[0]].device)
            for m in members
            if m
        ]
        self.bucket_of: dict[int, int] = {}
        self.views: dict[int, torch.Tensor] = {}
        for b, m in enumerate(members):
            offset = 0
            for i in m:
                n = params[i].numel()
                self.views[i] = self.buffers[b][offset : offset + n].view_as(params[i])
                self.bucket_of[i] = b
                offset += n
        self.sizes = [len(m) for m in members if m]
        self.reset()

    def reset(self) -> None:
        for buf in self.buffers:
            buf.zero_()
        self.counts = [0] * len(self.accumulations)
        self.pending = list(self.sizes)
        self.launched: list[Any] = []

    def accumulated(self, i: int) -> None:
        """Parameter i's gradient had one more accumulation; launch what became ready."""
        self.counts[i] += 1
        if self.counts[i] > self.accumulations[i]:
            raise RuntimeError(f"a gradient was accumulated {self.counts[i]} times in a step planned for "
                               f"{self.accumulations[i]}: its bucket was already reduced")  # fmt: skip
        if self.counts[i] == self.accumulations[i]:
            self.pending[self.bucket_of[i]] -= 1
            while len(self.launched) < len(self.buffers) and self.pending[len(self.launched)] == 0:
                self._launch()

    def _launch(self) -> None:
        self.launched.append(dist.all_reduce(self.buffers[len(self.launched)], group=self.group, async_op=True))

    def finish(self) -> None:
        """Launch the buckets still waiting (a parameter that got fewer gradients, or none), in order; wait for all."""
        while len(self.launched) < len(self.buffers):
            self._launch()
        for work in self.launched:
            work.wait()


class MasterWeights(torch.optim.Optimizer):
    """The optimizer of a model whose weights are 16-bit: gradients accumulated beside them in `grad_dtype`
    (`main_grads`), fp32 master weights stepped by `spec`'s optimizer (`optim`), the weights rounded from them.
    `group` (a process group of the replicas) shards the master weights and states as ZeRO-1; None keeps all of
    them here. `replicas` (the replicas' group; None: one replica) sums the gradients over the replicas while the
    backward runs, each once it has had its `accumulations` of a step (one per micro-batch and stage holding it);
    `reduce_gradients` waits for the sums, which the trainer then divides. Its own param_groups hold every
    parameter, for learning-rate schedules; their hyperparameters go to `optim` at each step."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        spec: OptimizerSpec,
        group: dist.ProcessGroup | None = None,
        *,
        grad_dtype: torch.dtype = torch.float32,
        replicas: dist.ProcessGroup | None = None,
        accumulations: list[int] | None = None,
    ) -> None:
        self._all = list(params)
        self._index = {id(p): i for i, p in enumerate(self._all)}
        self._group, self._grad_dtype = group, grad_dtype
        sharing = dist.get_world_size(group) if group is not None else 1
        shares = zero1_shares([own_values(p).numel() for p in self._all], sharing)
        self._owner = {i: r for r, share in enumerate(shares) for i in share}
        self._mine = sorted(shares[dist.get_rank(group)] if group is not None else range(len(self._all)))
        self._buckets = (
            _Buckets(self._all, grad_dtype, replicas, accumulations or [1] * len(self._all))
            if replicas is not None
            else None
        )
        self.main_grads: list[torch.Tensor | None] = (
            [self._buckets.views[i] for i in range(len(self._all))] if self._buckets else [None] * len(self._all)
        )
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
            elif isinstance(g, DTensor):
                self.main_grads[i] = g + p.grad  # (tensor parallelism: the two may be laid out differently)
            else:
                g.add_(p.grad)
            p.grad = None
            if self._buckets is not None:
                self._buckets.accumulated(i)

        return hook

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._buckets is not None:  # the gradients are views into the buckets: zeroed, never freed
            self._buckets.reset()
            set_to_none = False
        for i, g in enumerate(self.main_grads):
            if set_to_none:
                self.main_grads[i] = None
            elif g is not None:
                g.zero_()
        for p in self._all:
            p.grad = None

    def reduce_gradients(self) -> None:
        """Wait for the replicas' sums of the gradients (launched while the backward ran; the rest now)."""
        if self._buckets is not None:
            self._buckets.finish()

    def place(self) -> None:
        """Give each gradient of a DTensor its parameter's placements (tensor parallelism: a partial sum reduced)."""
        for i, g in enumerate(self.main_grads):
            if g is not None:
                self.main_grads[i] = placed_like(self._all[i], g)

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
            hand_hyperparameters(self, self.optim)
            for i, m in self.masters.items():
                g = self.main_grads[i]
                m.grad = g.float() if g is not None else None  # itself if fp32
            self.optim.step()
            for i, m in self.masters.items():
                m.grad = None
                self._all[i].copy_(m)
        if self._group is not None:
            for i, p in enumerate(self._all):
                dist.broadcast(own_values(p.detach()), group=self._group, group_src=self._owner[i])
