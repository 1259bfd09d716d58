"""Planning the whole zoo on five cluster sizes, with an empty and with a warm profile cache; prints a table.

Run: `python benchmarks/zoo.py [--jobs J] [--global-batch B] [--models a,b,...]`. What `pyplan zoo all --gpus
8,32,128,512,1024 --gpu a100-80g` does: every zoo model built on the meta device, traced, profiled analytically
for an A100 80GB (once per model) and searched for each of 8, 32, 128, 512 and 1,024 GPUs (8 per node), in J
worker processes (default: the CPU count). The cold run starts with an empty profile cache, the warm run reuses
it (tracing and the searches remain). Each run is a fresh process, so its wall time includes starting Python,
importing torch and pyplan, and starting the workers, as a user's command does; CPU time is the workers' time
in their tasks (imports left out). Targets: on 2 cores, the cold run in under 2 minutes, the warm
run in under 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from rich.table import Table

from pyplan.report.console import make_console

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import new_table, run_child

SIZES = (8, 32, 128, 512, 1024)
GPU = "a100-80g"
TARGETS_S = {"cold": 120.0, "warm": 20.0}


def run_once(cache_dir: str, jobs: int, global_batch: int, models: list[str]) -> dict[str, Any]:
    """One sweep in this process (the child's side); what it did, as JSON-ready data."""
    from pyplan import Cluster, Workload, zoo
    from pyplan.profile.cache import ProfileCache
    from pyplan.sweep import ModelRef, Sweep, cluster_label

    names = models or zoo.names()
    clusters = [Cluster.from_catalog(GPU, n) for n in SIZES]
    sweep = Sweep(
        models=tuple(ModelRef(n, ref=f"zoo:{n}") for n in names),
        clusters=tuple((cluster_label(c), c) for c in clusters),
        workloads=dict.fromkeys(names, Workload(global_batch=global_batch)),
    )
    result = sweep.run(jobs=jobs, cache=ProfileCache(cache_dir))
    statuses = [r["status"] for r in result.records]
    return {
        "models": len(names),
        "pairs": len(result.records),
        "status": {s: statuses.count(s) for s in sorted(set(statuses))},
        "hits": result.cache.hits,
        "misses": result.cache.misses,
        "sweep_s": result.seconds,
        "slowest": sorted(result.task_seconds, key=lambda t: -t[1])[:3],
        "failed": sorted({r["model"] for r in result.records if r["status"] == "failed"}),
        "cpu_s": result.task_cpu_seconds,
    }


def _child(cache_dir: str, jobs: int, global_batch: int, models: list[str]) -> dict[str, Any]:
    args = ["--one", cache_dir, "--jobs", str(jobs), "--global-batch", str(global_batch), "--models", ",".join(models)]
    start = time.perf_counter()
    done = run_child(__file__, *args, check=True)
    return {**json.loads(done.stdout), "wall_s": time.perf_counter() - start}


def _table(rows: list[tuple[str, dict[str, Any]]], jobs: int, global_batch: int) -> Table:
    table = new_table(
        f"Planning the zoo for {', '.join(map(str, SIZES))} x {GPU} ({os.cpu_count()} cores, {jobs} jobs, "
        f"global batch {global_batch}, torch {torch.__version__})",
        ("cache", "models", "pairs", "outcomes", "profiles", "wall s", "sweep s", "CPU s", "target", "slowest"),
        left=("cache", "outcomes", "slowest"),
        caption="wall: the whole command (Python start, imports, workers); sweep: planning alone; CPU: the tasks' "
        "CPU time in the workers; slowest: a model's profile and searches in its worker, seconds",
    )
    for cache, r in rows:
        target = TARGETS_S[cache]
        table.add_row(
            cache,
            str(r["models"]),
            str(r["pairs"]),
            ", ".join(f"{n} {s}" for s, n in r["status"].items()),
            f"{r['hits']} cached, {r['misses']} made",
            f"{r['wall_s']:.1f}",
            f"{r['sweep_s']:.1f}",
            f"{r['cpu_s']:.0f}",
            f"< {target:.0f} s " + ("ok" if r["wall_s"] < target else "MISSED"),
            ", ".join(f"{name} {s:.1f}" for name, s in r["slowest"]),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step (default 32, as pyplan plan)")
    parser.add_argument("--models", default="", help="comma-separated zoo names (default: the whole zoo)")
    parser.add_argument("--one", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    if args.one:
        print(json.dumps(run_once(args.one, args.jobs, args.global_batch, models)))
        return
    console = make_console()
    with tempfile.TemporaryDirectory() as cache_dir:
        rows = [(cache, _child(cache_dir, args.jobs, args.global_batch, models)) for cache in ("cold", "warm")]
    console.print(_table(rows, args.jobs, args.global_batch))
    failed = sorted({m for _, r in rows for m in r["failed"]})
    if failed:
        console.print(f"failed with an internal error: {', '.join(failed)} (`pyplan plan zoo:NAME --debug`)")


if __name__ == "__main__":
    main()
