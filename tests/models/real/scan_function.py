"""A custom `torch.autograd.Function`: a linear recurrence h_t = a_t * h_(t-1) + x_t scanned in place over views of
its output, with a hand-written backward (as selective-scan and parallel-scan layers are written)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SEQ, DIM, LAYERS = 6, 16, 4


class Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.empty_like(x)
        h[:, 0] = x[:, 0]
        for t in range(1, x.shape[1]):
            h[:, t] = a[:, t] * h[:, t - 1] + x[:, t]
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, h = ctx.saved_tensors
        gx = torch.empty_like(grad)
        last = grad.shape[1] - 1
        gx[:, last] = grad[:, last]
        for t in range(last - 1, -1, -1):
            gx[:, t] = grad[:, t] + a[:, t + 1] * gx[:, t + 1]
        ga = torch.zeros_like(a)
        ga[:, 1:] = gx[:, 1:] * h[:, :-1]
        return ga, gx


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, DIM)
        self.inp = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(Scan.apply(torch.sigmoid(self.gate(x)), self.inp(x)))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    return Recurrent()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, 8),)
