"""A mixture of experts routed as JetMoE routes it: the tokens per expert read off the router's choice
(`.tolist()`) size the split of the tokens, whose expert outputs are added back with `index_add` into zeros made
in the outputs' dtype; attention before it. A model on the meta device has no values to read, so a plan on a
catalog GPU builds it with weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS, EXPERTS, LAYERS = 32, 8, 16, 2, 4, 3


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, DIM)
        choice = self.router(flat).argmax(-1)
        order = choice.argsort()
        hits = torch.zeros(flat.shape[0], EXPERTS, dtype=flat.dtype, device=flat.device).scatter(1, choice[:, None], 1)
        sizes = hits.long().sum(0).tolist()
        outs = [e(x) for e, x in zip(self.experts, flat[order].split(sizes))]
        out = torch.cat(outs)
        zeros = torch.zeros(flat.shape, dtype=out.dtype, device=out.device)
        return h + zeros.index_add(0, order, out).reshape(h.shape)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.moe = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        return self.moe(h)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def model() -> nn.Module:
    return Routed()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, VOCAB, (batch_size, SEQ))}
