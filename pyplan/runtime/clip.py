"""Gradient clipping over a model split across ranks: the norm of the whole model's gradient, as one process has it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["clip_gradients"]


def clip_gradients(grads: list[tuple[torch.Tensor, float]], max_norm: float) -> float:
    """Scale every gradient so that the norm of the whole model's gradient is at most `max_norm`, as
    `torch.nn.utils.clip_grad_norm_` does in one process (coefficient max_norm / (norm + 1e-6), at most 1); returns
    the norm before clipping.

    `grads` are this rank's gradients, each with the weight its square has in the sum over the world: 1 / dp for
    one held whole by every replica (DDP, ZeRO-1), 1 for a shard over the dp axis (ZeRO-3's DTensors), 0 for the
    copy of a tied weight that another pipeline rank already counts."""
    total = torch.zeros((), dtype=torch.float64)
    for g, weight in grads:
        if weight:
            local = g.to_local() if isinstance(g, DTensor) else g
            total += weight * torch.linalg.vector_norm(local, dtype=torch.float64).square().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1:
        on = total.to(grads[0][0].device if grads else torch.device("cpu"))
        dist.all_reduce(on)
        total = on.cpu()
    norm = float(total.sqrt())
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g, _ in grads:
            g.mul_(coef)
    return norm
