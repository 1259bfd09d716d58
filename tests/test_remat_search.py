"""The plan search with rematerialization: plans that only fit with recomputation, and faster plans with it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pyplan import zoo
from pyplan.api import chain_for, search
from pyplan.errors import InfeasibleError, PlanError
from pyplan.graph.chain import Chain
from pyplan.hardware import Cluster
from pyplan.plan import Plan, Workload
from pyplan.profile.remat import remat_bytes
from pyplan.remat_plan import Checkpoint, Keep, Selective
from pyplan.solve.remat import replay


@pytest.fixture(scope="module")
def gpt():
    spec = zoo.get("gpt-tiny")
    model = spec.build()
    cluster = Cluster.from_catalog("t4", 1)
    workload = Workload(global_batch=64)
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    return spec, model, cluster, workload, chain


def test_remat_finds_plans_that_only_fit_with_it(gpt) -> None:
    spec, model, cluster, workload, chain = gpt
    options = dict(chain=chain, memory_fraction=0.0008, micro_batch_sizes=[64])
    with pytest.raises(InfeasibleError):
        search(model, spec.example_inputs, cluster, workload, **options)
    best = search(model, spec.example_inputs, cluster, workload, remat="auto", **options).best
    limit = cluster.gpu.memory_bytes * 0.0008
    assert best.predicted.peak_memory_bytes <= limit
    assert best.layout.remat and any(r is not None for r in best.layout.remat)
    # Each stage's activations are its plan replayed: one micro-batch's peak plus the others' leftovers.
    profile = remat_bytes(chain, spec.example_inputs, (1, 2))
    b = best.layout.micro_batch_size
    fwd = [blk.fwd_time_s(b) for blk in chain.blocks]
    bwd = [blk.bwd_time_s(b) for blk in chain.blocks]
    full = profile.chain(b, fwd, bwd)
    for st, r in zip(best.stages, best.layout.remat):
        sub = full.sub(st.first_block, st.last_block + 1).with_outputs_held()
        assert r.positions == tuple(c.position for c in chain.cuts[st.first_block : st.last_block + 2])
        rep = replay(sub, r.plan)
        assert st.recompute_s == pytest.approx(rep.recompute_s)
        assert st.backward_s == pytest.approx(rep.time_s - sum(sub.fwd_s))
        cut_in = chain.cuts[st.first_block].bytes(b)
        assert st.activation_bytes == pytest.approx(
            rep.peak_bytes + (st.in_flight - 1) * rep.after_forward_bytes + st.in_flight * cut_in
        )
    assert Plan.from_json(best.to_json()) == best
    # Forced modes are no faster than the optimal plan, when they fit at all.
    fitted = 0
    for mode in ("full", "periodic"):
        try:
            forced = search(model, spec.example_inputs, cluster, workload, remat=mode, **options).best
        except InfeasibleError as exc:
            assert "even with rematerialization" in str(exc)
            continue
        fitted += 1
        assert forced.predicted.iteration_s >= best.predicted.iteration_s - 1e-12
    assert fitted


def test_auto_is_never_slower_than_no_remat(gpt) -> None:
    spec, model, cluster, workload, chain = gpt
    for fraction in (0.0006, 0.001, 0.9):
        plain = search(model, spec.example_inputs, cluster, workload, chain=chain, memory_fraction=fraction).best
        auto = search(
            model, spec.example_inputs, cluster, workload, chain=chain, memory_fraction=fraction, remat="auto"
        ).best
        assert auto.predicted.iteration_s <= plain.predicted.iteration_s + 1e-12
    # With memory to spare the plan keeps everything.
    assert auto.layout.remat == ()


def test_selective_checkpointing_keeps_the_matrix_products(gpt) -> None:
    """remat="selective" runs the blocks that keep fewer bytes so selectively checkpointed: the saved bytes are
    those replayed on the chain with those blocks' figures, more than full recomputation holds and less than
    keeping everything, and the time between the two."""
    spec, model, cluster, workload, chain = gpt
    options = dict(chain=chain, micro_batch_sizes=[16], stage_dag=False)
    plans = {
        mode: search(model, spec.example_inputs, cluster, workload, remat=mode, **options).best
        for mode in ("none", "selective", "full")
    }
    (stage,) = plans["selective"].layout.remat
    assert stage is not None and stage.plan.selective_blocks()
    assert "S" in stage.plan.describe()
    assert all(isinstance(it, Selective | Keep) for it in stage.plan.items)
    act = {mode: sum(s.activation_bytes for s in p.stages) for mode, p in plans.items()}
    assert act["full"] < act["selective"] < act["none"]
    time = {mode: p.predicted.iteration_s for mode, p in plans.items()}
    assert time["none"] < time["selective"] < time["full"]
    # The plan's JSON names the selective blocks, and reads back as the same plan.
    again = Plan.from_json(json.loads(json.dumps(plans["selective"].to_json())))
    assert again.layout.remat == plans["selective"].layout.remat


def test_bad_remat_mode(gpt) -> None:
    spec, model, cluster, workload, chain = gpt
    with pytest.raises(PlanError, match="unknown remat mode 'some'"):
        search(model, spec.example_inputs, cluster, workload, chain=chain, remat="some")


def test_each_checkpointed_block_adds_its_measured_cost(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On this machine every block inside a checkpoint costs its measured checkpoint_costs more: with full
    remat on one stage, per micro-batch exactly their sum, its forward share in the forward."""
    import pyplan.planner as api
    from pyplan.hardware.catalog import local_gpu
    from pyplan.profile.measure import CheckpointCosts, checkpoint_costs

    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "local.json").write_text(
        json.dumps(
            {
                "device": local_gpu().description,
                "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "test"},
                "link": {"latency_s": 1e-4, "bw_bytes_per_s": 2e9, "source": "test"},
            }
        )
    )
    spec = zoo.get("gpt-tiny")
    model = spec.build()
    cluster, workload = Cluster.from_catalog("local", 1), Workload(global_batch=4)
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    measured = checkpoint_costs(chain, spec.example_inputs, 2)
    assert len(measured.block_s) == len(chain) and all(0 <= x < 0.1 for x in measured.block_s)
    assert 0 <= measured.forward_share <= 1
    options = dict(chain=chain, micro_batch_sizes=[4], remat="full", stage_dag=False)
    found = {}
    call = 1e-4
    monkeypatch.setattr(api, "checkpoint_call_s", lambda: call)  # measured anew by each search otherwise
    for cost, share in ((0.0, 0.0), (1e-3, 0.0), (1e-3, 0.25)):
        costs = CheckpointCosts((cost,) * len(chain), share)
        monkeypatch.setattr(api, "checkpoint_costs", lambda *a, costs=costs, **k: costs)
        found[cost, share] = search(model, spec.example_inputs, cluster, workload, **options).best
    zero, extra, ahead = (found[k].stages[0] for k in ((0.0, 0.0), (1e-3, 0.0), (1e-3, 0.25)))
    plan = found[1e-3, 0.0].layout.remat[0].plan
    top = [it for it in plan.items if isinstance(it, Checkpoint)]
    inside = sum(it.inner.last - it.inner.first + 1 for it in top)
    assert inside == len(chain) - 1  # full remat: every block but the last, whose output backward needs at once
    assert extra.recompute_s - zero.recompute_s == pytest.approx(1e-3 * inside, rel=1e-6)
    assert extra.checkpoint_s - zero.checkpoint_s == pytest.approx(1e-3 * inside, rel=1e-6)
    assert zero.checkpoint_s == pytest.approx(call * len(top), rel=1e-6)
    assert extra.backward_s - zero.backward_s == pytest.approx(1e-3 * inside, rel=1e-6)
    assert extra.forward_s == zero.forward_s and extra.checkpoint_forward_s == 0.0
    # A quarter of every checkpoint's cost (its call and its blocks') moves from the backward to the forward.
    moved = 0.25 * (1e-3 * inside + call * len(top))
    assert ahead.checkpoint_forward_s == pytest.approx(moved, rel=1e-6)
    assert ahead.forward_s - extra.forward_s == pytest.approx(moved, rel=1e-6)
    assert extra.backward_s - ahead.backward_s == pytest.approx(moved, rel=1e-6)
    assert ahead.recompute_s == pytest.approx(extra.recompute_s, rel=1e-9)


