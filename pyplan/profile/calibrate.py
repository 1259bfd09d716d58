"""`pyplan calibrate`: measure the local device's peaks, per-op-class efficiencies, launch cost and local link."""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

from pyplan._files import write_atomic
from pyplan._torch import OpRecorder, torch_threads
from pyplan.errors import PlanError
from pyplan.hardware.catalog import _detect_local, local_calibration_path
from pyplan.profile._procs import run_two
from pyplan.profile.analytic import ALLOCATIONS, OP_CLASSES, Efficiency, OpCost, OpEfficiency, Roofline, op_class
from pyplan.profile.host import HostCosts, measure_host_costs
from pyplan.runtime.affinity import pin_rank
from pyplan.runtime.heap import keep_freed_memory
from pyplan.units import fmt_bandwidth, fmt_bytes, fmt_count, fmt_seconds

__all__ = [
    "AlphaBeta",
    "Calibration",
    "CalibrationOptions",
    "LinkMeasurement",
    "MatmulPeak",
    "OpSample",
    "calibrate",
    "class_efficiency",
    "fit_alpha_beta",
    "fit_op",
    "measure_link",
    "op_efficiency",
    "render_calibration",
    "write_calibration",
]

# What is measured, and how the analytic model uses it (pyplan/profile/analytic.py):
#   peak FLOP/s per dtype   the best throughput of square matmuls of doubling size: the roofline's compute roof;
#   memory bandwidth        the better of a large copy and a large add (bytes read + written): its memory roof;
#   launch_s                seconds per aten op of a chain of tiny ops run forward and backward under autograd:
#                           what an op costs beyond its roofline (dispatch, autograd, kernel launch);
#   per aten op             representative programs of one op each (matmul, convolution, norms, elementwise,
#                           attention; forward and backward) at a small and a large size, fitted to
#                           t = latency + roofline time at full efficiency / efficiency (Hockney's model);
#   per op class            Σ roofline time / Σ (measured time − launches) over the class's large programs:
#                           the achieved fraction of the roofline for ops that were not timed themselves;
#   link                    one-way point-to-point and all-reduce times between two local processes over
#                           several message sizes, each fitted to t = latency + bytes / bandwidth (α-β); the
#                           all-reduce's fit gives the link's collective α-β (a 2-rank ring: 2α + G/BW);
#   host (CPU only)         the runtime's own costs per micro-batch and stage, per message, per step, and each
#                           optimizer's per tensor and per element (pyplan/profile/host.py).
# Every device figure is the best of several rounds; one efficiency is applied to both roofs.


@dataclass(frozen=True)
class CalibrationOptions:
    """`threads`: CPU threads per process (fixed, as `pyplan inspect` times); `quick`: smaller sizes and fewer
    repeats (about 15 s on a 2-core CPU); `link`: also measure the link between two local processes."""

    threads: int = 1
    quick: bool = False
    link: bool = True
    link_timeout_s: float = 180.0


@dataclass(frozen=True)
class MatmulPeak:
    """The best matmul throughput in one dtype, and the n of the n×n×n product that reached it."""

    dtype: str
    flops_per_s: float
    size: int


@dataclass(frozen=True)
class OpSample:
    """One timed representative program: its op class, the one aten op it runs (None if several), whether it is
    at the large of the two scales, the count and roofline time at full efficiency of its ops, and the measured
    time (the least of the rounds)."""

    name: str
    op_class: str
    op: str | None
    large: bool
    n_ops: int
    roofline_s: float
    time_s: float


@dataclass(frozen=True)
class AlphaBeta:
    """A fit of transfer time to `latency_s + bytes / bw_bytes_per_s`."""

    latency_s: float
    bw_bytes_per_s: float

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bw_bytes_per_s


