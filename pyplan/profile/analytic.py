"""Analytic time of each block on a GPU that is not present: a roofline over the ops torch would run.

Every aten op of a block's forward and backward is recorded on fake (or meta) tensors with its FLOPs and the
bytes it reads and writes; on the target GPU it takes `max(FLOPs / (peak · eff_compute), bytes / (bandwidth ·
eff_memory)) + launch` (Williams et al. 2009, the roofline; the survey of Gusak et al. §2 uses the same
arithmetic-intensity argument). Efficiencies depend on the op class; `pyplan calibrate` measures them on the
local device, and the defaults below are typical achieved fractions, to be replaced by calibrated ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pyplan._torch import OpRecorder, run_without_compute
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine, Piecewise
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.hardware.catalog import GPU, LOCAL, local_efficiency
from pyplan.profile.attention import fused_work
from pyplan.profile.autocast import CudaAutocast
from pyplan.profile.pieces import RepeatedBlocks, backward, block_inputs, forward, leaf_inputs

__all__ = [
    "ALLOCATIONS",
    "OP_CLASSES",
    "AnalyticBlocks",
    "Efficiency",
    "OpCost",
    "OpEfficiency",
    "Roofline",
    "analytic_blocks",
    "block_op_costs",
    "block_times_analytic",
    "op_class",
]

OP_CLASSES = ("matmul", "attention", "norm", "elementwise")

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "linear")
_NORM = ("layer_norm", "batch_norm", "group_norm", "rms_norm", "native_layer_norm", "native_batch_norm")
# Ops that only allocate their output: they launch no kernel that moves data.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


def op_class(name: str) -> str:
    """The class an aten op's efficiency comes from: matmul (incl. convolution), attention, norm, elementwise."""
    if any(a in name for a in _ATTENTION):
        return "attention"
    if name in _MATMUL or "convolution" in name or name.startswith("_slow_conv"):
        return "matmul"
    if any(n in name for n in _NORM):
        return "norm"
    return "elementwise"


@dataclass(frozen=True)
class OpCost:
    """One aten op: its class, FLOPs, bytes read and written, and the floating dtype it computes in."""

    name: str
    op_class: str
    flops: float
    bytes: float
    dtype: str
    is_view: bool = False
    # FLOPs as torch's formula counts them, whatever share the kernel computes (a causal fused attention's full
    # Tq x Tk): the model's FLOPs as FlopCounterMode reports them.
    counted_flops: float = 0.0


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class OpEfficiency:
    """One aten op as calibration measured it: `latency_s + roofline time / efficiency` (Hockney's fixed cost and
    asymptotic rate), from programs of the op at two sizes."""

    efficiency: float
    latency_s: float


# The host's time to issue one aten op, views included, to a GPU's queue (Python, the dispatcher, autograd, the
# launch) in eager PyTorch, from an H200's host (benchmarks/GPU.md, "Changes priced against the measurements of
# 2026-11-27"): gpt2-small in bf16-mixed at micro-batch 4 bounds it at 17.9 µs, the 1B Llama-style model's rows at
# about 11 µs (higher prices them more than 6 % slow). `pyplan calibrate` does not measure it yet; 0 turns it off.
HOST_S = 1.1e-5


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak FLOP/s and of memory bandwidth per op class, and the launch cost of an op.

    Defaults are typical of large dense kernels on datacenter GPUs (matmuls reach 60-80 % of peak, memory-bound
    kernels 70-90 % of bandwidth); calibration replaces them with measured values. `host_s` is the host's time to
    issue one op to a GPU's queue (`Roofline.sequence_time_s`). `op` refines a class by aten op
    name (e.g. "native_batch_norm"): the fit calibration made for that op alone, its efficiency used for both
    roofs. Kernels of one class differ several-fold on a CPU, and small ones fall short of large ones.
    """

    compute: Mapping[str, float] = field(
        default_factory=lambda: {"matmul": 0.7, "attention": 0.5, "norm": 0.5, "elementwise": 0.5}
    )
    memory: Mapping[str, float] = field(
        default_factory=lambda: {"matmul": 0.8, "attention": 0.7, "norm": 0.7, "elementwise": 0.8}
    )
    launch_s: float = 4e-6
    op: Mapping[str, OpEfficiency] = field(default_factory=dict)
    host_s: float = HOST_S

    def to_json(self) -> dict[str, Any]:
        ops = {name: {"efficiency": f.efficiency, "latency_s": f.latency_s} for name, f in self.op.items()}
        return {
            "compute": dict(self.compute),
            "memory": dict(self.memory),
            "launch_s": self.launch_s,
            "host_s": self.host_s,
            "op": ops,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any], what: str = "efficiency") -> Efficiency:
        """Read `to_json`'s form (the "efficiency" object of a calibration file); classes it lacks keep defaults."""
        default = Efficiency()
        parts = {}
        for key in ("compute", "memory"):
            given = data.get(key, {})
            if not isinstance(given, Mapping) or set(given) - set(OP_CLASSES):
                raise PlanError(f"{what}: '{key}' must map op classes ({', '.join(OP_CLASSES)}) to fractions")
            for cls, value in given.items():
                if not _positive(value):
                    raise PlanError(f"{what}: '{key}.{cls}' must be a positive number, got {value!r}")
            parts[key] = {**getattr(default, key), **given}
        ops = data.get("op", {})
        if not isinstance(ops, Mapping) or not all(
            isinstance(v, Mapping) and _positive(v.get("efficiency")) and _positive(v.get("latency_s"))
            for v in ops.values()
        ):
            raise PlanError(f"{what}: 'op' must map aten op names to positive 'efficiency' and 'latency_s'")
        launch = data.get("launch_s", default.launch_s)
        if not (_positive(launch) or launch == 0):
            raise PlanError(f"{what}: 'launch_s' must be zero or positive, got {launch!r}")
        host = data.get("host_s", default.host_s)
        if not (_positive(host) or host == 0):
            raise PlanError(f"{what}: 'host_s' must be zero or positive, got {host!r}")
        return Efficiency(
            compute=parts["compute"],
            memory=parts["memory"],
            launch_s=float(launch),
            op={name: OpEfficiency(float(v["efficiency"]), float(v["latency_s"])) for name, v in ops.items()},
            host_s=float(host),
        )


