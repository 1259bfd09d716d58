"""Tests of the exact stage partition against brute force over every composition of the chain."""

from __future__ import annotations

import itertools
import math
import random
import re
from typing import Any

import pytest

from pyplan import _core
from pyplan.solve import partition
from tests.solve.reference import evaluate_partition, partition_brute_force

REL = 1e-9  # only float summation order may differ
_CHAIN = ("fwd_time_s", "bwd_time_s", "act_bytes", "state_bytes", "cut_bytes")


def _instance(rng: random.Random, *, max_blocks: int = 9, max_stages: int = 4) -> dict[str, Any]:
    """A random chain with communication and per-stage memory limits near the edge of feasibility.

    Half the instances draw small integers, so that many partitions tie and the tie handling is exercised.
    """
    num_blocks = rng.randint(1, max_blocks)
    num_stages = rng.randint(1, min(max_stages, num_blocks))
    integers = rng.random() < 0.5

    def time_s() -> float:
        return float(rng.randint(1, 3)) if integers else rng.uniform(0.05, 1.0)

    kwargs: dict[str, Any] = {
        "fwd_time_s": [time_s() for _ in range(num_blocks)],
        "bwd_time_s": [time_s() for _ in range(num_blocks)],
        "act_bytes": [float(rng.randint(0, 100)) for _ in range(num_blocks)],
        "state_bytes": [float(rng.randint(0, 100)) for _ in range(num_blocks)],
        "cut_bytes": [float(rng.randint(0, 100)) for _ in range(num_blocks + 1)],
        "num_stages": num_stages,
        "num_microbatches": rng.randint(1, 8),
        "schedule": rng.choice(["GPipe", "1F1B"]),
        "latency_s": 0.0 if integers else rng.choice([0.0, rng.uniform(0.0, 0.2)]),
        "bw_bytes_per_s": 100.0 if integers else rng.choice([math.inf, rng.uniform(50.0, 1000.0)]),
    }
    # Limits around what a random partition needs: some instances fit, some do not.
    inner = sorted(rng.sample(range(1, num_blocks), num_stages - 1))
    probe = evaluate_partition(
        [0, *inner, num_blocks], **_without(kwargs, "num_stages"), mem_limit_bytes=[0.0] * num_stages
    )
    need = [s + a for s, a in zip(probe.stage_state_bytes, probe.stage_act_bytes, strict=True)]
    kwargs["mem_limit_bytes"] = [float(round(n * rng.uniform(0.7, 1.6))) for n in need]
    return kwargs


def _without(kwargs: dict[str, Any], *names: str) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in names}


def _chain(kwargs: dict[str, Any]) -> list[Any]:
    return [kwargs[k] for k in ("fwd_time_s", "bwd_time_s", "act_bytes", "state_bytes", "cut_bytes")]


def _check_against_brute_force(kwargs: dict[str, Any], objective: str) -> None:
    got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN), objective=objective)
    want = partition_brute_force(*_chain(kwargs), **_without(kwargs, *_CHAIN))
    best = want.best_pipeline_time if objective == "pipeline_time" else want.best_bottleneck
    assert got.feasible == (best is not None), kwargs
    if not got.feasible:
        assert got.reason.startswith(f"no partition into {kwargs['num_stages']} stages fits"), got.reason
        assert got.overflow.overflow_bytes == pytest.approx(want.least_overflow_bytes, rel=REL)
        assert got.overflow.overflow_bytes > 0
        assert got.overflow.need_bytes > got.overflow.limit_bytes
        return
    assert best is not None
    cuts = got.cuts
    assert len(cuts) == kwargs["num_stages"] + 1 and cuts[0] == 0 and cuts[-1] == len(kwargs["fwd_time_s"])
    assert all(a < b for a, b in itertools.pairwise(cuts))
    # The returned boundaries reproduce every returned figure, and they fit.
    mine = evaluate_partition(cuts, *_chain(kwargs), **_without(kwargs, *_CHAIN, "num_stages"))
    assert mine.fits
    assert got.stage_time_s == pytest.approx(mine.stage_time_s, rel=REL)
    assert got.stage_state_bytes == pytest.approx(mine.stage_state_bytes, rel=REL)
    assert got.stage_act_bytes == pytest.approx(mine.stage_act_bytes, rel=REL)
    assert got.pipeline_time_s == pytest.approx(mine.pipeline_time_s, rel=REL)
    assert got.bottleneck_s == pytest.approx(mine.bottleneck_s, rel=REL)
    # And they are optimal.
    if objective == "pipeline_time":
        assert got.pipeline_time_s == pytest.approx(best.pipeline_time_s, rel=REL), kwargs
    else:
        assert got.bottleneck_s == pytest.approx(best.bottleneck_s, rel=REL), kwargs
        assert mine.sum_s == pytest.approx(best.sum_s, rel=REL), kwargs


