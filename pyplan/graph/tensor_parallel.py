"""Tensor-parallel plans derived from a captured graph: Megatron's column-parallel / row-parallel regions.

Implements the layer splitting of Shoeybi et al. 2019 ("Megatron-LM", §3): a column-parallel Linear (each rank
computes a slice of the output features), the operations between (element-wise, reshapes, attention over a slice
of the heads), a row-parallel Linear (each rank reads the same slice of the input features; the outputs are
summed by an all-reduce). In pyplan such a *region* is found, not written: starting from a Linear, the sharded
dimension is followed through the graph node by node (`_through`), Linears that must join (K and V beside Q) are
pulled in, and the region stands only if every value it produces ends in the input features of a Linear. A model
whose blocks show no such pattern keeps them replicated. Besides regions: the token embedding split over the
vocabulary (torch's RowwiseParallel on nn.Embedding) and the output layer split over its outputs and gathered
(ColwiseParallel with replicated output), torchtitan's plan for Llama.

Glossary (torchtitan's): a *style* is what parallelize_module applies to one module (`ColwiseParallel`,
`RowwiseParallel`); *degree* t is the number of ranks a layer is split over; a value is *sharded* along one
dimension (each rank holds 1/t of it, contiguous) or *replicated*.

`local_module(graph, plan, t, rank)` rewrites the GraphModule for one rank: each split weight replaced by that
rank's shard and every size argument that names a sharded dimension made to infer it (-1), so the graph runs on
the rank's slices. The profile prices a degree by running this graph (the split matmuls at their real shapes).
"""

from __future__ import annotations

import copy
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import lazy_graph_module
from pyplan.errors import PlanError
from pyplan.graph.layergraph import LayerGraph
from pyplan.spec import cross_entropy

__all__ = [
    "ELEMENTWISE",
    "RESHAPES",
    "STYLES",
    "Embedding",
    "NotSplit",
    "OutputLayer",
    "Reader",
    "Region",
    "TpPlan",
    "aligned_inputs",
    "derive_tp_plan",
    "linear_operands",
    "local_module",
    "node_arg",
    "op_name",
    "read_tp_plan",
    "restrict_tp_plan",
    "shard_sizes",
    "vocab_parallel_loss",
    "weight_owner",
]

# torchtitan's vocabulary of styles (torch.distributed.tensor.parallel), what a --tp-plan file may name.
STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel")

# Operations that act on each element (or each element's row) without mixing positions across the sharded
# dimension, by normalized name (`_name`): the output is sharded where the sharded inputs are, once shapes are
# aligned from the right; a replicated operand must broadcast along it (size 1 or absent).
ELEMENTWISE = frozenset({
    "abs", "add", "alias", "bfloat16", "clamp", "clone", "contiguous", "cos", "detach", "div", "dropout", "elu",
    "erf", "exp", "expm1", "float", "gelu", "half", "hardsigmoid", "hardswish", "hardtanh", "iadd", "imul",
    "leaky_relu", "log", "log1p", "masked_fill", "mish", "mul", "native_dropout", "neg", "pow", "reciprocal", "relu",
    "relu_", "relu6", "rsqrt", "selu", "sigmoid", "silu", "sin", "softplus", "sqrt", "square", "sub", "tanh", "to",
    "truediv", "type_as", "where", "_to_copy",
    "Dropout", "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "Mish", "ReLU", "ReLU6", "SELU",
    "SiLU", "Sigmoid", "Softplus", "Tanh", "Identity",
})  # fmt: skip
# Reductions over some dimensions, (input, dim, keepdim) as torch and aten take them: followed where they leave the
# sharded dimension out (a norm over each head's features, Qwen3's QK-norm), refused where they reduce along it.
REDUCTIONS = frozenset({"mean", "sum", "amax", "amin"})
# How far back (in nodes) a value that must be sharded may lie from the Linears it comes from: farther is the
# residual stream or an input, never a region's own value.
_MAX_WALK = 200
# Size-taking operations whose size argument for the sharded dimension becomes -1 (infer) on a rank.
RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})


class NotSplit(Exception):
    """A region cannot stand: the reason, for `TpPlan.replicated`."""


@dataclass(frozen=True)
class Region:
    """One Megatron region: `columns` column-parallel Linears (module names), `rows` row-parallel ones.

    `sharded` maps every graph node the region computes to the dimension its value is sharded along (a tuple of
    them for a split); `sizes` are the global sizes of every sharded dimension met (feature and head counts): a
    degree t splits the region only if it divides each. `parts` maps a column Linear whose output is split into
    equal pieces along the sharded dimension (a fused QKV) to their number: each rank takes the same slice of every
    piece. `inputs` are the replicated values the column Linears read (each one all-reduce of its gradient in
    backward), `outputs` the row Linears' nodes (each one all-reduce in forward); `edits` the nodes whose size
    arguments a rank rewrites (node, argument index, or -1 for a fused split). `params` are the whole parameters its
    operations read beside sharded values (Qwen3's per-head query and key norms): each rank's gradient is a partial
    sum over its heads, summed over the ranks."""

    columns: tuple[str, ...]
    rows: tuple[str, ...]
    sharded: Mapping[str, Any]
    sizes: tuple[int, ...]
    parts: Mapping[str, int]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    edits: tuple[tuple[str, int], ...]
    params: tuple[str, ...] = ()

    def splits_at(self, t: int) -> bool:
        return all(s % t == 0 for s in self.sizes)


@dataclass(frozen=True)
class Embedding:
    """A token embedding split over its vocabulary: each rank looks up its rows, an all-reduce sums the output."""

    module: str
    node: str
    vocab: int

    def splits_at(self, t: int) -> bool:
        return self.vocab % t == 0