@dataclass(frozen=True)
class LinkMeasurement:
    """Point-to-point (one way, half a ping-pong) and all-reduce times between two local processes."""

    backend: str
    sizes_bytes: tuple[int, ...]
    p2p_time_s: tuple[float, ...]
    allreduce_time_s: tuple[float, ...]
    p2p: AlphaBeta
    allreduce: AlphaBeta
    # (max - min) / median of each fitted figure over the repeated passes (`spread`), e.g. "send latency"
    spread: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    """Everything `pyplan calibrate` measured on one device; `to_json` is the calibration file."""

    device: str
    device_type: str
    threads: int | None
    peaks: tuple[MatmulPeak, ...]
    copy_bw_bytes_per_s: float
    add_bw_bytes_per_s: float
    launch_s: float
    samples: tuple[OpSample, ...]
    efficiency: Efficiency
    link: LinkMeasurement | None
    elapsed_s: float
    host: HostCosts | None = None
    # (max - min) / median of each device figure over the rounds that measured it (`spread`); the link's are its own
    spread: dict[str, float] = field(default_factory=dict)
    torch_version: str = torch.__version__
    measured_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    @property
    def mem_bw_bytes_per_s(self) -> float:
        return max(self.copy_bw_bytes_per_s, self.add_bw_bytes_per_s)

    @property
    def peak_flops_per_s(self) -> dict[str, float]:
        return {p.dtype: p.flops_per_s for p in self.peaks}

    def to_json(self) -> dict[str, Any]:
        """The calibration file: "device", "gpu" and "link" as the catalog reads them (see
        `local_calibration_path`), "efficiency" as `Efficiency.from_json` reads it, and "measured" for people."""
        threads = f", {self.threads} thread(s) per process" if self.threads else ""
        gpu: dict[str, Any] = {
            "peak_flops_per_s": self.peak_flops_per_s,
            "hbm_bw_bytes_per_s": self.mem_bw_bytes_per_s,
            "source": f"pyplan calibrate {self.measured_at}: matmul peaks, copy/add bandwidth{threads}",
        }
        if self.threads:
            gpu["cpu_threads"] = self.threads
        data: dict[str, Any] = {"device": self.device, "gpu": gpu, "efficiency": self.efficiency.to_json()}
        if self.link is not None:
            # A ring all-reduce over 2 ranks takes 2 steps: 2(α + G/(2·BW)) = 2α + G/BW.
            data["link"] = {
                "latency_s": self.link.p2p.latency_s,
                "bw_bytes_per_s": self.link.p2p.bw_bytes_per_s,
                "collective_latency_s": self.link.allreduce.latency_s / 2,
                "collective_bw_bytes_per_s": self.link.allreduce.bw_bytes_per_s,
                "source": f"pyplan calibrate {self.measured_at}: {self.link.backend} send/recv between 2 processes, "
                f"α-β fit over {len(self.link.sizes_bytes)} sizes",
            }
        if self.host is not None:
            data["host"] = self.host.to_json()
        data["measured"] = {
            "torch": self.torch_version,
            "device_type": self.device_type,
            "threads": self.threads,
            "elapsed_s": self.elapsed_s,
            "matmul": [asdict(p) for p in self.peaks],
            "copy_bw_bytes_per_s": self.copy_bw_bytes_per_s,
            "add_bw_bytes_per_s": self.add_bw_bytes_per_s,
            "launch_s": self.launch_s,
            "ops": [asdict(s) for s in self.samples],
            "link": None if self.link is None else asdict(self.link),
            "spread": self.spread,
        }
        return data

    def unstable(self) -> list[str]:
        """One line for each figure that moved more than UNSTABLE between the repeats that measured it."""
        figures = {**self.spread, **(self.link.spread if self.link is not None else {})}
        return [
            f"warning: {name} moved {value:.0%} between repeats (more than {UNSTABLE:.0%}): something else ran on "
            "the machine; calibrate again when it is quiet"
            for name, value in sorted(figures.items())
            if value > UNSTABLE
        ]


# --- Fitting (pure) ---------------------------------------------------------------------------------------

# A figure whose repeats differ by more than this share of their median is reported as unstable.
UNSTABLE = 0.2


