"""Batch planning: every model on every cluster, in parallel processes, one record per pair (`plan_many`).

A sweep plans models x clusters. The work is split into tasks of one model on one GPU type, so a model is
traced and profiled once per GPU type (or read from a `ProfileCache`) and then searched for each cluster of
that type; tasks run in worker processes (`jobs`), started with spawn, not fork, so they inherit none of the
parent's torch threads or state, and so that the process that starts them is their parent; they leave Ctrl-C to it
and end when it ends, however it ends (`_WORKER_START`). Each pair gives one flat record (`COLUMNS`):
the best plan's layout and predictions, or why there is none. `ResultsFile` writes records as they arrive, so
an interrupted sweep keeps what it finished and a resumed one skips it.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import multiprocessing
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from torch import nn

from pyplan import zoo
from pyplan._files import write_atomic
from pyplan._torch import meta_build
from pyplan.api import add_loss, chain_for, search
from pyplan.errors import InfeasibleError, PlanError
from pyplan.graph.trace import ExampleInputs
from pyplan.hardware.catalog import LOCAL
from pyplan.hardware.cluster import Cluster
from pyplan.load import load_model
from pyplan.plan import OBJECTIVES, Plan, Workload
from pyplan.profile.cache import CacheStats, ProfileCache
from pyplan.profile.loss import LossFn, TargetFn
from pyplan.solve.remat_search import OFFLOAD_MODES, REMAT_MODES
from pyplan.spec import default_loss

__all__ = [
    "COLUMNS",
    "IDENTITY",
    "ModelRef",
    "ResultsFile",
    "SearchOptions",
    "Sweep",
    "SweepResult",
    "cluster_label",
    "identity",
    "is_finished",
    "plan_many",
    "sweep_difference",
]

# The record of one (model, cluster) pair, as CSV columns with their types; absent values are None (empty in CSV).
COLUMNS: tuple[tuple[str, type], ...] = (
    ("model", str),
    ("cluster", str),
    ("gpu", str),
    ("gpus", int),
    ("gpus_per_node", int),
    ("global_batch", int),
    ("precision", str),
    ("optimizer", str),
    ("objective", str),
    ("weight", float),
    ("memory_fraction", float),
    ("remat", str),
    ("offload", str),
    # "ok"; "infeasible" (no plan fits); "error" (PlanError: the pair cannot be planned as asked);
    # "failed" (an internal error: a resumed sweep tries the pair again).
    ("status", str),
    ("dp", int),
    ("pp", int),
    ("gpus_used", int),
    ("stages_per_rank", int),
    ("micro_batch_size", int),
    ("num_microbatches", int),
    ("schedule", str),
    ("zero_stage", int),
    ("placement", str),
    ("iteration_s", float),
    ("samples_per_s", float),
    ("peak_memory_bytes", float),
    ("bubble_fraction", float),
    ("cost_per_iteration", float),
    ("cost_per_1m_samples", float),
    ("currency", str),
    ("profiled_on", str),
    ("message", str),
)
COLUMN_NAMES = tuple(name for name, _ in COLUMNS)
# The columns that name a pair: a resumed sweep skips the pairs whose identity is already in the file.
IDENTITY = (
    "model",
    "cluster",
    "global_batch",
    "precision",
    "optimizer",
    "objective",
    "weight",
    "memory_fraction",
    "remat",
    "offload",
)
_RETRIED = "failed"
# Beside a results file, the sweep that writes it: `ResultsFile.sweep_path`, {"format": 1, "sweep": ...}.
SWEEP_SUFFIX = ".sweep.json"
SWEEP_FORMAT = 1

Identity = tuple[Any, ...]
Record = dict[str, Any]


def identity(record: Mapping[str, Any]) -> Identity:
    return tuple(record[k] for k in IDENTITY)


def cluster_label(cluster: Cluster) -> str:
    """A short name of a cluster: "64 x a100-80g-sxm", "16 x p4d.24xlarge" (instance clusters by instance)."""
    return " + ".join(f"{g.gpus} x {g.instance or g.gpu.name}" for g in cluster.groups)


@dataclass(frozen=True)
class SearchOptions:
    """What `pyplan.search` is asked for each pair: the objective, the share of each GPU's memory planned for,
    and the rematerialization and offloading modes."""

    objective: str = "time"
    weight: float = 0.0
    memory_fraction: float = 0.9
    remat: str = "none"
    offload: str = "none"

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise PlanError(f"unknown objective '{self.objective}'; choose one of {', '.join(OBJECTIVES)}")
        if not 0 < self.memory_fraction <= 1:
            raise PlanError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.remat not in REMAT_MODES:
            raise PlanError(f"unknown remat mode '{self.remat}'; choose one of {', '.join(REMAT_MODES)}")
        if self.offload not in OFFLOAD_MODES:
            raise PlanError(f"unknown offload mode '{self.offload}'; choose one of {', '.join(OFFLOAD_MODES)}")


@dataclass(frozen=True)
class ModelRef:
    """A model of a sweep: `ref` is what `load_model` reads ("zoo:NAME", "model.py"), loaded in the worker;
    or `module` with its `example_inputs` (planned in the calling process)."""

    name: str
    ref: str | None = None
    module: nn.Module | None = field(default=None, repr=False)
    example_inputs: ExampleInputs | None = field(default=None, repr=False)

    def loss(self) -> tuple[LossFn | None, TargetFn | None]:
        """The loss and target a referenced model trains with (its own, else mean squared error to zeros, as the
        runtime does); none for a module given directly."""
        if self.ref is None:
            return None, None

        spec = load_model(self.ref)
        return spec.loss or default_loss, spec.target

    def load(self, *, meta: bool) -> tuple[nn.Module, ExampleInputs]:
        """The module and its inputs; a referenced model is built on the meta device when `meta` (an analytic
        profile needs no weights), as `pyplan plan` builds it."""
        if self.module is not None:
            assert self.example_inputs is not None
            return self.module, self.example_inputs

        assert self.ref is not None
        spec = load_model(self.ref)
        if meta:
            with meta_build():
                return spec.build(), spec.example_inputs
        return spec.build(), spec.example_inputs


@dataclass(frozen=True)
class _Task:
    """One model on clusters of one GPU type: profiled once, then searched for each cluster. Clusters travel
    as JSON (the catalog's read-only mappings do not pickle)."""

    model: ModelRef
    clusters: tuple[tuple[str, dict[str, Any]], ...]
    workload: Workload
    options: SearchOptions
    cache_dir: str | None


@dataclass
class _TaskResult:
    records: list[Record]
    cache: CacheStats
    seconds: float
    cpu_seconds: float


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if isinstance(exc, PlanError) else f"{type(exc).__name__}: {text}"


def _status(exc: BaseException) -> str:
    if isinstance(exc, InfeasibleError):
        return "infeasible"
    return "error" if isinstance(exc, PlanError) else _RETRIED


def _base(model: str, label: str, cluster: Cluster, workload: Workload, options: SearchOptions) -> Record:
    """A record of the pair with nothing planned yet: what names it and its cluster."""
    sizes = {g.gpus_per_node for g in cluster.groups}
    record: Record = dict.fromkeys(COLUMN_NAMES)
    record.update(
        model=model,
        cluster=label,
        gpu=",".join(dict.fromkeys(g.gpu.name for g in cluster.groups)),
        gpus=cluster.gpus,
        gpus_per_node=sizes.pop() if len(sizes) == 1 else None,
        global_batch=workload.global_batch,
        precision=workload.precision,
        optimizer=workload.optimizer,
        objective=options.objective,
        weight=float(options.weight),
        memory_fraction=float(options.memory_fraction),
        remat=options.remat,
        offload=options.offload,
    )
    return record


def _failed(base: Record, exc: BaseException, profiled_on: str | None = None) -> Record:
    return {**base, "status": _status(exc), "message": _one_line(exc), "profiled_on": profiled_on}


def _planned(base: Record, plan: Plan, workload: Workload, profiled_on: str) -> Record:
    layout, predicted = plan.layout, plan.predicted
    priced = bool(predicted.currency)
    return {
        **base,
        "status": "ok",
        "dp": layout.dp,
        "pp": layout.pp,
        "gpus_used": layout.num_gpus,
        "stages_per_rank": layout.stages_per_rank,
        "micro_batch_size": layout.micro_batch_size,
        "num_microbatches": layout.num_microbatches,
        "schedule": layout.schedule,
        "zero_stage": layout.zero_stage,
        "placement": layout.placement,
        "iteration_s": predicted.iteration_s,
        "samples_per_s": predicted.samples_per_s,
        "peak_memory_bytes": predicted.peak_memory_bytes,
        "bubble_fraction": predicted.bubble_fraction,
        "cost_per_iteration": predicted.cost_per_iteration if priced else None,
        "cost_per_1m_samples": predicted.cost_per_iteration / workload.global_batch * 1e6 if priced else None,
        "currency": predicted.currency or None,
        "profiled_on": profiled_on,
    }


def is_finished(record: Mapping[str, Any]) -> bool:
    """Whether a resumed sweep keeps this record: every outcome but an internal error, which is tried again."""
    return record["status"] != _RETRIED


def _run_task(task: _Task) -> _TaskResult:
    """Profile the task's model once and search each of its clusters (runs in a worker process)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    cache = ProfileCache(Path(task.cache_dir)) if task.cache_dir is not None else None
    stats = cache.stats if cache is not None else CacheStats()

    def base(label: str, cluster: Cluster) -> Record:
        return _base(task.model.name, label, cluster, task.workload, task.options)

    clusters = [(label, Cluster.from_json(data)) for label, data in task.clusters]
    first = clusters[0][1]
    try:
        module, inputs = task.model.load(meta=first.groups[0].gpu.name != LOCAL)
        chain, how = chain_for(module, inputs, first, task.workload, cache=cache)
        loss, target = task.model.loss()
        if loss is not None:  # one GPU type per task: the loss's cost is the same on every cluster
            chain = add_loss(chain, module, inputs, first, task.workload, loss, target)
    except Exception as exc:
        records = [_failed(base(label, cluster), exc) for label, cluster in clusters]
        return _TaskResult(records, stats, time.perf_counter() - start, time.process_time() - cpu_start)
    records = []
    for label, cluster in clusters:
        try:
            result = search(
                module,
                inputs,
                cluster,
                task.workload,
                objective=task.options.objective,
                weight=task.options.weight,
                memory_fraction=task.options.memory_fraction,
                chain=chain,
                remat=task.options.remat,
                offload=task.options.offload,
            )
        except Exception as exc:
            records.append(_failed(base(label, cluster), exc, how))
        else:
            records.append(_planned(base(label, cluster), result.best, task.workload, how))
    return _TaskResult(records, stats, time.perf_counter() - start, time.process_time() - cpu_start)


# The first code a sweep's worker runs, through `exec` as its pool's initializer: before the worker imports pyplan,
# whose import takes torch's 2 s or more, where a function of pyplan's would run only after it. Ctrl-C reaches every
# process of the terminal's foreground group: the worker ignores it, and the process that started the sweep (`parent`)
# stops the workers (`_stop`). The worker was started with SIGINT blocked (`_workers_starting`), so a Ctrl-C during
# its start is dropped here. It also ends as soon as `parent` ends, however that ends (killed with SIGKILL or SIGTERM,
# it cannot stop its workers, which would keep their memory and the resource tracker alive, and the caller's pipes
# open): on Linux the kernel kills it (prctl's PR_SET_PDEATHSIG), whatever its threads are doing; a thread that
# watched `parent` had to wait for the GIL while the worker ran C code that holds it. Elsewhere a thread watches.
_WORKER_START = """
import os
import signal
import sys

signal.signal(signal.SIGINT, signal.SIG_IGN)
if hasattr(signal, "pthread_sigmask"):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
PR_SET_PDEATHSIG = 1  # linux/prctl.h
killed_with_parent = False
if sys.platform.startswith("linux"):
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        killed_with_parent = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        pass
if not killed_with_parent:
    from pyplan.sweep import _watch_parent

    _watch_parent(parent)
elif os.getppid() != parent:  # it ended before the request: nothing would end this process
    os._exit(1)
"""


def _watch_parent(parent: int) -> None:
    """Where the kernel cannot end a worker with its parent (`_WORKER_START`), a thread of its own does."""
    threading.Thread(target=_exit_with, args=(parent,), name="pyplan-watch-parent", daemon=True).start()


def _exit_with(pid: int) -> None:
    """End this process when process `pid` has ended: at once through a pidfd (Linux 5.3+); elsewhere by asking
    every half second, which does not see a parent that has ended but not yet been reaped."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):
        while True:
            try:
                os.kill(pid, 0)
            except OSError:  # gone, or its number now another user's process
                os._exit(1)
            time.sleep(0.5)
    select.select([fd], [], [])  # readable once the process has exited
    os._exit(1)


def _context() -> multiprocessing.context.BaseContext:
    """Spawn: a worker is then a child of the process that starts it, so the kernel can end it when that process
    ends (`_WORKER_START`); a forkserver's workers are the forkserver's children, and it outlives them."""
    return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _workers_starting() -> Iterator[None]:
    """Around the submits that start a pool's workers: SIGINT blocked in this thread, so that each worker starts
    with it blocked (a process inherits its parent's signal mask) and a Ctrl-C during its start, before it has set
    SIGINT aside, is held for it rather than ending it with a traceback. The resource tracker is started first:
    starting it unblocks SIGINT in the thread that starts it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _run_tasks(tasks: Sequence[_Task], jobs: int, on_result: Callable[[_Task, _TaskResult], None]) -> None:
    """Run `tasks` in `jobs` worker processes (in this process for one job), calling `on_result` here as each
    finishes. Models given as modules are planned in this process: they need not pickle, nor their classes
    import in a worker."""
    here: list[_Task] = []
    away: list[_Task] = []
    for task in tasks:
        (here if task.model.module is not None or jobs <= 1 else away).append(task)
    if not away:
        for task in here:
            on_result(task, _run_task(task))
        return
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, len(away)),
        mp_context=_context(),
        initializer=exec,
        initargs=(_WORKER_START, {"parent": os.getpid()}),
    )
    try:
        with _workers_starting():  # the pool starts its workers as tasks are submitted
            futures = {pool.submit(_run_task, task): task for task in away}
        for task in here:
            on_result(task, _run_task(task))
        for future in as_completed(futures):
            on_result(futures[future], future.result())
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop the workers now: an interrupted or failed sweep neither waits for the models being planned nor
    starts the others."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    # Before 3.14 the executor offers no way to stop a running task but to end its process.
    for process in list((pool._processes or {}).values()):
        process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class SweepResult:
    """The records a run produced (in the order they finished), what the profile caches did, the wall time, the
    seconds each task (a model on one GPU type: profile and searches) took in its worker, and the CPU seconds of
    all tasks."""

    records: list[Record]
    cache: CacheStats
    seconds: float
    task_seconds: list[tuple[str, float]] = field(default_factory=list)
    task_cpu_seconds: float = 0.0


@dataclass(frozen=True)
class Sweep:
    """Models x clusters with a workload per model and the search options: the pairs to plan."""

    models: tuple[ModelRef, ...]
    clusters: tuple[tuple[str, Cluster], ...]
    workloads: Mapping[str, Workload]
    options: SearchOptions = SearchOptions()

    def __post_init__(self) -> None:
        for kind, names in (("models", [m.name for m in self.models]), ("clusters", [c for c, _ in self.clusters])):
            seen: set[str] = set()
            for name in names:
                if name in seen:
                    raise PlanError(f"two {kind} are called '{name}'; name them apart")
                seen.add(name)
        missing = [m.name for m in self.models if m.name not in self.workloads]
        if missing:
            raise PlanError(f"no workload for model '{missing[0]}'")

    def identities(self) -> list[Identity]:
        """Every pair's identity, in the sweep's order: models in the order given, clusters within each."""
        return [self._identity(m, label, c) for m in self.models for label, c in self.clusters]

    def _identity(self, model: ModelRef, label: str, cluster: Cluster) -> Identity:
        return identity(_base(model.name, label, cluster, self.workloads[model.name], self.options))

    def tasks(self, *, done: Iterable[Identity] = (), cache_dir: str | None = None) -> list[_Task]:
        """The tasks of the pairs not `done`: one per model and GPU type."""
        finished = set(done)
        tasks = []
        for model in self.models:
            by_gpu: dict[str, list[tuple[str, dict[str, Any]]]] = {}
            for label, cluster in self.clusters:
                if self._identity(model, label, cluster) not in finished:
                    gpus = json.dumps([g.gpu.to_json() for g in cluster.groups], sort_keys=True)
                    by_gpu.setdefault(gpus, []).append((label, cluster.to_json()))
            tasks += [
                _Task(model, tuple(group), self.workloads[model.name], self.options, cache_dir)
                for group in by_gpu.values()
            ]
        return tasks

    def describe(self) -> dict[str, Any]:
        """What makes this sweep itself, as JSON: its models (with their references), its clusters (every figure),
        each model's workload and the search options. `ResultsFile` keeps it beside the records, so that a resume
        can tell the sweep that wrote a file from another."""
        data = {
            "models": {m.name: m.ref for m in self.models},
            "clusters": {label: cluster.to_json() for label, cluster in self.clusters},
            "workloads": {m.name: dataclasses.asdict(self.workloads[m.name]) for m in self.models},
            "options": dataclasses.asdict(self.options),
        }
        return json.loads(json.dumps(data))  # as read back from a file: lists for tuples

    def outside(self, records: Iterable[Record]) -> str | None:
        """Why the first of `records` is not a pair of this sweep, in words ("models: vgg-tiny only in the file"),
        or None when every record is one: its model, cluster, GPUs, workload and options are this sweep's."""
        models = {m.name: m for m in self.models}
        clusters = dict(self.clusters)
        for record in records:
            if record["model"] not in models:
                return f"models: {record['model']} only in the file"
            if record["cluster"] not in clusters:
                return f"clusters: '{record['cluster']}' only in the file"
            model = models[record["model"]]
            label = record["cluster"]
            expected = _base(model.name, label, clusters[label], self.workloads[model.name], self.options)
            for key, value in expected.items():
                if value is not None and record[key] != value:
                    return f"{key} of {model.name} on '{label}': {record[key]} in the file, {value} in this command"
        return None

    def ordered(self, records: Iterable[Record]) -> list[Record]:
        """`records` in the sweep's order; records of pairs outside the sweep follow in their own order."""
        rank = {key: i for i, key in enumerate(self.identities())}
        return sorted(records, key=lambda r: rank.get(identity(r), len(rank)))

    def run(
        self,
        *,
        jobs: int = 1,
        cache: ProfileCache | None = None,
        done: Iterable[Identity] = (),
        on_record: Callable[[Record], None] | None = None,
    ) -> SweepResult:
        """Plan every pair not `done`; `on_record` is called here with each record as it arrives."""
        if jobs < 1:
            raise PlanError(f"jobs must be at least 1, got {jobs}")
        tasks = self.tasks(done=done, cache_dir=str(cache.directory) if cache is not None else None)
        start = time.perf_counter()
        records: list[Record] = []
        stats = CacheStats()
        task_seconds: list[tuple[str, float]] = []
        cpu = 0.0

        def collect(task: _Task, result: _TaskResult) -> None:
            nonlocal cpu
            stats.add(result.cache)
            task_seconds.append((task.model.name, result.seconds))
            cpu += result.cpu_seconds
            for record in result.records:
                records.append(record)
                if on_record is not None:
                    on_record(record)

        _run_tasks(tasks, jobs, collect)
        if cache is not None:
            cache.stats.add(stats)
        return SweepResult(records, stats, time.perf_counter() - start, task_seconds, cpu)


# --- Inputs of plan_many ----------------------------------------------------------------------------------

ModelLike = str | tuple[nn.Module, ExampleInputs]


def _model_ref(name: str | None, model: ModelLike) -> ModelRef:
    if isinstance(model, str):
        ref = model if model.startswith("zoo:") or model.endswith(".py") or ".py:" in model else f"zoo:{model}"
        if ref.startswith("zoo:"):
            zoo.get(ref.removeprefix("zoo:"))  # an unknown name raises here, with the closest names
        else:
            load_model(ref)
        return ModelRef(name or model.removeprefix("zoo:"), ref=ref)
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module):
        return ModelRef(name or type(model[0]).__name__, module=model[0], example_inputs=model[1])
    raise PlanError(
        f"a model must be a zoo name, a model file, or a (module, example_inputs) pair; got {type(model).__name__}"
    )


