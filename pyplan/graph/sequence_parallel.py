"""Sequence parallelism derived from a tensor-parallel plan: the values between regions as each rank's tokens.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.2.2): between
Megatron's regions (norms, dropout, residual adds) every operation treats each token alone, so at degree t each
rank can hold 1/t of the tokens instead of all of them. A row-parallel output's all-reduce becomes a
reduce-scatter (each rank keeps its slice of the tokens), and a region's input is all-gathered before its
column-parallel Linears (its gradient reduce-scattered in backward): the same bytes on the link as the all-reduces
they replace. The *zone* is found from the plan, not written: from each row-parallel output, along the token
dimension next to the features, through every operation that keeps tokens apart (`_token_wise`), in graph order.
What the zone meets:

- a region's column Linear (or an output layer) reads a zone value gathered: one all-gather per value, shared by
  the Linears that read it (Q, K and V), whose gradients meet in one reduce-scatter;
- a Linear that works on the tokens flattened, (b·s, h) (Hugging Face's `Conv1D`, GPT-2's: `addmm` on
  `x.view(-1, h)`, its output viewed back to (b, s, h)), meets the zone at those reshapes: a column Linear's
  flattening reshape reads the zone value gathered (`flattened`), and a row Linear's output is reduce-scattered
  once it is viewed back (`unflattened`), since a rank's tokens are not contiguous rows of the flattened value;
- a shape read of a zone value reads the whole shape (the graph's own sizes stay the model's);
- any other operation reads a zone value gathered whole (all-gather; its gradient, the same on every rank, is
  sliced in backward);
- a whole value that a zone operation combines with a zone value along the tokens (the residual stream before the
  first region) is sliced (its gradient all-gathered in backward);
- a zone value the model returns is gathered whole by the operation that makes it (`exits`);
- a parameter read in the zone (a norm's weight) gets each rank's partial gradient, summed over the axis.

As Megatron-LM's sequence-parallel Linear does, a gathered input is saved for the Linears' backward as each rank's
slice and all-gathered again in backward (`Gathered.saving`), not kept whole as torch's DTensor styles would keep
what they compute on: per layer Korthikanti's 34sbh/t, not 4sbh of it whole (the two Linears' inputs), for one more
all-gather per gathered value in backward.

`rewrite(gm, zone, ops, layers=...)` rewrites a GraphModule for one rank without adding nodes (cut positions and
profiles keep their node names): the nodes that meet the zone call the collectives of `ops`, the runtime's
(pyplan/runtime/tensor_parallel.py, with the Linears' own styles) or `ShapeOps`, stand-ins that make only the shapes,
for the profile; the Linears that read a gathered value run inside `ops.saving()`. Runtime and profile share
`Gathered`, so the profile's recorders (saved-tensor hooks, live memory) see what the runtime keeps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import fx, nn

from pyplan._torch import own_base, saved_tensors_hooks_now, tensor_version
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.tensor_parallel import (
    ELEMENTWISE,
    RESHAPES,
    NotSplit,
    Reader,
    TpPlan,
    aligned_inputs,
    node_arg,
    op_name,
    source_through_casts,
)

__all__ = ["Gathered", "SeqOps", "SequenceZone", "ShapeOps", "rewrite", "sequence_zone"]

_NORMS = frozenset({"layer_norm", "rms_norm", "LayerNorm", "RMSNorm"})
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "std"})


@dataclass(frozen=True)
class SequenceZone:
    """Where sequence parallelism puts each rank's slice of the tokens at one degree (see the module docstring).
    Dimensions are the token dimension of each value; `reason`, when not empty, says why there is no zone."""

    degree: int
    dims: Mapping[str, int]  # zone node (the row Linears' included) -> its token dimension
    rows: tuple[str, ...]  # row Linears whose outputs are reduce-scattered
    gathered: Mapping[str, int]  # column Linear / output layer node -> dimension its input is gathered along
    shapes: Mapping[str, int]  # shape-reading node -> the dimension it reads whole
    whole: Mapping[str, Mapping[str, int]]  # node -> {zone input: dimension} it reads gathered whole
    split: Mapping[str, Mapping[str, int]]  # zone node -> {whole input: its dimension} it reads sliced
    exits: Mapping[str, int]  # zone node whose value leaves the model -> dimension it gathers it along
    params: tuple[str, ...]  # parameters read in the zone: partial gradients, summed over the axis
    reason: str = ""
    # A column Linear's reshape of a zone value to its tokens flattened -> the dimension its input is gathered
    # along (there, in the graph; the Linears that read it are in `gathered` with the same dimension).
    flattened: Mapping[str, int] = field(default_factory=dict)
    # A row Linear whose output is its tokens flattened -> the reshape that views it back, a zone value, where
    # its output is reduce-scattered (in the graph).
    unflattened: Mapping[str, str] = field(default_factory=dict)
    # A node of `gathered` -> the node whose value it reads: the zone value, or the flattening reshape (`flattened`).
    reads: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return not self.reason

    def readers(self, node: str) -> int:
        """How many nodes of `gathered` read the value that `node` (one of them) gathers: the Linears that share its
        gathered value (Q, K and V), or 1 where a flattening reshape gathers it once for them."""
        value = self.reads.get(node)
        if value is None or value in self.flattened:
            return 1
        return sum(1 for v in self.reads.values() if v == value)


def _none(degree: int, reason: str) -> SequenceZone:
    return SequenceZone(degree, {}, (), {}, {}, {}, {}, {}, (), reason)


def _reads_shape(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] == "shape"
    return n.op in ("call_method", "call_function") and op_name(n, gm) in ("size", "sym_size")


def _normalized(dims: Any, ndim: int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [d + ndim if d < 0 else d for d in dims]


def _token_wise(r: Reader, n: fx.Node, zone: Mapping[str, int]) -> tuple[int, dict[str, int]]:
    """How n carries the tokens of its zone inputs: (its output's token dimension, {whole input: the dimension it
    is sliced along}). Raises NotSplit where n mixes tokens, or leaves them."""
    name, out = op_name(n, r.gm), r.shape(n)
    ins = r.tensor_inputs(n)
    if out is None:
        raise NotSplit(f"'{n.name}' returns no tensor")
    if name == "type_as":
        ins = ins[:1]
    first = next(a for a in ins if a.name in zone)
    src = r.shape(first) or ()
    d = zone[first.name]
    if name in ELEMENTWISE:
        at = d + len(out) - len(src)
        return at, aligned_inputs(r, n, ins, at, zone)
    if first is not n.args[0]:
        raise NotSplit(f"'{n.name}' reads the tokens other than as its first operand")
    if name in ("slice", "narrow", "alias") and out == src:
        return d, {}  # all of it
    if name in _NORMS:
        if n.op == "call_module":
            normalized = getattr(r.gm.get_submodule(str(n.target)), "normalized_shape", None)
        else:
            normalized = node_arg(n, 1, "normalized_shape")
        k = len(normalized) if isinstance(normalized, (list, tuple, torch.Size)) else 1
        if normalized is None or d >= len(src) - k:
            raise NotSplit(f"'{n.name}' normalizes along the tokens")
        return d, {}
    if name in _REDUCTIONS:
        dims = node_arg(n, 1, "dim")
        if dims is None or d in _normalized(dims, len(src)):
            raise NotSplit(f"'{n.name}' reduces along the tokens")
        if len(out) != len(src) and any(k < d for k in _normalized(dims, len(src))):
            raise NotSplit(f"'{n.name}' drops a dimension before the tokens")
        return d, {}
    raise NotSplit(f"'{n.name}' ({name}) mixes tokens")


def _token_dim(r: Reader, node: fx.Node, degree: int) -> int:
    shape = r.shape(node)
    if shape is None or len(shape) < 2:
        raise NotSplit(f"'{node.name}' has no token dimension")
    d = len(shape) - 2
    if shape[d] % degree:
        raise NotSplit(f"{shape[d]} tokens of '{node.name}' do not divide among {degree} ranks")
    return d


def _unflattening(r: Reader, row: str) -> str | None:
    """The reshape that views a row Linear's output (tokens flattened, (b·s, h)) back to (…, s, h), where that is
    all that reads it; None where the output keeps its tokens apart itself."""
    out, users = r.shape(r.nodes[row]), list(r.nodes[row].users)
    if out is None or len(out) != 2 or len(users) != 1 or op_name(users[0], r.gm) not in RESHAPES:
        return None
    back = r.shape(users[0])
    if back is None or len(back) < 3 or back[-1] != out[-1] or math.prod(back[:-1]) != out[0]:
        return None
    return users[0].name


def _flattens(r: Reader, n: fx.Node, d: int) -> bool:
    """Whether n reshapes its zone input (token dimension d) to its tokens flattened, (b·s, h), for column
    Linears only (checked by the caller)."""
    src, out = r.shape(n.args[0]) if isinstance(n.args[0], fx.Node) else None, r.shape(n)
    if op_name(n, r.gm) not in RESHAPES or src is None or out is None or d != len(src) - 2:
        return False
    return tuple(out) == (math.prod(src[: d + 1]), *src[d + 1 :])


def sequence_zone(graph: LayerGraph, plan: TpPlan, degree: int) -> SequenceZone:
    """The zone of `plan` at `degree` in the captured graph, or an empty one with its reason."""
    if degree < 2:
        return _none(degree, "sequence parallelism needs a degree of 2 or more")
    r = Reader(graph)
    rows = [o for region in plan.regions if region.splits_at(degree) for o in region.outputs]
    if not rows:
        return _none(degree, f"no region splits at degree {degree}")
    columns = {
        name: lin.input.name
        for region in plan.regions
        if region.splits_at(degree)
        for name, lin in r.linears.items()
        if lin.module in region.columns
    }
    columns.update({o.node: o.input for o in plan.output_layers if o.splits_at(degree)})
    # A row Linear's zone value: its output, or the reshape that views its flattened tokens back.
    seeds = {o: _unflattening(r, o) or o for o in rows}
    row_of = {v: o for o, v in seeds.items()}
    kept: set[str] = set()  # rows whose outputs are all-reduced after all (returned, or read only whole)
    exits: dict[str, int] = {}
    try:
        while True:
            zone = _grow(r, degree, {o: seeds[o] for o in rows if o not in kept}, columns, exits)
            # A row output that no token-wise operation reads would only be gathered again: all-reduce it.
            gathered_again = set(zone.whole) | set(zone.shapes)
            idle = [x for x in zone.rows if all(u.name in gathered_again for u in r.nodes[seeds[x]].users)]
            leaving = [a for a in zone.dims if a not in exits and any(u.op == "output" for u in r.nodes[a].users)]
            if idle:
                kept.update(idle)
                continue
            if not leaving:
                break
            for a in leaving:
                if a in row_of:
                    kept.add(row_of[a])
                else:
                    exits[a] = zone.dims[a]
        if not zone.rows:
            return _none(
                degree,
                "no row-parallel output stays split by tokens (each leaves the model, or is reshaped before an "
                "operation reads it token by token)",
            )
        return _with_params(r, zone)
    except NotSplit as why:
        return _none(degree, str(why))


def _grow(
    r: Reader, degree: int, seeds: Mapping[str, str], columns: Mapping[str, str], exits: Mapping[str, int]
) -> SequenceZone:
    """The zone grown from the row Linears' zone values (`seeds`: row -> its output or the reshape that views it
    back), in graph order."""
    dims = {v: _token_dim(r, r.nodes[v], degree) for v in seeds.values()}
    gathered: dict[str, int] = {}
    shapes: dict[str, int] = {}
    whole: dict[str, dict[str, int]] = {}
    split: dict[str, dict[str, int]] = {}
    flattened: dict[str, int] = {}
    reads: dict[str, str] = {}
    for n in r.gm.graph.nodes:
        if n.name in dims:
            continue
        local = {a.name: dims[a.name] for a in n.all_input_nodes if a.name in dims and a.name not in exits}
        if not local:
            continue
        if n.op == "output":
            continue  # the zone values it reads become exits (sequence_zone)
        if op_name(n, r.gm) == "_assert_tensor_metadata" and n.kwargs.get("size") is None:
            continue  # torch.export's check of a dtype or device, which a slice passes as the whole does
        readers = list(n.users)
        if (
            len(local) == 1
            and readers
            and all(columns.get(u.name) == n.name for u in readers)
            and _flattens(r, n, next(iter(local.values())))
        ):
            flattened[n.name] = next(iter(local.values()))
            gathered.update(dict.fromkeys((u.name for u in readers), flattened[n.name]))
            reads.update(dict.fromkeys((u.name for u in readers), n.name))
        elif columns.get(n.name) in local:
            gathered[n.name] = local[columns[n.name]]
            reads[n.name] = columns[n.name]
        elif _reads_shape(n, r.gm):
            shapes[n.name] = next(iter(local.values()))
        else:
            try:
                dims[n.name], sliced = _token_wise(r, n, local)
            except NotSplit:
                whole[n.name] = local
                continue
            for a, k in sliced.items():
                if (r.shape(r.nodes[a]) or ())[k] % degree:
                    raise NotSplit(f"'{n.name}' reads '{a}', whose {k}th dimension does not divide")
            if sliced:
                split[n.name] = sliced
    unflattened = {o: v for o, v in seeds.items() if v != o}
    return SequenceZone(degree, dims, tuple(seeds), gathered, shapes, whole, split, dict(exits), (), "", flattened,
                        unflattened, reads)  # fmt: skip


def _with_params(r: Reader, zone: SequenceZone) -> SequenceZone:
    """The zone with the parameters its operations read (each rank's gradient a partial sum); NotSplit where a
    zone operation reads a value with a gradient that is not one of them, or one of them is read outside."""

    def held(n: fx.Node) -> list[str]:
        """The parameters n reads itself, by qualified name."""
        if n.op == "get_attr":
            return [str(n.target)] if isinstance(r.attr(n), nn.Parameter) else []
        if n.op == "call_module":
            return [f"{n.target}.{k}" for k, _ in r.gm.get_submodule(str(n.target)).named_parameters()]
        return []

    needs_grad: set[str] = set()
    for n in r.gm.graph.nodes:
        if held(n) or any(a.name in needs_grad for a in n.all_input_nodes):
            needs_grad.add(n.name)
    params: dict[str, None] = {}
    reads: set[str] = set()  # nodes through which the zone reads them
    seeds = set(zone.rows) | set(zone.unflattened.values())
    for name in zone.dims:
        n = r.nodes[name]
        if name in seeds:
            continue
        params.update(dict.fromkeys(held(n)))
        for a in r.tensor_inputs(n):
            if a.name in zone.dims or a.name in zone.split.get(name, {}) or a.name not in needs_grad:
                continue
            source, path = source_through_casts(r, a)
            if source.op != "get_attr":
                raise NotSplit(f"'{name}' combines its tokens with '{a.name}', which has a gradient of its own")
            reads.update(path)
            params[str(source.target)] = None
    zone_nodes = set(zone.dims) | reads
    for n in r.gm.graph.nodes:
        if n.name in zone_nodes:
            continue
        outside = [p for p in held(n) if p in params]
        if outside and (n.op == "call_module" or any(u.name not in zone_nodes for u in n.users)):
            raise NotSplit(f"'{n.name}' reads the parameter '{outside[0]}' outside the zone as well")
    return replace(zone, params=tuple(params))


# ----------------------------------------------------------------------------------------------------------------
# Rewriting a rank's graph


class SeqOps(Protocol):
    """The collectives a rewritten graph calls (x: a tensor, dim: its token dimension)."""

    degree: int

    def whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather x along dim; backward: this rank's slice of the (equal) gradient."""
        ...

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of x along dim; backward: all-gather the gradient."""
        ...

    def gather(self, x: torch.Tensor, dim: int, readers: int = 1) -> torch.Tensor:
        """A region's input gathered for its column Linears (one per value: the `readers` calls for one x share it),
        as those Linears read it (at run time what their styles take); backward: reduce-scatter."""
        ...

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A row output (each rank's partial sum, as the Linear or its style leaves it) reduce-scattered along dim;
        backward: all-gather."""
        ...

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        """The context a Linear that reads a gathered value runs in: autograd saves the value as this rank's slice
        (`Gathered.saving`)."""
        ...


def _same(t: Any) -> Any:
    return t


def _unchanged(t: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return _same


# The autograd nodes of views, through which autocast's copy of a Linear's input is followed back to a gathered value
# (the flattening reshape of GPT-2's Conv1D).
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})


