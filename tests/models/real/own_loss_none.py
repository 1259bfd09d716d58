"""own_loss.py's model called without targets, so it returns `(logits, None)`; the file's loss reads the logits."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from own_loss import SEQ, VOCAB, LossGPT


def model() -> nn.Module:
    return LossGPT()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def target(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
