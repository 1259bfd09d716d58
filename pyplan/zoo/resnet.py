"""ResNet (He et al. 2016) with torchvision's module names and v1.5 stride placement, for any input size."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet"]


def _shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Sequential | None:
    """The projection shortcut (1x1 conv + BN) where a block changes shape, else None (identity)."""
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions around a skip connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        # Out-of-place ReLUs and adds (torchvision's are in place) keep the traced graph free of mutation,
        # so every fx node is a fresh tensor that a pipeline cut can carry.
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _shortcut(inplanes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's v1.5), 1x1 expand, around a skip connection."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU()
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem, one stage per entry of `layers` (stride 2 from the second on), global average pool, classifier.

    `small_input` selects the CIFAR stem of kuangliu/pytorch-cifar (3x3 stride-1 conv, no max pool): a 7x7
    stride-2 conv and a pool would shrink a 32x32 image to 8x8 before the first block.
    """

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        layers: Sequence[int],
        *,
        num_classes: int = 1000,
        in_channels: int = 3,
        widths: Sequence[int] = (64, 128, 256, 512),
        small_input: bool = False,
    ) -> None:
        super().__init__()
        stem = widths[0]
        if small_input:
            self.conv1 = nn.Conv2d(in_channels, stem, 3, 1, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(in_channels, stem, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU()
        self.maxpool = nn.Identity() if small_input else nn.MaxPool2d(3, 2, 1)
        self.num_stages = len(layers)
        inplanes = stem
        for i, (planes, blocks) in enumerate(zip(widths, layers, strict=True)):
            stage = []
            for j in range(blocks):
                stride = 2 if i > 0 and j == 0 else 1
                stage.append(block(inplanes, planes, stride))
                inplanes = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


# Block type and residual blocks per stage of the published depths (He et al. 2016, Table 1).
_DEPTHS: dict[int, tuple[type[BasicBlock | Bottleneck], tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


def resnet(depth: int, *, num_classes: int = 1000, in_channels: int = 3, small_input: bool = False) -> ResNet:
    """ResNet-`depth` (18, 34, 50, 101 or 152) as torchvision builds it, or with the CIFAR stem."""
    block, layers = _DEPTHS[depth]
    return ResNet(block, layers, num_classes=num_classes, in_channels=in_channels, small_input=small_input)
