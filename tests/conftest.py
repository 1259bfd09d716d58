"""Shared fixtures: seeded torch and the example model files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from pyplan.load import load_model
from pyplan.spec import ModelSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def finite(value: object) -> bool:
    """Whether every number in `value` (nested dicts, lists and tuples of numbers, booleans and strings) is finite."""
    if isinstance(value, bool | str):
        return True
    if isinstance(value, int | float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(finite(v) for v in value)
    return False


def example(name: str) -> ModelSpec:
    """The ModelSpec of examples/<name>.py."""
    return load_model(os.path.join(EXAMPLES, f"{name}.py"))


def write_local_calibration(directory: Path) -> Path:
    """A calibration file of this machine with made-up figures (tests check mechanics, not speeds) in `directory`,
    for plans on the `local` GPU with PYPLAN_CACHE_DIR set to it."""
    from pyplan.hardware.catalog import local_gpu

    path = directory / "local.json"
    path.write_text(
        json.dumps(
            {
                "device": local_gpu().description,
                "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "test"},
                "link": {"latency_s": 1e-4, "bw_bytes_per_s": 2e9, "source": "test"},
            }
        )
    )
    return path