def test_checkpoint_costs_are_scaled_to_what_the_runtime_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per block, the checkpoint cost measured alone, scaled so that the chain under full remat in pyplan's
    RematModule costs no remat + the recomputed forwards + a call per checkpoint + the blocks' costs."""
    import torch

    from pyplan.profile import measure

    spec = zoo.get("mlp-tiny")
    model = spec.build()
    chain, _ = chain_for(model, spec.example_inputs, Cluster.from_catalog("local", 1), Workload(global_batch=4))
    n, call, b = len(chain), 1e-4, 4
    assert n >= 3
    alone = [(1e-4 * (i + 1), 2e-5 * (i + 1), 1e-5 * (i + 1)) for i in range(n)]
    forward = sum(blk.fwd_time_s(b) for blk in chain.blocks[: n - 1])  # type: ignore[misc]
    hooks = 3e-4
    ahead = 0.4 * (call * (n - 1) + hooks)  # what the forward pass pays of the calls and hooks
    # RematModule: no remat, then full remat, as (forward, backward)
    seconds = iter([(0.004, 0.006), (0.004 + ahead, 0.006 + forward + call * (n - 1) + hooks - ahead)])
    monkeypatch.setattr(measure, "_module_s", lambda *a, **k: next(seconds))
    clock = measure._Clock(torch.device("cpu"), 1)
    mods = [None] * n
    got = measure._as_in_the_runtime(chain, mods, [], alone, b, call, clock, measure.TimingOptions())
    share = sum(x for _, x, _ in alone[: n - 1])
    assert got.block_s == pytest.approx([x * hooks / share for _, x, _ in alone], rel=1e-6)
    assert got.forward_share == pytest.approx(0.4, rel=1e-6)
    # Nothing left beyond the forwards and the calls: no block cost, the calls' forward part alone.
    seconds = iter([(0.004, 0.006), (0.004 + call, 0.006 + forward + call * (n - 2))])
    got = measure._as_in_the_runtime(chain, mods, [], alone, b, call, clock, measure.TimingOptions())
    assert got.block_s == pytest.approx((0.0,) * n, abs=1e-15)
    assert got.forward_share == pytest.approx(1 / (n - 1), rel=1e-6)


