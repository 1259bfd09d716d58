"""Tensor parallelism at run time: a captured GraphModule split over one DeviceMesh axis with DTensor's styles.

`apply_tensor_parallel(graph, plan, mesh)` turns the captured module of `graph` into the module one rank of the
tensor-parallel axis runs (Shoeybi et al. 2019, torchtitan's `parallelize_llama` on a captured graph):

1. `shard_sizes` rewrites the size arguments of sharded dimensions, so the graph runs on a rank's slices;
2. every Linear and Embedding the plan splits becomes a module call: torch.export captures `aten.linear` on
   `get_attr` weights, and a style works only through the forward hooks of a module the graph calls. The new
   `nn.Linear` / `nn.Embedding` holds the very Parameter objects at the qualified name they had, so parameter
   names stay the model's;
3. `parallelize_module` applies torchtitan's styles with local outputs (plain tensors flow through the graph):
   column Linears `ColwiseParallel`, a fused QKV column (`Region.parts`) its `_FusedColwise` (each rank holds the
   rank-th slice of each of Q, K and V, and `full_tensor()` of the weight and of its gradient is the model's own
   layout), row Linears `RowwiseParallel`, the token embedding `RowwiseParallel(input_layouts=Replicate())` (split
   over the vocabulary), the output layer `ColwiseParallel(output_layouts=Replicate())`, or with `vocab_parallel`
   `ColwiseParallel(output_layouts=Shard(-1))`: each rank keeps its slice of the logits, and the loss sums over the
   ranks (`VocabParallelLoss`, Megatron-LM's vocabulary-parallel cross-entropy, torchtitan's `loss_parallel`);
4. tied weights, which parallelize_module unties, are tied again: the model keeps one parameter;
5. every parameter left whole (norms, position embeddings, layers the plan keeps whole) becomes a `Replicate`
   DTensor on the mesh, read as its local tensor by the graph (`_read_locally`): the optimizer, gradient clipping
   and a checkpoint see DTensors only (torch's foreach/fused optimizers and `clip_grad_norm_` refuse a mix of
   DTensor and plain tensors), and no op runs on DTensors outside the split layers;
6. the random state is made equal on every rank of the axis (`sync_rng_state`): dropout in the replicated parts
   of the model then draws the same mask on every rank, as it must (CPU DTensor has no offset-based RNG; in the
   split parts the ranks draw equal, hence correlated, masks);
7. with sequence parallelism (pyplan/graph/sequence_parallel.py) the row Linears of the zone keep their tokens
   (`RowwiseParallel(output_layouts=Shard(d))`, a reduce-scatter), the column Linears and output layers that read a
   zone value gather it once for all of them (`_Gathered`: a Replicate DTensor whose partial gradients meet in one
   reduce-scatter), the norms read in the zone get partial gradients, and the graph is rewritten last to read
   whole shapes, gather, slice (`_SeqCollectives`). As in Megatron-LM, the Linears that read a gathered value save
   it for backward as the rank's slice, all-gathered again when backward needs it (once per value for Q, K and V:
   `pyplan.graph.sequence_parallel.Gathered.saving`, hooks around those Linears' forwards that pass every other
   tensor on to the hooks outside: a checkpoint's, a profiler's). A Linear on the tokens flattened (GPT-2's
   Conv1D) has its collectives at the reshapes around it: its input is gathered before the flattening reshape (the
   DTensor flows through it into the column style), and a row's partial sums (`output_layouts=Partial()`, kept a
   DTensor) are reduce-scattered after the reshape that views them back.

After backward, `sync_gradients` gives each gradient its parameter's layout (and averages over data-parallel
replicas when asked); `torch.nn.utils.clip_grad_norm_` and torch's optimizers then work on the module's
parameters as they are. `grad_norm_weight` says how much a gradient's local square counts in a norm summed over
ranks (pyplan.runtime.clip). `full_parameters` / `full_gradients` gather what one process would hold.

Data parallelism beside it: average the gradients over the dp group (`sync_gradients(..., dp_group=...)`; DDP
takes no DTensor parameters), or FSDP2 over the dp axis (pyplan/runtime/sharded.py, `TracedUnits`), which trains
exactly too; on torch 2.13 `full_tensor()` of a fused QKV under FSDP2 (placements `_StridedShard` on both axes)
comes out with its rows in the wrong order, and `distribute_tensor` lays it out wrong: `full_value` and
`local_value` gather and split such a tensor in two steps.

Glossary (torchtitan's): the mesh's one *axis* is the tensor-parallel ("tp") axis; a tensor *dim* is sharded or
replicated along it; a *style* is what parallelize_module applies to one module.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from pyplan._torch import is_strided, strided_shard
from pyplan.errors import PlanError
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.sequence_parallel import Gathered, SequenceZone, rewrite, sequence_zone
from pyplan.graph.tensor_parallel import TpPlan, linear_operands, shard_sizes, weight_owner
from pyplan.runtime.optim import OptimizerSpec, hand_hyperparameters
from pyplan.runtime.vocab_loss import VocabParallelLoss
from pyplan.solve.state import zero1_shares

__all__ = [
    "TransposedLinear",
    "VocabParallelLoss",
    "Zero1Optimizer",
    "apply_tensor_parallel",
    "full_gradients",
    "full_parameters",
    "full_value",
    "grad_norm_weight",
    "local_value",
    "own_values",
    "placed_like",
    "sync_gradients",
    "sync_rng_state",
    "tp_styles",
]

_EMBEDDING_OPS = (torch.ops.aten.embedding.default,)


class TransposedLinear(nn.Linear):
    """A Linear whose weight is laid out (in, out), as Hugging Face's Conv1D holds it (GPT-2): what an
    `addmm(bias, x, weight)` of the captured graph becomes, to be split by the `_Transposed` styles. It computes
    `F.linear` on the weight's transpose, so that a split weight runs DTensor's Linear rules."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.t(), self.bias)


