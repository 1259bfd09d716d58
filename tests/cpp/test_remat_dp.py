"""The remat DP (pyplan/remat.h) against brute force over every plan, replayed by pyplan.solve.remat.replay."""

from __future__ import annotations

import itertools
import math
import random
from functools import cache

import pytest

from pyplan.errors import InfeasibleError
from pyplan.remat_plan import Checkpoint, Keep, Offload, RematItem, RematPlan, full_remat, no_remat, periodic
from pyplan.solve.remat import RematChain, min_budget, replay, solve


def random_chain(rng: random.Random, n: int) -> RematChain:
    """Integer sizes (so a budget of B bytes in B slots loses nothing to rounding), consistent with the model:
    outputs split into values live one or more cuts, each saved by some of the blocks that may save it (its
    block, later ones up to its last cut) or by none, and some blocks that save nothing at all."""
    grad = [rng.randint(1, 6) for _ in range(n + 1)]
    saves = [rng.random() < 0.75 for _ in range(n)]
    out = [rng.randint(1, 8) for _ in range(n)]
    kept = [o + (rng.randint(0, 15) if saves[i] else 0) for i, o in enumerate(out)]
    values = [_values(rng, i, n, o) for i, o in enumerate(out)]
    return RematChain(
        fwd_s=tuple(float(rng.randint(1, 9)) for _ in range(n)),
        bwd_s=tuple(float(rng.randint(1, 18)) for _ in range(n)),
        kept_bytes=tuple(float(k) for k in kept),
        out_bytes=tuple(float(o) for o in out),
        fwd_peak_bytes=tuple(float(k + rng.randint(0, 5)) for k in kept),
        fwd_nosave_peak_bytes=tuple(float(o + rng.randint(0, 5)) for o in out),
        bwd_peak_bytes=tuple(float(kept[i] + grad[i] + grad[i + 1] + rng.randint(0, 5)) for i in range(n)),
        grad_bytes=tuple(float(g) for g in grad),
        out_values=tuple(values),
        out_savers=tuple(tuple(_savers(rng, i, last, saves) for _, last in vs) for i, vs in enumerate(values)),
        saves=tuple(saves),
        checkpoint_s=rng.choice((0.0, 0.0, 0.5, 2.0)),
        # What each block adds to a checkpoint it is inside (torch's saved-tensor hooks), in half the chains.
        checkpoint_block_s=tuple(float(rng.randint(0, 3)) for _ in range(n)) if rng.random() < 0.5 else (),
    )


def _values(rng: random.Random, i: int, n: int, out: int) -> tuple[tuple[float, int], ...]:
    """Block i's output split into values, some passed on through later blocks (a skip, a residual stream)."""
    first = rng.randint(0, out)
    lasts = [min(n, i + 1 + rng.choice((0, 0, 1, 2, 4))) for _ in range(2)]
    return tuple((float(b), last) for b, last in zip((first, out - first), lasts) if b > 0) or ((0.0, i + 1),)


def _savers(rng: random.Random, i: int, last: int, saves: list[bool]) -> tuple[int, ...]:
    """The blocks that save a value of block i live to cut `last`: each that saves anything, with chance 1/3."""
    return tuple(q for q in range(i, min(last, len(saves) - 1) + 1) if saves[q] and rng.random() < 1 / 3)


def all_plans(
    s: int, t: int, *, offload: bool, depth: int | None, trailing: bool = False
) -> list[tuple[RematItem, ...]]:
    """Every item sequence covering blocks s..t, nesting at most `depth`. A checkpoint with nothing after it
    is recomputed at once (same peak, more time): left out unless `trailing`."""

    @cache
    def plans(s: int, t: int, depth: int) -> tuple[tuple[RematItem, ...], ...]:
        if s > t:
            return ((),)
        out: list[tuple[RematItem, ...]] = []
        leaves: list[RematItem] = [Keep(s)] + ([Offload(s)] if offload else [])
        for leaf in leaves:
            out.extend((leaf, *rest) for rest in plans(s + 1, t, depth))
        if depth > 0:
            for k in range(s + 1, t + 2 if trailing else t + 1):
                for inner in plans(s, k - 1, depth - 1):
                    out.extend((Checkpoint(RematPlan(inner)), *rest) for rest in plans(k, t, depth))
        return tuple(out)

    return list(plans(s, t, t - s + 1 if depth is None else depth))


def replayed(
    chain: RematChain, *, bw: float, offload: bool, depth: int | None
) -> list[tuple[float, float, tuple[RematItem, ...]]]:
    """Every plan of the chain (all_plans) replayed once: (time, peak, items), for brute_force at each budget."""
    out = []
    for items in all_plans(0, len(chain) - 1, offload=offload, depth=depth):
        rep = replay(chain, RematPlan(items), offload_bw_bytes_per_s=bw)
        out.append((rep.time_s, rep.peak_bytes, items))
    return out


