"""Tests of the pipeline schedule orders (against torch's) and of their event simulation."""

from __future__ import annotations

import random

import pytest
from _sim_reference import reference_simulate
from _torch_orders import executed_order, lowered_order
from _torch_orders import pipeline_order as torch_pipeline_order

from pyplan import _core
from pyplan.errors import PlanError
from pyplan.solve.schedules import (
    SCHEDULES,
    Action,
    pipeline_order,
    simulate,
    simulate_order,
    stage_placement,
    torch_rejection,
)
from tests.solve import reference

# The stages per rank each schedule accepts (the loop-placed multi-stage ones: any; tried with these).
STAGES_PER_RANK = {"GPipe": (1,), "1F1B": (1,), "ZBVZeroBubble": (2,), "DualPipeV": (2,)}
LOOPED = (1, 2, 3, 4)


def _tokens(order: list[list[Action]]) -> list[list[str]]:
    return [[str(a) for a in rank] for rank in order]


def _shapes() -> list[tuple[str, int, int, int]]:
    shapes = []
    for schedule in SCHEDULES:
        for p in (2, 4):
            for m in (1, 2, 4, 8):
                shapes.extend((schedule, p, m, v) for v in STAGES_PER_RANK.get(schedule, LOOPED))
    # Shapes where torch's interleaved schedules use uneven rounds or reject m.
    shapes += [(s, 4, m, 2) for s in ("Interleaved1F1B", "InterleavedZeroBubble") for m in (6, 9, 10)]
    return shapes


# --- sends, receives and the receive buffers ---------------------------------------------------------------

_MESSAGES = {("send", "F"): "SEND_F", ("receive", "F"): "RECV_F", ("send", "B"): "SEND_B", ("receive", "B"): "RECV_B"}


def _lowered_tokens(schedule: str, p: int, m: int, v: int) -> list[list[str]]:
    """_core.lower_order in torch's spelling ("1RECV_F0", "1F0")."""
    return [
        [f"{s}{op}{k}" if step == "compute" else f"{s}{_MESSAGES[(step, op)]}{k}" for step, s, op, k in rank]
        for rank in _core.lower_order(schedule, p, m, v)
    ]


def _accepted() -> list[tuple[str, int, int, int]]:
    return [shape for shape in _shapes() if not torch_rejection(*shape)]


@pytest.mark.parametrize(("schedule", "p", "m", "v"), _accepted())
def test_lowered_order_is_torchs(schedule: str, p: int, m: int, v: int) -> None:
    """The receives go where torch posts them: before the computation that reads them, in the order GPipe's and
    1F1B's _step_microbatches ask for them; for the multi-stage schedules where torch's own lowering puts them
    (`_add_send_recv`) in the compute order without idle slots, the order pyplan's runtime hands torch."""
    ours = _lowered_tokens(schedule, p, m, v)
    if schedule in ("GPipe", "1F1B"):
        no_sends = [[t for t in rank if "SEND" not in t] for rank in ours]
        assert no_sends == executed_order(schedule, p, m, receives=True)
        return
    order = [[(a.stage, a.op, a.microbatch) for a in rank] for rank in pipeline_order(schedule, p, m, v)]
    assert ours == lowered_order(schedule, order, stage_placement(schedule, p, v))


@pytest.mark.parametrize(("schedule", "p", "m", "v"), _accepted())
def test_receive_buffers_equal_reference(schedule: str, p: int, m: int, v: int) -> None:
    got = _core.receive_buffers(schedule, p, m, v)
    placement = stage_placement(schedule, p, v)
    order = [[(a.stage, a.op, a.microbatch) for a in rank] for rank in pipeline_order(schedule, p, m, v)]
    inputs, gradients = reference.receive_buffers(reference.lower_order(schedule, order, placement), placement)
    assert (got["inputs"], got["gradients"]) == (inputs, gradients)
    # A stage that receives its input holds at least the micro-batches in flight in receive buffers.
    peak = simulate(schedule, [1.0] * (p * v), [1.0] * (p * v), backward_weight_s=[0.5] * (p * v),
                    num_microbatches=m, stages_per_rank=v).peak_in_flight  # fmt: skip
    for s in range(1, p * v):
        if placement[s - 1] != placement[s]:
            assert got["inputs"][s] >= peak[s]
        else:
            assert got["inputs"][s] == 0


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 64), (8, 16)])
def test_gpipe_and_1f1b_receive_just_in_time(p: int, m: int) -> None:
    """Each receive just before its computation: the inputs in flight, and one output gradient, the backward's."""
    for schedule in ("GPipe", "1F1B"):
        got = _core.receive_buffers(schedule, p, m, 1)
        n = [m if schedule == "GPipe" else min(m, p - s) for s in range(p)]
        assert got["inputs"] == [0, *n[1:]]
        assert got["gradients"] == [1] * (p - 1) + [0]


