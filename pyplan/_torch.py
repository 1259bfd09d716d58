"""The one module that calls private torch APIs: fake tensors, module reparametrization, storage identity."""

from __future__ import annotations

import contextlib
import gc
import sys
import traceback
from collections.abc import Callable, Hashable, Iterator
from types import FunctionType
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import conv_flop_count, flop_registry, shape_wrapper

__all__ = [
    "FLOP_FORMULAS",
    "MetaMemo",
    "OpRecorder",
    "SelectiveForward",
    "TorchDispatchMode",
    "find_dynamo_skips",
    "is_meta_module",
    "is_real",
    "is_strided",
    "is_view",
    "layout_key",
    "lazy_graph_module",
    "meta_build",
    "never_unpacked",
    "one_value_per_channel",
    "own_base",
    "plain_codegen",
    "run_without_compute",
    "saved_tensors_hooks_now",
    "saving_nothing",
    "storage_key",
    "strided_shard",
    "tensor_leaves",
    "tensor_version",
    "torch_threads",
    "tree_flatten",
    "tree_map_only",
    "without_dynamo",
]

T = TypeVar("T")
Convert = Callable[[torch.Tensor], torch.Tensor]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (shared by its views); works on real, meta and fake tensors."""
    return t.untyped_storage()._cdata


def saved_tensors_hooks_now() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) hooks autograd applies to a tensor saved here: those of the innermost
    `torch.autograd.graph.saved_tensors_hooks` (a recorder's, a checkpoint's), or None. Hooks entered inside hide
    them, so hooks that mean to pass tensors on to them read them first; torch 2.13 has no public call for it."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor's storage (it cannot be detached in place)."""
    return t._is_view()


def own_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views as autograd tracks it (its `_base`), or `t` itself if it is no view."""
    return t._base if t._base is not None else t


def tensor_version(t: torch.Tensor) -> int:
    """`t`'s version counter: how many times its storage was written in place (autograd's check of saved tensors)."""
    return t._version


def is_real(t: torch.Tensor) -> bool:
    """Whether `t` holds data (neither a meta nor a fake tensor)."""
    return not t.is_meta and not isinstance(t, FakeTensor)


def is_meta_module(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


# What gives a tensor its first values and nothing else: torch.nn.init's functions that dispatch as functions, and
# the in-place fills the rest of torch.nn.init calls. On the meta device there are no values to give, and torch runs
# some of them (normal_, through torch._refs) in Python decompositions whose first call imports torch._dynamo (about
# 1 s of CPU, FSDP and DTensor with it).
_FILLS = frozenset(
    {
        torch.nn.init.uniform_,
        torch.nn.init.normal_,
        torch.nn.init.constant_,
        torch.nn.init.kaiming_uniform_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.fill_,
        torch.Tensor.zero_,
        torch.Tensor.random_,
        torch.Tensor.exponential_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.geometric_,
        torch.Tensor.bernoulli_,
    }
)


class _NoFillOnMeta(TorchFunctionMode):
    """Leaves a meta tensor as it is where code would fill it (each fill returns its tensor, as the fill would)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FILLS:
            # torch.nn.init passes its tensor by keyword.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_build() -> Iterator[None]:
    """Modules made inside are made on the meta device, their parameters and buffers left unfilled: what a module's
    initialization would write has no values to land in (and torch's own functions, a `torch.arange` on meta, are
    called without importing torch._dynamo: `without_dynamo`)."""
    with torch.device("meta"), _NoFillOnMeta(), without_dynamo():
        yield


# What F.batch_norm says when a BatchNorm in training mode sees one value per channel (a 1x1 map of one sample).
_ONE_VALUE = "Expected more than 1 value per channel"


def one_value_per_channel(exc: BaseException) -> BaseException | None:
    """The error among `exc` and the exceptions it was raised from that says a BatchNorm in training mode saw one
    value per channel: F.batch_norm's ValueError, or, where a captured graph calls the aten op on fake tensors
    (no such check there), the division by n - 1 in torch's batch-norm decomposition."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ValueError) and _ONE_VALUE in str(seen) and type(seen).__module__ == "builtins":
            return seen
        if isinstance(seen, ZeroDivisionError) and any(
            frame.f_code.co_name.startswith("native_batch_norm") for frame, _ in traceback.walk_tb(seen.__traceback__)
        ):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def _grads_kept(module: torch.nn.Module) -> Iterator[None]:
    params = list(module.parameters())
    grads = [p.grad for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def layout_key(value: Any) -> Hashable:
    """What an op's result on fake or meta tensors depends on, hashable: each tensor's layout, the rest as is.
    Raises TypeError for a value that cannot be hashed."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(layout_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, layout_key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    hash(value)
    return (type(value).__name__, value)


