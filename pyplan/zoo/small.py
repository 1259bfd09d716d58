"""Tiny models for fast tests: an MLP, and small configurations of the zoo's ResNet, VGG and GPT.

The CNNs take CIFAR-10-shaped input (3x32x32, 10 classes).
"""

from __future__ import annotations

from torch import nn

from pyplan.zoo.resnet import BasicBlock, ResNet
from pyplan.zoo.transformer import GPT, GPTConfig
from pyplan.zoo.vgg import VGG

__all__ = [
    "GPT_TINY",
    "MLP_CLASSES",
    "MLP_FEATURES",
    "gpt_tiny",
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


def resnet_tiny() -> ResNet:
    """CIFAR-stem ResNet, one BasicBlock per stage (16, 32, 48 channels); stages 2 and 3 have projections."""
    return ResNet(BasicBlock, (1, 1, 1), num_classes=10, widths=(16, 32, 48), small_input=True)


def vgg_tiny() -> VGG:
    """Conv+ReLU+pool x3 (16, 32, 64 channels), 2x2 average pool, Linear(256, 32), Linear(32, 10)."""
    return VGG((16, "M", 32, "M", 64, "M"), num_classes=10, pool_size=2, hidden=(32,), dropout=0.0)


def gpt_tiny() -> GPT:
    """GPT-2 structure at 2 layers, width 64, 4 heads, vocabulary 256, context 32."""
    return GPT(GPT_TINY)
