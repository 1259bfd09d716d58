"""A small GPT with a padding mask passed to every layer: a mask that rides across every pipeline cut."""

import math

import torch
from torch import nn

VOCAB, SEQ, DIM, HEADS, LAYERS = 512, 64, 128, 4, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.register_buffer("causal", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(DIM, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        # Attend to earlier positions that are not padding.
        allowed = self.causal[:t, :t] & keep[:, None, None, :]
        att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings

    def forward(self, idx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for layer in self.layers:
            x = layer(x, keep)
        return self.head(self.ln(x))


def model() -> nn.Module:
    return GPT()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch_size,), generator=g)
    keep = torch.arange(SEQ)[None, :] < lengths[:, None]
    return idx, keep


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())
