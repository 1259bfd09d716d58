"""Tests of the plan search: brute force on small instances, ZeRO-3 and fewer-GPU paths, errors, Pareto."""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import asdict, replace
from typing import Any

import pytest

from pyplan import _core
from tests.solve.reference_search import Hardware, Host, ProfiledChain, Space, search_brute_force

REL = 1e-9


def _chain(rng: random.Random, num_blocks: int) -> ProfiledChain:
    def u(lo: float, hi: float, n: int) -> list[float]:
        return [rng.uniform(lo, hi) for _ in range(n)]

    return ProfiledChain(
        fwd_alpha_s=u(1e-3, 4e-3, num_blocks),
        fwd_beta_s=u(0, 1e-3, num_blocks),
        bwd_alpha_s=u(2e-3, 8e-3, num_blocks),
        bwd_beta_s=u(0, 2e-3, num_blocks),
        act_per_sample_bytes=u(1e6, 1e7, num_blocks),
        act_fixed_bytes=u(0, 1e5, num_blocks),
        params=u(1e5, 2e6, num_blocks),
        cut_per_sample_bytes=u(1e4, 2e5, num_blocks + 1),
        cut_fixed_bytes=u(0, 1e4, num_blocks + 1),
        param_tensors=[float(rng.randint(0, 12)) for _ in range(num_blocks)],
        cut_tensors=[float(rng.randint(1, 3)) for _ in range(num_blocks + 1)],
        **_measured_times(rng, num_blocks),
    )


def _measured_times(rng: random.Random, num_blocks: int) -> dict[str, list[float]]:
    """Times measured at a few sizes (pyplan's Piecewise), for half the chains: sizes the searched micro-batches
    fall between, on, below and above; per-sample costs that fall and rise with b, as on a real machine."""
    if rng.random() < 0.5:
        return {}
    sizes = sorted(rng.sample((1, 2, 3, 4, 8, 16), rng.randint(2, 4)))
    out: dict[str, list[float]] = {"time_sizes": [float(b) for b in sizes], "fwd_points_s": [], "bwd_points_s": []}
    for _ in range(num_blocks):
        for key, scale in (("fwd_points_s", 1e-3), ("bwd_points_s", 2e-3)):
            out[key] += [scale * b * rng.uniform(0.5, 4.0) + rng.uniform(0, scale) for b in sizes]
    return out


def _host(rng: random.Random) -> Host:
    """Host costs as a CPU over gloo has them (half the instances), or none."""
    if rng.random() < 0.5:
        return Host()
    return Host(
        stage_forward_s=rng.uniform(0, 5e-4),
        stage_backward_s=rng.uniform(0, 5e-4),
        message_s=rng.uniform(0, 3e-4),
        step_s=rng.uniform(0, 2e-3),
        optimizer_tensor_s=rng.uniform(0, 5e-5),
        optimizer_element_s=rng.choice((0.0, rng.uniform(1e-11, 1e-8))),
        sync_overlaps_backward=rng.random() < 0.5,
    )


def _hardware(rng: random.Random, num_gpus: int, gpus_per_node: int, gpu_mem_bytes: float) -> Hardware:
    return Hardware(
        num_gpus=num_gpus,
        gpus_per_node=gpus_per_node,
        gpu_mem_bytes=gpu_mem_bytes,
        mem_bw_bytes_per_s=rng.uniform(1e11, 1e12),
        intra=(rng.uniform(1e-6, 1e-5), rng.uniform(2e10, 2e11)),
        inter=(rng.uniform(1e-5, 1e-4), rng.uniform(2e9, 2e10)),
        price_per_gpu_s=rng.uniform(1e-4, 1e-3),
        intra_collective=rng.choice((None, (rng.uniform(1e-5, 1e-4), rng.uniform(1e9, 1e10)))),
        host=_host(rng),
    )


