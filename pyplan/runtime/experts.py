"""Expert parallelism: each mixture-of-experts layer's routed experts split over an expert-parallel group carved out
of the data-parallel replicas, tokens sent to their experts' ranks and back by all-to-all.

The layout is torchtitan's and Megatron-LM's: the `degree` E divides dp; each run of E consecutive replicas (in the
dp axis's order) is an *expert-parallel group* whose rank r holds experts [r·n, (r+1)·n), n = num_experts / E, of
every layer of its stages; the dp/E ranks that hold the same experts are its *expert replicas*. A layer's forward on
one rank (`ExpertParallel`):

    1. each (token, choice) pair goes to the rank holding its expert: the pairs sorted by expert, the counts per
       rank exchanged (all-to-all), then the local expert ids and the tokens (all-to-all);
    2. the rank's experts run on what they received (the experts module itself, on its own slice of the experts,
       each pair with weight 1);
    3. the outputs go back (all-to-all), are put in the pairs' order, weighted by the router's weights and summed per
       token.

The tokens' all-to-alls carry gradients back the same way, so a rank's expert gradients hold the contributions of
every token its group sent them. Gradients equal one process's on the global batch: the replicas' DDP averages the
other parameters over dp; the experts' parameters are left out of DDP (`_ddp_params_and_buffers_to_ignore`), their
gradients summed over the expert replicas and divided by dp (`ExpertShards.reduce_gradients`), after the schedule's
mean over micro-batches.

The experts module is reached as the capture keeps it whole (pyplan/graph/experts.py): one module called as
`experts(hidden, index, weights)`; the rank's copy holds the slices of its parameters along their experts dimension
(or its ModuleList's slice), and its class gains `ExpertParallel` ahead of its own (as FSDP2's `fully_shard` does),
so its parameters keep their names. Before use, the copy is checked against the whole module: each expert of the
slice computes what it computed before, and a token's output is the weighted sum of its experts' outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from pyplan.errors import PlanError
from pyplan.graph.experts import ExpertLayer
from pyplan.plan import SPLIT_BACKWARD, Layout

__all__ = [
    "ExpertGroups",
    "ExpertParallel",
    "ExpertShards",
    "apply_expert_parallel",
    "expert_groups",
    "expert_refusal",
    "expert_slices",
]

# Precisions whose weights train as the model holds them (fp32, or autocast over fp32 weights); the 16-bit weights
# beside master weights keep their gradients in MasterWeights' buffers, which expert parallelism does not reduce.
_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


def expert_refusal(layout: Layout, precision: str) -> str:
    """Why the runtime cannot train `layout` with expert parallelism, or ""."""
    if layout.ep == 1:
        return ""
    if layout.tp > 1:
        return "beside tensor parallelism is not supported yet; plan it with tp 1"
    if layout.zero_stage != 0:
        return (
            f"runs under ZeRO 0, not {layout.zero_stage} (ZeroRedundancyOptimizer and FSDP2 would shard the experts "
            "as if every replica held the same ones); plan it with --zero 0"
        )
    if layout.schedule in SPLIT_BACKWARD:
        return f"does not run {layout.schedule} (its weight gradients skip the replicas' hooks); choose another"
    if precision not in _PRECISIONS:
        return f"runs with {', '.join(_PRECISIONS)}, not {precision}"
    return ""


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of the rows of a tensor with autograd: the gradient goes back by the reverse
    exchange (rows `sends[r]` to rank r, `receives[r]` from it)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, receives: list[int], sends: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.receives, ctx.sends, ctx.group = receives, sends, group
        out = x.new_empty((sum(receives), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receives, sends, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_empty((sum(ctx.sends), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.sends, ctx.receives, group=ctx.group)
        return out, None, None, None


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in expert parallelism of `degree`: its index `rank` in its expert-parallel `group`, and
    `replicas`, the group of the ranks holding the same experts (None where dp = degree); `dp` replicas in all."""

    degree: int
    rank: int
    group: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    dp: int