def _memoizable(func: Any) -> bool:
    """Whether `func` returns new tensors whose layouts its arguments' layouts decide: no argument or result
    aliased or written (views, in-place and out= variants), no output sized by values, tensors out."""
    schema = func._schema
    if any(a.alias_info is not None for a in (*schema.arguments, *schema.returns)):
        return False
    if torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
        return False
    # A factory (no tensor argument: empty_strided, what a hit makes) runs in C++ faster than a lookup.
    takes_tensors = any("Tensor" in str(a.type) for a in schema.arguments)
    return (
        takes_tensors
        and bool(schema.returns)
        and all(str(r.type) in ("Tensor", "Tensor[]", "Optional[Tensor]", "Tensor?") for r in schema.returns)
    )


# Op call (op, the arguments' layouts) -> the layouts of its outputs and their structure, shared by every pass of
# one process: the same blocks are recorded at the same sizes by several passes (FLOPs, op costs, saved bytes,
# working memory) and at every tensor-parallel degree.
_MEMO: dict[tuple[Any, ...], tuple[Any, list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]]] = {}
_MEMOIZABLE: dict[Any, bool] = {}


class MetaMemo(TorchDispatchMode):
    """Beneath every other mode, on meta tensors: an aten op that makes new tensors (no view, no in-place, no out=)
    called again on arguments of the same layouts gets new meta tensors of the layouts it returned the first time,
    without running its meta kernel again (many are Python decompositions: layer norm, GELU, addmm take
    milliseconds each). What a meta kernel gives depends on nothing else, so every mode above sees the same.

    Enter it before the modes that record (it must be the innermost mode, the last to see an op)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        ok = _MEMOIZABLE.get(func)
        if ok is None:
            ok = _MEMOIZABLE[func] = _memoizable(func)
        if not ok:
            return func(*args, **kwargs)
        if not all(t.is_meta and t.layout == torch.strided for t in tensor_leaves((args, kwargs))):
            return func(*args, **kwargs)
        try:
            key = (func, layout_key(args), layout_key(kwargs))
            hash(key)  # a SymInt among the sizes hashes to nothing
        except TypeError:
            return func(*args, **kwargs)
        found = _MEMO.get(key)
        if found is not None:
            spec, layouts = found
            made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in layouts]
            return tree_unflatten(made, spec)
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten(out)
        inputs = {storage_key(t) for t in tensor_leaves((args, kwargs))}
        storages = [storage_key(t) for t in leaves if isinstance(t, torch.Tensor)]
        if (
            all(isinstance(t, torch.Tensor) and t.is_meta and t.storage_offset() == 0 for t in leaves)
            and len(set(storages)) == len(storages)
            and not inputs.intersection(storages)
            and all(t.untyped_storage().nbytes() == _strided_bytes(t) for t in leaves)
        ):
            _MEMO[key] = (spec, [(tuple(t.shape), t.stride(), t.dtype) for t in leaves])
        return out


def _strided_bytes(t: torch.Tensor) -> int:
    """The bytes `torch.empty_strided` gives a tensor of `t`'s shape and strides."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


