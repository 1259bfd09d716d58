"""FLOPs per block against the matmul count, and measured times fitted per micro-batch size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import PlanError, TimingOptions, linearize, profile, trace
from pyplan.profile import default_batch_sizes
from pyplan.profile.flops import block_flops


def test_linear_flops_forward_and_backward() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    chain = linearize(trace(model, x))
    (f0, b0), (f1, b1) = block_flops(chain, x, (2, 4))
    assert (f0.per_sample, f0.fixed) == (2 * 16 * 32, 0)
    # The first block computes no input gradient (the data needs none): weight gradient only.
    assert b0.per_sample == 2 * 16 * 32
    assert (f1.per_sample, b1.per_sample) == (2 * 32 * 8, 4 * 32 * 8)


def test_measured_times_are_positive_lines() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    x = torch.randn(8, 256)
    chain = profile(linearize(trace(model, x)), x, batch_sizes=(4, 8), options=TimingOptions(warmup=1, repeats=3))
    for b in chain.blocks:
        assert b.fwd_time_s is not None and b.bwd_time_s is not None
        # A cheap pass (the ReLU's backward; a small Linear's weight gradient, seen at 64 x 256) may time at 0 once
        # the timer's cost is taken off on a loaded machine: never below, and a Linear's two passes never both 0.
        assert b.fwd_time_s(8) >= 0 and b.bwd_time_s(8) >= 0
        if b.param_numel:
            assert b.fwd_time_s(8) + b.bwd_time_s(8) > 0
    assert all(p.grad is None for p in model.parameters())


def test_meta_model_profiles_without_timing_and_refuses_to_be_timed() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    chain = linearize(trace(model, torch.randn(2, 1024)))
    profiled = profile(chain, torch.randn(2, 1024), measure=False)
    assert profiled.blocks[0].flops_fwd is not None and profiled.blocks[0].fwd_time_s is None
    assert profiled.blocks[0].flops_fwd.per_sample == 2 * 1024 * 1024
    with pytest.raises(PlanError, match="meta device"):
        profile(chain, torch.randn(2, 1024))


def test_default_batch_sizes_have_two_distinct_sizes() -> None:
    assert default_batch_sizes(8) == (2, 4, 8)
    assert default_batch_sizes(1) == (1, 2)
    assert len(set(default_batch_sizes(2))) >= 2


def test_time_fit_is_never_negative() -> None:
    from pyplan import Affine

    assert Affine.fit([1, 2, 4], [1.0, 2.0, 4.0]) == Affine(1.0, 0.0)
    assert Affine.fit([1, 2], [3.0, 2.0]) == Affine(0.0, 2.5)
    line = Affine.fit([2, 4], [1.0, 3.0])
    assert line.fixed == 0.0 and line.per_sample > 0


@pytest.mark.parametrize("groups", [1, 64])
def test_convolution_backward_is_twice_the_forward(groups: int) -> None:
    # Input gradient and weight gradient each take the forward's multiply-adds, depthwise convolutions included.
    model = nn.Sequential(nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1, groups=groups, bias=False))
    x = torch.randn(2, 64, 16, 16)
    chain = linearize(trace(model, x), positions=[1])
    _, (fwd, bwd) = block_flops(chain, x, (2, 4))
    assert fwd.per_sample == 2 * 64 * (64 // groups) * 9 * 16 * 16
    assert bwd.per_sample == 2 * fwd.per_sample