def spread(values: Sequence[float]) -> float:
    """(max − min) / median of repeated measurements of one figure: 0 for one value, or when all are 0."""
    mid = statistics.median(values) if values else 0.0
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of `t = α + n/β` in relative error (each point weighted by 1/t²), so that the
    microsecond latencies of small messages count as much as the milliseconds of large ones. α is clipped at 0."""
    if len(sizes_bytes) != len(times_s) or len(set(sizes_bytes)) < 2:
        raise PlanError(f"an α-β fit needs two or more distinct sizes, got {list(sizes_bytes)}")
    if any(t <= 0 for t in times_s):
        raise PlanError(f"an α-β fit needs positive times, got {list(times_s)}")
    # Weighted normal equations for t = a + b·n with weights w = 1/t².
    w = [1.0 / t**2 for t in times_s]
    sw = sum(w)
    sn = sum(wi * n for wi, n in zip(w, sizes_bytes))
    snn = sum(wi * n * n for wi, n in zip(w, sizes_bytes))
    st = sum(wi * t for wi, t in zip(w, times_s))
    snt = sum(wi * n * t for wi, n, t in zip(w, sizes_bytes, times_s))
    det = sw * snn - sn * sn
    a = (snn * st - sn * snt) / det
    b = (sw * snt - sn * st) / det
    if a < 0:  # no latency: refit through the origin
        a, b = 0.0, snt / snn
    if b <= 0:
        raise PlanError(f"transfer times do not grow with size ({list(times_s)} s for {list(sizes_bytes)} B)")
    return AlphaBeta(latency_s=a, bw_bytes_per_s=1.0 / b)


def _fraction(samples: Sequence[OpSample], launch_s: float) -> float | None:
    # A program whose time is (nearly) all launches says nothing about its roofline: left out.
    useful = [x for x in samples if x.time_s - x.n_ops * launch_s > 0.1 * x.time_s]
    if not useful:
        return None
    return sum(x.roofline_s for x in useful) / sum(x.time_s - x.n_ops * launch_s for x in useful)


def class_efficiency(samples: Sequence[OpSample], launch_s: float) -> dict[str, float]:
    """Per op class, over its large programs: Σ roofline time at full efficiency / Σ (measured time − launch_s
    per op). What an op that calibration did not time gets."""
    found = {cls: _fraction([x for x in samples if x.op_class == cls and x.large], launch_s) for cls in OP_CLASSES}
    return {cls: f for cls, f in found.items() if f is not None}


def fit_op(samples: Sequence[OpSample], launch_s: float) -> OpEfficiency:
    """Fit the programs of one aten op to `time = n_ops · latency + roofline / efficiency` (Hockney's model of a
    kernel: a fixed cost, then the roofline rate) by least squares, so the large programs set the rate and the
    small ones the fixed cost. The latency is at least `launch_s`: a small program faster than that (its operands
    in cache, beating the memory roof) leaves the latency at `launch_s` and the rate to the large programs."""
    if len({x.roofline_s for x in samples}) < 2:
        fraction = _fraction(samples, launch_s)
        if fraction is None:
            raise PlanError(f"op programs {[x.name for x in samples]} are all launch overhead")
        return OpEfficiency(efficiency=fraction, latency_s=launch_s)
    # Normal equations for t = n·λ + r·μ, μ = 1/efficiency.
    snn = sum(x.n_ops**2 for x in samples)
    snr = sum(x.n_ops * x.roofline_s for x in samples)
    srr = sum(x.roofline_s**2 for x in samples)
    snt = sum(x.n_ops * x.time_s for x in samples)
    srt = sum(x.roofline_s * x.time_s for x in samples)
    det = snn * srr - snr * snr
    latency, mu = (srr * snt - snr * srt) / det, (snn * srt - snr * snt) / det
    if latency < launch_s or mu <= 0:
        latency = launch_s
        mu = sum(x.roofline_s * (x.time_s - x.n_ops * latency) for x in samples) / srr
    if mu <= 0:
        raise PlanError(f"op programs {[x.name for x in samples]} are all launch overhead")
    return OpEfficiency(efficiency=1.0 / mu, latency_s=latency)


def op_efficiency(samples: Sequence[OpSample], launch_s: float) -> dict[str, OpEfficiency]:
    """`fit_op` for every aten op that some program runs alone."""
    return {op: fit_op([x for x in samples if x.op == op], launch_s) for op in sorted({x.op for x in samples if x.op})}


# --- Timing -----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class _Clock:
    """Seconds to time with. On a CPU with one thread: the calling thread's CPU time, which torch's work runs in
    and which other processes' load does not inflate (on a 2-core machine running tests beside the calibration,
    wall-clock times grow several-fold). Otherwise wall time, synchronized with the GPU."""

    device: torch.device
    threads: int

    def now(self) -> float:
        _sync(self.device)
        return time.thread_time() if self.device.type == "cpu" and self.threads == 1 else time.perf_counter()


def _time(fn: Callable[[], object], clock: _Clock, *, min_time_s: float, max_call_s: float = math.inf) -> float:
    """Seconds of one call of `fn`, the least of several samples: calls batched so each sample lasts ≥ 0.5 ms,
    samples until `min_time_s` of wall time has passed (at least 3). The least, not the median: other processes
    only ever add time, and a calibration describes the device, not its neighbours. A warm-up call longer than
    `max_call_s` is taken as the answer, to bound slow dtypes."""
    t0 = clock.now()
    fn()
    first = clock.now() - t0
    if first > max_call_s:
        return first
    per_sample = max(1, math.ceil(5e-4 / max(first, 1e-7)))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_time_s and len(samples) < 1000):
        t0 = clock.now()
        for _ in range(per_sample):
            fn()
        samples.append((clock.now() - t0) / per_sample)
    return min(samples)


_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _dtypes(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["fp32", "bf16", "fp16"]
    major, _ = torch.cuda.get_device_capability(device)
    found = ["fp32"] + (["tf32"] if major >= 8 else [])
    return found + (["bf16"] if torch.cuda.is_bf16_supported() else []) + ["fp16"]


@contextlib.contextmanager
def _tf32(on: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _matmul_peaks(clock: _Clock, quick: bool, min_time_s: float) -> list[MatmulPeak]:
    """Square matmuls of doubling n per dtype, up to the largest size or until the next product would take
    longer than the cap (a CPU without bf16 kernels runs bf16 fifty times slower than fp32: measured, not
    assumed)."""
    device = clock.device
    if device.type == "cuda":
        sizes = (1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192)
    else:
        sizes = (256, 512) if quick else (256, 512, 1024, 2048)
    cap_s = 0.05
    peaks = []
    for key in _dtypes(device):
        best = MatmulPeak(key, 0.0, 0)
        with _tf32(key == "tf32") if device.type == "cuda" else contextlib.nullcontext():
            for n in sizes:
                a = torch.randn(n, n, device=device, dtype=_TORCH_DTYPES[key])
                b = torch.randn(n, n, device=device, dtype=_TORCH_DTYPES[key])
                t = _time(lambda a=a, b=b: torch.mm(a, b), clock, min_time_s=min_time_s, max_call_s=cap_s)
                if 2 * n**3 / t > best.flops_per_s:
                    best = MatmulPeak(key, 2 * n**3 / t, n)
                if t * 8 > cap_s:  # the next size, twice n, would take eight times as long
                    break
        peaks.append(best)
    return peaks


def _bandwidth(clock: _Clock, quick: bool, min_time_s: float) -> tuple[float, float]:
    """Bytes per second of a large copy (read + write) and a large add (two reads + a write), into preallocated
    outputs, each far larger than the caches."""
    device = clock.device
    nbytes = (256 if quick else 1024) * 2**20 if device.type == "cuda" else (64 if quick else 256) * 2**20
    x = torch.ones(nbytes // 4, device=device)
    y = torch.ones_like(x)
    out = torch.empty_like(x)
    copy = _time(lambda: out.copy_(x), clock, min_time_s=min_time_s)
    add = _time(lambda: torch.add(x, y, out=out), clock, min_time_s=min_time_s)
    return 2 * nbytes / copy, 3 * nbytes / add


def _recorded(fn: Callable[[], object]) -> list[OpCost]:
    """The non-view aten ops one call of `fn` runs, as the analytic model costs them."""
    with OpRecorder() as rec:
        fn()
    return [OpCost(name, op_class(name), fl, nb, dt, view) for name, fl, nb, dt, view, _ in rec.ops if not view]


def _launch_program(device: torch.device) -> Callable[[], object]:
    """64 tiny multiplications forward and backward under autograd: almost nothing but per-op overhead."""
    x = torch.ones(4, device=device, requires_grad=True)
    g = torch.ones(4, device=device)

    def chain() -> None:
        y = x
        for _ in range(64):
            y = y * 1.0001
        torch.autograd.grad(y, x, g)

    return chain


def _leaf(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device, requires_grad=True)


def _backward_of(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> Callable[[], object]:
    """The backward alone of `out` with respect to `inputs`; the incoming gradient is made once, outside."""
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, list(inputs), g, retain_graph=True)


# Operand sizes of the representative programs: (tokens, width) of a linear layer, (N, C, H, W) of a 3x3
# convolution, (N, C, H, W) of a batch norm, elements of the elementwise and layer-norm operands, (B, heads, T,
# head dim) of attention. Two scales per device, so that each op's time is fitted as latency + roofline /
# efficiency: the small one as in a small model, whose tensors stay in cache; the large one as in a layer of a
# large model, where memory-bound operands (16 MB and more) stream from memory rather than from the last-level
# cache, as the roofline assumes (timed from cache, a CPU's relu beats its memory bandwidth three-fold). On the
# CPU they stay below 32 MB, glibc's largest mmap threshold: larger buffers are mapped afresh on every allocation,
# and their page faults (2 µs per 4 kB page in a VM) would be timed instead of the kernel.
_SIZES = {
    ("cpu", False): ((256, 64), (8, 16, 16, 16), (8, 16, 16, 16), 2**15, (8, 4, 32, 16)),
    ("cpu", True): ((512, 512), (16, 32, 32, 32), (32, 32, 64, 64), 2**22, (4, 8, 128, 64)),
    ("cuda", False): ((1024, 1024), (8, 64, 28, 28), (8, 64, 28, 28), 2**20, (4, 8, 256, 64)),
    ("cuda", True): ((8192, 4096), (32, 128, 56, 56), (64, 256, 56, 56), 2**26, (8, 16, 2048, 128)),
}


def _programs(device: torch.device, large: bool) -> list[tuple[str, str, Callable[[], object]]]:
    """(name, op class, program) of representative ops, forward and backward, each program one kind of aten op
    (allocations aside). Inputs are made once, outside the programs."""
    d = device
    (tokens, width), conv, bn, elems, heads = _SIZES[d.type, large]
    rows = elems // width

    x, w, bias = _leaf(tokens, width, device=d), _leaf(width, width, device=d), _leaf(width, device=d)
    xc, wc = _leaf(*conv, device=d), _leaf(conv[1], conv[1], 3, 3, device=d)
    xb, bn_w, bn_b = _leaf(*bn, device=d), _leaf(bn[1], device=d), _leaf(bn[1], device=d)
    stats = torch.zeros(bn[1], device=d), torch.ones(bn[1], device=d)
    e1, e2 = _leaf(rows, width, device=d), _leaf(rows, width, device=d)
    ln_w, ln_b = _leaf(width, device=d), _leaf(width, device=d)
    q, k, v = (_leaf(*heads, device=d) for _ in range(3))

    def sdpa() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def batch_norm() -> torch.Tensor:
        return F.batch_norm(xb, *stats, bn_w, bn_b, training=True)

    # GELU has two kernels under one aten name, exact (erf, BERT) and tanh-approximated (GPT-2), four times apart
    # on a CPU: both are timed, and the fit of "gelu" lies between them.
    mm, cv, ew = f"{tokens}x{width}x{width}", f"{conv}", f"({rows}, {width})"
    bns = f"{bn}"
    forward: list[tuple[str, str, Callable[[], torch.Tensor]]] = [
        (f"linear {mm}", "matmul", lambda: F.linear(x, w, bias)),
        (f"conv3x3 {cv}", "matmul", lambda: F.conv2d(xc, wc, padding=1)),
        (f"layer_norm {ew}", "norm", lambda: F.layer_norm(e1, (width,), ln_w, ln_b)),
        (f"batch_norm {bns}", "norm", batch_norm),
        (f"relu {ew}", "elementwise", lambda: torch.relu(e1)),
        (f"gelu {ew}", "elementwise", lambda: F.gelu(e1)),
        (f"gelu tanh {ew}", "elementwise", lambda: F.gelu(e1, approximate="tanh")),
        (f"softmax {ew}", "elementwise", lambda: torch.softmax(e1, -1)),
        (f"add {ew}", "elementwise", lambda: torch.add(e1, e2)),
        (f"mul {ew}", "elementwise", lambda: torch.mul(e1, e2)),
        (f"clone {ew}", "elementwise", lambda: e1.clone()),
        (f"sum over rows {ew}", "elementwise", lambda: e1.sum(0)),
        (f"sdpa causal {heads}", "attention", sdpa),
    ]
    backward = [
        (f"mm {mm} backward", "matmul", lambda: (torch.mm(x, w), (x, w))),
        (f"conv3x3 {cv} backward", "matmul", lambda: (F.conv2d(xc, wc, padding=1), (xc, wc))),
        (f"layer_norm {ew} backward", "norm", lambda: (F.layer_norm(e1, (width,), ln_w, ln_b), (e1, ln_w, ln_b))),
        (f"batch_norm {bns} backward", "norm", lambda: (batch_norm(), (xb, bn_w, bn_b))),
        (f"relu {ew} backward", "elementwise", lambda: (torch.relu(e1), (e1,))),
        (f"gelu {ew} backward", "elementwise", lambda: (F.gelu(e1), (e1,))),
        (f"gelu tanh {ew} backward", "elementwise", lambda: (F.gelu(e1, approximate="tanh"), (e1,))),
        (f"softmax {ew} backward", "elementwise", lambda: (torch.softmax(e1, -1), (e1,))),
        (f"sdpa causal {heads} backward", "attention", lambda: (sdpa(), (q, k, v))),
    ]

    def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return fn()

        return run

    programs = [(name, cls, no_grad(fn)) for name, cls, fn in forward]
    return programs + [(name, cls, _backward_of(*build())) for name, cls, build in backward]


def _op_name(ops: Sequence[OpCost]) -> str | None:
    """The one aten op a program runs (allocations aside), or None when it runs several kinds."""
    names = {op.name for op in ops if op.name not in ALLOCATIONS}
    return names.pop() if len(names) == 1 else None


# --- The link between two local processes -----------------------------------------------------------------


def _link_sizes(quick: bool) -> list[int]:
    return [4, 4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20] if quick else [4 * 8**k for k in range(9)]


def _reps(nbytes: int, quick: bool) -> int:
    base = 20 if nbytes <= 2**20 else 8
    return base if quick else 3 * base


# On a CPU both kinds of message are timed as training meets them: the ranks compute between messages.
# - All-reduce: timed after each rank computed for a while, as the gradient all-reduce follows the backward, and
#   the mean is kept. On this project's 2-core VM, gloo's all-reduce of up to 1 MiB then takes either 0.3-0.8 ms
#   or 3.5-5 ms a call (bimodal; the slow mode looks like a wake-up waiting for a timer tick), 0.7-2.1 ms on
#   average. Timed back to back after a barrier, most calls were fast: 0.12 ms of latency was fitted, and DDP's
#   measured gradient sync ran 2-5 ms longer than that predicted (benchmarks/accuracy.py).
# - Send/receive: in an unbroken stream of round trips, each rank computing between them, as pipeline stages
#   pass activations and gradients (_p2p_stream). With each trip started after a barrier instead, ranks pinned
#   to their cores (pyplan/runtime/affinity.py) took 0.9-1.9 ms a message of up to 256 KiB (a woken thread on an
#   idle virtual CPU), where the stream took 0.08-0.13 ms, and 1x2 pipelines ran 13-47 % faster than so predicted.
_BURST_S = 2e-3
# Ranks reach the gradient all-reduce apart, by the spread of their backwards; the rank that waits sleeps, and the
# late one pays its waking. Measured on this VM (2 ranks pinned, 512 KiB, the late rank's view, 40 calls): 0.48 ms
# median arriving together, 3.7-5.3 ms arriving 0.5-2 ms apart; unpinned 1.2 and 1.0-1.7 ms. DDP's gradient sync
# in the benchmark's 2x1 plans ran 2-3 ms longer than an all-reduce timed arriving together predicted.
_SKEW_S = 1e-3


def _busy(seconds: float) -> None:
    a = torch.ones(96, 96)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def _p2p_stream(rank: int, buf: torch.Tensor, trips: int, device: torch.device, burst_s: float) -> list[float]:
    """One-way times of `trips` round trips in an unbroken stream, as a pipeline passes activations and gradients:
    rank 0 computes for `burst_s`, sends and receives; rank 1 receives, computes for `burst_s` and sends back.
    Each trip less rank 1's compute, halved; on rank 0 (rank 1 returns [])."""

    spans, computed = [], []
    for _ in range(trips):
        if rank == 0:
            _busy(burst_s)
            t0 = time.perf_counter()
            dist.send(buf, 1)
            dist.recv(buf, 1)
            _sync(device)
            spans.append(time.perf_counter() - t0)
        else:
            dist.recv(buf, 0)
            _sync(device)
            t0 = time.perf_counter()
            _busy(burst_s)
            computed.append(time.perf_counter() - t0)
            dist.send(buf, 0)
    # rank 1's compute spans, to take out of rank 0's trips (_busy overshoots by up to one small matmul)
    spent = torch.tensor(computed if rank == 1 else [0.0] * trips, dtype=torch.float64, device=device)
    if rank == 1:
        dist.send(spent, 0)
        return []
    dist.recv(spent, 1)
    return [max(0.0, (span - c) / 2) for span, c in zip(spans, spent.tolist(), strict=True)]