def test_what_a_stage_holds_beside_the_replay_of_its_blocks() -> None:
    from pyplan.remat_plan import Keep, RematPlan, full_remat, no_remat
    from pyplan.solve.remat import BlockMemory
    from pyplan.solve.remat_search import _recomputed_outputs, _without, stage_outputs

    def block(values: tuple[tuple[int, int, tuple[int, ...]], ...]) -> BlockMemory:
        out = sum(b for b, _, _ in values)
        return BlockMemory(out + 5, out, out + 7, out + 3, out + 11, values)

    # Blocks 0-3 of a 6-block chain (cuts 0..6) as a stage over [1, 4): block 1's output dies inside, block 2's
    # (saved by itself) is carried past cut 4 by a residual, block 3's output crosses cut 4 and nobody saves it.
    mems = [block(((10, 1, (0,)),)), block(((20, 2, ()),)), block(((30, 5, (2, 5)),)), block(((40, 4, ()),))]
    mems += [block(((1, 5, ()),)), block(((1, 6, ()),))]
    outputs = stage_outputs(1, 4, mems, num_cuts=7)
    assert outputs == ((2, 0), (3, 0))
    assert stage_outputs(4, 6, mems, num_cuts=7) == ()  # the last stage's output goes to the loss
    # Counted elsewhere (held by the stage), an output leaves every figure of its block.
    assert _without(mems[2], {0}) == BlockMemory(5, 0, 7, 3, 11, ((0, 5, (2, 5)),))
    assert _without(mems[1], set()) is mems[1]
    # Recomputing block 2 makes its output again (it saves it); block 3's is made by nobody that saves it.
    assert _recomputed_outputs(full_remat(0, 3), 1, mems, outputs) == 30
    assert _recomputed_outputs(no_remat(0, 3), 1, mems, outputs) == 0
    assert _recomputed_outputs(RematPlan((Keep(0), Keep(1), Checkpoint(no_remat(2, 3)))), 1, mems, outputs) == 0


