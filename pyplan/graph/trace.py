"""Trace a model with torch.fx into a LayerGraph, with shapes and bytes recorded at two batch sizes."""

from __future__ import annotations

import linecache
import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import run_without_compute
from pyplan.errors import TraceError
from pyplan.graph.layergraph import Affine, GraphNode, LayerGraph, TensorInfo

__all__ = ["ExampleInputs", "LeafSpec", "inputs_at", "trace"]

# How a caller names leaf modules (kept whole, never traced into): a class, a class name, or a qualified name.
LeafSpec = type | str
# Example inputs: a builder `batch_size -> inputs`, or the inputs of one batch (then other sizes are sliced).
ExampleInputs = Callable[[int], Any] | torch.Tensor | Sequence[torch.Tensor]

_TORCH_DIR = os.path.dirname(torch.__file__)


def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(inputs)
    raise TraceError(
        f"example inputs must be a tensor or a tuple of tensors, got {type(inputs).__name__}; "
        "return a tuple of tensors from example_inputs(batch_size)"
    )


def inputs_at(example: ExampleInputs, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The example inputs for `batch_size` samples (dim 0 of every tensor is the batch)."""
    if callable(example):
        try:
            built = example(batch_size)
        except Exception as exc:
            raise TraceError(
                f"example_inputs({batch_size}) raised {type(exc).__name__}: {exc}; "
                "fix example_inputs so it returns the inputs of a batch of that size"
            ) from exc
        return _as_tuple(built)
    given = _as_tuple(example)
    have = given[0].shape[0] if given[0].dim() else 0
    if have == 0:
        raise TraceError("example inputs have no batch dimension; give tensors batched along dim 0")
    # Copies, not views: a view would keep (and count) the whole storage of the given batch.
    if batch_size <= have:
        return tuple(t[:batch_size].clone() for t in given)
    reps = -(-batch_size // have)
    return tuple(torch.cat([t] * reps)[:batch_size] for t in given)


class _Tracer(fx.Tracer):
    """fx.Tracer with configurable leaves, remembering which module it is inside when tracing fails."""

    def __init__(self, leaves: Iterable[LeafSpec]) -> None:
        super().__init__()
        # Buffers become get_attr nodes, so `self.mask[:t, :t]` with a traced `t` works like a parameter would.
        self.proxy_buffer_attributes = True
        self.leaf_types = tuple(x for x in leaves if isinstance(x, type))
        self.leaf_names = {x for x in leaves if isinstance(x, str)}
        self.path_stack: list[tuple[str, str]] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        if type(m).__name__ in self.leaf_names or module_qualified_name in self.leaf_names:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # Pop only on success, so after a failure the stack still says where tracing was.
        self.path_stack.append((self.path_of_module(m), type(m).__name__))
        result = super().call_module(m, forward, args, kwargs)
        self.path_stack.pop()
        return result


def _user_frame(exc: BaseException) -> str:
    """`file:line: code` of the innermost frame outside torch, where the failing operation is written."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    frames = [f for f in frames if not f.filename.endswith(os.path.join("pyplan", "graph", "trace.py"))]
    if not frames:
        return ""
    f = frames[-1]
    code = (f.line or linecache.getline(f.filename, f.lineno or 0)).strip()
    return f"{os.path.basename(f.filename)}:{f.lineno}: `{code}`"


def _symbolic_trace(model: nn.Module, leaves: Iterable[LeafSpec]) -> fx.GraphModule:
    tracer = _Tracer(leaves)
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        where = tracer.path_stack[-1] if tracer.path_stack else ("", type(model).__name__)
        path, cls = where
        module = f"module '{path}' ({cls})" if path else f"the top-level module ({cls})"
        frame = _user_frame(exc)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        leaf = cls if path else None
        hint = (
            f"mark it as a leaf: trace(..., leaf_modules=['{leaf}']) or --leaf {leaf}"
            if leaf
            else "make the top-level forward traceable (no Python control flow on tensor values)"
        )
        raise TraceError(
            f"torch.fx cannot trace {module}" + (f" at {frame}" if frame else "") + f": {first_line}; {hint}"
        ) from exc
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _leaves(value: Any) -> list[Any]:
    """The leaves of nested tuples, lists and dicts, in order."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    return [value]


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps, for every node, the (shape, dtype, bytes) of each tensor it returns."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.seen: dict[str, list[tuple[tuple[int, ...], str, int]]] = {}
        self.single: dict[str, bool] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        tensors = [t for t in _leaves(result) if isinstance(t, torch.Tensor)]
        self.seen[n.name] = [
            (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size()) for t in tensors
        ]
        self.single[n.name] = isinstance(result, torch.Tensor)
        return result


def _record(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> _Recorder:
    """Run `gm` on fake or meta tensors (no real compute, no allocation) and record every node's outputs."""

    def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> _Recorder:
        rec = _Recorder(gm)
        with torch.no_grad():
            rec.run(*[convert(t) for t in inputs])
        return rec

    return run_without_compute(gm, run)


def trace(
    model: nn.Module,
    example_inputs: ExampleInputs,
    *,
    leaf_modules: Iterable[LeafSpec] = (),
    batch_size: int | None = None,
) -> LayerGraph:
    """Trace `model` with torch.fx into a LayerGraph.

    Shapes are recorded at `batch_size` (default: the batch of the given inputs, or 2 for a builder) and at
    twice that, so every tensor's bytes are known exactly as `per_sample·b + fixed`. Recording runs on fake
    tensors (meta for a model built on the meta device), so a model of any size traces without compute.
    """
    leaves = tuple(leaf_modules)
    gm = _symbolic_trace(model, leaves)
    if batch_size is None:
        batch_size = 2 if callable(example_inputs) else _as_tuple(example_inputs)[0].shape[0]
    b1, b2 = batch_size, 2 * batch_size
    try:
        r1 = _record(gm, inputs_at(example_inputs, b1))
        r2 = _record(gm, inputs_at(example_inputs, b2))
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(
            f"running the traced model on its example inputs failed with {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}; "
            "check that example_inputs(batch_size) matches what model() expects"
        ) from exc

    static: set[str] = set()
    nodes: list[GraphNode] = []
    for n in gm.graph.nodes:
        inputs = tuple(a.name for a in n.all_input_nodes)
        if n.op == "get_attr" or (n.op in ("call_function", "call_method") and all(i in static for i in inputs)):
            static.add(n.name)
        stack = n.meta.get("nn_module_stack") or {}
        module_path = next(reversed(stack.values()))[0] if stack else ""
        if n.op == "call_module":
            module_path = str(n.target)
        outs1, outs2 = r1.seen.get(n.name, []), r2.seen.get(n.name, [])
        outputs = tuple(
            TensorInfo(shape=s1, dtype=d1, bytes=Affine.from_two(b1, float(n1), b2, float(n2)))
            for (s1, d1, n1), (_, _, n2) in zip(outs1, outs2)
        )
        nodes.append(
            GraphNode(
                name=n.name,
                op=n.op,
                target=n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)),
                module_path=module_path,
                inputs=inputs,
                outputs=outputs,
                is_tensor=r1.single.get(n.name, False),
                static=n.name in static,
            )
        )
    names = tuple(x if isinstance(x, str) else x.__name__ for x in leaves)
    return LayerGraph(nodes=nodes, batch_size=b1, module=gm, leaf_modules=names)