@dataclass
class _Regathered:
    """A gathered value as backward gathers it again, shared by every tensor saved of it (Q's, K's and V's input)."""

    dim: int
    stride: tuple[int, ...]  # the strides of the value's own tensor (gathering it again lays it out alike)
    offset: int  # and its storage offset
    count: int = 0  # the tensors saved of it that backward has not unpacked yet
    # Its own tensor gathered again, by dtype, until the last of them is unpacked (16-bit: from the slice cast).
    values: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    casts: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # the slice cast, saved for autocast's copies


@dataclass(frozen=True)
class _Source:
    """The slice a gathered value was gathered from, while the value's storage lives; `node`, the value's autograd
    node (autocast's copies of the value are found through it)."""

    storage: weakref.ref[Any]
    slice: torch.Tensor
    regathered: _Regathered
    node: Any


@dataclass(frozen=True)
class _Saved:
    """A tensor autograd saved of a gathered value, packed: the slice as the hooks outside packed it, and where the
    tensor lies in the value's own tensor, or, for autocast's copy of the value (`copy`: the copy's shape, a
    reshape of the value), in that copy; `like` makes the saved tensor of such a view (a DTensor at run time)."""

    regathered: _Regathered
    packed: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    like: Callable[[torch.Tensor], torch.Tensor]
    version: int
    copy: tuple[int, ...] | None = None


