"""Closed-form pipeline times against the event simulator, on uneven stages."""

from __future__ import annotations

import random

import pytest

from pyplan.solve import pipeline_time_s
from pyplan.solve.closed_form import closed_form_makespan_s
from pyplan.solve.schedules import simulate


def _stages(rng: random.Random, p: int) -> tuple[list[float], list[float]]:
    return [rng.uniform(0.1, 2.0) for _ in range(p)], [rng.uniform(0.1, 3.0) for _ in range(p)]


def test_gpipe_makespan_is_the_split_closed_form() -> None:
    # With no send time GPipe runs every forward, then every backward: each phase is a pipeline of its own,
    # so the makespan is ΣF + (m−1)·max F + ΣB + (m−1)·max B exactly, for any stage times.
    rng = random.Random(0)
    for _ in range(300):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        fwd, bwd = _stages(rng, p)
        split = sum(fwd) + (m - 1) * max(fwd) + sum(bwd) + (m - 1) * max(bwd)
        assert simulate("GPipe", fwd, bwd, num_microbatches=m).makespan_s == pytest.approx(split, rel=1e-12)


def test_eq1_is_exact_when_balanced_and_a_lower_bound_for_gpipe() -> None:
    # Huang et al. eq. 1, Σ t_s + (m−1)·max t_s with t_s = F_s + B_s: exact for equal stages (GPipe and 1F1B);
    # for uneven stages it undercuts GPipe's makespan (the slowest forward and backward may lie on different
    # stages), never overshoots it. For 1F1B it can err either way, which is why the search simulates.
    rng = random.Random(1)
    for _ in range(300):
        p = rng.randint(1, 6)
        m = rng.randint(p, 12)
        f, b = rng.uniform(0.1, 2.0), rng.uniform(0.1, 3.0)
        for schedule in ("GPipe", "1F1B"):
            sim = simulate(schedule, [f] * p, [b] * p, num_microbatches=m).makespan_s
            assert pipeline_time_s([f + b] * p, m) == pytest.approx(sim, rel=1e-12)
        fwd, bwd = _stages(rng, p)
        sim = simulate("GPipe", fwd, bwd, num_microbatches=m).makespan_s
        assert pipeline_time_s([x + y for x, y in zip(fwd, bwd)], m) <= sim * (1 + 1e-12)


def test_closed_form_equals_balanced_and_never_undercuts_the_simulation() -> None:
    rng = random.Random(2)
    for _ in range(400):
        p = rng.randint(1, 6)
        m = rng.randint(p, 12)
        f, b = rng.uniform(0.1, 2.0), rng.uniform(0.1, 3.0)
        for schedule in ("GPipe", "1F1B"):
            balanced = closed_form_makespan_s(schedule, [f] * p, [b] * p, num_microbatches=m)
            assert balanced == pytest.approx(pipeline_time_s([f + b] * p, m), rel=1e-12)
            assert balanced == pytest.approx(
                simulate(schedule, [f] * p, [b] * p, num_microbatches=m).makespan_s, rel=1e-12
            )
        fwd, bwd = _stages(rng, p)
        sf = [rng.uniform(0.0, 1.0) for _ in range(p - 1)]
        sb = [rng.uniform(0.0, 1.0) for _ in range(p - 1)]
        for schedule in ("GPipe", "1F1B"):
            bound = closed_form_makespan_s(
                schedule, fwd, bwd, num_microbatches=m, send_forward_s=sf, send_backward_s=sb
            )
            sim = simulate(
                schedule, fwd, bwd, num_microbatches=m, send_forward_s=sf or 0.0, send_backward_s=sb or 0.0
            ).makespan_s
            assert sim <= bound * (1 + 1e-12)
            if schedule == "GPipe":
                assert sim == pytest.approx(bound, rel=1e-12)
