"""A forward that checks a value it reads off its input, as XLM's does (`assert lengths.max().item() <= slen`):
torch.export keeps the check as a runtime assertion on the value, which no run on meta tensors can read."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 20, 5, 8, 3


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        slen = ids.size(1)
        lengths = (ids != 0).sum(dim=1).long()
        assert lengths.max().item() <= slen
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h.sum(1)


def model() -> nn.Module:
    return Checked()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    # Keyword inputs: captured by torch.export.
    return {"ids": torch.randint(1, VOCAB, (batch_size, SEQ))}