def test_unmade_gradients_by_hand() -> None:
    """A stage of m micro-batches all in flight before its first backward, gradients G = 100 bytes: peak P = 1000
    without gradients, 1040 with those made by then (`peak_with_grads_bytes`), each other micro-batch holding
    A = 300 after its forward. The state counts P + (m-1)A + G; the step peaks at the most of the first backward
    (1040 + (m-1)A), the second (P + (m-2)A + G) and the end (G)."""
    from pyplan.solve.remat import Replay
    from pyplan.solve.remat_search import unmade_grad_bytes

    rep = Replay(0.0, 1000.0, 0.0, 0.0, 300.0, 1040.0)
    assert unmade_grad_bytes(rep, 1, 100.0) == 60.0  # one micro-batch: 1100 counted, 1040 reached
    assert unmade_grad_bytes(rep, 4, 100.0) == 60.0  # 2000 counted; the first 1940, the second 1800
    assert unmade_grad_bytes(rep, 4, 0.0) == 0.0
    # Made early (within 10 bytes of P + G): the second backward's peak is below, nothing to take off but 10.
    assert unmade_grad_bytes(Replay(0.0, 1000.0, 0.0, 0.0, 300.0, 1090.0), 3, 100.0) == 10.0
    # Small activations, large gradients: the end of the step holds every gradient.
    assert unmade_grad_bytes(Replay(0.0, 10.0, 0.0, 0.0, 5.0, 10.0), 1, 100.0) == 10.0
    # Gradients made late and A small: the second backward peaks higher (1000 + 0 + 100 against 1000 + 20).
    assert unmade_grad_bytes(Replay(0.0, 1000.0, 0.0, 0.0, 20.0, 1000.0), 2, 100.0) == 20.0


def test_optimizer_step_bytes() -> None:
    """Adam's sqrt(exp_avg_sq) + eps out of place in the master dtype: every tensor at once on a GPU (foreach), two
    of the largest on the CPU (measured on mlp-tiny: tests/runtime/test_step_memory.py); SGD updates in place."""
    from pyplan.model_state import optimizer_step_bytes

    assert optimizer_step_bytes("adamw", "fp32", elements=1000, largest_tensor=300, foreach=True) == 4000
    assert optimizer_step_bytes("adam", "fp32", elements=1000, largest_tensor=300, foreach=False) == 2400
    assert optimizer_step_bytes("adamw", "bf16-mixed", elements=1000, largest_tensor=300, foreach=True) == 4000
    assert optimizer_step_bytes("sgd-momentum", "fp32", elements=1000, largest_tensor=300, foreach=True) == 0
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_step_bytes("lion", "fp32", elements=1, largest_tensor=1, foreach=True)


