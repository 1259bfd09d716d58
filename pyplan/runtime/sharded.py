"""ZeRO-3 without pipeline stages, as FSDP runs it: the model's own modules, sharded unit by unit.

A plan of one pipeline stage and ZeRO-3 trains the model itself, not a captured piece of it: FSDP2 gathers a
unit's parameters in that unit's forward hooks, and a captured graph reads its parameters without calling the modules
that own them. Each layer of the model's layer stacks (a child of an `nn.ModuleList` or `nn.Sequential` that owns
parameters) is a unit, the rest of the model one more at the root (torchtitan shards its Llama this way).

Every micro-batch's backward reduce-scatters each unit's gradients into the shards as the unit finishes (FSDP2's
default, the ZeRO paper's stage 3): no unsharded gradient outlives its unit's backward, and no unit's parameters
stay gathered once it is done. `torch.distributed.pipelining` does the opposite (it defers both to the step's end,
holding every unsharded gradient and parameter), which is why pipelines of several stages do not plan ZeRO-3.

Beside tensor parallelism the model's own modules are not what runs: the traced graph, split over the tp axis
(pyplan/runtime/tensor_parallel.py), calls the split layers and reads the rest as local tensors. It is cut into
pieces at the bounds of the same units (`TracedUnits`: one piece per outermost unit, the root's operations in the
pieces between), each unit's piece sharded by FSDP2 as the unit would be, over the dp axis of the (dp, tp) mesh
(FSDP2 keeps each parameter's tp layout: torchtitan's FSDP + TP).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from pyplan._torch import is_view, selective_contexts, tree_map_only
from pyplan.errors import PlanError
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.linearize import cut_points, linearize
from pyplan.graph.split import piece, run_pieces
from pyplan.graph.trace import Call, ExampleInputs, call_at, output_tensors
from pyplan.plan import Layout
from pyplan.runtime.clip import clip_gradients
from pyplan.runtime.optim import OptimizerFactory
from pyplan.runtime.tensor_parallel import full_value, grad_norm_weight
from pyplan.runtime.units import outermost_units, remat_kind, shard_units
from pyplan.spec import upcasts_itself

__all__ = ["ShardedTrainer", "TracedUnits", "build_sharded_trainer", "traced_units"]


class TracedUnits(nn.Module):
    """The traced model cut at the bounds of its outermost units (`traced_units`), the pieces run in sequence, each
    passing on the values live at its end (pyplan.graph.split). `units` are the indices of the pieces that are a
    unit's; the others hold the root's operations (embeddings before the first unit, norm and head after the last).
    Parameters keep their names in the model inside each piece (`named_tensors`)."""

    def __init__(self, pieces: Sequence[nn.Module], units: Sequence[int]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.units = tuple(units)

    def forward(self, *args: torch.Tensor) -> Any:
        return run_pieces(list(self.pieces), *args)

    def named_tensors(self, keep_vars: bool = True) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers under every name they have in the model."""
        out: dict[str, torch.Tensor] = {}
        for p in self.pieces:
            out.update(p.state_dict(keep_vars=keep_vars))
        return out

    def named_model_parameters(self) -> dict[str, nn.Parameter]:
        """Every parameter once, under its first name in the model."""
        out: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for p in self.pieces:
            for name, param in p.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    out[name] = param
        return out


def traced_units(graph: LayerGraph, model: nn.Module) -> TracedUnits:
    """`graph` (the traced `model`, already split over the tp axis) cut into one piece per outermost unit of
    `model` (`shard_units`), its operations those whose module lies in the unit, and pieces of the root's
    operations between. A unit's operations must be consecutive in the traced order and read its own parameters
    only, which no other piece reads."""
    points = cut_points(graph)
    paths = [p for p, _ in outermost_units(model)]
    spans: dict[str, list[int]] = {}
    for i, name in enumerate(points.order):
        path = graph.node(name).module_path
        owner = next((p for p in paths if path == p or path.startswith(p + ".")), None)
        if owner is not None:
            spans.setdefault(owner, [i, i])[1] = i
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for (a, (_, end)), (b, (start, _)) in itertools.pairwise(ordered):
        if start <= end:
            raise PlanError(
                f"ZeRO-3 beside tensor parallelism shards the traced model unit by unit, and the operations of "
                f"'{a}' and '{b}' interleave; plan it with ZeRO-1 (--zero 1)"
            )
    bounds = [0]
    units: list[int] = []
    for k, (path, (start, end)) in enumerate(ordered):
        low = bounds[-1]
        high = ordered[k + 1][1][0] if k + 1 < len(ordered) else len(points.order)
        first = next((c for c in range(start, low - 1, -1) if c == 0 or points.valid(c)), None)
        stop = next((c for c in range(end + 1, high + 1) if c == len(points.order) or points.valid(c)), None)
        if first is None or stop is None:
            raise PlanError(
                f"ZeRO-3 beside tensor parallelism cannot cut the traced model around '{path}' (no value that a "
                "piece can pass lies at its bounds); plan it with ZeRO-1 (--zero 1)"
            )
        if first > bounds[-1]:
            bounds.append(first)
        units.append(len(bounds) - 1)
        bounds.append(stop)
    if bounds[-1] < len(points.order):
        bounds.append(len(points.order))
    chain = linearize(graph, positions=bounds[1:-1])
    pieces = [piece(chain, i, i + 1) for i in range(len(chain))]
    # FSDP2 shards every parameter a unit's piece holds with that unit: each must be the unit's own, and read by
    # no other piece (which would find it sharded). By name: the pieces hold the graph's parameters under the
    # model's names (a graph torch.export captured holds its own).
    mine = {i: path for i, (path, _) in zip(units, ordered)}
    for i, pc in enumerate(pieces):
        for name, _ in pc.named_parameters(remove_duplicate=False):
            owner = next((path for path, _ in ordered if name.startswith(path + ".")), None)
            if owner != mine.get(i):
                raise PlanError(
                    f"ZeRO-3 beside tensor parallelism shards the traced model unit by unit, and '{name}' is read "
                    f"{'outside its unit' if owner else 'inside a unit it does not belong to'}; plan it with ZeRO-1 "
                    "(--zero 1)"
                )
    return TracedUnits(pieces, units)