def _model_refs(models: Iterable[ModelLike] | Mapping[str, ModelLike]) -> tuple[ModelRef, ...]:
    if isinstance(models, Mapping):
        return tuple(_model_ref(name, m) for name, m in models.items())
    refs: list[ModelRef] = []
    counts: dict[str, int] = {}
    for m in models:
        ref = _model_ref(None, m)
        if ref.module is not None:  # modules are named by class: GPT, GPT-2, ...
            counts[ref.name] = counts.get(ref.name, 0) + 1
            if counts[ref.name] > 1:
                ref = ModelRef(f"{ref.name}-{counts[ref.name]}", module=ref.module, example_inputs=ref.example_inputs)
        refs.append(ref)
    return tuple(refs)


def _labelled(clusters: Iterable[Cluster] | Mapping[str, Cluster]) -> tuple[tuple[str, Cluster], ...]:
    if isinstance(clusters, Mapping):
        return tuple(clusters.items())
    return tuple((cluster_label(c), c) for c in clusters)


def _frame(records: list[Record]) -> Any:
    try:
        import pandas as pd  # optional: pandas, only for results as a DataFrame
    except ImportError:
        raise PlanError("as_frame=True needs pandas: pip install pandas (or take the records)") from None
    return pd.DataFrame.from_records(records, columns=list(COLUMN_NAMES))


