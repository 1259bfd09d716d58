"""Attention as the target GPU runs it: the fused kernel torch would select there, not the meta device's math path.

`F.scaled_dot_product_attention` picks its kernel at run time from the device, the dtype and the shapes. On the
meta device (and on fake CPU tensors) it takes the math path, which materializes the (B, H, Tq, Tk) scores and
probabilities and saves them for backward; on a GPU the flash or memory-efficient kernel saves Q, K, V, the output
and the log-sum-exp only, and its backward recomputes the scores. `TargetAttention` intercepts each call while a
profile records FLOPs, bytes and saved tensors, and runs the kernel the target would select as its explicit aten
op (`_scaled_dot_product_flash_attention`, `_scaled_dot_product_efficient_attention`), whose meta kernel and
autograd formula save exactly what the GPU kernel saves.

The selection follows torch's `select_sdp_backend` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
read at the torch 2.11-2.13 sources): in priority order
- flash: no attention mask; q, k, v of one head size of at most 256; an sm80-sm121 GPU; fp16 or bf16; training
  with a head size in (192, 224], or in (224, 256] with dropout, is refused on sm86-sm89 and sm120-sm121; causal
  only where the query and key lengths agree. Grouped-query attention runs natively (fewer K and V heads).
- memory-efficient: an sm50-sm121 GPU; fp16, fp32 (and bf16 on sm80+); head sizes divisible by the GEMM alignment
  (sm80+: 8 in fp16/bf16, 4 in fp32; sm70-sm75: 8 in fp16, 1 in fp32; below: 1). It takes a mask as an additive
  bias: a boolean mask becomes a float tensor of the query's dtype, which it saves.
- math: anything else, as on the meta device.
cuDNN attention, which torch 2.9+ prefers on sm90/sm100 with cuDNN 9.15+, saves and computes what flash does
(Q, K, V, the output and the softmax statistics), so it is priced as flash. AMD GPUs (gfx targets) run flash and
memory-efficient attention through AOTriton with the same rule, without grouped-query support in the efficient
kernel. A CPU target is left to torch itself (the tensors are on the CPU already).

Where a model computes attention by hand (matmul, softmax, matmul), nothing is intercepted: the GPU runs it
unfused too.

Dropout is the other op whose kernel differs by device: on a GPU `F.dropout` runs the fused `native_dropout`,
which saves a one-byte boolean mask; anywhere else (the meta device, the CPU) it multiplies by a noise tensor of
the input's dtype, which it saves: four bytes an element in fp32. While `TargetKernels` is active, dropout in
training runs `native_dropout` as on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from pyplan._torch import is_real
from pyplan.graph.masks import SDPA_TARGETS, sdpa_arguments

__all__ = [
    "FLASH_TILE",
    "AttentionTarget",
    "TargetKernels",
    "causal_fraction",
    "fused_work",
    "select_backend",
]

# The query and key tile of the flash kernels (FlashAttention-2, Dao 2023, §3.3: blocks of 64-128): a causal
# attention computes the tiles on and below the diagonal.
FLASH_TILE = 128
_HALF = ("float16", "bfloat16")


def causal_fraction(q_len: int, k_len: int) -> float:
    """The share of the full Tq x Tk tiles a causal fused kernel computes: n(n+1)/2 of n² tiles, n = ⌈T/128⌉."""
    if q_len != k_len or q_len <= 0:
        return 1.0
    n = math.ceil(q_len / FLASH_TILE)
    return (n + 1) / (2 * n)


@dataclass(frozen=True)
class AttentionTarget:
    """The device attention is priced for: `arch` "smXY" (NVIDIA) or "gfxNNN" (AMD), and the dtype the attention
    computes in (under mixed precision the compute dtype, whatever the profiled tensors hold)."""

    arch: str
    dtype: str | None = None

    @property
    def vendor(self) -> str:
        return "amd" if self.arch.startswith("gfx") else "nvidia"

    @property
    def sm(self) -> int:
        """The compute capability as an integer (sm80 -> 80); 0 for an AMD GPU."""
        return int(self.arch[2:]) if self.vendor == "nvidia" else 0


def _gemm_alignment(sm: int, half: bool) -> int:
    """`minimum_gemm_alignment` of sdp_utils.cpp: the head size the efficient kernel's GEMMs need a multiple of."""
    tensor_cores = sm >= 80 or (sm >= 70 and half)
    align = 4 if sm >= 80 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def select_backend(
    target: AttentionTarget,
    *,
    dtype: str,
    head_dims: tuple[int, int, int],
    q_len: int,
    k_len: int,
    has_mask: bool,
    is_causal: bool,
    dropout: float,
    gqa: bool,
    training: bool = True,
) -> str:
    """ "flash", "efficient" or "math": the kernel torch would run this attention with on `target`."""
    dq, dk, dv = head_dims
    half = dtype in _HALF
    same = dq == dk == dv
    if target.vendor == "amd":
        if not has_mask and half and same and dq <= 256 and not (is_causal and q_len != k_len):
            return "flash"
        if same and dq % (8 if half else 4) == 0 and not gqa and dtype in ("float16", "bfloat16", "float32"):
            return "efficient"
        return "math"
    sm = target.sm
    flash = not has_mask and same and dq <= 256 and 80 <= sm <= 121 and half and not (is_causal and q_len != k_len)
    if flash and training and (86 <= sm <= 89 or 120 <= sm <= 121):
        flash = dq <= 192 or (dropout == 0.0 and dq > 224)
    if flash:
        return "flash"
    dtypes = ("float16", "float32", "bfloat16") if sm >= 80 else ("float16", "float32")
    align = _gemm_alignment(sm, half)
    if 50 <= sm <= 121 and dtype in dtypes and dq == dk and dq % align == 0 and dv % align == 0:
        return "efficient"
    return "math"


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