def test_receive_buffers_do_not_grow_with_the_micro_batches_of_interleaved_schedules() -> None:
    """Interleaved 1F1B holds what is in flight (Narayanan et al. 2021), not all m: the same counts at 8 and 64."""
    for schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        few, many = _core.receive_buffers(schedule, 4, 8, 2), _core.receive_buffers(schedule, 4, 64, 2)
        assert few == many and max(many["inputs"]) == 8 and max(many["gradients"]) <= 4


# --- the order is torch's order ------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "p", "m", "v"), _shapes())
def test_order_equals_torch(schedule: str, p: int, m: int, v: int) -> None:
    try:
        theirs = torch_pipeline_order(schedule, p, m, v)
    except ValueError:
        theirs = None
    reason = torch_rejection(schedule, p, m, v)
    if theirs is None:
        assert reason, f"torch rejects {schedule} p={p} m={m} v={v}, pyplan accepts it"
        with pytest.raises(PlanError, match="micro-batches"):
            pipeline_order(schedule, p, m, v)
        return
    assert reason == ""
    ours = _tokens(pipeline_order(schedule, p, m, v))
    if schedule == "1F1B":
        # Schedule1F1B.pipeline_order numbers the last rank's forwards from 1 (test below); the ranks before
        # it, and the order _step_microbatches actually runs, agree.
        assert ours[:-1] == theirs[:-1]
    else:
        assert ours == theirs
    if schedule in ("GPipe", "1F1B"):
        assert ours == executed_order(schedule, p, m)


def test_torch_1f1b_pipeline_order_numbers_last_rank_from_one() -> None:
    """A quirk of torch 2.13: Schedule1F1B.pipeline_order (used for display, not for running) gives the
    last rank F1..Fm instead of F0..F(m-1). Failing means torch fixed it: fold 1F1B into the test above."""
    p, m = 4, 8
    ours = pipeline_order("1F1B", p, m)[-1]
    shifted = [str(Action(a.stage, a.op, a.microbatch + (a.op == "F"))) for a in ours]
    assert torch_pipeline_order("1F1B", p, m, 1)[-1] == shifted


