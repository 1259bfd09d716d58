"""Shared fixtures: seeded torch and the example model files."""

from __future__ import annotations

import os

import pytest
import torch

from pyplan.load import load_model
from pyplan.spec import ModelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def example(name: str) -> ModelSpec:
    """The ModelSpec of examples/<name>.py."""
    return load_model(os.path.join(EXAMPLES, f"{name}.py"))
