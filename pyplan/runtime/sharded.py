"""ZeRO-3 without pipeline stages, as FSDP runs it: the model's own modules, sharded unit by unit.

A plan of one pipeline stage and ZeRO-3 trains the model itself, not a captured piece of it: FSDP2 gathers a
unit's parameters in that unit's forward hooks, and a captured graph reads its parameters without calling the modules
that own them. Each layer of the model's layer stacks (a child of an `nn.ModuleList` or `nn.Sequential` that owns
parameters) is a unit, the rest of the model one more at the root (torchtitan shards its Llama this way).

Every micro-batch's backward reduce-scatters each unit's gradients into the shards as the unit finishes (FSDP2's
default, the ZeRO paper's stage 3): no unsharded gradient outlives its unit's backward, and no unit's parameters
stay gathered once it is done. `torch.distributed.pipelining` does the opposite (it defers both to the step's end,
holding every unsharded gradient and parameter), which is why pipelines of several stages do not plan ZeRO-3.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from pyplan._torch import selective_contexts
from pyplan.graph.trace import Call, ExampleInputs, call_at, output_tensors
from pyplan.plan import Layout
from pyplan.remat_plan import Checkpoint, Keep, SelectiveCheckpoint
from pyplan.runtime.clip import clip_gradients
from pyplan.runtime.optim import OptimizerFactory

__all__ = [
    "ShardedTrainer",
    "build_sharded_trainer",
    "gathered_bytes",
    "remat_kind",
    "shard_units",
    "unit_segments",
    "zero3_overlap",
]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, deepest first: the children of every `nn.ModuleList` and
    `nn.Sequential` that own parameters. The root, sharded last, holds the rest."""
    units = [
        child
        for parent in model.modules()
        if isinstance(parent, (nn.ModuleList, nn.Sequential))
        for child in parent.children()
        if any(True for _ in child.parameters())
    ]
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: -depth[id(m)])


def remat_kind(layout: Layout) -> str:
    """ "none" (every block keeps its activations), "units" (some blocks checkpointed in one level, as checkpointing
    whole units makes them: the runtime then checkpoints every unit), "selective units" (the same, selectively
    checkpointed) or "other" (nested checkpoints, offloading, blocks checkpointed selectively on their own)."""
    items = [it for r in layout.remat if r is not None for it in r.plan.items]
    if all(isinstance(it, Keep) for it in items):
        return "none"
    for kind, name in ((SelectiveCheckpoint, "selective units"), (Checkpoint, "units")):
        if all(
            isinstance(it, Keep) or (type(it) is kind and all(isinstance(x, Keep) for x in it.inner.items))
            for it in items
        ):
            return name
    return "other"


