"""Tests of the cost formulas against their Python reference and the ZeRO paper's Figure 1."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from pyplan import solve
from tests.solve import reference

REL = 1e-12
MIXED_PRECISION_ADAM = {"param_bytes": 2.0, "grad_bytes": 2.0, "optim_bytes": 12.0}


@pytest.mark.parametrize(("zero_stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_reproduces_figure_1(zero_stage: int, gb: float) -> None:
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B parameters, 64 GPUs, mixed-precision Adam (K = 12).
    state = solve.zero_model_state_bytes(7.5e9, 64, zero_stage, **MIXED_PRECISION_ADAM)
    assert round(state.total_bytes / 1e9, 1) == gb
    exact = {0: 120e9, 1: 30e9 + 90e9 / 64, 2: 15e9 + 105e9 / 64, 3: 120e9 / 64}[zero_stage]
    assert state.total_bytes == pytest.approx(exact, rel=REL)


def test_zero_shards_optimizer_then_gradients_then_weights() -> None:
    per_param = {"param_bytes": 4.0, "grad_bytes": 4.0, "optim_bytes": 8.0}  # fp32 SGD with momentum + copy
    parts = [solve.zero_model_state_bytes(1000.0, 4, stage, **per_param) for stage in range(4)]
    assert [(s.param_bytes, s.grad_bytes, s.optim_bytes) for s in parts] == [
        (4000.0, 4000.0, 8000.0),
        (4000.0, 4000.0, 2000.0),
        (4000.0, 1000.0, 2000.0),
        (1000.0, 1000.0, 2000.0),
    ]


def test_communication_formulas_equal_the_reference() -> None:
    rng = random.Random(5)
    for _ in range(200):
        link = {"latency_s": rng.uniform(0.0, 1e-4), "bw_bytes_per_s": rng.uniform(1e9, 1e11)}
        size = rng.uniform(0.0, 1e10)
        d = rng.randint(1, 64)
        for name in ("ring_allreduce_time_s", "reduce_scatter_time_s", "all_gather_time_s"):
            got = getattr(solve, name)(size, d, **link)
            assert got == pytest.approx(getattr(reference, name)(size, d, **link), rel=REL)
        assert solve.p2p_time_s(size, **link) == pytest.approx(reference.p2p_time_s(size, **link), rel=REL)
        hier = {
            "intra_latency_s": rng.uniform(0.0, 1e-5), "intra_bw_bytes_per_s": rng.uniform(1e11, 1e12),
            "inter_latency_s": rng.uniform(0.0, 1e-4), "inter_bw_bytes_per_s": rng.uniform(1e9, 1e11),
        }  # fmt: skip
        g, n = rng.randint(1, 8), rng.randint(1, 16)
        assert solve.hierarchical_allreduce_time_s(size, g, n, **hier) == pytest.approx(
            reference.hierarchical_allreduce_time_s(size, g, n, **hier), rel=REL
        )


def test_collective_special_cases() -> None:
    link = {"latency_s": 1e-5, "bw_bytes_per_s": 1e10}
    assert solve.ring_allreduce_time_s(1e9, 1, **link) == 0.0
    # Eq. 5.1 by hand: 2·7·(1e-5 + 8e9/(8·1e10)).
    assert solve.ring_allreduce_time_s(8e9, 8, **link) == pytest.approx(14 * (1e-5 + 0.1), rel=REL)
    assert solve.reduce_scatter_time_s(8e9, 8, **link) * 2 == solve.ring_allreduce_time_s(8e9, 8, **link)
    intra = {"intra_latency_s": 1e-6, "intra_bw_bytes_per_s": 3e11}
    inter = {"inter_latency_s": 1e-5, "inter_bw_bytes_per_s": 1e10}
    one_node = solve.hierarchical_allreduce_time_s(8e9, 8, 1, **intra, **inter)
    assert one_node == pytest.approx(solve.ring_allreduce_time_s(8e9, 8, latency_s=1e-6, bw_bytes_per_s=3e11))
    one_gpu = solve.hierarchical_allreduce_time_s(8e9, 1, 4, **intra, **inter)
    assert one_gpu == pytest.approx(solve.ring_allreduce_time_s(8e9, 4, latency_s=1e-5, bw_bytes_per_s=1e10))


def test_pipeline_formulas() -> None:
    rng = random.Random(9)
    for _ in range(100):
        times = [rng.uniform(0.1, 1.0) for _ in range(rng.randint(1, 8))]
        m = rng.randint(1, 32)
        assert solve.pipeline_time_s(times, m) == pytest.approx(reference.pipeline_time_s(times, m), rel=REL)
    # Balanced stages: T = (m + p − 1)·t, of which (p − 1)·t is bubble, (p−1)/(m+p−1) of the total.
    for p, m in [(1, 1), (4, 1), (4, 8), (8, 32), (16, 4)]:
        total = solve.pipeline_time_s([0.5] * p, m)
        assert total == pytest.approx((m + p - 1) * 0.5, rel=REL)
        assert solve.bubble_fraction(p, m) == pytest.approx((total - m * 0.5) / total, rel=REL)
        assert solve.bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1), rel=REL)
        for v in (1, 2, 4):
            got = solve.bubble_fraction(p, m, num_chunks=v)
            assert got == pytest.approx(reference.bubble_fraction(p, m, v), rel=REL)


def test_optimizer_step_time() -> None:
    # Mixed-precision Adam on 1e9 local parameters: read grads (2) + fp32 state (12), write state + weights (2).
    got = solve.optimizer_step_time_s(14e9, 14e9, 2e12)
    assert got == pytest.approx(reference.optimizer_step_time_s(14e9, 14e9, 2e12), rel=REL)
    assert got == pytest.approx(0.014, rel=REL)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: solve.ring_allreduce_time_s(1.0, 0, latency_s=0.0, bw_bytes_per_s=1.0), "ranks must be >= 1"),
        (
            lambda: solve.p2p_time_s(1.0, latency_s=0.0, bw_bytes_per_s=0.0),
            r"bw_bytes_per_s must be in \[0.001, inf\], got 0",
        ),
        (lambda: solve.p2p_time_s(-1.0, latency_s=0.0, bw_bytes_per_s=1.0), r"bytes must be in \[0, 1e\+100\], got -1"),
        (lambda: solve.zero_model_state_bytes(1.0, 2, 4, **MIXED_PRECISION_ADAM), "zero_stage must be 0, 1, 2"),
        (lambda: solve.pipeline_time_s([], 4), "at least one stage"),
        (lambda: solve.bubble_fraction(4, 0), "num_microbatches must be >= 1"),
        (lambda: solve.optimizer_step_time_s(1.0, 1.0, 0.0), r"mem_bw_bytes_per_s must be in \[0.001, inf\]"),
    ],
)
def test_bad_input_raises(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
