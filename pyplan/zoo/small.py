"""Tiny models for fast tests: two MLPs (one of parallel branches) and small configurations of ResNet, VGG, GPT.

The CNNs take CIFAR-10-shaped input (3x32x32, 10 classes).
"""

from __future__ import annotations

import torch
from torch import nn

from pyplan.zoo.resnet import BasicBlock, ResNet
from pyplan.zoo.transformer import GPT, GPTConfig
from pyplan.zoo.vgg import VGG

__all__ = [
    "GPT_TINY",
    "MLP_CLASSES",
    "MLP_FEATURES",
    "GroupedMLP",
    "gpt_tiny",
    "grouped_mlp_tiny",
    "mlp_tiny",
    "resnet_tiny",
    "vgg_tiny",
]

MLP_FEATURES = 32
MLP_CLASSES = 10
# No dropout in the tiny models: tests compare pipelined and single-process runs, which must be deterministic.
GPT_TINY = GPTConfig(vocab_size=256, n_ctx=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0)


def mlp_tiny() -> nn.Sequential:
    """Three Linear layers with ReLUs between: MLP_FEATURES -> 64 -> 64 -> MLP_CLASSES."""
    return nn.Sequential(
        nn.Linear(MLP_FEATURES, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.ReLU(),
        nn.Linear(64, MLP_CLASSES),
    )


class GroupedMLP(nn.Module):
    """A stem, its features split into `groups` parallel branches of `depth` Linear+ReLU layers, joined, a head.

    `torch.chunk` returns a tuple, and the branches index it one after another, so the tuple stays live across
    every branch but the last: no pipeline cut can fall between those branches (a stage sends only single
    tensors), and linearization leaves them in one block. Assigning the graph's nodes to stages one by one
    (pyplan.solve.dag_search) splits them.
    """

    def __init__(self, features: int, width: int, groups: int, depth: int, classes: int) -> None:
        super().__init__()
        self.groups = groups
        self.stem = nn.Linear(features, width)
        self.branches = nn.ModuleList(
            nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width // groups, width // groups), nn.ReLU())])
            for _ in range(groups)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.chunk(torch.relu(self.stem(x)), self.groups, dim=1)
        return self.head(torch.cat([branch(parts[i]) for i, branch in enumerate(self.branches)], dim=1))


def grouped_mlp_tiny() -> GroupedMLP:
    """GroupedMLP: MLP_FEATURES -> 128, 8 branches of 2 Linear(16, 16) layers, 128 -> MLP_CLASSES."""
    return GroupedMLP(MLP_FEATURES, 128, groups=8, depth=2, classes=MLP_CLASSES)


def resnet_tiny() -> ResNet:
    """CIFAR-stem ResNet, one BasicBlock per stage (16, 32, 48 channels); stages 2 and 3 have projections."""
    return ResNet(BasicBlock, (1, 1, 1), num_classes=10, widths=(16, 32, 48), small_input=True)


def vgg_tiny() -> VGG:
    """Conv+ReLU+pool x3 (16, 32, 64 channels), 2x2 average pool, Linear(256, 32), Linear(32, 10)."""
    return VGG((16, "M", 32, "M", 64, "M"), num_classes=10, pool_size=2, hidden=(32,), dropout=0.0)


def gpt_tiny() -> GPT:
    """GPT-2 structure at 2 layers, width 64, 4 heads, vocabulary 256, context 32."""
    return GPT(GPT_TINY)