class _DynamoSkips:
    """torch marks some of its own functions (the Python references that are the meta kernels of many ops, its
    checkpoint) for torch.compile to skip, with `torch._compile._disable_dynamo`, whose wrapper imports torch._dynamo
    at its first call: 1.3 s of CPU, the largest single cost of planning a model on meta tensors. While torch._dynamo
    is not imported nothing is being compiled, and skipping is calling the function: inside `unloaded()` each such
    wrapper, found once among the objects the collector tracks, calls its function as it is (the attribute it caches
    the skipping wrapper in is set to the function itself). On leaving, the attributes set are taken back, so that
    a torch.compile after it skips what torch means it to. A process that freezes the collector after its imports
    (`gc.freeze`, the `pyplan` command) finds them first: frozen objects are out of `gc.get_objects()`."""

    def __init__(self) -> None:
        self.functions: list[Any] | None = None

    def find(self) -> list[Any]:
        if self.functions is None:
            code = torch._compile._disable_dynamo(_dropped).__code__
            cell = code.co_freevars.index("fn")  # its function (`__wrapped__` is another one's, under a `wraps`)
            wrappers = (f for f in gc.get_objects() if type(f) is FunctionType and f.__code__ is code)
            self.functions = [w.__closure__[cell].cell_contents for w in wrappers]
        return self.functions

    @contextlib.contextmanager
    def unloaded(self) -> Iterator[None]:
        if "torch._dynamo" in sys.modules:
            yield
            return
        marked = [f for f in self.find() if f.__dict__.get(_SKIP_ATTRIBUTE) is None]
        for f in marked:
            f.__dict__[_SKIP_ATTRIBUTE] = f
        try:
            yield
        finally:
            for f in marked:
                if f.__dict__.get(_SKIP_ATTRIBUTE) is f:
                    del f.__dict__[_SKIP_ATTRIBUTE]


# Where `torch._compile._disable_dynamo`'s wrapper caches the skipping wrapper of its function (torch 2.13).
_SKIP_ATTRIBUTE = "__dynamo_disable"
_DYNAMO_SKIPS = _DynamoSkips()


def without_dynamo() -> contextlib.ContextDecorator:
    """Inside it (a `with`, or a decorated function's call), torch's functions marked for torch.compile to skip are
    called as they are while torch._dynamo is not imported (`_DynamoSkips`): planning on meta tensors never imports
    it. Nothing may compile inside it."""
    return _DYNAMO_SKIPS.unloaded()


def find_dynamo_skips() -> None:
    """Find the functions torch marks for torch.compile to skip (`_DynamoSkips`), before the collector is frozen."""
    _DYNAMO_SKIPS.find()


def run_without_compute(module: torch.nn.Module, fn: Callable[[Convert], T], *, memo: bool = True) -> T:
    """`fn(convert)` with `module` on meta tensors if it was built there, else on fake tensors.

    Nothing is computed or allocated. Parameters and buffers are stand-ins that gradients accumulate into; the
    real ones and their `.grad` are left as they were. `convert` turns an input tensor into the same kind. A real
    model whose forward needs real values (data-dependent control flow inside a leaf module) runs for real. On meta
    tensors, ops repeated with arguments of the same layouts skip their meta kernels (`MetaMemo`) unless `memo` is
    False (for a caller that repeats whole calls itself, where the mode would only add its lookups).
    """
    with without_dynamo():
        return _without_compute(module, fn, memo)


def _without_compute(module: torch.nn.Module, fn: Callable[[Convert], T], memo: bool) -> T:
    if is_meta_module(module):
        with _grads_kept(module), MetaMemo() if memo else contextlib.nullcontext():
            return fn(lambda t: t.to("meta"))
    state = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = {name: mode.from_tensor(t) for name, t in state.items()}
            with _reparametrize_module(module, fakes, tie_weights=True):
                return fn(mode.from_tensor)
    except (DataDependentOutputException, DynamicOutputShapeException):
        with _grads_kept(module):
            return fn(lambda t: t)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples, lists and dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensor_leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensor_leaves(v)]
    return []


def _conv_backward_flop(
    grad_out_shape: list[int], x_shape: list[int], w_shape: list[int], *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """FLOPs of a convolution's backward: the input gradient and the weight gradient each take as many
    multiply-adds as the forward. torch 2.13's own formula ignores `groups` and overcounts depthwise convolutions
    by about the group count (65x for 64 channels)."""
    transposed, output_mask = args[4], args[7]
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def _grouped_query_tolerant(packet: Any) -> Callable[..., float]:
    """torch's formula for an attention op, counting grouped-query shapes as `_op_flops` does; given the op's
    tensors (`_get_raw`), as FlopCounterMode passes them to such an entry."""
    formula, name = flop_registry[packet], packet.__name__

    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> float:
        return _op_flops(formula, name, args, kwargs, out_val)

    count._get_raw = True  # type: ignore[attr-defined]
    return count


# Formulas that replace torch's, as FlopCounterMode's custom_mapping (shape-based, like torch's own, except the
# attention entries, which take the tensors).
FLOP_FORMULAS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.convolution_backward: _conv_backward_flop,
    **{k: _grouped_query_tolerant(k) for k in flop_registry if "scaled_dot_product" in k.__name__},
}
# OpRecorder's formulas: torch's with the shape-based replacements (it counts attention through `_op_flops` itself).
_REGISTRY = {
    **flop_registry,
    **{k: shape_wrapper(v) for k, v in FLOP_FORMULAS.items() if not getattr(v, "_get_raw", False)},
}

