"""Tests of the OR-Tools models: DAG stages against the chain DP and brute force, Checkmate against tree plans."""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from pyplan import cut_points, trace
from pyplan.errors import InfeasibleError, PlanError
from pyplan.remat_plan import Checkpoint, Keep, RematItem, RematPlan, no_remat
from pyplan.solve import partition
from pyplan.solve.ilp import (
    RematDag,
    StageDag,
    assign_stages,
    chain_ops,
    evaluate_stages,
    periodic_schedule,
    remat_schedule,
    replay_dag,
    stage_dag_from_layergraph,
)
from pyplan.solve.remat import RematChain, min_budget, plan_ops, replay, replay_ops, solve
from pyplan.units import fmt_bytes
from tests.solve.reference import evaluate_partition

REL = 1e-9  # stage times: only the rounding of seconds to CP-SAT's integer units may differ
LIMIT_S = 20.0  # a safety net: every instance here solves to optimality in well under a second

# ---------------------------------------------------------------------------------------------------------------
# A. Stage assignment
# ---------------------------------------------------------------------------------------------------------------

_CHAIN = ("fwd_time_s", "bwd_time_s", "act_bytes", "state_bytes", "cut_bytes")


def _chain_instance(rng: random.Random) -> dict[str, Any]:
    """A random chain with communication and memory limits near the edge of feasibility (as test_partition)."""
    n = rng.randint(2, 12)
    p = rng.randint(1, min(4, n))
    integers = rng.random() < 0.5

    def time_s() -> float:
        return float(rng.randint(1, 3)) if integers else rng.uniform(0.05, 1.0)

    kwargs: dict[str, Any] = {
        "fwd_time_s": [time_s() for _ in range(n)],
        "bwd_time_s": [time_s() for _ in range(n)],
        "act_bytes": [float(rng.randint(0, 100)) for _ in range(n)],
        "state_bytes": [float(rng.randint(0, 100)) for _ in range(n)],
        "cut_bytes": [float(rng.randint(0, 100)) for _ in range(n + 1)],
        "num_stages": p,
        "num_microbatches": rng.randint(1, 8),
        "schedule": rng.choice(["GPipe", "1F1B"]),
        "latency_s": 0.0 if integers else rng.choice([0.0, rng.uniform(0.0, 0.2)]),
        "bw_bytes_per_s": 100.0 if integers else rng.choice([math.inf, rng.uniform(50.0, 1000.0)]),
    }
    if rng.random() < 0.25:
        kwargs["in_flight_per_stage"] = [rng.randint(1, kwargs["num_microbatches"]) for _ in range(p)]
    inner = sorted(rng.sample(range(1, n), p - 1))
    probe = evaluate_partition(
        [0, *inner, n], **{k: v for k, v in kwargs.items() if k != "num_stages"}, mem_limit_bytes=[0.0] * p
    )
    need = [s + a for s, a in zip(probe.stage_state_bytes, probe.stage_act_bytes)]
    kwargs["mem_limit_bytes"] = [float(round(x * rng.uniform(0.7, 1.6))) for x in need]
    return kwargs


def _options(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _CHAIN}


def test_stages_of_a_chain_equal_the_partition_dp() -> None:
    # A chain as a path whose edges carry the cut bytes: every monotone assignment is a partition with the same cost.
    rng = random.Random(20240601)
    feasible = 0
    for k in range(40):
        kwargs = _chain_instance(rng)
        chain = [kwargs[name] for name in _CHAIN]
        want = partition(*chain, **_options(kwargs))
        dag = StageDag.from_chain(*chain)
        warm = k % 2 == 0
        if not want.feasible:
            message = f"the best overflows by {fmt_bytes(want.overflow.overflow_bytes)}"
            with pytest.raises(InfeasibleError, match=re.escape(message)):
                assign_stages(dag, **_options(kwargs), time_limit_s=LIMIT_S, warm_start=warm)
            continue
        feasible += 1
        got = assign_stages(dag, **_options(kwargs), time_limit_s=LIMIT_S, warm_start=warm)
        assert got.status == "optimal"
        assert got.warm_start == ("dp" if warm else "")
        assert got.pipeline_time_s == pytest.approx(want.pipeline_time_s, rel=REL), kwargs
        # The assignment is a partition, and partition.h's formulas give it the same figures.
        cuts = [0, *(v for v in range(1, len(dag)) if got.stage_of_node[v] != got.stage_of_node[v - 1]), len(dag)]
        assert len(cuts) == kwargs["num_stages"] + 1
        mine = evaluate_partition(cuts, *chain, **{k: v for k, v in _options(kwargs).items() if k != "num_stages"})
        assert mine.fits
        assert got.stage_time_s == pytest.approx(mine.stage_time_s, rel=REL)
        assert got.stage_act_bytes == pytest.approx(mine.stage_act_bytes, rel=REL)
        assert got.stage_state_bytes == pytest.approx(mine.stage_state_bytes, rel=REL)
    assert 10 < feasible < 35  # both outcomes are exercised


