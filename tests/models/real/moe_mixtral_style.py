"""A Mixtral-style mixture of experts: each token's top 2 of 8 SwiGLU experts chosen by a softmax router and their
weights renormalized over the two; pre-norm attention before it. The experts are a ModuleList of MLPs called in a
loop, every expert over every token weighted by the router's choice (no branch on values: the model captures as
written), behind one module called as `experts(hidden, index, weights)`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS, FFN, LAYERS = 64, 8, 32, 4, 48, 2
EXPERTS, TOP_K = 8, 2


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(dim, ffn, bias=False)
        self.w_up = nn.Linear(dim, ffn, bias=False)
        self.w_down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Experts(nn.Module):
    """Routed experts: token t's output is the sum over its choices k of weights[t, k] · mlps[index[t, k]](t)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlps = nn.ModuleList(SwiGLU(DIM, FFN) for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, mlp in enumerate(self.mlps):
            share = (weights * (index == e)).sum(-1, keepdim=True)
            out = out + share * mlp(hidden)
        return out


class SparseMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, DIM)
        probs = self.gate(flat).softmax(dim=-1)
        weights, index = torch.topk(probs, TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(flat, index, weights).reshape(h.shape)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.moe_norm = nn.LayerNorm(DIM)
        self.moe = SparseMoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        h = h + self.proj(attn)
        return h + self.moe(self.moe_norm(h))


class MixtralStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def model() -> nn.Module:
    return MixtralStyle()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0)),)


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
