"""Host costs of the training runtime: what a rank's own thread spends beyond the blocks' profiled kernels.

On a CPU with one thread per rank (gloo) these are large next to small blocks (measured on a 2-core VM: 0.1-0.4 ms
per micro-batch and stage of schedule and PipelineStage bookkeeping, ~0.1 ms of CPU per message, AdamW ~35 us per
parameter tensor, 1-2 ms per step), and the gradient all-reduce runs after the backward on the same core instead
of overlapping it. `pyplan calibrate` measures them with the runtime itself (`measure_host_costs`) and the search
charges them (cpp/include/pyplan/search.h, HostCosts). A GPU's host work runs ahead of its kernels: catalog GPUs
carry none.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pyplan.errors import PlanError
from pyplan.hardware.catalog import local_host_json
from pyplan.plan import Layout
from pyplan.profile._procs import run_two
from pyplan.runtime.affinity import pin_rank
from pyplan.runtime.heap import keep_freed_memory
from pyplan.runtime.optim import optimizer_factory
from pyplan.spec import ModelSpec

__all__ = [
    "HostCosts",
    "OptimizerCost",
    "fit_optimizer_cost",
    "local_host_costs",
    "measure_host_costs",
    "measure_optimizer_costs",
]

OPTIMIZER_NAMES = ("sgd", "sgd-momentum", "adam", "adamw")


@dataclass(frozen=True)
class OptimizerCost:
    """One optimizer step on the host: `tensor_s` per parameter tensor plus `element_s` per parameter element."""

    tensor_s: float
    element_s: float

    def time_s(self, tensors: float, elements: float) -> float:
        return tensors * self.tensor_s + elements * self.element_s


@dataclass(frozen=True)
class HostCosts:
    """Per-rank host costs of pyplan's runtime (the fields of search.h's HostCosts; the optimizer's by name)."""

    stage_forward_s: float = 0.0
    stage_backward_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    optimizer: Mapping[str, OptimizerCost] = field(default_factory=dict)
    sync_overlaps_backward: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("stage_forward_s", "stage_backward_s", "message_s", "step_s"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and 0 <= value < float("inf")):
                raise PlanError(f"host costs: '{key}' must be a finite number >= 0, got {value!r}")
        object.__setattr__(self, "optimizer", MappingProxyType(dict(self.optimizer)))

    def for_search(self, optimizer: str) -> dict[str, float | bool]:
        """The keyword `host` of `_core.search` for a workload trained with `optimizer`."""
        cost = self.optimizer.get(optimizer)
        return {
            "stage_forward_s": self.stage_forward_s,
            "stage_backward_s": self.stage_backward_s,
            "message_s": self.message_s,
            "step_s": self.step_s,
            "optimizer_tensor_s": cost.tensor_s if cost else 0.0,
            "optimizer_element_s": cost.element_s if cost else 0.0,
            "sync_overlaps_backward": self.sync_overlaps_backward,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "stage_forward_s": self.stage_forward_s,
            "stage_backward_s": self.stage_backward_s,
            "message_s": self.message_s,
            "step_s": self.step_s,
            "optimizer": {k: {"tensor_s": v.tensor_s, "element_s": v.element_s} for k, v in self.optimizer.items()},
            "sync_overlaps_backward": self.sync_overlaps_backward,
            "source": self.source,
        }

    @staticmethod
    def from_json(data: Any, what: str) -> HostCosts:
        if not isinstance(data, Mapping):
            raise PlanError(f"{what}: must be an object; rerun `pyplan calibrate`")
        known = {
            "stage_forward_s",
            "stage_backward_s",
            "message_s",
            "step_s",
            "optimizer",
            "sync_overlaps_backward",
            "source",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{what}: unknown key '{unknown[0]}'; rerun `pyplan calibrate`")
        try:
            optimizer = {
                str(k): OptimizerCost(float(v["tensor_s"]), float(v["element_s"]))
                for k, v in dict(data.get("optimizer", {})).items()
            }
            return HostCosts(
                **{
                    k: float(data[k])
                    for k in ("stage_forward_s", "stage_backward_s", "message_s", "step_s")
                    if k in data
                },
                optimizer=optimizer,
                sync_overlaps_backward=bool(data.get("sync_overlaps_backward", True)),
                source=str(data.get("source", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{what}: malformed ({exc}); rerun `pyplan calibrate`") from None


# --- Optimizer step (one process) ----------------------------------------------------------------------------


def local_host_costs() -> HostCosts | None:
    """The runtime's host costs `pyplan calibrate` measured on this machine, or None when it has not (no
    calibration file, no host costs in it, or a file for another device)."""
    found = local_host_json()
    return None if found is None else HostCosts.from_json(found[0], f"calibration file {found[1]}: 'host'")


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    spec = optimizer_factory(name, 1e-3)
    return spec.cls(params, **spec.kwargs)


def _step_time_s(name: str, tensors: int, elements: int, reps: int) -> float:
    """The median CPU seconds of one step of optimizer `name` over `tensors` tensors of `elements` each."""
    params = [nn.Parameter(torch.randn(elements)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(elements)
    opt = _optimizer(name, params)
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        opt.step()
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def fit_optimizer_cost(many_small: tuple[int, int, float], few_large: tuple[int, int, float]) -> OptimizerCost:
    """Solve t = tensors·a + tensors·elements·c from two (tensors, elements per tensor, seconds) points."""
    (k1, n1, t1), (k2, n2, t2) = many_small, few_large
    e1, e2 = k1 * n1, k2 * n2
    det = k1 * e2 - k2 * e1
    if det == 0:
        raise ValueError("the two optimizer measurements must differ in shape")
    a = (t1 * e2 - t2 * e1) / det
    c = (k1 * t2 - k2 * t1) / det
    return OptimizerCost(tensor_s=max(0.0, a), element_s=max(0.0, c))


def measure_optimizer_costs(*, quick: bool = False) -> dict[str, OptimizerCost]:
    """Per optimizer: steps over 64 tensors of 16 elements and over 4 tensors of 256 Ki elements, fitted."""
    reps = 7 if quick else 21
    out = {}
    for name in OPTIMIZER_NAMES:
        small = (64, 16, _step_time_s(name, 64, 16, reps))
        large = (4, 1 << 18, _step_time_s(name, 4, 1 << 18, reps))
        out[name] = fit_optimizer_cost(small, large)
    return out


# --- The runtime's own costs (two processes) -----------------------------------------------------------------

_WIDTH = 8  # the probe model: tiny Linear layers, so what is measured is the runtime, not the kernels


def _probe_spec() -> Any:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(_WIDTH, _WIDTH), nn.ReLU(), nn.Linear(_WIDTH, _WIDTH))

    return ModelSpec(name="host-probe", build=build, example_inputs=lambda b: (torch.randn(b, _WIDTH),))


def _cpu_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        c0 = time.thread_time()
        fn()
        times.append(time.thread_time() - c0)
    return statistics.median(times)


def _messages(rank: int, reps: int) -> float:
    """CPU seconds a rank spends per message sent or received (a 4-byte tensor, as the schedules post them)."""

    buf = torch.zeros(1)
    peer = 1 - rank

    def post(op: Callable[..., Any]) -> None:
        for work in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
            work.wait()

    def trip() -> None:
        for op in (dist.isend, dist.irecv) if rank == 0 else (dist.irecv, dist.isend):
            post(op)

    for _ in range(10):
        trip()
    dist.barrier()
    return _cpu_s(trip, reps) / 2


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    """`fn`, each call's CPU seconds appended to `into`."""

    def call(*args: Any, **kwargs: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.thread_time() - c0)

    return call


def _trainer_step(spec: Any, m: int, reps: int, *, pp: int = 1) -> tuple[float, float, float]:
    """CPU seconds of one `PipelineTrainer.step` of a (2/pp) x pp GPipe plan of the probe model at m micro-batches
    of one sample, the forward chunk's CPU seconds per micro-batch beyond the model's own forward, and the step's
    CPU seconds outside its schedule (zeroing, finishing and applying the gradients: the medians of each)."""
    # Heavy: the trainer imports torch.distributed.pipelining and FSDP (1.3 s), which only calibration needs.
    from pyplan.runtime.trainer import build_trainer

    cuts = (0, 3) if pp == 1 else (0, 2, 3)
    layout = Layout(dp=2 // pp, pp=pp, micro_batch_size=1, num_microbatches=m, schedule="GPipe", cut_positions=cuts)
    torch.manual_seed(0)
    trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("sgd", 1e-3))
    x, y = torch.randn(m, _WIDTH), torch.randn(m, _WIDTH)
    stage = trainer.schedule._stage
    module = trainer.modules[0]
    inner = module.module if hasattr(module, "module") else module
    marks: list[float] = []
    extra: list[float] = []  # + each forward chunk, − the model's forward inside it
    inner.register_forward_pre_hook(lambda *_: marks.append(time.thread_time()))
    inner.register_forward_hook(lambda *_: extra.append(marks.pop() - time.thread_time()))
    stage.forward_one_chunk = _timed(stage.forward_one_chunk, extra)
    scheduled: list[float] = []
    trainer.schedule.step = _timed(trainer.schedule.step, scheduled)
    inputs = (x,) if trainer.has_first else ()
    for _ in range(3):
        trainer.step(inputs, y)
    extra.clear()
    scheduled.clear()
    totals: list[float] = []
    step_s = _cpu_s(_timed(lambda: trainer.step(inputs, y), totals), reps)
    outside = statistics.median(t - s for t, s in zip(totals, scheduled, strict=True))
    return step_s, sum(extra) / (reps * m), outside


def _runtime(reps: int, microbatches: tuple[int, int]) -> dict[str, float]:
    """Per micro-batch and stage, and per step, CPU seconds of `PipelineTrainer.step` beyond the probe model's
    compute (a plan with one stage: no messages), from the step's growth between two micro-batch counts."""
    spec = _probe_spec()
    (m1, m2) = microbatches
    (t1, _, outside), (t2, forward_extra, _) = _trainer_step(spec, m1, reps), _trainer_step(spec, m2, reps)
    model = spec.build()
    xb = torch.randn(1, _WIDTH)

    def fwd_bwd() -> None:
        model(xb).sum().backward()

    for _ in range(5):
        fwd_bwd()
    compute = _cpu_s(fwd_bwd, reps)
    slope = (t2 - t1) / (m2 - m1)
    # The forward chunk's own extra is measured directly, so the total is never below it; the backward's share is
    # what the growth leaves beyond it (0 where the two differences' noise hides it: a loaded host).
    forward = max(0.0, forward_extra)
    per_microbatch = max(forward, slope - compute)
    # The same plan on 1 x 2 stages: per micro-batch, each rank also sends one message and receives one (the
    # activation one way, its gradient the other), with the schedule's bookkeeping of both (the operations, the
    # receive buffers, posting and waiting). Each rank holds half the probe's compute on average.
    (p1, _, _), (p2, _, _) = _trainer_step(spec, m1, reps, pp=2), _trainer_step(spec, m2, reps, pp=2)
    pipeline_slope = (p2 - p1) / (m2 - m1)
    message = (pipeline_slope - compute / 2 - per_microbatch) / 2
    return {
        "stage_forward_s": forward,
        "stage_backward_s": per_microbatch - forward,
        # The step's own cost is the intercept of the two counts' line; never below what it measurably spends
        # outside the schedule (a loaded host's noise can take the intercept to 0 or below).
        "step_s": max(outside, t1 - m1 * slope),
        "pipeline_message_s": message,
    }


def _host_worker(rank: int, out: str, init: str, quick: bool) -> None:

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)

    keep_freed_memory()  # as the runtime runs CPU ranks (pyplan/runtime/heap.py, affinity.py)
    pin_rank()
    try:
        reps = 15 if quick else 41
        found = {"message_s": _messages(rank, 10 * reps), **_runtime(reps, (2, 8))}
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, found)
        if rank == 0:
            mean = {k: statistics.mean(g[k] for g in gathered) for k in found}
            # A message costs what the pipeline shows (its bookkeeping included), never less than posting one.
            mean["message_s"] = max(mean["message_s"], mean.pop("pipeline_message_s"))
            tmp = f"{out}.tmp"
            Path(tmp).write_text(json.dumps(mean))
            os.replace(tmp, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_host_costs(*, quick: bool = False, timeout_s: float = 180.0) -> HostCosts:
    """The runtime's host costs on this CPU: two processes of one thread over gloo (the setting `pyplan plan`
    targets on a CPU), each figure the mean of both ranks' medians; the optimizers' in this process."""
    optimizer = measure_optimizer_costs(quick=quick)
    data = run_two(_host_worker, (quick,), what="host-cost measurement", timeout_s=timeout_s, done_if_written=True)
    return HostCosts(
        **data,
        optimizer=optimizer,
        sync_overlaps_backward=False,
        source="pyplan calibrate: pyplan's runtime on 2 CPU processes of one thread (gloo)",
    )