def _checkpointed(unit: nn.Module, *, selective: bool = False) -> None:
    """Run `unit`'s forward under non-reentrant checkpointing: it keeps its inputs and recomputes the rest in its
    backward, inside FSDP2's hooks (which gather the unit's parameters again for the backward); `selective`: it also
    keeps the outputs of its matrix products and fused attention (`pyplan._torch.selective_contexts`)."""
    forward = unit.forward
    context = {"context_fn": selective_contexts} if selective else {}
    unit.forward = functools.partial(checkpoint, forward, use_reentrant=False, **context)  # type: ignore[method-assign]


def _own_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """`output` with each tensor that requires grad and is a view of another (a biased `nn.Linear` over 3-d input
    returns its matrix product's output viewed back to 3-d: aten's `linear`, aten/src/ATen/native/Linear.cpp) cloned.

    A unit's forward hook, run before FSDP2's own (`fully_shard` appends its post-forward hook: `FSDPState.init`,
    torch/distributed/fsdp/_fully_shard/_fsdp_state.py), which registers the unit's pre-backward hook on every
    output that requires grad (`FSDPState._register_pre_backward_hook`, which warns of views). An in-place op on a
    view moves the view's gradient to a node on its base, and the hook on the view never fires: the unit's parameters
    are not gathered again for its backward (`FSDPState._pre_backward`; a `ReLU(inplace=True)` after a layer unit:
    its backward reads freed storage), and nothing queues the root's end-of-backward callback, which reduce-scatters
    the gradients of a unit whose inputs need none (`_root_post_backward_final_callback`; the post-backward hook
    `FSDPParamGroup._register_post_backward_hook` puts on its inputs never runs): a model that is one unit, its
    logits scaled in place by the loss, trains on gradients off by 100 %. On a tensor of its own an in-place op keeps
    the hooked node on the path, and the clone costs one copy of the output."""
    return tree_map_only(torch.Tensor, lambda t: t.clone() if t.requires_grad and is_view(t) else t, output)


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
        """The parameters by their names in the original model, as full tensors (every rank must call it)."""
        named = (
            self.model.named_model_parameters()
            if isinstance(self.model, TracedUnits)
            else dict(self.model.named_parameters())
        )
        return {name: full_value(p).detach() for name, p in named.items()}

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters (DTensor shards) and persistent buffers under every name they have in the model."""
        if isinstance(self.model, TracedUnits):
            return self.model.named_tensors(keep_vars=True)
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
            tensors = tuple(t[part].to(self.device) for t in inputs)
            if isinstance(self.model, TracedUnits):  # the traced graph: the tensors in order, its own output
                out = self.model(*tensors)
            else:
                args, kwargs = self._call(tensors)
                out = output_tensors(self.model(*args, **kwargs))
            loss = self.loss_fn(out, target[part].to(self.device) if target is not None else None)
            (loss / m).backward()
            losses.append(loss.detach())
        if max_norm is not None:
            # Shards on the dp axis, each counted once; beside tensor parallelism, what the tp axis replicates
            # counted once over it.
            grads = [(p.grad, grad_norm_weight(p.grad)) for p in self.model.parameters() if p.grad is not None]
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
    graph: LayerGraph | None = None,
) -> ShardedTrainer:
    """`model` sharded over the mesh's dp axis unit by unit (`shard_units`, then the root), the outermost units
    checkpointed where the plan recomputes (`unit_segments`), with its optimizer over the shards. With `graph`
    (the traced model split over the mesh's tp axis) the units are its pieces (`traced_units`).

    Mixed precision (`compute_dtype` 16-bit) is FSDP2's policy, as torchtitan runs it: each unit gathered and
    computed in `compute_dtype`, its gradients reduce-scattered in fp32 into the fp32 shards the optimizer steps,
    the model's outputs cast to fp32 for the loss unless it computes in fp32 by itself (`upcasts_itself`); no
    autocast (`pyplan.model_state.ShardedUnitBytes`)."""
    model = model.to(device)
    if graph is None:
        root, units, outermost = model, shard_units(model), [u for _, u in outermost_units(model)]
    else:
        root = traced_units(graph, model).to(device)
        units = outermost = [root.pieces[i] for i in root.units]
    kind = remat_kind(layout)
    if kind in ("units", "selective units"):
        for unit in outermost:
            _checkpointed(unit, selective=kind == "selective units")
    unit_policy = root_policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        unit_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        root_policy = unit_policy if upcasts_itself(loss_fn) else replace(unit_policy, output_dtype=torch.float32)
    for unit in (*units, root):
        unit.register_forward_hook(_own_outputs)
    for unit in units:
        fully_shard(unit, mesh=mesh["dp"], mp_policy=unit_policy)
    fully_shard(root, mesh=mesh["dp"], mp_policy=root_policy)
    optimizer = make_optimizer(list(root.parameters()))
    template = call_at(examples, layout.micro_batch_size)
    return ShardedTrainer(layout, mesh, root, optimizer, device, template, loss_fn)
