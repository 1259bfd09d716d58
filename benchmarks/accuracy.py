"""Prediction accuracy: plans run on 2 CPU processes and on one device, predicted against measured; prints tables.

Run: `python benchmarks/accuracy.py` (5-15 minutes on 2 cores, longer while it waits for a quiet machine or runs a
model again; `--help` for the options). It calibrates this machine (`pyplan calibrate`, into a temporary cache
directory, so the `local` GPU and link carry today's figures); then, model by model, it profiles the model with
`chain_for` on the `local` GPU of 2 processes (block times measured with 1 thread beside a companion process running
the same blocks, as the ranks run), for each remat policy ("none", "full") runs one `pyplan.search` over 2 processes
constrained to the matrix (dp x pp in {2x1, 1x2}, GPipe and 1F1B, the case's micro-batch sizes, ZeRO 0, every GPU
used), and runs the plans at once. Every plan the search returns is a configuration of the matrix: its Layout is
what runs, so the prediction printed is the prediction of the configuration measured. Each model's configurations
run in torchrun launches of their own (2 ranks, gloo, one thread each; `Protocol.launches` of the same plans, whose
steps are pooled), each rank building its stages from the Layout with `build_trainer` as the emitted script does.
One process per model, as a user's training has: with every model's trainers in one process, gpt-tiny's stage
forwards took 9-26 % more CPU time than with its own alone (2 x 1 plans, four runs each), though the trainers of the
other models sat idle.

The machine's speed. This VM's speed drifts by 10-50 % within minutes, unseen by a matrix product held in one core's
cache (a run's gpt-tiny forwards took 38-51 % more time than profiled while such a probe moved 1 %): a prediction
made from a profile taken at one speed and measured at another holds the drift, not the cost model's error. So at
the start of each round both ranks time the model's blocks again, as `chain_for` did (`_Reprofile`), and a model
whose blocks then take more than DRIFT more or less time than in its plans' profile, at any of its micro-batch sizes,
is profiled, planned and run again, up to ATTEMPTS times; the attempt with the least drift is kept and its drift
printed.

Measurement, per configuration and rank:
  time     blocks of `warmup` untimed and `steps` timed steps (Protocol), each step started after a barrier; a
           step is the wall clock around `PipelineTrainer.step` (zero_grad, the schedule, gradient sync, optimizer
           step) and its iteration time the max over ranks. The blocks run in rounds over the whole matrix, so a
           burst of load elsewhere falls on every configuration alike; a block starts where another
           configuration left the caches, so it warms up for 3 steps (after 1, gpt-tiny's stage forwards took
           23-36 % more CPU time than profiled; after 4, 5-22 %). On a shared 2-core machine other processes
           take a rank's core and stretch the steps of both ranks (one waits for the other) by up to 3x: a block
           is quiet when other processes used at most `quiet_cores` cores during it (the machine's busy time in
           /proc/stat less both ranks' CPU time), rounds go on until every configuration has `quiet_blocks` quiet
           blocks, and before each round the benchmark waits for a quiet second. The figure is the median over the
           quiet steps of every launch (over every step, said so by the "quiet steps" column, when fewer than 3
           were quiet); the median over every step is printed beside it.
  memory   the two first steps run under `LiveMemory` (pyplan/profile/live.py: every storage torch allocates, from
           its allocation to its death); the peak is taken over the second step, so it holds what the first step
           left (optimizer state, the pipeline's receive buffers, DDP's buckets, gradients) and every transient
           of a steady step; the rank's parameter bytes and, on the first stage's rank, the replica's batch, both
           allocated before, are added. That is compared with the plan's memory of the rank: Σ
           StagePlan.memory_bytes = weights + gradients + optimizer state (AdamW, 16 bytes per parameter) +
           activations of the micro-batches in flight + what the PipelineStage keeps (inputs, outputs, the
           runtime's receive buffers as the schedule holds them: pyplan/solve/remat_search.py's stage_outputs,
           pyplan/runtime/recv.py, the core's receive_buffers and held_input_cuts, simulate.h's warmup_send_held).
           Not seen: memory inside kernels and allocations made by gloo's threads.
  busy     per stage, wall and CPU time of the stage module's forward (+ the loss on the last stage), of its
           autograd backward (torch's stage_backward) and of recomputation inside it (checkpointed blocks run
           again); the rest of forward_one_chunk / backward_one_chunk and of the step outside them, the loss, the
           optimizer step and the waits for sends and receives is framework overhead (schedule, stage
           bookkeeping, posting sends, zero_grad, gradient scaling). With dp > 1 the last micro-batch's backward
           also waits for DDP's all-reduce: backward is taken from the other micro-batches, the excess is sync;
           after the schedule, stages on two ranks that share a parameter (gpt-tiny's tied embedding) all-reduce
           its gradient: the rank that gets there last times that all-reduce, which is sync too.

One device (`--matrices one-cpu` or `one-cuda`; one-cuda by default where torch sees a GPU). The choices a single
device leaves, the remat policy and the micro-batch size with its GA steps (1F1B: each micro-batch's forward and
backward in turn; see ONE_DEVICE_SCHEDULES), on ONE_CPU_CASES (one process of one thread) or ONE_CUDA_CASES
(one GPU, models large enough to keep it busy). Each model is calibrated (on a GPU: `pyplan calibrate` of it, once),
profiled and planned in a process of its own (`_plan_worker`), then run as above in launches of one rank (gloo on
the CPU, NCCL on a GPU). On a GPU, a step is timed from a synchronize to a synchronize, the probe synchronizes
at each mark (its wall times are the GPU's work, and stand for the CPU times of the terms below), and memory is
torch.cuda.max_memory_allocated over the second step, less what the GPU held before the trainer was built. This
process never touches CUDA: it hides the GPU from itself and the CPU matrices' ranks (CUDA_VISIBLE_DEVICES), and
shows it again to the one-cuda processes.

Diagnosis. The iteration's error is split into terms by re-simulating the planned schedule (pyplan's simulator, with
the plan's send times) with measured per-micro-batch stage times: compute = makespan(CPU-time F and B less
recompute, plus the predicted recompute) − the predicted makespan without its host costs (CPU time is what the
profile measures: what the stages cost); contention = the same in wall-clock time, less that (other threads held the
core while a stage computed); recompute = makespan(wall F, B) − that (the blocks a checkpoint runs again in the
backward, measured against the plan's recomputed forwards: its recompute_s less checkpoint_s); framework = makespan
with each stage's framework overhead per micro-batch added to its F and B, less that, less the predicted host costs
(per-stage, per-message and per-step, pyplan/profile/host.py); optimizer = measured − predicted optimizer step;
sync = measured all-reduce waits − predicted exposed communication (DDP's and the tied parameters'); the rest
(measured − everything above) is "p2p" for pipelines (time the ranks wait for sends and receives beyond what the
schedule with the real compute and overhead implies) and "other" for dp x 1.
With remat, a checkpoint's call and torch's hooks on the saved tensors run in the forward (packing) and in the
backward around the recomputation, interleaved with the blocks' own work: they are in the compute term where they
run, measured in F and B, predicted in the plan's forward_s (checkpoint_forward_s) and backward_s (the rest of
checkpoint_s). The CPU F and B errors printed are those of the busiest stage per micro-batch, B without the
recomputation, and R that of the recomputation.
A row whose error exceeds 10 % names its largest term as the wrong one.

Targets: median |error| of iteration time <= 10 %, worst <= 25 %; peak
memory |error| <= 10 %; the plan ranked first is the measured fastest, or within 5 % of it, in >= 90 % of the
decisions (each search, model x remat policy, and each model over both policies).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, new_table, target_line, write_json

LR = 1e-3
MESHES = ((2, 1), (1, 2))
# A model's matrix runs again (up to ATTEMPTS times, each planned afresh) while its blocks, timed again in the
# ranks during the runs, take more than DRIFT more or less time than the profile its plans were made from.
DRIFT = 0.05
ATTEMPTS = 3
SCHEDULES = ("GPipe", "1F1B")
# One device runs 1F1B only: with one stage it is gradient accumulation (each micro-batch's forward and backward in
# turn); GPipe does the same work holding every micro-batch's activations at once, a plan pyplan never ranks first
# (equal time, more memory). With both in the matrix, every wrong decision of an earlier run of the one-cpu matrix was
# that pair: over the 36 pairs of two runs, 1F1B measured -17 % to +21 % off its GPipe twin (mean -1.0 %, standard
# deviation 6.5 %), noise either way, which the 5 % of a right decision does not cover.
ONE_DEVICE_SCHEDULES = ("1F1B",)
REMATS = ("none", "full")
TARGET_TIME_MEDIAN, TARGET_TIME_WORST, TARGET_MEMORY, TARGET_RIGHT = 0.10, 0.25, 0.10, 0.90
WITHIN = 0.05  # a recommendation is right when its measured time is within 5 % of the fastest


@dataclass(frozen=True)
class Case:
    """A model of the zoo, the global batch it trains, and the micro-batch sizes the matrix tries."""

    model: str
    global_batch: int
    micro_batch_sizes: tuple[int, ...]


# Global batches chosen so a step takes 20-120 ms on a 2-core x86 VM, one thread per rank.
CASES = (
    Case("resnet-tiny", 32, (4, 8)),
    Case("vgg-tiny", 64, (8, 16)),
    Case("gpt-tiny", 64, (8, 16)),
)
# One device: remat and the micro-batch size / GA steps of one process, on the CPU (one thread) or one GPU.
ONE_CPU_CASES = (
    Case("resnet-tiny", 32, (4, 8, 16)),
    Case("vgg-tiny", 64, (8, 16, 32)),
    Case("gpt-tiny", 64, (8, 16, 32)),
)
# On a GPU, models whose kernels keep it busy: a tiny model's step is the host launching kernels, which the
# profile (CUDA events around each block) does not time. Every configuration's trainer is held at once (see
# _worker), so their weights and AdamW state share the GPU's memory with the peak of the one that runs: 12
# trainers of gpt2-small hold 24 GB of weights, gradients and AdamW state.
ONE_CUDA_CASES = (
    Case("resnet50", 128, (16, 32, 64)),
    Case("gpt2-small", 8, (1, 2, 4)),
    Case("vgg16-cifar10", 512, (64, 128, 256)),
)
# The matrices: name -> (processes, device, cases).
MATRICES: dict[str, tuple[int, str, tuple[Case, ...]]] = {
    "ranks": (2, "cpu", CASES),
    "one-cpu": (1, "cpu", ONE_CPU_CASES),
    "one-cuda": (1, "cuda", ONE_CUDA_CASES),
}


@dataclass(frozen=True)
class Config:
    """One configuration of the matrix."""

    model: str
    dp: int
    pp: int
    schedule: str
    micro_batch_size: int
    num_microbatches: int
    remat: str

    @property
    def label(self) -> str:
        return (
            f"{self.model} {self.dp}x{self.pp} {self.schedule} b{self.micro_batch_size}x{self.num_microbatches} "
            f"remat={self.remat}"
        )


@dataclass(frozen=True)
class Planned:
    """A configuration with pyplan's plan for it and what the diagnosis needs of the chain."""

    config: Config
    global_batch: int
    plan: dict[str, Any]  # Plan.to_json()
    send_s: tuple[float, ...]  # predicted transfer time of each stage boundary, per micro-batch
    stage_rank: tuple[int, ...]
    # Per stage, the host costs the prediction charges per micro-batch (framework work and messages) in F and B,
    # so the diagnosis compares the profiled compute with the measured compute and the predicted host costs with
    # the measured framework overhead.
    host_s: tuple[tuple[float, float], ...]
    # The profile's forward and backward of the whole model (every block, no loss) at the micro-batch size: what
    # the ranks time again during the runs to see whether the machine still runs at the profile's speed.
    profiled_s: float = 0.0
    device: str = "cpu"  # where the plan was profiled and runs: "cpu" or "cuda"

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Planned:
        """The inverse of dataclasses.asdict."""
        return Planned(
            **{
                **d,
                "config": Config(**d["config"]),
                "send_s": tuple(d["send_s"]),
                "stage_rank": tuple(d["stage_rank"]),
                "host_s": tuple(tuple(h) for h in d["host_s"]),
            }
        )


