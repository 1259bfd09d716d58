"""Attention written as nanoGPT writes it: `sdpa(...).transpose(1, 2).contiguous().view(B, T, C)`, a view that is
valid only on the contiguous copy. Its forward asserts on a size, as nanoGPT's does, so torch.export captures
it (and drops the `contiguous` that was a no-op on the capture's strides)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 8, 32, 4, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(self.ln(x)).split(C, dim=2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return x + self.proj(y)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Attention() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert idx.size(1) <= SEQ, f"cannot forward a sequence of {idx.size(1)} tokens"  # fx cannot trace it
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    return TinyGPT()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)