def brute_force(plans: list[tuple[float, float, tuple[RematItem, ...]]], budget: float):
    """The fastest of the replayed plans within the budget (time, plan), and the least peak of any."""
    best = (math.inf, None)
    least_peak = math.inf
    for time_s, peak_bytes, items in plans:
        least_peak = min(least_peak, peak_bytes)
        if peak_bytes <= budget and time_s < best[0]:
            best = (time_s, RematPlan(items))
    return best, least_peak


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_brute_force_over_every_plan(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    chain = random_chain(rng, n)
    offload = seed % 2 == 0
    bw = rng.uniform(0.5, 4.0) if offload else math.inf
    depth = None if seed % 3 else rng.randint(0, 2)
    plans = replayed(chain, bw=bw, offload=offload, depth=depth)
    (_, _), least = brute_force(plans, math.inf)
    assert min_budget(chain, offload=offload, max_depth=depth) == least
    top = replay(chain, no_remat(0, n)).peak_bytes
    for budget in sorted({int(least), int(least) + rng.randint(0, 10), int((least + top) / 2), int(top) + 3}):
        (want, _), _ = brute_force(plans, budget)
        if want == math.inf:
            with pytest.raises(InfeasibleError, match="the least any plan needs"):
                solve(
                    chain,
                    budget,
                    slots=budget,
                    offload_bw_bytes_per_s=bw if offload else None,
                    max_depth=depth,
                    baselines=False,
                )
            continue
        got = solve(
            chain,
            budget,
            slots=budget,
            offload_bw_bytes_per_s=bw if offload else None,
            max_depth=depth,
            baselines=False,
        )
        assert got.time_s == pytest.approx(want, rel=1e-12)
        assert got.peak_bytes <= budget


@pytest.mark.parametrize("n", [6, 7])
def test_dp_equals_brute_force_on_longer_chains(n: int) -> None:
    rng = random.Random(n)
    chain = random_chain(rng, n)
    plans = replayed(chain, bw=math.inf, offload=False, depth=None)
    (_, _), least = brute_force(plans, math.inf)
    top = int(replay(chain, no_remat(0, n)).peak_bytes)
    for budget in range(int(least), top + 1, max(1, (top - int(least)) // 6)):
        (want, _), _ = brute_force(plans, budget)
        assert solve(chain, budget, slots=budget, baselines=False).time_s == pytest.approx(want, rel=1e-12)


def checkpoint_sets(n: int) -> list[tuple[RematItem, ...]]:
    """One-level plans (checkpoint_sequential generalized): kept blocks and checkpointed segments, no nesting, the
    last block kept (as checkpoint_sequential and the DP's Checkpoint(s..k−1), k ≤ t, keep it: pyplan/remat.h)."""
    out = []
    # Each boundary between blocks: 0 same segment, 1 new segment; each segment kept or checkpointed.
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        segments = list(itertools.pairwise(bounds))
        for kinds in itertools.product((0, 1), repeat=len(segments)):
            if any(k == 0 and b - a > 1 for k, (a, b) in zip(kinds, segments)):
                continue  # a kept segment of several blocks is the same plan as single kept blocks
            if kinds[-1] == 1:
                continue  # the last segment checkpointed
            items: list[RematItem] = []
            for k, (a, b) in zip(kinds, segments):
                items.append(Keep(a) if k == 0 else Checkpoint(no_remat(a, b)))
            out.append(tuple(items))
    return out


@pytest.mark.parametrize("n", [9, 11])
def test_checkpoint_set_dp_equals_brute_force_up_to_11_blocks(n: int) -> None:
    rng = random.Random(100 + n)
    chain = random_chain(rng, n)
    plans = [(replay(chain, RematPlan(items)), items) for items in checkpoint_sets(n)]
    least = min(r.peak_bytes for r, _ in plans)
    top = int(replay(chain, no_remat(0, n)).peak_bytes)
    for budget in (int(least), int(least) + 5, (int(least) + top) // 2, top):
        want = min(r.time_s for r, _ in plans if r.peak_bytes <= budget)
        assert solve(chain, budget, slots=budget, max_depth=1, baselines=False).time_s == pytest.approx(want, rel=1e-12)
        # Nesting (Rotor) can only help.
        assert solve(chain, budget, slots=budget, baselines=False).time_s <= want + 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_never_worse_than_the_baselines_and_monotone(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 24)
    chain = random_chain(rng, n)
    baselines = [no_remat(0, n), full_remat(0, n)] + [periodic(0, n, k) for k in range(1, n + 1)]
    replays = [(plan, replay(chain, plan)) for plan in baselines]  # the same at every budget
    least = min_budget(chain)
    top = replay(chain, no_remat(0, n)).peak_bytes
    last = math.inf
    for budget in range(int(least), int(top) + 2):
        got = solve(chain, budget, slots=budget, baselines=False)
        assert got.peak_bytes <= budget
        assert got.time_s <= last + 1e-9  # more memory never costs time
        last = got.time_s
        for plan, rep in replays:
            if rep.peak_bytes <= budget:
                assert got.time_s <= rep.time_s + 1e-9, plan.describe()
    with pytest.raises(InfeasibleError, match=f"the least any plan needs is {least:.3g} B".replace("e+", "e")):
        solve(chain, least - 1, slots=100) if least > 1 else solve(chain, 0.5, slots=1)


def test_in_flight_micro_batches_fit_with_their_leftovers() -> None:
    rng = random.Random(7)
    chain = random_chain(rng, 10)
    top = replay(chain, no_remat(0, 10)).peak_bytes
    for k in (1, 2, 4):
        budget = int(top * 1.5)
        got = solve(chain, budget, slots=budget, in_flight=k)
        assert got.peak_bytes + (k - 1) * got.after_forward_bytes <= budget
    one = solve(chain, int(top), slots=int(top))
    assert one.plan == no_remat(0, 10)


def test_a_value_nobody_saves_dies_with_its_last_reader() -> None:
    # Block 0's output (10 bytes) is passed through block 1 to block 2, and none of them saves it: it dies with
    # block 2's forward, and block 0's backward no longer counts it. Block 1's output is saved by block 1 itself.
    chain = RematChain(
        fwd_s=(1.0, 1.0, 1.0),
        bwd_s=(1.0, 1.0, 1.0),
        kept_bytes=(10.0, 5.0, 1.0),
        out_bytes=(10.0, 5.0, 1.0),
        fwd_peak_bytes=(10.0, 5.0, 1.0),
        fwd_nosave_peak_bytes=(10.0, 5.0, 1.0),
        bwd_peak_bytes=(11.0, 7.0, 20.0),
        grad_bytes=(0.0, 1.0, 1.0, 1.0),
        out_values=(((10.0, 2),), ((5.0, 2),), ((1.0, 3),)),
        out_savers=(((),), ((1,),), ((2,),)),
    )
    got = replay(chain, no_remat(0, 3))
    assert got.after_forward_bytes == 5 + 1  # block 1's output and block 2's, not block 0's
    # Block 2's backward: what is live (6) less its kept bytes (1) and the resident output gradient (1), plus its
    # peak (20); had block 0's output lived to its backward, 10 more.
    assert got.peak_bytes == 24


@pytest.mark.parametrize("seed", range(20))
def test_what_a_micro_batch_holds_after_its_forward_is_the_replays(seed: int) -> None:
    # The core picks plans for several micro-batches in flight by their leftovers after the forward: its own count
    # must be the replay's, checkpoints and freed values included.
    from pyplan import _core
    from pyplan.solve.remat import _arrays, _plan_of_steps

    rng = random.Random(500 + seed)
    n = rng.randint(2, 12)
    chain = random_chain(rng, n)
    least, top = min_budget(chain), replay(chain, no_remat(0, n)).peak_bytes
    for budget in {int(least) + 1, int((least + top) / 2), int(top) + 1}:
        got = _core.remat(*_arrays(chain), budget_bytes=budget, slots=budget)
        if got.feasible:
            plan = _plan_of_steps(got.plan, 0)
            assert got.after_forward_bytes == pytest.approx(replay(chain, plan).after_forward_bytes, abs=1e-9)


def test_slots_round_towards_safety() -> None:
    rng = random.Random(3)
    chain = random_chain(rng, 30)
    sizes = ("kept_bytes", "out_bytes", "fwd_peak_bytes", "fwd_nosave_peak_bytes", "bwd_peak_bytes", "grad_bytes")
    scaled = RematChain(
        **{k: tuple(v * 1e6 + 0.37 for v in getattr(chain, k)) for k in sizes},
        fwd_s=chain.fwd_s,
        bwd_s=chain.bwd_s,
        out_values=tuple(tuple((b * 1e6 + 0.37 / len(vs), last) for b, last in vs) for vs in chain.out_values),
        out_savers=chain.out_savers,
        saves=chain.saves,
    )
    least = min_budget(scaled)
    for budget in (least * 1.05, least * 1.5, least * 3):
        for slots in (7, 50, 500):
            try:
                got = solve(scaled, budget, slots=slots)
            except InfeasibleError:
                continue
            assert got.peak_bytes <= budget


_SIZES = ("kept_bytes", "out_bytes", "fwd_peak_bytes", "fwd_nosave_peak_bytes", "bwd_peak_bytes", "grad_bytes")


def test_the_least_budget_is_always_answered() -> None:
    """At exactly `min_budget` slots round the least plan's sizes up past the budget: solve asks again with a few
    slots more and keeps an answer whose replay fits in bytes, never "no plan fits in X; the least is X"."""
    rng = random.Random(11)
    for _ in range(60):
        chain = random_chain(rng, rng.randint(2, 12))
        for scale in (1.0, 1e6):  # bytes, and MB-sized values whose rounding differs
            if scale != 1.0:
                chain = RematChain(
                    **{k: tuple(v * scale for v in getattr(chain, k)) for k in _SIZES},
                    fwd_s=chain.fwd_s,
                    bwd_s=chain.bwd_s,
                    out_values=tuple(tuple((b * scale, last) for b, last in vs) for vs in chain.out_values),
                    out_savers=chain.out_savers,
                    saves=chain.saves,
                )
            least = min_budget(chain)
            got = solve(chain, least)
            assert got.peak_bytes <= least and replay(chain, got.plan).peak_bytes <= least
