"""`pyplan zoo list` (the zoo's models, parameter counts and input shapes) and `pyplan zoo NAMES|all` (a sweep)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pyplan import _core, zoo
from pyplan._files import check_writable
from pyplan._torch import meta_build
from pyplan.errors import PlanError
from pyplan.hardware.cluster import Cluster
from pyplan.model_state import OPTIMIZERS, PRECISIONS
from pyplan.plan import Workload
from pyplan.profile.cache import ProfileCache
from pyplan.report.console import make_console
from pyplan.solve.remat_search import OFFLOAD_MODES, REMAT_MODES
from pyplan.sweep import ModelRef, ResultsFile, SearchOptions, Sweep, cluster_label, identity
from pyplan.units import fmt_bytes, fmt_count

__all__ = ["add_zoo_parser", "list_data", "zoo_list", "zoo_main", "zoo_sweep"]

_ZOO_EXAMPLES = """examples:
  pyplan zoo list                          # every model: parameters and input shapes
  pyplan zoo list gpt2-xl llama-70b-style  # only these
  pyplan zoo list resnet50 --json
  pyplan zoo gpt2-small bert-base --gpus 8,64 --gpu a100-80g,h100
  pyplan zoo all --gpus 8,64,512 --out results.csv --resume   # the whole zoo; rerun to finish an interrupted sweep
  pyplan zoo resnet50 vgg16 --gpus 16 --instance p4d.24xlarge --objective cost --json

Use a zoo model anywhere a model file goes, as zoo:NAME:
  pyplan inspect zoo:gpt2-xl --analytic
"""

_SWEEP_DESCRIPTION = """\
Plan every model named (or all) on every cluster (--gpus sizes x --gpu types, and --instance types) and print
the best plan of each pair, or why there is none. Pairs are planned as `pyplan plan zoo:NAME` plans them, in
--jobs worker processes; each model is profiled once per GPU type, and its profile is kept in a cache on disk
(--cache-dir, default $PYPLAN_CACHE_DIR/profiles or ~/.cache/pyplan/profiles) for later sweeps. With --out,
each pair is written as soon as it is planned, so an interrupted sweep keeps what it finished, and --resume
plans only the pairs the file lacks (pairs that failed with an internal error are tried again); the sweep is
kept beside it (FILE.sweep.json), and a resume with other models, clusters or options is refused.