def _outermost(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of `shard_units` inside no other unit, with their names: the ones the runtime checkpoints."""
    names = {id(m): name for name, m in model.named_modules()}
    units = [(names[id(u)], u) for u in shard_units(model)]
    paths = {p for p, _ in units}
    return [(p, u) for p, u in units if not any(a in paths for a in _ancestors(p))]


def _ancestors(path: str) -> list[str]:
    """The paths of the modules above `path`, outermost first: "a.b.c" -> ["a", "a.b"]."""
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def unit_segments(model: nn.Module, block_names: Sequence[str]) -> list[tuple[int, int]]:
    """The blocks each outermost unit spans, as [start, stop) runs of consecutive blocks (blocks are named by the
    module they come from): what checkpointing those units recomputes."""
    paths = {p for p, _ in _outermost(model)}

    def unit_of(block: str) -> str | None:
        return next((p for p in (*_ancestors(block), block) if p in paths), None)

    owners = [unit_of(name) for name in block_names]
    runs: list[tuple[int, int]] = []
    for i, owner in enumerate(owners):
        if owner is None:
            continue
        if runs and owners[runs[-1][0]] == owner and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _checkpointed(unit: nn.Module, *, selective: bool = False) -> None:
    """Run `unit`'s forward under non-reentrant checkpointing: it keeps its inputs and recomputes the rest in its
    backward, inside FSDP2's hooks (which gather the unit's parameters again for the backward); `selective`: it also
    keeps the outputs of its matrix products and fused attention (`pyplan._torch.selective_contexts`)."""
    forward = unit.forward
    context = {"context_fn": selective_contexts} if selective else {}
    unit.forward = functools.partial(checkpoint, forward, use_reentrant=False, **context)  # type: ignore[method-assign]


def gathered_bytes(model: nn.Module, param_bytes: float, grad_bytes: float) -> float:
    """Bytes FSDP2 holds unsharded beside the shards at a step's peak, at `param_bytes` and `grad_bytes` an element.

    The root unit stays gathered from its forward to the end of its backward (FSDP2 does not reshard the root after
    forward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_lazy_init`), with its gradient before the last
    reduce-scatter; a layer unit is gathered in its forward and again in its backward beside the next one, which is
    prefetched, and its unsharded gradient lives until its reduce-scatter: (P + G)·root + (2·P + G)·largest unit."""
    claimed: set[int] = set()
    largest = 0
    for unit in shard_units(model):
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        largest = max(largest, sum(p.numel() for p in own))
    root = sum(p.numel() for p in model.parameters() if id(p) not in claimed)
    return (param_bytes + grad_bytes) * root + (2 * param_bytes + grad_bytes) * largest


def zero3_overlap(
    fwd_s: Sequence[float], bwd_s: Sequence[float], gather_s: Sequence[float], scatter_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Each block's share of one micro-batch's forward and backward under ZeRO-3 as FSDP2 runs it: the compute on
    one stream, the collectives on the link one after another (`gather_s`: a block's all-gather of its weights,
    `scatter_s`: the reduce-scatter of its gradients), simulated event by event.

    Forward: the first all-gather is waited for; block i+1's is issued when block i starts (FSDP2 prefetches the
    next unit's all-gather while the current one computes), and a block starts once the one before has finished
    and its own weights are gathered. Backward, from the last block: its all-gather is waited for; block i−1's is
    issued when block i starts, block i's reduce-scatter when it ends, and the step waits for the last
    reduce-scatter. A block's share is the time from the end of the block before to its own end (the last
    reduce-scatter's wait goes to the first block's backward). With the link always ahead of the compute this is
    max(fwd_i, gather_{i+1}) (+ gather_0 for the first block) and max(bwd_i, gather_{i−1} + scatter_{i+1}); in
    total it is never more than the compute and the communication one after the other, nor less than either."""
    n = len(fwd_s)
    if not (len(bwd_s) == len(gather_s) == len(scatter_s) == n):
        raise ValueError("zero3_overlap needs one forward, backward, gather and scatter time per block")
    fwd: list[float] = []
    link = gathered = gather_s[0] if n else 0.0
    end = 0.0
    for i in range(n):
        start = max(end, gathered)
        if i + 1 < n:  # the next block's all-gather, issued now
            link = gathered = max(link, start) + gather_s[i + 1]
        fwd.append(start + fwd_s[i] - end)
        end = start + fwd_s[i]
    bwd = [0.0] * n
    link = gathered = gather_s[-1] if n else 0.0
    end = 0.0
    for i in range(n - 1, -1, -1):
        start = max(end, gathered)
        if i > 0:
            link = gathered = max(link, start) + gather_s[i - 1]
        bwd[i] = start + bwd_s[i] - end
        end = start + bwd_s[i]
        link = max(link, end) + scatter_s[i]  # this block's reduce-scatter, issued at its end
    if n:
        bwd[0] += max(0.0, link - end)
    return fwd, bwd


@dataclass
class ShardedTrainer:
    """One replica of a plan with one pipeline stage and ZeRO-3: the same interface as `PipelineTrainer`."""

    layout: Layout
    mesh: DeviceMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    template: Call  # the structure of one micro-batch's call, its tensors in `input_tensors` order
    loss_fn: Any
    grad_norm: float = float("nan")  # the gradient's norm at the last step that clipped

    stage_indices = (0,)
    has_first = True
    has_last = True

    @property
    def modules(self) -> list[nn.Module]:
        return [self.model]

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    def parameters(self) -> dict[str, torch.Tensor]:
        """The parameters by their names in the original model, as full tensors."""
        return {name: p.full_tensor().detach() for name, p in self.model.named_parameters()}

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters (DTensor shards) and persistent buffers under every name they have in the model."""
        return self.model.state_dict(keep_vars=True)

    def _call(self, tensors: tuple[torch.Tensor, ...]) -> Call:
        leaves, spec = tree_flatten(self.template)
        given = iter(tensors)
        return tree_unflatten([next(given) if isinstance(x, torch.Tensor) else x for x in leaves], spec)

    def step(
        self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None, max_norm: float | None = None
    ) -> list[torch.Tensor]:
        """One optimizer step on this replica's samples (gradient accumulation over the plan's micro-batches, the
        loss of each divided by their count, as the pipeline schedules scale it), the gradient clipped to
        `max_norm` if given (its norm before clipping in `grad_norm`); returns each micro-batch's loss."""
        self.optimizer.zero_grad(set_to_none=True)
        m, b = self.layout.num_microbatches, self.layout.micro_batch_size
        losses: list[torch.Tensor] = []
        for k in range(m):
            part = slice(k * b, (k + 1) * b)
            args, kwargs = self._call(tuple(t[part].to(self.device) for t in inputs))
            out = output_tensors(self.model(*args, **kwargs))
            loss = self.loss_fn(out, target[part].to(self.device) if target is not None else None)
            (loss / m).backward()
            losses.append(loss.detach())
        if max_norm is not None:
            grads = [(p.grad, 1.0) for p in self.model.parameters() if p.grad is not None]  # shards
            self.grad_norm = clip_gradients(grads, max_norm)
        self.optimizer.step()
        return losses


def build_sharded_trainer(
    model: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    make_optimizer: OptimizerFactory,
    examples: ExampleInputs,
    device: torch.device,
    loss_fn: Any,
    compute_dtype: torch.dtype | None,
) -> ShardedTrainer:
    """`model` sharded over the mesh's dp axis unit by unit (`shard_units`, then the root), the outermost units
    checkpointed where the plan recomputes (`unit_segments`), with its optimizer over the shards.

    Mixed precision (`compute_dtype` 16-bit) is FSDP2's policy, as torchtitan runs it: each unit gathered and
    computed in `compute_dtype`, its gradients reduce-scattered in fp32 into the fp32 shards the optimizer steps,
    the model's outputs cast to fp32 for the loss; no autocast (`pyplan.model_state.ShardedUnitBytes`)."""
    model = model.to(device)
    kind = remat_kind(layout)
    if kind in ("units", "selective units"):
        for _, unit in _outermost(model):
            _checkpointed(unit, selective=kind == "selective units")
    unit_policy = root_policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        unit_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        root_policy = replace(unit_policy, output_dtype=torch.float32)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh["dp"], mp_policy=unit_policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=root_policy)
    optimizer = make_optimizer(list(model.parameters()))
    template = call_at(examples, layout.micro_batch_size)
    return ShardedTrainer(layout, mesh, model, optimizer, device, template, loss_fn)