def test_full_recomputation_checkpoints_the_last_block_where_micro_batches_are_in_flight() -> None:
    """`--remat full` on a stage holding several micro-batches: keeping the last block's activations for each of
    them does not fit, checkpointing it too does (Megatron-LM's uniform recomputation), and that plan is chosen;
    with one micro-batch in flight the last block is kept (its backward follows its forward), as before."""
    from pyplan.remat_plan import full_remat
    from pyplan.solve.remat import RematChain, replay
    from pyplan.solve.remat_search import stage_remat

    n = 4
    chain = RematChain(
        fwd_s=(1.0,) * n,
        bwd_s=(2.0,) * n,
        kept_bytes=(100.0,) * n,  # each block saves 100 for its backward, its output is 10
        out_bytes=(10.0,) * n,
        fwd_peak_bytes=(110.0,) * n,
        fwd_nosave_peak_bytes=(20.0,) * n,
        bwd_peak_bytes=(130.0,) * n,
        grad_bytes=(10.0,) * (n + 1),
    )
    keep_last, all_four = full_remat(0, n), full_remat(0, n, last=True)
    in_flight = 4
    need = {
        plan: (rep := replay(chain, plan)).peak_bytes + (in_flight - 1) * rep.after_forward_bytes
        for plan in (keep_last, all_four)
    }
    assert need[all_four] < need[keep_last]
    budget = (need[all_four] + need[keep_last]) / 2
    got = stage_remat(chain, budget, in_flight, mode="full", offload_bw_bytes_per_s=None)
    assert got is not None and got.plan == all_four
    assert got.recompute_s == pytest.approx(n * 1.0)  # every block's forward again
    # Room for both: the faster, which keeps the last block.
    roomy = stage_remat(chain, need[keep_last], in_flight, mode="full", offload_bw_bytes_per_s=None)
    assert roomy is not None and roomy.plan == keep_last
    # One micro-batch in flight: the last block is kept whatever the budget allows.
    one = stage_remat(chain, 10 * need[keep_last], 1, mode="full", offload_bw_bytes_per_s=None)
    assert one is not None and one.plan == keep_last
    assert stage_remat(chain, budget, 1, mode="full", offload_bw_bytes_per_s=None) in (None, one)


def _linear_stack(width: int, layers: int) -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]]]:
    """`layers` Linear(width, width) + ReLU pairs and its example inputs: parameters and saved activations of one
    size, chosen by the batch."""
    torch.manual_seed(0)
    pairs = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    return torch.nn.Sequential(*pairs), lambda b: (torch.randn(b, width),)


def test_a_plan_that_fits_only_by_gradients_not_yet_made_is_found() -> None:
    """One GPU, one micro-batch of 256 through 16 Linear(64, 64) layers: the stage makes its fp32 gradients again in
    its backward, after its activations peak, and needs that much less (pyplan/solve/remat_search.py's
    unmade_grad_bytes). The search leaves out what it surely has not made there (search.h's fresh_gradients), so the
    plan that fits only by them is found with just its memory; with less, nothing fits."""
    model, inputs = _linear_stack(64, 16)
    cluster, workload = Cluster.from_catalog("t4", 1), Workload(global_batch=256)
    chain, _ = chain_for(model, inputs, cluster, workload)
    options = dict(chain=chain, micro_batch_sizes=[256])
    roomy = search(model, inputs, cluster, workload, memory_fraction=0.5, **options).best
    (stage,) = roomy.stages
    need, memory = roomy.predicted.peak_memory_bytes, cluster.gpu.memory_bytes
    assert stage.unmade_grad_bytes > 0 and need == stage.memory_bytes
    # Counted whole, the gradients would not fit: the plan fits only because they are not made at its peak.
    assert stage.state_bytes + stage.activation_bytes + stage.buffer_bytes > need * (1 + 1e-6)
    tight = search(model, inputs, cluster, workload, memory_fraction=need / memory * (1 + 1e-9), **options).best
    assert tight.layout == roomy.layout and tight.predicted.peak_memory_bytes == need
    with pytest.raises(InfeasibleError, match="no plan fits"):
        search(model, inputs, cluster, workload, memory_fraction=need / memory * (1 - 1e-6), **options)


@functools.cache
def _two_gpus() -> tuple[torch.nn.Module, Callable[[int], tuple[torch.Tensor, ...]], Cluster, Workload, Chain]:
    """16 Linear(64, 64) layers on 2 GPUs, a batch of 256, and its chain."""
    model, inputs = _linear_stack(64, 16)
    cluster, workload = Cluster.from_catalog("t4", 2), Workload(global_batch=256)
    chain, _ = chain_for(model, inputs, cluster, workload)
    return model, inputs, cluster, workload, chain