@dataclass(frozen=True)
class OutputLayer:
    """A Linear whose output leaves the model (the logits): split over its outputs, then all-gathered."""

    module: str
    node: str
    input: str
    out_features: int

    def splits_at(self, t: int) -> bool:
        return self.out_features % t == 0


@dataclass(frozen=True)
class TpPlan:
    """What splits under tensor parallelism, and why the rest does not (`replicated`: Linear module -> reason)."""

    regions: tuple[Region, ...] = ()
    embeddings: tuple[Embedding, ...] = ()
    output_layers: tuple[OutputLayer, ...] = ()
    replicated: Mapping[str, str] = field(default_factory=dict)

    def styles(self, t: int) -> dict[str, str]:
        """The parallelize_module plan at degree t: module name -> style, torchtitan's names."""
        out: dict[str, str] = {}
        for r in self.regions:
            if r.splits_at(t):
                out.update(dict.fromkeys(r.columns, "ColwiseParallel"))
                out.update(dict.fromkeys(r.rows, "RowwiseParallel"))
        out.update({e.module: "RowwiseParallel" for e in self.embeddings if e.splits_at(t)})
        out.update({o.module: "ColwiseParallel" for o in self.output_layers if o.splits_at(t)})
        return out

    def partial_params(self, t: int) -> tuple[str, ...]:
        """The whole parameters the regions split at degree t read beside sharded values: each rank's gradient is a
        partial sum, summed over the ranks."""
        return tuple(p for r in self.regions if r.splits_at(t) for p in r.params)

    def degrees(self, most: int = 8) -> tuple[int, ...]:
        """Every degree up to `most` that splits at least one layer (1 always)."""
        return tuple(t for t in range(1, most + 1) if t == 1 or self.styles(t))

    def to_json(self) -> dict[str, Any]:
        return {
            "regions": [
                {"columns": list(r.columns), "rows": list(r.rows), "sizes": list(r.sizes), "parts": dict(r.parts)}
                for r in self.regions
            ],
            "embeddings": [{"module": e.module, "vocab": e.vocab} for e in self.embeddings],
            "output_layers": [{"module": o.module, "out_features": o.out_features} for o in self.output_layers],
            "replicated": dict(self.replicated),
        }


# ----------------------------------------------------------------------------------------------------------------
# Reading the graph


def weight_owner(gm: fx.GraphModule, weight: fx.Node, kind: str) -> str:
    """The module an aten linear or embedding reads its weight from (`weight`, a get_attr), by name. torch.export
    reads a tied weight under one name for every use (Hugging Face's tied token embedding and output layer: both
    `lm_head.weight`), though the module tree holds it under each; to split both layers, each gets a name of its
    own: the embedding the first one the weight has (where the model made it), a Linear the one it is read under,
    or the next one if that is the first."""
    target = str(weight.target)
    first = target.rpartition(".")[0]
    try:
        param = gm.get_parameter(target)
    except AttributeError:  # a buffer or a constant
        return first
    names = [name for name, p in gm.named_parameters(remove_duplicate=False) if p is param]
    if len(names) < 2 or not all(name.endswith(".weight") for name in names):
        return first
    owners = [name.rpartition(".")[0] for name in names]
    if kind == "embedding":
        return owners[0]
    return owners[1] if first == owners[0] else first


def op_name(n: fx.Node, gm: fx.GraphModule) -> str:
    """An operation's name whatever the capture: `view` for aten.view.default, Tensor.view and torch.view alike;
    a module call by its class."""
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op == "call_method":
        return str(n.target)
    if n.op == "call_function":
        if n.target is operator.getitem:
            return "getitem"
        return getattr(n.target, "__name__", str(n.target)).split(".")[0]
    return n.op


def node_arg(n: fx.Node, index: int, key: str, default: Any = None) -> Any:
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(key, default)


@dataclass(frozen=True)
class _Linear:
    """A Linear's call: `transposed` for `addmm(bias, x, weight)` on a weight laid out (in, out), Hugging Face's
    `Conv1D` (GPT-2) as torch.export captures it."""

    module: str
    node: str
    input: fx.Node
    weight: nn.Parameter | torch.Tensor
    in_features: int
    out_features: int
    transposed: bool = False


def linear_operands(n: fx.Node) -> tuple[Any, Any, Any] | None:
    """(input, weight, bias) of an aten linear, or of an `addmm(bias, x, weight)` on a get_attr weight (a
    transposed Linear); None for other nodes."""
    if n.op != "call_function":
        return None
    name = getattr(n.target, "__name__", "").split(".")[0]
    if name == "linear":
        return n.args[0], node_arg(n, 1, "weight"), node_arg(n, 2, "bias")
    bias, x, weight = (*n.args, None, None, None)[:3]
    on_attrs = all(isinstance(a, fx.Node) and a.op == "get_attr" for a in (bias, weight))
    if name == "addmm" and len(n.args) == 3 and not n.kwargs and on_attrs:
        return x, weight, bias
    return None