def plan_many(
    models: Iterable[ModelLike] | Mapping[str, ModelLike],
    clusters: Iterable[Cluster] | Mapping[str, Cluster],
    workload: Workload | Mapping[str, Workload],
    *,
    objective: str = "time",
    weight: float = 0.0,
    memory_fraction: float = 0.9,
    remat: str = "none",
    offload: str = "none",
    jobs: int = 1,
    cache: ProfileCache | None = None,
    as_frame: bool = False,
) -> Any:
    """The best plan of every model on every cluster: one record (a dict with the keys of `COLUMNS`) per pair,
    models in the order given and clusters within each.

    `models` are zoo names ("gpt2-xl", or "zoo:gpt2-xl"), model files, or `(module, example_inputs)` pairs
    (named by class), or a mapping from names to those. `clusters` are Clusters (named by `cluster_label`) or a
    mapping from names to Clusters. `workload` is one Workload for all models or a mapping from model names to
    Workloads. `objective`, `weight`, `memory_fraction`, `remat` and `offload` are `pyplan.search`'s, for every
    pair. A pair that cannot be planned gives a record whose `status` says why ("infeasible", "error",
    "failed") and whose `message` is the error in one line; the call raises only for bad arguments.

    `jobs` > 1 plans named models in that many worker processes (modules given as pairs are planned in this
    process meanwhile). With `cache`
    (e.g. `ProfileCache()`: ~/.cache/pyplan/profiles), profiles are read from and written to disk, so a model
    is profiled once for every cluster of a GPU type, and once across calls. `as_frame=True` returns a pandas
    DataFrame instead of the list of records (needs pandas).
    """
    refs = _model_refs(models)
    workloads = dict(workload) if isinstance(workload, Mapping) else {m.name: workload for m in refs}
    sweep = Sweep(
        refs,
        _labelled(clusters),
        workloads,
        SearchOptions(objective, weight, memory_fraction, remat, offload),
    )
    records = sweep.ordered(sweep.run(jobs=jobs, cache=cache).records)
    return _frame(records) if as_frame else records