def test_placement() -> None:
    assert stage_placement("Interleaved1F1B", 4, 2) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_placement("ZBVZeroBubble", 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stage_placement("GPipe", 3) == [0, 1, 2]


# --- closed forms on balanced stages -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 2), (2, 8), (4, 4), (4, 8), (8, 32)])
def test_makespan_and_bubble_of_gpipe_and_1f1b(schedule: str, p: int, m: int) -> None:
    f, b = 1.5, 2.5
    sim = simulate(schedule, [f] * p, [b] * p, num_microbatches=m)
    assert sim.makespan_s == pytest.approx((m + p - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert all(busy == pytest.approx(m * (f + b)) for busy in sim.busy_s)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (3, 9, 3)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_interleaving_divides_the_bubble_by_v(schedule: str, p: int, m: int, v: int, f: float, b: float) -> None:
    """Each of v chunks takes F/v and B/v: the pipeline's fill and drain shrink to (p−1)/v·(F+B)."""
    sim = simulate(schedule, [f / v] * (p * v), [b / v] * (p * v), num_microbatches=m, stages_per_rank=v)
    assert sim.makespan_s == pytest.approx((m + (p - 1) / v) * (f + b))


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (4, 2), (4, 4), (4, 8)])
def test_in_flight_gpipe_holds_every_microbatch(p: int, m: int) -> None:
    assert simulate("GPipe", [1.0] * p, [2.0] * p, num_microbatches=m).peak_in_flight == (m,) * p


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_in_flight_1f1b_is_min_m_p_minus_s(p: int, m: int) -> None:
    rng = random.Random(p * 100 + m)
    forward = [rng.uniform(0.5, 2.0) for _ in range(p)]
    backward = [rng.uniform(0.5, 4.0) for _ in range(p)]
    sim = simulate("1F1B", forward, backward, num_microbatches=m, send_forward_s=0.1, send_backward_s=0.2)
    assert sim.peak_in_flight == tuple(min(m, p - s) for s in range(p))


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zero_bubble_schedules_meet_the_fill_bound(schedule: str, p: int, m: int) -> None:
    """With F = I = W = t per chunk, each rank computes 6·m·t, and the last rank cannot start before the first
    micro-batch has crossed p−1 stages: makespan ≥ (6m + p − 1)·t. These schedules attain it."""
    t = 1.0
    n = 2 * p
    sim = simulate(schedule, [t] * n, [2 * t] * n, backward_weight_s=[t] * n, num_microbatches=m)
    assert sim.makespan_s == pytest.approx((6 * m + p - 1) * t)


# --- the C++ simulator equals the Python reference --------------------------------------------------------


def _random_case(rng: random.Random) -> tuple[str, int, int, int]:
    while True:
        schedule = rng.choice(SCHEDULES)
        p = rng.randint(1, 5)
        m = rng.randint(1, 12)
        v = rng.choice(STAGES_PER_RANK.get(schedule, LOOPED))
        if not torch_rejection(schedule, p, m, v):
            return schedule, p, m, v


@pytest.mark.parametrize("seed", range(60))
def test_simulator_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    schedule, p, m, v = _random_case(rng)
    n = p * v
    forward = [rng.uniform(0.1, 2.0) for _ in range(n)]
    backward = [rng.uniform(0.1, 4.0) for _ in range(n)]
    weight = [rng.uniform(0.0, 1.0) * bwd for bwd in backward]
    send_f = [rng.choice([0.0, rng.uniform(0.0, 0.5)]) for _ in range(n - 1)]
    send_b = [rng.choice([0.0, rng.uniform(0.0, 0.5)]) for _ in range(n - 1)]
    order = pipeline_order(schedule, p, m, v)
    placement = stage_placement(schedule, p, v)

    sim = simulate(
        schedule,
        forward,
        backward,
        num_microbatches=m,
        stages_per_rank=v,
        backward_weight_s=weight,
        send_forward_s=send_f,
        send_backward_s=send_b,
    )
    ref = reference_simulate([list(r) for r in order], placement, forward, backward, weight, send_f, send_b)

    assert sim.makespan_s == pytest.approx(ref["makespan_s"], rel=1e-12)
    assert sim.busy_s == pytest.approx(ref["busy_s"], rel=1e-12)
    assert sim.idle_s == pytest.approx(ref["idle_s"], rel=1e-12, abs=1e-12)
    assert list(sim.peak_in_flight) == ref["peak_in_flight"]
    assert [e[:4] for e in sim.events] == [e[:4] for e in ref["events"]]
    for ours, theirs in zip(sim.events, ref["events"], strict=True):
        assert ours.start_s == pytest.approx(theirs[4], rel=1e-12)
        assert ours.end_s == pytest.approx(theirs[5], rel=1e-12)


def test_send_time_is_paid_between_ranks_only() -> None:
    """Two stages, one micro-batch: F0, send, F1, B1, send, B0. On a V the tip stages share a rank."""
    sim = simulate("GPipe", [1.0, 1.0], [2.0, 2.0], num_microbatches=1, send_forward_s=0.5, send_backward_s=0.25)
    assert sim.makespan_s == pytest.approx(1 + 0.5 + 1 + 2 + 0.25 + 2)
    zbv = simulate(
        "ZBVZeroBubble",
        [1.0] * 4,
        [2.0] * 4,
        backward_weight_s=[1.0] * 4,
        num_microbatches=1,
        send_forward_s=[0.5, 0.0, 0.5],
    )
    one_rank_hop = simulate(
        "ZBVZeroBubble",
        [1.0] * 4,
        [2.0] * 4,
        backward_weight_s=[1.0] * 4,
        num_microbatches=1,
        send_forward_s=[0.5, 9.0, 0.5],
    )
    assert zbv.makespan_s == one_rank_hop.makespan_s  # boundary 1 joins stages 1 and 2, both on rank 1


# --- errors -----------------------------------------------------------------------------------------------


def test_deadlock_is_an_error() -> None:
    """Rank 1 waits for 0F1, which rank 0 runs after 0B0, which waits for 1B0, which rank 1 runs after 1F1."""
    order = [
        [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
        [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)],
    ]
    with pytest.raises(PlanError, match=r"deadlocks: rank 0 at 0B0, rank 1 at 1F1"):
        simulate_order(order, [0, 1], [1.0, 1.0], [1.0, 1.0], num_microbatches=2)
    with pytest.raises(PlanError, match=r"deadlocks: rank 0 at 0W0"):
        simulate_order(
            [[(0, "F", 0), (0, "W", 0), (0, "I", 0)]],
            [0],
            [1.0],
            [1.0],
            num_microbatches=1,
            backward_weight_s=[0.5],
        )


@pytest.mark.parametrize(
    ("order", "placement", "message"),
    [
        (
            [[(0, "B", 0)], [(0, "F", 0), (1, "F", 0), (1, "B", 0)]],
            [0, 1],
            "0F0 is on rank 1, but stage 0 is placed on rank 0",
        ),
        ([[(0, "F", 0)], [(1, "F", 0), (1, "B", 0)]], [0, 1], "stage 0 micro-batch 0 has 1 F, 0 B"),
        ([[(0, "F", 0), (0, "B", 0), (0, "B", 0)], [(1, "F", 0), (1, "B", 0)]], [0, 1], "has 1 F, 2 B"),
        (
            [[(0, "F", 0), (0, "B", 2)], [(1, "F", 0), (1, "B", 0)]],
            [0, 1],
            "outside 2 stages and 1 micro-batches",
        ),
        ([[(0, "F", 0), (0, "X", 0)], [(1, "F", 0), (1, "B", 0)]], [0, 1], "unknown action kind 'X'"),
    ],
)
def test_bad_orders(order: list, placement: list[int], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        simulate_order(order, placement, [1.0, 1.0], [1.0, 1.0], num_microbatches=1)


def test_bad_times_and_shapes() -> None:
    with pytest.raises(PlanError, match="give backward_weight_s"):
        simulate("ZBVZeroBubble", [1.0] * 4, [1.0] * 4, num_microbatches=2)
    with pytest.raises(PlanError, match=r"backward_weight_s 2\.0+ exceeds backward_s 1\.0+"):
        simulate("ZBVZeroBubble", [1.0] * 4, [1.0] * 4, backward_weight_s=[2.0] * 4, num_microbatches=2)
    with pytest.raises(PlanError, match=r"forward_s\[1\] = -1\.0+ is not a finite time"):
        simulate("GPipe", [1.0, -1.0], [1.0, 1.0], num_microbatches=2)
    with pytest.raises(PlanError, match="send_forward_s has 2 entries for 1 stage boundaries"):
        simulate("GPipe", [1.0, 1.0], [1.0, 1.0], num_microbatches=2, send_forward_s=[0.1, 0.2])
    with pytest.raises(PlanError, match=r"1F1B needs at least as many micro-batches as stages \(2 < 4\)"):
        simulate("1F1B", [1.0] * 4, [1.0] * 4, num_microbatches=2)
    with pytest.raises(PlanError, match="ZBVZeroBubble runs exactly 2 stages per rank"):
        pipeline_order("ZBVZeroBubble", 2, 4, 3)
    with pytest.raises(PlanError, match="unknown schedule 'PipeDream'"):
        pipeline_order("PipeDream", 2, 4)
    with pytest.raises(PlanError, match="5 stages do not split into 2 stages per rank"):
        simulate("Interleaved1F1B", [1.0] * 5, [1.0] * 5, num_microbatches=2)