class Reader:
    """The captured graph with what the analysis asks of it: shapes, Linears, users, static values."""

    def __init__(self, graph: LayerGraph) -> None:
        self.layer = graph
        self.gm = graph.module
        self.nodes = {n.name: n for n in self.gm.graph.nodes}
        self.linears: dict[str, _Linear] = {}
        self.embeddings: dict[str, tuple[str, int]] = {}
        for n in self.gm.graph.nodes:
            found = self._linear(n)
            if found is not None:
                self.linears[n.name] = found
            emb = self._embedding(n)
            if emb is not None:
                self.embeddings[n.name] = emb

    def shape(self, n: fx.Node) -> tuple[int, ...] | None:
        info = self.layer.node(n.name)
        return tuple(info.outputs[0].shape) if info.is_tensor and info.outputs else None

    def static(self, n: fx.Node) -> bool:
        return self.layer.node(n.name).static

    def attr(self, n: Any) -> Any:
        if not isinstance(n, fx.Node) or n.op != "get_attr":
            return None
        obj: Any = self.gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj

    def _linear(self, n: fx.Node) -> _Linear | None:
        if n.op == "call_module":
            mod = self.gm.get_submodule(str(n.target))
            if type(mod) is nn.Linear and n.args and isinstance(n.args[0], fx.Node):
                return _Linear(str(n.target), n.name, n.args[0], mod.weight, mod.in_features, mod.out_features)
            return None
        operands = linear_operands(n)
        if operands is not None and isinstance(operands[0], fx.Node):
            x, w, _ = operands
            weight = self.attr(w)
            if isinstance(weight, torch.Tensor) and weight.dim() == 2:
                module = weight_owner(self.gm, w, "linear")
                if op_name(n, self.gm) == "addmm":
                    return _Linear(module, n.name, x, weight, weight.shape[0], weight.shape[1], transposed=True)
                return _Linear(module, n.name, x, weight, weight.shape[1], weight.shape[0])
        return None

    def _embedding(self, n: fx.Node) -> tuple[str, int] | None:
        if n.op == "call_module":
            mod = self.gm.get_submodule(str(n.target))
            if type(mod) is nn.Embedding and mod.padding_idx is None and mod.max_norm is None:
                return str(n.target), mod.num_embeddings
            return None
        if n.op == "call_function" and op_name(n, self.gm) == "embedding":
            weight = self.attr(n.args[0])
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and len(n.args) <= 2:
                return weight_owner(self.gm, n.args[0], "embedding"), weight.shape[0]
        return None

    def tensor_inputs(self, n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if self.layer.node(a.name).outputs]


# ----------------------------------------------------------------------------------------------------------------
# Following a sharded dimension through one operation


def _dim(d: Any, ndim: int) -> int:
    if not isinstance(d, int):
        raise NotSplit(f"a dimension given as {d!r}")
    return d + ndim if d < 0 else d


def _sizes(n: fx.Node) -> tuple[list[Any], int]:
    """The size arguments of view/reshape/expand and the index of the first of them in n.args (a list argument:
    -1 - its index)."""
    if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)):
        return list(n.args[1]), -2
    return list(n.args[1:]), 1


def _reshaped_dim(before: Sequence[int], after: Sequence[int], d: int) -> int:
    """The output dimension a reshape of `before` into `after` shards when the input is sharded along d: the
    outermost output dimension (of size > 1) of the group of dimensions with equal products that holds d, d being
    the outermost input dimension of size > 1 in its group (so contiguous slices stay contiguous)."""
    i = j = 0
    while i < len(before) or j < len(after):
        gi, gj, pi, pj = [i], [j], before[i] if i < len(before) else 1, after[j] if j < len(after) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= before[i]
                gi.append(i)
                i += 1
            else:
                pj *= after[j]
                gj.append(j)
                j += 1
        if d in gi:
            if any(before[k] > 1 for k in gi if k < d):
                raise NotSplit("a reshape merges the sharded dimension under an outer one")
            return next(k for k in gj if k < len(after) and after[k] > 1)
    raise NotSplit("a reshape the analysis cannot follow")