def _search(chain: ProfiledChain, hw: Hardware, space: Space, *, top_k: int = 5, **extra: Any) -> _core.SearchResult:
    kwargs = asdict(space)
    kwargs["param_bytes"], kwargs["grad_bytes"], kwargs["optim_bytes"] = kwargs.pop("bytes_per_param")
    kwargs["micro_batch_sizes"] = list(kwargs["micro_batch_sizes"])
    arrays = asdict(chain)
    host = asdict(hw.host)
    return _core.search(
        *[arrays.pop(k) for k in list(arrays)[:9]],
        **arrays,
        intra_collective=hw.intra_collective or (0.0, 0.0),
        inter_collective=hw.inter_collective or (0.0, 0.0),
        host=host,
        num_gpus=hw.num_gpus,
        gpus_per_node=hw.gpus_per_node,
        gpu_mem_bytes=hw.gpu_mem_bytes,
        mem_bw_bytes_per_s=hw.mem_bw_bytes_per_s,
        intra_latency_s=hw.intra[0],
        intra_bw_bytes_per_s=hw.intra[1],
        inter_latency_s=hw.inter[0],
        inter_bw_bytes_per_s=hw.inter[1],
        price_per_gpu_s=hw.price_per_gpu_s,
        top_k=top_k,
        **kwargs,
        **extra,
    )


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0)


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(time, cost) pairs no other pair beats in both, one per equal pair, by increasing time."""
    out: list[tuple[float, float]] = []
    for t, c in sorted(set(points)):
        if not out or c < out[-1][1]:
            out.append((t, c))
    return out


def _instance(seed: int) -> tuple[ProfiledChain, Hardware, Space]:
    rng = random.Random(seed)
    num_blocks = rng.randint(2, 6)
    chain = _chain(rng, num_blocks)
    gpus_per_node = rng.choice((2, 4, 8))
    num_gpus = rng.choice((1, 2, 3, 4, 6, 8, 12, 16))
    batch = rng.choice((4, 6, 8, 12, 16))
    # Memory from "everything fits on one GPU" down to "only sharded, deep pipelines fit".
    whole = 16 * sum(chain.params) + batch * sum(chain.act_per_sample_bytes)
    hw = _hardware(rng, num_gpus, gpus_per_node, rng.uniform(0.05, 1.0) * whole)
    space = Space(
        global_batch=batch,
        bytes_per_param=(2.0, 2.0, 12.0),
        micro_batch_sizes=rng.choice(((), (), (1, 2), (2, 4, 8))),
        allow_fewer_gpus=rng.random() < 0.5,
        objective=rng.choice(("time", "cost", "weighted")),
        weight=rng.choice((0.0, 2.0**-4, 1.0)),
        zero3_single_stage=rng.random() < 0.5,
        # Mixed precision's ZeRO-3: 16-bit weights gathered, fp32 gradients reduced.
        zero3_gather_bytes=rng.choice((0.0, 1.0)),
        zero3_reduce_bytes=rng.choice((0.0, 4.0)),
    )
    return chain, hw, space


@pytest.mark.parametrize("seed", range(150))
def test_search_equals_brute_force(seed: int) -> None:
    _equals_brute_force(*_instance(seed))


@pytest.mark.parametrize("seed", range(40))
def test_a_pinned_partition_equals_brute_force_over_that_partition(seed: int) -> None:
    """With fixed_cuts, only configurations of that many stages, cut there: the brute force's best of them."""
    chain, hw, space = _instance(seed)
    rng = random.Random(10_000 + seed)
    num_blocks = len(chain.fwd_alpha_s)
    stages = rng.randint(1, min(num_blocks, 4))
    cuts = (0, *sorted(rng.sample(range(1, num_blocks), stages - 1)), num_blocks)
    space = replace(space, fixed_cuts=cuts)
    if not search_brute_force(chain, hw, space).num_candidates:
        with pytest.raises(ValueError, match=f"no configuration has {stages} stages|is not d·b·m"):
            _search(chain, hw, space)
        return
    result = _equals_brute_force(chain, hw, space)
    if result is not None and result.feasible:
        assert all(tuple(c.cuts) == cuts for c in result.top)


