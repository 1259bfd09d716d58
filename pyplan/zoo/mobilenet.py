"""MobileNetV2 (Sandler et al. 2018) with torchvision's module names, and the CIFAR variant of kuangliu."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SETTINGS", "InvertedResidual", "MobileNetV2"]

# (t, c, n, s) of the paper's Table 2: expansion factor, output channels, repeats, stride of the first repeat.
SETTINGS: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _conv_bn_act(
    inp: int, oup: int, kernel: int, stride: int = 1, *, groups: int = 1, act: type[nn.Module]
) -> nn.Sequential:
    """Conv (no bias), BatchNorm, activation: torchvision's Conv2dNormActivation."""
    return nn.Sequential(
        nn.Conv2d(inp, oup, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(oup),
        act(),
    )


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise, linear 1x1 project; a skip connection where the stride is 1.

    The CIFAR variant (kuangliu) always expands (also for t = 1), uses ReLU instead of ReLU6, and gives a
    stride-1 block that changes width a projection shortcut where torchvision gives it none.
    """

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int, *, cifar: bool = False) -> None:
        super().__init__()
        hidden = inp * expand_ratio
        act = nn.ReLU if cifar else nn.ReLU6
        layers: list[nn.Module] = []
        if expand_ratio != 1 or cifar:
            layers.append(_conv_bn_act(inp, hidden, 1, act=act))
        layers += [
            _conv_bn_act(hidden, hidden, 3, stride, groups=hidden, act=act),
            nn.Conv2d(hidden, oup, 1, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.use_res_connect = stride == 1 and (inp == oup or cifar)
        self.shortcut: nn.Sequential | None = None
        if stride == 1 and inp != oup and cifar:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, oup, 1, bias=False), nn.BatchNorm2d(oup))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        if not self.use_res_connect:
            return out
        return out + (x if self.shortcut is None else self.shortcut(x))


class MobileNetV2(nn.Module):
    """Stem conv, the inverted-residual stages of `SETTINGS`, 1x1 conv to 1280, average pool, classifier.

    `cifar=True` is kuangliu's CIFAR-10 model, the one Jansen's thesis uses for CIFAR-10 and MNIST (Tables
    A.4, A.7): stride 1 in the stem and the second stage so a 32x32 image ends at 4x4, and no dropout.
    """

    def __init__(self, *, num_classes: int = 1000, in_channels: int = 3, cifar: bool = False) -> None:
        super().__init__()
        act = nn.ReLU if cifar else nn.ReLU6
        features: list[nn.Module] = [_conv_bn_act(in_channels, 32, 3, 1 if cifar else 2, act=act)]
        inp = 32
        for i, (t, c, n, s) in enumerate(SETTINGS):
            stride = 1 if cifar and i == 1 else s
            for j in range(n):
                features.append(InvertedResidual(inp, c, stride if j == 0 else 1, t, cifar=cifar))
                inp = c
        features.append(_conv_bn_act(inp, 1280, 1, act=act))
        self.features = nn.Sequential(*features)
        head: list[nn.Module] = [] if cifar else [nn.Dropout(0.2)]
        self.classifier = nn.Sequential(*head, nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))
