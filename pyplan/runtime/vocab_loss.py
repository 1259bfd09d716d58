"""The cross-entropy loss on each tensor-parallel rank's slice of the vocabulary (the output layer split by its
classes), and one rank's share of it as the plan records it. It reads no DTensor, so that planning does not load
torch.distributed.tensor (pyplan.runtime.tensor_parallel applies the rest of tensor parallelism)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VocabParallelLoss", "vocab_slice_loss"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (N, V) logits held as each rank's (N, V/t) slice of the classes, `start` its first
    class: three all-reduces of N numbers (the max, the sum of exponentials, the target's logit) instead of the
    logits gathered; the softmax slice is what the backward keeps (Megatron-LM's vocab_parallel_cross_entropy).
    Targets of -100 count for nothing, as F.cross_entropy's `ignore_index`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None, start: int
    ) -> torch.Tensor:
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # in fp32 under autocast, as F.cross_entropy
        top = x.detach().amax(dim=-1)
        if group is not None:  # (None: one rank's ops alone, as the plan records them; pyplan.profile.loss)
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = (x - top[:, None]).exp_()
        total = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(total, group=group)
        valid = target != -100
        local = target - start
        mine = valid & (local >= 0) & (local < x.shape[-1])
        index = local.clamp(0, x.shape[-1] - 1)[:, None]
        picked = torch.where(mine, x.gather(-1, index).squeeze(-1) - top, 0.0)
        if group is not None:
            dist.all_reduce(picked, group=group)
        count = valid.sum()
        loss = torch.where(valid, total.log() - picked, 0.0).sum() / count
        exp.div_(total[:, None])  # the softmax slice
        ctx.save_for_backward(exp, index, mine, valid, count)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        softmax, index, mine, valid, count = ctx.saved_tensors
        softmax.scatter_add_(-1, index, -mine[:, None].to(softmax.dtype))
        softmax.mul_((valid.to(softmax.dtype) * grad / count)[:, None])
        return softmax.to(ctx.dtype), None, None, None


def vocab_slice_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One rank's share of `VocabParallelLoss` on its slice of the logits, without the collectives: the ops and
    storages the plan records for it (its values are not the loss)."""
    return _VocabParallelCrossEntropy.apply(output.flatten(0, -2), target.flatten(), None, 0)


class VocabParallelLoss:
    """`pyplan.spec.cross_entropy` on each rank's slice of the logits along the last dimension (the output layer's
    outputs split over `mesh`, contiguous slices in rank order): the loss one process computes on the whole logits,
    on every rank of the mesh (`pyplan.graph.tensor_parallel.vocab_parallel_loss` says when it applies)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.rank = mesh.get_group(), mesh.get_local_rank()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.flatten(0, -2)
        start = self.rank * logits.shape[-1]
        return _VocabParallelCrossEntropy.apply(logits, target.flatten().to(logits.device), self.group, start)
