"""CUDA autocast's casts on the tensors the analytic profile records ops on, which torch's autocast never sees.

A plan in bf16-mixed or fp16-mixed trains under `torch.autocast("cuda")`: matrix products, convolutions, recurrences
and attention compute in 16 bits on 16-bit copies of their inputs (weights and biases included), norms, softmaxes,
reductions and losses in fp32, and every other op in the widest dtype of its inputs, so the residual stream of a
pre-norm transformer stays fp32. The analytic profile runs on meta or fake tensors, where autocast does nothing (it
acts on CUDA tensors, and is off on a machine without CUDA). `CudaAutocast` applies the same policy below autograd:
the lists of ATen's CUDA autocast kernels (aten/src/ATen/autocast_mode.h and autocast_mode.cpp, torch 2.13:
AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
AT_FORALL_PROMOTE, and binary_cross_entropy, which autocast refuses), by the names of the aten ops those composites
reach. Each cast is the `_to_copy` kernel autocast launches; a tensor is cast once per recording (autocast
saves its 16-bit copies for the backward; here autograd saves the originals, and the backward finds their casts
made). The backward runs without autocast, as it does in training (`CudaAutocast.backward`); autograd casts each
gradient to the dtype of its tensor, as under autocast. The composites of the lists (conv2d, linear, layer_norm,
...) reach a dispatch mode only as their pieces, and some refuse mixed dtypes before that (a convolution's bias):
`CudaAutocast` casts their inputs above autograd, where autocast does. torch.export's graphs assert the dtypes the
capture saw (`_assert_tensor_metadata`), which autocast changes: under the emulation they check the rest.

Below autograd, autograd saves the fp32 originals: right for the kernels a step launches, not for the memory it
holds. `AutocastAbove` applies the same lists above autograd, to the torch functions a model calls, as autocast's
dispatch key does: the products save their 16-bit copies, a weight's copy lives until the backward, and the memory
profile of a mixed-precision plan (pyplan/profile/remat.py) is recorded under it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pyplan._torch import TorchDispatchMode, storage_key, tensor_leaves, tree_map_only
from pyplan.errors import PlanError
from pyplan.graph.functions import KEPT_WHOLE, run_kept_whole
from pyplan.graph.trace import node_module, source_line

__all__ = ["AutocastAbove", "CudaAutocast", "NoKernelInDtype"]

# The policy of CUDA autocast in torch 2.13: the op lists of aten/src/ATen/autocast_mode.h, registered for CUDA in
# aten/src/ATen/autocast_mode.cpp (`TORCH_LIBRARY_IMPL(aten, Autocast, m)`) with a few ops of their own, and
# aten/src/ATen/native/cudnn/AutocastRNN.cpp. Names are aten ops' (every overload of one name shares its policy).

# Ops that compute in the 16-bit dtype on 16-bit copies of every floating input (AT_FORALL_LOWER_PRECISION_FP, and
# cudnn_convolution, cudnn_convolution_transpose in autocast_mode.cpp; `_cudnn_rnn` in AutocastRNN.cpp, the kernel
# nn.LSTM, nn.GRU and nn.RNN reach on a GPU: here by their own ops, which reach other kernels off a GPU). With them
# the aten ops their composites reach on a GPU: the fused attention kernels, and a convolution's backward, whose
# saved inputs are the fp32 originals below autograd.
LOWER = frozenset(
    {
        "_convolution", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
        "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d", "conv2d", "conv3d",
        "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution", "einsum", "gru_cell",
        "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_relu_cell",
        "rnn_tanh_cell", "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",
        "_cudnn_rnn", "gru", "lstm", "rnn_relu", "rnn_tanh",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "convolution_backward",
    }
)  # fmt: skip
# Ops that compute in fp32 on fp32 copies of every floating input (AT_FORALL_FP32), with the aten ops the composites
# of AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE reach (softmax's `_softmax` casts its bf16 input on a GPU), and
# cross_entropy_loss, a composite of two (log_softmax and nll_loss).
FP32 = frozenset(
    {
        "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d", "acos", "asin", "binary_cross_entropy_with_logits", "cdist", "cosh",
        "cosine_embedding_loss", "cosine_similarity", "dist", "erfinv", "exp", "expm1", "frobenius_norm",
        "group_norm", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "layer_norm", "log", "log10",
        "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
        "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d", "nuclear_norm", "pdist",
        "poisson_nll_loss", "pow", "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh", "smooth_l1_loss",
        "soft_margin_loss", "softplus", "tan", "triplet_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d",
        "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
        "upsample_trilinear3d",
        "_softmax", "_log_softmax", "native_group_norm", "_fused_rms_norm", "nll_loss_forward",
        "nll_loss2d_forward", "cross_entropy_loss",
    }
)  # fmt: skip
# Ops run with `dtype=torch.float32` where they are given none and their first input is floating
# (AT_FORALL_FP32_SET_OPT_DTYPE): a reduction reads its 16-bit input and writes fp32, with no cast of its own.
FP32_SET_OPT_DTYPE = frozenset(
    {"cumprod", "cumsum", "linalg_matrix_norm", "linalg_vector_norm", "log_softmax", "prod", "softmax", "sum"}
)
# Ops that compute in the widest floating dtype of their inputs (AT_FORALL_PROMOTE).
PROMOTE = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
     "tensordot", "vdot"}
)  # fmt: skip
# The ops of the lists that are composites (CompositeImplicitAutograd in aten/src/ATen/native/native_functions.yaml):
# autocast casts their inputs before they decompose, where the dispatch of `CudaAutocast` sees only the pieces, and
# some check dtypes first (conv2d: "Input type and bias type should be the same"). `CudaAutocast` casts these above
# autograd, as torch functions (tests/profile/test_autocast.py checks the list against the dispatcher).
COMPOSITE = frozenset(
    {
        "_convolution", "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "einsum", "gru", "gru_cell", "linalg_multi_dot", "linalg_vecdot", "linear", "lstm",
        "lstm_cell", "matmul", "prelu", "rnn_relu", "rnn_relu_cell", "rnn_tanh", "rnn_tanh_cell",
        "scaled_dot_product_attention",
        "_fused_rms_norm", "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "cdist", "cosine_embedding_loss",
        "cosine_similarity", "cross_entropy_loss", "frobenius_norm", "group_norm", "hinge_embedding_loss", "kl_div",
        "l1_loss", "layer_norm", "linalg_matrix_norm", "log_softmax", "margin_ranking_loss",
        "multilabel_margin_loss", "nll_loss", "nll_loss2d", "nuclear_norm", "pdist", "poisson_nll_loss", "rms_norm",
        "softmax", "triplet_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_trilinear3d",
        "bilinear", "cross", "grid_sampler", "tensordot",
    }
)  # fmt: skip
# norm without a dtype runs as its overload with one, given fp32 (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
# fp32_append_dtype); norm given a dtype runs as asked.
_APPEND_DTYPE = {
    torch.ops.aten.norm.Scalar: torch.ops.aten.norm.ScalarOpt_dtype,
    torch.ops.aten.norm.ScalarOpt_dim: torch.ops.aten.norm.ScalarOpt_dim_dtype,
}
# torch.export's check of the dtype a value had at capture (fp32): autocast changes dtypes, so the emulation checks
# its size and strides only.
# Ops outside autocast's lists that refuse a source of another dtype than the tensor they write into (a mixture of
# experts' index_add of its experts' outputs): under the emulation their floating inputs take `self`'s dtype.
_SAME_AS_SELF = frozenset({"index_add", "index_add_", "index_copy", "index_copy_", "masked_scatter", "scatter",
                           "scatter_", "scatter_reduce", "scatter_reduce_"})  # fmt: skip
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64 alone

# Torch functions whose names differ from the aten ops of the lists.
_FUNCTION_NAMES = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__pow__": "pow",
    "__rpow__": "pow",
    "cross_entropy": "cross_entropy_loss",
    "grid_sample": "grid_sampler",
}


class NoKernelInDtype(RuntimeError):
    """An op that autocast gives a 16-bit tensor and that torch has no CUDA kernel for in that dtype (its FFTs take
    no bfloat16: aten/src/ATen/native/SpectralOps.cpp, `promote_type_fft`). `where`: the module and source line of
    the graph node that called it, where known."""

    def __init__(self, op: str, dtype: torch.dtype, message: str, where: str | None) -> None:
        self.op, self.dtype, self.message, self.where = op, dtype, message, where
        super().__init__(f"{op} takes no {dtype} ({message})")


def _node_here() -> str | None:
    """`module (Class) at file:line` of the captured graph's node whose generated code is running (the innermost
    fx GraphModule frame on the stack), else None."""
    frame = sys._getframe(1)
    while frame is not None and not frame.f_code.co_filename.startswith("<eval_with_key"):
        frame = frame.f_back
    module = frame.f_locals.get("self") if frame is not None else None
    lines = getattr(module, "_lineno_map", None)
    if frame is None or not lines:
        return None
    index = lines.get(frame.f_lineno - frame.f_code.co_firstlineno)
    nodes = list(module.graph.nodes)
    if index is None or index >= len(nodes):
        return None
    source = source_line(nodes[index].meta.get("stack_trace") or "")
    where = node_module(nodes[index])
    if source:
        where = f"{where} at {os.path.basename(source[0])}:{source[1]}".strip()
    return where or None


def _run(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> Any:
    """`func(*args, **kwargs)`; an op that refuses the 16-bit dtype autocast gave it raises NoKernelInDtype."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        text = str(exc)
        if not text.startswith("Unsupported dtype") or str(dtype).removeprefix("torch.").lower() not in text.lower():
            raise
        packet = getattr(func, "overloadpacket", None)
        if packet is not None:
            op = f"aten.{packet.__name__}"
        else:  # a torch function of a graph captured by symbolic tracing: torch._C._fft.fft_fftn is torch.fft.fftn
            name = getattr(func, "__name__", str(func))
            op = f"torch.{'fft.' + name.removeprefix('fft_') if name.startswith('fft_') else name}"
        raise NoKernelInDtype(op, dtype, text.strip().splitlines()[0], _node_here()) from None


