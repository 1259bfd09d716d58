"""Rematerialization: pyplan's optimal plan against checkpoint_sequential's best, and the DP's solve time.

Run: `python benchmarks/remat.py`. Targets:
for ResNet-152 and GPT-2 xl, profiled analytically for an A100 (times from the roofline, bytes measured on
fake tensors), at budgets from the least any plan needs up to what keeping everything needs, the predicted
overhead (recomputation time over the time without remat) of pyplan's plan is never worse than that of
`torch.utils.checkpoint.checkpoint_sequential` with its best segment count; the table says by how much it is
better. And the DP solves a 200-block chain with 500 memory slots in under 1 s.

Both plans are replayed by the same model (pyplan/solve/remat.py), so the comparison is like for like; `n/a`
means no segment count of checkpoint_sequential fits that budget.
"""

from __future__ import annotations

import functools
import os
import random
import sys

import torch
from rich.console import Console

from pyplan import zoo
from pyplan.api import chain_for
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.profile.remat import remat_bytes
from pyplan.remat_plan import no_remat, periodic
from pyplan.solve.remat import RematChain, min_budget, replay, solve
from pyplan.units import fmt_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import new_table, timed

MODELS = (("resnet152", 32), ("gpt2-xl", 4))
STEPS = 8
SLOTS = 500


def model_chain(name: str, batch: int) -> RematChain:
    spec = zoo.get(name)
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 1)
    chain, _ = chain_for(model, spec.example_inputs, cluster, Workload(global_batch=batch))
    profile = remat_bytes(chain, spec.example_inputs, (1, 2))
    fwd = [b.fwd_time_s(batch) for b in chain.blocks]
    bwd = [b.bwd_time_s(batch) for b in chain.blocks]
    return profile.chain(batch, fwd, bwd)


def best_periodic(chain: RematChain, budget: float) -> tuple[int, float] | None:
    n = len(chain)
    fits = []
    for k in range(1, n + 1):
        rep = replay(chain, periodic(0, n, k))
        if rep.peak_bytes <= budget:
            fits.append((rep.time_s, k))
    if not fits:
        return None
    t, k = min(fits)
    return k, t


def compare(console: Console) -> None:
    table = new_table(
        "Predicted recompute overhead: pyplan's optimal plan vs checkpoint_sequential's best",
        ("model", "blocks", "budget", "pyplan", "peak", "checkpoint_seq.", "segments", "better by"),
    )
    for name, batch in MODELS:
        chain = model_chain(f"{name}", batch)
        n = len(chain)
        base = sum(chain.fwd_s) + sum(chain.bwd_s)
        least = min_budget(chain)
        top = replay(chain, no_remat(0, n)).peak_bytes
        for i in range(STEPS + 1):
            budget = least + (top - least) * i / STEPS
            budget = max(budget, least * 1.02)  # slots round sizes up: the least budget needs a little room
            got = solve(chain, budget, slots=SLOTS)
            ours = got.time_s / base - 1
            ref = best_periodic(chain, budget)
            theirs = "n/a" if ref is None else f"{ref[1] / base - 1:.1%}"
            by = "-" if ref is None else f"{(ref[1] - got.time_s) / base:.1%} pts"
            table.add_row(
                f"{name} b={batch}",
                str(n),
                fmt_bytes(budget),
                f"{ours:.1%}",
                fmt_bytes(got.peak_bytes),
                theirs,
                "-" if ref is None else str(ref[0]),
                by,
            )
            assert ref is None or got.time_s <= ref[1] * (1 + 1e-9), (name, budget)
        table.add_section()
    console.print(table)


def random_chain(n: int, seed: int = 0) -> RematChain:
    rng = random.Random(seed)
    out = [rng.uniform(1, 8) * 1e6 for _ in range(n)]
    kept = [o + rng.uniform(0, 15) * 1e6 for o in out]
    grad = [rng.uniform(1, 6) * 1e6 for _ in range(n + 1)]
    values = [((o / 2, i + 1), (o / 2, min(n, i + 1 + rng.randint(0, 4)))) for i, o in enumerate(out)]
    return RematChain(
        fwd_s=tuple(rng.uniform(1, 9) * 1e-3 for _ in range(n)),
        bwd_s=tuple(rng.uniform(1, 18) * 1e-3 for _ in range(n)),
        kept_bytes=tuple(kept),
        out_bytes=tuple(out),
        fwd_peak_bytes=tuple(k + rng.uniform(0, 5) * 1e6 for k in kept),
        fwd_nosave_peak_bytes=tuple(o + rng.uniform(0, 5) * 1e6 for o in out),
        bwd_peak_bytes=tuple(kept[i] + grad[i] + grad[i + 1] for i in range(n)),
        grad_bytes=tuple(grad),
        # half of each output passed on through up to 4 more blocks (a residual stream)
        out_values=tuple(values),
        # each value saved by its block, by its first reader, or by none (an add's inputs), as in real models
        out_savers=tuple(tuple(_savers(rng, i, n) for _ in vs) for i, vs in enumerate(values)),
    )


def _savers(rng: random.Random, i: int, n: int) -> tuple[int, ...]:
    """Who saves a value of block i: the block itself (40 %), its next block (40 %) or nobody (20 %)."""
    pick = rng.random()
    if pick < 0.4 or i + 1 >= n:
        return (i,)
    return (i + 1,) if pick < 0.8 else ()


def speed(console: Console) -> None:
    table = new_table("Remat DP solve time (median of 5)", ("blocks", "slots", "offload", "solve", "target"))
    for n, slots, offload in ((50, 500, False), (100, 500, False), (200, 500, False), (200, 500, True)):
        chain = random_chain(n)
        least = min_budget(chain)
        top = replay(chain, no_remat(0, n)).peak_bytes
        bw = 25e9 if offload else None
        _, seconds = timed(
            functools.partial(solve, chain, (least + top) / 2, slots=slots, offload_bw_bytes_per_s=bw), 5
        )
        table.add_row(
            str(n), str(slots), "yes" if offload else "no", f"{seconds * 1e3:.0f} ms", "< 1 s" if n == 200 else ""
        )
    console.print(table)


def main() -> None:
    console = Console(width=140)
    speed(console)
    compare(console)


if __name__ == "__main__":
    main()
