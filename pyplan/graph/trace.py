"""Trace a model with torch.fx into a LayerGraph, with shapes and bytes recorded at two batch sizes."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import linecache
import os
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, export

from pyplan._torch import (
    is_meta_module,
    plain_codegen,
    tree_flatten,
    tree_map_only,
)
from pyplan.errors import TraceError
from pyplan.graph.chain import Chain
from pyplan.graph.experts import keep_experts_whole
from pyplan.graph.functions import kept_whole
from pyplan.graph.layergraph import Affine, GraphNode, LayerGraph, TensorInfo
from pyplan.graph.masks import is_batch_size, simplify_attention_masks
from pyplan.graph.record import GraphRecorder, static_nodes

__all__ = [
    "Call",
    "ExampleInputs",
    "Examples",
    "LeafSpec",
    "call_at",
    "graph_of",
    "input_tensors",
    "inputs_at",
    "is_batch_size",
    "output_tensors",
    "trace",
]

# How a caller names leaf modules (kept whole, never traced into): a class, a class name, or a qualified name.
LeafSpec = type | str
# Example inputs: a builder `batch_size -> inputs`, or the inputs of one batch (then other sizes are sliced). The
# inputs of a batch are a tensor, a tuple of tensors (positional), a dict (keyword arguments) or a pair
# (args tuple, kwargs dict).
ExampleInputs = Callable[[int], Any] | torch.Tensor | Sequence[torch.Tensor]
Call = tuple[tuple[Any, ...], dict[str, Any]]

_TORCH_DIR = os.path.dirname(torch.__file__)
_SHAPE = "return a tuple of tensors, a dict of keyword arguments, or (args, kwargs) from example_inputs(batch_size)"


def _as_call(inputs: Any) -> Call:
    """The (args, kwargs) of a model call from what example_inputs returned."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        return (), dict(inputs)
    if (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[0], (tuple, list))
        and isinstance(inputs[1], dict)
    ):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TraceError(f"example inputs must be tensors, got {type(inputs).__name__}; {_SHAPE}")


def _flat_tensors(call: Call) -> tuple[torch.Tensor, ...]:
    """The tensors of a call, in the order torch.export numbers its inputs (pytree order of (args, kwargs))."""
    leaves, _ = tree_flatten(call)
    tensors = tuple(t for t in leaves if isinstance(t, torch.Tensor))
    if not tensors:
        raise TraceError(f"example inputs hold no tensor; {_SHAPE}")
    return tensors


def input_tensors(inputs: Any) -> tuple[torch.Tensor, ...]:
    """What example_inputs returned (a tensor, a tuple, a dict, or (args, kwargs)) as the tensors the captured
    module takes, in its order: the form the runtime and profiling pass batches in."""
    return _flat_tensors(_as_call(inputs))


def output_tensors(output: Any) -> Any:
    """A model's output as its captured module returns it: the tensors of the output (a dataclass such as
    transformers' ModelOutput, a dict, nested tuples) in order, one tensor as itself, several as a tuple."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def _is_positional(call: Call) -> bool:
    """A call of tensors passed positionally, the form torch.fx's symbolic trace takes."""
    return not call[1] and all(isinstance(t, torch.Tensor) for t in call[0])


def call_at(example: ExampleInputs, batch_size: int) -> Call:
    """The (args, kwargs) of a model call on `batch_size` samples."""
    if callable(example):
        try:
            built = example(batch_size)
        except Exception as exc:
            raise TraceError(
                f"example_inputs({batch_size}) raised {type(exc).__name__}: {exc}; "
                "fix example_inputs so it returns the inputs of a batch of that size"
            ) from exc
        return _as_call(built)
    return (inputs_at(example, batch_size), {})