def _random_dag(rng: random.Random) -> StageDag:
    """A small branching DAG: skips, a graph input read late, a returned early value, maybe an unsendable node."""
    n = rng.randint(4, 7)
    edges = {(v - 1, v) for v in range(1, n) if rng.random() < 0.7}
    edges |= {(u, v) for v in range(2, n) for u in range(v - 1) if rng.random() < 0.25}
    input_edges = {(0, 0), *((rng.randint(0, 1), v) for v in range(1, n) if rng.random() < 0.2)}
    return StageDag(
        time_s=tuple(float(rng.randint(1, 5)) for _ in range(n)),
        state_bytes=tuple(float(rng.randint(0, 50)) for _ in range(n)),
        act_bytes=tuple(float(rng.randint(0, 30)) for _ in range(n)),
        out_bytes=tuple(float(rng.randint(0, 40)) for _ in range(n)),
        edges=tuple(sorted(edges)),
        input_bytes=(float(rng.randint(1, 30)), float(rng.randint(1, 30))),
        input_edges=tuple(sorted(input_edges)),
        output_nodes=tuple(sorted({n - 1, rng.randrange(n)})),
        unsendable=(rng.randrange(n - 1),) if rng.random() < 0.3 else (),
    )


def _as_chain(dag: StageDag, stage_of_node: Sequence[int], opts: dict[str, Any]) -> Any:
    """The assignment as a partition of the stage-sorted order, costed by reference.evaluate_partition."""
    order = sorted(range(len(dag)), key=lambda v: (stage_of_node[v], v))
    pos = {v: i for i, v in enumerate(order)}
    n = len(dag)
    last = [n if u in dag.output_nodes else max((pos[v] for x, v in dag.edges if x == u), default=-1) for u in order]
    last_in = [max((pos[v] for x, v in dag.input_edges if x == k), default=-1) for k in range(len(dag.input_bytes))]
    cut_bytes = [sum(dag.input_bytes)]
    for c in range(1, n + 1):
        nodes = sum(dag.out_bytes[order[i]] for i in range(c) if last[i] >= c)
        inputs = sum(b for k, b in enumerate(dag.input_bytes) if last_in[k] >= c)
        cut_bytes.append(nodes + inputs)
    p = max(stage_of_node) + 1
    cuts = [0, *(pos[min(v for v in range(n) if stage_of_node[v] == s)] for s in range(1, p)), n]
    return evaluate_partition(
        cuts,
        [dag.time_s[v] for v in order],
        [0.0] * n,
        [dag.act_bytes[v] for v in order],
        [dag.state_bytes[v] for v in order],
        cut_bytes,
        **{k: v for k, v in opts.items() if k != "num_stages"},
    )


def _monotone_assignments(dag: StageDag, p: int) -> list[tuple[int, ...]]:
    out = []
    for stages in itertools.product(range(p), repeat=len(dag)):
        if set(stages) != set(range(p)):
            continue
        if any(stages[u] > stages[v] for u, v in dag.edges):
            continue
        if any(stages[u] != stages[v] for u, v in dag.edges if u in dag.unsendable):
            continue
        if any(stages[u] != p - 1 for u in dag.unsendable if u in dag.output_nodes):
            continue
        out.append(stages)
    return out