@dataclass(frozen=True)
class StageTimes:
    """One stage's measured times in one step (seconds, summed over its micro-batches)."""

    forward_s: float  # the stage module's forward, and the loss on the last stage
    forward_cpu_s: float
    backward_s: float  # autograd's backward of the stage (recomputation included), DDP's wait left out
    backward_cpu_s: float
    backward_sync_s: float  # the last micro-batch's backward beyond the others' mean (DDP's all-reduce wait)
    recompute_s: float
    recompute_cpu_s: float
    overhead_s: float  # the rest of forward_one_chunk and backward_one_chunk: the stage's framework overhead


@dataclass(frozen=True)
class RankResult:
    """What one rank measured for one configuration."""

    step_s: tuple[float, ...]
    quiet: tuple[bool, ...]  # per step: whether other processes left the machine alone meanwhile
    optimizer_s: float
    outside_s: float  # the step outside chunks, loss, optimizer and waits (zero_grad, posting sends, ...)
    wait_s: float  # blocked in the schedule's waits for sends and receives
    finish_s: float  # the gradients' finish after the schedule: the tied parameters' all-reduce (and its wait)
    stages: dict[int, StageTimes]  # medians over the quiet steps (every step when fewer than 3 were quiet)
    other_cores: tuple[float, ...]  # per block: cores other processes kept busy
    peak_bytes: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int


@dataclass(frozen=True)
class Terms:
    """The iteration-time error split into terms: measured minus predicted seconds (see the module docstring).

    `forward_err`/`backward_err`: measured (CPU time, what the profile measures) over predicted, less one, of the
    busiest stage's forward and backward (recomputation left out) per micro-batch; `recompute_cpu_s` and
    `recompute_pred_s` its recomputation per micro-batch, measured and predicted (0 without). `other_cores`: how
    many cores other processes kept busy on average while the configuration ran (2 cores in all)."""

    compute_s: float
    contention_s: float
    recompute_s: float
    framework_s: float
    optimizer_s: float
    sync_s: float
    rest_s: float
    rest_name: str
    forward_err: float
    backward_err: float
    other_cores: float
    stage_overhead_s: float  # framework overhead inside the busiest stage's chunks, per micro-batch
    outside_s: float  # framework overhead outside the chunks, per step, on the rank where it is largest
    recompute_cpu_s: float = 0.0
    recompute_pred_s: float = 0.0

    def named(self) -> dict[str, float]:
        return {
            "compute": self.compute_s,
            "contention": self.contention_s,
            "recompute": self.recompute_s,
            "framework": self.framework_s,
            "optimizer": self.optimizer_s,
            "sync": self.sync_s,
            self.rest_name: self.rest_s,
        }

    def describe(self, measured_s: float, error: float) -> str:
        terms = self.named()
        parts = [f"{k} {v / measured_s:+.0%}" for k, v in terms.items() if v]
        errors = f"CPU F {self.forward_err:+.0%}, B {self.backward_err:+.0%}"
        if self.recompute_pred_s > 0:
            errors += f", R {self.recompute_cpu_s / self.recompute_pred_s - 1:+.0%}"
        text = ", ".join(parts) + (
            f" ({errors}; framework "
            f"{self.stage_overhead_s * 1e3:.2f} ms/micro-batch in a stage + {self.outside_s * 1e3:.1f} ms/step)"
        )
        if abs(error) > TARGET_TIME_MEDIAN:
            worst = max(terms, key=lambda k: abs(terms[k]))
            text = f"{worst} wrong: {text}"
        return text