# CPU's fused attention has no FLOP formula of its own; it does the work of the GPU flash kernel.
_FLOP_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": torch.ops.aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        torch.ops.aten._scaled_dot_product_flash_attention_backward
    ),
}


def _op_flops(formula: Callable[..., Any], name: str, args: tuple, kwargs: dict, out: Any) -> float:
    """An op's FLOPs by torch's formula. Attention with fewer key/value heads than query heads (grouped-query
    attention) is counted with the key/value heads repeated, as the kernel computes it: torch before 2.13 has
    formulas that refuse such shapes."""
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        if "scaled_dot_product" not in name:
            raise
        # The op's tensors, or their shapes where a FlopCounterMode passed shapes.
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        heads = max(t[1] for t in shapes if isinstance(t, tuple) and len(t) == 4)

        def widen(t: Any) -> Any:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else t
            if not isinstance(shape, tuple) or len(shape) != 4 or shape[1] >= heads or heads % shape[1]:
                return t
            wide = (shape[0], heads, *shape[2:])
            return t.new_empty(wide) if isinstance(t, torch.Tensor) else type(t)(wide)

        return float(formula(*(widen(a) for a in args), **kwargs, out_val=out))


# Selective activation checkpointing (torchtitan's "op" policy, torchtitan/models/llama3/infra/parallelize.py
# `_save_list` and `_custom_policy`): a block run under it saves the outputs of its matrix products and fused
# attention kernels, except every second `aten.mm` (counted per block, in its forward and again in its
# recomputation), and recomputes every other op in its backward.
SELECTIVE_SAVE_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)
SELECTIVE_SAVE_NAMES = frozenset(op.overloadpacket.__name__ for op in SELECTIVE_SAVE_OPS)


def selective_saves(names: list[str]) -> list[bool]:
    """For a block's ops in order (aten names), whether selective checkpointing saves each one's output: the
    policy of `selective_contexts` (every second `mm` recomputed)."""
    policy = _SelectivePolicy()
    return [policy.keeps(name in SELECTIVE_SAVE_NAMES, name == "mm") for name in names]


class _SelectivePolicy:
    """torchtitan's op policy over one pass of a block (a forward or its recomputation): whether selective
    checkpointing saves the output of each op in turn (every second `aten.mm` recomputed, counted in this pass)."""

    def __init__(self) -> None:
        self.mms = 0

    def saves(self, func: Any) -> bool:
        """Whether the output of the aten op `func`, run next, is saved."""
        return self.keeps(func in _SAVED_OPS, func == _MM)

    def keeps(self, listed: bool, mm: bool) -> bool:
        """Whether the output of the next op, on the save list or not, an `mm` or not, is saved."""
        self.mms += mm
        return listed and not (mm and self.mms % 2 == 0)


_MM = torch.ops.aten.mm.default
_SAVED_OPS = frozenset(SELECTIVE_SAVE_OPS)