class Gathered:
    """The zone values gathered for column Linears, each once for all the Linears that read it (Q, K and V), and
    the saved-tensor hooks that keep each rank's slice of them for backward instead (Megatron-LM's
    sequence-parallel Linear, Korthikanti et al. 2022 §4.2.2).

    `make(x, dim)` gathers the slice x along dim (differentiably); `own(t)` is the tensor that holds a value's
    elements on this rank (a DTensor's local tensor) and `like(t)` what makes a tensor like t from such a tensor.
    Calling it gathers x, or hands the value gathered for the same x to its next `readers - 1` calls (then lets
    it go, or once another value is gathered). Inside `saving()`, a tensor autograd saves whose storage is a
    gathered value's (the value, or a view such as a Linear's flattening of it) is packed as the slice it was
    gathered from, and unpacking gathers it again: once per value for every tensor saved of it (cached on what
    they share, released when the last is unpacked). Under autocast a Linear saves its 16-bit copy of the value
    instead: that is packed as the slice cast alike (once for Q, K and V), gathered again in 16 bits. Every other
    tensor, and the slice, go to the hooks outside as they are (a recorder's count, a checkpoint's), which so see
    what is kept."""

    def __init__(
        self,
        make: Callable[[torch.Tensor, int], torch.Tensor],
        own: Callable[[torch.Tensor], torch.Tensor] = _same,
        like: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] = _unchanged,
    ) -> None:
        self.make, self.own, self.like = make, own, like
        # The value held for the readers of one slice: (the slice, weakly; the value; readers yet to read it).
        self._held: tuple[weakref.ref[torch.Tensor], torch.Tensor, int] | None = None
        # id of a gathered value's storage -> its slice, until that storage is freed.
        self._sources: dict[int, _Source] = {}
        # id of a gathered value's autograd node -> the id of its storage, as long.
        self._nodes: dict[int, int] = {}

    def __call__(self, x: torch.Tensor, dim: int, readers: int = 1) -> torch.Tensor:
        held = self._held
        if held is not None and held[0]() is x:
            self._held = (held[0], held[1], held[2] - 1) if held[2] > 1 else None
            return held[1]
        value = self.make(x, dim)
        own = self.own(value)
        storage = own.untyped_storage()  # torch keeps one Python object per live storage
        key = id(storage)
        ref = weakref.ref(storage, functools.partial(self._forget, key))
        node = value.grad_fn
        self._sources[key] = _Source(ref, x, _Regathered(dim, own.stride(), own.storage_offset()), node)
        if node is not None:
            self._nodes[id(node)] = key
        self._held = (weakref.ref(x), value, readers - 1) if readers > 1 else None
        return value

    def _forget(self, key: int, _ref: Any) -> None:
        source = self._sources.pop(key, None)
        if source is not None and source.node is not None:
            self._nodes.pop(id(source.node), None)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd saves the gathered values as their slices here (the hooks outside still see every tensor)."""
        outer = saved_tensors_hooks_now()
        pack, unpack = outer if outer is not None else (_same, _same)
        with torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, pack), functools.partial(self._unpack, unpack)
        ):
            yield

    def _copied(self, t: torch.Tensor) -> tuple[_Source, torch.Tensor] | None:
        """The gathered value that t lies in a copy of (autocast's cast of a Linear's input: the value or a view of
        it, cast), with that copy; None for any other tensor."""
        copy = own_base(t)
        node = copy.grad_fn
        if node is None or node.name() != "ToCopyBackward0":
            return None
        node = node.next_functions[0][0]
        while node is not None and id(node) not in self._nodes and node.name() in _VIEW_NODES:
            node = node.next_functions[0][0]
        source = self._sources.get(self._nodes.get(id(node), -1)) if node is not None else None
        return (source, copy) if source is not None and source.node is node else None

    def _pack(self, outer: Callable[[torch.Tensor], Any], t: torch.Tensor) -> Any:
        own = self.own(t)
        source = self._sources.get(id(own.untyped_storage()))
        if source is not None and source.storage() is not None:
            regathered = source.regathered
            regathered.count += 1
            offset = own.storage_offset() - regathered.offset
            return _Saved(regathered, outer(source.slice), tuple(own.shape), own.stride(), offset, self.like(t),
                          tensor_version(source.slice))  # fmt: skip
        copied = self._copied(t)
        if copied is None:
            return outer(t)
        source, copy = copied
        regathered, base = source.regathered, self.own(copy)
        if not base.is_contiguous():  # not what unpacking makes again: kept as it is
            return outer(t)
        if copy.dtype not in regathered.casts:
            with torch.no_grad():
                regathered.casts[copy.dtype] = source.slice.to(copy.dtype)
        regathered.count += 1
        piece = regathered.casts[copy.dtype]
        offset = own.storage_offset() - base.storage_offset()
        return _Saved(regathered, outer(piece), tuple(own.shape), own.stride(), offset, self.like(t),
                      tensor_version(piece), tuple(base.shape))  # fmt: skip

    def _unpack(self, outer: Callable[[Any], torch.Tensor], packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return outer(packed)
        piece = outer(packed.packed)
        if piece is packed.packed and tensor_version(piece) != packed.version:
            raise RuntimeError(
                "a slice gathered for a column Linear was modified in place before backward gathered it again"
            )
        regathered = packed.regathered
        if piece.dtype not in regathered.values:
            with torch.no_grad():
                value = self.own(self.make(piece, regathered.dim))
            if value.stride() != regathered.stride:
                raise RuntimeError(
                    f"the input gathered again in backward is laid out {value.stride()}, in forward {regathered.stride}"
                )
            regathered.values[piece.dtype] = value
        value = regathered.values[piece.dtype]
        if packed.copy is None:
            base, offset = value, value.storage_offset() + packed.offset
        else:  # autocast's copy: the value (or its reshape), contiguous, as `_to_copy` leaves a dense tensor
            base = value.reshape(packed.copy)
            offset = base.storage_offset() + packed.offset
        out = packed.like(base.as_strided(packed.size, packed.stride, offset))
        regathered.count -= 1
        if regathered.count <= 0:
            regathered.values.clear()
            regathered.casts.clear()
        return out


class ShapeOps:
    """Stand-ins with the shapes of the collectives, for the profile of one rank (meta or fake tensors): a gathered
    value is a new tensor of the whole size (one per value, as the runtime shares it, saved as its slice), a slice
    a new one."""

    def __init__(self, degree: int) -> None:
        self.degree = degree
        self._gathered = Gathered(self.whole)

    def whole(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.repeat(*(self.degree if i == dim else 1 for i in range(x.dim())))

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.narrow(dim, 0, x.shape[dim] // self.degree).clone()

    scatter = split

    def gather(self, x: torch.Tensor, dim: int, readers: int = 1) -> torch.Tensor:
        return self._gathered(x, dim, readers)

    def saving(self) -> contextlib.AbstractContextManager[Any]:
        return self._gathered.saving()


class _At:
    """A node's place in an argument structure."""

    def __init__(self, name: str) -> None:
        self.name = name