def _chunks_instance(seed: int) -> tuple[ProfiledChain, Hardware, Space]:
    """Chains long enough for 3 and 4 stages per rank on 2 or 3 pipeline ranks, the allowed v drawn."""
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 9)
    chain = _chain(rng, num_blocks)
    batch = rng.choice((4, 6, 8))
    whole = 16 * sum(chain.params) + batch * sum(chain.act_per_sample_bytes)
    hw = _hardware(rng, rng.choice((2, 3, 4)), rng.choice((2, 4)), rng.uniform(0.1, 1.0) * whole)
    space = Space(
        global_batch=batch,
        bytes_per_param=(2.0, 2.0, 12.0),
        micro_batch_sizes=rng.choice(((), (1, 2))),
        stages_per_rank=rng.choice(((1, 2, 3, 4), (3,), (2, 4), (1, 3, 4))),
        allow_fewer_gpus=rng.random() < 0.5,
        objective=rng.choice(("time", "cost")),
        zero_stages=(0, 1),
    )
    return chain, hw, space


@pytest.mark.parametrize("seed", range(30))
def test_interleaved_chunks_equal_brute_force(seed: int) -> None:
    """Interleaved schedules with 2, 3 or 4 stages per rank (stage s on rank s mod p, a rank's stages sharing its
    memory): the search's best, top and frontier are the brute force's."""
    _equals_brute_force(*_chunks_instance(seed))


def test_chunk_instances_plan_three_and_four_stages_per_rank() -> None:
    """The instances above reach v = 3 and v = 4 among the plans found."""
    found = set()
    for seed in range(30):
        chain, hw, space = _chunks_instance(seed)
        found |= {x.stages_per_rank for x in search_brute_force(chain, hw, space).feasible}
    assert {3, 4} <= found


@pytest.mark.parametrize("seed", range(30))
def test_two_chunks_apart_are_the_search_of_at_most_two(seed: int) -> None:
    """With two_chunks_apart the search also returns the top and frontier that a search of at most 2 stages per rank
    alone finds (the planner refines both, so that more chunks never push a candidate out), and the same overall."""
    chain, hw, space = _chunks_instance(seed)
    space = replace(space, stages_per_rank=(1, 2, 3, 4))
    few = replace(space, stages_per_rank=(1, 2))
    try:
        apart = _search(chain, hw, space, top_k=3, two_chunks_apart=True)
    except ValueError:
        return
    whole, alone = _search(chain, hw, space, top_k=3), _search(chain, hw, few, top_k=3)
    key = [(c.dp, c.pp, c.stages_per_rank, c.micro_batch_size, c.schedule, c.zero_stage, c.placement, c.objective)
           for c in (*apart.top, *apart.pareto)]  # fmt: skip
    assert key == [(c.dp, c.pp, c.stages_per_rank, c.micro_batch_size, c.schedule, c.zero_stage, c.placement,
                    c.objective) for c in (*whole.top, *whole.pareto)]  # fmt: skip
    ours = [(c.dp, c.pp, c.micro_batch_size, c.schedule, c.zero_stage, c.placement, tuple(c.cuts), c.objective)
            for c in (*apart.top_two_chunks, *apart.pareto_two_chunks)]  # fmt: skip
    assert ours == [(c.dp, c.pp, c.micro_batch_size, c.schedule, c.zero_stage, c.placement, tuple(c.cuts),
                     c.objective) for c in (*alone.top, *alone.pareto)]  # fmt: skip
    assert all(c.stages_per_rank <= 2 for c in (*apart.top_two_chunks, *apart.pareto_two_chunks))


