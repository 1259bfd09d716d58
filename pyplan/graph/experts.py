"""Mixture-of-experts layers found in a captured graph: the router, its top-k choice, the routed experts, a shared
expert; and the capture that keeps each layer's experts whole, as expert parallelism runs them.

A layer is found as the tensor-parallel plan finds Megatron's regions: from the graph, not from class names. Its
*routed experts* are a module whose parameters hold one slice per expert: 3-D parameters stacked along a first
dimension of experts (transformers' MixtralExperts: `gate_up_proj` (experts, 2·I, H)), or a ModuleList of one MLP per
expert (`experts.mlps.0.w1.weight` ...). Its *routing* is a top-k (or an argmax, top-1) over the scores of a Linear
with one output per expert, the *router*: the experts module must read the choice's indices, and weights derived
from it, as `experts(hidden, index, weights)`. The *shared experts* are what the layer adds to the routed experts'
output from the layer's own input (DeepSeek's and Qwen2-MoE's shared expert and its gate).

Expert parallelism of degree E spreads each layer's experts over E ranks, num_experts/E each; a layer splits at E
where E divides its experts and its experts are a module of their own called with (hidden, index, weights), which
the runtime replaces (pyplan/runtime/experts.py). To reach that module in the captured graph, a capture for expert
parallelism keeps it whole (`expert_leaves`, `keep_experts_whole`): one `call_module` node with those three inputs.
Under torch.export, which has no leaf modules, the module's call is captured as one op (`pyplan::experts_call`) and
turned into the `call_module` afterwards; its forward need not be capturable (transformers' eager experts loop over
the experts the router picked, a branch on values).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensor

from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.tensor_parallel import Reader, node_arg, op_name

__all__ = [
    "ExpertLayer",
    "ExpertPlan",
    "WholeExperts",
    "expert_leaves",
    "find_expert_layers",
    "is_experts_module",
    "keep_experts_whole",
]

# The score functions a router's logits may pass through on their way to the top-k choice (names as `_plain` gives
# them: lower-case, no underscores).
_SCORES = frozenset({"softmax", "sigmoid", "logsoftmax"})
# Operations that only reshape or cast a value: walked through from the experts' output and back from the router's
# input to the layer's input.
_RESHAPES = frozenset(
    {"view", "reshape", "unsafeview", "flatten", "contiguous", "to", "tocopy", "float", "typeas", "clone", "alias"}
)
_ADDS = frozenset({"add", "iadd"})
# How far a walk through the graph goes (nodes): a router's scores, an experts module's inputs and a shared expert lie
# within a layer.
_MAX_WALK = 64


def _plain(name: str) -> str:
    """An operation's name as the walks compare it: `_to_copy`, `to_copy` and `toCopy` alike."""
    return name.lower().replace("_", "")


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer: where its experts are and the figures the cost model prices.

    `path` is the routed experts' module; `num_experts` experts, each token sent to `top_k` of them by the router
    (`router`, scores by `score`: "softmax", "sigmoid" or "" for raw logits); `hidden` the width of the tokens the
    experts take; `expert_params` one routed expert's parameter elements, `intermediate` its inner width, `gated`
    whether it is a gated MLP (SwiGLU: gate and up projections, 3·hidden·intermediate weights; else 2·...);
    `shared_params` the elements of the shared experts (`shared`, modules), `router_params` the router's.
    `layout` is "grouped" (3-D parameters, one slice per expert along dim 0) or "list" (a ModuleList of one module
    per expert). `kept_whole`: the graph calls the experts as one module (a capture for expert parallelism).
    `problem` says why the experts cannot be spread over ranks at any degree ("" where they can)."""

    path: str
    num_experts: int
    top_k: int
    hidden: int
    expert_params: int
    shared_params: int
    router_params: int
    gated: bool
    intermediate: int
    router: str
    shared: tuple[str, ...] = ()
    score: str = ""
    layout: str = "grouped"
    kept_whole: bool = False
    problem: str = ""

    def why_not(self, degree: int) -> str:
        """Why expert parallelism of `degree` does not split this layer, or "" where it does."""
        if self.problem:
            return self.problem
        if self.num_experts % degree:
            return f"{degree} does not divide its {self.num_experts} experts"
        return ""

    def splits_at(self, degree: int) -> bool:
        return not self.why_not(degree)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden": self.hidden,
            "expert_params": self.expert_params,
            "shared_params": self.shared_params,
            "router_params": self.router_params,
            "gated": self.gated,
            "intermediate": self.intermediate,
            "router": self.router,
            "shared": list(self.shared),
            "score": self.score,
            "layout": self.layout,
            "kept_whole": self.kept_whole,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class ExpertPlan:
    """The model's mixture-of-experts layers in graph order, and `unrouted`: modules holding one set of parameters
    per expert of a router the model has, whose routing was not recognized (module -> why)."""

    layers: tuple[ExpertLayer, ...] = ()
    unrouted: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.layers or self.unrouted)

    def degrees(self, most: int = 64) -> tuple[int, ...]:
        """Every degree up to `most` that splits every layer (1 always)."""
        splits = [e for e in range(2, most + 1) if self.layers and all(x.splits_at(e) for x in self.layers)]
        return (1, *splits)

    def to_json(self) -> dict[str, Any]:
        return {"layers": [x.to_json() for x in self.layers], "unrouted": dict(self.unrouted)}


# ----------------------------------------------------------------------------------------------------------------
# Parameters held one set per expert


@dataclass(frozen=True)
class _Group:
    """A module whose parameters look like routed experts': `count` experts, each a slice along dim 0 of the
    module's own parameters ("grouped"), or a child of its ModuleList `list_path` ("list")."""

    path: str
    count: int
    layout: str
    list_path: str = ""