# --- Results files -------------------------------------------------------------------------------------------


def _csv_text(records: Iterable[Record], *, header: bool = True) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    if header:
        writer.writerow(COLUMN_NAMES)
    for r in records:
        writer.writerow(["" if r[k] is None else r[k] for k in COLUMN_NAMES])
    return out.getvalue()


def _typed(row: list[str]) -> Record:
    if len(row) != len(COLUMNS):
        raise ValueError(f"{len(row)} fields, expected {len(COLUMNS)}")
    return {name: None if value == "" else kind(value) for (name, kind), value in zip(COLUMNS, row)}


def _first_difference(earlier: Any, now: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first place where two JSON values differ: (its path, e.g. "gpus_per_node" or "gpu.memory_bytes", the
    earlier value, the value now), or None when they are equal."""
    if isinstance(earlier, dict) and isinstance(now, dict):
        for key in (*earlier, *(k for k in now if k not in earlier)):
            found = _first_difference(earlier.get(key), now.get(key), f"{where}.{key}" if where else str(key))
            if found is not None:
                return found
        return None
    if isinstance(earlier, list) and isinstance(now, list) and len(earlier) == len(now):
        for i, (a, b) in enumerate(zip(earlier, now)):
            found = _first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    return None if earlier == now else (where, earlier, now)


def _only(kind: str, earlier: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """The names of one side only, in words ("models: vgg-tiny only in the file; mlp-tiny only in this command"),
    or None when both sides name the same."""
    parts = []
    gone = [k for k in earlier if k not in now]
    if gone:
        parts.append(f"{', '.join(gone)} only in the file")
    new = [k for k in now if k not in earlier]
    if new:
        parts.append(f"{', '.join(new)} only in this command")
    return f"{kind}: {'; '.join(parts)}" if parts else None


def sweep_difference(earlier: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """What differs between two sweeps' `Sweep.describe()`, in words, or None when they are the same sweep (in any
    order of models and clusters)."""
    for kind in ("models", "clusters"):
        names = _only(kind, earlier.get(kind) or {}, now.get(kind) or {})
        if names is not None:
            return names
    for kind, what in (("models", "model"), ("clusters", "cluster"), ("workloads", "workload of")):
        for name, value in now[kind].items():
            found = _first_difference(earlier[kind].get(name), value)
            if found is not None:
                path, was, wanted = found
                at = f" {path}" if path else ""
                return f"{what} '{name}'{at}: {was!r} in the file, {wanted!r} in this command"
    found = _first_difference(earlier.get("options"), now["options"])
    if found is not None:
        path, was, wanted = found
        return f"{path}: {was!r} in the file, {wanted!r} in this command"
    return None


class ResultsFile:
    """Where a sweep's records go (.csv, .json or .parquet), kept valid while the sweep runs.

    CSV is appended one line per record and flushed; a line cut short by an interrupted write is dropped when
    the file is read back. JSON and Parquet are rewritten whole for each record, through a temporary file and
    a rename. `finish` rewrites the file once more, in the sweep's order, so a resumed sweep ends with the
    same file as one that ran through. `dropped` counts the incomplete lines `read` skipped.

    Beside it, `sweep_path` (the name with ".sweep.json" added) holds the sweep that writes it (`Sweep.describe`),
    written when the file is begun; `resume` keeps an earlier run's records only when that run was the same sweep.
    """

    SUFFIXES = (".csv", ".json", ".parquet")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.format = self.path.suffix.lower()
        if self.format not in self.SUFFIXES:
            raise PlanError(f"--out {self.path}: the name must end in {', '.join(self.SUFFIXES)}")
        if self.format == ".parquet":
            try:
                import pyarrow  # noqa: F401  (optional: pyarrow, only for Parquet results)
            except ImportError:
                raise PlanError("writing .parquet needs pyarrow: pip install pyarrow (or use .csv)") from None
        self.sweep_path = self.path.with_name(self.path.name + SWEEP_SUFFIX)
        self.dropped = 0
        self._records: list[Record] = []
        self._append: io.TextIOWrapper | None = None

    def resume(self, sweep: Sweep) -> list[Record]:
        """The finished records of an earlier run of `sweep` in the file (none if there is no file); raises a
        one-line PlanError naming what differs where the file holds another sweep: its `sweep_path` describes
        another, or (without one, as an older pyplan wrote it) a record is not a pair of `sweep`."""
        if not self.path.exists():
            return []
        records = self.read()
        refuse = f"--resume: {self.path} holds another sweep"
        fix = "rerun the command that wrote it, or choose another --out"
        if self.sweep_path.exists():
            try:
                stored = json.loads(self.sweep_path.read_text())
                earlier = stored["sweep"] if stored.get("format") == SWEEP_FORMAT else None
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError, KeyError):
                earlier = None
            if not isinstance(earlier, dict) or not all(
                isinstance(earlier.get(k), dict) for k in ("models", "clusters", "workloads", "options")
            ):
                raise PlanError(
                    f"--resume: {self.sweep_path} (the sweep that wrote {self.path}) cannot be read; delete it to "
                    "resume with the records' own check, or choose another --out"
                )
            differs = sweep_difference(earlier, sweep.describe())
            if differs is not None:
                raise PlanError(f"{refuse} ({differs}); {fix}")
        differs = sweep.outside(records)
        if differs is not None:
            raise PlanError(f"{refuse} ({differs}); {fix}")
        return [r for r in records if is_finished(r)]

    def read(self) -> list[Record]:
        """The complete records in the file (none if it does not exist)."""
        if not self.path.exists():
            return []
        what = f"--resume: {self.path}"
        if self.format == ".csv":
            return self._read_csv(what)
        if self.format == ".json":
            try:
                data = json.loads(self.path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
                raise PlanError(f"{what} cannot be read ({exc}); delete it or write to another file") from None
        else:
            import pyarrow.parquet as pq  # optional: pyarrow (as above)

            try:
                data = pq.read_table(self.path).to_pylist()
            except Exception as exc:
                raise PlanError(f"{what} cannot be read ({exc}); delete it or write to another file") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) and set(r) == set(COLUMN_NAMES) for r in data):
            raise PlanError(f"{what} does not hold this pyplan's sweep records; write to another file")
        return data

    def _read_csv(self, what: str) -> list[Record]:
        try:
            text = self.path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise PlanError(f"{what} cannot be read ({exc}); delete it or write to another file") from None
        lines = text.split("\n")
        # Every complete line ends in a newline; what follows the last one was cut short.
        self.dropped = int(lines[-1] != "")
        lines = lines[:-1]
        if not lines:
            return []
        rows = list(csv.reader(lines))
        if tuple(rows[0]) != COLUMN_NAMES:
            raise PlanError(f"{what} has other columns than this pyplan writes; write to another file")
        records = []
        for row in rows[1:]:
            try:
                records.append(_typed(row))
            except ValueError:
                self.dropped += 1
        return records

    def begin(self, records: Sequence[Record], sweep: Sweep | None = None) -> None:
        """Start the file afresh with `records` (those kept from an earlier run), and `sweep_path` with `sweep`
        first (a resume then finds the sweep of every record in the file). The directory must exist."""
        if sweep is not None:
            data = {"format": SWEEP_FORMAT, "sweep": sweep.describe()}
            write_atomic(self.sweep_path, json.dumps(data, indent=1) + "\n")
        self._records = list(records)
        self._rewrite(self._records)
        if self.format == ".csv":
            self._append = self.path.open("a", newline="")

    def add(self, record: Record) -> None:
        self._records.append(record)
        if self._append is not None:
            self._append.write(_csv_text([record], header=False))
            self._append.flush()
        else:
            self._rewrite(self._records)

    def finish(self, records: Sequence[Record]) -> None:
        """Close the file and write it once more as `records` (the whole sweep, in its order)."""
        self.close()
        self._records = list(records)
        self._rewrite(self._records)

    def close(self) -> None:
        if self._append is not None:
            self._append.close()
            self._append = None

    def _rewrite(self, records: Sequence[Record]) -> None:
        if self.format == ".csv":
            data = _csv_text(records).encode()
        elif self.format == ".json":
            data = (json.dumps(list(records), indent=1) + "\n").encode()
        else:
            data = _parquet_bytes(records)
        write_atomic(self.path, data)


def _parquet_bytes(records: Sequence[Record]) -> bytes:
    import pyarrow as pa  # optional: pyarrow (as above)
    import pyarrow.parquet as pq  # optional: pyarrow (as above)

    kinds = {str: pa.string(), int: pa.int64(), float: pa.float64()}
    schema = pa.schema([(name, kinds[kind]) for name, kind in COLUMNS])
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(list(records), schema=schema), sink)
    return sink.getvalue()
