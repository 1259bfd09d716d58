"""Layers that flatten batch and sequence into one dimension of tokens (`x.reshape(-1, d)`), work on the tokens and
view them back with the batch size read at the top of the model: between the layers' pieces no value has the batch
first. Called with a keyword input, so torch.export captures it."""

from __future__ import annotations

import torch
from torch import nn

SEQ, DIM, LAYERS = 6, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        h = torch.relu(self.fc(x.reshape(-1, DIM)))
        return self.fc2(h).view(batch, -1, DIM)


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, batch)
        return self.out(h.reshape(-1, DIM)).view(batch, SEQ, 3)


def model() -> nn.Module:
    return Tokens()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch_size, SEQ, 8)}