def _expert_groups(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, _Group]:
    """The modules (by path; never the root) whose parameters (name -> shape) hold one set per expert."""
    direct: dict[str, dict[str, tuple[int, ...]]] = {}
    lists: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        direct.setdefault(prefix, {})[leaf] = shape
        parts = name.split(".")
        for j in range(1, len(parts) - 1):
            if parts[j].isdigit():
                child = lists.setdefault(".".join(parts[:j]), {}).setdefault(int(parts[j]), {})
                child[".".join(parts[j + 1 :])] = shape
    out: dict[str, _Group] = {}
    for prefix, params in direct.items():
        firsts = {s[0] for s in params.values() if len(s) >= 2}
        stacked = sum(len(s) == 3 for s in params.values())
        if prefix and stacked and len(firsts) == 1 and all(len(s) >= 2 for s in params.values()):
            count = firsts.pop()
            if count >= 2:
                out[prefix] = _Group(prefix, count, "grouped")
    for list_path, children in lists.items():
        parent = list_path.rpartition(".")[0]
        n = len(children)
        numbered = n >= 2 and sorted(children) == list(range(n))
        if parent and parent not in out and numbered and all(c == children[0] for c in children.values()):
            out[parent] = _Group(parent, n, "list", list_path)
    return out


def _not_per_expert(group: _Group, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """A parameter under the group's module that is not one expert's (its name there and shape), or ""."""
    for name, shape in shapes.items():
        if not name.startswith(group.path + "."):
            continue
        rest = name[len(group.path) + 1 :]
        if group.layout == "grouped" and ("." in rest or shape[0] != group.count):
            return f"'{rest}' {tuple(shape)}"
        if group.layout == "list" and not name.startswith(group.list_path + "."):
            return f"'{rest}' {tuple(shape)}"
    return ""


def _expert_matrices(group: _Group, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, list[tuple[int, int]]]:
    """One expert's parameter elements and its weight matrices' shapes."""
    if group.layout == "grouped":
        own = [s for name, s in shapes.items() if name.rpartition(".")[0] == group.path]
        numel = sum(_numel(s) // group.count for s in own)
        return numel, [(s[1], s[2]) for s in own if len(s) == 3]
    first = [s for name, s in shapes.items() if name.startswith(f"{group.list_path}.0.")]
    return sum(_numel(s) for s in first), [(s[0], s[1]) for s in first if len(s) == 2]


def _numel(shape: Iterable[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _mlp_shape(matrices: list[tuple[int, int]], hidden: int, numel: int) -> tuple[int, bool]:
    """(inner width, gated) of an expert MLP from its weight matrices: each has the hidden width on one side and
    the inner width (or twice it, a fused gate and up projection) on the other; a gated MLP holds 3·H·I weights, a
    plain one 2·H·I."""
    inner = [a if b == hidden else b for a, b in matrices if hidden in (a, b)]
    if not inner:
        return numel // max(2 * hidden, 1), False
    width = min(inner)
    total = sum(a * b for a, b in matrices)
    return width, total == 3 * hidden * width


# ----------------------------------------------------------------------------------------------------------------
# The module tree, before capture


def _positional_inputs(cls: type) -> int:
    """How many positional parameters a module class's forward takes besides self (transformers' experts dispatch
    through a wrapper that keeps the signature of the forward it wraps; gpt-oss's experts default their index and
    weights to None)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params)


def is_experts_module(model: nn.Module, path: str) -> bool:
    """Whether module `path` of `model` holds routed experts a capture can keep whole: its parameters are one set
    per expert, its forward takes (hidden, index, weights), and beside it (in its parent) a parameter has one row
    per expert (the router's weight)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    group = _expert_groups(shapes).get(path)
    return group is not None and _leaf_candidate(model, group, shapes)


def _leaf_candidate(model: nn.Module, group: _Group, shapes: Mapping[str, tuple[int, ...]]) -> bool:
    if _positional_inputs(type(model.get_submodule(group.path))) < 3 or _not_per_expert(group, shapes):
        return False
    # The router is a sibling module of the experts (the parent's own child, `mlp.gate.weight`): a parameter deeper
    # in the parent, such as BERT's token-type embedding beside its encoder's list of 2 layers, is not one.
    parent = group.path.rpartition(".")[0]
    prefix = parent + "." if parent else ""
    beside = (
        n
        for n in shapes
        if n.startswith(prefix) and n[len(prefix) :].count(".") == 1 and not n.startswith(group.path + ".")
    )
    return any(len(shapes[n]) == 2 and shapes[n][0] == group.count for n in beside)


def expert_leaves(model: nn.Module) -> tuple[str, ...]:
    """The routed experts' modules of `model` (paths, outermost only) that a capture for expert parallelism keeps
    whole: pass them as `leaf_modules` to `trace`."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    found = sorted(g.path for g in _expert_groups(shapes).values() if _leaf_candidate(model, g, shapes))
    return tuple(p for p in found if not any(p.startswith(q + ".") for q in found))


# ----------------------------------------------------------------------------------------------------------------
# Keeping experts whole under torch.export

# The experts modules being captured, by the key their op names them with.
_CAPTURED: dict[str, weakref.ref[nn.Module]] = {}


@torch.library.custom_op("pyplan::experts_call", mutates_args=())
def _experts_call(key: str, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """An experts module's call as one op, while torch.export captures the model (then made a `call_module`): on
    real tensors it runs the module (without gradients: a capture runs it on fake tensors alone)."""
    module = _CAPTURED[key]()
    if module is None:
        raise RuntimeError(f"the experts module of '{key}' is gone; capture the model again")
    with torch.no_grad():
        return type(module).forward(module, hidden, index, weights).clone()


@_experts_call.register_fake
def _experts_like(key: str, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The output's layout on fake and meta tensors: routed experts return one value per token, as `hidden`."""
    return torch.empty_like(hidden)


_OP = torch.ops.pyplan.experts_call.default


class WholeExperts(nn.Module):
    """Mixed into the class of an experts module kept whole by a capture: on fake or meta tensors (recording the
    graph's shapes, the analytic profile) the call returns a value of `hidden`'s layout without running the
    experts, whose forward may need values (transformers' eager experts loop over the experts picked) or kernels
    without meta support in the dtype (grouped_mm takes bf16 alone on meta); on real tensors it runs them. Their cost
    on fake and meta tensors is the cost model's, from the layer's figures (`ExpertLayer`)."""

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in (hidden, index, weights)):
            return torch.empty_like(hidden)
        return super().forward(hidden, index, weights)


def _whole(module: nn.Module) -> nn.Module:
    """A copy of the experts module that the captured graph calls: the same parameters, buffers and children (shared,
    not copied), its class with `WholeExperts` mixed in. The model's own module is left as it was."""
    cls = type(module)
    whole_cls = type(cls.__name__, (WholeExperts, cls), {"__qualname__": cls.__qualname__})
    copy = whole_cls.__new__(whole_cls)
    copy.__dict__.update(module.__dict__)
    for slot in ("_parameters", "_buffers", "_modules"):
        copy.__dict__[slot] = dict(module.__dict__[slot])
    return copy


def _named(leaves: Iterable[Any], path: str, module: nn.Module) -> bool:
    """Whether a leaf spec (a class, a class name or a qualified name) names this module."""
    for leaf in leaves:
        if isinstance(leaf, type) and isinstance(module, leaf):
            return True
        if isinstance(leaf, str) and leaf in (path, type(module).__name__):
            return True
    return False


def keep_experts_whole(
    model: nn.Module, leaves: Iterable[Any], capture: Callable[[], fx.GraphModule]
) -> fx.GraphModule:
    """`capture()` with every routed experts module that `leaves` names kept whole: one `call_module` node with
    (hidden, index, weights), calling a copy of the module (`WholeExperts`) installed in the result under its path.
    torch.fx's symbolic trace keeps leaves itself; under torch.export, which has none, each such module is captured
    as one `pyplan::experts_call` op that becomes the `call_module` afterwards."""
    names = tuple(leaves)
    if not names:
        return capture()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    groups = _expert_groups(shapes)
    whole = {
        path: m
        for path, m in model.named_modules()
        if path in groups and _named(names, path, m) and _leaf_candidate(model, groups[path], shapes)
    }
    if not whole:
        return capture()
    keys = {f"{path}#{id(m)}": path for path, m in whole.items()}
    for key, path in keys.items():
        _CAPTURED[key] = weakref.ref(whole[path])
        whole[path].forward = _one_op(key, whole[path])  # type: ignore[method-assign]
    try:
        gm = capture()
    finally:
        for key, path in keys.items():
            del whole[path].forward
            _CAPTURED.pop(key, None)
    _as_module_calls(gm, keys, {path: _whole(m) for path, m in whole.items()})
    return gm


def _one_op(key: str, module: nn.Module) -> Callable[..., torch.Tensor]:
    """The forward an experts module has while captured: its three inputs into one op."""
    signature = inspect.signature(type(module).forward)

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(module, *args, **kwargs)
        values = list(bound.arguments.values())[1:4]
        if len(values) < 3 or not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError(f"{type(module).__name__} is called without (hidden, index, weights) tensors")
        return _OP(key, *values)

    return forward


def _as_module_calls(gm: fx.GraphModule, keys: Mapping[str, str], copies: Mapping[str, nn.Module]) -> None:
    """In `gm`, each experts module kept whole called through its copy (`copies`, by path): a `pyplan::experts_call`
    node (keys: its key -> path) made a `call_module` node; the parameters read for the op alone dropped."""
    graph = gm.graph
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    called |= {keys[n.args[0]] for n in graph.nodes if n.op == "call_function" and n.target is _OP}
    for path, copy in copies.items():
        if path in called:
            _install(gm, path, copy)
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not _OP:
            continue
        with graph.inserting_before(n):
            call = graph.call_module(keys[n.args[0]], tuple(n.args[1:]))
        call.meta = dict(n.meta)
        n.replace_all_uses_with(call)
        graph.erase_node(n)
    for n in list(graph.nodes):
        inside = any(str(n.target).startswith(path + ".") for path in copies)
        if n.op == "get_attr" and not n.users and inside:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()


def _install(gm: fx.GraphModule, path: str, module: nn.Module) -> None:
    parent: nn.Module = gm
    *outer, last = path.split(".")
    for part in outer:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]  # type: ignore[assignment]
    parent.add_module(last, module)


# ----------------------------------------------------------------------------------------------------------------
# Finding the layers in a captured graph


def _stack_paths(n: fx.Node) -> list[str]:
    return [v[0] for v in (n.meta.get("nn_module_stack") or {}).values()]


def _stack_class(n: fx.Node, path: str) -> tuple[str, type | None]:
    """The name of the class of module `path` in a node's module stack, and the class where the capture kept it
    (torch.export keeps its qualified name alone)."""
    for p, cls in (n.meta.get("nn_module_stack") or {}).values():
        if p == path:
            if isinstance(cls, type):
                return cls.__name__, cls
            return str(cls).rsplit(".", 1)[-1].strip("'>"), None
    return "", None


class _Finder:
    """The graph with the walks the layers are found by."""

    def __init__(self, graph: LayerGraph) -> None:
        self.graph = graph
        self.reader = Reader(graph)
        self.gm = graph.module
        self.nodes = list(self.gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self.shapes = {name: tuple(p.shape) for name, p in self.gm.named_parameters(remove_duplicate=False)}
        self.choices = [n for n in self.nodes if self._is_choice(n)]
        self.is_choice = set(self.choices)

    def _is_choice(self, n: fx.Node) -> bool:
        return n.op in ("call_function", "call_method") and op_name(n, self.gm) in ("topk", "argmax")

    def info(self, n: fx.Node) -> Any:
        node = self.graph.node(n.name)
        return node.outputs[0] if node.outputs and node.is_tensor else None

    def is_value(self, n: fx.Node) -> bool:
        return n.op != "get_attr" and self.info(n) is not None and not self.graph.node(n.name).static

    def ancestors(self, starts: Iterable[fx.Node], floor: int) -> set[fx.Node]:
        """`starts` and every node they are computed from that lies at position `floor` or after."""
        seen: set[fx.Node] = set()
        todo = [s for s in starts if self.order[s] >= floor]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(a for a in n.all_input_nodes if self.order[a] >= floor)
        return seen

    def descendants(self, start: fx.Node, ceiling: int) -> set[fx.Node]:
        """`start` and every node computed from it up to position `ceiling`."""
        seen: set[fx.Node] = set()
        todo = [start]
        while todo:
            n = todo.pop()
            if n in seen or self.order[n] > ceiling:
                continue
            seen.add(n)
            todo.extend(n.users)
        return seen

    def params_read(self, nodes: Iterable[fx.Node]) -> dict[str, int]:
        """The parameters the nodes read (name -> elements): a module call's, a get_attr's."""
        out: dict[str, int] = {}
        for n in nodes:
            if n.op == "call_module":
                for name, p in self.gm.get_submodule(str(n.target)).named_parameters():
                    out[f"{n.target}.{name}"] = p.numel()
            for a in n.all_input_nodes:
                if a.op == "get_attr" and str(a.target) in self.shapes:
                    out[str(a.target)] = _numel(self.shapes[str(a.target)])
        return out

    def router_of(self, choice: fx.Node) -> tuple[Any, str]:
        """The Linear whose scores the choice ranks (tensor_parallel's `_Linear`, or None) and the score function
        on the way ("softmax", "sigmoid" or "")."""
        score = ""
        n = choice.args[0] if choice.args and isinstance(choice.args[0], fx.Node) else None
        for _ in range(_MAX_WALK):
            if n is None:
                break
            if n.name in self.reader.linears:
                return self.reader.linears[n.name], score
            name = _plain(op_name(n, self.gm))
            if name in _SCORES and not score:
                score = "softmax" if name == "logsoftmax" else name
            ins = [a for a in n.all_input_nodes if self.is_value(a)]
            n = ins[0] if ins else None
        return None, score

    def choice_before(self, value: fx.Node) -> fx.Node | None:
        """The nearest top-k (or argmax) that `value` is computed from, walking back no further than a layer."""
        seen: set[fx.Node] = set()
        todo = [value]
        while todo and len(seen) < 4 * _MAX_WALK:
            n = todo.pop(0)
            if n in seen:
                continue
            seen.add(n)
            if n in self.is_choice:
                return n
            todo.extend(a for a in n.all_input_nodes if self.is_value(a) or a.op == "call_function")
        return None

    def layer_input(self, x: fx.Node) -> fx.Node:
        """The value a layer's router reads, back through reshapes and casts (the layer's input)."""
        for _ in range(_MAX_WALK):
            ins = [a for a in x.all_input_nodes if self.is_value(a)]
            if _plain(op_name(x, self.gm)) not in _RESHAPES or len(ins) != 1:
                return x
            x = ins[0]
        return x


def find_expert_layers(graph: LayerGraph) -> ExpertPlan:
    """The mixture-of-experts layers of a captured graph, whether their experts are kept whole or traced into."""
    f = _Finder(graph)
    groups = _expert_groups(f.shapes)
    routed_counts = set()
    for c in f.choices:
        linear, _ = f.router_of(c)
        if linear is not None:
            routed_counts.add(linear.out_features)
    layers: list[tuple[int, ExpertLayer]] = []
    unrouted: dict[str, str] = {}
    for group in groups.values():
        inside = [
            n
            for n in f.nodes
            if n.op != "get_attr"
            and (
                (n.op == "call_module" and (n.target == group.path or str(n.target).startswith(group.path + ".")))
                or group.path in _stack_paths(n)
            )
        ]
        if not inside:
            continue
        found = _layer(f, group, inside)
        if isinstance(found, ExpertLayer):
            layers.append((f.order[inside[0]], found))
        elif found and group.count in routed_counts:
            unrouted[group.path] = found
    return ExpertPlan(tuple(x for _, x in sorted(layers, key=lambda t: t[0])), unrouted)


def _layer(f: _Finder, group: _Group, inside: list[fx.Node]) -> ExpertLayer | str:
    """The layer whose routed experts are `group`, or why its routing was not recognized ("" for a group that is
    no experts at all: its module holds no router's choice and reads none)."""
    members = set(inside)
    leaf = inside[0] if len(inside) == 1 and inside[0].op == "call_module" and inside[0].target == group.path else None
    if leaf is not None:
        entries = [a for a in leaf.args if isinstance(a, fx.Node)]
    else:
        outside = (a for n in inside for a in n.all_input_nodes if a not in members and f.is_value(a))
        entries = list(dict.fromkeys(outside))
    # The choice the experts read: one inside their module (a router of its own), else of those their inputs are
    # computed from or that lie in the module around them, the nearest to them in the module tree, then the latest
    # (an earlier layer's choice lies behind the tokens too).
    inner = [c for c in f.choices if c in members]
    parent = group.path.rpartition(".")[0]
    around = [c for c in f.choices if any(p == parent or p.startswith(parent + ".") for p in _stack_paths(c)[-1:])]
    before = [c for c in (f.choice_before(e) for e in entries) if c is not None]
    near = [c for c in dict.fromkeys(before + around) if c not in members]

    def nearness(c: fx.Node) -> tuple[int, int]:
        common = _common_prefix(_stack_paths(c)[-1] if _stack_paths(c) else "", group.path)
        return len(common.split(".")) if common else 0, f.order[c]

    choice = inner[0] if inner else max(near, key=nearness, default=None)
    if choice is None:
        grouped = group.layout == "grouped"
        return "no top-k choice of a router reaches its inputs" if grouped or len(entries) >= 3 else ""
    linear, score = f.router_of(choice)
    if linear is None:
        return f"its top-k choice ('{choice.name}') does not rank the scores of a Linear (a router)"
    if linear.out_features != group.count:
        return ""
    k = 1 if op_name(choice, f.gm) == "argmax" else node_arg(choice, 1, "k")
    if not isinstance(k, int):
        return f"its top-k choice ('{choice.name}') takes k as a value of the graph, not a number"
    if group.layout == "list" and linear.module.startswith(group.list_path + "."):
        return ""  # a stack of layers, each with a router of its own, is no set of experts
    numel, matrices = _expert_matrices(group, f.shapes)
    intermediate, gated = _mlp_shape(matrices, linear.in_features, numel)
    u = f.layer_input(linear.input)
    routing = [e for e in entries if choice in f.ancestors([e], f.order[choice])]  # the indices and weights
    lin_node = f.reader.nodes[linear.node]
    router_nodes = f.ancestors([lin_node, *routing], f.order[lin_node])
    if choice not in members:
        router_nodes -= members
    router_params = sum(f.params_read(router_nodes).values())
    shared, shared_params = _shared(f, members, u, group, linear.module)
    problem = _separable(f, group, leaf, entries, choice, members, k, linear.in_features, linear.module)
    return ExpertLayer(
        path=group.path,
        num_experts=group.count,
        top_k=k,
        hidden=linear.in_features,
        expert_params=numel,
        shared_params=shared_params,
        router_params=router_params,
        gated=gated,
        intermediate=intermediate,
        router=linear.module,
        shared=shared,
        score=score,
        layout=group.layout,
        kept_whole=leaf is not None,
        problem=problem,
    )


def _separable(
    f: _Finder,
    group: _Group,
    leaf: fx.Node | None,
    entries: list[fx.Node],
    choice: fx.Node,
    members: set[fx.Node],
    k: int,
    hidden: int,
    router: str,
) -> str:
    """Why the experts are not a module of their own called as experts(hidden, index, weights), or ""."""
    if leaf is not None:
        cls: type | None = type(f.gm.get_submodule(group.path))
        name = cls.__name__
    else:
        name, cls = _stack_class(next(iter(members)), group.path)
    what = f"({name or 'its module'})"  # the layer's path is beside every verdict
    if choice in members or router.startswith(group.path + "."):
        return (
            f"its router and its experts are one module {what}: the experts are not a module of their own, "
            "called with (hidden, index, weights)"
        )
    bad = _not_per_expert(group, f.shapes)
    if bad:
        return f"parameter {bad} of the experts' module {what} is not one expert's"
    floor = f.order[choice]
    kinds = []
    for e in entries:
        info = f.info(e)
        routed = choice in f.ancestors([e], floor)
        integer = info is not None and not info.dtype.startswith(("float", "bfloat", "complex"))
        kinds.append("index" if routed and integer else "weights" if routed else "hidden")
    if sorted(kinds) != ["hidden", "index", "weights"]:
        return (
            f"the experts' module {what} reads {len(entries)} values from outside it ({', '.join(kinds) or 'none'}), "
            "not (hidden, top-k indices, top-k weights)"
        )
    if leaf is not None and kinds != ["hidden", "index", "weights"]:
        return f"the experts' module {what} takes ({', '.join(kinds)}), not (hidden, index, weights) in this order"
    if leaf is None and cls is not None and _positional_inputs(cls) < 3:
        return f"the experts' module {what} does not take (hidden, index, weights) as its forward's arguments"
    by_kind = dict(zip(kinds, entries))
    index_info, hidden_info = f.info(by_kind["index"]), f.info(by_kind["hidden"])
    weights_shape = f.info(by_kind["weights"]).shape
    if weights_shape != index_info.shape:
        return (
            f"the experts' module {what} takes weights of shape {weights_shape} beside indices of shape "
            f"{index_info.shape}, not one weight per chosen expert"
        )
    if index_info.shape[-1:] != (k,) or hidden_info.shape[-1:] != (hidden,):
        return (
            f"the experts' module {what} takes indices of shape {index_info.shape} and tokens of shape "
            f"{hidden_info.shape}, not (tokens, {k}) and (tokens, {hidden})"
        )
    return ""


def _shared(f: _Finder, members: set[fx.Node], u: fx.Node, group: _Group, router: str) -> tuple[tuple[str, ...], int]:
    """The shared experts: what is added to the routed experts' output, computed from the layer's input `u` with
    parameters of its own (modules, as children of the layer's module, and their parameter elements)."""
    outputs = [n for n in members if f.is_value(n) and any(user not in members for user in n.users)]
    if len(outputs) != 1:
        return (), 0
    block = _common_prefix(router, group.path)
    n = outputs[0]
    modules: set[str] = set()
    params: dict[str, int] = {}
    for _ in range(_MAX_WALK):
        if len(n.users) != 1:
            break
        user = next(iter(n.users))
        name = _plain(op_name(user, f.gm))
        if name in _RESHAPES:
            n = user
            continue
        other = [a for a in user.all_input_nodes if a is not n and f.is_value(a)]
        if name not in _ADDS or len(other) != 1:
            break
        between = f.ancestors(other, f.order[u]) & f.descendants(u, f.order[user])
        read = f.params_read(between - members - {u})
        if not read:
            break
        params.update(read)
        modules.update(_child_of(block, param) for param in read)
        n = user
    return tuple(sorted(modules)), sum(params.values())


def _common_prefix(a: str, b: str) -> str:
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _child_of(block: str, param: str) -> str:
    """The module holding `param` as a child of the layer's module `block` (its owner where it lies outside)."""
    owner = param.rpartition(".")[0]
    if block and owner.startswith(block + "."):
        return ".".join(owner.split(".")[: len(block.split(".")) + 1])
    return owner
