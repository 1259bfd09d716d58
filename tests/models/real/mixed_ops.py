"""Ops CUDA autocast treats each its own way, on fp32 weights: convolutions with biases fed 16-bit maps, batch, group,
layer and RMS norms, an embedding bag, batched and added products, reductions, recurrences, and concatenations and
promoting ops of 16-bit and fp32 values. `exported` also reads back a dtype it converted, which torch.export asserts.

Every builder takes the same inputs: a batch of 3x8x8 images and of token rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, SIDE, VOCAB, TOKENS, WIDTH = 8, 8, 32, 6, 16


class Convs(nn.Module):
    """Convolutions with biases, the later ones given the 16-bit output of the first (through a BatchNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.bn = nn.BatchNorm2d(CHANNELS)
        self.second = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(CHANNELS, CHANNELS, 2, stride=2)
        self.rows = nn.Conv1d(CHANNELS, CHANNELS, 3, padding=1)
        self.volume = nn.Conv3d(1, 1, 3, padding=1)
        self.act = nn.PReLU()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.first(image)))
        x = self.up(self.second(x))  # (B, C, 2S, 2S)
        x = F.avg_pool2d(x, 2)
        b, c, h, w = x.shape
        x = self.rows(x.reshape(b, c, h * w)).reshape(b, c, h, w)
        x = self.volume(x.unsqueeze(1)).squeeze(1)
        return self.act(x)


class Norms(nn.Module):
    """Batch norm (in its input's dtype), then group, layer and RMS norms (in fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(CHANNELS)
        self.gn = nn.GroupNorm(2, CHANNELS)
        self.ln = nn.LayerNorm([CHANNELS, SIDE, SIDE])
        self.rms = nn.RMSNorm(SIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms(self.ln(self.gn(self.bn(x))))


class Products(nn.Module):
    """The feature maps and a bag of token embeddings through addmm, bmm, baddbmm and einsum."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, WIDTH, mode="mean")
        self.proj = nn.Parameter(torch.randn(CHANNELS * SIDE * SIDE, WIDTH) * 0.02)
        self.bias = nn.Parameter(torch.zeros(WIDTH))
        self.mix = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.1)

    def forward(self, maps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        bag = self.bag(tokens)  # (B, W), fp32: embedding_bag is in no list
        feats = torch.addmm(self.bias, maps.flatten(1), self.proj)  # (B, W), 16-bit
        pair = torch.stack([feats, bag], 1)  # (B, 2, W): stack promotes to fp32 by itself
        square = torch.bmm(pair.transpose(1, 2), pair)  # (B, W, W)
        square = torch.baddbmm(square, pair.transpose(1, 2), pair, alpha=0.5)
        return torch.einsum("bij,jk->bik", square, self.mix)


class Reductions(nn.Module):
    """Softmax, log-softmax, sums, norms and the promoting ops of AT_FORALL_PROMOTE on a 16-bit product."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, square: torch.Tensor) -> torch.Tensor:
        g = self.gate(square)  # (B, W, W), 16-bit
        p = torch.softmax(g, -1) + F.log_softmax(g, -1).exp()
        s = g.sum(-1, keepdim=True) + torch.cumsum(g, -1) + torch.logsumexp(g, -1, keepdim=True)
        n = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
        mixed = torch.cat([g, p], -1)[..., :WIDTH]  # cat promotes to fp32 by itself
        mixed = torch.addcmul(mixed, g, p) + torch.atan2(g, s)
        index = torch.zeros_like(g, dtype=torch.long)
        mixed = mixed.scatter_add(-1, index, g)
        return mixed / (1 + n)


class Recurrent(nn.Module):
    """An LSTM over the rows of a square, then a GRU cell: on a GPU both run in the 16-bit dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.cell = nn.GRUCell(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, square: torch.Tensor) -> torch.Tensor:
        rows, _ = self.lstm(square)
        h = self.cell(rows[:, -1], rows[:, 0])
        return self.head(h)


class MixedOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = Convs()
        self.norms = Norms()
        self.products = Products()
        self.reductions = Reductions()
        self.recurrent = Recurrent()

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        maps = self.norms(self.convs(image))
        return self.recurrent(self.reductions(self.products(maps, tokens)))


class Exported(nn.Module):
    """A norm computed in fp32 as Hugging Face models write it (`x.to(torch.float32)`), behind a branch on a size
    that only torch.export captures: its graph asserts the fp32 dtype the capture saw, where autocast gives bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, CHANNELS, 3, padding=1)
        self.scale = nn.Parameter(torch.ones(CHANNELS * SIDE * SIDE))
        self.head = nn.Linear(CHANNELS * SIDE * SIDE, 4)

    def forward(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = self.conv(image).flatten(1)
        if x.shape[-1] > 1:
            x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head((self.scale * x).to(self.head.weight.dtype)) + tokens.float().mean(-1, keepdim=True)


def model() -> nn.Module:
    return MixedOps()


def exported() -> nn.Module:
    return Exported()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, SIDE, SIDE), torch.randint(0, VOCAB, (batch_size, TOKENS))