def _link_worker(
    rank: int, out: str, init: str, backend: str, sizes: list[int], quick: bool, threads: int, passes: int = 1
) -> None:
    """One of the two processes: ping-pong and all-reduce at each size, in `passes` passes over the sizes; rank 0
    writes each pass's medians to `out`."""

    torch.set_num_threads(threads)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=2)
    if not cuda:
        keep_freed_memory()  # as the runtime runs CPU ranks (pyplan/runtime/heap.py, affinity.py)
        pin_rank()
    try:
        warm = torch.zeros(1, device=device)
        for _ in range(10):  # the first messages set up connections: not timed
            dist.all_reduce(warm)
            dist.barrier()
        p2p_passes, allreduce_passes = [], []
        for _ in range(passes):
            p2p, allreduce = _link_pass(rank, sizes, quick, device, cuda)
            p2p_passes.append(p2p)
            allreduce_passes.append(allreduce)
        if rank == 0:
            Path(out).write_text(json.dumps({"p2p": p2p_passes, "allreduce": allreduce_passes}))
    finally:
        dist.destroy_process_group()


def _link_pass(
    rank: int, sizes: list[int], quick: bool, device: torch.device, cuda: bool
) -> tuple[list[float], list[float]]:
    """One pass of ping-pongs and all-reduces over the sizes: each size's median (rank 0's p2p)."""

    p2p: list[float] = []
    allreduce: list[float] = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), device=device)
        reps = _reps(nbytes, quick)
        dist.barrier()
        # On a CPU the ranks compute between messages, as pipeline stages do (see _BURST_S).
        trips = _p2p_stream(rank, buf, 2 + reps, device, 0.0 if cuda else _BURST_S)[2:]
        reduces = []
        for rep in range(2 + reps):
            dist.barrier()
            if not cuda:
                # As the gradient all-reduce follows a backward, which one rank ends later (see _SKEW_S);
                # rank 0, which writes the figures, is the late one.
                _busy(_BURST_S + (_SKEW_S if rank == 0 else 0.0))
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            _sync(device)
            if rep >= 2:
                reduces.append(time.perf_counter() - t0)
        if rank == 0:
            p2p.append(statistics.median(trips))
        # gloo's all-reduce time is bimodal on a busy CPU (see _BURST_S): its mean is what steps pay.
        allreduce.append(statistics.median(reduces) if cuda else statistics.fmean(reduces))
    return p2p, allreduce