@dataclass(frozen=True)
class Row:
    """A configuration's predicted and measured figures."""

    config: Config
    predicted_s: float
    measured_s: float  # median over the quiet steps (over every step when fewer than 3 were quiet)
    all_steps_s: float  # median over every step
    quiet_steps: int
    steps: int
    predicted_bytes: float
    measured_bytes: float
    predicted_activation_bytes: float
    measured_activation_bytes: float
    terms: Terms
    # Per pipeline rank (one replica), the plan's memory less the measured peak: where a memory error lies.
    rank_bytes_error: tuple[float, ...] = ()
    # Every timed step's iteration time (the max over ranks) and whether it was quiet, in the order run.
    step_s: tuple[float, ...] = ()
    step_quiet: tuple[bool, ...] = ()
    # The whole model's forward and backward at the micro-batch size (every block, no loss): in the profile the
    # plan was made from, and timed again by the ranks at the start of each round (_Reprofile), in order.
    profiled_s: float = 0.0
    reprofiled_s: tuple[float, ...] = ()

    @property
    def time_error(self) -> float:
        """(predicted − measured) / measured."""
        return self.predicted_s / self.measured_s - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1


@dataclass(frozen=True)
class Decision:
    """One ranking: the configurations of a group by predicted time; right when the first is the measured fastest
    or within WITHIN of it."""

    group: str
    chosen: str
    fastest: str
    slower_by: float

    @property
    def right(self) -> bool:
        return self.slower_by <= WITHIN


@dataclass(frozen=True)
class Summary:
    """Aggregates over the rows and whether each target is met."""

    time_median: float
    time_worst: float
    memory_median: float
    memory_worst: float
    decisions: tuple[Decision, ...]
    targets: dict[str, bool] = field(default_factory=dict)
    # Per model: its blocks timed again by the ranks during the runs against the profile its plans were made
    # from (time over time, less one; positive when the machine ran slower), and the attempts it took to get
    # within DRIFT (at most ATTEMPTS; the attempt with the least drift is kept).
    drift: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)

    @property
    def right_rate(self) -> float:
        return sum(d.right for d in self.decisions) / len(self.decisions) if self.decisions else math.nan


# --- Planning (in this process) -------------------------------------------------------------------------------