_DROPOUT = (torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default)


class TargetKernels(TorchFunctionMode):
    """While active, every `scaled_dot_product_attention` call runs the kernel `target` would select, and dropout
    the GPU's fused kernel.

    `chosen` counts the attention kernels used, by name: what a profile reports as the attention it priced."""

    def __init__(self, target: AttentionTarget) -> None:
        super().__init__()
        self.target = target
        self.chosen: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUT:
            return self._dropout(func, args, kwargs)
        if func not in SDPA_TARGETS:
            return func(*args, **kwargs)
        a = sdpa_arguments(args, kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return func(*args, **kwargs)  # unbatched or nested inputs: as torch runs them
        if is_real(q) and q.device.type != "cuda":
            # A model whose forward reads values runs for real on this host (pyplan._torch.run_without_compute),
            # where the GPU's kernels do not exist: torch's CPU kernel, its fused one where it applies (FLOPs and
            # saved tensors as the GPU's flash kernel: pyplan._torch's _FLOP_ALIASES).
            return func(*args, **kwargs)
        gqa = bool(a["enable_gqa"]) and q.shape[1] != k.shape[1]
        dtype = self.target.dtype or str(q.dtype).removeprefix("torch.")
        kind = select_backend(
            self.target,
            dtype=dtype,
            head_dims=(q.shape[-1], k.shape[-1], v.shape[-1]),
            q_len=q.shape[-2],
            k_len=k.shape[-2],
            has_mask=mask is not None,
            is_causal=bool(a["is_causal"]),
            dropout=float(a["dropout_p"]),
            gqa=gqa,
            training=torch.is_grad_enabled(),
        )
        self.chosen[kind] = self.chosen.get(kind, 0) + 1
        if kind == "math":
            return func(*args, **kwargs)
        return self._fused(kind, q, k, v, mask, a, gqa)  # (a mode is off inside its own handler)

    @staticmethod
    def _dropout(func: Any, args: tuple, kwargs: dict) -> Any:
        names = (
            ("input", "p", "training", "inplace") if func is torch.nn.functional.dropout else ("input", "p", "train")
        )
        named = {**dict(zip(names, args)), **kwargs}
        x, p = named["input"], float(named.get("p", 0.5))
        training = bool(named.get("training", named.get("train", True)))
        if not training or not 0 < p < 1 or named.get("inplace") or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)
        return torch.ops.aten.native_dropout(x, p, True)[0]

    @staticmethod
    def _fused(kind: str, q: Any, k: Any, v: Any, mask: Any, a: dict[str, Any], gqa: bool) -> Any:
        dropout, causal, scale = float(a["dropout_p"]), bool(a["is_causal"]), a["scale"]
        if kind == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        if gqa:  # the efficient kernel takes as many K and V heads as queries
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        bias = mask
        if mask is not None and mask.dtype == torch.bool:
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        lse = q.requires_grad or k.requires_grad or v.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, lse, dropout, causal, scale=scale)[
            0
        ]


def fused_work(func: Any, args: tuple, kwargs: dict) -> float:
    """The share of its counted FLOPs a fused attention op computes: `causal_fraction` where it is causal, else 1
    (an `OpRecorder` flop_scale; torch's FLOP formulas count the full Tq x Tk for causal kernels too)."""
    schema = getattr(func, "_schema", None)
    if schema is None or "attention" not in func.overloadpacket.__name__:
        return 1.0
    named = {arg.name: value for arg, value in zip(schema.arguments, args)}
    named.update(kwargs)
    query, key = named.get("query"), named.get("key")
    if not named.get("is_causal") or not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return 1.0
    return causal_fraction(int(query.shape[-2]), int(key.shape[-2]))
