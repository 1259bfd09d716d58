"""Analytic profiling of large zoo models on the meta device: wall and CPU time per step, peak memory; prints a table.

Run: `python benchmarks/analytic.py [--gpu a100-80g] [--cprofile MODEL]`. Each model runs in a fresh process, so its
peak resident memory is its own. The steps are those `pyplan plan` takes for a GPU that is not present: build on
the meta device, trace, linearize, FLOPs per block (`block_flops`), bytes saved for backward (`saved_bytes`), and
roofline times (`block_times_analytic`, bf16 mixed precision), each at micro-batches 1 and 2.
Target: the 70B Llama configuration in under 60 s and under 2 GB of resident memory.
`--cprofile MODEL` profiles one model instead and prints where the time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pyplan import linearize, load_model, trace
from pyplan.hardware import get_gpu
from pyplan.profile.analytic import Roofline, block_times_analytic
from pyplan.profile.flops import block_flops
from pyplan.profile.memory import saved_bytes
from pyplan.units import fmt_bytes, fmt_count, fmt_seconds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, machine, new_table, peak_rss_bytes, run_child, target_line

MODELS = ("gpt2-xl", "llama-7b-style", "llama-70b-style")
TARGET_MODEL, TARGET_S, TARGET_RSS_BYTES = "llama-70b-style", 60.0, 2e9
STEPS = ("build", "trace", "linearize", "flops", "saved", "roofline")
SIZES = (1, 2)


def profile_model(name: str, gpu_name: str) -> dict[str, Any]:
    """Run every analytic step on zoo model `name`; times, figures at micro-batch 1 and memory, as JSON-ready data."""
    gpu = get_gpu(gpu_name)
    device = Roofline(gpu.peak_flops_per_s, gpu.hbm_bw_bytes_per_s)
    spec = load_model(f"zoo:{name}")
    rss_start = peak_rss_bytes()
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def step(key: str, fn: Callable[[], Any]) -> Any:
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        wall[key], cpu[key] = time.perf_counter() - w, time.process_time() - c
        return out

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return spec.build()

    model = step("build", build)
    graph = step("trace", lambda: trace(model, spec.example_inputs, batch_size=SIZES[0]))
    chain = step("linearize", lambda: linearize(graph))
    flops = step("flops", lambda: block_flops(chain, spec.example_inputs, SIZES))
    saved, inputs_saved = step("saved", lambda: saved_bytes(chain, spec.example_inputs, SIZES))
    times = step(
        "roofline",
        lambda: block_times_analytic(chain, spec.example_inputs, device, SIZES, compute_dtype="bfloat16"),
    )
    return {
        "model": name,
        "gpu": gpu.name,
        "params": chain.param_numel,
        "blocks": len(chain),
        "flops_fwd": sum(f(1) for f, _ in flops),
        "flops_bwd": sum(g(1) for _, g in flops),
        "saved_bytes": sum(s(1) for s in saved) + inputs_saved(1),
        "time_fwd_s": sum(f(1) for f, _ in times),
        "time_bwd_s": sum(g(1) for _, g in times),
        "wall_s": wall,
        "cpu_s": cpu,
        "rss_start_bytes": rss_start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def _child(name: str, gpu: str) -> dict[str, Any]:
    done = run_child(__file__, "--one", name, "--gpu", gpu, check=True)
    return json.loads(done.stdout)


def _table(rows: list[dict[str, Any]], gpu: str) -> Table:
    table = new_table(
        f"Analytic profiling on the meta device ({machine()})",
        ("model", "params", "blocks", *STEPS, "total (CPU)", "peak RSS", "fwd/bwd FLOP", "saved", "fwd/bwd"),
        left=("model",),
        caption=f"seconds of wall time per step; figures per sample (micro-batch 1); times predicted on {gpu} in "
        "bf16; peak RSS of the model's own process, after imports in brackets",
        no_wrap=True,
    )
    for r in rows:
        table.add_row(
            r["model"],
            f"{r['params'] / 1e9:.3g} G",
            str(r["blocks"]),
            *(f"{r['wall_s'][s]:.2f}" for s in STEPS),
            f"{sum(r['wall_s'].values()):.1f} ({sum(r['cpu_s'].values()):.1f})",
            f"{r['peak_rss_bytes'] / 1e9:.2f} GB ({r['rss_start_bytes'] / 1e9:.2f})",
            f"{fmt_count(r['flops_fwd'])}/{fmt_count(r['flops_bwd'])}",
            fmt_bytes(r["saved_bytes"]),
            f"{fmt_seconds(r['time_fwd_s'])}/{fmt_seconds(r['time_bwd_s'])}",
        )
    return table


def _cprofile(name: str, gpu: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    profile_model(name, gpu)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--gpu", default="a100-80g", help="catalog GPU whose roofline times are predicted")
    parser.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME", help="zoo models to run")
    parser.add_argument("--cprofile", metavar="NAME", help="profile this zoo model with cProfile instead")
    parser.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)  # a child process: print one JSON row
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.one:
        print(json.dumps(profile_model(args.one, args.gpu)))
        return 0
    if args.cprofile:
        _cprofile(args.cprofile, args.gpu)
        return 0
    rows = [_child(name, args.gpu) for name in args.models]
    gpu = rows[0]["gpu"]
    Console(width=200).print(_table(rows, gpu))
    target = next((r for r in rows if r["model"] == TARGET_MODEL), None)
    if target is None:
        return 0
    total = sum(target["wall_s"].values())
    ok = total < TARGET_S and target["peak_rss_bytes"] < TARGET_RSS_BYTES
    what = f"{TARGET_MODEL} in < {TARGET_S:.0f} s and < {TARGET_RSS_BYTES / 1e9:.0f} GB RSS"
    cpu_s = sum(target["cpu_s"].values())
    print(target_line(what, ok, f"{total:.1f} s wall, {cpu_s:.1f} s CPU, {target['peak_rss_bytes'] / 1e9:.2f} GB"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
