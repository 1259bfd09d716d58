"""Cut a traced module at chosen cuts into pieces that run in sequence, each passing on its live set."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import lazy_graph_module
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.masks import is_batch_size

__all__ = ["batch_carrier", "piece", "pieces", "run_pieces"]


def piece(
    chain: Chain, start: int, stop: int, *, lazy: bool = False, by_name: dict[str, fx.Node] | None = None
) -> fx.GraphModule:
    """The GraphModule of blocks [start, stop) of `chain` (with `lazy`, its code generated when first called;
    `by_name`: the traced graph's nodes by name, when the caller has them).

    It takes the values live at cut `start` as positional arguments (the model's own inputs for start = 0) and
    returns the tuple of values live at cut `stop` (the model's own output for the last block). Static values it
    needs (parameters, buffers, what is computed from them alone) are recomputed inside. Parameters are shared
    with the traced module, not copied.
    """
    if not 0 <= start < stop <= len(chain):
        raise ValueError(f"piece [{start}, {stop}) is not a non-empty range of a chain of {len(chain)} blocks")
    gm = chain.graph.module
    if by_name is None:
        by_name = {n.name: n for n in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    if start == 0:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = graph.node_copy(n)
    else:
        lo, hi = chain.cuts[start].position, chain.cuts[stop].position
        mutated = {a for name in chain.order[lo:hi] for a in _mutated(by_name[name], gm)}
        for name in chain.cuts[start].live:
            env[by_name[name]] = graph.placeholder(name)
            if by_name[name] in mutated:
                # A stage's input is a leaf that needs grad: an in-place op on it (nn.ReLU(inplace=True) right
                # after the cut) must work on a copy, as it does on the previous stage's value in the whole model.
                env[by_name[name]] = graph.call_method("clone", (env[by_name[name]],))

    def copy(n: fx.Node) -> fx.Node:
        if n not in env:
            if not chain.graph.node(n.name).static:
                raise RuntimeError(f"node '{n.name}' is neither live at cut {start} nor inside the piece")
            if is_batch_size(n) and n.args[0] not in env:
                env[n] = batch_size()
                return env[n]
            for a in n.all_input_nodes:
                copy(a)
            env[n] = graph.node_copy(n, lambda a: env[a])
        return env[n]

    def batch_size() -> fx.Node:
        """The batch size read off a value live at cut `start`: its dim 0 where that is the batch, else its size
        along the dimension that grows with the batch over the multiple of the batch it is (flattened tokens)."""
        value = batch_carrier(chain.graph, chain.cuts[start].live)
        if value is None:
            raise RuntimeError(f"no value live at cut {start} carries the batch, which the piece needs")
        name, dim, factor = value
        size = graph.call_function(torch.ops.aten.sym_size.int, (env[by_name[name]], dim))
        return size if factor == 1 else graph.call_function(operator.floordiv, (size, factor))

    lo, hi = chain.cuts[start].position, chain.cuts[stop].position
    for name in chain.order[lo:hi]:
        n = by_name[name]
        for a in n.all_input_nodes:
            copy(a)
        env[n] = graph.node_copy(n, lambda a: env[a])

    if stop == len(chain):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        for a in out.all_input_nodes:
            copy(a)
        graph.output(fx.map_arg(out.args[0], lambda a: env[a]))
    else:
        graph.output(tuple(copy(by_name[name]) for name in chain.cuts[stop].live))
    graph.lint()
    name = f"{type(gm).__name__}_{start}_{stop}"
    return lazy_graph_module(gm, graph, name) if lazy else fx.GraphModule(gm, graph, name)


def batch_carrier(graph: LayerGraph, live: Sequence[str]) -> tuple[str, int, int] | None:
    """A value among `live` to read the batch size off: (its name, the dimension that grows with the batch, that
    dimension's size over the batch size); one with the batch as dim 0 first. None where no live value has one."""
    b = graph.batch_size
    found = []
    for name in live:
        out = graph.node(name).outputs
        if len(out) != 1 or out[0].bytes.per_sample <= 0:
            continue
        info = out[0]
        if info.shape[:1] == (b,):
            return name, 0, 1
        if info.batch_dim is not None and info.shape[info.batch_dim] % b == 0:
            found.append((name, info.batch_dim, info.shape[info.batch_dim] // b))
    return found[0] if found else None


def _mutated(n: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """The inputs node `n` modifies in place: the first argument of an in-place op (a name ending in `_`, an
    `inplace=True` argument or module attribute)."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return []
    if n.op == "call_module":
        inplace = bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    elif n.op == "call_method":
        inplace = str(n.target).endswith("_") and not str(n.target).endswith("__")
    elif n.op == "call_function":
        name = getattr(n.target, "__name__", str(n.target))
        overload = getattr(n.target, "_schema", None)
        base = overload.name.split("::")[-1] if overload is not None else name
        inplace = (base.endswith("_") and not base.endswith("__")) or n.kwargs.get("inplace") is True
    else:
        return []
    return _aliased(n.args[0], gm) if inplace else []


# Methods of a traced tensor that may return a view of it (or the tensor itself).
_VIEW_METHODS = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "contiguous"}
    | {"unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "__getitem__", "t", "detach", "to"}
)


def _aliased(n: fx.Node, gm: fx.GraphModule) -> list[fx.Node]:
    """`n` and the values it may share storage with, back through views and ops that may return their input
    unchanged (dropout with p = 0 returns its input itself): an in-place op on `n` modifies each of them."""
    found = [n]
    while True:
        source = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if source is None or not _may_alias(n, source, gm):
            return found
        found.append(source)
        n = source


def _may_alias(n: fx.Node, source: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether node `n`'s value may share storage with its first argument `source`'s."""
    val, src = n.meta.get("val"), source.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(src, torch.Tensor):
        try:
            if val.untyped_storage()._cdata == src.untyped_storage()._cdata:
                return True
        except (RuntimeError, NotImplementedError):
            pass
    if n.op == "call_method":
        return str(n.target) in _VIEW_METHODS
    if n.op == "call_function":
        schema = getattr(n.target, "_schema", None)
        if schema is not None:
            returns = schema.returns
            if returns and returns[0].alias_info is not None:
                return True
            return schema.name.split("::")[-1] in ("dropout", "alias", "contiguous", "to", "type_as", "_to_copy")
        name = getattr(n.target, "__name__", "")
        return name in _VIEW_METHODS or name in ("dropout", "getitem")
    if n.op == "call_module":
        # Dropout with p = 0 or in eval mode returns its input itself.
        return isinstance(gm.get_submodule(str(n.target)), (nn.modules.dropout._DropoutNd, nn.Identity))
    return False


def pieces(chain: Chain, bounds: Sequence[int] | None = None, *, lazy: bool = False) -> list[fx.GraphModule]:
    """The pieces between consecutive `bounds` (block indices; default: one piece per block), `lazy` as `piece`."""
    bounds = list(range(len(chain) + 1)) if bounds is None else list(bounds)
    by_name = {n.name: n for n in chain.graph.module.graph.nodes}
    return [piece(chain, a, b, lazy=lazy, by_name=by_name) for a, b in itertools.pairwise(bounds)]


def run_pieces(mods: Sequence[torch.nn.Module], *inputs: Any) -> Any:
    """Run pieces in sequence: each receives the previous one's tuple of live values."""
    args: tuple[Any, ...] = inputs
    out: Any = None
    for i, m in enumerate(mods):
        out = m(*args)
        if i < len(mods) - 1:
            args = out if isinstance(out, tuple) else (out,)
    return out