def _floats(args: tuple, kwargs: dict) -> set[torch.dtype]:
    """The dtypes of the floating tensors autocast casts among `args` and `kwargs`."""
    return {t.dtype for t in tensor_leaves((args, kwargs)) if t.dtype in _ELIGIBLE}


def _widest(floats: set[torch.dtype]) -> torch.dtype | None:
    """The dtype autocast's promote policy casts to: fp32 beside any fp32 (or two 16-bit dtypes), else the one."""
    if not floats:
        return None
    return floats.pop() if len(floats) == 1 else torch.float32


def _first_is_eligible(args: tuple) -> bool:
    """Whether the first argument is a floating tensor autocast acts on (its `firstarg_is_eligible`)."""
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].dtype in _ELIGIBLE


def _given_dtype(args: tuple, kwargs: dict) -> bool:
    """Whether an op of FP32_SET_OPT_DTYPE was given its output dtype (by keyword, or by position)."""
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _positional(func: Any, args: tuple, kwargs: dict) -> tuple:
    """The positional arguments of the aten op `func`, those not given filled with their defaults."""
    schema = func._schema.arguments
    return tuple(
        args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        for i, a in enumerate(schema)
        if not a.kwarg_only
    )


def _autocast_call(
    func: Any, name: str, args: tuple, kwargs: dict, lower: torch.dtype
) -> tuple[Any, tuple, dict, torch.dtype | None]:
    """The call CUDA autocast makes of `func` (an aten op or a torch function named `name`) given `args` and
    `kwargs`: the op, its arguments, and the dtype its floating tensors are cast to (None: none cast)."""
    if func is _ASSERT_METADATA:
        values = _positional(func, args, kwargs)
        return func, (*values[:3], None), {k: v for k, v in kwargs.items() if k in ("device", "layout")}, None
    if name == "binary_cross_entropy":
        raise PlanError(
            "binary_cross_entropy (nn.BCELoss) refuses to run under CUDA autocast, so the model cannot train in "
            "bf16-mixed or fp16-mixed: use binary_cross_entropy_with_logits (nn.BCEWithLogitsLoss) on the logits"
        )
    if name in LOWER:
        return func, args, kwargs, lower
    if name in FP32:
        return func, args, kwargs, torch.float32
    if name in FP32_SET_OPT_DTYPE:
        if _first_is_eligible(args) and not _given_dtype(args, kwargs):
            kwargs = {**kwargs, "dtype": torch.float32}
        return func, args, kwargs, None
    if func in _APPEND_DTYPE and _first_is_eligible(args):
        return _APPEND_DTYPE[func], _positional(func, args, kwargs), {"dtype": torch.float32}, None
    if name in PROMOTE:
        return func, args, kwargs, _widest(_floats(args, kwargs))
    if name in _SAME_AS_SELF and args and isinstance(args[0], torch.Tensor) and args[0].dtype in _ELIGIBLE:
        # A captured graph's factories keep the dtype they had at capture (`zeros(..., dtype=x.dtype)` written
        # as float32), where autocast makes x 16-bit: the op that adds x into it took one dtype at capture.
        return func, args, kwargs, args[0].dtype
    return func, args, kwargs, None


