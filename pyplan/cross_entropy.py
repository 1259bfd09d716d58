"""Cross-entropy over many classes in fp32 at the logits' own memory: chunked, the gradient made in the backward.

A language model's logits are the largest tensor of its step (Llama 3's 128,256 classes at 4,096 tokens: 1.05 GB
in bf16 a sample). `torch.nn.functional.cross_entropy` keeps its log-softmax output for the backward and makes two
more tensors of that size there (the log-softmax's gradient and the logits'); on 16-bit logits it also computes
in 16 bits, so a training loop casts them to fp32 first (Megatron-LM, torchtitan) and every one of those tensors
doubles. This loss is what fused cross-entropy kernels do (flash-attn's `CrossEntropyLoss`, Megatron-LM's fused
vocabulary-parallel cross-entropy) in plain aten ops: the forward keeps only the logits (the model made them
anyway) and each row's log-sum-exp, the backward makes the gradient in the logits' dtype, and the fp32 work runs
over chunks of rows of at most `CHUNK_ELEMENTS`, so the fp32 copies never exceed one chunk. The arithmetic is
fp32 (fp64 for fp64 logits) whatever the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK_ELEMENTS", "fused_cross_entropy"]

# Elements of one chunk of rows computed in fp32 (128 MiB): 523 rows of Llama 3's 128,256 classes.
CHUNK_ELEMENTS = 1 << 25


def fused_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100, chunk_elements: int = CHUNK_ELEMENTS
) -> torch.Tensor:
    """The mean cross-entropy of `logits` (N, C) against class indices `target` (N,), rows whose target is
    `ignore_index` left out, as `torch.nn.functional.cross_entropy(logits.float(), target)` computes it (NaN when
    every row is left out), returned in fp32 (fp64 for fp64 logits); the logits' gradient is in their dtype."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"fused_cross_entropy takes logits (N, C) and targets (N,), not {list(logits.shape)} and "
            f"{list(target.shape)}"
        )
    if not logits.is_floating_point() or target.is_floating_point():
        raise TypeError(
            f"fused_cross_entropy takes floating logits and class indices, not {logits.dtype} and {target.dtype}"
        )
    rows = max(1, chunk_elements // max(1, logits.shape[1]))
    return _FusedCrossEntropy.apply(logits, target.long(), ignore_index, rows)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _logsumexp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """log-sum-exp of each row of `x` in `dtype`, in the kernels torch's GPU composite launches (the meta
    device's single kernel would allocate nothing), the shift made in `dtype` from `x` as it is (one pass that
    reads 16 bits and writes 32, not a copy and a shift)."""
    top = x.amax(dim=1, keepdim=True).to(dtype)  # the maximum is exact in any dtype
    top.masked_fill_(top.abs() == float("inf"), 0)
    return torch.sub(x, top).exp_().sum(dim=1).log_().add_(top.squeeze(1))


class _FusedCrossEntropy(torch.autograd.Function):
    """forward: lse[i] = logsumexp(x[i]), loss = sum over kept rows of (lse[i] - x[i, t[i]]) / kept;
    backward: dx[i] = (softmax(x[i]) - onehot(t[i])) · grad / kept for kept rows, 0 for the others, the softmax
    exp(x[i] - lse[i]) shifted from the logits as they are, the factor and the cast to their dtype in one pass."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, rows: int) -> torch.Tensor:
        dtype = _compute_dtype(logits.dtype)
        kept = target != ignore_index
        index = target.where(kept, 0).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            lse[start : start + rows] = _logsumexp(logits[start : start + rows], dtype)
        picked = logits.gather(1, index).squeeze(1).to(dtype)
        count = kept.sum()
        ctx.save_for_backward(logits, index, kept, lse, count)
        ctx.rows = rows
        return ((lse - picked) * kept).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, index, kept, lse, count = ctx.saved_tensors
        dtype = _compute_dtype(logits.dtype)
        scale = ((grad.to(dtype) / count) * kept).unsqueeze(1)  # each row's factor: 0 for the rows left out
        out = torch.empty_like(logits)
        minus_one = torch.full_like(index, -1, dtype=dtype)  # the one-hot target, subtracted row by row
        for start in range(0, logits.shape[0], ctx.rows):
            stop = start + ctx.rows
            p = torch.sub(logits[start:stop], lse[start:stop].unsqueeze(1)).exp_()
            p.scatter_add_(1, index[start:stop], minus_one[start:stop])
            torch.mul(p, scale[start:stop], out=out[start:stop])
            del p  # before the next chunk is made: one chunk at a time
        return out, None, None, None
