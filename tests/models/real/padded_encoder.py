"""torch's own `nn.TransformerEncoder` (batch first) called with a padding mask, between an embedding and a head."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 100, 12, 32, 6


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, LAYERS)
        self.head = nn.Linear(DIM, 5)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=padding).mean(1))


def model() -> nn.Module:
    return Encoder()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    padding = torch.zeros(batch_size, SEQ, dtype=torch.bool)
    padding[:, SEQ - 3 :] = True
    return torch.randint(0, VOCAB, (batch_size, SEQ)), padding