def test_three_chunks_shrink_the_bubble() -> None:
    """Six equal blocks on two GPUs that cannot each hold the model, two micro-batches, every send free: a rank's
    bubble is p − 1 stage steps of its v stages, so three chunks a rank beat two, and two beat one (Narayanan et al.
    2021); the default chunks find the three."""
    chain = ProfiledChain(
        fwd_alpha_s=[1e-3] * 6,
        fwd_beta_s=[0.0] * 6,
        bwd_alpha_s=[2e-3] * 6,
        bwd_beta_s=[0.0] * 6,
        act_per_sample_bytes=[1.0] * 6,
        act_fixed_bytes=[0.0] * 6,
        params=[1e6] * 6,
        cut_per_sample_bytes=[0.0] * 7,
        cut_fixed_bytes=[0.0] * 7,
    )
    hw = Hardware(2, 2, 60e6, 1e15, intra=(0.0, 1e18), inter=(0.0, 1e18), price_per_gpu_s=1e-3)
    times = {}
    for chunks in ((1,), (2,), (3,), (1, 2, 3, 4)):
        space = Space(2, (2.0, 2.0, 12.0), micro_batch_sizes=(1,), stages_per_rank=chunks, zero_stages=(0,))
        result = _equals_brute_force(chain, hw, space)
        times[chunks] = result.best.iteration_s
        assert (result.best.dp, result.best.pp) == (1, 2)
        assert result.best.stages_per_rank == (chunks[0] if len(chunks) == 1 else 3)
        assert len(result.best.cuts) == 2 * result.best.stages_per_rank + 1
    assert times[(3,)] < times[(2,)] < times[(1,)]
    assert times[(1, 2, 3, 4)] == times[(3,)]