def test_stages_of_a_branching_dag_equal_brute_force() -> None:
    rng = random.Random(7)
    feasible = infeasible = 0
    for _ in range(14):
        dag = _random_dag(rng)
        p = rng.randint(1, 3)
        opts: dict[str, Any] = {
            "num_stages": p,
            "num_microbatches": rng.randint(1, 6),
            "schedule": rng.choice(["GPipe", "1F1B"]),
            "latency_s": rng.choice([0.0, 0.5]),
            "bw_bytes_per_s": rng.choice([10.0, 100.0]),
            "mem_limit_bytes": [math.inf] * p,
        }
        candidates = _monotone_assignments(dag, p)
        if not candidates:
            with pytest.raises(InfeasibleError, match="keeps the unsendable values"):
                assign_stages(dag, **opts, time_limit_s=LIMIT_S)
            continue
        probe = _as_chain(dag, rng.choice(candidates), opts)
        need = [s + a for s, a in zip(probe.stage_state_bytes, probe.stage_act_bytes)]
        opts["mem_limit_bytes"] = [float(round(x * rng.uniform(0.8, 1.4))) for x in need]
        evaluated = [_as_chain(dag, a, opts) for a in candidates]
        fits = [e.pipeline_time_s for e in evaluated if e.fits]
        if not fits:
            infeasible += 1
            with pytest.raises(InfeasibleError, match=f"no assignment of the {len(dag)} nodes to {p} stages fits"):
                assign_stages(dag, **opts, time_limit_s=LIMIT_S)
            continue
        feasible += 1
        for warm in (True, False):
            got = assign_stages(dag, **opts, time_limit_s=LIMIT_S, warm_start=warm)
            assert got.status == "optimal"
            assert got.pipeline_time_s == pytest.approx(min(fits), rel=REL), (dag, opts)
            ref = _as_chain(dag, got.stage_of_node, opts)
            assert ref.fits
            assert got.stage_time_s == pytest.approx(ref.stage_time_s, rel=REL)
            assert got.stage_act_bytes == pytest.approx(ref.stage_act_bytes, rel=REL)
    assert feasible >= 6 and infeasible >= 2


def test_a_branch_can_leave_the_topological_order() -> None:
    # A stem (0), branches 1 → 2 and 3 → 4 of 2 s per node, a join (5); the outputs of 0, 2 and 4 are large. Every
    # split of the order 0..5 into two stages either sends a large output or is unbalanced; the DAG optimum puts
    # the heads of both branches (1 and 3) with the stem and their tails with the join, sending two small outputs.
    dag = StageDag(
        time_s=(0.0, 2.0, 2.0, 2.0, 2.0, 0.0),
        state_bytes=(0.0,) * 6,
        act_bytes=(0.0,) * 6,
        out_bytes=(100.0, 1.0, 100.0, 1.0, 100.0, 0.0),
        edges=((0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5)),
    )
    got = assign_stages(dag, num_stages=2, num_microbatches=4, mem_limit_bytes=[math.inf] * 2, bw_bytes_per_s=100.0)
    assert got.stage_of_node == (0, 0, 1, 0, 1, 1)
    assert got.boundary_bytes == (2.0,)
    assert got.pipeline_time_s == pytest.approx(2 * 4.02 + 3 * 4.02, rel=REL)
    # The chain DP over the order (the warm start) can do no better than 6 s per stage (0, 1, 2 | 3, 4, 5).
    order = evaluate_stages(dag, [0, 0, 0, 1, 1, 1], num_microbatches=4, bw_bytes_per_s=100.0)
    assert order.pipeline_time_s == pytest.approx(2 * 6.0 + 3 * 6.0, rel=REL)