def _fused_source(r: Reader, n: fx.Node) -> str | None:
    """The Linear whose output n is, itself or reshaped with its features kept last (a transposed Linear's
    (b·t, 3h) output viewed as (b, t, 3h)): its node, or None."""
    while n.name not in r.linears:
        shape, src = r.shape(n), (r.shape(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None)
        if op_name(n, r.gm) not in RESHAPES or shape is None or src is None or shape[-1] != src[-1]:
            return None
        n = n.args[0]
    return n.name


def aligned_inputs(r: Reader, n: fx.Node, ins: Sequence[fx.Node], at: int, dims: Mapping[str, Any]) -> dict[str, int]:
    """For an element-wise n whose output is split along `at`: the inputs not in `dims` that hold that dimension
    (not broadcast along it), with the dimension they hold it in, shapes aligned from the right. NotSplit where an
    input in `dims` is split along another."""
    out = r.shape(n) or ()
    whole: dict[str, int] = {}
    for a in ins:
        shape = r.shape(a) or ()
        k = at - (len(out) - len(shape))
        if a.name in dims:
            if dims[a.name] != k:
                raise NotSplit(f"'{n.name}' combines values sharded along different dimensions")
        elif 0 <= k < len(shape) and shape[k] != 1:
            whole[a.name] = k
    return whole


def _through(r: Reader, n: fx.Node, dims: Mapping[str, Any]) -> tuple[Any, int | None, tuple[int, ...]]:
    """How the sharding of n's inputs (`dims`: node -> dimension) carries through n: (the output's sharded
    dimension, or a tuple of them for a split; the index of a size argument a rank rewrites, or None; the global
    sizes of the sharded dimensions met). Raises NotSplit where it does not."""
    name = op_name(n, r.gm)
    ins = r.tensor_inputs(n)
    sharded = [a for a in ins if a.name in dims]
    out = r.shape(n)
    first = sharded[0]
    d = dims[first.name]
    if not isinstance(d, int):
        raise NotSplit(f"'{n.name}' reads a split's pieces whole")
    src = r.shape(first)
    if src is None:
        raise NotSplit(f"'{first.name}' is not one tensor")
    if name == "getitem":
        raise NotSplit(f"'{n.name}' indexes a sharded tensor")
    if name in ELEMENTWISE or (n.op == "call_module" and name in ELEMENTWISE):
        if out is None:
            raise NotSplit(f"'{n.name}' returns no tensor")
        at = d + len(out) - len(src)
        whole = aligned_inputs(r, n, ins, at, dims)
        if whole:
            raise NotSplit(f"'{n.name}' combines a sharded value with a whole one ('{next(iter(whole))}')")
        return at, None, (out[at],)
    if name in ("transpose", "swapaxes"):
        a, b = _dim(node_arg(n, 1, "dim0"), len(src)), _dim(node_arg(n, 2, "dim1"), len(src))
        return {a: b, b: a}.get(d, d), None, ()
    if name == "permute":
        order = _sizes(n)[0]
        return [_dim(x, len(src)) for x in order].index(d), None, ()
    if name == "unsqueeze":
        k = _dim(node_arg(n, 1, "dim"), len(src) + 1)
        return d + (k <= d), None, ()
    if name in REDUCTIONS:
        given = node_arg(n, 1, "dim")
        if given is None or given == []:
            raise NotSplit(f"'{n.name}' reduces every dimension, the sharded one too")
        reduced = {_dim(k, len(src)) for k in (given if isinstance(given, (list, tuple)) else (given,))}
        if d in reduced:
            raise NotSplit(f"'{n.name}' reduces along the sharded dimension")
        keepdim = node_arg(n, 2, "keepdim", False)
        return (d if keepdim else d - sum(k < d for k in reduced)), None, ()
    if name == "select":
        k = _dim(node_arg(n, 1, "dim"), len(src))
        if k == d:
            raise NotSplit(f"'{n.name}' picks along the sharded dimension")
        return d - (k < d), None, ()
    if name in ("layer_norm", "LayerNorm"):
        if n.op == "call_module":
            shape = r.gm.get_submodule(str(n.target)).normalized_shape
        else:
            shape = node_arg(n, 1, "normalized_shape")
        if not isinstance(shape, (list, tuple)) or d >= len(src) - len(shape):
            raise NotSplit(f"'{n.name}' normalizes along the sharded dimension")
        return d, None, ()
    if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
        if _dim(node_arg(n, 1, "dim"), len(src)) == d:
            raise NotSplit(f"'{n.name}' normalizes along the sharded dimension")
        return d, None, ()
    if name in RESHAPES or name == "expand":
        assert out is not None
        sizes, at = _sizes(n)
        k = _reshaped_dim(src, out, d) if name in RESHAPES else d + len(out) - len(src)
        if (
            name in RESHAPES
            and any(isinstance(s, int) and s == -1 for i, s in enumerate(sizes) if i != k)
            and not isinstance(sizes[k], int)
        ):
            raise NotSplit(f"'{n.name}' infers another dimension (-1) and computes the sharded one")
        if isinstance(sizes[k], int) and sizes[k] == -1:
            return k, None, (out[k],)
        return k, (-2 - k if at < 0 else 1 + k), (out[k],)
    if name in ("split", "chunk", "split_with_sizes"):
        k = _dim(node_arg(n, 2, "dim", 0), len(src))
        pieces = len(r.layer.node(n.name).outputs)
        if k == d:
            if _fused_source(r, first) is None or src[d] % pieces:
                raise NotSplit(f"'{n.name}' splits the sharded dimension other than a Linear's fused outputs")
            if name == "split_with_sizes" and len(set(node_arg(n, 1, "split_sizes"))) != 1:
                raise NotSplit(f"'{n.name}' splits into unequal pieces")
            return (d,) * pieces, -1, (src[d] // pieces,)
        return (d,) * pieces, None, ()
    if name in ("slice", "narrow"):
        if _dim(node_arg(n, 1, "dim", 0), len(src)) == d and out != src:
            raise NotSplit(f"'{n.name}' slices the sharded dimension")
        return d, None, ()
    if name == "cat":
        k = _dim(node_arg(n, 1, "dim", 0), len(src))
        if k == d or len(sharded) != len(ins):
            raise NotSplit(f"'{n.name}' concatenates along the sharded dimension or with whole values")
        return d, None, ()
    if name == "scaled_dot_product_attention":
        heads = len(src) - 3
        if len(src) != 4 or any(dims.get(a.name) != heads for a in (n.args[:3])):
            raise NotSplit(f"'{n.name}' has query, key and value not all sharded along their heads")
        mask = node_arg(n, 3, "attn_mask")
        if isinstance(mask, fx.Node) and (r.shape(mask) or (1,) * 4)[-3:][0] != 1 and mask.name not in dims:
            raise NotSplit(f"'{n.name}' has a mask per head")
        return heads, None, tuple(r.shape(a)[heads] for a in n.args[:3])  # type: ignore[index]
    if name in ("matmul", "bmm"):
        if len(sharded) != 2 or d >= len(src) - 2 or dims[ins[1].name] != d:
            raise NotSplit(f"'{n.name}' multiplies along the sharded dimension")
        return d, None, ()
    if name == "_assert_tensor_metadata" and n.kwargs.get("size") is None:
        return None, None, ()
    raise NotSplit(f"'{n.name}' ({name}) is not an operation tensor parallelism follows")


# ----------------------------------------------------------------------------------------------------------------
# Growing regions


def _region(r: Reader, seed: str) -> Region:
    """The region that `seed` (a Linear's node) opens, grown until it closes, or NotSplit."""
    entries = {seed}
    while True:
        pulled = _follow(r, entries)
        if isinstance(pulled, Region):
            return pulled
        entries |= pulled


def _follow(r: Reader, entries: set[str]) -> Region | set[str]:
    """Propagate from the column Linears `entries`: the region, or more Linears it needs as columns."""
    dims: dict[str, Any] = {e: len(r.shape(r.nodes[e]) or (0,)) - 1 for e in entries}
    sizes: list[int] = []
    for e in entries:
        sizes.append(r.linears[e].out_features)
    rows: dict[str, _Linear] = {}
    edits: list[tuple[str, int]] = []
    parts: dict[str, int] = {}
    pending = list(entries)
    waiting: set[str] = set()
    while pending:
        value = r.nodes[pending.pop()]
        for user in value.users:
            if user.name in dims or user.name in rows:
                continue
            lin = r.linears.get(user.name)
            if lin is not None and lin.input is value:
                if dims[value.name] != len(r.shape(value) or ()) - 1:
                    raise NotSplit(f"'{lin.module}' reads a value sharded along other than its features")
                rows[user.name] = lin
                sizes.append(lin.in_features)
                continue
            if user.op == "output":
                raise NotSplit(f"'{value.name}' leaves the model sharded")
            if op_name(user, r.gm) == "getitem" and isinstance(dims[value.name], tuple):
                dims[user.name] = dims[value.name][user.args[1]]
                pending.append(user.name)
                continue
            missing = [a for a in r.tensor_inputs(user) if a.name not in dims and _needs_shard(r, user, a, dims)]
            if missing:
                more = _columns_behind(r, missing) - entries
                if more:
                    return more
                waiting.add(user.name)  # its other inputs are on their way from these columns
                continue
            out, edit, met = _through(r, user, dims)
            sizes.extend(met)
            if edit is not None:
                edits.append((user.name, edit))
                if edit == -1:
                    source = _fused_source(r, value)
                    assert source is not None
                    parts[r.linears[source].module] = len(out)  # a split: one dimension per piece
            if out is None:
                continue
            dims[user.name] = out
            pending.append(user.name)
    stuck = sorted(waiting - set(dims))
    if stuck:
        raise NotSplit(f"'{stuck[0]}' mixes a sharded value with a whole one")
    if not rows:
        raise NotSplit("its values never reach a Linear's input features")
    inputs = tuple(dict.fromkeys(r.linears[e].input.name for e in sorted(entries)))
    params = _region_params(r, dims)
    return Region(
        columns=tuple(r.linears[e].module for e in sorted(entries, key=list(r.nodes).index)),
        rows=tuple(lin.module for lin in sorted(rows.values(), key=lambda x: list(r.nodes).index(x.node))),
        sharded=dims,
        sizes=tuple(sorted(set(sizes))),
        parts=parts,
        inputs=inputs,
        outputs=tuple(sorted(rows, key=list(r.nodes).index)),
        edits=tuple(edits),
        params=params,
    )


def _region_params(r: Reader, dims: Mapping[str, Any]) -> tuple[str, ...]:
    """The whole parameters the region's operations (`dims`: its sharded nodes) read beside sharded values, by
    qualified name, directly or through elementwise casts; NotSplit where one is also read outside the region (its
    gradient there would be counted once per rank)."""
    params: dict[str, None] = {}
    reads: set[str] = set(dims)
    for name in dims:
        if name in r.linears:  # a column Linear's own weight and bias are split with it
            continue
        for a in r.tensor_inputs(r.nodes[name]):
            if a.name in dims:
                continue
            source, path = source_through_casts(r, a)
            if source.op == "get_attr" and isinstance(r.attr(source), nn.Parameter):
                params[str(source.target)] = None
                reads.update(path)
    for n in r.gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) in params:
            outside = [u.name for u in n.users if u.name not in reads]
            if outside:
                raise NotSplit(f"'{outside[0]}' reads the parameter '{n.target}' outside the region as well")
    return tuple(params)


def source_through_casts(r: Reader, a: fx.Node) -> tuple[fx.Node, list[str]]:
    """The node `a` comes from through single-input elementwise operations (casts, a norm weight's `+ 1`), with
    the names of the nodes on the way, itself and `a` included."""
    path = [a.name]
    while a.op != "get_attr" and len(a.all_input_nodes) == 1 and op_name(a, r.gm) in ELEMENTWISE:
        a = a.all_input_nodes[0]
        path.append(a.name)
    return a, path


def _needs_shard(r: Reader, user: fx.Node, a: fx.Node, dims: Mapping[str, Any]) -> bool:
    """Whether input `a` of `user` must be sharded too (it is whole along the dimension the sharded inputs are
    sharded along, where an operation that pairs them element by element, or attention, needs it sharded)."""
    name = op_name(user, r.gm)
    if name == "scaled_dot_product_attention":
        return a in user.args[:3]
    if name in ("matmul", "bmm", "cat"):
        return True
    if name not in ELEMENTWISE or r.static(a):
        return False
    out, shape = r.shape(user), r.shape(a)
    sharded = next(x for x in r.tensor_inputs(user) if x.name in dims)
    src = r.shape(sharded)
    if out is None or shape is None or src is None or not isinstance(dims[sharded.name], int):
        return False
    k = dims[sharded.name] + len(out) - len(src) - (len(out) - len(shape))
    return 0 <= k < len(shape) and shape[k] != 1


def _columns_behind(r: Reader, missing: list[fx.Node]) -> set[str]:
    """The Linears whose outputs the `missing` values come from, through operations that keep positions; a value
    that comes from elsewhere (the residual stream, an input) ends the region."""
    found: set[str] = set()
    stack, seen = list(missing), set()
    while stack:
        v = stack.pop()
        if v.name in seen:
            continue
        seen.add(v.name)
        if v.name in r.linears:
            found.add(v.name)
            continue
        sources = [a for a in r.tensor_inputs(v) if not r.static(a)]
        if op_name(v, r.gm) in ELEMENTWISE:  # operands that broadcast along the sharded dimension need not be
            sources = [a for a in sources if r.shape(a) == r.shape(v)]
        if v.op in ("placeholder", "get_attr") or not sources or len(seen) > _MAX_WALK:
            raise NotSplit(f"'{v.name}' must be sharded but comes from no Linear")
        stack.extend(sources)
    return found


def vocab_parallel_loss(graph: LayerGraph, plan: TpPlan, degree: int, loss: Callable[..., Any] | None) -> bool:
    """Whether the loss runs on each rank's slice of the vocabulary at `degree` (torchtitan's `loss_parallel`):
    the loss is `pyplan.spec.cross_entropy` (classes along the last dimension), the model's only output is the
    logits of an output layer split at that degree (through operations that keep the last dimension, as
    `derive_tp_plan` finds output layers), whose last dimension is that layer's outputs. The output layer then
    hands each rank its slice of the logits and the loss sums over the ranks: no logits gathered whole."""
    if loss is not cross_entropy:
        return False
    layers = [o for o in plan.output_layers if o.splits_at(degree)]
    out = next((n for n in graph.nodes if n.op == "output"), None)
    if len(layers) != 1 or out is None or len(out.inputs) != 1:
        return False
    info = graph.node(out.inputs[0]).outputs
    return len(info) == 1 and bool(info[0].shape) and info[0].shape[-1] == layers[0].out_features


def derive_tp_plan(graph: LayerGraph) -> TpPlan:
    """The tensor-parallel plan of a captured model: every Megatron region, the vocabulary-parallel embeddings and
    the output layers; each Linear that joins none, with the reason."""
    r = Reader(graph)
    regions: list[Region] = []
    taken: set[str] = set()
    replicated: dict[str, str] = {}
    for name, lin in r.linears.items():
        if name in taken:
            continue
        try:
            region = _region(r, name)
        except NotSplit as why:
            replicated[lin.module] = str(why)
            continue
        regions.append(region)
        taken |= {n for n in region.sharded if n in r.linears} | set(region.outputs)
        for module in region.columns + region.rows:
            replicated.pop(module, None)
    outputs = [
        OutputLayer(lin.module, name, lin.input.name, lin.out_features)
        for name, lin in r.linears.items()
        if name not in taken and _leaves_model(r, r.nodes[name])
    ]
    for o in outputs:
        replicated.pop(o.module, None)
    # Token embeddings only: a table looked up by positions (computed, not read from an input) stays whole.
    embeddings = [
        Embedding(module, name, vocab)
        for name, (module, vocab) in r.embeddings.items()
        if _from_input(r, _ids(r.nodes[name]))
    ]
    plan = TpPlan(tuple(regions), tuple(embeddings), tuple(outputs), replicated)
    return _untie(r, plan)


def _from_input(r: Reader, n: fx.Node) -> bool:
    """Whether n is a model input, itself or reshaped (GPT-2 views its ids as (-1, T))."""
    while n.op != "placeholder":
        if op_name(n, r.gm) not in RESHAPES | {"unsqueeze"} or not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return True


def _ids(n: fx.Node) -> fx.Node:
    """The indices an embedding looks up."""
    return n.args[0] if n.op == "call_module" else n.args[1]


def _leaves_model(r: Reader, n: fx.Node) -> bool:
    """Whether n's value is (a reshape or element-wise image of) an output of the model."""
    for user in n.users:
        if user.op == "output":
            continue
        if op_name(user, r.gm) not in RESHAPES | {"contiguous", "to", "float", "_to_copy", "slice"}:
            return False
        if not _leaves_model(r, user):
            return False
    return bool(n.users)


def _untie(r: Reader, plan: TpPlan) -> TpPlan:
    """A weight shared by several layers (tied embeddings) splits only if every one of them splits it alike: the
    embedding over its rows (the vocabulary) and the output layer over its outputs (the vocabulary again) do;
    otherwise every layer that shares it stays whole."""
    how: dict[int, set[Any]] = {}
    for e in plan.embeddings:
        how.setdefault(id(_weight_of(r, e.node)), set()).add(("rows", 1, e.vocab))
    for o in plan.output_layers:
        how.setdefault(id(r.linears[o.node].weight), set()).add(("rows", 1, o.out_features))
    split: set[str] = {o.node for o in plan.output_layers}
    for g in plan.regions:
        for node in (n for n in g.sharded if n in r.linears):
            lin = r.linears[node]
            how.setdefault(id(lin.weight), set()).add(("rows", g.parts.get(lin.module, 1), g.sizes))
            split.add(node)
        for node in g.outputs:
            how.setdefault(id(r.linears[node].weight), set()).add(("columns", g.sizes))
            split.add(node)
    for node, lin in r.linears.items():
        if node not in split and id(lin.weight) in how:
            how[id(lin.weight)].add("whole")
    # Any other reader of such a weight (an embedding with a padding index, which `_embedding` does not take, an
    # operation on the weight itself) reads it whole.
    splitting = split | {e.node for e in plan.embeddings}
    for n in r.gm.graph.nodes:
        held: list[Any] = []
        if n.op == "get_attr" and any(u.name not in splitting for u in n.users):
            held = [r.attr(n)]
        elif n.op == "call_module" and n.name not in splitting:
            held = list(r.gm.get_submodule(str(n.target)).parameters())
        for w in held:
            if id(w) in how:
                how[id(w)].add("whole")
    bad = {w for w, ways in how.items() if len(ways) > 1}
    if not bad:
        return plan
    shared = "shares its weight with a layer split otherwise (tied weights)"
    regions = [g for g in plan.regions if not any(id(r.linears[n].weight) in bad for n in (*g.outputs, *g.sharded)
                                                   if n in r.linears)]  # fmt: skip
    embeddings = [e for e in plan.embeddings if id(_weight_of(r, e.node)) not in bad]
    outputs = [o for o in plan.output_layers if id(r.linears[o.node].weight) not in bad]
    replicated = dict(plan.replicated)
    for g in (g for g in plan.regions if g not in regions):  # regions hold dicts: not hashable
        replicated.update(dict.fromkeys(g.columns + g.rows, shared))
    replicated.update({x.module: shared for x in (*plan.embeddings, *plan.output_layers)
                       if x not in embeddings and x not in outputs})  # fmt: skip
    return TpPlan(tuple(regions), tuple(embeddings), tuple(outputs), replicated)


def _weight_of(r: Reader, node: str) -> torch.Tensor:
    n = r.nodes[node]
    if n.op == "call_module":
        return r.gm.get_submodule(str(n.target)).weight
    return r.attr(n.args[0])


# ----------------------------------------------------------------------------------------------------------------
# One rank's graph


def _shard(t: torch.Tensor, dim: int, degree: int, rank: int, parts: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `t` along `dim`: of each of `parts` equal pieces, the rank-th of `degree` slices."""
    pieces = t.chunk(parts, dim) if parts > 1 else (t,)
    return (
        torch.cat([p.chunk(degree, dim)[rank] for p in pieces], dim)
        if parts > 1
        else pieces[0].chunk(degree, dim)[rank]
    )


def _replace_weight(
    gm: fx.GraphModule,
    n: fx.Node,
    new: Callable[[torch.Tensor, str], torch.Tensor],
    made: dict[int, nn.Parameter],
) -> None:
    """Give the layer called at n new weights (and bias): `new(tensor, 'weight' | 'bias')`, once per original
    tensor (`made`, by its id), so tied weights stay one parameter."""

    def shard(old: torch.Tensor, key: str) -> nn.Parameter:
        if id(old) not in made:
            made[id(old)] = nn.Parameter(new(old.detach(), key), old.requires_grad)
        return made[id(old)]

    if n.op == "call_module":
        old = gm.get_submodule(str(n.target))
        mod = copy.copy(old)
        mod._parameters = dict(old._parameters)
        for key in ("weight", "bias"):
            if old._parameters.get(key) is not None:
                mod._parameters[key] = shard(old._parameters[key], key)
        if isinstance(mod, nn.Linear):
            mod.out_features, mod.in_features = mod.weight.shape
        elif isinstance(mod, nn.Embedding):
            mod.num_embeddings = mod.weight.shape[0]
        parent, _, leaf = str(n.target).rpartition(".")
        setattr(gm.get_submodule(parent), leaf, mod)
        return
    operands = linear_operands(n)
    pairs = zip(("weight", "bias"), operands[1:] if operands is not None else n.args[:1])  # an embedding: its table
    for key, arg in pairs:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            parent, _, leaf = str(arg.target).rpartition(".")
            owner = gm.get_submodule(parent)
            held = getattr(owner, leaf)
            if not any(held is m for m in made.values()):  # a tied weight read by two layers: shard it once
                setattr(owner, leaf, shard(held, key))


def local_module(graph: LayerGraph, plan: TpPlan, degree: int, rank: int = 0) -> fx.GraphModule:
    """Rank `rank`'s GraphModule at tensor-parallel degree `degree`: the split layers hold the rank's shards (column
    Linears a slice of their outputs, of each fused piece; row Linears a slice of their inputs and the whole bias;
    embeddings a slice of the vocabulary; output layers a slice of their outputs), and the size arguments of
    sharded dimensions infer them (`shard_sizes`). The collectives are not in it: the runtime's styles add them,
    the profile prices them (pyplan/profile/tensor_parallel.py). The original graph and model are untouched."""
    copied = copy.deepcopy(graph.module.graph)
    nodes = {n.name: n for n in copied.nodes}
    _edit_sizes(nodes, graph, plan, degree)
    # Its code is generated when it first runs: the profile records the rank's shapes node by node and runs its
    # distinct blocks' pieces alone.
    gm = lazy_graph_module(graph.module, copied, type(graph.module).__name__)
    r = Reader(graph)
    made: dict[int, nn.Parameter] = {}
    for region in plan.regions:
        if not region.splits_at(degree):
            continue
        for name, lin in r.linears.items():
            # (A transposed Linear holds its weight as (in, out): the other dimension.)
            out_dim, in_dim = (1, 0) if lin.transposed else (0, 1)
            if lin.module in region.columns:
                parts = region.parts.get(lin.module, 1)
                _replace_weight(
                    gm,
                    nodes[name],
                    lambda t, key, p=parts, o=out_dim: _shard(t, o if key == "weight" else 0, degree, rank, p),
                    made,
                )
            elif lin.module in region.rows:
                _replace_weight(
                    gm, nodes[name], lambda t, key, i=in_dim: _shard(t, i, degree, rank) if key == "weight" else t, made
                )
    for e in plan.embeddings:
        if e.splits_at(degree):
            _replace_weight(gm, nodes[e.node], lambda t, key: _shard(t, 0, degree, rank), made)
    for o in plan.output_layers:
        if o.splits_at(degree):
            _replace_weight(gm, nodes[o.node], lambda t, key: _shard(t, 0, degree, rank), made)
    return gm


def shard_sizes(gm: fx.GraphModule, graph: LayerGraph, plan: TpPlan, degree: int) -> None:
    """Rewrite `gm` (the captured GraphModule of `graph`, or a copy with the same node names) in place so that it
    runs on one rank's slices at `degree`: every size argument that names a sharded dimension infers it (-1), and a
    fused Linear's output splits into its pieces whatever their size (a chunk). Weights are not touched."""
    _edit_sizes({n.name: n for n in gm.graph.nodes}, graph, plan, degree)
    gm.recompile()


def _edit_sizes(nodes: dict[str, fx.Node], graph: LayerGraph, plan: TpPlan, degree: int) -> None:
    """`shard_sizes`' edits on the nodes of a graph (by name), without generating its module's code."""
    for region in plan.regions:
        if region.splits_at(degree):
            for node, index in region.edits:
                _edit(nodes[node], index, len(graph.node(node).outputs), degree)


def _edit(n: fx.Node, index: int, pieces: int, degree: int) -> None:
    """Make the size argument at `index` (-2 - i: item i of the list argument) infer its dimension, or, where
    another size infers its own (`view(-1, 64)`), a rank's share of it; index -1: the split of a fused Linear's
    output into `pieces` equal pieces becomes a chunk into as many (each piece is 1/t of its global size on a
    rank)."""
    if index == -1:
        dim = node_arg(n, 2, "dim", 0)
        if n.op == "call_method":
            n.target = "chunk"
        else:
            n.target = torch.ops.aten.chunk.default if isinstance(n.target, torch._ops.OpOverload) else torch.chunk
        n.args, n.kwargs = (n.args[0], pieces), {"dim": dim}
        return
    args = list(n.args)
    sizes = list(args[1:]) if index >= 0 else list(args[1])
    at = index - 1 if index >= 0 else -2 - index
    infers = any(isinstance(x, int) and x == -1 for i, x in enumerate(sizes) if i != at)
    size = sizes[at] // degree if infers else -1
    if index >= 0:
        args[index] = size
    else:
        sizes[at] = size
        args[1] = tuple(sizes) if isinstance(args[1], tuple) else sizes
    n.args = tuple(args)


# ----------------------------------------------------------------------------------------------------------------
# A plan written by the user


def read_tp_plan(path: str | Path) -> dict[str, str]:
    """A --tp-plan file: a JSON object of module name -> style (torchtitan's names, `STYLES`). Raises PlanError
    naming the problem; `restrict_tp_plan` checks it against the model."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PlanError(f"cannot read the TP plan {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PlanError(f"the TP plan {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise PlanError(f"the TP plan {path} must be a JSON object of module name -> style, e.g. "
                        '{"layers.0.mlp.fc1": "ColwiseParallel"}')  # fmt: skip
    for module, style in data.items():
        if style not in STYLES:
            raise PlanError(f"TP plan: unknown style '{style}' for '{module}'; choose one of {', '.join(STYLES)}")
    return dict(data)


def _check_styles(styles: Mapping[str, str], graph: LayerGraph) -> None:
    """Every module of `styles` exists in the model and its style fits it (a Linear takes ColwiseParallel or
    RowwiseParallel, an Embedding RowwiseParallel, a norm SequenceParallel)."""
    kinds = _module_kinds(graph)
    for module, style in styles.items():
        if module not in kinds:
            close = [m for m in kinds if m.endswith(module.rpartition(".")[2])][:3]
            hint = f"; close: {', '.join(close)}" if close else ""
            raise PlanError(f"TP plan: the model has no module '{module}'{hint}")
        fits = {"linear": ("ColwiseParallel", "RowwiseParallel"), "embedding": ("RowwiseParallel",),
                "norm": ("SequenceParallel",)}.get(kinds[module], ())  # fmt: skip
        if style not in fits:
            takes = "it takes " + " or ".join(fits) if fits else "only Linear, Embedding and norm modules split"
            raise PlanError(f"TP plan: {style} does not fit '{module}' (a {kinds[module]}); {takes}")


def _module_kinds(graph: LayerGraph) -> dict[str, str]:
    """Every module the captured graph calls, by name: 'linear', 'embedding', 'norm' or 'other'."""
    r = Reader(graph)
    kinds = {lin.module: "linear" for lin in r.linears.values()}
    kinds.update({module: "embedding" for module, _ in r.embeddings.values()})
    for n in graph.nodes:
        path = n.module_path
        if path and path not in kinds:
            leaf = path.rpartition(".")[2].lower()
            kinds[path] = "norm" if "norm" in leaf or leaf.startswith("ln") else "other"
    return kinds


def restrict_tp_plan(plan: TpPlan, styles: Mapping[str, str], graph: LayerGraph) -> TpPlan:
    """`plan` (derived from `graph`) cut down to what a user's `styles` (read_tp_plan's) ask for: a region splits
    when all its column Linears are given ColwiseParallel and all its row Linears RowwiseParallel, an embedding
    when given RowwiseParallel, an output layer ColwiseParallel. A norm given SequenceParallel splits nothing here:
    it asks for sequence parallelism, which covers every value between the split layers that the analysis allows
    (pyplan/graph/sequence_parallel.py). A module the model lacks, a style that does not fit it, or a split pyplan
    cannot follow: PlanError naming the module and the reason."""
    _check_styles(styles, graph)
    expected: dict[str, str] = {}
    for r in plan.regions:
        expected.update(dict.fromkeys(r.columns, "ColwiseParallel"))
        expected.update(dict.fromkeys(r.rows, "RowwiseParallel"))
    expected.update({e.module: "RowwiseParallel" for e in plan.embeddings})
    expected.update({o.module: "ColwiseParallel" for o in plan.output_layers})
    for module, style in styles.items():
        if style == "SequenceParallel":
            continue
        if module not in expected:
            why = plan.replicated.get(module, "it is not a Linear or Embedding on the model's main path")
            raise PlanError(f"TP plan: pyplan cannot split '{module}': {why}")
        if style != expected[module]:
            raise PlanError(f"TP plan: '{module}' splits as {expected[module]} in the model's graph, not {style}")
    for r in plan.regions:
        named = [m for m in r.columns + r.rows if m in styles]
        if named and len(named) < len(r.columns + r.rows):
            missing = next(m for m in r.columns + r.rows if m not in styles)
            raise PlanError(f"TP plan: '{named[0]}' splits only with '{missing}' ({expected[missing]}); name both")
    return TpPlan(
        tuple(r for r in plan.regions if r.columns[0] in styles),
        tuple(e for e in plan.embeddings if e.module in styles),
        tuple(o for o in plan.output_layers if o.module in styles),
        {m: why for m, why in plan.replicated.items()},
    )
