"""Tests of a rank's micro-batches in flight over time (simulate.h's in_flight_peaks) against walking its order."""

from __future__ import annotations

import random

import pytest

from pyplan.solve.schedules import in_flight_peaks, pipeline_order, simulate, stage_placement, torch_rejection
from tests.solve import reference

# The multi-stage schedules with the stages per rank they take.
SHAPES = [
    (schedule, p, m, v)
    for schedule, vs in (
        ("Interleaved1F1B", (2, 3, 4)),
        ("LoopedBFS", (2, 3, 4)),
        ("InterleavedZeroBubble", (2, 3, 4)),
        ("ZBVZeroBubble", (2,)),
        ("DualPipeV", (2,)),
    )
    for p in (2, 3, 4)
    for v in vs
    for m in (1, 2, 3, 4, 6, 8, 9, 12)
    if not torch_rejection(schedule, p, m, v)
]


def _walk(order: list[tuple[int, str, int]], stages: list[int]) -> list[tuple[int, ...]]:
    """The counts of `stages` (one rank's, in order) after every action of the rank's order."""
    now = dict.fromkeys(stages, 0)
    states = []
    for stage, op, _ in order:
        if op == "F":
            now[stage] += 1
        elif op in ("B", "W"):
            now[stage] -= 1
        states.append(tuple(now[s] for s in stages))
    return states


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SHAPES)
def test_the_rank_peak_is_the_most_held_walking_its_order(schedule: str, p: int, m: int, v: int) -> None:
    """For random bytes per micro-batch of each stage, the largest Σ_j n_j·A_j over a rank's peaks is the most its
    stages hold at once, walking its order action by action; every peak occurs there, and none covers another."""
    rng = random.Random(f"{schedule}-{p}-{m}-{v}")
    order = [[(a.stage, a.op, a.microbatch) for a in rank] for rank in pipeline_order(schedule, p, m, v)]
    placement = stage_placement(schedule, p, v)
    peaks = in_flight_peaks(schedule, p, m, v)
    assert len(peaks) == p
    for r, actions in enumerate(order):
        stages = [s for s in range(p * v) if placement[s] == r]
        states = set(_walk(actions, stages))
        assert peaks[r] and set(peaks[r]) <= states
        assert peaks[r] == sorted(set(peaks[r]))
        for a in peaks[r]:
            assert not any(b != a and all(x >= y for x, y in zip(b, a)) for b in peaks[r])
        for _ in range(5):
            held = [rng.choice((0.0, rng.uniform(0, 1e6), rng.uniform(0, 1e9))) for _ in stages]
            per_stage = [0.0] * (p * v)
            for s, x in zip(stages, held):
                per_stage[s] = x
            most = max(sum(n * x for n, x in zip(counts, held)) for counts in peaks[r])
            assert most == pytest.approx(reference.rank_activation_bytes(actions, per_stage), rel=1e-12, abs=1e-9)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), SHAPES)
def test_the_rank_peak_is_at_most_the_stages_own_peaks(schedule: str, p: int, m: int, v: int) -> None:
    """A rank's stages never hold more together than their own peaks (simulate's peak_in_flight), and each stage
    reaches its own peak in some vector."""
    ones = [1.0] * (p * v)
    own = simulate(schedule, ones, ones, num_microbatches=m, stages_per_rank=v, backward_weight_s=ones).peak_in_flight
    placement = stage_placement(schedule, p, v)
    for r, rank_peaks in enumerate(in_flight_peaks(schedule, p, m, v)):
        stages = [s for s in range(p * v) if placement[s] == r]
        for j, s in enumerate(stages):
            assert max(counts[j] for counts in rank_peaks) == own[s]
        assert max(sum(counts) for counts in rank_peaks) <= sum(own[s] for s in stages)


def test_megatron_530b_rank_0_holds_139_micro_batches_not_174() -> None:
    """[KORTH]'s 530B at 280 GPUs (pp 35, 3 chunks a rank, m 280, benchmarks/published.py): rank 0's chunks peak at
    70, 69 and 35 micro-batches in flight, 174 summed, but the rank holds at most 139 at once: torch's and
    Megatron-LM's warm-up, (v − 1)·p + 2(p − 1) = 138 forwards, and one more."""
    p, v, m = 35, 3, 280
    own = simulate("Interleaved1F1B", [1.0] * (p * v), [1.0] * (p * v), num_microbatches=m, stages_per_rank=v)
    assert [own.peak_in_flight[s] for s in (0, 35, 70)] == [70, 69, 35]
    rank0 = in_flight_peaks("Interleaved1F1B", p, m, v)[0]
    most = max(rank0, key=sum)
    assert most == (69, 35, 35) and sum(most) == 139 == (v - 1) * p + 2 * (p - 1) + 1
    order = [(a.stage, a.op, a.microbatch) for a in pipeline_order("Interleaved1F1B", p, m, v)[0]]
    per_stage = [1.0 if s in (0, 35, 70) else 0.0 for s in range(p * v)]
    assert reference.rank_activation_bytes(order, per_stage) == 139