class CudaAutocast(TorchDispatchMode):
    """While active, aten ops run as under `torch.autocast("cuda", dtype)`: see the module's docstring. Enter it
    above an OpRecorder (after it), so the recorder sees the casts and the ops as they run. The composites of the
    lists (COMPOSITE) are cast above autograd, as torch functions (`AutocastAbove`, entered with it), since their
    dispatch reaches this mode only in pieces.

    Autocast acts on the forward only: the backward's ops run in the dtypes of what they are given. There, enter
    `backward()`, which casts only the fp32 originals autograd saved where autocast saves their 16-bit copies (a
    16-bit product given one), to the copies the forward made."""

    def __init__(self, dtype: torch.dtype, casts: dict | None = None, *, in_backward: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.in_backward = in_backward
        self._casts: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {} if casts is None else casts
        self._above: list[AutocastAbove] = []  # the composites' casts, one per entry of the forward's mode

    def backward(self) -> CudaAutocast:
        """The same emulation for the backward, with the forward's casts."""
        return CudaAutocast(self.dtype, self._casts, in_backward=True)

    def __enter__(self) -> CudaAutocast:
        """Enter the mode, and in the forward the composites' casts above autograd."""
        if not self.in_backward:
            above = AutocastAbove(self.dtype, only=COMPOSITE)
            above.__enter__()
            self._above.append(above)
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Leave the mode and the composites' casts."""
        super().__exit__(exc_type, exc_val, exc_tb)
        if not self.in_backward:
            self._above.pop().__exit__(exc_type, exc_val, exc_tb)

    def _cast(self, t: Any, dtype: torch.dtype) -> Any:
        if not isinstance(t, torch.Tensor) or t.dtype not in _ELIGIBLE or t.dtype == dtype:
            return t
        key = (storage_key(t), t.storage_offset(), t.numel(), dtype)
        if key not in self._casts:
            # The kernel itself: below autograd, `Tensor.to` reaches the modes beneath as `to`, a view of nothing.
            # The source is kept, so its storage is not reused by another.
            self._casts[key] = (t, torch.ops.aten._to_copy.default(t, dtype=dtype))
        source, cast = self._casts[key]
        if t.shape == source.shape and t.stride() == source.stride():
            return cast
        # The same elements seen another way (a weight's transpose in the backward): the same view of the cast,
        # which keeps its source's strides.
        return cast.as_strided(t.shape, t.stride(), cast.storage_offset())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is KEPT_WHOLE and not self.in_backward:
            # A user's autograd Function kept whole: autocast casts inside its forward (YOSO's products), so its
            # ops run here again, beneath this mode.
            with self:
                return run_kept_whole(args, kwargs, autograd=False)
        name = func.overloadpacket.__name__
        if self.in_backward:
            target = self.dtype if name in LOWER and len(_floats(args, kwargs)) > 1 else None
        else:
            func, args, kwargs, target = _autocast_call(func, name, args, kwargs, self.dtype)
        if target is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, target), (args, kwargs))
        return _run(func, args, kwargs, self.dtype)