class TwoInputSkip(nn.Module):
    """A skip tensor over four layers and a second model input used only at the end (as test_linearize's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.mid = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        skip = self.a(x)
        return self.b(self.mid(skip) + skip) * scale


def test_layergraph_boundaries_carry_what_linearize_says_crosses_each_cut() -> None:
    graph = trace(TwoInputSkip(), (torch.randn(3, 8), torch.randn(3, 1)))
    points = cut_points(graph)
    dag = stage_dag_from_layergraph(graph, batch_size=4, time_s={name: 1.0 for name in points.order})
    assert dag.names == tuple(points.order)
    n = len(dag)
    for c in range(1, n):
        stages = [0] * c + [1] * (n - c)
        got = evaluate_stages(dag, stages, num_microbatches=1)
        assert got.boundary_bytes == (points.cuts[c].bytes(4),), c
        assert got.stage_act_bytes[0] == points.cuts[0].bytes(4)  # stage 0 keeps the model inputs
    # The ILP can use it as is: three stages of the seven operations, balanced by count.
    best = assign_stages(dag, num_stages=3, num_microbatches=8, mem_limit_bytes=[math.inf] * 3)
    assert best.stage_time_s == pytest.approx((n / 3,) * 3, abs=1.0)
    with pytest.raises(PlanError, match="'x', which is not an operation"):
        stage_dag_from_layergraph(graph, batch_size=4, time_s={"x": 1.0})


def test_infeasible_assignment_names_the_stage_and_the_bytes() -> None:
    # partition's own example: node 1 alone needs 10 + 8 × (90 + 5) = 770 bytes under GPipe; the limit is 500.
    dag = StageDag.from_chain([1.0] * 3, [1.0] * 3, [1.0, 90.0, 1.0], [10.0] * 3, [5.0] * 4)
    with pytest.raises(InfeasibleError) as info:
        assign_stages(dag, num_stages=3, num_microbatches=8, mem_limit_bytes=[500.0] * 3, schedule="GPipe")
    assert str(info.value) == (
        "no assignment of the 3 nodes to 3 stages fits in memory; the best overflows by 270 B: stage 1 (node 1) "
        "needs 770 B (state 10 B + 8 micro-batches in flight x 95 B), limit 500 B"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_stages": 4, "mem_limit_bytes": [1.0] * 4}, "num_stages must be in [1, 3]"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"mem_limit_bytes": [1.0]}, "mem_limit_bytes must have one entry per stage (2)"),
        ({"schedule": "Interleaved1F1B"}, "known for 'GPipe' and '1F1B'"),
        ({"in_flight_per_stage": [3, 1]}, "in_flight_per_stage must have 2 entries in [1, 2]"),
        ({"bw_bytes_per_s": 0.0}, "bw_bytes_per_s > 0"),
    ],
)
def test_bad_stage_options_raise(change: dict[str, Any], message: str) -> None:
    dag = StageDag.from_chain([1.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 3, [1.0] * 4)
    kwargs: dict[str, Any] = {"num_stages": 2, "num_microbatches": 2, "mem_limit_bytes": [1e9] * 2, **change}
    with pytest.raises(PlanError, match=re.escape(message)):
        assign_stages(dag, **kwargs)


def test_bad_dag_raises() -> None:
    with pytest.raises(PlanError, match=re.escape("edge (2, 1) must join two of the 3 nodes in topological order")):
        StageDag((1.0,) * 3, (0.0,) * 3, (0.0,) * 3, (0.0,) * 3, ((0, 1), (2, 1)))
    with pytest.raises(PlanError, match=re.escape("act_bytes has 2 entries, the DAG has 3 nodes")):
        StageDag((1.0,) * 3, (0.0,) * 3, (0.0,) * 2, (0.0,) * 3, ())


# ---------------------------------------------------------------------------------------------------------------
# B. Rematerialization
# ---------------------------------------------------------------------------------------------------------------


def _remat_chain(rng: random.Random, n: int) -> RematChain:
    """Integer sizes (1..20) and times, so that equal schedules cost exactly equal amounts."""
    out = [float(rng.randint(1, 20)) for _ in range(n)]
    kept = [o + rng.randint(0, 20) for o in out]
    grad = [float(rng.randint(1, 20)) for _ in range(n + 1)]
    return RematChain(
        fwd_s=tuple(float(rng.randint(1, 10)) for _ in range(n)),
        bwd_s=tuple(float(rng.randint(1, 20)) for _ in range(n)),
        kept_bytes=tuple(kept),
        out_bytes=tuple(out),
        fwd_peak_bytes=tuple(k + rng.randint(0, 10) for k in kept),
        fwd_nosave_peak_bytes=tuple(o + rng.randint(0, 10) for o in out),
        bwd_peak_bytes=tuple(kept[i] + grad[i] + grad[i + 1] + rng.randint(0, 10) for i in range(n)),
        grad_bytes=tuple(grad),
    )


@functools.cache
def _sequences(a: int, b: int, pruned: bool) -> tuple[tuple[RematItem, ...], ...]:
    """Every item sequence covering blocks [a, b) (no offload); `pruned`: only those ending with a Keep."""
    if a == b:
        return ((),)
    out = []
    for m in range(a + 1, b + 1):
        for first in _items(a, m, pruned):
            out += [
                (first, *rest)
                for rest in _sequences(m, b, pruned)
                if not pruned or isinstance((first, *rest)[-1], Keep)
            ]
    return tuple(out)


@functools.cache
def _items(a: int, k: int, pruned: bool) -> tuple[RematItem, ...]:
    """Every item covering exactly [a, k): Keep(a), or a Checkpoint of a sequence other than one Checkpoint of [a, k)
    (re-wrapping only adds a recomputation, and would never end)."""
    if k == a + 1:
        return (Keep(a), Checkpoint(RematPlan((Keep(a),))))
    inner = [
        (first, *rest) for m in range(a + 1, k) for first in _items(a, m, pruned) for rest in _sequences(m, k, pruned)
    ]
    return tuple(Checkpoint(RematPlan(s)) for s in inner if not pruned or isinstance(s[-1], Keep))


def _tree_plans(n: int, *, pruned: bool = True) -> list[RematPlan]:
    """The tree plans of n blocks. Pruned: only plans in which every sequence (the plan's and each Checkpoint's)
    ends with a Keep. That loses no optimum: a sequence [..., C[inner]] runs C's blocks without saving, frees the
    output at once and starts its backward by recomputing `inner`, so it is [..., *inner] with an extra pass that
    leaves memory as it found it, strictly slower and with a peak at least as high."""
    return [RematPlan(p) for p in _sequences(0, n, pruned)]


@functools.cache
def _tree_ops(n: int) -> list[list[Any]]:
    """The operations of every pruned tree plan (what `replay` replays)."""
    return [plan_ops(plan) for plan in _tree_plans(n)]


def _tree_replays(chain: RematChain) -> list[Any]:
    """replay(chain, plan) for every pruned tree plan, with the operations built once per length."""
    return [replay_ops(chain, ops) for ops in _tree_ops(len(chain))]


def test_every_tree_plan_is_counted() -> None:
    # All: P(n) = 2·Σ_{k<n} Q(k)·P(n−k) with Q(1) = 2, Q(k) = P(k)/2. Pruned: E(n) = S(n−1), the sequences of
    # n − 1 blocks over items Keep, C[K] and C[E-plan].
    assert [len(_tree_plans(n, pruned=False)) for n in range(1, 7)] == [2, 8, 48, 352, 2880, 25216]
    assert [len(_tree_plans(n)) for n in range(1, 8)] == [1, 2, 6, 22, 90, 394, 1806]


def test_pruned_tree_plans_lose_no_optimum() -> None:
    rng = random.Random(2)
    for n in (2, 3, 4, 4, 5):
        chain = _remat_chain(rng, n)
        every = [replay(chain, plan) for plan in _tree_plans(n, pruned=False)]
        pruned = _tree_replays(chain)
        for budget in sorted({r.peak_bytes for r in every}):
            best = min(r.time_s for r in every if r.peak_bytes <= budget)
            assert best == min((r.time_s for r in pruned if r.peak_bytes <= budget), default=None)


def _dag_ops(ops: Sequence[Any]) -> list[Any]:
    """remat.py's chain operations as DAG operations: cut c is block c − 1's output."""
    return [("free", op[1] - 1) if op[0] == "free" else op for op in ops]


def test_replay_dag_is_replay_ops_on_every_tree_plan() -> None:
    rng = random.Random(3)
    for n in range(1, 6):
        chain = _remat_chain(rng, n)
        dag = RematDag.from_chain(chain)
        for plan in _tree_plans(n, pruned=False):
            want = replay(chain, plan)
            got = replay_dag(dag, _dag_ops(plan_ops(plan)))
            assert (got.time_s, got.peak_bytes, got.recompute_s) == (want.time_s, want.peak_bytes, want.recompute_s)


def test_the_remat_ilp_refuses_chain_figures_it_does_not_model() -> None:
    chain = _remat_chain(random.Random(4), 3)
    nothing_saved_by_0 = replace(chain, saves=(False, True, True), out_savers=(((1,),), ((1, 2),), ((2,),)))
    for changed in (nothing_saved_by_0, replace(chain, out_savers=(((0,),), ((1,),), ((2,),)))):
        with pytest.raises(PlanError, match="does not model which blocks save a value"):
            RematDag.from_chain(changed)


def _check_chain_schedule(chain: RematChain, budget: float, **kwargs: Any) -> Any:
    """Solve, then replay the schedule with remat.py: its time and peak must be the ILP's own figures."""
    got = remat_schedule(RematDag.from_chain(chain), budget_bytes=budget, time_limit_s=LIMIT_S, **kwargs)
    assert got.status == "optimal"
    again = replay_ops(chain, chain_ops(got.ops))
    assert (again.time_s, again.peak_bytes, again.recompute_s) == (got.time_s, got.peak_bytes, got.recompute_s)
    assert got.peak_bytes <= budget
    assert got.forward_count == tuple(sum(op[:2] == ("F", i) for op in got.ops) for i in range(len(chain)))
    return got


