"""A multi-layer perceptron: the smallest model file pyplan accepts."""

import torch
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 256, generator=torch.Generator().manual_seed(0)),)


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