def _split_transposed(module: nn.Module, mesh: DeviceMesh, weight: Any, bias: Any, src: int | None) -> None:
    """A TransposedLinear's weight and bias distributed as `weight`, `bias` (placements)."""
    for key, param in module.named_parameters():
        placement = weight if key == "weight" else bias
        local = distribute_tensor(param, mesh, [placement], src_data_rank=src)
        module.register_parameter(key, nn.Parameter(local, requires_grad=param.requires_grad))


class _TransposedColwise(ColwiseParallel):
    """ColwiseParallel for a TransposedLinear: the weight split along its second dimension (the outputs), in
    `parts` pieces side by side for a fused QKV (as `_FusedColwise`)."""

    def __init__(self, parts: int = 1) -> None:
        super().__init__(output_layouts=strided_shard(-1, parts) if parts > 1 else Shard(-1))
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if self.parts > 1:
            weight, bias = strided_shard(1, self.parts), strided_shard(0, self.parts)
        else:
            weight, bias = Shard(1), Shard(0)
        _split_transposed(module, device_mesh, weight, bias, self.src_data_rank)


class _TransposedRowwise(RowwiseParallel):
    """RowwiseParallel for a TransposedLinear: the weight split along its first dimension (the inputs)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _split_transposed(module, device_mesh, Shard(0), Replicate(), self.src_data_rank)


class _FusedColwise(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is `parts` pieces side by side (a fused QKV): each rank holds the
    rank-th slice of every piece, its local output is those slices side by side (what the graph's chunk expects
    after `shard_sizes`), and weight, bias and their gradients gather to the model's layout."""

    def __init__(self, parts: int) -> None:
        super().__init__(output_layouts=strided_shard(-1, parts))
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, param in module.named_parameters():
            local = distribute_tensor(
                param, device_mesh, [strided_shard(0, self.parts)], src_data_rank=self.src_data_rank
            )
            module.register_parameter(key, nn.Parameter(local, requires_grad=param.requires_grad))


# ----------------------------------------------------------------------------------------------------------------
# The layers of the captured graph


@dataclass(frozen=True)
class _Layer:
    """One call of a Linear or an Embedding in the captured graph: `module` is its qualified name (for an aten op,
    the prefix of its weight's get_attr target); `convertible` says whether the call can become a module call
    (an aten op: weight and bias at `<module>.weight` / `<module>.bias`, an embedding without options)."""

    node: fx.Node
    module: str
    kind: str  # "linear" | "embedding"
    weight: torch.Tensor
    bias: torch.Tensor | None
    convertible: bool
    transposed: bool = False  # a weight laid out (in, out): `addmm(bias, x, weight)`, Hugging Face's Conv1D


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _arg(n: fx.Node, index: int, key: str) -> Any:
    return n.args[index] if len(n.args) > index else n.kwargs.get(key)