@pytest.mark.parametrize("objective", ["pipeline_time", "bottleneck"])
def test_equals_brute_force_on_random_chains(objective: str) -> None:
    rng = random.Random(20240501)
    feasible = 0
    for _ in range(600):
        kwargs = _instance(rng)
        _check_against_brute_force(kwargs, objective)
        feasible += partition(*_chain(kwargs), **_without(kwargs, *_CHAIN)).feasible
    assert 200 < feasible < 500  # both outcomes are exercised


def test_equals_brute_force_on_longer_chains() -> None:
    rng = random.Random(7)
    for _ in range(40):
        kwargs = _instance(rng, max_blocks=14, max_stages=6)
        _check_against_brute_force(kwargs, "pipeline_time")


def test_equals_brute_force_when_communication_dominates() -> None:
    # Few micro-batches and costly, uneven boundaries: the least sum G(B) keeps falling as the bound B grows,
    # so the optimum often lies strictly between bottleneck candidates that the solver evaluates first.
    rng = random.Random(11)
    for _ in range(300):
        num_blocks = rng.randint(6, 12)
        num_stages = rng.randint(2, 4)
        kwargs: dict[str, Any] = {
            "fwd_time_s": [rng.uniform(0.05, 1.0) for _ in range(num_blocks)],
            "bwd_time_s": [rng.uniform(0.05, 1.0) for _ in range(num_blocks)],
            "act_bytes": [0.0] * num_blocks,
            "state_bytes": [0.0] * num_blocks,
            "cut_bytes": [rng.uniform(0.0, 100.0) for _ in range(num_blocks + 1)],
            "num_stages": num_stages,
            "num_microbatches": rng.randint(2, 3),
            "mem_limit_bytes": [math.inf] * num_stages,
            "latency_s": 0.0,
            "bw_bytes_per_s": 50.0,
        }
        _check_against_brute_force(kwargs, "pipeline_time")


@pytest.mark.parametrize("objective", ["pipeline_time", "bottleneck"])
def test_per_stage_in_flight_equals_brute_force(objective: str) -> None:
    # Any counts in [1, m] (an interleaved schedule's simulated peaks, say) replace the schedule's rule.
    rng = random.Random(41)
    feasible = 0
    for _ in range(300):
        kwargs = _instance(rng)
        m = kwargs["num_microbatches"]
        kwargs["in_flight_per_stage"] = [rng.randint(1, m) for _ in range(kwargs["num_stages"])]
        _check_against_brute_force(kwargs, objective)
        got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
        feasible += got.feasible
        if got.feasible:
            assert got.stage_in_flight == kwargs["in_flight_per_stage"]
    assert 50 < feasible < 250


@pytest.mark.parametrize("objective", ["pipeline_time", "bottleneck"])
def test_receive_buffers_equal_brute_force(objective: str) -> None:
    # What a stage holds beside its activations, in tensors of its input cut (receive buffers posted ahead, the
    # rest of the batch on the first stage) and of its output cut (output gradients, a kept send): they depend on
    # both cuts of a stage, which the DP's windows and the overflow DP must get right.
    rng = random.Random(77)
    feasible = 0
    for k in range(400):
        kwargs = _instance(rng)
        p, m = kwargs["num_stages"], kwargs["num_microbatches"]
        kwargs["input_buffer_cuts"] = [rng.randint(0, m) for _ in range(p)]
        if k % 2:
            kwargs["output_buffer_cuts"] = [rng.randint(0, m + 1) for _ in range(p)]
        _check_against_brute_force(kwargs, objective)
        got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
        feasible += got.feasible
    assert 50 < feasible < 350


