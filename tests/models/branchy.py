"""A plain-torch model torch.fx cannot trace: keyword inputs, a None check, branches on shapes and dtypes, and a
dict output. pyplan captures it with torch.export."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, LAYERS = 64, 12, 32, 3


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.norm(h)
        if mask is not None:  # a None check
            x = x * mask.unsqueeze(-1).to(x.dtype)  # a dtype taken from a tensor
        if x.shape[1] > 1:  # a branch on a shape: fx cannot follow it
            x = x + torch.cumsum(self.mix(x), dim=1) / x.shape[1]
        return h + self.ff(x)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        if h.dtype != self.head.weight.dtype:
            h = h.to(self.head.weight.dtype)
        for layer in self.layers:
            h = layer(h, attention_mask)
        return {"logits": self.head(h)}


def model() -> nn.Module:
    return Branchy()


def _draw(b: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ + 1), generator=torch.Generator().manual_seed(0))


def example_inputs(b: int) -> dict[str, torch.Tensor]:
    lengths = torch.arange(b) % SEQ + SEQ // 2
    mask = (torch.arange(SEQ)[None, :] < lengths.clamp(max=SEQ)[:, None]).long()
    return {"input_ids": _draw(b)[:, :-1].contiguous(), "attention_mask": mask}


def target(b: int) -> torch.Tensor:
    return _draw(b)[:, 1:].contiguous()


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