def _layers(gm: fx.GraphModule) -> list[_Layer]:
    found: list[_Layer] = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            if isinstance(mod, nn.Linear):
                t = isinstance(mod, TransposedLinear)
                found.append(_Layer(n, str(n.target), "linear", mod.weight, mod.bias, True, t))
            elif isinstance(mod, nn.Embedding):
                # Split over the vocabulary, a padding row would be a local index on every rank.
                plain = mod.padding_idx is None and mod.max_norm is None
                found.append(_Layer(n, str(n.target), "embedding", mod.weight, None, plain))
        elif (operands := linear_operands(n)) is not None:
            x, w, b = operands
            if not (isinstance(w, fx.Node) and w.op == "get_attr"):
                continue
            module, leaf = weight_owner(gm, w, "linear"), str(w.target).rpartition(".")[2]
            if b is None:  # a bias held beside the weight but not added would be added by an nn.Linear
                bias_ok = module != "" and gm.get_submodule(module)._parameters.get("bias") is None
            else:
                bias_ok = isinstance(b, fx.Node) and b.op == "get_attr" and b.target == f"{module}.bias"
            found.append(
                _Layer(
                    n,
                    module,
                    "linear",
                    _attr(gm, str(w.target)),
                    _attr(gm, str(b.target)) if isinstance(b, fx.Node) and b.op == "get_attr" else None,
                    module != "" and leaf == "weight" and bias_ok and isinstance(x, fx.Node),
                    n.target is torch.ops.aten.addmm.default,
                )
            )
        elif n.op == "call_function" and n.target in _EMBEDDING_OPS:
            w = n.args[0]
            if isinstance(w, fx.Node) and w.op == "get_attr":
                module, leaf = weight_owner(gm, w, "embedding"), str(w.target).rpartition(".")[2]
                plain = module != "" and leaf == "weight" and len(n.args) == 2 and not n.kwargs
                found.append(_Layer(n, module, "embedding", _attr(gm, str(w.target)), None, plain))
    return found


# ----------------------------------------------------------------------------------------------------------------
# The styles, checked against the graph


def _local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds a DTensor's elements on this rank (a plain tensor: itself)."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():
        return t.to_local()


