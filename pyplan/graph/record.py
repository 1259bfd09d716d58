"""Record a graph's outputs on fake or meta tensors: the shape, dtype and bytes of every tensor each node returns.

An op's result on fake or meta tensors depends only on its arguments' layouts, so the recorder runs each distinct call
once (its memo), and, on the meta device, each distinct block of operations once: a block that repeats an earlier
one op for op, on values of the same layouts, takes the earlier block's records (one of a model's identical layers
runs). The records come out as running every op would give them.
"""

from __future__ import annotations

import collections
import itertools
import types
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from pyplan._torch import is_meta_module, layout_key, run_without_compute, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.describe import describe, module_hooks, own_tensors
from pyplan.graph.masks import is_batch_size

__all__ = ["GraphRecorder", "Recording", "static_nodes"]


@dataclass(frozen=True)
class Recording:
    """One run of a graph: each node's tensors as (shape, dtype name, bytes), and whether it returned one tensor."""

    seen: dict[str, list[tuple[tuple[int, ...], str, int]]]
    single: dict[str, bool]


def _leaves(value: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts, in order."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


_NOT_SEEN = object()
# Where torch's own modules live: their forward depends on nothing but their attributes and inputs.
_TORCH_NN = "torch.nn.modules"


# Where pyplan makes classes at run time over torch's (a rank's Linear that reads a gathered value runs its forward
# inside a context: pyplan/graph/sequence_parallel.py), whose functions are all their own behaviour.
_PYPLAN = "pyplan."


def _module_class(cls: type, names: dict[str, int]) -> Hashable:
    """A module's class as the recorder's memo keys it: a torch.nn class itself; a class pyplan made at run time
    over one by that class and what its own functions do (`describe`, the nodes they name as positions among the
    call's inputs). Raises TypeError for any other class: a user's leaf module may steer its forward by anything."""
    if cls.__module__.startswith(_TORCH_NN):
        return cls
    own = {k: v for k, v in vars(cls).items() if k not in ("__module__", "__doc__", "__qualname__")}
    bases = cls.__bases__
    if (
        not cls.__module__.startswith(_PYPLAN)
        or len(bases) != 1
        or not bases[0].__module__.startswith(_TORCH_NN)
        or not all(isinstance(v, types.FunctionType) for v in own.values())
    ):
        raise TypeError(f"{cls.__qualname__} is not a torch.nn module class")
    return ("over", bases[0], describe(own, names))


def _module_key(module: nn.Module) -> Hashable:
    """What a torch.nn module's result on fake or meta tensors depends on besides its inputs: its plain attributes
    (sizes, strides, flags, training) and its tensors' layouts, its submodules' alike. Raises TypeError where an
    attribute cannot be hashed."""
    plain = tuple(
        (name, layout_key(v))
        for name, v in sorted(vars(module).items())
        if not name.startswith("_") and (v is None or isinstance(v, bool | int | float | str | tuple | torch.dtype))
    )
    # (Its own tensors: its submodules' are in theirs.)
    own = [*own_tensors(module._parameters), *own_tensors(module._buffers)]
    tensors = tuple((name, layout_key(t)) for name, t in own)
    children = tuple((name, type(c), _module_key(c)) for name, c in module.named_children()) if module._modules else ()
    return plain, tensors, children


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers, its submodules' included (a leaf's read off its own tables: nn.Module's
    generators cost more than the recorder's lookups)."""
    if module._modules:
        return [*module.parameters(), *module.buffers()]
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _like(value: Any) -> Any:
    """`value` with each tensor replaced by a new one of the same layout (on the same fake or meta device)."""
    if isinstance(value, torch.Tensor):
        extent = value.storage_offset() + sum((n - 1) * s for n, s in zip(value.shape, value.stride())) + 1
        base = torch.empty(extent if value.numel() else 0, dtype=value.dtype, device=value.device)
        return base.as_strided(value.shape, value.stride(), value.storage_offset() if value.numel() else 0)
    if isinstance(value, (tuple, list)):
        return type(value)(_like(v) for v in value)
    return value


@dataclass(frozen=True)
class _Target:
    """What a node calls as the recorder's memo keys it (None: never reused), and the module it calls if any."""

    key: Hashable
    module: nn.Module | None


class _Targets:
    """What each node of a graph calls, as the recorder's memo keys it, found once for every recording of the graph
    (one per batch size) and the description of its blocks (`_Blocks`).

    A call of a closure (the scatters and gathers of a rank's rewritten graph, pyplan/graph/sequence_parallel.py) is
    the same op as another where both are described alike (pyplan/graph/describe.py), the nodes they name as
    positions among their inputs; a module's call, where their classes (`_module_class`), attributes, tensors'
    layouts and hooks are alike, the hooks described so."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._found: dict[str, _Target] = {}

    def of(self, n: fx.Node) -> _Target:
        found = self._found.get(n.name)
        if found is None:
            found = self._found[n.name] = self._find(n)
        return found

    def _find(self, n: fx.Node) -> _Target:
        if n.op == "call_module":
            module = self.gm.get_submodule(str(n.target))
            names = {a.name: i for i, a in enumerate(n.all_input_nodes)}
            try:
                key = (_module_class(type(module), names), _module_key(module), describe(module_hooks(module), names))
                hash(key)
            except (TypeError, ValueError):  # a user's leaf module, an attribute or a hook that cannot be hashed
                return _Target(None, module)
            return _Target(key, module)
        if n.op == "call_function" and isinstance(n.target, types.FunctionType) and n.target.__closure__:
            try:
                key = ("closure", describe(n.target, {a.name: i for i, a in enumerate(n.all_input_nodes)}))
                hash(key)
            except (TypeError, ValueError):  # what it closes over cannot be hashed, or a cell is empty
                return _Target(None, None)
            return _Target(key, None)
        return _Target(n.target if n.op in ("call_function", "call_method") else None, None)


class _NotRepeatable(Exception):
    """A block the recorder must run whatever it repeats (a call its memo never reuses, an unhashable argument)."""


# A block to the recorder: its operations in the graph's order, and the values live at its start.
_Span = tuple[tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class _Blocks:
    """Blocks of the graph being recorded, for the recorder to skip their repeats: a block that repeats an earlier
    one op for op (the same `group`: the same calls, as the memo keys them, on the same arguments) gets that block's
    records instead of running, where the values live at its start have the layouts they had at the earlier
    block's. The memo would have given each of its ops the earlier block's results, one by one. Its operations read
    outside it (`needed`) are given new values of the layouts of the earlier block's."""

    index: dict[str, int]  # an operation -> its block
    position: dict[str, int]  # an operation -> its place in its block
    nodes: list[tuple[str, ...]]  # each block's operations, in the graph's order
    live: list[tuple[fx.Node, ...]]  # the values live at each block's start
    group: list[int | None]  # each block's first block op for op (itself if none is before it; None: never skipped)
    kept: frozenset[int]  # the blocks of groups of two or more: their values are kept for their repeats
    needed: frozenset[str]  # the operations whose values are read outside their block

    @staticmethod
    def of(gm: fx.GraphModule, like: Chain | None, targets: _Targets) -> _Blocks | None:
        """The blocks of `like` over `gm`, a graph with the same operations under the same names (pyplan/graph/
        tensor_parallel.py's rank graph of the chain's), else `gm`'s operations grouped by the modules that made them
        (`_module_spans`); None where the recorder runs every block: a model not on the meta device (fake tensors hold
        what values the model read), or a chain whose order of operations is not the graph's."""
        if not is_meta_module(gm):
            return None
        static = static_nodes(gm)
        if like is None:
            spans = _module_spans(gm, static)
        else:
            ops = set(like.order)
            if [n.name for n in gm.graph.nodes if n.name in ops] != list(like.order):
                return None
            spans = [(block.nodes, cut.live) for block, cut in zip(like.blocks, like.cuts)]
        by_name = {n.name: n for n in gm.graph.nodes}
        index = {name: k for k, (nodes, _) in enumerate(spans) for name in nodes}
        first: dict[Hashable, int] = {}
        group: list[int | None] = []
        for nodes, live in spans:
            try:
                signature = _signature(nodes, live, by_name, static, targets)
            except _NotRepeatable:
                group.append(None)
            else:
                group.append(first.setdefault(signature, len(group)))
        sizes = collections.Counter(g for g in group if g is not None)
        needed = {name for name, k in index.items() if any(index.get(u.name) != k for u in by_name[name].users)}
        return _Blocks(
            index=index,
            position={name: i for nodes, _ in spans for i, name in enumerate(nodes)},
            nodes=[nodes for nodes, _ in spans],
            live=[tuple(by_name[name] for name in live) for _, live in spans],
            group=group,
            kept=frozenset(k for k, g in enumerate(group) if g is not None and sizes[g] > 1),
            needed=frozenset(needed),
        )


# The fewest blocks `_module_spans` groups a graph's operations into, where module paths are deep enough
# (linearize's default).
_MIN_SPANS = 16


def _module_spans(gm: fx.GraphModule, static: set[str]) -> list[_Span]:
    """A captured graph's operations (not static, in the graph's order) grouped by the module that made each, its
    path cut to the shallowest depth that gives `_MIN_SPANS` groups or more (a transformer's layers, a ResNet's
    bottlenecks), each with the values live at its start: the repeats the recorder skips before the graph has a
    chain. Operations made outside every module join the group before them."""
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output") and n.name not in static]
    paths: list[list[str]] = []
    for n in ops:
        stack = n.meta.get("nn_module_stack") or {}
        path = str(n.target) if n.op == "call_module" else next(reversed(stack.values()))[0] if stack else ""
        paths.append(path.split(".") if path else [])
    deepest = max((len(p) for p in paths), default=0)
    bounds: list[int] = [0]
    for depth in range(1, deepest + 1):
        keys: list[tuple[str, ...] | None] = [tuple(p[:depth]) if p else None for p in paths]
        for i in range(1, len(keys)):
            if keys[i] is None:
                keys[i] = keys[i - 1]
        bounds = [0, *(i for i in range(1, len(ops)) if keys[i] != keys[i - 1])]
        if len(bounds) >= _MIN_SPANS:
            break
    # The values live at each group's start: made before it (a model input, an operation), read at or after it.
    last: dict[str, int] = {}
    for i, n in enumerate([*ops, *(n for n in gm.graph.nodes if n.op == "output")]):
        for a in n.all_input_nodes:
            if a.name not in static:
                last[a.name] = i
    alive = {n.name: None for n in gm.graph.nodes if n.op == "placeholder" and n.name in last}
    spans = []
    for start, stop in itertools.pairwise([*bounds, len(ops)]):
        for name in [name for name in alive if last[name] < start]:
            del alive[name]
        spans.append((tuple(n.name for n in ops[start:stop]), tuple(alive)))
        alive.update((n.name, None) for n in ops[start:stop] if last.get(n.name, -1) >= stop)
    return spans


def _signature(
    nodes: Sequence[str], live: Sequence[str], by_name: dict[str, fx.Node], static: set[str], targets: _Targets
) -> Hashable:
    """A block's operations as plain data: each call as the memo keys it, its arguments with the values live at the
    block's start and its own operations by their places, the model's inputs by name, and the static values it
    reads (parameters, buffers, what is computed from them alone) by what computes them. Raises _NotRepeatable for a
    call the memo never reuses, or a value read through a static one (a batch size read off an earlier value)."""
    places: dict[str, tuple[str, int]] = {name: ("live", i) for i, name in enumerate(live)}
    places.update((name, ("op", i)) for i, name in enumerate(nodes))
    described: dict[str, Hashable] = {}

    def ref(a: fx.Node) -> Any:
        if a.name in places:
            return places[a.name]
        if a.op == "placeholder":
            return ("input", a.name)
        if a.name not in static:
            raise _NotRepeatable(a.name)
        if a.name not in described:
            described[a.name] = ("static", call(a))
        return described[a.name]

    def call(n: fx.Node) -> Hashable:
        if n.op == "get_attr":
            value = _attribute(targets.gm, str(n.target))
            if not isinstance(value, torch.Tensor):
                raise _NotRepeatable(n.name)
            return ("get_attr", layout_key(value))
        key = targets.of(n).key
        if key is None:
            raise _NotRepeatable(n.name)
        try:
            return (n.op, key, _argument_key(n.args, ref), _argument_key(n.kwargs, ref))
        except TypeError:
            raise _NotRepeatable(n.name) from None

    return (len(live), tuple(call(by_name[name]) for name in nodes))


def _argument_key(value: Any, ref: Callable[[fx.Node], Any]) -> Hashable:
    """A node's argument as `layout_key` makes it, each node in it as `ref` says. Raises TypeError for a value that
    cannot be hashed."""
    if isinstance(value, fx.Node):
        return ref(value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_argument_key(v, ref) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _argument_key(v, ref)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", *(_argument_key(v, ref) for v in (value.start, value.stop, value.step)))
    return layout_key(value)


def static_nodes(gm: fx.GraphModule) -> set[str]:
    """The nodes of `gm` whose values depend on no model input (parameters, buffers and what is computed from them
    alone), and the reads of the batch size off an input (each piece reads it off a tensor of its own,
    graph/split.py): what a LayerGraph marks static."""
    static: set[str] = set()
    for n in gm.graph.nodes:
        computed = n.op in ("call_function", "call_method") and all(a.name in static for a in n.all_input_nodes)
        if n.op == "get_attr" or computed or is_batch_size(n):
            static.add(n.name)
    return static


def _attribute(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps, for every node, the (shape, dtype, bytes) of each tensor it returns.

    On fake or meta tensors an op's result depends only on its arguments' layouts: a call seen before (the same op
    in each of a model's identical layers) gets new tensors of the layouts it returned then, without running the
    op's meta kernel again (most of the cost of recording a deep model). With `blocks`, a block that repeats an
    earlier one on values of the same layouts is not run at all: its records are the earlier block's."""

    def __init__(self, gm: fx.GraphModule, targets: _Targets, blocks: _Blocks | None) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.seen: dict[str, list[tuple[tuple[int, ...], str, int]]] = {}
        self.single: dict[str, bool] = {}
        self._results: dict[Hashable, Any] = {}
        self._targets = targets
        self._blocks = blocks
        self._ran: dict[tuple[int, Hashable], int] = {}  # (group, the layouts live at its start) -> a block run
        self._kept: dict[str, Any] = {}  # an operation of a kept block that ran -> its value
        self._skipped = -1  # the block whose records are copied now (-1: none)
        self._from = -1  # the block it repeats

    def _key(self, n: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
        """The memo's key of a call of `n` on `args` and `kwargs`, or None where its result must not be reused."""
        target = self._targets.of(n)
        if target.key is None:
            return None
        flat = tensor_leaves((args, kwargs))
        if target.module is not None:
            flat += _module_tensors(target.module)
        if not flat or not all(t.device.type == "meta" or isinstance(t, FakeTensor) for t in flat):
            return None
        try:
            return (n.op, target.key, layout_key(args), layout_key(kwargs))
        except TypeError:
            return None

    def _repeated(self, k: int) -> int:
        """At block k's first operation: the block run before that k repeats op for op on values of the same
        layouts, else -1 (k runs, and where a later block may repeat it, it is noted)."""
        blocks = self._blocks
        assert blocks is not None
        group = blocks.group[k]
        if group is None or k not in blocks.kept:
            return -1
        values = [self.env[n] for n in blocks.live[k]]
        try:
            layouts = layout_key(tuple(values)) if all(t.is_meta for t in tensor_leaves(values)) else None
        except TypeError:
            return -1
        if layouts is None:
            return -1
        found = self._ran.get((group, layouts))
        if found is None:
            self._ran[(group, layouts)] = k
            return -1
        return found

    def run_node(self, n: fx.Node) -> Any:
        blocks = self._blocks
        k = -1 if blocks is None else blocks.index.get(n.name, -1)
        if k >= 0:
            assert blocks is not None
            if blocks.position[n.name] == 0:
                self._from = self._repeated(k)
                self._skipped = k if self._from >= 0 else -1
            if k == self._skipped:
                twin = blocks.nodes[self._from][blocks.position[n.name]]
                self.seen[n.name], self.single[n.name] = self.seen[twin], self.single[twin]
                return _like(self._kept[twin]) if n.name in blocks.needed else None
        if n.op not in ("call_module", "call_function", "call_method"):
            result = super().run_node(n)
        else:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            key = self._key(n, args, kwargs)
            seen = _NOT_SEEN if key is None else self._results.get(key, _NOT_SEEN)
            if seen is not _NOT_SEEN:
                result = _like(seen)
            else:
                with self._set_current_node(n):
                    result = getattr(self, n.op)(n.target, args, kwargs)
                leaves = _leaves(result)
                if key is not None and leaves and all(isinstance(x, torch.Tensor) or x is None for x in leaves):
                    self._results[key] = result
        if k >= 0 and blocks is not None and k in blocks.kept:
            self._kept[n.name] = result
        tensors = [t for t in _leaves(result) if isinstance(t, torch.Tensor)]
        self.seen[n.name] = [
            (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()) for t in tensors
        ]
        self.single[n.name] = isinstance(result, torch.Tensor)
        return result


class GraphRecorder:
    """Records a graph's outputs on fake or meta tensors (no real compute, no allocation), once per set of inputs
    (one per batch size), what it learns of the graph shared by the recordings: what each node calls, as the memo
    keys it, and the blocks whose repeats are not run (those of `like`, a chain of the graph `gm` was rewritten
    from, else the operations grouped by the modules that made them)."""

    def __init__(self, gm: fx.GraphModule, like: Chain | None = None) -> None:
        self.gm = gm
        self._targets = _Targets(gm)
        self._blocks = _Blocks.of(gm, like, self._targets)

    def record(self, inputs: tuple[torch.Tensor, ...]) -> Recording:
        """Every node's outputs when the graph runs on `inputs`."""

        def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> Recording:
            rec = _Recorder(self.gm, self._targets, self._blocks)
            with torch.no_grad():
                rec.run(*[convert(t) for t in inputs])
            return Recording(rec.seen, rec.single)

        return run_without_compute(self.gm, run, memo=False)  # the recorder repeats whole calls itself
