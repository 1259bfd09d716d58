"""The emitted script's learning-rate schedule against its closed forms."""

from __future__ import annotations

import pytest

from pyplan.errors import PlanError
from pyplan.runtime.optim import lr_factor


def test_warmup_then_decay_to_the_floor() -> None:
    steps, warmup = 11, 2
    assert [lr_factor(s, steps, warmup, "none") for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert all(lr_factor(s, steps, warmup, "none") == 1.0 for s in range(warmup, steps))
    for decay in ("linear", "cosine"):
        assert lr_factor(warmup, steps, warmup, decay) == pytest.approx(1.0)  # the decay starts from the full rate
        assert lr_factor(steps - 1, steps, warmup, decay) == pytest.approx(0.1)  # and ends at the floor
        rates = [lr_factor(s, steps, warmup, decay) for s in range(warmup, steps)]
        assert rates == sorted(rates, reverse=True)
    middle = warmup + (steps - warmup - 1) // 2  # halfway through the decay
    assert lr_factor(middle, steps, warmup, "linear") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(middle, steps, warmup, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(warmup + 2, steps, warmup, "cosine") > lr_factor(warmup + 2, steps, warmup, "linear")
    with pytest.raises(PlanError, match="unknown learning-rate decay 'step'"):
        lr_factor(0, steps, warmup, "step")