`pyplan zoo list [NAME ...] [--json]` prints the zoo instead."""

_LIST_NOTES = """\
Parameters are counted on a model built on the meta device (no weights allocated), tied weights once.
"published" is the count of the architecture the model reproduces, which the test suite checks it against
("equal" when the model has exactly that count; "-" where none exists: MNIST variants, AmoebaNet-D-like).
Input shapes are per batch, B the batch size; inputs are float32 unless a dtype is shown.
"""

# Sweep options, with their defaults: None in the parser, so `zoo list` can tell that none was given.
_SWEEP_DEFAULTS: dict[str, Any] = {
    "gpus": None,
    "gpu": None,
    "instance": None,
    "gpus_per_node": None,
    "price_per_gpu_hour": None,
    "currency": None,
    "global_batch": 32,
    "optimizer": "adamw",
    "precision": None,  # bf16-mixed where every GPU of the sweep computes in bf16, else fp32 (_precision)
    "objective": "time",
    "weight": 0.0,
    "memory_fraction": 0.9,
    "remat": "none",
    "offload": "none",
    "out": None,
    "resume": False,
    "jobs": None,
    "cache_dir": None,
    "no_cache": False,
}
_DEFAULT_GPU = "a100-80g"


def add_zoo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `zoo list` and `zoo NAMES|all` (the sweep) to the `pyplan` subcommands; returns the `zoo` parser."""
    parser = subparsers.add_parser(
        "zoo",
        help="list the built-in models (zoo list), or plan many of them on many clusters",
        description=_SWEEP_DESCRIPTION,
        epilog=_ZOO_EXAMPLES + "\n" + _LIST_NOTES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s list [NAME ...] [--json]\n       %(prog)s NAME ...|all --gpus N,... [options]",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="zoo models to plan, or all; or `list` [NAME ...]")
    p = parser.add_argument_group("clusters (every size x every type)")
    p.add_argument("--gpus", metavar="N,...", help="cluster sizes in GPUs, e.g. 8,16,64 (required)")
    p.add_argument("--gpu", metavar="NAME,...", help=f"catalog GPU types (default {_DEFAULT_GPU} without --instance)")
    p.add_argument("--instance", metavar="NAME,...", help="catalog cloud instances: GPU, node size and price")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs per node of --gpu clusters (default: up to 8)")
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        metavar="PRICE",
        help="price of one GPU-hour of --gpu clusters (with --currency)",
    )
    p.add_argument("--currency", metavar="CODE", help="ISO currency code of --price-per-gpu-hour, e.g. USD")
    p = parser.add_argument_group("workload and search (as in pyplan plan)")
    p.add_argument("--global-batch", type=int, metavar="B", help="samples per optimizer step (default 32)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="default adamw")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        help="default: bf16-mixed where every GPU of the sweep computes in bf16 (as pyplan plan), else fp32",
    )
    p.add_argument("--objective", metavar="NAME", help="time, cost, or weighted (cost + weight x time); default time")
    p.add_argument("--weight", type=float, metavar="W", help="w of the weighted objective (default 0)")
    p.add_argument(
        "--memory-fraction", type=float, metavar="F", help="share of each GPU's memory to plan for (default 0.9)"
    )
    p.add_argument("--remat", choices=REMAT_MODES, help="recompute activations, as in pyplan plan (default none)")
    p.add_argument("--offload", choices=OFFLOAD_MODES, help="with --remat auto: offload activations (default none)")
    p = parser.add_argument_group("running and results")
    p.add_argument("--out", metavar="FILE", help="write one record per pair to FILE (.csv, .json or .parquet)")
    p.add_argument("--resume", action="store_true", help="keep the pairs already in --out and plan the rest")
    p.add_argument("--jobs", "-j", type=int, metavar="J", help="worker processes (default: the CPU count)")
    p.add_argument("--cache-dir", metavar="DIR", help="profile cache directory (default $PYPLAN_CACHE_DIR/profiles)")
    p.add_argument("--no-cache", action="store_true", help="profile every model afresh and keep nothing")
    parser.add_argument("--json", action="store_true", help="print the records (or the list) as JSON")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.set_defaults(func=zoo_main, **{k: None for k in _SWEEP_DEFAULTS if k not in ("resume", "no_cache")})
    return parser


def zoo_main(args: argparse.Namespace) -> int:
    """`pyplan zoo list ...` or `pyplan zoo NAMES|all ...`."""
    if args.names[:1] == ["list"]:
        given = [k for k, default in _SWEEP_DEFAULTS.items() if getattr(args, k, None) not in (None, False)]
        if given:
            raise PlanError(f"`pyplan zoo list` takes names and --json only, not --{given[0].replace('_', '-')}")
        return zoo_list(argparse.Namespace(names=args.names[1:], json=args.json))
    for key, default in _SWEEP_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, default)
    return zoo_sweep(args)


# --- Data (pure) ------------------------------------------------------------------------------------------


def _entry(name: str) -> dict[str, Any]:
    spec = zoo.get(name)
    with meta_build():
        model = spec.build()
    inputs = spec.example_inputs(1)
    return {
        "name": spec.name,
        "params": sum(p.numel() for p in model.parameters()),
        "published_params": spec.published_params,
        "inputs": [{"shape": ["B", *t.shape[1:]], "dtype": str(t.dtype).removeprefix("torch.")} for t in inputs],
        "source": spec.source,
    }