def _interleaved(remat: str, memory_bytes: float) -> Plan | None:
    """`_two_gpus` as 4 stages of Interleaved1F1B, 4 micro-batches of 64: rank 0 runs the chunks holding 4 and 2
    micro-batches in flight, rank 1 those holding 3 and 1; None where it does not fit."""
    model, inputs, cluster, workload, chain = _two_gpus()
    pins = dict(micro_batch_sizes=[64], pipeline_ranks=[2], schedules=["Interleaved1F1B"], data_parallel=[1],
                stages_per_rank=[2])  # fmt: skip
    try:
        found = search(model, inputs, cluster, workload, chain=chain, remat=remat, **pins,
                       memory_fraction=memory_bytes / cluster.gpu.memory_bytes)  # fmt: skip
    except InfeasibleError:
        return None
    assert [st.in_flight for st in found.best.stages] == [4, 3, 2, 1]
    return found.best


def _least_memory(remat: str, most_bytes: float) -> float:
    """The least memory (within 0.1 %) at which `_interleaved` plans, by bisection below `most_bytes`."""
    lo, hi = 0.0, most_bytes
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _interleaved(remat, mid) is not None else (mid, hi)
    return hi


def test_interleaved_chunks_share_their_rank_memory() -> None:
    """Two chunks on a rank hold different micro-batches in flight (4 and 2): the rank's free memory is theirs
    together, not half each. Keeping everything, the plan fits in exactly what its fullest rank holds (the first
    chunk alone needs more than half of what is free there); with that memory, remat "auto" keeps everything too;
    with less, "none" does not fit."""
    roomy = _interleaved("none", 1e9)
    assert roomy is not None
    need = roomy.predicted.peak_memory_bytes
    first, third = roomy.stages[0], roomy.stages[2]
    assert need == first.memory_bytes + third.memory_bytes  # rank 0 is the fullest
    assert first.activation_bytes > 1.5 * third.activation_bytes
    tight = _interleaved("none", need * (1 + 1e-9))
    assert tight is not None and tight.predicted.peak_memory_bytes == need
    assert _interleaved("none", need * (1 - 1e-6)) is None
    auto = _interleaved("auto", need * (1 + 1e-9))
    assert auto is not None and auto.layout.remat == () and auto.predicted.iteration_s == tight.predicted.iteration_s


def test_interleaved_chunks_recompute_in_proportion_to_what_they_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remat "auto" with too little memory to keep everything: the rank's free memory split in proportion to each
    chunk's least need (full recomputation's: 4 and 2 micro-batches in flight) plans the layout in less memory than
    halving it for each chunk, which leaves the first chunk too little; below that least memory it does not fit."""
    from pyplan.solve import remat_search

    keep_all = _interleaved("none", 1e9)
    assert keep_all is not None
    least = _least_memory("auto", keep_all.predicted.peak_memory_bytes)
    assert least < keep_all.predicted.peak_memory_bytes
    planned = _interleaved("auto", least)
    assert planned is not None and planned.layout.remat and planned.predicted.peak_memory_bytes <= least

    def halves(
        stages: list[Any], free_bytes: float, mode: str, offload_bw_bytes_per_s: float | None, peaks: Any
    ) -> Any:
        """What refine_plan did before: each of the rank's stages within an even share of its free memory beside
        their inputs and outputs in flight, at its own peak; then the rank's peak checked as refine_plan checks it."""
        beside = free_bytes - sum(x.in_flight * x.resident_bytes for x in stages)
        got = [x.within(beside / len(stages), mode, offload_bw_bytes_per_s) for x in stages]
        if any(c is None for c in got) or remat_search._rank_peak(stages, got, peaks)[0] > free_bytes:
            return None
        return got

    monkeypatch.setattr(remat_search, "_rank_choices", halves)
    assert _interleaved("auto", least) is None
    assert _least_memory("auto", keep_all.predicted.peak_memory_bytes) > least * 1.02


