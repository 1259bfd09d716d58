"""A DeepSeek-style mixture of experts: a shared expert beside 16 small routed experts, 4 per token. Sigmoid scores
choose them with a load-balancing bias added for the choice only; the chosen experts' weights are their unbiased
scores, normalized over the four. The routed experts' weights are grouped in 3-D parameters (expert, in, out), every
expert computed over every token and weighted by the choice. The first layer's feed-forward is dense, as DeepSeek's
first layers are. Called with keyword inputs, so it is captured with torch.export."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, DIM, HEADS, LAYERS, DENSE_LAYERS = 64, 8, 32, 4, 3, 1
EXPERTS, TOP_K, EXPERT_FFN, SHARED_FFN = 16, 4, 16, 32


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts whose weights are stacked along a first dimension of experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * EXPERT_FFN) * DIM**-0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, EXPERT_FFN, DIM) * EXPERT_FFN**-0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        # (tokens, experts): each token's weight for every expert, zero for those not chosen.
        dense = weights.new_zeros(hidden.shape[0], self.gate_up.shape[0]).scatter_add(1, index, weights)
        gate, up = torch.matmul(hidden.unsqueeze(0), self.gate_up).chunk(2, dim=-1)
        out = torch.matmul(F.silu(gate) * up, self.down)  # (experts, tokens, dim)
        return (dense.t().unsqueeze(-1) * out).sum(0)


class DeepSeekMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.register_buffer("choice_bias", torch.linspace(-0.01, 0.01, EXPERTS))
        self.experts = GroupedExperts()
        self.shared_expert = SwiGLU(DIM, SHARED_FFN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, DIM)
        scores = torch.sigmoid(self.gate(flat))
        index = torch.topk(scores + self.choice_bias, TOP_K, dim=-1).indices
        weights = scores.gather(1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(flat, index, weights) + self.shared_expert(flat)
        return out.reshape(h.shape)


class Layer(nn.Module):
    def __init__(self, dense: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = SwiGLU(DIM, 2 * SHARED_FFN) if dense else DeepSeekMoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        h = h + self.proj(attn)
        return h + self.mlp(self.mlp_norm(h))


class DeepSeekStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(dense=i < DENSE_LAYERS) for i in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def model() -> nn.Module:
    return DeepSeekStyle()


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(0))}


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