def test_remat_of_a_chain_equals_the_best_tree_plan() -> None:
    # Budgets at (or one byte around) the peaks the tree plans reach, so every optimum is tight somewhere.
    rng = random.Random(11)
    sizes = [rng.randint(1, 6) for _ in range(32)] + [7, 7]
    infeasible = 0
    for k, n in enumerate(sizes):
        chain = _remat_chain(rng, n)
        replays = _tree_replays(chain)
        budget = rng.choice(sorted({r.peak_bytes for r in replays})) + rng.choice([-1, 0, 0, 1])
        fits = [r.time_s for r in replays if r.peak_bytes <= budget]
        if not fits:
            infeasible += 1
            with pytest.raises(InfeasibleError, match=f"no rematerialization schedule of the {n} blocks fits"):
                remat_schedule(RematDag.from_chain(chain), budget_bytes=budget, time_limit_s=LIMIT_S)
            continue
        got = _check_chain_schedule(chain, budget, warm_start=k % 2 == 0)
        assert got.time_s == min(fits), (chain, budget)
    assert 1 <= infeasible <= 8


def test_remat_of_a_chain_equals_the_dp() -> None:
    # The ILP (persistent checkpoints, as nested torch checkpoints run) and the C++ DP of pyplan/remat.h agree
    # exactly on chains, with one memory slot per byte so the DP loses nothing to rounding.
    rng = random.Random(23)
    for n in [rng.randint(2, 8) for _ in range(24)]:
        chain = _remat_chain(rng, n)
        least = min_budget(chain)
        top = replay(chain, no_remat(0, n)).peak_bytes
        budget = int(least + (top - least) * rng.random())
        got = _check_chain_schedule(chain, budget)
        assert got.time_s == solve(chain, budget, slots=budget).time_s, (chain, budget)


