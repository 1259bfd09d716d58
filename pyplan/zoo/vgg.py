"""VGG (Simonyan and Zisserman 2015) with torchvision's module names: features, avgpool, classifier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

__all__ = ["CONFIGS", "VGG", "Layers"]

# Output channels of each 3x3 conv, "M" for a 2x2 max pool of stride 2.
Layers = Sequence[int | Literal["M"]]

# Configurations A (11 layers) and D (16 layers) of the paper's Table 1.
CONFIGS: dict[str, Layers] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
}


class VGG(nn.Module):
    """Conv stack, adaptive average pool to `pool_size`², Linear+ReLU+Dropout per `hidden` width, classifier.

    torchvision: `pool_size=7, hidden=(4096, 4096)`; kuangliu/pytorch-cifar: `batch_norm=True, pool_size=1,
    hidden=()` (one Linear(512, classes)).
    """

    def __init__(
        self,
        layers: Layers,
        *,
        batch_norm: bool = False,
        in_channels: int = 3,
        num_classes: int = 1000,
        pool_size: int = 7,
        hidden: Sequence[int] = (4096, 4096),
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        features: list[nn.Module] = []
        channels = in_channels
        for item in layers:
            if item == "M":
                features.append(nn.MaxPool2d(2, 2))
                continue
            features.append(nn.Conv2d(channels, item, 3, padding=1))
            if batch_norm:
                features.append(nn.BatchNorm2d(item))
            features.append(nn.ReLU())
            channels = item
        self.features = nn.Sequential(*features)
        self.avgpool = nn.AdaptiveAvgPool2d(pool_size)
        classifier: list[nn.Module] = []
        width = channels * pool_size * pool_size
        for h in hidden:
            classifier += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        classifier.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*classifier)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))
