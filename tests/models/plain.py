"""Plain PyTorch models as users write them, one builder each over the same input: an in-place activation, a
recurrent layer and torch's own transformer encoder. Load one as `tests/models/plain.py:NAME`."""

from __future__ import annotations

import torch
from torch import nn

SEQ, DIM = 5, 8


class _LastStep(nn.Module):
    """An LSTM whose last step feeds a head: its output is a tuple, of which the model keeps one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(DIM, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def relu_inplace() -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, DIM), nn.ReLU(inplace=True), nn.Linear(DIM, DIM), nn.ReLU(inplace=True), nn.Linear(DIM, 4)
    )


def lstm() -> nn.Module:
    return _LastStep()


def transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(DIM, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, SEQ, DIM),)