class AutocastAbove(TorchFunctionMode):
    """While active, the torch functions a model calls run as under `torch.autocast("cuda", dtype)`, with their
    inputs cast before autograd sees them, as autocast's dispatch key casts them: autograd then saves the 16-bit
    copies a product reads, not their fp32 originals, and a leaf tensor that requires grad (a weight) is cast once
    while the mode is active, as autocast caches it for its region. For the memory a mixed-precision forward holds
    (pyplan/profile/remat.py); the recorded kernels come from `CudaAutocast`. It sees the functions by the names
    of the same lists (`F.linear`, `torch.matmul`, `@`, `F.layer_norm`, ...), not the aten ops inside a torch
    function written in Python that calls others (`F.multi_head_attention_forward`: its products stay fp32).

    `only`: the names it casts (default: every name of the lists); torch.export's dtype checks are relaxed in any
    case."""

    def __init__(self, dtype: torch.dtype, *, only: frozenset[str] | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.only = only
        self._weights: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype not in _ELIGIBLE or t.dtype == dtype:
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(dtype)
        key = (id(t), dtype)
        if key not in self._weights:
            self._weights[key] = (t, t.to(dtype))  # the source kept, so that its id is not reused
        return self._weights[key][1]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is KEPT_WHOLE:
            with self:  # autocast casts inside a kept-whole Function's forward (as CudaAutocast)
                return run_kept_whole(args, kwargs, autograd=True)
        packet = getattr(func, "overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(func, "__name__", "")
        name = _FUNCTION_NAMES.get(name, name)
        if self.only is not None and name not in self.only and func is not _ASSERT_METADATA:
            return _run(func, args, kwargs, self.dtype)
        func, args, kwargs, target = _autocast_call(func, name, args, kwargs, self.dtype)
        if target is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, target), (args, kwargs))
        return _run(func, args, kwargs, self.dtype)