@contextlib.contextmanager
def calibration_dir(calibration: str | None, quick: bool) -> Iterator[str]:
    """A temporary pyplan cache directory holding a calibration file, set as $PYPLAN_CACHE_DIR while inside: the
    given file, or a fresh `pyplan calibrate` (1 thread per process, as the ranks run)."""
    from pyplan.profile.calibrate import CalibrationOptions, calibrate, write_calibration

    before = os.environ.get("PYPLAN_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="pyplan-accuracy-") as tmp:
        target = Path(tmp) / "local.json"
        if calibration is not None:
            shutil.copyfile(calibration, target)
        else:
            write_calibration(calibrate(CalibrationOptions(threads=1, quick=quick)), target)
        os.environ["PYPLAN_CACHE_DIR"] = tmp
        try:
            yield str(target)
        finally:
            if before is None:
                del os.environ["PYPLAN_CACHE_DIR"]
            else:
                os.environ["PYPLAN_CACHE_DIR"] = before


def plan_case(
    case: Case, remats: Sequence[str], keep: Callable[[Config], bool] = lambda c: True, *, processes: int = 2
) -> list[Planned]:
    """The matrix of one model: one search per remat policy, constrained to the matrix, every plan it returns.
    With 2 processes the matrix is dp x pp in MESHES; with 1, one device (where `local_device` is)."""
    import torch

    from pyplan import load_model, search
    from pyplan.api import chain_for
    from pyplan.hardware import Cluster
    from pyplan.plan import Plan, Workload
    from pyplan.profile.host import local_host_costs
    from pyplan.profile.measure import local_device
    from pyplan.solve.schedules import stage_placement
    from pyplan.spec import default_loss

    meshes = MESHES if processes == 2 else ((1, 1),)
    device = local_device().type
    spec = load_model(f"zoo:{case.model}")
    torch.manual_seed(0)
    model = spec.build()
    cluster = Cluster.from_catalog("local", processes)
    workload = Workload(global_batch=case.global_batch, optimizer="adamw", precision="fp32")
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    link = cluster.groups[0].intra_link
    # One device sends nothing: a calibration without a link (`pyplan calibrate --no-link`) plans it.
    assert processes == 1 or (link.latency_s is not None and link.bw_bytes_per_s is not None)
    host = local_host_costs() if device == "cpu" else None  # as the search charges them
    out = []
    for remat in remats:
        found = search(
            model,
            spec.example_inputs,
            cluster,
            workload,
            chain=chain,
            schedules=SCHEDULES if processes == 2 else ONE_DEVICE_SCHEDULES,
            zero_stages=(0,),
            placements=("pp-inner",),
            micro_batch_sizes=case.micro_batch_sizes,
            allow_fewer_gpus=False,
            top_k=1000,
            remat=remat,
            loss=spec.loss or default_loss,
            target=spec.target,
        )
        plans: list[Plan] = [found.best, *found.alternatives]
        seen = set()
        for p in plans:
            lay = p.layout
            config = Config(case.model, lay.dp, lay.pp, lay.schedule, lay.micro_batch_size, lay.num_microbatches, remat)
            if (lay.dp, lay.pp) not in meshes or config in seen or not keep(config):
                continue
            seen.add(config)
            b = lay.micro_batch_size
            sends = tuple(
                link.latency_s + chain.cuts[st.last_block + 1].bytes(b) / link.bw_bytes_per_s  # type: ignore[operator]
                for st in p.stages[:-1]
            )
            placement = stage_placement(lay.schedule, lay.pp, lay.stages_per_rank)
            last = len(p.stages) - 1
            host_s = []
            for s, st in enumerate(p.stages):
                messages = (len(chain.cuts[st.first_block].live) if s > 0 else 0) + (
                    len(chain.cuts[st.last_block + 1].live) if s < last else 0
                )
                extra = host.message_s * messages if host is not None else 0.0
                host_s.append(
                    (host.stage_forward_s + extra, host.stage_backward_s + extra) if host is not None else (0.0, 0.0)
                )
            profiled = sum(blk.fwd_time_s(b) + blk.bwd_time_s(b) for blk in chain.blocks)
            out.append(
                Planned(
                    config, case.global_batch, p.to_json(), sends, tuple(placement), tuple(host_s), profiled, device
                )
            )
    return out


# --- Measuring (under torchrun) -------------------------------------------------------------------------------


class _Probe:
    """Where a rank's step goes. Wall and CPU time of each local stage's module forward (and the loss, on the last
    stage), of its autograd backward (torch's stage_backward), of recomputation inside it, and of the whole
    forward_one_chunk / backward_one_chunk calls (the rest of them is the stage's framework overhead); the time
    blocked in the schedule's waits for sends and receives; the optimizer step. Methods are wrapped on this rank's
    objects; the schedule's wait and torch's stage_backward are module functions, replaced in this worker process
    only. On a GPU each mark first waits for the GPU (torch.cuda.synchronize), so that wall times are the GPU's
    work (a few microseconds of launch gap per mark, against steps of tens of milliseconds), and the "CPU" times
    are those wall times: the GPU's work is what the profile measured there (CUDA events), and the host's time in
    the synchronize, spinning or asleep, says nothing of it."""

    def __init__(self, trainer: Any) -> None:
        import torch
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage_module
        from torch.nn.parallel import DistributedDataParallel

        from pyplan.runtime.remat import RematModule

        sched = trainer.schedule
        self.sync: Callable[[], None] | None = torch.cuda.synchronize if trainer.device.type == "cuda" else None
        self.stages = list(sched._stages) if hasattr(sched, "_stages") else [sched._stage]
        self.current = -1  # the stage whose chunk runs
        self.in_backward = 0
        self.remat_depth = 0
        self.reset()
        for st in self.stages:
            s = st.stage_index
            st.forward_one_chunk = self._timed(st.forward_one_chunk, s, "chunk F")
            st.backward_one_chunk = self._timed(st.backward_one_chunk, s, "chunk B", backward=True)
            module = st.submod.module if isinstance(st.submod, DistributedDataParallel) else st.submod
            module.register_forward_pre_hook(lambda *_: self._start())
            module.register_forward_hook(lambda *_, s=s: self._stop((s, "F")))
            for m in st.submod.modules():
                if isinstance(m, RematModule):
                    m._run = self._recompute(m._run)
        if any(st.is_last for st in self.stages):
            last = next(st.stage_index for st in self.stages if st.is_last)
            sched._compute_loss = self._timed(sched._compute_loss, last, "L")
        trainer.optimizer.step = self._timed(trainer.optimizer.step, -1, "O")
        trainer._finish_gradients = self._timed(trainer._finish_gradients, -1, "G")
        if not hasattr(stage_module.stage_backward, "_probe"):
            stage_module.stage_backward = _Probe._patched(stage_module.stage_backward, "B")
            schedules._wait_batch_p2p = _Probe._patched(schedules._wait_batch_p2p, "W")

    active: _Probe | None = None  # the probe the module functions report to (set while a block is timed)

    @staticmethod
    def _patched(fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            probe = _Probe.active
            if probe is None:
                return fn(*args, **kwargs)
            probe._start()
            try:
                return fn(*args, **kwargs)
            finally:
                probe._stop((probe.current if kind == "B" else -1, kind))

        run._probe = True  # type: ignore[attr-defined]
        return run

    def reset(self) -> None:
        self.wall: dict[tuple[int, str], list[float]] = {}
        self.cpu: dict[tuple[int, str], list[float]] = {}
        self.marks: list[tuple[float, float]] = []

    def _start(self) -> None:
        if self.sync is not None:
            self.sync()
        self.marks.append((time.perf_counter(), time.thread_time()))

    def _stop(self, key: tuple[int, str]) -> None:
        if self.sync is not None:
            self.sync()
        t0, c0 = self.marks.pop()
        wall = time.perf_counter() - t0
        self.wall.setdefault(key, []).append(wall)
        self.cpu.setdefault(key, []).append(wall if self.sync is not None else time.thread_time() - c0)

    def _timed(self, fn: Callable[..., Any], stage: int, kind: str, backward: bool = False) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.in_backward += backward
            self.current = stage
            self._start()
            try:
                return fn(*args, **kwargs)
            finally:
                self._stop((stage, kind))
                self.in_backward -= backward

        return run

    def _recompute(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.in_backward or self.remat_depth:
                return fn(*args, **kwargs)
            self.remat_depth += 1
            self._start()
            try:
                return fn(*args, **kwargs)
            finally:
                self._stop((self.current, "R"))
                self.remat_depth -= 1

        return run

    def total(self, stage: int, kind: str, cpu: bool = False) -> float:
        return sum((self.cpu if cpu else self.wall).get((stage, kind), []))

    def stage_times(self, dp: int) -> dict[int, StageTimes]:
        out = {}
        for st in self.stages:
            s = st.stage_index
            bwd = self.wall.get((s, "B"), [0.0])
            sync = 0.0
            if dp > 1 and len(bwd) > 1:
                # The last backward also waits for DDP's gradient all-reduce: charge its excess to communication.
                sync = max(0.0, bwd[-1] - statistics.mean(bwd[:-1]))
            chunks = self.total(s, "chunk F") + self.total(s, "chunk B")
            out[s] = StageTimes(
                forward_s=self.total(s, "F") + self.total(s, "L"),
                forward_cpu_s=self.total(s, "F", True) + self.total(s, "L", True),
                backward_s=sum(bwd) - sync,
                backward_cpu_s=self.total(s, "B", True),
                backward_sync_s=sync,
                recompute_s=self.total(s, "R"),
                recompute_cpu_s=self.total(s, "R", True),
                overhead_s=chunks - self.total(s, "F") - sum(bwd),
            )
        return out

    def outside_s(self, step_s: float) -> float:
        """The step's time outside the stages' chunks, the loss, the optimizer and the waits: framework."""
        inside = sum(self.total(st.stage_index, k) for st in self.stages for k in ("chunk F", "chunk B", "L"))
        return step_s - inside - self.total(-1, "O") - self.total(-1, "W") - self.total(-1, "G")


_FIELDS = tuple(StageTimes.__dataclass_fields__)


class _Reprofile:
    """The model's blocks timed again on a rank during the runs, as `chain_for` timed them for the plans (in
    sequence, one thread; both ranks at once, as the profile ran beside a companion process): the whole model's
    forward and backward at each micro-batch size of the matrix."""

    def __init__(self, item: dict[str, Any], sizes: Sequence[int]) -> None:
        import torch

        from pyplan import load_model
        from pyplan.graph.linearize import linearize
        from pyplan.graph.trace import trace

        self.spec = load_model(f"zoo:{item['config']['model']}")
        torch.manual_seed(0)
        model = self.spec.build()
        self.chain = linearize(trace(model, self.spec.example_inputs, batch_size=min(4, item["global_batch"])))
        self.sizes = sorted(set(sizes))
        # Timed as chain_for timed the plans' profile: alone, the blocks brought down to the whole model's time;
        # on 2 ranks (each the other's companion, as the profile's was), not (pyplan/profile/measure.py).
        self.alone = item["config"]["dp"] * item["config"]["pp"] == 1
        # Two sizes or more to time; the smallest size's half is timed and not reported.
        self.timed = sorted({*self.sizes, max(1, self.sizes[0] // 2)}) if len(self.sizes) < 2 else self.sizes
        if len(self.timed) < 2:
            self.timed = [1, 2]

    def __call__(self) -> dict[int, float]:
        from pyplan.profile.measure import TimingOptions, block_times

        times = block_times(self.chain, self.spec.example_inputs, self.timed, options=TimingOptions(whole=self.alone))
        return {b: sum(f(b) + g(b) for f, g in times) for b in self.sizes}


def model_drift(planned: Sequence[Planned], profiles: Sequence[dict[str, float]]) -> float:
    """The blocks' time during the runs against the profile the plans were made from, less one, at the micro-batch
    size where it is farthest off: per size, the median over timings (a rank in a round) of timed / profiled.
    Sizes are not averaged: one attempt had vgg-tiny's b=8 profile 34 % fast and its b=16 profile 12 % slow
    against the re-timings, which a mean over the sizes put at +10.7 %, and a plan chosen between sizes holds
    both errors."""
    profiled = {p.config.micro_batch_size: p.profiled_s for p in planned}
    if not profiles:
        return 0.0
    per_size = [statistics.median(t[str(b)] / profiled[b] for t in profiles) - 1 for b in sorted(profiled)]
    return max(per_size, key=abs)


def _machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Protocol:
    """How the configurations are timed: in `launches` torchrun launches of the same plans (fresh processes), in
    each blocks of `warmup` untimed and `steps` timed steps, in rounds over the matrix until each configuration
    has `quiet_blocks` quiet blocks (other processes used at most `quiet_cores` cores meanwhile) or `max_rounds`
    rounds have run; before each round, up to `wait_s` seconds of waiting for the machine to be quiet.

    32 quiet steps per configuration, in two launches: a 2x1 step on this VM spreads over 20 % (vgg-tiny b=16:
    20.3-25.8 ms, the gradient all-reduce's wait), and the median of 6 steps moved by more than the 5 % a
    recommendation is judged by. A 2x1 GPipe/1F1B pair does the same work: measured with 6 steps their times
    differed by 5.4 % (standard deviation, 156 pairs), with 12-20 steps by 2.9 % (48 pairs). A difference can also
    hold through a launch: with 32 steps in one, vgg-tiny's 1F1B b=16 ran 6.3 % slower than its GPipe, slower in 7
    of 8 rounds; steps from two launches average two such draws."""

    steps: int = 4
    warmup: int = 3
    quiet_blocks: int = 4
    max_rounds: int = 8
    quiet_cores: float = 0.15
    wait_s: float = 60.0
    launches: int = 2


@dataclass
class _Run:
    """One configuration on this rank: its trainer and batch, and what was measured so far."""

    item: dict[str, Any]
    trainer: Any
    batch: tuple[Any, Any]
    probe: _Probe | None = None
    memory: dict[str, int] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    quiet: list[bool] = field(default_factory=list)
    optimizer_s: list[float] = field(default_factory=list)
    outside_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    stage_steps: list[dict[int, StageTimes]] = field(default_factory=list)
    other_cores: list[float] = field(default_factory=list)  # per block


def _build(item: dict[str, Any]) -> _Run:
    """Build this rank's stages from the plan's Layout, as the emitted script does, and measure the memory of a
    steady step: the first step leaves the state a steady step starts from; the peak is taken over the second.
    On a GPU the peak is torch.cuda.max_memory_allocated over the second step, less what was allocated before the
    trainer was built (the other configurations' trainers); the replica's batch is moved to the GPU first, as a
    data loader's would be."""
    import torch
    import torch.distributed as dist

    from pyplan import load_model
    from pyplan.plan import Plan
    from pyplan.profile.live import LiveMemory
    from pyplan.runtime.trainer import build_trainer, optimizer_factory, replica_slice

    layout = Plan.from_json(item["plan"]).layout
    spec = load_model(f"zoo:{item['config']['model']}")
    device = torch.device(item.get("device", "cpu"))
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated(device) if cuda else 0
    torch.manual_seed(0)
    trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", LR), device=device)
    batch = item["global_batch"]
    inputs, target = spec.example_inputs(batch), spec.target(batch)
    mine = replica_slice(layout, trainer.dp_rank)
    x, y = tuple(t[mine].to(device) for t in inputs), target[mine].to(device)
    dist.barrier()
    params = list({id(p): p for mod in trainer.modules for p in mod.parameters()}.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    if cuda:
        trainer.step(x, y)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        trainer.step(x, y)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        with LiveMemory() as mem:
            trainer.step(x, y)
            start = mem.mark()
            trainer.step(x, y)
            stop = mem.mark()
        # The replica's batch, made before the steps, is held by the first stage through each step (as a data
        # loader's batch would be); the plan counts it there.
        batch_bytes = sum(t.numel() * t.element_size() for t in x) if trainer.has_first else 0
        peak = param_bytes + batch_bytes + mem.peak_bytes_since(start, stop)
    state = trainer.optimizer.state.values()
    run = _Run(item, trainer, (x, y))
    run.memory = {
        "peak_bytes": peak,
        "param_bytes": param_bytes,
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer_state_bytes": sum(
            v.numel() * v.element_size() for s in state for v in s.values() if torch.is_tensor(v)
        ),
    }
    run.probe = _Probe(trainer)
    return run


def _time_block(run: _Run, protocol: Protocol) -> None:
    """One block of `protocol.warmup` untimed and `protocol.steps` timed steps, each after a barrier. Other
    processes' load over the timed steps is the machine's busy CPU time less both ranks' (every thread)."""
    import torch.distributed as dist

    assert run.probe is not None
    trainer, probe, (x, y) = run.trainer, run.probe, run.batch
    sync = probe.sync or (lambda: None)  # on a GPU a step ends when its kernels have
    for _ in range(protocol.warmup):
        dist.barrier()
        trainer.step(x, y)
    sync()
    dist.barrier()
    _Probe.active = probe
    busy0, cpu0, wall0 = _machine_busy_s(), time.process_time(), time.perf_counter()
    for _ in range(protocol.steps):
        dist.barrier()
        probe.reset()
        t0 = time.perf_counter()
        trainer.step(x, y)
        sync()
        step = time.perf_counter() - t0
        run.step_s.append(step)
        run.optimizer_s.append(probe.total(-1, "O"))
        run.outside_s.append(probe.outside_s(step))
        run.wait_s.append(probe.total(-1, "W"))
        run.finish_s.append(probe.total(-1, "G"))
        run.stage_steps.append(probe.stage_times(trainer.layout.dp))
    dist.barrier()
    _Probe.active = None
    wall, cpu, busy = time.perf_counter() - wall0, time.process_time() - cpu0, _machine_busy_s() - busy0
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (cpu, busy))
    others = max(0.0, gathered[0][1] - sum(c for c, _ in gathered)) / wall
    run.other_cores.append(others)
    run.quiet.extend([others <= protocol.quiet_cores] * protocol.steps)


def _wait_quiet(protocol: Protocol) -> float:
    """Wait (up to protocol.wait_s) until the machine has been quiet for a second; returns the seconds waited. Only
    rank 0 calls it; the other rank waits in the next barrier."""
    start = time.perf_counter()
    while time.perf_counter() - start < protocol.wait_s:
        busy0 = _machine_busy_s()
        time.sleep(1.0)
        if _machine_busy_s() - busy0 <= protocol.quiet_cores:
            break
    return time.perf_counter() - start


def _result(run: _Run) -> RankResult:
    # The quiet steps if there are enough of them (the rows say how many), else every step.
    keep = [i for i, q in enumerate(run.quiet) if q]
    if len(keep) < len(run.quiet) and len(keep) < 3:
        keep = list(range(len(run.quiet)))
    stages = {
        s: StageTimes(*(statistics.median(getattr(run.stage_steps[i][s], f) for i in keep) for f in _FIELDS))
        for s in run.stage_steps[0]
    }
    return RankResult(
        step_s=tuple(run.step_s),
        quiet=tuple(run.quiet),
        optimizer_s=statistics.median(run.optimizer_s[i] for i in keep),
        outside_s=statistics.median(run.outside_s[i] for i in keep),
        wait_s=statistics.median(run.wait_s[i] for i in keep),
        finish_s=statistics.median(run.finish_s[i] for i in keep),
        stages=stages,
        other_cores=tuple(run.other_cores),
        **run.memory,
    )


def _worker(job_path: str, out_path: str) -> None:
    """One rank: build every configuration, then time them in rounds, each round every configuration that still
    needs quiet blocks in turn (every other round in reverse order), so that a burst of load from other processes
    falls on all configurations alike."""
    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(float(os.environ.get("PYPLAN_HANG_S", "1800")), exit=True)
    job = json.loads(Path(job_path).read_text())
    cuda = any(i.get("device") == "cuda" for i in job["items"])
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    protocol = Protocol(**job["protocol"])
    runs: list[_Run] = []
    profiles: list[dict[int, float]] = []
    item: dict[str, Any] = {}
    try:
        if len({i["config"]["model"] for i in job["items"]}) != 1:
            raise ValueError("a launch runs one model's configurations")
        reprofile = _Reprofile(job["items"][0], [i["config"]["micro_batch_size"] for i in job["items"]])
        for item in job["items"]:
            runs.append(_build(item))
        # The matrix holds every configuration's trainer at once where a user's script holds one: frozen, their
        # objects do not lengthen the garbage collector's passes during the timed steps.
        gc.collect()
        gc.freeze()
        for round_ in range(protocol.max_rounds):
            pending = [r for r in runs if sum(c <= protocol.quiet_cores for c in r.other_cores) < protocol.quiet_blocks]
            if not pending:
                break
            if rank == 0:
                _wait_quiet(protocol)
            dist.barrier()
            profiles.append(reprofile())
            # Every other round in reverse: a configuration's place in the round (first after the wait, or
            # following a given other one) is not the same for all its blocks.
            for run in pending if round_ % 2 == 0 else pending[::-1]:
                item = run.item
                _time_block(run, protocol)
    except Exception:
        # The other rank may wait in a send or receive of the pipeline: record and stop the launch.
        Path(f"{out_path}.rank{rank}.error").write_text(f"{item.get('config')}\n{traceback.format_exc()}")
        os._exit(1)
    results = []
    for run in runs:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, asdict(_result(run)))
        results.append(gathered)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, profiles)
    if rank == 0:
        write_json(out_path, {"results": results, "profiles": [t for r in every for t in r]})
    dist.barrier()
    dist.destroy_process_group()
    # Meshes sometimes abort the process at exit after a clean shutdown (TORCH_FACTS.md); exit at once.
    os._exit(0)


def _plan_worker(job_path: str, out_path: str) -> None:
    """Plan one model's one-device matrix in a process of its own (where a GPU may be visible): with the given
    calibration file, or with a fresh `pyplan calibrate` of this device, which is copied to the job's `store`."""
    job = json.loads(Path(job_path).read_text())
    with calibration_dir(job["calibration"], job["quick"]) as used:
        case = job["case"]
        planned = plan_case(
            Case(case["model"], case["global_batch"], tuple(case["micro_batch_sizes"])), job["remats"], processes=1
        )
        if job["calibration"] is None:
            shutil.copyfile(used, job["store"])
    write_json(out_path, [asdict(p) for p in planned])


def plan_one_device(
    case: Case,
    remats: Sequence[str],
    device: str,
    calibration: str | None,
    store: Path,
    *,
    quick: bool = False,
    timeout_s: float = 3600,
) -> list[Planned]:
    """The one-device matrix of one model, planned in a process of its own (`_plan_worker`) on `device`; without
    a `calibration` file, that process calibrates the device first and leaves the file at `store`."""
    with tempfile.TemporaryDirectory(prefix="pyplan-accuracy-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(
            json.dumps(
                {
                    "case": asdict(case),
                    "remats": list(remats),
                    "calibration": calibration,
                    "store": str(store),
                    "quick": quick,
                }
            )
        )
        done = subprocess.run(
            [sys.executable, __file__, "--plan-worker", str(job), str(out)],
            env=_device_env(device),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"planning {case.model} on one {device} failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        planned = [Planned.from_dict(d) for d in json.loads(out.read_text())]
    wrong = {p.device for p in planned} - {device}
    if wrong:
        raise RuntimeError(f"{case.model} was planned on {sorted(wrong)}, not {device}: is the device visible?")
    return planned


# Where main() keeps the CUDA_VISIBLE_DEVICES it replaced (_UNSET: there was none), for the one-cuda processes.
_VISIBLE_KEY, _UNSET = "PYPLAN_ACCURACY_CUDA_VISIBLE_DEVICES", "<unset>"


def _device_env(device: str) -> dict[str, str]:
    """The environment of a process that profiles or runs on `device`: on "cuda", the GPUs main() hid from the
    CPU matrices (its own process measures on the CPU) are visible again."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cuda" and _VISIBLE_KEY in env:
        visible = env.pop(_VISIBLE_KEY)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if visible != _UNSET:
            env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def run_matrix(
    planned: Sequence[Planned], protocol: Protocol, *, timeout_s: float = 3600
) -> tuple[list[list[dict]], list[dict[str, float]]]:
    """Every planned configuration (of one model) in one torchrun launch of as many ranks as the plans have GPUs,
    timed following `protocol`; per configuration, each rank's RankResult as a dict; and the model's blocks timed
    again by each rank at the start of each round (`_Reprofile`: micro-batch size, as a string, to seconds)."""
    from pyplan.plan import Plan

    sizes = {Plan.from_json(p.plan).layout.num_gpus for p in planned}
    devices = {p.device for p in planned}
    if len(sizes) != 1 or len(devices) != 1:
        raise ValueError(f"a launch runs plans of one size on one device, got {sorted(sizes)} on {sorted(devices)}")
    with tempfile.TemporaryDirectory(prefix="pyplan-accuracy-") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        items = [{**asdict(p), "config": asdict(p.config)} for p in planned]
        job.write_text(json.dumps({"items": items, "protocol": asdict(protocol)}))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(sizes.pop()),
                __file__,
                "--worker",
                str(job),
                str(out),
            ],
            env=_device_env(devices.pop()),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        errors = sorted(Path(tmp).glob("out.json.rank*.error"))
        if errors:
            raise RuntimeError(f"a configuration failed:\n{errors[0].read_text()}")
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the torchrun launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        data = json.loads(out.read_text())
        return data["results"], data["profiles"]


def merge_launches(launches: Sequence[list[list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    """Per configuration and rank, the RankResults (as dicts) of several launches of the same plans as one: the
    steps, their quietness and the blocks' other load one after the other; the medians (optimizer, framework,
    waits, stage times) averaged over the launches; memory, the same tensor bytes in every launch, the most."""
    if not launches:
        raise ValueError("no launch to merge")

    def one(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        out = dict(parts[0])
        for key in ("step_s", "quiet", "other_cores"):
            out[key] = [x for p in parts for x in p[key]]
        for key in ("optimizer_s", "outside_s", "wait_s", "finish_s"):
            out[key] = statistics.fmean(p[key] for p in parts)
        for key in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes"):
            out[key] = max(p[key] for p in parts)
        out["stages"] = {
            s: {f: statistics.fmean(p["stages"][s][f] for p in parts) for f in _FIELDS} for s in parts[0]["stages"]
        }
        return out

    return [
        [one([launch[c][r] for launch in launches]) for r in range(len(launches[0][c]))]
        for c in range(len(launches[0]))
    ]


# --- Analysis -------------------------------------------------------------------------------------------------


def _stage_times(data: dict[str, Any]) -> dict[int, StageTimes]:
    return {int(s): StageTimes(**t) for s, t in data.items()}


def analyse(planned: Planned, ranks: Sequence[dict[str, Any]], reprofiled: Sequence[float] = ()) -> Row:
    """The row of one configuration from its plan and every rank's measurement (and the blocks timed again during
    the runs at its micro-batch size, `reprofiled`)."""
    from pyplan.plan import Plan
    from pyplan.solve.schedules import simulate

    plan = Plan.from_json(planned.plan)
    lay, pred = plan.layout, plan.predicted
    m = lay.num_microbatches
    per_step = [max(t) for t in zip(*(r["step_s"] for r in ranks))]
    quiet = [t for t, q in zip(per_step, ranks[0]["quiet"]) if q]
    measured_s = statistics.median(quiet if len(quiet) >= 3 else per_step)
    stages: dict[int, StageTimes] = {}
    for r in ranks:
        stages.update(_stage_times(r["stages"]))
    n = len(plan.stages)

    # Per micro-batch stage times: predicted; measured in CPU time and in wall time; recompute apart; framework
    # overhead (the stage's, and its rank's outside the chunks, shared by the rank's stages) split between F and B.
    f_pred = [st.forward_s for st in plan.stages]
    b_pred = [st.backward_s for st in plan.stages]
    # The blocks checkpoints run again in the backward (the rest of recompute_s is the checkpoints' calls and hooks,
    # in forward_s and backward_s where they run).
    r_pred = [st.recompute_s - st.checkpoint_s for st in plan.stages]
    t = [stages[s] for s in range(n)]
    per_rank = [sum(1 for r in planned.stage_rank if r == k) for k in range(lay.pp)]
    outside = [ranks[planned.stage_rank[s]]["outside_s"] / per_rank[planned.stage_rank[s]] for s in range(n)]
    f_cpu = [x.forward_cpu_s / m for x in t]
    f_wall = [x.forward_s / m for x in t]
    b_cpu_less = [(x.backward_cpu_s - x.recompute_cpu_s) / m for x in t]
    b_wall_less = [(x.backward_s - x.recompute_s) / m for x in t]
    b_wall = [x.backward_s / m for x in t]
    r_cpu = [x.recompute_cpu_s / m for x in t]
    half_fw = [(x.overhead_s + o) / (2 * m) for x, o in zip(t, outside)]

    def makespan(f: list[float], b: list[float]) -> float:
        sends = list(planned.send_s) or 0.0
        sim = simulate(
            lay.schedule,
            f,
            b,
            num_microbatches=m,
            stages_per_rank=lay.stages_per_rank,
            send_forward_s=sends,
            send_backward_s=sends,
        )
        return sim.makespan_s

    # The prediction without its host costs: what the profiled compute alone gives.
    f_model = [x - h[0] for x, h in zip(f_pred, planned.host_s)]
    b_model = [x - h[1] for x, h in zip(b_pred, planned.host_s)]
    pipeline_model = makespan(f_model, b_model)
    framework_pred = pred.pipeline_s - pipeline_model + pred.host_step_s
    sim_wall = makespan(f_wall, b_wall)
    sim_cpu = makespan(f_cpu, [x + r for x, r in zip(b_cpu_less, r_pred)])
    sim_wall_less = makespan(f_wall, [x + r for x, r in zip(b_wall_less, r_pred)])
    sim_fw = makespan([x + h for x, h in zip(f_wall, half_fw)], [x + h for x, h in zip(b_wall, half_fw)])
    optimizer_meas = max(r["optimizer_s"] for r in ranks)
    # DDP's wait in the last backward, plus the tied parameters' all-reduce after the schedule: the rank that
    # reaches it last waits the least, so its time is the all-reduce's.
    ddp_sync = max(sum(x.backward_sync_s for x in _stage_times(r["stages"]).values()) for r in ranks)
    sync_meas = ddp_sync + min(r["finish_s"] for r in ranks)
    busiest = max(range(n), key=lambda s: f_pred[s] + b_pred[s])
    terms = Terms(
        compute_s=sim_cpu - pipeline_model,
        contention_s=sim_wall_less - sim_cpu,
        recompute_s=sim_wall - sim_wall_less,
        framework_s=sim_fw - sim_wall - framework_pred,
        optimizer_s=optimizer_meas - pred.optimizer_s,
        sync_s=sync_meas - pred.exposed_comm_s,
        rest_s=measured_s - sim_fw - optimizer_meas - sync_meas,
        rest_name="other" if lay.pp == 1 else "p2p",
        forward_err=f_cpu[busiest] / f_model[busiest] - 1,
        backward_err=b_cpu_less[busiest] / (b_model[busiest] - r_pred[busiest]) - 1,
        recompute_cpu_s=r_cpu[busiest],
        recompute_pred_s=r_pred[busiest],
        other_cores=statistics.median(ranks[0]["other_cores"]),
        stage_overhead_s=t[busiest].overhead_s / m,
        outside_s=max(r["outside_s"] for r in ranks),
    )

    # Memory of each rank: predicted (its stages' state + activations) against measured.
    pred_rank = [0.0] * lay.pp
    act_rank = [0.0] * lay.pp
    for s, st in enumerate(plan.stages):
        pred_rank[planned.stage_rank[s]] += st.memory_bytes
        act_rank[planned.stage_rank[s]] += st.activation_bytes
    measured = [r["peak_bytes"] for r in ranks[: lay.pp]]  # one replica: dp ranks hold the same
    # Activations: the peak less weights, gradients and optimizer state (all live at the peak or counted so).
    state = [r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"] for r in ranks[: lay.pp]]
    top = max(range(lay.pp), key=lambda k: measured[k])
    return Row(
        config=planned.config,
        predicted_s=pred.iteration_s,
        measured_s=measured_s,
        all_steps_s=statistics.median(per_step),
        quiet_steps=len(quiet),
        steps=len(per_step),
        predicted_bytes=pred.peak_memory_bytes,
        measured_bytes=max(r["peak_bytes"] for r in ranks),
        predicted_activation_bytes=act_rank[top],
        measured_activation_bytes=measured[top] - state[top],
        terms=terms,
        rank_bytes_error=tuple(pred_rank[k] - measured[k] for k in range(lay.pp)),
        step_s=tuple(per_step),
        step_quiet=tuple(ranks[0]["quiet"]),
        profiled_s=planned.profiled_s,
        reprofiled_s=tuple(reprofiled),
    )


def decisions(rows: Sequence[Row]) -> list[Decision]:
    """Per search (model x remat policy) and per model: the configuration ranked first by predicted time against
    the measured fastest."""
    from pyplan.planner import rank_ties

    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(f"{r.config.model} remat={r.config.remat}", []).append(r)
        groups.setdefault(f"{r.config.model} (all)", []).append(r)
    out = []
    for name, members in groups.items():
        if len(members) < 2:
            continue
        # As pyplan ranks plans (pyplan.planner.rank_ties): predicted times within 0.1 % are a tie, less memory
        # first.
        chosen = rank_ties(members, lambda r: r.predicted_s, lambda r: (r.predicted_bytes,))[0]
        fastest = min(members, key=lambda r: r.measured_s)
        slower = chosen.measured_s / fastest.measured_s - 1
        out.append(Decision(name, chosen.config.label, fastest.config.label, slower))
    return out


def summarize(
    rows: Sequence[Row], drift: dict[str, float] | None = None, attempts: dict[str, int] | None = None
) -> Summary:
    time_err = [abs(r.time_error) for r in rows]
    mem_err = [abs(r.memory_error) for r in rows]
    found = decisions(rows)
    summary = Summary(
        time_median=statistics.median(time_err),
        time_worst=max(time_err),
        memory_median=statistics.median(mem_err),
        memory_worst=max(mem_err),
        decisions=tuple(found),
        drift=dict(drift or {}),
        attempts=dict(attempts or {}),
    )
    summary.targets.update(
        {
            f"median |time error| <= {TARGET_TIME_MEDIAN:.0%}": summary.time_median <= TARGET_TIME_MEDIAN,
            f"worst |time error| <= {TARGET_TIME_WORST:.0%}": summary.time_worst <= TARGET_TIME_WORST,
            f"worst |peak memory error| <= {TARGET_MEMORY:.0%}": summary.memory_worst <= TARGET_MEMORY,
            f"right recommendation >= {TARGET_RIGHT:.0%}": bool(found) and summary.right_rate >= TARGET_RIGHT,
        }
    )
    return summary


# --- Printing -------------------------------------------------------------------------------------------------


def print_report(rows: Sequence[Row], summary: Summary, *, header: str) -> None:
    from rich.console import Console

    from pyplan.units import fmt_bytes

    console = Console(width=200)
    # A configuration's columns, the same in the time and memory tables; its names and choices left-justified.
    config = ("model", "dp x pp", "schedule", "b x m", "remat")
    config_left = ("model", "schedule", "remat")

    def config_cells(c: Config) -> list[str]:
        return [c.model, f"{c.dp}x{c.pp}", c.schedule, f"{c.micro_batch_size}x{c.num_microbatches}", c.remat]

    times = new_table(
        f"Iteration time, predicted against measured; {header}",
        (*config, "predicted", "measured", "error", "all steps", "quiet steps", "other cores"),
        left=config_left,
    )
    for r in rows:
        times.add_row(
            *config_cells(r.config),
            f"{r.predicted_s * 1e3:.1f} ms",
            f"{r.measured_s * 1e3:.1f} ms",
            f"{r.time_error:+.1%}",
            f"{r.all_steps_s * 1e3:.1f} ms",
            f"{r.quiet_steps}/{r.steps}",
            f"{r.terms.other_cores:.2f}",
        )
    console.print(times)

    memory = new_table(
        "Peak memory of the fullest rank (weights, gradients, AdamW state, activations, buffers)",
        (*config, "predicted", "measured", "error", "act. predicted", "act. measured", "plan - measured per rank"),
        left=config_left,
    )
    for r in rows:
        memory.add_row(
            *config_cells(r.config),
            fmt_bytes(r.predicted_bytes),
            fmt_bytes(r.measured_bytes),
            f"{r.memory_error:+.1%}",
            fmt_bytes(r.predicted_activation_bytes),
            fmt_bytes(r.measured_activation_bytes),
            ", ".join(("+" if d >= 0 else "-") + fmt_bytes(abs(d)) for d in r.rank_bytes_error),
        )
    console.print(memory)

    diag = new_table(
        "Diagnosis: measured minus predicted iteration time by term, % of the measured time",
        ("configuration", "T err", "terms"),
        left=("configuration", "terms"),
    )
    for r in rows:
        diag.add_row(r.config.label, f"{r.time_error:+.1%}", r.terms.describe(r.measured_s, r.time_error))
    console.print(diag)

    ranks = new_table(
        f"Recommendations (right: the plan ranked first is within {WITHIN:.0%} of the fastest)",
        ("decision", "ranked first", "measured fastest", "slower by", "right"),
        left=("decision", "ranked first", "measured fastest", "right"),
    )
    for d in summary.decisions:
        ranks.add_row(d.group, d.chosen, d.fastest, f"{d.slower_by:+.1%}", "yes" if d.right else "NO")
    console.print(ranks)

    right = sum(d.right for d in summary.decisions)
    console.print(
        f"iteration time |error|: median {summary.time_median:.1%}, worst {summary.time_worst:.1%}; "
        f"peak memory |error|: median {summary.memory_median:.1%}, worst {summary.memory_worst:.1%}; "
        f"right recommendation {right}/{len(summary.decisions)} ({summary.right_rate:.0%})"
    )
    for model, drift in summary.drift.items():
        tries = summary.attempts.get(model, 1)
        console.print(
            f"{model}: blocks timed during the runs against the plans' profile {drift:+.1%} (the micro-batch "
            f"size farthest off), attempt "
            f"{tries} of at most {ATTEMPTS}"
            + (
                f" (WARNING: beyond {DRIFT:.0%}: its errors hold the machine's drift, run again)"
                if abs(drift) > DRIFT
                else ""
            )
        )
    for name, met in summary.targets.items():
        console.print(target_line(name, met))


def run(
    cases: Sequence[Case] = CASES,
    *,
    remats: Sequence[str] = REMATS,
    protocol: Protocol = Protocol(),
    calibration: str | None = None,
    quick_calibration: bool = False,
    keep: Callable[[Config], bool] = lambda c: True,
    attempts: int = ATTEMPTS,
    matrix: str = "ranks",
) -> tuple[list[Row], Summary]:
    """Calibrate (or use `calibration`), then per model: profile and plan, and run at once; a model whose blocks
    ran more than DRIFT slower or faster during the runs than when profiled is planned and run again, up to
    `attempts` times (the attempt with the least drift is kept). Returns the rows and the summary.

    `matrix` (a key of MATRICES): "ranks" plans in this process and runs 2 ranks; "one-cpu" and "one-cuda" plan
    and run one process on one device, each in a process of its own, so that a GPU this process does not see
    (main() hides it from the CPU matrices) is seen there. On a GPU, that process calibrates it, unless given a
    `calibration` file."""
    processes, device, _ = MATRICES[matrix]
    rows: list[Row] = []
    drift: dict[str, float] = {}
    tries: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pyplan-accuracy-"))
        store = Path(tmp) / "calibration.json"
        used: str | None = calibration
        if device == "cpu":
            used = stack.enter_context(calibration_dir(calibration, quick_calibration))
        for case in cases:
            best: tuple[float, list[Row]] | None = None
            for attempt in range(1, max(1, attempts) + 1):
                if processes == 2:
                    planned = plan_case(case, remats, keep)
                else:
                    found = plan_one_device(case, remats, device, used, store, quick=quick_calibration)
                    planned = [p for p in found if keep(p.config)]
                    used = used or str(store)
                if not planned:
                    break
                launched = [run_matrix(planned, protocol) for _ in range(max(1, protocol.launches))]
                results = merge_launches([r for r, _ in launched])
                profiles = [t for _, p in launched for t in p]
                off = model_drift(planned, profiles)
                if best is None or abs(off) < abs(best[0]):
                    best = (
                        off,
                        [
                            analyse(p, ranks, [t[str(p.config.micro_batch_size)] for t in profiles])
                            for p, ranks in zip(planned, results)
                        ],
                    )
                    drift[case.model], tries[case.model] = off, attempt
                if abs(off) <= DRIFT:
                    break
            if best is not None:
                rows += best[1]
    return rows, summarize(rows, drift, tries)


def _gpu_name() -> str | None:
    """The name of the GPU a process started now would use, or None: asked in a process of its own, so that this
    one never initializes CUDA (main() hides the GPU from it and its children afterwards)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')",
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"could not ask torch for a GPU:\n{done.stderr[-2000:]}")
    return done.stdout.strip() or None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    models = sorted({c.model for _, _, cases in MATRICES.values() for c in cases})
    parser.add_argument("--models", nargs="+", choices=models, help="default: all of each matrix")
    parser.add_argument(
        "--matrices",
        nargs="+",
        choices=list(MATRICES),
        help="ranks: dp x pp on 2 CPU processes; one-cpu: remat and micro-batch/GA on one CPU process; one-cuda: "
        "the same on one GPU (default: ranks, and one-cuda where a GPU is present)",
    )
    default = Protocol()
    parser.add_argument("--steps", type=int, default=default.steps, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed steps before each block")
    parser.add_argument(
        "--quiet-blocks", type=int, default=default.quiet_blocks, help="quiet blocks wanted per configuration"
    )
    parser.add_argument("--max-rounds", type=int, default=default.max_rounds)
    parser.add_argument(
        "--launches", type=int, default=default.launches, help="torchrun launches of the same plans per model"
    )
    parser.add_argument(
        "--quiet-cores",
        type=float,
        default=default.quiet_cores,
        help="a block is quiet when other processes used at most this many cores",
    )
    parser.add_argument(
        "--wait", type=float, default=default.wait_s, help="seconds to wait for a quiet machine before each round"
    )
    parser.add_argument(
        "--attempts",
        type=int,
        default=ATTEMPTS,
        help=f"attempts per model (each planned afresh) while its blocks run over {DRIFT * 100:.0f}%% off profile",
    )
    parser.add_argument(
        "--calibration", metavar="FILE", help="a calibration file of the matrices' device, instead of calibrating it"
    )
    parser.add_argument("--quick-calibration", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and summary here")
    args = parser.parse_args(argv)
    gpu = _gpu_name()
    matrices = args.matrices or (["ranks", "one-cuda"] if gpu else ["ranks"])
    if "one-cuda" in matrices and gpu is None:
        parser.error("the one-cuda matrix needs a GPU, and torch sees none")
    # This process plans the CPU matrices and measures on the CPU: the GPU is hidden from it and from their ranks
    # (CUDA reads the variable when first used, and this process has not used it); the one-cuda matrix's
    # processes see it again (_device_env).
    os.environ[_VISIBLE_KEY] = os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    protocol = Protocol(
        steps=args.steps,
        warmup=args.warmup,
        quiet_blocks=args.quiet_blocks,
        max_rounds=args.max_rounds,
        quiet_cores=args.quiet_cores,
        wait_s=args.wait,
        launches=args.launches,
    )
    import torch

    report: dict[str, Any] = {}
    met = True
    for name in matrices:
        processes, device, table = MATRICES[name]
        cases = [c for c in table if not args.models or c.model in args.models]
        if not cases:
            continue
        start = time.perf_counter()
        rows, summary = run(
            cases,
            protocol=protocol,
            calibration=args.calibration,
            quick_calibration=args.quick_calibration,
            attempts=args.attempts,
            matrix=name,
        )
        where = (
            "2 ranks x 1 thread, gloo"
            if processes == 2
            else ("1 process x 1 thread, CPU" if device == "cpu" else f"1 process, {gpu}")
        )
        header = (
            f"{name}: {where}, torch {torch.__version__}, blocks of {args.warmup} + {args.steps} steps, "
            f"{args.launches} launches, medians over quiet steps ({time.perf_counter() - start:.0f} s)"
        )
        print_report(rows, summary, header=header)
        report[name] = {"rows": [asdict(r) for r in rows], "summary": asdict(summary)}
        met = met and all(summary.targets.values())
    if args.json:
        write_json(args.json, {"matrices": report})
    return 0 if met else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "--plan-worker":
        _plan_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
