"""CUDA autocast's casts on the tensors the analytic profile records ops on, which torch's autocast never sees.

A plan in bf16-mixed or fp16-mixed trains under `torch.autocast("cuda")`: matrix products and attention compute in
16 bits on 16-bit copies of their inputs (weights included), norms, softmaxes, reductions and losses in fp32, and
every other op in the widest dtype of its inputs, so the residual stream of a pre-norm transformer stays fp32. The
analytic profile runs on meta or fake tensors, where autocast does nothing (it acts on CUDA tensors, and is off on
a machine without CUDA). `CudaAutocast` applies the same policy below autograd: the lists of ATen's CUDA autocast
kernels (aten/src/ATen/autocast_mode.h, torch 2.13: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), by the names of the aten ops those composites reach. Each cast is
the `_to_copy` kernel autocast launches; a tensor is cast once per recording (autocast
saves its 16-bit copies for the backward; here autograd saves the originals, and the backward finds their casts
made). The backward runs without autocast, as it does in training (`CudaAutocast.backward`); autograd casts each
gradient to the dtype of its tensor, as under autocast.

Below autograd, autograd saves the fp32 originals: right for the kernels a step launches, not for the memory it
holds. `AutocastAbove` applies the same lists above autograd, to the torch functions a model calls, as autocast's
dispatch key does: the products save their 16-bit copies, a weight's copy lives until the backward, and the memory
profile of a mixed-precision plan (pyplan/profile/remat.py) is recorded under it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pyplan._torch import TorchDispatchMode, storage_key, tensor_leaves, tree_map_only

__all__ = ["AutocastAbove", "CudaAutocast"]

# Ops that compute in the 16-bit dtype (AT_FORALL_LOWER_PRECISION_FP), with the aten ops their composites reach on
# a GPU (the fused attention kernels; a convolution's backward, whose saved inputs are the fp32 originals here).
LOWER = frozenset(
    {
        "_convolution", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
        "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d", "conv2d", "conv3d",
        "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution", "einsum", "gru_cell",
        "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_relu_cell",
        "rnn_tanh_cell", "scaled_dot_product_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "convolution_backward",
    }
)  # fmt: skip
# Ops that compute in fp32 (AT_FORALL_FP32, and AT_FORALL_FP32_SET_OPT_DTYPE, whose ops autocast runs with an fp32
# output dtype), with the aten ops they reach.
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
        "cumprod", "cumsum", "linalg_matrix_norm", "linalg_vector_norm", "log_softmax", "prod", "softmax", "sum",
        "_softmax", "_log_softmax", "native_group_norm", "_fused_rms_norm", "nll_loss_forward",
        "nll_loss2d_forward", "cross_entropy_loss",
    }
)  # fmt: skip
# Ops that compute in the widest floating dtype of their inputs (AT_FORALL_PROMOTE).
PROMOTE = frozenset(
    {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
     "tensordot", "vdot"}
)  # fmt: skip
_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64 alone


class CudaAutocast(TorchDispatchMode):
    """While active, aten ops run as under `torch.autocast("cuda", dtype)`: see the module's docstring. Enter it
    above an OpRecorder (after it), so the recorder sees the casts and the ops as they run.

    Autocast acts on the forward only: the backward's ops run in the dtypes of what they are given. There, enter
    `backward()`, which casts only the fp32 originals autograd saved where autocast saves their 16-bit copies (a
    16-bit product given one), to the copies the forward made."""

    def __init__(self, dtype: torch.dtype, casts: dict | None = None, *, in_backward: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        self.in_backward = in_backward
        self._casts: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {} if casts is None else casts

    def backward(self) -> CudaAutocast:
        """The same emulation for the backward, with the forward's casts."""
        return CudaAutocast(self.dtype, self._casts, in_backward=True)

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
        name = func.overloadpacket.__name__

        def floats() -> set[torch.dtype]:
            return {t.dtype for t in tensor_leaves((args, kwargs)) if t.dtype in _ELIGIBLE}

        if self.in_backward:
            target: torch.dtype | None = self.dtype if name in LOWER and len(floats()) > 1 else None
        elif name in LOWER:
            target = self.dtype
        elif name in FP32 and kwargs.get("dtype") is None:  # an op given its dtype runs as asked
            target = torch.float32
        elif name in PROMOTE:
            target = max(floats(), key=lambda d: torch.finfo(d).bits, default=None)
        else:
            target = None
        if target is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, target), (args, kwargs))
        return func(*args, **kwargs)


# Torch functions whose names differ from the aten ops of the lists.
_FUNCTION_NAMES = {"__matmul__": "matmul", "__rmatmul__": "matmul"}


class AutocastAbove(TorchFunctionMode):
    """While active, the torch functions a model calls run as under `torch.autocast("cuda", dtype)`, with their
    inputs cast before autograd sees them, as autocast's dispatch key casts them: autograd then saves the 16-bit
    copies a product reads, not their fp32 originals, and a leaf tensor that requires grad (a weight) is cast once
    while the mode is active, as autocast caches it for its region. For the memory a mixed-precision forward holds
    (pyplan/profile/remat.py); the recorded kernels come from `CudaAutocast`. It sees the functions by the names
    of the same lists (`F.linear`, `torch.matmul`, `@`, `F.layer_norm`, ...), not the aten ops inside a torch
    function written in Python that calls others (`F.multi_head_attention_forward`: its products stay fp32)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
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
        packet = getattr(func, "overloadpacket", None)
        name = packet.__name__ if packet is not None else getattr(func, "__name__", "")
        name = _FUNCTION_NAMES.get(name, name)
        if name in LOWER:
            target: torch.dtype | None = self.dtype
        elif name in FP32 and kwargs.get("dtype") is None:
            target = torch.float32
        elif name in PROMOTE:
            floats = {t.dtype for t in tensor_leaves((args, kwargs)) if t.dtype in _ELIGIBLE}
            target = max(floats, key=lambda d: torch.finfo(d).bits, default=None)
        else:
            target = None
        if target is not None:
            args, kwargs = tree_map_only(torch.Tensor, lambda t: self._cast(t, target), (args, kwargs))
        return func(*args, **kwargs)