def _map_at(spec: Any, value: Any, fn: Callable[[str, Any], Any]) -> Any:
    if isinstance(spec, _At):
        return fn(spec.name, value)
    if isinstance(spec, (list, tuple)) and isinstance(value, (list, tuple)) and len(spec) == len(value):
        return type(value)(_map_at(s, v, fn) for s, v in zip(spec, value))
    if isinstance(spec, dict) and isinstance(value, dict):
        return {k: _map_at(spec[k], v, fn) if k in spec else v for k, v in value.items()}
    return value


def _wrap(
    gm: fx.GraphModule,
    n: fx.Node,
    inputs: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    output: Callable[[Any], Any] | None,
    tag: str,
    around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> None:
    """Make n apply `inputs[name]` to the value of each input node named there and `output` to its result, and run
    its operation inside `around()`, without adding nodes: a function or method call becomes a call of a function
    that does so; a module call keeps its node and calls a copy of the module that holds the same parameters, with
    hooks (and a forward inside `around()`)."""
    spec = fx.node.map_arg((n.args, n.kwargs), lambda a: _At(a.name))

    def before(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not inputs:
            return args, kwargs
        return _map_at(spec, (args, kwargs), lambda name, v: inputs[name](v) if name in inputs else v)

    if n.op == "call_module":
        old = gm.get_submodule(str(n.target))
        mod = copy.copy(old)
        for key in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks"):
            setattr(mod, key, type(getattr(old, key))(getattr(old, key)))
        if inputs:
            mod.register_forward_pre_hook(lambda _m, args, kwargs: before(args, kwargs), with_kwargs=True)
        if output is not None:
            mod.register_forward_hook(lambda _m, _args, out: output(out))
        if around is not None:
            cls = type(mod)

            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                with around():
                    return cls.forward(self, *args, **kwargs)

            mod.__class__ = type(cls.__name__, (cls,), {"forward": forward})
        parent, _, leaf = str(n.target).rpartition(".")
        setattr(gm.get_submodule(parent), leaf, mod)
        return
    target, method = n.target, n.op == "call_method"

    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = before(args, kwargs)
        with around() if around is not None else contextlib.nullcontext():
            out = getattr(args[0], target)(*args[1:], **kwargs) if method else target(*args, **kwargs)
        return output(out) if output is not None else out

    call.__name__ = f"{tag}_{op_name(n, gm)}"
    n.op, n.target = "call_function", call


def _whole_shape(n: fx.Node, dim: int, degree: int, tag: str) -> None:
    """A shape read of a zone value (`x.shape`, `x.size()`, `x.size(i)`, `sym_size(x, i)`) reads the whole size."""
    target, method = n.target, n.op == "call_method"

    def read(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        got = getattr(x, target)(*args, **kwargs) if method else target(x, *args, **kwargs)
        if isinstance(got, torch.Size):
            return torch.Size(s * degree if i == dim else s for i, s in enumerate(got))
        at = args[0] if args else kwargs.get("dim")
        return got * degree if at is not None and at % x.dim() == dim else got

    read.__name__ = f"{tag}_shape"
    n.op, n.target = "call_function", read


def rewrite(gm: fx.GraphModule, zone: SequenceZone, ops: SeqOps, *, layers: bool) -> None:
    """Rewrite `gm` (the captured GraphModule, or a rank's copy with the same node names) in place so that the
    zone's values are each rank's tokens. `layers`: the row and column Linears call `ops.scatter` and `ops.gather`
    themselves (the profile); otherwise their styles must do it (the runtime). The reshapes of Linears that work
    on the tokens flattened call them in either case (`ops.gather` then hands the Linear's style what it reads).
    Every Linear that reads a gathered value runs inside `ops.saving()`."""
    if not zone:
        raise ValueError(f"no sequence parallelism here: {zone.reason}")
    tag = "seq"
    views = {v: o for o, v in zone.unflattened.items()}
    read_flattened = {u.name for n in gm.graph.nodes if n.name in zone.flattened for u in n.users}
    for n in list(gm.graph.nodes):
        inputs: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        output: Callable[[Any], Any] | None = None
        if n.name in zone.shapes:
            _whole_shape(n, zone.shapes[n.name], zone.degree, tag)
            continue
        for a, d in zone.whole.get(n.name, {}).items():
            inputs[a] = lambda x, d=d: ops.whole(x, d)
        for a, d in zone.split.get(n.name, {}).items():
            inputs[a] = lambda x, d=d: ops.split(x, d)
        if n.name in zone.exits:
            output = lambda x, d=zone.exits[n.name]: ops.whole(x, d)  # noqa: E731
        if n.name in zone.flattened:
            inputs[n.args[0].name] = lambda x, d=zone.flattened[n.name]: ops.gather(x, d)
        if layers and n.name in zone.gathered and n.name not in read_flattened:
            source = n.all_input_nodes[0].name
            readers = zone.readers(n.name)
            inputs[source] = lambda x, d=zone.gathered[n.name], k=readers: ops.gather(x, d, k)
        if n.name in views or (layers and n.name in zone.rows and n.name not in zone.unflattened):
            output = lambda x, d=zone.dims[n.name]: ops.scatter(x, d)  # noqa: E731
        around = ops.saving if n.name in zone.gathered else None
        if inputs or output is not None or around is not None:
            _wrap(gm, n, inputs, output, tag, around)
    gm.recompile()