def measure_link(*, quick: bool = False, threads: int = 1, timeout_s: float = 180.0) -> LinkMeasurement:
    """Point-to-point and all-reduce between two processes spawned on this machine: NCCL between two CUDA
    GPUs when there are two, else gloo over CPU tensors. Each is fitted to α-β over several message sizes."""
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "gloo"
    sizes = _link_sizes(quick)
    passes = 2 if quick else 3
    what = f"{backend} link measurement between 2 processes"
    data = run_two(_link_worker, (backend, sizes, quick, threads, passes), what=what, timeout_s=timeout_s)
    # Each size's median over the passes is fitted; each pass's own fit gives the figures' spread.
    p2p = [statistics.median(times) for times in zip(*data["p2p"])]
    allreduce = [statistics.median(times) for times in zip(*data["allreduce"])]
    fits = {kind: [fit_alpha_beta(sizes, one) for one in data[kind]] for kind in ("p2p", "allreduce")}
    return LinkMeasurement(
        backend=backend,
        sizes_bytes=tuple(sizes),
        p2p_time_s=tuple(p2p),
        allreduce_time_s=tuple(allreduce),
        p2p=fit_alpha_beta(sizes, p2p),
        allreduce=fit_alpha_beta(sizes, allreduce),
        spread={
            "send latency": spread([f.latency_s for f in fits["p2p"]]),
            "send bandwidth": spread([f.bw_bytes_per_s for f in fits["p2p"]]),
            "all-reduce latency": spread([f.latency_s for f in fits["allreduce"]]),
            "all-reduce bandwidth": spread([f.bw_bytes_per_s for f in fits["allreduce"]]),
        },
    )