# A chain and budget where a schedule that is no tree plan beats every tree plan (found among random chains).
BEYOND_TREES = RematChain(
    fwd_s=(9.0, 4.0, 2.0, 1.0, 2.0),
    bwd_s=(5.0, 6.0, 6.0, 18.0, 7.0),
    kept_bytes=(20.0, 21.0, 30.0, 20.0, 18.0),
    out_bytes=(9.0, 11.0, 20.0, 17.0, 9.0),
    fwd_peak_bytes=(23.0, 30.0, 37.0, 22.0, 27.0),
    fwd_nosave_peak_bytes=(17.0, 12.0, 25.0, 17.0, 15.0),
    bwd_peak_bytes=(45.0, 48.0, 46.0, 37.0, 42.0),
    grad_bytes=(3.0, 13.0, 5.0, 5.0, 11.0, 4.0),
)


def test_unrestricted_remat_beats_every_tree_plan() -> None:
    # Tree plans (nested checkpoints) must keep a checkpoint until the backward that reads it; here dropping cut 2
    # after the recomputation of block 2 and rebuilding it from block 0's saved output saves 3 s over the best
    # tree plan C[K0] C[K1 K2] C[K3] K4 (76 s), within the same 86-byte budget. replay_ops confirms both figures.
    budget = 86.0
    best = min(r.time_s for r in _tree_replays(BEYOND_TREES) if r.peak_bytes <= budget)
    assert best == 76.0
    assert _check_chain_schedule(BEYOND_TREES, budget).time_s == 76.0
    assert _check_chain_schedule(BEYOND_TREES, budget, persistent=False).time_s == 73.0


def test_replays_refuse_a_schedule_torch_cannot_run() -> None:
    # Block 1 runs saving, its input (cut 1) is dropped and recomputed for its backward: 1 s faster than any tree
    # plan within 53 bytes if it were possible, but in torch the saved block holds its input until its backward,
    # so both replays (and the ILP) refuse it.
    chain = RematChain(
        fwd_s=(7.0, 1.0, 9.0),
        bwd_s=(8.0, 15.0, 16.0),
        kept_bytes=(25.0, 15.0, 26.0),
        out_bytes=(18.0, 8.0, 12.0),
        fwd_peak_bytes=(29.0, 15.0, 32.0),
        fwd_nosave_peak_bytes=(26.0, 18.0, 13.0),
        bwd_peak_bytes=(49.0, 35.0, 49.0),
        grad_bytes=(6.0, 10.0, 4.0, 11.0),
    )
    ops = [
        ("F", 0, "nosave"), ("F", 1, "save"), ("free", 1), ("F", 2, "save"), ("B", 2),
        ("F", 0, "nosave"), ("B", 1), ("free", 1), ("F", 0, "save"), ("B", 0),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="block 1's saved tensors"):
        replay_ops(chain, ops)
    assert min(r.time_s for r in _tree_replays(chain) if r.peak_bytes <= 53) == 71.0
    with pytest.raises(ValueError, match="block 1's saved tensors hold it"):
        replay_dag(RematDag.from_chain(chain), _dag_ops(ops))
    assert _check_chain_schedule(chain, 53.0, persistent=False).time_s == 71.0