def inputs_at(example: ExampleInputs, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The example inputs for `batch_size` samples (dim 0 of every tensor is the batch), as the tensors the
    captured module takes positionally: keyword arguments follow the positional ones, in the order of the model's
    call (torch.export's)."""
    if callable(example):
        return _flat_tensors(call_at(example, batch_size))
    given = _flat_tensors(_as_call(example))
    have = given[0].shape[0] if given[0].dim() else 0
    if have == 0:
        raise TraceError("example inputs have no batch dimension; give tensors batched along dim 0")
    # Copies, not views: a view would keep (and count) the whole storage of the given batch.
    if batch_size <= have:
        return tuple(t[:batch_size].clone() for t in given)
    reps = -(-batch_size // have)
    return tuple(torch.cat([t] * reps)[:batch_size] for t in given)


class Examples:
    """A model's example inputs at each batch size, made once: every profiler of one capture reads the same tensors
    for a size instead of building and batching them again. Callable as `example_inputs` is (it returns the call's
    (args, kwargs)), so it goes wherever ExampleInputs do."""

    def __init__(self, example_inputs: ExampleInputs) -> None:
        self.source = example_inputs.source if isinstance(example_inputs, Examples) else example_inputs
        self._calls: dict[int, Call] = {}

    def __call__(self, batch_size: int) -> Call:
        if batch_size not in self._calls:
            self._calls[batch_size] = call_at(self.source, batch_size)
        return self._calls[batch_size]


# torch.nn modules that hold a stack of layers: torch.fx would keep one whole (it keeps torch.nn's modules as
# leaves), leaving no cut between its layers.
_LAYER_STACKS = (nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)


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
        if isinstance(m, _LAYER_STACKS):
            return False  # traced into, so each layer is a block of its own
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


class _FxFailure(Exception):
    """Where torch.fx's symbolic trace stopped: the module it was in and the error."""

    def __init__(self, path: str, cls: str, error: BaseException) -> None:
        super().__init__(path, cls)
        self.path, self.cls, self.error = path, cls, error


def _unpassed_defaults(model: nn.Module, call: Call) -> dict[str, Any]:
    """The forward's parameters that `call` leaves at their defaults, with those defaults: torch.fx would make each
    a placeholder and trace `if targets is None` as False."""
    try:
        params = inspect.signature(model.forward).parameters
        bound = inspect.signature(model.forward).bind(*call[0], **call[1]).arguments
    except (TypeError, ValueError):
        return {}
    return {
        name: p.default
        for name, p in params.items()
        if name not in bound
        and p.default is not inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _symbolic_trace(model: nn.Module, leaves: Iterable[LeafSpec], call: Call) -> fx.GraphModule:
    """torch.fx's trace of `model` called as `call`, user autograd Functions kept whole (else _FxFailure)."""
    tracer = _Tracer(leaves)
    defaults = _unpassed_defaults(model, call)
    try:
        with kept_whole():
            graph = tracer.trace(model, concrete_args=defaults or None)
    except Exception as exc:
        path, cls = tracer.path_stack[-1] if tracer.path_stack else ("", type(model).__name__)
        raise _FxFailure(path, cls, exc) from exc
    for n in [n for n in graph.nodes if n.op == "placeholder"]:
        checks = _specialization_checks(n)
        if checks:  # a default taken at capture: not an input
            for check in reversed(checks):
                graph.erase_node(check)
            graph.erase_node(n)
    _flatten_output(graph)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _specialization_checks(placeholder: fx.Node) -> list[fx.Node] | None:
    """The nodes torch.fx adds to check that a concrete argument has its value (`_assert_is_none`, `== value`
    then `torch._assert`), in graph order, when nothing else reads the placeholder; else None."""
    seen: list[fx.Node] = []
    todo = list(placeholder.users)
    while todo:
        n = todo.pop()
        name = getattr(n.target, "__name__", "")
        if n.op != "call_function" or name not in ("_assert_is_none", "_assert", "eq"):
            return None
        if n not in seen:
            seen.append(n)
            todo.extend(n.users)
    order = {n: i for i, n in enumerate(placeholder.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _flatten_output(graph: fx.Graph) -> None:
    """The graph returns its output's tensors alone (one as itself, several as a tuple), as `output_tensors` gives a
    model's output: a None or a flag among the outputs (`(logits, None)`) is dropped."""
    out = next(n for n in graph.nodes if n.op == "output")
    flat = [a for a in tree_flatten(out.args[0])[0] if isinstance(a, fx.Node)]
    out.args = (flat[0] if len(flat) == 1 else tuple(flat),)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _module_at(model: nn.Module, exc: BaseException) -> tuple[str, str]:
    """The module whose forward holds the innermost frame of `exc` that lies in one: (path, class name); the
    first such module in `named_modules` order when several share the class (a repeated layer)."""
    spans: dict[type, tuple[str, int, int, str]] = {}
    for path, m in model.named_modules():
        if type(m) in spans:
            continue
        try:
            lines, start = inspect.getsourcelines(type(m).forward)
            file = inspect.getsourcefile(type(m).forward)
        except (OSError, TypeError):
            continue
        if file is not None:
            spans[type(m)] = (os.path.abspath(file), start, start + len(lines), path)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        for cls, (file, first, stop, path) in spans.items():
            if os.path.abspath(frame.filename) == file and first <= (frame.lineno or 0) < stop:
                return path, cls.__name__
    return "", type(model).__name__


def _param_share(model: nn.Module, path: str) -> float:
    """The fraction of the model's parameters inside submodule `path`."""
    total = sum(p.numel() for p in model.parameters())
    inside = sum(p.numel() for p in model.get_submodule(path).parameters())
    return inside / total if total else 0.0


def _capture_error(model: nn.Module, exc: BaseException, fx_failure: _FxFailure | None) -> TraceError:
    """One line for a model no capture takes: the module, the user's line, and what to do about it."""
    path, cls = _module_at(model, exc)
    module = f"module '{path}' ({cls})" if path else f"the top-level module ({cls})"
    frame = _user_frame(exc)
    where = f" at {frame}" if frame else ""
    if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
        what = "its forward branches on a tensor's values, which no graph capture can follow"
        small = path and fx_failure is not None and fx_failure.path == path and _param_share(model, path) < 0.5
        hint = (
            # torch.fx keeps a leaf whole and calls it as a module: the rest of the model still splits into blocks.
            f"mark it as a leaf: trace(..., leaf_modules=['{cls}']) or --leaf {cls}"
            if small
            else "compute the condition from shapes or Python values, or write the branch with torch.where or "
            "torch.cond"
        )
    else:
        what = _first_line(exc)
        hint = "check that example_inputs(batch_size) is what the model's forward takes"
    return TraceError(f"cannot capture {module}{where}: {what}; {hint}")


# Where a node of an exported graph was made outside every module: torch.export's placeholder for an empty stack.
_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


@contextlib.contextmanager
def _explicit_keywords(model: nn.Module, bound: dict[str, Any]) -> Iterator[None]:
    """While torch.export runs: where the example inputs reach the forward's `**kwargs` (FNet's forward takes no
    attention_mask), a forward whose signature names each of them, so that dynamic_shapes can mirror it (torch 2.13's
    export binds the inputs to the signature, then appends the keyword inputs again beside the `**kwargs` entry, and
    refuses the shapes as a mismatch)."""
    params = list(inspect.signature(model.forward).parameters.values())
    var = next((p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var is None or not bound.get(var.name):
        yield
        return
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in bound[var.name]]
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = inspect.Signature(named + extra)  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.forward


# torch.export's checks of the values a model read with .item() (XLM's `assert lengths.max().item() <= slen`): the
# capture saw one value, a run on meta or fake tensors has none to read.
_VALUE_CHECKS = (torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size.default)


def _drop_value_checks(graph: fx.Graph) -> None:
    """Remove the checks of values read off tensors (`_VALUE_CHECKS`) and what only they used (the `.item()`, the
    reductions before it): they check the data, not the plan, and no run without data can do them."""
    dead = [n for n in graph.nodes if n.op == "call_function" and n.target in _VALUE_CHECKS]
    while dead:
        n = dead.pop()
        inputs = n.all_input_nodes
        graph.erase_node(n)
        for a in inputs:
            if not a.users and a.op == "call_function" and not (a.target in _VALUE_CHECKS or _mutates(a)):
                dead.append(a)


def _mutates(n: fx.Node) -> bool:
    """Whether node `n` writes into a tensor or has another effect (an in-place or out= op, a print)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return not callable(n.target) or getattr(n.target, "__module__", "") != "_operator"
    return schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _export(model: nn.Module, call: Call) -> fx.GraphModule:
    """Capture `model` with torch.export (non-strict: the model's Python runs as written, on fake tensors, so
    control flow on shapes, dtypes and None is taken at capture), dim 0 of every input a symbolic batch size.

    The result follows the conventions of a symbolic trace: parameters and buffers as get_attr nodes of the
    model's own tensors (shared, ties kept), one placeholder per input tensor in `inputs_at` order, and the
    output's tensors flattened (one tensor returned as itself, several as a tuple). The batch size is read off an
    input (`aten.sym_size.int(input, 0)`), which `trace` marks static so that each piece reads it off its own."""
    args, kwargs = call
    batch = Dim("batch", min=1)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise TraceError(f"{type(model).__name__}.forward does not take the example inputs: {exc}; {_SHAPE}") from None
    if is_meta_module(model):
        args, kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    with _explicit_keywords(model, bound):
        # dynamic_shapes mirrors the forward's parameters: dim 0 of every tensor is the batch.
        named = inspect.signature(model.forward).bind(*args, **kwargs).arguments

        def shapes(dim: Any) -> dict[str, Any]:
            return {
                k: tree_map_only(torch.Tensor, lambda t: {0: dim} if t.dim() else None, v) for k, v in named.items()
            }

        try:
            program = export(model, args, kwargs, dynamic_shapes=shapes(batch), strict=False)
        except Exception as exc:  # torch.export raises its constraint violations as a UserError
            if "Constraints violated" not in str(exc):
                raise
            # A relation over the batch that torch's solver cannot prove for every size (Llama 4's experts reshape
            # by `min(hidden, tokens·hidden)`, true from 1 sample on): the batch dynamic without a named range,
            # which keeps it symbolic and leaves such relations as checks of the inputs.
            program = export(model, args, kwargs, dynamic_shapes=shapes(Dim.DYNAMIC), strict=False)
    gm = program.module()
    graph = gm.graph
    _refuse_vmap(graph)
    plain_codegen(graph)
    for n in list(graph.nodes):
        if n.op == "call_module" and not n.users:  # torch.export's input guards: the inputs are ours
            graph.erase_node(n)
        elif n.op == "call_function" and n.target is torch.ops.aten.view.default:
            # `y.transpose(1, 2).contiguous().view(b, t, c)` is captured without the `contiguous`, a no-op on the
            # strides the capture saw; another kernel (SDPA's math path, a fake tensor) gives other strides, where
            # the view fails. reshape is the same view wherever the view holds, and the copy that `contiguous`
            # made where it does not.
            n.target = torch.ops.aten.reshape.default
    for n in [n for n in graph.nodes if n.op == "placeholder"]:
        if not (isinstance(n.meta.get("val"), torch.Tensor) or n.users):
            graph.erase_node(n)  # a constant input (None, a flag): taken at capture
        elif not isinstance(n.meta.get("val"), torch.Tensor):
            raise TraceError(f"the model reads its non-tensor input '{n.name}' as a value; pass tensors only")
    _drop_value_checks(graph)
    _flatten_output(graph)
    for n in graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        if stack and next(reversed(stack.values()))[0] == _NO_MODULE:
            n.meta["nn_module_stack"] = {}
    graph.lint()
    # A module of its own: without the exported module's input checks, sharing its parameters and buffers.
    return fx.GraphModule(gm, graph, type(model).__name__)


def source_line(text: str) -> tuple[str, str, str] | None:
    """The innermost `File "PATH", line N` of a traceback's text (a node's `stack_trace`, or what torch.fx's
    interpreter appends to an error after "Original traceback:") with the code on the line after it: (PATH, N, the
    code or ""); None where it names no file."""
    lines = [line.strip() for line in text.splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File ") and ", line " in lines[i]:
            path = lines[i].split('"')[1] if '"' in lines[i] else lines[i][len("File ") :].split(",")[0]
            number = lines[i].split(", line ", 1)[1].split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return path, number, code
    return None


def node_module(n: fx.Node) -> str:
    """The module a captured node was made in, as errors name it ("module 'PATH' (Class)", "the top-level module
    (Class)"), or "" where the capture recorded none."""
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return ""
    path, kind = stack[-1]
    name = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1].strip("'>"))
    return f"module '{path}' ({name})" if path else f"the top-level module ({name})"


def _refuse_vmap(graph: fx.Graph) -> None:
    """One line where the forward calls torch.vmap (transformers builds some attention masks with it): torch.export
    leaves functorch's batching ops in the graph, which run only inside the vmap call that made them; the pieces of
    such a graph, run on their own, find its values escaped from it (T5Gemma 2's bidirectional masks)."""
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "_vmap_increment_nesting":
            module = node_module(n) or "the top-level module"
            source = source_line(n.meta.get("stack_trace") or "")
            where = f" at {os.path.basename(source[0])}:{source[1]}: `{source[2]}`" if source else ""
            raise TraceError(
                f"cannot capture {module}{where}: it calls torch.vmap, which torch.export captures as batching ops "
                "that run only inside the vmap call (transformers builds some attention masks this way); compute "
                "it without torch.vmap, or plan the model with another attention mask"
            )


def _check_leaves(model: nn.Module, leaves: tuple[LeafSpec, ...]) -> None:
    """Every leaf given by name names a module of `model`, by class or by path: a misspelt leaf would be ignored."""
    names = {type(m).__name__ for m in model.modules()} | {name for name, _ in model.named_modules() if name}
    for leaf in leaves:
        if isinstance(leaf, str) and leaf not in names:
            close = difflib.get_close_matches(leaf, sorted(names), n=3)
            hint = f"; close: {', '.join(close)}" if close else f"; its module classes: {_classes(model)}"
            raise TraceError(f"leaf module '{leaf}' names no module of the model (by class or by path){hint}")


def _classes(model: nn.Module) -> str:
    classes = sorted({type(m).__name__ for m in model.modules()})
    return ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")


@contextlib.contextmanager
def _unchecked_distributions() -> Iterator[None]:
    """While capturing: torch.distributions skip the checks of their arguments' values (`Categorical(logits=x)`
    checks that x is finite, a branch on values no capture follows; BLT's entropy of its patcher's logits). The
    checks raise or pass and compute nothing the model uses."""
    before = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)


def _capture(model: nn.Module, example: ExampleInputs, leaves: tuple[LeafSpec, ...], batch_size: int) -> fx.GraphModule:
    """The model's graph: torch.fx's symbolic trace where it works on positional tensor inputs (its graph keeps
    module calls whole and leaf modules as asked), else torch.export's (`_export`)."""
    call = call_at(example, max(2, batch_size))  # torch.export takes a batch of 1 for a constant
    fx_failure = None
    # A model on meta makes the tensors of its forward there too (SEW-D's `torch.tensor(finfo.min)` as a fill
    # value, which masked_fill on meta refuses from the CPU).
    where = torch.device("meta") if is_meta_module(model) else contextlib.nullcontext()
    # a user's autograd Function stays one op, run as written; torch.distributions do not check their arguments
    with kept_whole(), where, _unchecked_distributions():
        if _is_positional(call):
            try:
                return _symbolic_trace(model, leaves, call)
            except _FxFailure as failure:
                fx_failure = failure
        try:
            return _export(model, call)
        except TraceError:
            raise
        except Exception as exc:
            raise _capture_error(model, exc, fx_failure) from exc


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
    _check_leaves(model, leaves)
    if is_meta_module(model):
        # A model built under `torch.device("meta")` can hold tensors made elsewhere: torch.normal(mean, std, size)
        # ignores the device context (DiffLlama's lambdas), and a graph mixing them copies out of meta.
        model.to("meta")
    if batch_size is None:
        batch_size = 2 if callable(example_inputs) else _flat_tensors(_as_call(example_inputs))[0].shape[0]
    # Routed experts among the leaves are kept whole under torch.export too, which has no leaf modules.
    gm = keep_experts_whole(model, leaves, lambda: _capture(model, example_inputs, leaves, batch_size))
    simplify_attention_masks(gm)
    return graph_of(gm, example_inputs, batch_size, tuple(x if isinstance(x, str) else x.__name__ for x in leaves))


def _batch_dim(at_b: tuple[int, ...], at_2b: tuple[int, ...]) -> int | None:
    """The first dimension that doubles when the batch does (the batch, or tokens of batch x sequence)."""
    if len(at_b) != len(at_2b):
        return None
    return next((d for d, (x, y) in enumerate(zip(at_b, at_2b)) if x > 0 and y == 2 * x), None)


def graph_of(
    gm: fx.GraphModule,
    example_inputs: ExampleInputs,
    batch_size: int,
    leaf_modules: tuple[str, ...] = (),
    *,
    like: Chain | None = None,
) -> LayerGraph:
    """The LayerGraph of a captured GraphModule: every node's outputs recorded at `batch_size` and at twice that.
    Also serves a GraphModule rewritten after capture (pyplan/graph/tensor_parallel.py's local shards).

    On the meta device a block of operations that repeats an earlier one op for op, on values of the same layouts,
    is recorded as the earlier one was instead of run (the records come out the same: one of a model's identical
    layers is run). The blocks are those of `like`, the chain of the graph `gm` was rewritten from (the same
    operations, names and order), else the operations grouped by the modules that made them."""
    b1, b2 = batch_size, 2 * batch_size
    try:
        recorder = GraphRecorder(gm, like)
        r1 = recorder.record(inputs_at(example_inputs, b1))
        r2 = recorder.record(inputs_at(example_inputs, b2))
    except TraceError:
        raise
    except Exception as exc:
        raise TraceError(
            f"running the traced model on its example inputs failed with {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}; "
            "check that example_inputs(batch_size) matches what model() expects"
        ) from exc

    static = static_nodes(gm)
    nodes: list[GraphNode] = []
    for n in gm.graph.nodes:
        inputs = tuple(a.name for a in n.all_input_nodes)
        stack = n.meta.get("nn_module_stack") or {}
        module_path = next(reversed(stack.values()))[0] if stack else ""
        if n.op == "call_module":
            module_path = str(n.target)
        outs1, outs2 = r1.seen.get(n.name, []), r2.seen.get(n.name, [])
        outputs = tuple(
            TensorInfo(
                shape=s1, dtype=d1, bytes=Affine.from_two(b1, float(n1), b2, float(n2)), batch_dim=_batch_dim(s1, s2)
            )
            for (s1, d1, n1), (s2, _, n2) in zip(outs1, outs2)
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
    return LayerGraph(nodes=nodes, batch_size=b1, module=gm, leaf_modules=leaf_modules)