@pytest.mark.parametrize("objective", ["pipeline_time", "bottleneck"])
def test_fresh_gradients_equal_brute_force(objective: str) -> None:
    # Stages that make their gradients (part of their state) after their activations peak leave out
    # min(gradients, in flight x saved activations): max(S, S - G + n A), which the DP's prefix-sum windows and the
    # overflow DP must get right, beside stages that count every gradient.
    rng = random.Random(93)
    feasible = relieved = 0
    for _ in range(400):
        kwargs = _instance(rng)
        p = kwargs["num_stages"]
        kwargs["grad_bytes"] = [rng.choice((0.0, 1.0, rng.uniform(0.2, 1.0))) * x for x in kwargs["state_bytes"]]
        kwargs["fresh_grads"] = [rng.random() < 0.7 for _ in range(p)]
        _check_against_brute_force(kwargs, objective)
        got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
        feasible += got.feasible
        if got.feasible:
            mine = evaluate_partition(got.cuts, *_chain(kwargs), **_without(kwargs, *_CHAIN, "num_stages"))
            assert got.stage_unmade_grad_bytes == pytest.approx(mine.stage_unmade_grad_bytes, rel=REL)
            relieved += any(x > 0 for x in got.stage_unmade_grad_bytes)
    assert 50 < feasible < 350 and relieved > 50


def test_fresh_gradients_leave_out_those_not_made_at_the_peak() -> None:
    # GPipe, 2 micro-batches: the block holds 100 of state (40 of them gradients) and saves 30 a micro-batch beside
    # its input cut of 5: 100 + 2 x 35 = 170 counted, 170 - min(40, 60) = 130 with fresh gradients; with saved
    # activations of 10, every gradient is held at the step: 100 + 2 x 15 - min(40, 20) = 110.
    args = ([1.0], [1.0], [30.0], [100.0], [5.0, 5.0])
    options = dict(num_stages=1, num_microbatches=2, schedule="GPipe", grad_bytes=[40.0])
    counted = partition(*args, mem_limit_bytes=[130.0], **options)
    assert not counted.feasible and counted.overflow.need_bytes == 170.0
    got = partition(*args, mem_limit_bytes=[130.0], fresh_grads=[True], **options)
    assert got.feasible and got.stage_unmade_grad_bytes == [40.0] and got.stage_act_bytes == [70.0]
    short = partition(*args, mem_limit_bytes=[129.0], fresh_grads=[True], **options)
    assert not short.feasible and short.overflow.need_bytes == 130.0
    assert "- gradients not yet made 40 B" in short.reason
    small = partition([1.0], [1.0], [10.0], [100.0], [5.0, 5.0], mem_limit_bytes=[109.0], fresh_grads=[True],
                      **options)  # fmt: skip
    assert not small.feasible and small.overflow.need_bytes == 110.0


def test_gradients_beyond_the_state_are_refused() -> None:
    with pytest.raises(ValueError, match=r"grad_bytes\[0\]"):
        partition([1.0], [1.0], [1.0], [10.0], [1.0, 1.0], num_stages=1, num_microbatches=1, mem_limit_bytes=[1e9],
                  grad_bytes=[11.0])  # fmt: skip
    with pytest.raises(ValueError, match="fresh_grads must be empty or have one entry per stage"):
        partition([1.0], [1.0], [1.0], [10.0], [1.0, 1.0], num_stages=1, num_microbatches=1, mem_limit_bytes=[1e9],
                  fresh_grads=[True, False])  # fmt: skip


def test_equals_brute_force_when_sends_and_cuts_are_uneven() -> None:
    # Boundaries that cost more than blocks and input cuts larger than a block's activations: the ranges a
    # stage may cover are then not contiguous in their first cut, which the DP's window must get right.
    rng = random.Random(5)
    for _ in range(300):
        num_blocks = rng.randint(5, 12)
        num_stages = rng.randint(2, min(5, num_blocks))
        kwargs: dict[str, Any] = {
            "fwd_time_s": [rng.uniform(0.01, 0.5) for _ in range(num_blocks)],
            "bwd_time_s": [rng.uniform(0.01, 0.5) for _ in range(num_blocks)],
            "act_bytes": [float(rng.randint(0, 20)) for _ in range(num_blocks)],
            "state_bytes": [float(rng.randint(0, 50)) for _ in range(num_blocks)],
            "cut_bytes": [float(rng.choice([0, 1, 2, 200])) for _ in range(num_blocks + 1)],
            "num_stages": num_stages,
            "num_microbatches": rng.randint(1, 6),
            "schedule": rng.choice(["GPipe", "1F1B"]),
            "latency_s": rng.choice([0.0, 0.3]),
            "bw_bytes_per_s": 100.0,
        }
        inner = sorted(rng.sample(range(1, num_blocks), num_stages - 1))
        probe = evaluate_partition(
            [0, *inner, num_blocks], **_without(kwargs, "num_stages"), mem_limit_bytes=[0.0] * num_stages
        )
        need = max(s + a for s, a in zip(probe.stage_state_bytes, probe.stage_act_bytes, strict=True))
        kwargs["mem_limit_bytes"] = [float(round(need * rng.uniform(0.6, 1.3)))] * num_stages
        for objective in ("pipeline_time", "bottleneck"):
            _check_against_brute_force(kwargs, objective)