def expert_groups(mesh: DeviceMesh, degree: int) -> ExpertGroups:
    """The expert-parallel groups of `mesh`'s dp axis: for each set of replicas (one per stage and tp rank), runs of
    `degree` consecutive replicas, and the replicas `degree` apart. Collective: every rank creates every group in the
    same order and keeps its own."""
    names = list(mesh.mesh_dim_names or ())
    dp = mesh.mesh.shape[names.index("dp")]
    if degree < 2 or dp % degree:
        raise PlanError(f"expert parallelism {degree} needs a degree of 2 or more dividing dp {dp}")
    me = dist.get_rank()
    rows = mesh.mesh.movedim(names.index("dp"), -1).reshape(-1, dp).tolist()
    group: dist.ProcessGroup | None = None
    replicas: dist.ProcessGroup | None = None
    rank = 0
    for row in rows:
        for g in range(dp // degree):
            members = row[g * degree : (g + 1) * degree]
            made = dist.new_group(members)
            if me in members:
                group, rank = made, members.index(me)
        if dp == degree:
            continue
        for j in range(degree):
            members = row[j::degree]
            made = dist.new_group(members)
            if me in members:
                replicas = made
    if group is None:
        raise PlanError(f"rank {me} is in no replica set of the mesh {mesh.mesh.tolist()}")
    return ExpertGroups(degree, rank, group, replicas, dp)


class ExpertParallel(nn.Module):
    """Mixed in ahead of an experts module's class on one rank: its experts are the rank's slice, and its call on
    (hidden, index, weights) dispatches the tokens to the experts' ranks and combines them back (see the module).
    Attributes set by `apply_expert_parallel`: `ep_group` (ExpertGroups), `ep_first` (the first expert held),
    `ep_local` (experts held), `ep_path` (the module's path in the model), `ep_lists` (children sliced)."""

    ep_group: ExpertGroups
    ep_first: int
    ep_local: int
    ep_path: str
    ep_lists: tuple[str, ...]

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        groups = self.ep_group
        x = hidden.reshape(-1, hidden.shape[-1])
        choices = index.reshape(x.shape[0], -1)
        k = choices.shape[1]
        experts = choices.reshape(-1)
        order = torch.argsort(experts, stable=True)  # the (token, choice) pairs by expert, so by rank
        by_rank = experts[order] // self.ep_local
        sends = torch.bincount(by_rank, minlength=groups.degree)
        receives = torch.empty_like(sends)
        dist.all_to_all_single(receives, sends, group=groups.group)
        send_list, receive_list = sends.tolist(), receives.tolist()
        local_ids = experts[order] - by_rank * self.ep_local
        ids = local_ids.new_empty(sum(receive_list))
        dist.all_to_all_single(ids, local_ids, receive_list, send_list, group=groups.group)
        received = _AllToAll.apply(x[order // k], receive_list, send_list, groups.group)
        ones = torch.ones(received.shape[0], 1, dtype=weights.dtype, device=weights.device)
        done = super().forward(received, ids.unsqueeze(1), ones)
        back = _AllToAll.apply(done, send_list, receive_list, groups.group)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.shape[0], device=order.device)
        pairs = back[unsorted].reshape(x.shape[0], k, -1) * weights.reshape(x.shape[0], k, 1)
        return pairs.sum(1).to(hidden.dtype).reshape(hidden.shape)


@dataclass
class ExpertShards:
    """The experts this rank holds: their parameters, and the groups their gradients are reduced over."""

    groups: ExpertGroups
    params: list[nn.Parameter]
    _held: set[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._held = {id(p) for p in self.params}

    def reduce_gradients(self) -> None:
        """Each expert gradient summed over the expert replicas and divided by dp: with the schedule's mean over
        micro-batches, the gradient of the mean loss over the global batch (call after the step's backward)."""
        for p in self.params:
            if p.grad is None:  # no token reached this rank's experts: every replica must still join
                p.grad = torch.zeros_like(p)
        if self.groups.replicas is not None:
            # One all-reduce per dtype and device, of the gradients laid end to end.
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for p in self.params:
                by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
            for grads in by_kind.values():
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.groups.replicas)
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        for p in self.params:
            p.grad.div_(self.groups.dp)

    def norm_factor(self, p: nn.Parameter) -> float:
        """How much more a gradient's square counts in the norm over the world than a replicated one's: an expert's
        is held by dp/E ranks, not dp."""
        return float(self.groups.degree) if id(p) in self._held else 1.0


def apply_expert_parallel(
    stages: Sequence[nn.Module],
    layers: Sequence[ExpertLayer],
    graph_module: fx.GraphModule,
    groups: ExpertGroups,
    *,
    shared_parameters: bool = False,
) -> ExpertShards:
    """Replace, in this rank's `stages`, each layer's experts module (as `graph_module`, the captured model, holds it)
    with the rank's slice of it under `ExpertParallel`; leave the experts' parameters out of DDP. `layers` are the
    model's MoE layers (`find_expert_layers` on the capture that kept them whole); every one must split at the
    degree. `shared_parameters`: this rank's stages share parameters, whose gradients the trainer averages by hand
    over every replica (the experts' too), which expert parallelism does not run beside."""
    degree = groups.degree
    if shared_parameters:
        raise PlanError(
            "expert parallelism does not run beside stages sharing parameters on one rank (tied weights under an "
            "interleaved schedule); choose a schedule of one stage per rank"
        )
    for layer in layers:
        why = layer.why_not(degree)
        if why:
            raise PlanError(f"expert parallelism {degree} does not split '{layer.path}': {why}")
        if not layer.kept_whole:
            raise PlanError(
                f"the experts of '{layer.path}' were traced into, not kept whole: capture the model with "
                "leaf_modules=expert_leaves(model) for expert parallelism"
            )
    params: list[nn.Parameter] = []
    for layer in layers:
        whole = graph_module.get_submodule(layer.path)
        holders = [
            (parent, name)
            for stage in stages
            for parent in stage.modules()
            for name, child in parent.named_children()
            if child is whole
        ]
        if not holders:
            continue  # the layer is on another pipeline rank
        local = _expert_slice(whole, layer, groups)
        for parent, name in holders:
            setattr(parent, name, local)
        params.extend(local.parameters())
    ids = {id(p) for p in params}
    for stage in stages:
        ignored = [name for name, p in stage.named_parameters() if id(p) in ids]
        stage._ddp_params_and_buffers_to_ignore = [  # type: ignore[assignment]
            *getattr(stage, "_ddp_params_and_buffers_to_ignore", []),
            *ignored,
        ]
    return ExpertShards(groups, params)


def _expert_slice(whole: nn.Module, layer: ExpertLayer, groups: ExpertGroups) -> nn.Module:
    """The rank's copy of an experts module: experts [first, first + n) of each per-expert parameter, buffer and
    ModuleList, its expert count set to n, `ExpertParallel` mixed into its class; checked against `whole`."""
    n = layer.num_experts // groups.degree
    first = groups.rank * n
    part = slice(first, first + n)
    cls = type(whole)
    local = cls.__new__(cls)
    local.__dict__.update(whole.__dict__)
    local._parameters = {}
    local._buffers = dict(whole._buffers)
    local._modules = dict(whole._modules)
    for name, p in whole._parameters.items():
        if p is None or p.dim() < 2 or p.shape[0] != layer.num_experts:
            raise PlanError(f"parameter '{layer.path}.{name}' is not one slice per expert; it cannot be split")
        local._parameters[name] = nn.Parameter(p.detach()[part].clone(), requires_grad=p.requires_grad)
    for name, b in whole._buffers.items():
        if b is not None and b.dim() >= 1 and b.shape[0] == layer.num_experts:
            local._buffers[name] = b[part].clone()
    lists = []
    for name, child in whole._modules.items():
        if isinstance(child, nn.ModuleList) and len(child) == layer.num_experts:
            local._modules[name] = nn.ModuleList(list(child)[part])
            lists.append(name)
        elif child is not None and any(True for _ in child.parameters()):
            raise PlanError(f"module '{layer.path}.{name}' holds parameters of no single expert; it cannot be split")
    for name, value in whole.__dict__.items():
        if isinstance(value, int) and not isinstance(value, bool) and value == layer.num_experts and "expert" in name:
            local.__dict__[name] = n  # transformers' `num_experts`, read by its forward
    _check_slice(whole, local, layer, first)
    local.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
    local.ep_group, local.ep_first, local.ep_local = groups, first, n
    local.ep_path, local.ep_lists = layer.path, tuple(lists)
    return local


def _check_slice(whole: nn.Module, local: nn.Module, layer: ExpertLayer, first: int) -> None:
    """The slice computes what the whole module does for its experts, and the whole module computes each token as
    the weighted sum of its experts' outputs (what the combine step assumes); on a few random tokens, without
    gradients, off the global random stream."""
    p = next(whole.parameters())
    make = torch.Generator(device=p.device).manual_seed(0)
    held = _held(local, layer)
    tokens = 2 * held
    dtype = p.dtype if p.is_floating_point() else torch.float32
    x = torch.randn(tokens, layer.hidden, generator=make, device=p.device, dtype=dtype)
    ones = torch.ones(tokens, 1, device=p.device, dtype=dtype)
    mine = torch.arange(held, device=p.device).repeat(2).unsqueeze(1)
    k = min(layer.top_k, layer.num_experts)
    picks = torch.rand(tokens, layer.num_experts, generator=make, device=p.device).argsort(-1)[:, :k]
    w = torch.rand(tokens, k, generator=make, device=p.device, dtype=dtype)
    forward = type(whole).forward
    with torch.no_grad():
        original = forward(whole, x, mine + first, ones)
        try:
            sliced = forward(local, x, mine, ones)
            failed = ""
        except Exception as exc:  # a forward sized by a constant number of experts
            sliced, failed = original, f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
        same = not failed and torch.allclose(sliced, original, rtol=1e-4, atol=1e-5)
        full = forward(whole, x, picks, w)
        parts = sum(w[:, j : j + 1] * forward(whole, x, picks[:, j : j + 1], ones) for j in range(k))
        summed = torch.allclose(full, parts, rtol=1e-4, atol=1e-5)
    if not same:
        raise PlanError(
            f"the experts of '{layer.path}' ({type(whole).__name__}) compute otherwise on a slice of their experts"
            f"{failed}; write their forward to size itself by its parameters (or a `num_experts` attribute)"
        )
    if not summed:
        raise PlanError(
            f"the experts of '{layer.path}' ({type(whole).__name__}) do not compute a token as the weighted sum of "
            "its experts' outputs, which expert parallelism sends to other ranks and sums back"
        )


def _held(local: nn.Module, layer: ExpertLayer) -> int:
    """How many experts a sliced module holds (read off its parameters)."""
    for p in local._parameters.values():
        if p is not None:
            return int(p.shape[0])
    for child in local._modules.values():
        if isinstance(child, nn.ModuleList):
            return len(child)
    raise PlanError(f"the experts of '{layer.path}' hold no parameters to split")


def expert_slices(module: nn.Module) -> dict[str, tuple[str, slice | None]]:
    """For every parameter of `module` that is a rank's slice of experts: its name -> (its name in the whole model,
    and the rows of that parameter it holds, or None for a whole parameter of an expert renumbered in a list)."""
    out: dict[str, tuple[str, slice | None]] = {}
    for prefix, m in module.named_modules():
        if not isinstance(m, ExpertParallel):
            continue
        head = f"{prefix}." if prefix else ""
        for name, _ in m.named_parameters():
            first, _, rest = name.partition(".")
            if first in m.ep_lists:
                number, _, tail = rest.partition(".")
                out[head + name] = (f"{head}{first}.{int(number) + m.ep_first}.{tail}", None)
            else:
                out[head + name] = (head + name, slice(m.ep_first, m.ep_first + m.ep_local))
    return out