@dataclass(frozen=True)
class Roofline:
    """What the roofline needs of a device: dense peak FLOP/s per dtype key and memory bandwidth."""

    peak_flops_per_s: Mapping[str, float]
    mem_bw_bytes_per_s: float
    efficiency: Efficiency = field(default_factory=Efficiency)

    @staticmethod
    def from_gpu(gpu: GPU, efficiency: Efficiency | None = None) -> Roofline:
        """The roofline of a catalog GPU. Without `efficiency`: the defaults, or for `local` the efficiencies
        `pyplan calibrate` measured."""
        if not gpu.peak_flops_per_s or gpu.hbm_bw_bytes_per_s is None:
            hint = ": run `pyplan calibrate`" if gpu.name == LOCAL else ""
            raise PlanError(f"GPU '{gpu.name}' has no peak FLOP/s or memory bandwidth figures{hint}")
        if efficiency is None:
            measured = local_efficiency() if gpu.name == LOCAL else None
            efficiency = Efficiency() if measured is None else Efficiency.from_json(measured, "calibrated efficiency")
        if gpu.device_type != "cuda":  # the host runs the ops itself: no queue to get ahead in
            efficiency = replace(efficiency, host_s=0.0)
        return Roofline(dict(gpu.peak_flops_per_s), gpu.hbm_bw_bytes_per_s, efficiency)

    def peak(self, dtype: str) -> float:
        key = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")
        if key not in self.peak_flops_per_s:
            raise ValueError(f"the device has no {key} peak; known: {', '.join(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[key]

    def sequence_time_s(self, ops: Sequence[OpCost]) -> float:
        """The time of `ops` run in order from an idle GPU: the host issues one op every `host_s` (none on a device
        without a queue: `host_s` 0), views included, which launch nothing; the GPU starts each kernel once it is
        issued and the one before is done. A run of short kernels waits on the host; behind a long one the host
        gets ahead and the next ones queue."""
        return self._sequence_s(
            None if op.is_view else (op.name, op.op_class, op.flops, op.bytes, op.dtype) for op in ops
        )

    def _sequence_s(self, kernels: Iterable[tuple[str, str, float, float, str] | None]) -> float:
        """`sequence_time_s` of ops given as (name, class, FLOPs, bytes, dtype), None for a view."""
        host_s = self.efficiency.host_s
        issued = done = 0.0
        for kernel in kernels:
            issued += host_s
            if kernel is not None:
                done = max(done, issued) + self._kernel_time_s(*kernel)
        return max(done, issued)

    def op_time_s(self, op: OpCost) -> float:
        """Roofline time of one op; a view launches no kernel and costs nothing, an allocation only its launch."""
        if op.is_view:
            return 0.0
        return self._kernel_time_s(op.name, op.op_class, op.flops, op.bytes, op.dtype)

    def _kernel_time_s(self, name: str, op_class: str, flops: float, nbytes: float, dtype: str) -> float:
        """`op_time_s` of an op that is no view, from its fields."""
        eff = self.efficiency
        if name in ALLOCATIONS:
            return eff.launch_s
        compute = flops / self.peak(dtype) if flops else 0.0
        memory = nbytes / self.mem_bw_bytes_per_s
        fit = eff.op.get(name)
        if fit is not None:
            return max(compute, memory) / fit.efficiency + fit.latency_s
        return max(compute / eff.compute[op_class], memory / eff.memory[op_class]) + eff.launch_s


def _costs(recorder: OpRecorder, weights: str | None = None) -> list[OpCost]:
    """The recorded ops as costs; with `weights` (a 16-bit dtype's name), the fp32 ones as that dtype computes them,
    moving half the bytes: a model of 16-bit weights, recorded on the fp32 model."""
    scale = getattr(torch, weights).itemsize / 4 if weights else 1.0
    out = []
    for name, flops, nbytes, dtype, is_view, counted in recorder.ops:
        if weights and dtype == "float32":
            dtype, nbytes = weights, nbytes * scale
        out.append(OpCost(name, op_class(name), flops, nbytes, dtype, is_view, counted))
    return out


def block_op_costs(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_size: int,
    *,
    compute_dtype: str | None = None,
    autocast: bool = False,
    blocks: RepeatedBlocks | None = None,
) -> list[tuple[list[OpCost], list[OpCost]]]:
    """The ops of each block's forward and backward at `batch_size`, recorded without computing: with
    `compute_dtype` ("bfloat16", "float16") and `autocast`, as under CUDA's autocast (mixed precision, each op in
    the dtype it runs in; pyplan/profile/autocast.py); with `compute_dtype` alone, as 16-bit weights compute (the
    master-weight precisions): recorded on the model as it is, every fp32 op costed in that dtype. `blocks`: the
    chain's table of distinct blocks, when the caller has it already (a repeated block's costs are its first
    occurrence's, the same lists).

    (Converting the weights and recording the model in 16 bits would also see the ops a model keeps in fp32, but a
    model's fp32 constants and its own casts, a Hugging Face rotary embedding's, break it on real models.)
    """
    repeated = RepeatedBlocks.of(chain) if blocks is None else blocks
    mods = repeated.mods
    inputs = inputs_at(example_inputs, batch_size)
    dtype = getattr(torch, compute_dtype) if compute_dtype is not None else None
    weights = compute_dtype if dtype is not None and not autocast else None

    def casts() -> CudaAutocast | None:
        """The autocast emulation (a new one for each block: its casts are made once, for forward and backward)."""
        return CudaAutocast(dtype) if autocast and dtype is not None else None

    def record(convert: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[list[OpCost], list[OpCost]]]:
        result = []
        done: dict[str, tuple[list[OpCost], list[OpCost]]] = {}
        with casts() or contextlib.nullcontext():
            args = block_inputs(mods, [convert(t) for t in inputs], repeated)
        # Fused attention where it applies, as on a GPU: the math kernel's (B, H, T, T) scores never exist there.
        attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        attention.__enter__()
        for i, (mod, a) in enumerate(zip(mods, args)):
            leaves = leaf_inputs(a, first=i == 0)
            key = repeated.key(i, leaves)
            if key is not None and key in done:
                result.append(done[key])
                continue
            # The emulation above the recorder, so the recorder sees its casts.
            block_casts = casts()
            with OpRecorder(fused_work) as fwd, block_casts or contextlib.nullcontext():
                _, roots = forward(mod, leaves)
            # The incoming gradient is made outside, as measure.py times it: in a pipeline it comes from the next stage.
            grads = [torch.ones_like(t) for t in roots]
            with OpRecorder(fused_work) as bwd, block_casts.backward() if block_casts else contextlib.nullcontext():
                backward(roots, grads)
            result.append((_costs(fwd, weights), _costs(bwd, weights)))
            if key is not None:
                done[key] = result[-1]
        attention.__exit__(None, None, None)
        return result

    return run_without_compute(chain.graph.module, record)


def block_times_analytic(
    chain: Chain,
    example_inputs: ExampleInputs,
    device: Roofline,
    batch_sizes: Sequence[int] = (1, 2),
    *,
    compute_dtype: str | None = None,
    autocast: bool = False,
    blocks: RepeatedBlocks | None = None,
) -> list[tuple[Affine, Affine]]:
    """Forward and backward seconds of every block on `device` as `α·b + β`, least squares over `batch_sizes`;
    `compute_dtype`, `autocast` and `blocks` as `block_op_costs` takes them."""
    return analytic_blocks(
        chain, example_inputs, device, batch_sizes, compute_dtype=compute_dtype, autocast=autocast, blocks=blocks
    ).times


@dataclass(frozen=True)
class AnalyticBlocks:
    """Every block's forward and backward seconds on a roofline, and its FLOPs as torch's formulas count them (what
    `block_flops` counts on the math kernels: the recorded ops' `counted_flops`), each as `α·b + β`."""

    times: list[tuple[Affine, Affine]]
    flops: list[tuple[Affine, Affine]]


def analytic_blocks(
    chain: Chain,
    example_inputs: ExampleInputs,
    device: Roofline,
    batch_sizes: Sequence[int] = (1, 2),
    *,
    compute_dtype: str | None = None,
    autocast: bool = False,
    blocks: RepeatedBlocks | None = None,
) -> AnalyticBlocks:
    """`block_times_analytic`'s times, and the FLOPs of the same recordings (no pass of their own)."""
    table = RepeatedBlocks.of(chain) if blocks is None else blocks

    def costs(b: int) -> list[tuple[list[OpCost], list[OpCost]]]:
        return block_op_costs(chain, example_inputs, b, compute_dtype=compute_dtype, autocast=autocast, blocks=table)

    wanted = sorted(set(batch_sizes))
    recorded = {b: costs(b) for b in wanted[-2:]}
    # With the host's floor every curve comes from the two largest sizes where the ops recorded there match one for
    # one (_sequence_curve): the smaller sizes are recorded only where some block's do not.
    low, high = (recorded[b] for b in wanted[-2:])
    if device.efficiency.host_s == 0 or not all(
        _same_ops(x[k], y[k]) for x, y in zip(low, high, strict=True) for k in (0, 1)
    ):
        recorded.update({b: costs(b) for b in wanted[:-2]})
    sizes = sorted(recorded)
    per_size = [recorded[b] for b in sizes]

    def times(k: int) -> list[Affine]:
        """Block i's forward (k 0) or backward (k 1) seconds: `α·b + β` over the recorded sizes where the host
        sets no floor; with one (`host_s`), the ops' time in sequence at every EVALUATED_SIZES (each op's FLOPs
        and bytes are affine in b: the two largest recorded sizes give them), as the host's floor gives way to
        the GPU's work as b grows."""
        runs = [[per_size[j][i][k] for j in range(len(sizes))] for i in range(len(chain))]
        # A repeated block's ops are its first occurrence's very lists: its curve is that block's, made once.
        curves: dict[tuple[int, ...], Affine] = {}

        def curve(r: list[list[OpCost]]) -> Affine:
            if device.efficiency.host_s == 0:
                return Affine.fit(sizes, [sum(device.op_time_s(op) for op in ops) for ops in r])
            return _sequence_curve(device, sizes, r)

        for r in runs:
            key = tuple(map(id, r))
            if key not in curves:
                curves[key] = curve(r)
        return [curves[tuple(map(id, r))] for r in runs]

    # FLOPs are affine in b: the line through the two largest sizes.
    (b1, low_costs), (b2, high_costs) = ((b, recorded[b]) for b in sizes[-2:])

    def flops(k: int) -> list[Affine]:
        return [
            Affine.from_two(b1, sum(op.counted_flops for op in x[k]), b2, sum(op.counted_flops for op in y[k]))
            for x, y in zip(low_costs, high_costs, strict=True)
        ]

    return AnalyticBlocks(list(zip(times(0), times(1), strict=True)), list(zip(flops(0), flops(1), strict=True)))


# Micro-batch sizes at which a block's time with the host's floor is evaluated (beyond the last: along the last
# segment, where the GPU's work sets the time).
EVALUATED_SIZES = tuple(1 << k for k in range(10))


def _same_ops(low: Sequence[OpCost], high: Sequence[OpCost]) -> bool:
    """Whether two recordings of a block's ops at two sizes match one for one (names, dtypes, views)."""
    return [(o.name, o.dtype, o.is_view) for o in low] == [(o.name, o.dtype, o.is_view) for o in high]


def _sequence_curve(device: Roofline, sizes: Sequence[int], runs: Sequence[list[OpCost]]) -> Piecewise:
    """`Roofline.sequence_time_s` of one block's ops as a curve in b: through EVALUATED_SIZES when the ops
    recorded at the two largest sizes match one for one (their FLOPs and bytes interpolated), else through the
    recorded sizes."""
    (b1, low), (b2, high) = sorted(zip(sizes, runs))[-2:]
    if not _same_ops(low, high):
        return Piecewise.through(list(sizes), [device.sequence_time_s(r) for r in runs])

    def time_s(b: int) -> float:
        """`device.sequence_time_s` of the ops at b, their FLOPs and bytes on the line through the two sizes (no
        OpCost made for each: thousands of ops at ten sizes)."""

        def line(x: float, y: float) -> float:
            return max(0.0, x + (y - x) * (b - b1) / (b2 - b1))

        return device._sequence_s(
            None if x.is_view else (x.name, x.op_class, line(x.flops, y.flops), line(x.bytes, y.bytes), x.dtype)
            for x, y in zip(low, high)
        )

    return Piecewise.through(list(EVALUATED_SIZES), [time_s(b) for b in EVALUATED_SIZES])
