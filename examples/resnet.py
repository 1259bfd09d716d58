"""A small residual CNN for 32x32 images: skip connections that cross pipeline cuts."""

import torch
from torch import nn


class Residual(nn.Module):
    """Two 3x3 convolutions with a skip connection; a 1x1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...] = (32, 64, 128), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers = []
        cin = widths[0]
        for i, w in enumerate(widths):
            layers += [Residual(cin, w, stride=1 if i == 0 else 2), Residual(w, w)]
            cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def model() -> nn.Module:
    return ResNet()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