def selective_contexts() -> tuple[Any, Any]:
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` that runs selective checkpointing (torchtitan's op
    policy, above)."""
    passes = {False: _SelectivePolicy(), True: _SelectivePolicy()}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        keep = passes[ctx.is_recompute].saves(func)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class SelectiveForward(TorchDispatchMode):
    """The first forward of a block under `checkpoint(..., use_reentrant=False, context_fn=selective_contexts)`, as
    far as memory goes, without torch's checkpoint, whose every call reads `torch._dynamo.config` and so imports
    torch._dynamo (1.3 s of CPU the first time). Inside it autograd saves nothing (the checkpoint's saved-tensors
    hook keeps a handle, not the tensor) and the outputs of the ops the policy saves are held in `kept`, as the
    checkpoint's cache holds them (torch skips `aten.detach` and the ops it runs for its own checks, which the
    policy never saves). The graph it leaves cannot backpropagate: it is for measuring the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []
        self._policy = _SelectivePolicy()
        self._hooks = saving_nothing()

    def __enter__(self) -> SelectiveForward:
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._policy.saves(func):
            self.kept.append(out)
        return out


def saving_nothing() -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensors hooks under which autograd keeps none of the tensors it saves (a forward measured as a
    checkpoint's first pass runs it); a backward through what ran inside fails."""
    return torch.autograd.graph.saved_tensors_hooks(_dropped, never_unpacked)


def _dropped(t: torch.Tensor) -> None:
    """A saved-tensors pack hook that keeps nothing."""


def never_unpacked(packed: Any) -> torch.Tensor:
    """A saved-tensors unpack hook for forwards that are measured, never backpropagated."""
    raise RuntimeError("a forward whose saved tensors were not kept was backpropagated")


class OpRecorder(TorchDispatchMode):
    """Records every aten op that runs inside it: (op name, FLOPs, bytes read and written, dtype, is a view, FLOPs
    as counted).

    FLOPs come from torch's own formulas (`torch.utils.flop_counter`; 0 for ops it has none for, such as
    elementwise ones): as counted, what FlopCounterMode reports; computed, that times `flop_scale`. Bytes are the
    input and output tensors' sizes, a storage read twice by one op counted once; view ops move nothing.
    """

    def __init__(self, flop_scale: Callable[[Any, tuple, dict], float] | None = None) -> None:
        super().__init__()
        # (name, FLOPs computed, bytes moved, dtype, is a view, FLOPs its formula counts)
        self.ops: list[tuple[str, float, float, str, bool, float]] = []
        # The share of its formula's FLOPs an op really computes (a causal fused attention skips the tiles above
        # the diagonal, which torch's formula counts).
        self.flop_scale = flop_scale

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "aten":
            return out  # prim::device and the like: metadata queries, no kernel
        packet = func.overloadpacket
        formula = _REGISTRY.get(_FLOP_ALIASES.get(packet.__name__, packet))
        counted = _op_flops(formula, packet.__name__, args, kwargs, out) if formula is not None else 0.0
        flops = counted * self.flop_scale(func, args, kwargs) if counted and self.flop_scale is not None else counted
        inputs = tensor_leaves((args, kwargs))
        outputs = tensor_leaves(out)
        in_keys = {storage_key(t): t for t in inputs}
        moved = sum(t.numel() * t.element_size() for t in in_keys.values())
        moved += sum(t.numel() * t.element_size() for t in outputs if storage_key(t) not in in_keys)
        if func.is_view:
            moved = 0  # a view reads and writes no data
        floats = [t for t in (*inputs, *outputs) if t.is_floating_point()]
        dtype = str(floats[0].dtype).removeprefix("torch.") if floats else ""
        self.ops.append((packet.__name__, flops, float(moved), dtype, bool(func.is_view), counted))
        return out


def plain_codegen(graph: torch.fx.Graph) -> None:
    """Make `graph` take its placeholders positionally and return its output as is: an exported graph's code
    flattens and unflattens the model's own argument and output structure (pytree), which pyplan's pieces do not use."""
    graph._codegen = torch.fx.graph.CodeGen()


class _LazyGraphModule(LazyGraphModule):
    """torch's lazy GraphModule, whose first call runs the code it makes directly: torch's calls the module again
    once the code is made, running the module's own hooks twice."""

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        self.real_recompile()
        return self.forward(*args, **kwargs)


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    """`torch.fx.GraphModule(root, graph, name)` whose Python code is generated when it is first called or read, not
    when it is made (about 5 ms a graph): the profile makes a piece of every block and runs only the distinct ones.
    torch 2.13's lazy GraphModule (torch.fx._lazy_graph_module) is private."""
    return _LazyGraphModule(root, graph, name)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside, as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def strided_shard(dim: int, parts: int) -> Any:
    """A DTensor placement that gives each rank the rank-th slice of each of `parts` equal pieces along `dim` (a
    fused QKV's weight split over its heads). torch 2.13 has no public placement for it: `_StridedShard`
    (torch.distributed.tensor.placement_types) is private."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=parts)


def is_strided(placement: Any) -> bool:
    """Whether a DTensor placement is a strided shard (`strided_shard`), which torch.distributed.checkpoint cannot
    lay out on torch 2.13 (it reads its chunks as overlapping)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)