def _fresh_instance(seed: int) -> tuple[ProfiledChain, Hardware, Space]:
    """A few GPUs, and memory around the least that a plan needs counting every gradient: where one replica's
    stages that leave out the gradients not yet made at their peak fit and the others do not."""
    rng = random.Random(seed)
    chain = _chain(rng, rng.randint(2, 6))
    hw = _hardware(rng, rng.choice((1, 2, 3, 4)), rng.choice((2, 4)), 1.0)
    batch = rng.choice((2, 4, 6, 8))
    space = Space(
        global_batch=batch,
        bytes_per_param=(2.0, 2.0, 12.0),
        micro_batch_sizes=rng.choice(((), (1, 2), (batch // 2, batch))),
        allow_fewer_gpus=rng.random() < 0.5,
        objective=rng.choice(("time", "cost")),
        schedules=rng.choice((("GPipe", "1F1B"), ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"))),
        zero_stages=rng.choice(((0,), (0, 1), (0, 1, 2, 3))),
        fresh_gradients=True,
    )
    try:
        need = _search(chain, hw, replace(space, fresh_gradients=False)).least_need_bytes
    except ValueError:  # no d·b·m is the batch: the test expects the error
        need = 1.0
    return chain, replace(hw, gpu_mem_bytes=need * rng.uniform(0.85, 1.15)), space


@pytest.mark.parametrize("seed", range(80))
def test_fresh_gradients_equal_brute_force(seed: int) -> None:
    """One replica's stages that run every forward before their first backward leave out the gradients not yet made
    at their peak (search.h step 3): the bounds, the shared partitions and the evaluation agree with the brute force."""
    _equals_brute_force(*_fresh_instance(seed))


def test_fresh_gradient_instances_leave_gradients_out() -> None:
    """The instances above reach plans that leave gradients out, and plans that fit only so."""
    relieved = admitted = 0
    for seed in range(80):
        chain, hw, space = _fresh_instance(seed)
        with contextlib.suppress(ValueError):
            fresh, counted = _search(chain, hw, space), _search(chain, hw, replace(space, fresh_gradients=False))
            relieved += any(x > 0 for c in fresh.top for x in c.stage_unmade_grad_bytes)
            admitted += fresh.feasible and not counted.feasible
    assert relieved >= 15 and admitted >= 3


def test_fresh_gradients_admit_what_fits_only_by_them() -> None:
    """One GPU, one micro-batch: 2 blocks of 1e6 parameters (16 B each, 2 of them gradients) saving 3e6 B a sample
    at b = 4 beside an input cut of 1e5 B. Counted whole, the plan needs 32e6 + 4 x 6e6 + 1e5 = 56.1e6 B; its 4e6
    B of gradients are not yet made when its activations peak, so 52.1e6 B is what it needs. Below that nothing
    fits, and the reason names 52.1e6 B."""
    chain = ProfiledChain(
        fwd_alpha_s=[1e-3] * 2,
        fwd_beta_s=[0.0] * 2,
        bwd_alpha_s=[2e-3] * 2,
        bwd_beta_s=[0.0] * 2,
        act_per_sample_bytes=[3e6] * 2,
        act_fixed_bytes=[0.0] * 2,
        params=[1e6] * 2,
        cut_per_sample_bytes=[2.5e4] * 3,
        cut_fixed_bytes=[0.0] * 3,
    )
    hw = Hardware(1, 1, 52.1e6, 1e12, intra=(1e-6, 1e11), inter=(1e-5, 1e10), price_per_gpu_s=1e-3)
    space = Space(4, (2.0, 2.0, 12.0), micro_batch_sizes=(4,))
    assert not _search(chain, hw, space).feasible
    fresh = replace(space, fresh_gradients=True)
    best = _search(chain, hw, fresh).best
    assert (best.dp, best.pp, best.num_microbatches) == (1, 1, 1)
    assert best.stage_unmade_grad_bytes == [4e6] and best.peak_memory_bytes == pytest.approx(52.1e6, rel=REL)
    ((time_s, need),) = {(x.iteration_s, x.peak_memory_bytes) for x in search_brute_force(chain, hw, fresh).feasible}
    assert _close(best.iteration_s, time_s) and _close(best.peak_memory_bytes, need)
    short = _search(chain, replace(hw, gpu_mem_bytes=52.0e6), fresh)
    assert not short.feasible and short.least_need_bytes == pytest.approx(52.1e6, rel=REL)
    # Saving less than the gradients, the plan holds every gradient at the step: its state and its input cut.
    light = _search(replace(chain, act_per_sample_bytes=[2.5e5] * 2), replace(hw, gpu_mem_bytes=32.1e6), fresh).best
    assert light.stage_unmade_grad_bytes == [2e6] and light.peak_memory_bytes == pytest.approx(32.1e6, rel=REL)


def _equals_brute_force(chain: ProfiledChain, hw: Hardware, space: Space) -> Any:
    """The search's result, checked against the brute force on the same instance."""
    try:
        result = _search(chain, hw, space, top_k=4)
    except ValueError as error:
        # Only a batch no d·b·m divides is an error here; the brute force finds no configuration then.
        assert "is not d·b·m" in str(error)
        assert not search_brute_force(chain, hw, space).feasible
        return None
    brute = search_brute_force(chain, hw, space)
    assert result.num_candidates == brute.num_candidates
    assert result.num_evaluated + result.num_pruned == result.num_candidates
    if not brute.feasible:
        assert not result.feasible
        assert result.best is None
        assert _close(result.least_need_bytes, brute.least_need_bytes)
        assert result.reason.startswith("no plan fits: the best candidate (")
        return
    assert result.feasible
    ranked = sorted(brute.feasible, key=lambda x: (x.objective, x.dp * x.pp, x.peak_memory_bytes))
    assert _close(result.best.objective, ranked[0].objective)
    assert [c.objective for c in result.top] == pytest.approx([x.objective for x in ranked[:4]], rel=REL)
    assert result.best.num_gpus == ranked[0].dp * ranked[0].pp or _close(ranked[0].objective, ranked[1].objective)
    # The same configuration and stages hold the same memory (receive buffers, the last input gradient).
    same = {(x.dp, x.pp, x.micro_batch_size, x.schedule, x.zero_stage, x.placement, x.cuts): x for x in brute.feasible}
    for c in result.top:
        x = same.get((c.dp, c.pp, c.micro_batch_size, c.schedule, c.zero_stage, c.placement, tuple(c.cuts)))
        if x is not None:
            assert _close(c.peak_memory_bytes, x.peak_memory_bytes)
    frontier = _frontier([(x.iteration_s, x.cost_per_iteration) for x in brute.feasible])
    got = [(c.iteration_s, c.cost_per_iteration) for c in result.pareto]
    assert len(got) == len(frontier)
    for (t, c), (bt, bc) in zip(got, frontier):
        assert _close(t, bt) and _close(c, bc)
    return result


def _small() -> tuple[ProfiledChain, Hardware, Space]:
    rng = random.Random(7)
    chain = _chain(rng, 6)
    hw = _hardware(rng, 8, 4, 16 * sum(chain.params))
    return chain, hw, Space(global_batch=16, bytes_per_param=(2.0, 2.0, 12.0))


def test_candidate_fields_are_consistent() -> None:
    chain, hw, space = _small()
    result = _search(chain, hw, space, top_k=20)
    for c in result.top:
        stages = c.pp * c.stages_per_rank
        assert len(c.cuts) == stages + 1 and c.cuts[0] == 0 and c.cuts[-1] == 6
        assert c.dp * c.micro_batch_size * c.num_microbatches == space.global_batch
        assert c.num_gpus == hw.num_gpus
        assert _close(c.iteration_s, c.makespan_s + c.exposed_sync_s + c.optimizer_s)
        assert _close(c.cost_per_iteration, c.num_gpus * hw.price_per_gpu_s * c.iteration_s)
        assert _close(c.samples_per_s, space.global_batch / c.iteration_s)
        assert 0.0 <= c.bubble_fraction < 1.0
        assert c.peak_memory_bytes == max(c.rank_memory_bytes) <= hw.gpu_mem_bytes
        assert len(c.stage_time_s) == len(c.stage_in_flight) == stages
    assert [c.objective for c in result.top] == sorted(c.objective for c in result.top)


def test_zero3_pays_collectives_in_the_blocks_and_shards_state() -> None:
    chain, hw, space = _small()
    only = {
        z: _search(chain, hw, Space(**{**asdict(space), "zero_stages": (z,), "schedules": ("1F1B",)}), top_k=50)
        for z in (0, 3)
    }
    by_config = {z: {(c.dp, c.pp, c.micro_batch_size, c.placement): c for c in only[z].top if c.dp > 1} for z in only}
    shared = set(by_config[0]) & set(by_config[3])
    assert shared
    for key in shared:
        z0, z3 = by_config[0][key], by_config[3][key]
        assert z3.exposed_sync_s == 0.0 and all(s == 0.0 for s in z3.stage_sync_s)
        assert all(a > b for a, b in zip(z3.stage_forward_s, z0.stage_forward_s)) or z0.cuts != z3.cuts
        assert sum(z3.stage_state_bytes) == pytest.approx(sum(z0.stage_state_bytes) / z0.dp, rel=REL)


def test_least_need_is_exact_and_zero3_fits_below_it() -> None:
    chain, hw, space = _small()
    replicated = Space(**{**asdict(space), "zero_stages": (0,)})
    need = _search(chain, replace(hw, gpu_mem_bytes=1e6), replicated).least_need_bytes
    below = replace(hw, gpu_mem_bytes=need * (1 - 1e-9))
    at = replace(hw, gpu_mem_bytes=need)
    assert not _search(chain, below, replicated).feasible
    assert _search(chain, at, replicated).best.peak_memory_bytes == need
    sharded = _search(chain, below, Space(**{**asdict(space), "zero_stages": (3,)}))
    assert sharded.feasible and sharded.best.zero_stage == 3 and sharded.best.dp > 1


def test_fewer_gpus_are_searched_only_when_allowed() -> None:
    chain, hw, space = _small()
    exact = _search(chain, hw, space, top_k=1000)
    fewer = _search(chain, hw, Space(**{**asdict(space), "allow_fewer_gpus": True}), top_k=1000)
    assert {c.num_gpus for c in exact.top} == {hw.num_gpus}
    assert {c.num_gpus for c in fewer.top} > {hw.num_gpus}
    assert fewer.num_candidates > exact.num_candidates
    assert fewer.best.objective <= exact.best.objective
    # With a price, the cheapest plan of the frontier uses fewer GPUs than offered.
    assert min(fewer.pareto, key=lambda c: c.cost_per_iteration).num_gpus < hw.num_gpus


def test_pareto_frontier_is_non_dominated_and_has_the_extremes() -> None:
    chain, hw, space = _small()
    space = Space(**{**asdict(space), "allow_fewer_gpus": True})
    by_time = _search(chain, hw, space)
    by_cost = _search(chain, hw, Space(**{**asdict(space), "objective": "cost"}))
    frontier = by_time.pareto
    assert len(frontier) >= 2
    for a in frontier:
        for b in frontier:
            if a is not b:
                assert not (b.iteration_s <= a.iteration_s and b.cost_per_iteration <= a.cost_per_iteration)
    assert [c.iteration_s for c in frontier] == sorted(c.iteration_s for c in frontier)
    assert frontier[0].iteration_s == by_time.best.iteration_s
    assert min(c.cost_per_iteration for c in frontier) == by_cost.best.cost_per_iteration
    assert [(c.iteration_s, c.cost_per_iteration) for c in by_cost.pareto] == [
        (c.iteration_s, c.cost_per_iteration) for c in frontier
    ]


def test_interleaved_stages_hold_their_simulated_peak_in_flight() -> None:
    # Interleaved1F1B over p = 2 ranks with m = 8 keeps at most (4, 3, 2, 1) micro-batches on its four
    # stages, not m: four blocks of 16 MB state and 16 MB activations each fit in 128 MB only with those
    # counts (one stage with 8 in flight alone needs 144 MB). And a rank's stages do not peak together: rank 0
    # holds 2 × 16 + 5 × 16 MB, never more than 5 of its stages' micro-batches at once (its stages' own peaks, 4 and 2,
    # come at different times), rank 1 2 × 16 + 3 × 16 MB; it fits in 112 MB.
    mb = 16e6
    chain = ProfiledChain(
        fwd_alpha_s=[1e-3] * 4,
        fwd_beta_s=[0.0] * 4,
        bwd_alpha_s=[2e-3] * 4,
        bwd_beta_s=[0.0] * 4,
        act_per_sample_bytes=[mb] * 4,
        act_fixed_bytes=[0.0] * 4,
        params=[mb / 16] * 4,
        cut_per_sample_bytes=[0.0] * 5,
        cut_fixed_bytes=[0.0] * 5,
    )
    hw = Hardware(2, 2, 8 * mb, 1e12, intra=(1e-6, 1e11), inter=(1e-5, 1e10), price_per_gpu_s=1e-3)
    space = Space(8, (2.0, 2.0, 12.0), micro_batch_sizes=(1,), schedules=("Interleaved1F1B",))
    result = _search(chain, hw, space)
    assert result.feasible
    best = result.best
    assert (best.dp, best.pp, best.num_microbatches, best.schedule) == (1, 2, 8, "Interleaved1F1B")
    assert best.stage_in_flight == [4, 3, 2, 1]
    assert best.rank_memory_bytes == [7 * mb, 5 * mb]
    assert best.stage_act_bytes[0] + best.stage_act_bytes[2] == 5 * mb < (4 + 2) * mb
    (brute,) = search_brute_force(chain, hw, space).feasible
    assert _close(best.iteration_s, brute.iteration_s) and brute.peak_memory_bytes == 7 * mb
    tight = replace(hw, gpu_mem_bytes=7 * mb)
    assert _search(chain, tight, space).feasible and search_brute_force(chain, tight, space).feasible
    short = _search(chain, replace(hw, gpu_mem_bytes=7 * mb * (1 - 1e-9)), space)
    assert not short.feasible and short.least_need_bytes == 7 * mb


def test_nothing_fits_names_the_least_memory_needed() -> None:
    chain, hw, space = _small()
    tiny = replace(hw, gpu_mem_bytes=1e6)
    result = _search(chain, tiny, space)
    brute = search_brute_force(chain, tiny, space)
    assert not result.feasible and result.best is None and not result.top and not result.pareto
    assert result.least_need_bytes == pytest.approx(brute.least_need_bytes, rel=REL)
    assert result.reason.startswith("no plan fits: the best candidate (dp=")
    assert "the GPU has 977 KiB" in result.reason
    assert result.num_feasible == 0 and result.num_evaluated >= 1


def test_no_schedule_torch_builds_is_reported_not_raised() -> None:
    chain, hw, _ = _small()
    four = replace(hw, num_gpus=4)
    # d·p = 4 and B = 2: 1F1B needs m >= p, which no (d, p, b) gives.
    result = _search(chain, four, Space(global_batch=2, bytes_per_param=(2.0, 2.0, 12.0), schedules=("1F1B",)))
    assert not result.feasible and result.num_candidates == 0
    assert result.reason.startswith("no plan: torch builds none of the allowed schedules")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_gpus": 0}, r"the number of GPUs must be in \[1, 1048576\], got 0"),
        ({"num_gpus": -2}, r"the number of GPUs must be in \[1, 1048576\], got -2"),
        ({"global_batch": 0}, "the global batch must be >= 1, got 0"),
        ({"global_batch": 3, "micro_batch_sizes": [2]}, "the global batch 3 is not d·b·m"),
        ({"objective": "speed"}, "the objective must be 'time', 'cost' or 'weighted', got 'speed'"),
        ({"schedules": ["ZBVZeroBubble"]}, "ZBVZeroBubble is not searched"),
        ({"placements": ["diagonal"]}, "the placement must be 'pp-inner' or 'dp-inner'"),
        ({"zero_stages": [4]}, "ZeRO stages are 0, 1, 2 or 3, got 4"),
        ({"host": {"step_s": -1.0}}, r"host cost step_s must be in \[0, 1e\+09\], got -1"),
        ({"host": {"launch_s": 1.0}}, "unknown host cost 'launch_s'"),
        ({"cut_tensors": [1.0]}, "cut_tensors"),
        ({"stages_per_rank": []}, "no stages per rank to search"),
        ({"stages_per_rank": [0]}, "stages per rank must be >= 1, got 0"),
    ],
)
def test_bad_input_raises_one_line(change: dict, message: str) -> None:
    chain, hw, _ = _small()
    kwargs = {
        "num_gpus": hw.num_gpus,
        "gpus_per_node": hw.gpus_per_node,
        "gpu_mem_bytes": hw.gpu_mem_bytes,
        "mem_bw_bytes_per_s": hw.mem_bw_bytes_per_s,
        "intra_latency_s": hw.intra[0],
        "intra_bw_bytes_per_s": hw.intra[1],
        "inter_latency_s": hw.inter[0],
        "inter_bw_bytes_per_s": hw.inter[1],
        "global_batch": 16,
        "param_bytes": 2.0,
        "grad_bytes": 2.0,
        "optim_bytes": 12.0,
        **change,
    }
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        _core.search(*list(asdict(chain).values())[:9], **kwargs)
    assert "\n" not in str(info.value)
