"""A model that computes its own loss as nanoGPT's does: `forward(idx, targets=None)` returns `(logits, loss)`, the
loss `None` without targets. It prints while it is built, as many models do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 64, 8, 32, 4


class LossGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM), nn.GELU()) for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB)
        print(f"number of parameters: {sum(p.numel() for p in self.parameters())}")

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def model() -> nn.Module:
    return LossGPT()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets: the model returns its loss second."""
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def logits_only(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)