def _dag(preds: Sequence[Sequence[int]], fwd: Sequence[int], out: Sequence[int], extra: Sequence[int]) -> RematDag:
    """Integer figures: kept = out + extra, transients of 2 bytes, gradients as large as the outputs."""
    n = len(preds)
    kept = [o + e for o, e in zip(out, extra)]
    return RematDag(
        fwd_s=tuple(float(f) for f in fwd),
        bwd_s=tuple(2.0 * f for f in fwd),
        kept_bytes=tuple(float(k) for k in kept),
        out_bytes=tuple(float(o) for o in out),
        fwd_peak_bytes=tuple(k + 2.0 for k in kept),
        fwd_nosave_peak_bytes=tuple(o + 2.0 for o in out),
        bwd_peak_bytes=tuple(kept[i] + out[i] + sum(out[j] for j in preds[i]) + 2.0 for i in range(n)),
        grad_bytes=tuple(float(o) for o in out),
        preds=tuple(tuple(p) for p in preds),
    )


# Encoder e1 e2 e3, a middle block, decoder d3 d2 d1 with long skips e_k → d_k; e1's output is large but cheap.
UNET = _dag(
    preds=[(), (0,), (1,), (2,), (3, 2), (4, 1), (5, 0)],
    fwd=[1, 4, 4, 4, 4, 4, 4],
    out=[20, 8, 8, 8, 8, 8, 8],
    extra=[10, 8, 8, 8, 8, 8, 8],
)
# A stem, three parallel branches of two, two and three blocks, and a concatenation.
INCEPTION = _dag(
    preds=[(), (0,), (1,), (0,), (3,), (0,), (5,), (6,), (2, 4, 7)],
    fwd=[1, 3, 3, 3, 3, 3, 3, 3, 2],
    out=[16, 6, 6, 6, 6, 6, 6, 6, 18],
    extra=[8, 6, 6, 6, 6, 6, 6, 6, 4],
)


def _checkpoint_segments(dag: RematDag, starts: Sequence[int]) -> list[Any]:
    """checkpoint_sequential over the block order with segments [starts[i], starts[i+1]): every segment but the last
    runs without saving and keeps only what later segments read; before the backward of its last block it is
    recomputed once, saving. Every stored output is freed right after its last read."""
    n = len(dag)
    segments = list(itertools.pairwise([*starts, n]))
    ops: list[Any] = [("F", i, "nosave") for a, b in segments[:-1] for i in range(a, b)]
    ops += [("F", i, "save") for i in range(*segments[-1])]
    ops += [("B", i) for i in reversed(range(*segments[-1]))]
    for a, b in reversed(segments[:-1]):
        ops += [("F", i, "save") for i in range(a, b)] + [("B", i) for i in reversed(range(a, b))]
    # Free each X(j) right after its last read (its successors' forwards and backwards) before j runs again.
    frees: dict[int, list[Any]] = {}
    for k, op in enumerate(ops):
        if op[0] == "F" and op[2] == "nosave":
            j = op[1]
            again = next((q for q in range(k + 1, len(ops)) if ops[q][:2] == ("F", j)), len(ops))
            reads = [q for q in range(k + 1, again) if j in dag.preds[ops[q][1]]]
            frees.setdefault(max(reads, default=k), []).append(("free", j))
    return [x for k, op in enumerate(ops) for x in (op, *frees.get(k, []))]