def list_data(names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The zoo as JSON-ready entries: name, params (counted on meta), published_params, inputs
    (shape with "B" for the batch dimension, dtype) and source; only `names` when given, in that order."""
    return [_entry(name) for name in (names or zoo.names())]


# --- Rendering --------------------------------------------------------------------------------------------


def _published(e: dict[str, Any]) -> str:
    published = e["published_params"]
    if published is None:
        return "-"
    return "equal" if published == e["params"] else f"{published:,}"


def _shapes(inputs: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"({','.join(str(d) for d in i['shape'])})" + ("" if i["dtype"] == "float32" else f" {i['dtype']}")
        for i in inputs
    )


def _table(entries: list[dict[str, Any]]) -> Table:
    table = Table(title="Model zoo", caption="parameters counted on the meta device; use a model as zoo:NAME")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("parameters", justify="right", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    table.add_column("published", justify="right", no_wrap=True)
    table.add_column("inputs (B = batch)")
    for e in entries:
        table.add_row(e["name"], f"{e['params']:,}", fmt_count(e["params"]), _published(e), _shapes(e["inputs"]))
    return table


def zoo_list(args: argparse.Namespace) -> int:
    """`pyplan zoo list`: print the zoo."""
    entries = list_data(args.names)
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        Console().print(_table(entries))
    return 0


# --- The sweep --------------------------------------------------------------------------------------------


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _sizes(value: str | None) -> list[int]:
    if value is None:
        raise PlanError("give the cluster sizes to plan for, e.g. --gpus 8,16,64")
    if not _split(value):
        raise PlanError(f"--gpus '{value}' names no cluster size; give sizes in GPUs, e.g. --gpus 8,16,64")
    sizes = []
    for v in _split(value):
        if not v.isdigit() or int(v) < 1:
            raise PlanError(f"--gpus takes positive numbers of GPUs separated by commas, got '{v}'")
        if int(v) > _core.MAX_GPUS:
            raise PlanError(f"--gpus takes at most {_core.MAX_GPUS:,} GPUs a cluster, got {v}")
        sizes.append(int(v))
    return list(dict.fromkeys(sizes))


def _model_names(names: Sequence[str]) -> list[str]:
    if not names:
        raise PlanError("name the zoo models to plan, or all (pyplan zoo list shows them)")
    if "all" in names:
        return zoo.names()
    for name in names:
        zoo.get(name.removeprefix("zoo:"))  # an unknown name raises, with the closest names
    return list(dict.fromkeys(n.removeprefix("zoo:") for n in names))


def _clusters(args: argparse.Namespace) -> list[Cluster]:
    gpus = _sizes(args.gpus)
    types = _split(args.gpu)
    instances = _split(args.instance)
    for option, value, names, example in (
        ("--gpu", args.gpu, types, "a100-80g"),
        ("--instance", args.instance, instances, "p4d.24xlarge"),
    ):
        if value is not None and not names:
            raise PlanError(f"{option} '{value}' names nothing; give catalog names, e.g. {option} {example}")
    if not types and not instances:
        types = [_DEFAULT_GPU]
    clusters = [
        Cluster.from_catalog(
            gpu=gpu,
            gpus=n,
            gpus_per_node=args.gpus_per_node,
            price_per_gpu_hour=args.price_per_gpu_hour,
            currency=args.currency,
        )
        for gpu in types
        for n in gpus
    ]
    clusters += [Cluster.from_catalog(instance=inst, gpus=n) for inst in instances for n in gpus]
    return clusters


def _cache(args: argparse.Namespace) -> ProfileCache | None:
    if args.no_cache:
        if args.cache_dir:
            raise PlanError("--no-cache and --cache-dir contradict each other; give one")
        return None
    if not args.cache_dir:
        return ProfileCache()
    _check_cache_dir(args.cache_dir)
    return ProfileCache(args.cache_dir)


def _check_cache_dir(value: str) -> None:
    """Refuse a --cache-dir that cannot hold the cache (a file, or a missing directory under a file or in a
    read-only one): the cache skips what it cannot write, so it would be off without a word."""
    path = Path(value).expanduser()
    fix = "give a directory (made if missing), or --no-cache"
    if path.exists() and not path.is_dir():
        raise PlanError(f"--cache-dir {value}: it is a file, not a directory; {fix}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise PlanError(f"--cache-dir {value}: '{existing}' is a file, so the directory cannot be made; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PlanError(f"--cache-dir {value}: '{existing}' is not writable; {fix}")


def _precision(args: argparse.Namespace, clusters: Sequence[Cluster]) -> str:
    """--precision, else `pyplan plan`'s default on these GPUs: bf16-mixed where every GPU of the sweep has a bf16
    peak, else fp32; one precision for the whole sweep, so that its rows compare."""
    if args.precision is not None:
        return str(args.precision)
    return "bf16-mixed" if all(g.gpu.peak_flops_per_s.get("bf16") for c in clusters for g in c.groups) else "fp32"


def zoo_sweep(args: argparse.Namespace) -> int:
    """`pyplan zoo NAMES|all --gpus ...`: plan every model on every cluster, write and print the records."""
    names = _model_names(args.names)
    clusters = _clusters(args)
    workload = Workload(global_batch=args.global_batch, optimizer=args.optimizer, precision=_precision(args, clusters))
    sweep = Sweep(
        models=tuple(ModelRef(name, ref=f"zoo:{name}") for name in names),
        clusters=tuple((cluster_label(c), c) for c in clusters),
        workloads=dict.fromkeys(names, workload),
        options=SearchOptions(args.objective, args.weight, args.memory_fraction, args.remat, args.offload),
    )
    jobs = args.jobs if args.jobs is not None else os.cpu_count() or 1
    if jobs < 1:
        raise PlanError(f"--jobs must be at least 1, got {jobs}")
    if args.resume and not args.out:
        raise PlanError("--resume needs --out FILE: the results of the sweep to finish")
    if args.out and not args.resume and os.path.isfile(args.out) and os.path.getsize(args.out) > 0:
        # Starting afresh would replace the file with a header before planning anything: refused, so a finished
        # sweep's records are never lost to a rerun that is then killed.
        raise PlanError(
            f"'{args.out}' holds the results of an earlier sweep: --resume continues it; remove it or choose "
            "another --out to start afresh"
        )
    results = ResultsFile(args.out) if args.out else None
    if args.out:
        check_writable(args.out)  # as `pyplan plan --out`: a missing directory is refused, never made
    cache = _cache(args)
    # A resume keeps the records of the same sweep only; another sweep's file is refused, naming what differs.
    kept = results.resume(sweep) if results and args.resume else []
    wanted = set(sweep.identities())
    done = [identity(r) for r in kept]
    err = make_console(stderr=True)
    if results is not None:
        results.begin(kept, sweep)
        if results.dropped:
            err.print(f"{args.out}: dropped {results.dropped} incomplete line(s) left by an interrupted sweep")
    total = len(wanted) - len(done)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("pairs"),
        TimeElapsedColumn(),
        console=err,
        transient=not err.is_terminal,
    )
    bar = progress.add_task(f"planning {len(names)} models on {len(clusters)} clusters", total=total)

    def on_record(record: dict[str, Any]) -> None:
        if results is not None:
            results.add(record)
        progress.update(bar, advance=1, description=f"planned {record['model']}")

    try:
        with progress:
            run = sweep.run(jobs=jobs, cache=cache, done=done, on_record=on_record)
    finally:
        if results is not None:
            results.close()
    records = sweep.ordered([*kept, *run.records])
    if results is not None:
        results.finish(records)
    mine = [r for r in records if identity(r) in wanted]
    if args.json:
        print(json.dumps(mine, indent=2))
    else:
        console = make_console()
        console.print(_sweep_table(mine, workload=workload, options=sweep.options))
        failures = [r for r in mine if r["status"] != "ok"]
        if failures:
            console.print(_failure_table(failures))
    err.print(
        _sweep_note(run, len(done), cache, args.out if results is not None else None), soft_wrap=True, highlight=False
    )
    failed = sum(r["status"] == "failed" for r in mine)
    if failed:
        err.print(
            f"{failed} pairs failed with an internal error; `pyplan plan zoo:NAME ... --debug` shows the traceback",
            style="red",
        )
        return 1
    return 0


def _sweep_note(run: Any, kept: int, cache: ProfileCache | None, out: str | None) -> str:
    """One line on what a sweep did: pairs planned, not fitting, failing; records kept; the profile cache's use."""
    counts = {status: sum(r["status"] == status for r in run.records) for status in ("ok", "infeasible", "error")}
    note = (
        f"{len(run.records)} pairs in {run.seconds:.1f} s: {counts['ok']} planned, {counts['infeasible']} do not "
        f"fit, {counts['error']} cannot be planned, {len(run.records) - sum(counts.values())} failed"
    )
    if kept:
        note += f"; {kept} kept from {out}"
    if cache is not None:
        stats = run.cache
        note += f"; profiles: {stats.hits} from the cache ({cache.directory}), {stats.misses} made"
        if stats.discarded:
            note += f", {stats.discarded} bad cache entries replaced ({stats.reasons[0]})"
    if out is not None:
        note += f"; records in {out}"
    return note


def _money(value: float | None, currency: str | None) -> str:
    """Two decimals, or three significant digits below one unit (a tiny model costs fractions of a cent)."""
    if value is None:
        return "-"
    return f"{value:,.2f} {currency}" if value >= 1 else f"{value:.3g} {currency}"


def _sweep_table(records: list[dict[str, Any]], *, workload: Workload, options: SearchOptions) -> Table:
    planned = [r for r in records if r["status"] == "ok"]
    priced = any(r["cost_per_1m_samples"] is not None for r in planned)
    objective = options.objective + (f" (w = {options.weight:g})" if options.objective == "weighted" else "")
    remat = "" if options.remat == "none" else f", remat {options.remat}, offload {options.offload}"
    table = Table(
        title=f"Best plan per pair: global batch {workload.global_batch}, {workload.precision}, "
        f"{workload.optimizer}, objective {objective}{remat}",
        caption="dp x pp GPUs (xN stages per rank); mb micro-batch size; GA micro-batches per step; "
        "memory is the peak per GPU",
    )
    for name, justify in (
        ("model", "left"),
        ("cluster", "left"),
        ("dp x pp", "right"),
        ("mb", "right"),
        ("GA", "right"),
        ("schedule", "left"),
        ("ZeRO", "right"),
        ("samples/s", "right"),
        ("memory/GPU", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=name in ("model", "cluster"))
    if priced:
        table.add_column("cost / 1M samples", justify="right")
    for r in planned:
        shape = f"{r['dp']} x {r['pp']}" + (f" (x{r['stages_per_rank']})" if r["stages_per_rank"] > 1 else "")
        row = [
            r["model"],
            r["cluster"],
            shape,
            str(r["micro_batch_size"]),
            str(r["num_microbatches"]),
            r["schedule"],
            str(r["zero_stage"]),
            f"{r['samples_per_s']:,.1f}",
            fmt_bytes(r["peak_memory_bytes"]),
        ]
        if priced:
            row.append(_money(r["cost_per_1m_samples"], r["currency"]))
        table.add_row(*row)
    return table


def _failure_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="Pairs without a plan")
    table.add_column("model", no_wrap=True)
    table.add_column("cluster", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("why")
    for r in records:
        table.add_row(r["model"], r["cluster"], r["status"], r["message"] or "")
    return table