@pytest.mark.parametrize("case", ["p=1", "p=L", "m=1"])
def test_special_cases(case: str) -> None:
    rng = random.Random(case)
    for _ in range(100):
        kwargs = _instance(rng)
        num_blocks = len(kwargs["fwd_time_s"])
        if case == "p=1":
            kwargs["num_stages"] = 1
        elif case == "p=L":
            kwargs["num_stages"] = num_blocks
        else:
            kwargs["num_microbatches"] = 1
        kwargs["mem_limit_bytes"] = (kwargs["mem_limit_bytes"] * num_blocks)[: kwargs["num_stages"]]
        for objective in ("pipeline_time", "bottleneck"):
            _check_against_brute_force(kwargs, objective)
        got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
        if got.feasible and case != "m=1":
            assert got.cuts == (list(range(num_blocks + 1)) if case == "p=L" else [0, num_blocks])
        if got.feasible and case == "m=1":
            assert got.pipeline_time_s == pytest.approx(sum(got.stage_time_s), rel=REL)


def test_stage_time_and_memory_conventions() -> None:
    # Stage 0 pays the send of cut 1 forward; stage 1 the gradient send of cut 1 backward: 0.5 + 50/100 each.
    got = partition(
        [1.0, 2.0], [3.0, 4.0], [10.0, 20.0], [100.0, 200.0], [1.0, 50.0, 7.0],
        num_stages=2, num_microbatches=3, mem_limit_bytes=[1e9, 1e9], schedule="1F1B",
        latency_s=0.5, bw_bytes_per_s=100.0,
    )  # fmt: skip
    assert got.cuts == [0, 1, 2]
    assert got.stage_time_s == [5.0, 7.0]
    assert got.pipeline_time_s == 12.0 + 2 * 7.0
    # 1F1B: stage 0 holds min(3, 2) micro-batches, stage 1 one; each keeps its input cut.
    assert got.stage_in_flight == [2, 1]
    assert got.stage_act_bytes == [2 * (10.0 + 1.0), 1 * (20.0 + 50.0)]
    assert got.stage_state_bytes == [100.0, 200.0]


def test_bottleneck_is_the_many_microbatch_limit() -> None:
    # With m huge, the pipeline-time optimum is the min-max partition (same in-flight memory under 1F1B).
    rng = random.Random(3)
    for _ in range(50):
        kwargs = _instance(rng)
        kwargs["mem_limit_bytes"] = [math.inf] * kwargs["num_stages"]
        kwargs["schedule"] = "1F1B"
        kwargs["num_microbatches"] = 10**9
        many = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
        limit = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN), objective="bottleneck")
        assert many.bottleneck_s == pytest.approx(limit.bottleneck_s, rel=REL)


