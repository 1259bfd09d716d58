"""Piecewise: block times measured at several micro-batch sizes, linear between them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pyplan import search
from pyplan.api import chain_for
from pyplan.graph.layergraph import Affine, Piecewise
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.profile import measured_batch_sizes
from pyplan.profile.cache import _decode, _encode, _Invalid


def test_through_the_points_between_and_beyond() -> None:
    c = Piecewise.through([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.5])
    assert [c(b) for b in (1, 2, 4, 8)] == [1.0, 1.5, 2.5, 4.5]
    assert c(3) == pytest.approx(2.0)  # between 2 and 4
    assert c(6) == pytest.approx(3.5)
    assert c(16) == pytest.approx(8.5)  # along the last segment
    assert c(0.5) == pytest.approx(0.75)  # along the first
    # The least-squares line stays for reports and JSON.
    line = Affine.fit([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.5])
    assert (c.per_sample, c.fixed) == pytest.approx((line.per_sample, line.fixed))
    assert c.sizes == (1, 2, 4, 8)


def test_a_curve_is_not_a_line() -> None:
    # Per-sample cost falling with b (a batch that does not fill the machine): the line through the ends of a
    # small-batch profile overshoots at 16, the curve does not.
    c = Piecewise.through([1, 2, 4, 8, 16], [1.0, 1.6, 2.4, 3.2, 4.8])
    small = Affine.fit([1, 2, 4], [1.0, 1.6, 2.4])
    assert c(16) == 4.8
    assert small(16) > 1.2 * c(16)


def test_noise_never_makes_a_time_shrink_or_go_negative() -> None:
    c = Piecewise.through([1, 2, 4], [2.0, 1.5, 3.0])
    assert [v for _, v in c.points] == [2.0, 2.0, 3.0]
    steep = Piecewise.through([2, 4], [0.1, 2.0])
    assert steep(1) == 0.0
    assert Piecewise.through([2, 2, 4], [1.0, 3.0, 5.0]).points == ((2, 2.0), (4, 5.0))
    with pytest.raises(ValueError, match="two or more distinct"):
        Piecewise.through([4, 4], [1.0, 2.0])


def test_sums_keep_every_point() -> None:
    a = Piecewise.through([1, 4], [1.0, 4.0])
    b = Piecewise.through([2, 8], [2.0, 5.0])
    line = Affine(0.5, 1.0)
    for total in (a + b, b + a):
        assert isinstance(total, Piecewise) and total.sizes == (1, 2, 4, 8)
        assert [total(x) for x in (1, 2, 4, 8)] == pytest.approx([a(x) + b(x) for x in (1, 2, 4, 8)])
    for total in (a + line, line + a):
        assert isinstance(total, Piecewise) and total.sizes == (1, 4)
        assert total(3) == pytest.approx(a(3) + line(3))


def test_the_profile_cache_keeps_the_points() -> None:
    c = Piecewise.through([1, 2, 4], [1.0, 1.5, 2.5])
    assert _decode(_encode(c)) == c
    assert _decode(_encode(Affine(1.0, 2.0))) == Affine(1.0, 2.0)
    for bad in ([1.0, 0.0, [[1, 1.0]]], [1.0, 0.0, [[2, 1.0], [1, 2.0]]], [1.0, 0.0, [[1, 1.0], [2]]]):
        with pytest.raises(_Invalid):
            _decode(bad)


def test_measured_sizes_cover_the_plans_micro_batches() -> None:
    assert measured_batch_sizes(64) == (1, 2, 4, 8, 16, 32)
    assert measured_batch_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert measured_batch_sizes(1) == (1, 2)
    assert measured_batch_sizes(12, cap=8) == (1, 2, 4, 8)


def test_a_measured_profile_and_the_search_use_the_curves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import pyplan.planner
    from pyplan.hardware.catalog import local_gpu

    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))  # a calibration without host costs: the blocks alone
    calibration = {
        "device": local_gpu().description,
        "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "test"},
        "link": {"latency_s": 1e-4, "bw_bytes_per_s": 2e9, "source": "test"},
    }
    (tmp_path / "local.json").write_text(json.dumps(calibration))
    monkeypatch.setattr(pyplan.planner, "local_host_costs", lambda: None)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)))
    inputs = lambda b: (torch.randn(b, 64),)  # noqa: E731
    cluster, workload = Cluster.from_catalog("local", 1), Workload(global_batch=12)
    chain, _ = chain_for(model, inputs, cluster, workload)
    for blk in chain.blocks:
        assert isinstance(blk.fwd_time_s, Piecewise) and blk.fwd_time_s.sizes == (1, 2, 4, 8, 12)
        assert isinstance(blk.bwd_time_s, Piecewise) and blk.bwd_time_s.sizes == (1, 2, 4, 8, 12)
    # Micro-batches of 3 samples, between two measured sizes: the C++ search's stage times are the curves'.
    plan = search(model, inputs, cluster, workload, chain=chain, micro_batch_sizes=[3], schedules=["GPipe"]).best
    assert plan.layout.micro_batch_size == 3 and len(plan.stages) == 1
    curves = [(blk.fwd_time_s, blk.bwd_time_s) for blk in chain.blocks]
    assert plan.stages[0].forward_s == pytest.approx(sum(f(3) for f, _ in curves), rel=1e-9)  # type: ignore[misc]
    assert plan.stages[0].backward_s == pytest.approx(sum(g(3) for _, g in curves), rel=1e-9)  # type: ignore[misc]


def test_the_relaxed_remat_searches_recompute_in_the_curves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under full recomputation (the searches that seed remat plans) each block's backward also runs its forward:
    with curves, the search's backward points carry it, as its lines do without them."""
    import pyplan.planner
    from pyplan import _core
    from pyplan.hardware.catalog import local_gpu

    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    calibration = {
        "device": local_gpu().description,
        "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "test"},
        "link": {"latency_s": 1e-4, "bw_bytes_per_s": 2e9, "source": "test"},
    }
    (tmp_path / "local.json").write_text(json.dumps(calibration))
    model = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)))
    inputs = lambda b: (torch.randn(b, 64),)  # noqa: E731
    cluster, workload = Cluster.from_catalog("local", 1), Workload(global_batch=8)
    chain, _ = chain_for(model, inputs, cluster, workload)
    calls: list[dict] = []
    real = _core.search

    def spy(*args: object, **kwargs: object) -> object:
        calls.append({"args": args, **kwargs})
        return real(*args, **kwargs)

    monkeypatch.setattr(pyplan.planner._core, "search", spy)
    search(model, inputs, cluster, workload, chain=chain, remat="auto", micro_batch_sizes=[4], schedules=["GPipe"])
    plain, relaxed = calls[0], calls[1:]
    assert relaxed and plain["time_sizes"] == list(map(float, measured_batch_sizes(8)))
    for call in relaxed:
        assert call["time_sizes"] == plain["time_sizes"] and call["fwd_points_s"] == plain["fwd_points_s"]
        both = [g + f for g, f in zip(plain["bwd_points_s"], plain["fwd_points_s"])]
        assert call["bwd_points_s"] == pytest.approx(both, rel=1e-12)
        # The lines (alpha, beta) carry the recomputation too.
        assert call["args"][2] == pytest.approx([g + f for g, f in zip(plain["args"][2], plain["args"][0])])