def _walk_rank(schedule: str, p: int, m: int, v: int, rank: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    """Rank `rank`'s stages, and for each of its actions the counts of those stages in flight while it runs (the
    running micro-batch counted) and the index of its stage."""
    from pyplan.solve.schedules import pipeline_order, stage_placement

    placement = stage_placement(schedule, p, v)
    stages = [s for s in range(p * v) if placement[s] == rank]
    now = [0] * len(stages)
    running = []
    for a in pipeline_order(schedule, p, m, v)[rank]:
        j = stages.index(a.stage)
        if a.op == "F":
            now[j] += 1
        running.append((list(now), j))
        if a.op in ("B", "W"):
            now[j] -= 1
    return stages, running


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble"])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_ranks_chunks_are_counted_at_the_ranks_peak_over_time(schedule: str, p: int, v: int) -> None:
    """The refinement's rank memory with several chunks (`_rank_peak`) against walking the schedule action by action,
    with random held, resident and working bytes per chunk: it is the largest over every moment of Σ_j n_j·A_j plus
    the largest working memory of a chunk in flight then, at least what each action holds while it runs (its own
    chunk's working memory beside every micro-batch in flight), at most the chunks' own peaks summed; the chunks'
    shares add up to it."""
    import random
    from types import SimpleNamespace

    from pyplan.remat_plan import no_remat
    from pyplan.solve.remat_search import StageChoice, _Choice, _rank_peak
    from pyplan.solve.schedules import in_flight_peaks, simulate, torch_rejection

    for m in (2, 4, 8, 12):
        if torch_rejection(schedule, p, m, v):
            continue
        rng = random.Random(f"{schedule}-{p}-{v}-{m}")
        ones = [1.0] * (p * v)
        own = simulate(schedule, ones, ones, num_microbatches=m, stages_per_rank=v, backward_weight_s=ones)
        peaks = in_flight_peaks(schedule, p, m, v)
        for rank in range(p):
            stages_, running = _walk_rank(schedule, p, m, v, rank)
            n = [own.peak_in_flight[s] for s in stages_]
            held = [rng.uniform(0, 1e6) for _ in stages_]
            resident = [rng.uniform(0, 1e5) for _ in stages_]
            working = [rng.uniform(0, 3e6) for _ in stages_]
            again = [rng.uniform(0, 1e5) for _ in stages_]
            choices = [
                _Choice(StageChoice(no_remat(0, 1), 0.0, 0.0, 0.0, w + k * h - a, 0.0, h), a, k)
                for w, h, a, k in zip(working, held, again, n)
            ]
            planning: Any = [SimpleNamespace(resident_bytes=x) for x in resident]
            most, shares = _rank_peak(planning, choices, peaks[rank])
            per_mb = [h + x for h, x in zip(held, resident)]

            def at(counts: list[int], per_mb: list[float] = per_mb) -> float:
                return sum(c * x for c, x in zip(counts, per_mb))

            exact = max(at(c) + max(working[j] for j in range(len(c)) if c[j] > 0) for c, _ in running)
            sound = max(at(c) + working[j] for c, j in running)
            summed = sum(k * x + w for k, x, w in zip(n, per_mb, working))
            assert most == pytest.approx(exact, rel=1e-12)
            assert sound <= most * (1 + 1e-12) and most <= summed * (1 + 1e-12)
            assert sum(shares) == pytest.approx(most, rel=1e-12)


def test_the_530b_rank_0_chunks_are_counted_at_139_micro_batches_not_174() -> None:
    """Megatron-LM's 530B ([KORTH], pp 35, 3 chunks a rank, m 280): the refinement counts rank 0's chunks as the
    rank holds them at its peak, 139 micro-batches' worth, not their own peaks (70, 69 and 35) summed."""
    from types import SimpleNamespace

    from pyplan.remat_plan import no_remat
    from pyplan.solve.remat_search import StageChoice, _Choice, _rank_peak
    from pyplan.solve.schedules import in_flight_peaks

    choices = [_Choice(StageChoice(no_remat(0, 1), 0.0, 0.0, 0.0, n * 1e9, 0.0, 1e9), 0.0, n) for n in (70, 69, 35)]
    planning: Any = [SimpleNamespace(resident_bytes=0.0)] * 3
    most, shares = _rank_peak(planning, choices, in_flight_peaks("Interleaved1F1B", 35, 280, 3)[0])
    assert most == 139e9 and shares == [69e9, 35e9, 35e9]
