"""Blocks timed one by one, brought down to the whole model's time (pyplan/profile/measure.py, `_spread`)."""

from __future__ import annotations

import pytest

from pyplan.profile.measure import _Overhead, _spread

OVERHEAD = _Overhead(forward_s=1.0, backward_s=2.0, op_forward_s=0.5, op_backward_s=0.25)


def test_the_excess_over_the_whole_model_is_taken_off_every_block_alike() -> None:
    blocks = [(10.0, 20.0), (6.0, 8.0), (4.0, 2.0)]  # sums 20 and 30
    # The whole model took 18 + one call's overhead (1) forward and 24 + 2 backward: 2 and 6 too many.
    out = _spread(blocks, (19.0, 26.0), OVERHEAD)
    # Backward: 2 each, but the third block stops at one op (0.25); its last 0.25 comes off the other two.
    assert out == [
        pytest.approx((10 - 2 / 3, 17.875)),
        pytest.approx((6 - 2 / 3, 5.875)),
        pytest.approx((4 - 2 / 3, 0.25)),
    ]
    assert sum(f for f, _ in out) == pytest.approx(18.0) and sum(b for _, b in out) == pytest.approx(24.0)


def test_blocks_are_never_raised_to_the_whole_model_nor_cut_below_one_op() -> None:
    blocks = [(3.0, 3.0), (1.0, 0.6)]
    assert _spread(blocks, (10.0, 10.0), OVERHEAD) == blocks  # the sum is under the whole: unchanged
    # A whole model under half the blocks' sum did other work (no backward to time, say): the blocks are kept.
    assert _spread(blocks, (1.0, 2.0), OVERHEAD) == blocks
    assert _spread(blocks, (1.0 + 2.1, 2.0 + 1.7), OVERHEAD)[0][0] < 3.0  # 2.1 of 4 forward: spread
    assert _spread(blocks, (1.0 + 1.9, 2.0 + 1.7), OVERHEAD)[0][1] == 3.0  # 1.7 of 3.6 backward: kept
    # What a block at its floor cannot give comes off the others: 2 too many, the second block gives 0.5.
    out = _spread(blocks, (3.0, 100.0), OVERHEAD)
    assert out == [pytest.approx((1.5, 3.0)), pytest.approx((0.5, 0.6))]
    assert _spread([], (1.0, 1.0), OVERHEAD) == []


@pytest.mark.parametrize(
    ("corun", "whole", "spread"),
    [(0, None, True), (1, None, False), (1, True, True), (0, False, False)],
)
def test_blocks_are_brought_down_to_the_whole_model_when_timed_alone(
    corun: int, whole: bool | None, spread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default only a process timed alone (corun 0) is brought down to the whole model: beside others, the
    trainer's own cost per stage pass, which no host cost charges, brought the ranks' stages near the blocks' sum.
    `TimingOptions.whole` says so either way."""
    import torch
    from torch import nn

    from pyplan.graph.linearize import linearize
    from pyplan.graph.trace import trace
    from pyplan.profile import measure

    calls: list[int] = []

    def recorded(
        times: list[tuple[float, float]], whole_s: tuple[float, float], overhead: measure._Overhead
    ) -> list[tuple[float, float]]:
        calls.append(len(times))
        return list(times)

    monkeypatch.setattr(measure, "_spread", recorded)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
    chain = linearize(trace(model, lambda b: (torch.randn(b, 16),), batch_size=4), min_blocks=3)
    options = measure.TimingOptions(warmup=1, repeats=1, corun=corun, whole=whole)
    times = measure.block_times(chain, lambda b: (torch.randn(b, 16),), [2, 4], options=options)
    assert len(times) == len(chain)
    assert calls == ([len(chain)] * 2 if spread else [])


def test_the_gpu_timing_runs_passes_and_brings_the_blocks_down_to_the_whole_model() -> None:
    """The GPU's timing (events between the blocks of a pass, then the whole model) is device-agnostic code: run
    here on the CPU, where its clock is the wall clock, it times every size and every block, forward and backward."""
    import torch

    from pyplan import linearize, load_model, trace
    from pyplan.profile.measure import TimingOptions, _cuda_times

    spec = load_model("zoo:mlp-tiny")
    torch.manual_seed(0)
    chain = linearize(trace(spec.build(), spec.example_inputs))
    sizes = (2, 8)
    with torch.enable_grad():
        per_size = _cuda_times(chain, spec.example_inputs, sizes, torch.device("cpu"), TimingOptions(repeats=3))
    assert len(per_size) == len(sizes) and all(len(t) == len(chain) for t in per_size)
    assert all(f > 0 and b > 0 for times in per_size for f, b in times)