def _dtensor_like(t: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """What makes a tensor like t (a saved view of a gathered value) from a local tensor: a DTensor of t's mesh,
    placements and global layout (none for a plain tensor)."""
    if not isinstance(t, DTensor):
        return lambda local: local
    mesh, placements, shape, stride = t.device_mesh, t.placements, t.shape, t.stride()
    return lambda local: DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class _Gathered(Gathered):
    """A region's input gathered from each rank's tokens once for every column Linear that reads it (Q, K and V):
    a Replicate DTensor, whose gradients (partial sums, one per Linear) add up and are reduce-scattered once; saved
    for the Linears' weight gradients as the rank's slice, all-gathered again in backward (`Gathered.saving`). The
    mesh is the one the styles are applied on (set by the first style that gathers, when not given)."""

    def __init__(self, mesh: DeviceMesh | None = None) -> None:
        super().__init__(self._all_gather, own=_local_of, like=_dtensor_like)
        self.mesh = mesh

    def _all_gather(self, x: torch.Tensor, dim: int) -> DTensor:
        assert self.mesh is not None
        return DTensor.from_local(x, self.mesh, [Shard(dim)], run_check=False).redistribute(self.mesh, [Replicate()])


def _gathering(style: ColwiseParallel, gathered: _Gathered, dim: int, readers: int) -> ColwiseParallel:
    """`style` reading each rank's tokens along `dim` gathered (`_Gathered`, shared by the `readers` Linears that
    read the same value) in place of a whole input."""

    def prepare(_layouts: Any, _desired: Any, _mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        if gathered.mesh is None:
            gathered.mesh = mesh
        return gathered(x, dim, readers)  # type: ignore[return-value]

    style._prepare_input_fn = prepare  # type: ignore[method-assign]
    return style


class _SeqCollectives:
    """The collectives of a sequence-parallel graph on one mesh axis (`pyplan.graph.sequence_parallel.SeqOps`),
    as DTensor redistributions of local tensors."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh, self.degree, self.gathered = mesh, mesh.size(), _Gathered(mesh)

    def whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = DTensor.from_local(x, self.mesh, [Shard(dim)], run_check=False).redistribute(self.mesh, [Replicate()])
        return out.to_local(grad_placements=[Replicate()])  # each rank's gradient is the whole one: sliced

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(self.mesh, [Shard(dim)])
        return out.to_local()

    def gather(self, x: torch.Tensor, dim: int, readers: int = 1) -> torch.Tensor:
        # A Replicate DTensor: the flattening reshape in between runs on it, and the column styles take it as is.
        return self.gathered(x, dim, readers)

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        return self.gathered.saving()

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Partial()], run_check=False)
        return x.redistribute(self.mesh, [Shard(dim)]).to_local()


def tp_styles(
    graph: LayerGraph,
    plan: TpPlan,
    degree: int,
    zone: SequenceZone | None = None,
    *,
    vocab_parallel: bool = False,
    gathered: _Gathered | None = None,
) -> dict[str, ParallelStyle]:
    """The parallelize_module plan that `apply_tensor_parallel` runs at `degree`: module name -> style, for the
    layers of `plan` that split at that degree; with a sequence-parallel `zone`, the row Linears it reduce-scatters
    keep their tokens (`output_layouts=Shard`) and the column Linears and output layers that read its values
    gather them (`gathered`, the graph's collectives' when given, which keep the saved values' slices).

    Raises PlanError where the captured graph cannot run it: a module the graph never calls as a Linear or an
    Embedding, a call that cannot become a module call, or a weight that is split in one place and read otherwise
    in another (tied weights must split alike wherever they are used: the token embedding over its rows and the
    output layer over its outputs do; an embedding left whole, e.g. one with a padding index, does not)."""
    styles: dict[str, ParallelStyle] = {}
    transposed = {layer.module for layer in _layers(graph.module) if layer.transposed}
    for r in plan.regions:
        if r.splits_at(degree):
            for m in r.columns:
                parts = r.parts.get(m, 1)
                if m in transposed:
                    styles[m] = _TransposedColwise(parts)
                else:
                    styles[m] = _FusedColwise(parts) if parts > 1 else ColwiseParallel()
            styles.update({m: _TransposedRowwise() if m in transposed else RowwiseParallel() for m in r.rows})
    styles.update(
        {e.module: RowwiseParallel(input_layouts=Replicate()) for e in plan.embeddings if e.splits_at(degree)}
    )
    styles.update(
        {
            o.module: ColwiseParallel(output_layouts=Shard(-1) if vocab_parallel else Replicate())
            for o in plan.output_layers
            if o.splits_at(degree)
        }
    )
    if zone is not None:
        module_of = {layer.node.name: layer.module for layer in _layers(graph.module)}
        gathered = gathered if gathered is not None else _Gathered()
        for node in zone.rows:
            kind = _TransposedRowwise if module_of[node] in transposed else RowwiseParallel
            if node in zone.unflattened:  # its partial sums are reduce-scattered once viewed back (the rewrite)
                styles[module_of[node]] = kind(output_layouts=Partial(), use_local_output=False)
            else:
                styles[module_of[node]] = kind(output_layouts=Shard(zone.dims[node]))
        for node, dim in zone.gathered.items():
            style = styles[module_of[node]]
            assert isinstance(style, ColwiseParallel)
            styles[module_of[node]] = _gathering(style, gathered, dim, zone.readers(node))
    _check(graph.module, styles)
    return styles


def _layout(style: ParallelStyle, kind: str, key: str) -> str:
    """How `style` lays out a layer's parameter `key` along the axis, in words."""
    if isinstance(style, _FusedColwise):
        return f"rows split in {style.parts} pieces"
    if isinstance(style, ColwiseParallel):
        return "rows split"
    if kind == "embedding":
        return "rows split"
    return "columns split" if key == "weight" else "whole"


def _check(gm: fx.GraphModule, styles: Mapping[str, ParallelStyle]) -> None:
    layers = _layers(gm)
    by_module: dict[str, list[_Layer]] = {}
    for layer in layers:
        by_module.setdefault(layer.module, []).append(layer)
    for module, style in styles.items():
        calls = by_module.get(module, [])
        if not calls:
            raise PlanError(f"TP plan: the captured graph calls no Linear or Embedding '{module}'")
        if len({x.kind for x in calls}) > 1:
            raise PlanError(
                f"TP plan: '{module}' is both a Linear and an Embedding in the captured graph (one weight, tied, "
                "read under one name): it cannot split"
            )
        bad = next((x for x in calls if not x.convertible), None)
        if bad is not None:
            raise PlanError(
                f"TP plan: '{module}' ({bad.node.name}) cannot become a module call: its weight and bias are not "
                f"'{module}.weight' and '{module}.bias', or the embedding takes options (padding index, norms)"
            )
        if isinstance(style, ColwiseParallel) and calls[0].kind != "linear":
            raise PlanError(f"TP plan: '{module}' is an Embedding; only a Linear splits column-wise here")
    names = {id(p): name for name, p in gm.named_parameters(remove_duplicate=False)}
    # Every reader of every parameter (by node), with the layout it reads the parameter in.
    reads: dict[int, dict[str, tuple[str, str]]] = {}
    for layer in layers:
        style = styles.get(layer.module)
        for key, p in (("weight", layer.weight), ("bias", layer.bias)):
            if p is not None:
                how = "whole" if style is None else _layout(style, layer.kind, key)
                reads.setdefault(id(p), {})[layer.node.name] = (layer.module, how)
    args = {(layer.node, a) for layer in layers if layer.node.op == "call_function" for a in layer.node.all_input_nodes}
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    for n in gm.graph.nodes:
        if n.op == "call_module" and str(n.target) not in by_module:
            for p in gm.get_submodule(str(n.target)).parameters():
                reads.setdefault(id(p), {})[n.name] = (str(n.target), "whole")
        if n.op != "get_attr" or not isinstance(_attr(gm, str(n.target)), nn.Parameter):
            continue
        readers = [u for u in n.users if (u, n) not in args]
        for u in readers:
            reads.setdefault(id(_attr(gm, str(n.target))), {})[u.name] = (u.name, "whole")
        owner = str(n.target).rpartition(".")[0]
        if readers and (owner == "" or owner in called or owner in styles):
            # The graph reads it through its module's call (`_read_locally`): that module must be free to call.
            raise PlanError(
                f"TP plan: '{u.name}' reads the parameter '{n.target}' as an attribute of "
                f"{'the model itself' if owner == '' else repr(owner) + ', which the graph also calls'}: "
                "tensor parallelism cannot hand it the local tensor"
            )
    for pid, readers in reads.items():
        ways = {how for _, how in readers.values()}
        if len(ways) > 1:
            split = next((m, how) for m, how in readers.values() if how != "whole")
            other = next((m, how) for m, how in readers.values() if how != split[1])
            raise PlanError(
                f"TP plan: '{split[0]}' splits the parameter '{names.get(pid, '?')}' ({split[1]}), which "
                f"'{other[0]}' reads {other[1]}: tied weights must split alike wherever they are used; "
                f"leave '{split[0]}' whole"
            )


# ----------------------------------------------------------------------------------------------------------------
# Applying them


def apply_tensor_parallel(
    graph: LayerGraph, plan: TpPlan, mesh: DeviceMesh, *, sequence_parallel: bool = False, vocab_parallel: bool = False
) -> None:
    """Make `graph.module` (in place, before it is cut into pipeline stages) run tensor-parallel over the 1-D
    `mesh`, every rank of the mesh with the same module and inputs; see the module docstring for the steps. With
    `sequence_parallel` the values between the split layers are each rank's slice of the tokens
    (pyplan/graph/sequence_parallel.py): the graph is rewritten last, to call `_SeqCollectives`.

    Afterwards every parameter is a DTensor on `mesh`, named as in the model; the module's inputs and outputs are
    plain tensors, the outputs equal on every rank (with `vocab_parallel`, each rank's slice of the logits, for
    `VocabParallelLoss`). All ranks of the mesh must call it (it broadcasts rank 0's
    parameters and random state). Modules the graph shares with the model (plain fx keeps the model's own leaf
    modules) change with it."""
    if mesh.ndim != 1:
        raise PlanError(f"tensor parallelism runs over one mesh axis; got a mesh of {mesh.ndim} axes {mesh.shape}")
    gm, degree = graph.module, mesh.size()
    zone = sequence_zone(graph, plan, degree) if sequence_parallel else None
    if zone is not None and not zone:
        raise PlanError(f"sequence parallelism {degree} cannot run on this model: {zone.reason}")
    collectives = _SeqCollectives(mesh) if zone is not None else None
    gathered = collectives.gathered if collectives is not None else None
    styles = tp_styles(graph, plan, degree, zone, vocab_parallel=vocab_parallel, gathered=gathered)
    shard_sizes(gm, graph, plan, degree)
    for layer in _layers(gm):
        if layer.module in styles and layer.node.op == "call_function":
            _to_module_call(gm, layer)
    gm.recompile()
    tied = _holders(gm)
    parallelize_module(gm, mesh, styles)
    _tie_and_replicate(gm, mesh, tied)
    # Parameters read on each rank's tokens (sequence parallelism) or beside its heads (a per-head norm inside a
    # region): their gradients are partial sums.
    summed = set(plan.partial_params(degree)) | set(zone.params if zone else ())
    partial = {id(p) for name, p in gm.named_parameters(remove_duplicate=False) if name in summed}
    _read_locally(gm, set(styles), partial)
    if zone is not None and collectives is not None:
        rewrite(gm, zone, collectives, layers=False)
    sync_rng_state(mesh)


def _to_module_call(gm: fx.GraphModule, layer: _Layer) -> None:
    """Turn an aten op on get_attr weights into a call of an nn.Linear / nn.Embedding that holds the same
    Parameter objects at `layer.module` (whatever else that path held stays there); the node keeps its name."""
    old = gm.get_submodule(layer.module)
    if layer.kind == "linear":
        operands = linear_operands(layer.node)
        assert operands is not None
        x = operands[0]
        kind = TransposedLinear if layer.transposed else nn.Linear
        out_features, in_features = layer.weight.shape[::-1] if layer.transposed else layer.weight.shape
        new: nn.Module = kind(in_features, out_features, bias=layer.bias is not None, device="meta")
    else:
        new = nn.Embedding(*layer.weight.shape, device="meta")
        x = layer.node.args[1]
    if type(old) is not type(new):
        new._parameters.update(old._parameters)
        new._buffers.update(old._buffers)
        new._modules.update(old._modules)
        parent, _, leaf = layer.module.rpartition(".")
        setattr(gm.get_submodule(parent), leaf, new)
    layer.node.op, layer.node.target = "call_module", layer.module
    layer.node.args, layer.node.kwargs = (x,), {}


def _holders(gm: nn.Module) -> list[list[str]]:
    """Every parameter's qualified names (several for a tied one), in registration order."""
    groups: dict[int, list[str]] = {}
    for name, p in gm.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def _tie_and_replicate(gm: nn.Module, mesh: DeviceMesh, groups: list[list[str]]) -> None:
    """Give every group of names one DTensor parameter again: the split one where a style split it (parallelize_module
    makes a new Parameter per module, untying a weight that two split layers share; `tp_styles` checked that they
    split it alike), else a `Replicate` copy of rank 0's."""
    for names in groups:
        owners = [(gm.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in names]
        held = [m._parameters[key] for m, key in owners]
        one = next((p for p in held if isinstance(p, DTensor)), None)
        if one is None:
            whole = held[0]
            assert whole is not None
            one = nn.Parameter(
                distribute_tensor(whole.detach(), mesh, [Replicate()]), requires_grad=whole.requires_grad
            )
        for (module, key), p in zip(owners, held):
            if p is not one:
                module.register_parameter(key, one)


def _read_locally(gm: fx.GraphModule, styled: set[str], partial: set[int]) -> None:
    """Make the graph read every parameter outside the styled modules as its local tensor (differentiably: the
    gradient arrives as a DTensor of the parameter's placements), while the module tree keeps the DTensor
    Parameter under the model's name for `named_parameters()`, `getattr`, optimizers, FSDP2 and the pieces
    `pyplan.graph.split` cuts. Two ways, each a subclass of the module's class (as torch.nn.utils.parametrize
    makes), neither moving a parameter:

    - a module the graph calls: its forward runs with the local tensors in place of its (and its children's)
      DTensor parameters and puts the DTensors back after;
    - a get_attr of a parameter: the node becomes a call of the module that holds it (the node keeps its name),
      whose class gains a `forward(name)` returning the local tensor. A get_attr cannot stay: the graph would read
      the DTensor, and a piece of the graph copies what the attribute returns.

    The parameters in `partial` (by id; read on each rank's tokens under sequence parallelism) get each rank's
    gradient as a partial sum (`sync_gradients` sums it)."""
    for n in gm.graph.nodes:
        if n.op == "call_module" and str(n.target) not in styled:
            module = gm.get_submodule(str(n.target))
            if any(isinstance(p, DTensor) for p in module.parameters()) and not getattr(module, "_tp_local", False):
                # By name, not by object: FSDP2 swaps in gathered Parameters of the same names.
                keys = {
                    (at, k) for at, m in module.named_modules() for k, p in m._parameters.items() if id(p) in partial
                }
                _extend_class(module, {"forward": _forward_locally(type(module).forward, keys), "_tp_local": True})
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            owner, _, key = str(n.target).rpartition(".")
            module = gm.get_submodule(owner)
            if n.users and isinstance(module._parameters.get(key), DTensor):
                if not getattr(module, "_tp_read", False):
                    _extend_class(module, {"forward": _local_parameter, "_tp_read": True, "_tp_partial": set()})
                if id(module._parameters[key]) in partial:
                    module._tp_partial.add(key)
                n.op, n.target, n.args, n.kwargs = "call_module", owner, (key,), {}
    gm.recompile()


def _forward_locally(forward: Any, partial: set[tuple[str, str]]) -> Any:
    """`forward` run on the local tensors of the module's DTensor parameters; those named in `partial`
    ((submodule path, key)) get each rank's gradient as a partial sum."""

    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        held = [
            (m, k, p, (at, k) in partial)
            for at, m in self.named_modules()
            for k, p in m._parameters.items()
            if isinstance(p, DTensor)
        ]
        for m, k, p, summed in held:
            m._parameters[k] = p.to_local(grad_placements=[Partial()] if summed else None)
        try:
            return forward(self, *args, **kwargs)
        finally:
            for m, k, p, _ in held:
                m._parameters[k] = p

    return run


def _local_parameter(self: nn.Module, key: str) -> torch.Tensor:
    """The local tensor of the DTensor parameter `key` (the forward of a module whose parameters a graph reads)."""
    return self._parameters[key].to_local(grad_placements=[Partial()] if key in self._tp_partial else None)


def _extend_class(module: nn.Module, attrs: dict[str, Any]) -> None:
    """Give `module` a class of its own: a subclass of its class with `attrs`."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), attrs)


def sync_rng_state(mesh: DeviceMesh) -> None:
    """Give every rank of `mesh` the random state of its first rank, so that dropout in the replicated parts of a
    tensor-parallel model draws the same mask on every rank (call it again after re-seeding a rank)."""
    group = mesh.get_group()
    # NCCL sends device tensors only; the generator states are CPU byte tensors.
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    state = torch.get_rng_state().to(device)
    dist.broadcast(state, group=group, group_src=0)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        state = torch.cuda.get_rng_state().to(device)
        dist.broadcast(state, group=group, group_src=0)
        torch.cuda.set_rng_state(state.cpu())


# ----------------------------------------------------------------------------------------------------------------
# Gradients and what a trainer reads


def _unique(params: nn.Module | Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for p in params.parameters() if isinstance(params, nn.Module) else params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def placed_like(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A gradient in its parameter's placements (itself where they agree, or where neither is a DTensor)."""
    if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
        return g.redistribute(p.device_mesh, p.placements)
    return g


def sync_gradients(params: nn.Module | Iterable[torch.Tensor], *, dp_group: dist.ProcessGroup | None = None) -> None:
    """After backward: give every DTensor gradient its parameter's placements (a vocabulary-parallel embedding's
    gradient arrives replicated at full size, a gradient summed over several layouts arrives in one of them, a
    partial sum is reduced), so optimizers step without communication; with `dp_group`, then average every
    gradient over the data-parallel replicas, each of which computed it on its own samples."""
    replicas = dist.get_world_size(dp_group) if dp_group is not None else 1
    for p in _unique(params):
        if p.grad is None:
            continue
        g = p.grad = placed_like(p, p.grad)
        if replicas > 1:
            local = own_values(g)
            dist.all_reduce(local, group=dp_group)
            local.div_(replicas)


class Zero1Optimizer(torch.optim.Optimizer):
    """ZeRO-1 over the data-parallel replicas for parameters split by tensor parallelism (DTensors), where torch's
    ZeroRedundancyOptimizer cannot broadcast them: each replica keeps the optimizer state of its share of the
    tensors (`pyplan.solve.state.zero1_shares` of their local sizes: ZeroRedundancyOptimizer's split, largest
    first to the emptiest replica, which the plan counts) and steps it (`optim`); then every tensor's owner
    broadcasts its local values to the other replicas. The gradients are the replicas' mean beforehand
    (`sync_gradients`). Its own param_groups hold every parameter, for learning-rate schedules; their
    hyperparameters are handed to `optim` at each step."""

    def __init__(self, params: Iterable[nn.Parameter], spec: OptimizerSpec, group: dist.ProcessGroup) -> None:
        self._all = list(params)
        self._group, replicas = group, dist.get_world_size(group)
        shares = zero1_shares([own_values(p.data).numel() for p in self._all], replicas)
        self._owner = {i: r for r, share in enumerate(shares) for i in share}
        mine = [self._all[i] for i in sorted(shares[dist.get_rank(group)])]
        super().__init__(self._all, dict(spec.kwargs))
        self.optim: torch.optim.Optimizer | None = spec.cls(mine, **spec.kwargs) if mine else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("Zero1Optimizer takes no closure")
        if self.optim is not None:
            hand_hyperparameters(self, self.optim)
            self.optim.step()
        for i, p in enumerate(self._all):
            dist.broadcast(own_values(p.data), group=self._group, group_src=self._owner[i])


def own_values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own values on this rank: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def grad_norm_weight(grad: torch.Tensor) -> float:
    """The weight of a gradient's local square in a norm summed over the ranks of its mesh: 1 over the number of
    ranks that hold the same values (the product of the mesh sizes along which it is replicated); 1 for a plain
    tensor. A partial sum must be reduced first (`sync_gradients`)."""
    if not isinstance(grad, DTensor):
        return 1.0
    if any(p.is_partial() for p in grad.placements):
        raise ValueError("a partial gradient counts only once reduced: call sync_gradients first")
    sizes = [grad.device_mesh.size(i) for i, p in enumerate(grad.placements) if p.is_replicate()]
    return 1.0 / math.prod(sizes)


def _fsdp_over_strided(t: DTensor) -> bool:
    """Whether `t` is FSDP2's shard of a tensor-parallel strided shard: dim d split by the outer (dp) axis into
    contiguous chunks of each tp rank's local tensor, which is a strided shard of d on the inner (tp) axis."""
    if t.device_mesh.ndim != 2:
        return False
    outer, inner = t.placements
    # (A strided shard is no Shard on torch 2.13: `is_shard` says False; both have a `dim`.)
    return is_strided(inner) and getattr(outer, "dim", None) == inner.dim  # type: ignore[attr-defined]


def full_value(t: torch.Tensor) -> torch.Tensor:
    """`t` as one process holds it: a DTensor gathered (`full_tensor`), a plain tensor itself. FSDP2's shards of a
    strided tensor-parallel shard (a fused QKV under dp x tp) are gathered in two steps, which torch 2.13 gets wrong
    in one: the dp axis's chunks of each tp rank's local tensor (as FSDP2 cut them, `torch.chunk`, the last ones
    shorter), then the tp axis. Every rank of the mesh must call it."""
    if not isinstance(t, DTensor):
        return t
    if not _fsdp_over_strided(t):
        return t.full_tensor()
    mesh, inner = t.device_mesh, t.placements[1]
    dim = inner.dim  # type: ignore[attr-defined]
    outer_mesh, inner_mesh = mesh[mesh.mesh_dim_names[0]], mesh[mesh.mesh_dim_names[1]]  # type: ignore[index]
    rows = t.shape[dim] // inner_mesh.size()
    sizes = [c.numel() for c in torch.empty(rows, device="meta").chunk(outer_mesh.size())]
    sizes += [0] * (outer_mesh.size() - len(sizes))
    local = t.to_local().movedim(dim, 0)
    padded = local.new_zeros((sizes[0], *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=outer_mesh.get_group())
    whole = torch.cat([part[:n] for part, n in zip(parts, sizes)]).movedim(0, dim)
    return DTensor.from_local(whole, inner_mesh, [inner], run_check=False).full_tensor()


def local_value(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's local tensor of `full` laid out as `like` (the inverse of `full_value`)."""
    if not _fsdp_over_strided(like):
        return distribute_tensor(full, like.device_mesh, like.placements).to_local()
    mesh, inner = like.device_mesh, like.placements[1]
    outer_mesh, inner_mesh = mesh[mesh.mesh_dim_names[0]], mesh[mesh.mesh_dim_names[1]]  # type: ignore[index]
    mine = distribute_tensor(full, inner_mesh, [inner]).to_local()
    chunks = mine.chunk(outer_mesh.size(), dim=inner.dim)  # type: ignore[attr-defined]
    rank = outer_mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else mine.narrow(inner.dim, 0, 0)  # type: ignore[attr-defined]


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as one process holds it (DTensors gathered; a copy), by its name in the model.
    Every rank of the mesh must call it."""
    return {name: full_value(p).detach().clone() for name, p in module.named_parameters()}


def full_gradients(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as one process holds it (DTensors gathered; a copy), by the
    parameter's name in the model; parameters without a gradient are left out. Every rank of the mesh must call it."""
    return {name: full_value(p.grad).detach().clone() for name, p in module.named_parameters() if p.grad is not None}