# --- Calibration ------------------------------------------------------------------------------------------


def _measure(
    clock: _Clock, quick: bool
) -> tuple[list[MatmulPeak], float, float, float, list[OpSample], dict[str, float]]:
    """Peaks, copy and add bandwidth, launch cost, op samples and the device figures' spreads. Every figure is timed
    in each of several rounds and the best round kept, so a burst of load from other processes spoils one round of
    a figure, not the figure; how far the rounds differ is its spread."""
    rounds, min_time_s = (2, 0.02) if quick else (4, 0.1)
    device = clock.device
    launch_fn = _launch_program(device)
    n_launch = len(_recorded(launch_fn))
    programs = [
        (name, cls, fn, _recorded(fn), large) for large in (False, True) for name, cls, fn in _programs(device, large)
    ]
    peaks: dict[str, MatmulPeak] = {}
    copy_bw = add_bw = 0.0
    launch = math.inf
    times = [math.inf] * len(programs)
    rounds_of: dict[str, list[float]] = {}  # each figure's value in each round, for its spread
    for _ in range(rounds):
        for p in _matmul_peaks(clock, quick, min_time_s):
            rounds_of.setdefault(f"peak {p.dtype}", []).append(p.flops_per_s)
            if p.dtype not in peaks or p.flops_per_s > peaks[p.dtype].flops_per_s:
                peaks[p.dtype] = p
        copy, add = _bandwidth(clock, quick, 2 * min_time_s)
        rounds_of.setdefault("copy bandwidth", []).append(copy)
        rounds_of.setdefault("add bandwidth", []).append(add)
        copy_bw, add_bw = max(copy_bw, copy), max(add_bw, add)
        once = _time(launch_fn, clock, min_time_s=min_time_s) / n_launch
        rounds_of.setdefault("launch per op", []).append(once)
        launch = min(launch, once)
        for i, (_, _, fn, _, _) in enumerate(programs):
            times[i] = min(times[i], _time(fn, clock, min_time_s=min_time_s))
    unit = dict.fromkeys(OP_CLASSES, 1.0)
    roof = Roofline({p.dtype: p.flops_per_s for p in peaks.values()}, max(copy_bw, add_bw), Efficiency(unit, unit, 0.0))
    samples = [
        OpSample(name, cls, _op_name(ops), large, len(ops), sum(roof.op_time_s(op) for op in ops), t)
        for (name, cls, _, ops, large), t in zip(programs, times)
    ]
    return list(peaks.values()), copy_bw, add_bw, launch, samples, {k: spread(v) for k, v in rounds_of.items()}