@pytest.mark.parametrize(("name", "dag"), [("unet", UNET), ("inception", INCEPTION)])
def test_remat_fits_a_branching_block_where_periodic_checkpointing_cannot(name: str, dag: RematDag) -> None:
    n = len(dag)
    # checkpoint_sequential with k equal segments (remat.periodic's sizes), and with any segments at all.
    periodic = {}
    for k in range(1, n + 1):
        size = -(-n // k)
        starts = list(range(0, n, size))
        periodic[k] = replay_dag(dag, _checkpoint_segments(dag, starts))
        library = replay_dag(dag, periodic_schedule(dag, k))
        assert (library.time_s, library.peak_bytes) == (periodic[k].time_s, periodic[k].peak_bytes)
    any_segments = [
        replay_dag(dag, _checkpoint_segments(dag, [0, *cuts]))
        for r in range(n)
        for cuts in itertools.combinations(range(1, n), r)
    ]
    least_periodic = min(r.peak_bytes for r in periodic.values())
    least_segments = min(r.peak_bytes for r in any_segments)
    assert (least_periodic, least_segments) == {"unet": (102.0, 102.0), "inception": (94.0, 78.0)}[name]
    budget = least_segments - 4.0
    got = remat_schedule(dag, budget_bytes=budget, time_limit_s=LIMIT_S)
    assert got.status == "optimal"
    again = replay_dag(dag, got.ops)
    assert (again.time_s, again.peak_bytes) == (got.time_s, got.peak_bytes)
    assert got.peak_bytes <= budget < least_segments
    # And where a periodic schedule fits, the ILP is never slower than the fastest that does.
    fitting = [r.time_s for r in periodic.values() if r.peak_bytes <= least_periodic]
    at_periodic = remat_schedule(dag, budget_bytes=least_periodic, time_limit_s=LIMIT_S)
    assert at_periodic.warm_start and at_periodic.time_s <= min(fitting)


def test_remat_without_memory_pressure_is_no_remat() -> None:
    peak = replay_dag(INCEPTION, periodic_schedule(INCEPTION, 1)).peak_bytes
    got = remat_schedule(INCEPTION, budget_bytes=peak, time_limit_s=LIMIT_S)
    assert got.warm_start == "no remat"
    assert (got.time_s, got.recompute_s) == (sum(INCEPTION.fwd_s) + sum(INCEPTION.bwd_s), 0.0)
    assert got.forward_count == (1,) * len(INCEPTION)


def test_time_limit_returns_the_warm_start() -> None:
    # No time to search: the fastest periodic schedule that fits (periodic(5), 94 s at 94 bytes) comes back as it is.
    got = remat_schedule(INCEPTION, budget_bytes=94.0, time_limit_s=1e-9)
    assert (got.status, got.warm_start) == ("feasible", "periodic(5)")
    again = replay_dag(INCEPTION, got.ops)
    assert (again.time_s, again.peak_bytes) == (got.time_s, got.peak_bytes) == (94.0, 94.0)
    with pytest.raises(PlanError, match="no schedule of the 9 blocks found within"):
        remat_schedule(INCEPTION, budget_bytes=90.0, time_limit_s=1e-9)  # no simple schedule fits


def test_remat_infeasible_budget_names_the_block() -> None:
    # Below what one operation needs on its own: said without solving.
    with pytest.raises(InfeasibleError, match="backward alone needs at least 86 B"):
        remat_schedule(UNET, budget_bytes=85.0, time_limit_s=LIMIT_S)
    chain = _remat_chain(random.Random(5), 4)
    least = min(r.peak_bytes for r in _tree_replays(chain))
    with pytest.raises(InfeasibleError, match="no rematerialization schedule of the 4 blocks fits in 62 B: block"):
        remat_schedule(RematDag.from_chain(chain), budget_bytes=least - 1, time_limit_s=LIMIT_S)
    # Enough for every operation on its own, not for a whole schedule (found among random DAGs): the ILP proves it.
    dag = RematDag(
        fwd_s=(2.0, 9.0, 3.0, 2.0),
        bwd_s=(12.0, 11.0, 17.0, 7.0),
        kept_bytes=(4.0, 22.0, 27.0, 14.0),
        out_bytes=(3.0, 2.0, 20.0, 2.0),
        fwd_peak_bytes=(12.0, 32.0, 36.0, 23.0),
        fwd_nosave_peak_bytes=(6.0, 10.0, 28.0, 6.0),
        bwd_peak_bytes=(21.0, 35.0, 46.0, 35.0),
        grad_bytes=(9.0, 1.0, 16.0, 9.0),
        preds=((), (0,), (1,), (0, 1)),
    )
    with pytest.raises(InfeasibleError, match=re.escape("the ILP proves it for this order of the blocks, though no")):
        remat_schedule(dag, budget_bytes=47.0, time_limit_s=LIMIT_S)
    assert remat_schedule(dag, budget_bytes=48.0, time_limit_s=LIMIT_S).peak_bytes == 48.0


def test_bad_remat_dag_raises() -> None:
    with pytest.raises(PlanError, match=re.escape("block 1 reads [1]: predecessors must be distinct blocks before it")):
        _dag(preds=[(), (1,)], fwd=[1, 1], out=[1, 1], extra=[0, 0])
    with pytest.raises(ValueError, match="backward of block 0 before the backward of its successor 1"):
        replay_dag(RematDag.from_chain(_remat_chain(random.Random(1), 2)), [("F", 0, "save"), ("B", 0)])