def test_infeasible_reason_names_the_stage_and_the_bytes() -> None:
    # Block 1 alone needs 10 + 8 × (90 + 5) = 770 bytes under GPipe with 8 micro-batches; the limit is 500.
    got = partition(
        [1.0] * 3, [1.0] * 3, [1.0, 90.0, 1.0], [10.0] * 3, [5.0] * 4,
        num_stages=3, num_microbatches=8, mem_limit_bytes=[500.0] * 3, schedule="GPipe",
    )  # fmt: skip
    assert not got.feasible
    assert (got.overflow.stage, got.overflow.begin_cut, got.overflow.end_cut) == (1, 1, 2)
    assert got.overflow.need_bytes == 770.0 and got.overflow.in_flight == 8
    assert got.reason == (
        "no partition into 3 stages fits in memory; the best overflows by 270 B: stage 1 (block 1) needs "
        "770 B (state 10 B + 8 micro-batches in flight x 95 B), limit 500 B"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_stages": 0}, "num_stages must be in [1, 3]"),
        ({"num_stages": 4, "mem_limit_bytes": [1.0] * 4}, "num_stages must be in [1, 3]"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"mem_limit_bytes": [1.0]}, "mem_limit_bytes must have one entry per stage (2)"),
        ({"cut_bytes": [0.0] * 3}, "cut_bytes must have one entry per cut"),
        ({"fwd_time_s": [1.0, -1.0, 1.0]}, "fwd_time_s[1] must be in [0, 1e+100], got -1"),
        ({"schedule": "Interleaved1F1B"}, "partition knows the in-flight micro-batches of"),
        ({"objective": "cost"}, "objective must be 'pipeline_time' or 'bottleneck'"),
        ({"bw_bytes_per_s": 0.0}, "link bw_bytes_per_s must be in [0.001, inf], got 0"),
        ({"in_flight_per_stage": [1]}, "in_flight_per_stage must be empty or have one entry per stage (2), got 1"),
        ({"in_flight_per_stage": [1, 0]}, "in_flight_per_stage[1] must be in [1, 2], got 0"),
        ({"in_flight_per_stage": [3, 1]}, "in_flight_per_stage[0] must be in [1, 2], got 3"),
        ({"input_buffer_cuts": [1]}, "input_buffer_cuts must be empty or have one entry per stage (2), got 1"),
        ({"output_buffer_cuts": [0, -1]}, "output_buffer_cuts[1] must be in [0, 1000000000000000000], got -1"),
    ],
)
def test_bad_input_raises(change: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {
        "fwd_time_s": [1.0] * 3, "bwd_time_s": [1.0] * 3, "act_bytes": [1.0] * 3, "state_bytes": [1.0] * 3,
        "cut_bytes": [1.0] * 4, "num_stages": 2, "num_microbatches": 2, "mem_limit_bytes": [1e9] * 2,
    }  # fmt: skip
    kwargs.update(change)
    with pytest.raises(ValueError, match=re.escape(message)):
        partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))


def test_large_chain_is_solved() -> None:
    # The size the issue targets (L = 200, p = 16); the optimum can be no worse than even splits.
    rng = random.Random(200)
    num_blocks, p = 200, 16
    kwargs: dict[str, Any] = {
        "fwd_time_s": [rng.uniform(1e-3, 5e-3) for _ in range(num_blocks)],
        "bwd_time_s": [rng.uniform(2e-3, 1e-2) for _ in range(num_blocks)],
        "act_bytes": [float(rng.randint(10**6, 10**8)) for _ in range(num_blocks)],
        "state_bytes": [float(rng.randint(10**7, 10**9)) for _ in range(num_blocks)],
        "cut_bytes": [float(rng.randint(10**6, 10**8)) for _ in range(num_blocks + 1)],
        "num_stages": p, "num_microbatches": 8, "schedule": "1F1B", "mem_limit_bytes": [80e9] * p,
        "latency_s": 1e-5, "bw_bytes_per_s": 25e9,
    }  # fmt: skip
    got = partition(*_chain(kwargs), **_without(kwargs, *_CHAIN))
    assert got.feasible
    for shift in range(num_blocks // p):
        cuts = [0, *(min(num_blocks - p + s, shift + s * (num_blocks // p)) for s in range(1, p)), num_blocks]
        even = evaluate_partition(cuts, *_chain(kwargs), **_without(kwargs, *_CHAIN, "num_stages"))
        assert even.fits
        assert got.pipeline_time_s <= even.pipeline_time_s * (1 + REL)


def test_held_cuts_follow_torchs_schedules() -> None:
    # The first stage holds the rest of the replica's batch; a later one, with fewer than m in flight, its last
    # input gradient (its receive buffers are the schedule's, _core.receive_buffers).
    assert [_core.held_input_cuts(4, n, 0) for n in (1, 2, 4)] == [3, 2, 0]
    assert [_core.held_input_cuts(4, n, 1) for n in (1, 2, 4)] == [1, 1, 0]
    # Schedule1F1B keeps the Work of its last warm-up send: on a non-last stage with w = min(m, p − s) >= 2
    # warm-ups, past that micro-batch's backward once the steady phase reaches backward w − 1 (m >= 2w − 1).
    held = {(m, p, s) for m in range(1, 9) for p in range(1, 5) for s in range(p)
            if _core.warmup_send_held("1F1B", m, p, s)}  # fmt: skip
    assert (4, 2, 0) in held and (3, 2, 0) in held and (2, 2, 0) not in held and (4, 2, 1) not in held
    assert (5, 3, 0) in held and (4, 3, 0) not in held and (4, 3, 1) in held
    assert not any(_core.warmup_send_held(name, 8, 2, 0) for name in ("GPipe", "Interleaved1F1B"))