def calibrate(options: CalibrationOptions | None = None) -> Calibration:
    """Measure the local device (CUDA when present, else the CPU with `options.threads` threads)."""
    options = options or CalibrationOptions()
    if options.threads < 1:
        raise PlanError(f"--threads must be at least 1, got {options.threads}")
    start = time.perf_counter()
    detected = _detect_local()
    device = torch.device("cuda") if detected.device_type == "cuda" else torch.device("cpu")
    with torch_threads(options.threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peaks, copy_bw, add_bw, launch, samples, spreads = _measure(_Clock(device, options.threads), options.quick)
    per_class = class_efficiency(samples, launch)
    default = Efficiency()
    efficiency = Efficiency(
        compute={c: per_class.get(c, default.compute[c]) for c in OP_CLASSES},
        memory={c: per_class.get(c, default.memory[c]) for c in OP_CLASSES},
        launch_s=launch,
        op=op_efficiency(samples, launch),
    )
    link = (
        measure_link(quick=options.quick, threads=options.threads, timeout_s=options.link_timeout_s)
        if options.link
        else None
    )
    # The runtime's host costs matter where ranks are CPU processes; a GPU's host work runs ahead of its kernels.
    host = (
        measure_host_costs(quick=options.quick, timeout_s=options.link_timeout_s)
        if options.link and device.type == "cpu"
        else None
    )
    return Calibration(
        host=host,
        device=detected.description,
        device_type=device.type,
        threads=options.threads if device.type == "cpu" else None,
        peaks=tuple(peaks),
        copy_bw_bytes_per_s=copy_bw,
        add_bw_bytes_per_s=add_bw,
        launch_s=launch,
        samples=tuple(samples),
        efficiency=efficiency,
        link=link,
        elapsed_s=time.perf_counter() - start,
        spread=spreads,
    )


def write_calibration(calibration: Calibration, path: str | Path | None = None) -> Path:
    """Write the calibration file atomically (a temporary file renamed over it) to `path` (default:
    `local_calibration_path()`); returns the path written."""
    target = Path(path) if path is not None else local_calibration_path()
    write_atomic(target, json.dumps(calibration.to_json(), indent=2) + "\n", make_parents=True)
    return target


# --- Command line -----------------------------------------------------------------------------------------


def render_calibration(cal: Calibration, path: Path, console: Console) -> None:
    """The calibration's figures as tables, and the file written."""
    threads = f", {cal.threads} thread(s)" if cal.threads else ""
    console.print(f"[bold]{cal.device}[/bold] ({cal.device_type}{threads}), measured in {cal.elapsed_s:.1f} s")
    console.print(f"wrote {path}")

    t = Table(title="Roofs", caption="spread: (max - min) / median over the rounds")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("spread", justify="right")
    t.add_column("how")

    def moved(name: str) -> str:
        return f"{cal.spread[name]:.0%}" if name in cal.spread else "-"

    for p in cal.peaks:
        t.add_row(
            f"peak {p.dtype}",
            f"{fmt_count(p.flops_per_s)}FLOP/s",
            moved(f"peak {p.dtype}"),
            f"best square matmul, n = {p.size}",
        )
    t.add_row("memory bandwidth", fmt_bandwidth(cal.mem_bw_bytes_per_s), "", "the better of copy and add")
    t.add_row("  copy", fmt_bandwidth(cal.copy_bw_bytes_per_s), moved("copy bandwidth"), "bytes read + written")
    t.add_row("  add", fmt_bandwidth(cal.add_bw_bytes_per_s), moved("add bandwidth"), "bytes read + written")
    t.add_row(
        "launch per op",
        fmt_seconds(cal.launch_s),
        moved("launch per op"),
        "tiny ops, forward and backward under autograd",
    )
    console.print(t)

    t = Table(title="Achieved fraction of the roofline")
    t.add_column("op class / aten op")
    t.add_column("efficiency", justify="right")
    t.add_column("latency", justify="right")
    for cls in OP_CLASSES:
        t.add_row(f"[bold]{cls}[/bold]", f"{cal.efficiency.compute[cls]:.2f}", fmt_seconds(cal.efficiency.launch_s))
        for name, fit in cal.efficiency.op.items():
            if op_class(name) == cls:
                t.add_row(f"  {name}", f"{fit.efficiency:.2f}", fmt_seconds(fit.latency_s))
    console.print(t)

    if cal.link is not None:
        link = cal.link
        t = Table(title=f"Link between 2 local processes ({link.backend})")
        t.add_column("message", justify="right")
        t.add_column("send/recv (one way)", justify="right")
        t.add_column("all-reduce", justify="right")
        for n, p2p, ar in zip(link.sizes_bytes, link.p2p_time_s, link.allreduce_time_s):
            t.add_row(fmt_bytes(n), fmt_seconds(p2p), fmt_seconds(ar))
        for what, fit, key in (("send/recv", link.p2p, "send"), ("all-reduce", link.allreduce, "all-reduce")):
            t.add_row(
                f"α-β fit of {what}",
                f"{fmt_seconds(fit.latency_s)} + n / {fmt_bandwidth(fit.bw_bytes_per_s)}",
                "",
                end_section=what == "send/recv" and not link.spread,
            )
            if link.spread:
                t.add_row(
                    "  spread over passes",
                    f"latency {link.spread[f'{key} latency']:.0%}, bandwidth {link.spread[f'{key} bandwidth']:.0%}",
                    "",
                    end_section=what == "send/recv",
                )
        console.print(t)
