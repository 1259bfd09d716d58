"""Analytic time of each block on a GPU that is not present: a roofline over the ops torch would run.

Every aten op of a block's forward and backward is recorded on fake (or meta) tensors with its FLOPs and the
bytes it reads and writes; on the target GPU it takes `max(FLOPs / (peak · eff_compute), bytes / (bandwidth ·
eff_memory)) + launch` (Williams et al. 2009, the roofline; the survey of Gusak et al. §2 uses the same
arithmetic-intensity argument). Efficiencies depend on the op class; `pyplan calibrate` measures them on the
local device, and the defaults below are typical achieved fractions, to be replaced by calibrated ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pyplan._torch import OpRecorder, run_without_compute
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.pieces import backward, block_inputs, block_modules, forward, leaf_inputs

__all__ = ["OP_CLASSES", "Efficiency", "OpCost", "Roofline", "block_op_costs", "block_times_analytic", "op_class"]

OP_CLASSES = ("matmul", "attention", "norm", "elementwise")

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm", "linear")
_NORM = ("layer_norm", "batch_norm", "group_norm", "rms_norm", "native_layer_norm", "native_batch_norm")


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


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of peak FLOP/s and of memory bandwidth per op class, and the launch cost of an op.

    Defaults are typical of large dense kernels on datacenter GPUs (matmuls reach 60-80 % of peak, memory-bound
    kernels 70-90 % of bandwidth); calibration replaces them with measured values.
    """

    compute: Mapping[str, float] = field(
        default_factory=lambda: {"matmul": 0.7, "attention": 0.5, "norm": 0.5, "elementwise": 0.5}
    )
    memory: Mapping[str, float] = field(
        default_factory=lambda: {"matmul": 0.8, "attention": 0.7, "norm": 0.7, "elementwise": 0.8}
    )
    launch_s: float = 4e-6


@dataclass(frozen=True)
class Roofline:
    """What the roofline needs of a device: dense peak FLOP/s per dtype key and memory bandwidth."""

    peak_flops_per_s: Mapping[str, float]
    mem_bw_bytes_per_s: float
    efficiency: Efficiency = field(default_factory=Efficiency)

    def peak(self, dtype: str) -> float:
        key = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, "fp32")
        if key not in self.peak_flops_per_s:
            raise ValueError(f"the device has no {key} peak; known: {', '.join(self.peak_flops_per_s)}")
        return self.peak_flops_per_s[key]

    def op_time_s(self, op: OpCost) -> float:
        """Roofline time of one op; a view launches no kernel and costs nothing."""
        if op.is_view:
            return 0.0
        eff = self.efficiency
        compute = op.flops / (self.peak(op.dtype) * eff.compute[op.op_class]) if op.flops else 0.0
        memory = op.bytes / (self.mem_bw_bytes_per_s * eff.memory[op.op_class])
        return max(compute, memory) + eff.launch_s


def _costs(recorder: OpRecorder, compute_dtype: str | None) -> list[OpCost]:
    out = []
    for name, flops, nbytes, dtype, is_view in recorder.ops:
        if compute_dtype and dtype == "float32":
            # Mixed precision: the op runs in the compute dtype and moves half (bf16/fp16) the bytes.
            scale = torch.empty((), dtype=getattr(torch, compute_dtype)).element_size() / 4
            dtype, nbytes = compute_dtype, nbytes * scale
        out.append(OpCost(name, op_class(name), flops, nbytes, dtype, is_view))
    return out


def block_op_costs(
    chain: Chain, example_inputs: ExampleInputs, batch_size: int, *, compute_dtype: str | None = None
) -> list[tuple[list[OpCost], list[OpCost]]]:
    """The ops of each block's forward and backward at `batch_size`, recorded without computing.

    `compute_dtype` ("bfloat16", "float16") models mixed precision: fp32 ops are costed in that dtype.
    """
    mods = block_modules(chain)
    inputs = inputs_at(example_inputs, batch_size)

    def record(convert: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[list[OpCost], list[OpCost]]]:
        result = []
        args = block_inputs(mods, [convert(t) for t in inputs])
        # Fused attention where it applies, as on a GPU: the math kernel's (B, H, T, T) scores never exist there.
        attention = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
        attention.__enter__()
        for i, (mod, a) in enumerate(zip(mods, args)):
            leaves = leaf_inputs(a, first=i == 0)
            with OpRecorder() as fwd:
                _, roots = forward(mod, leaves)
            with OpRecorder() as bwd:
                backward(roots)
            result.append((_costs(fwd, compute_dtype), _costs(bwd, compute_dtype)))
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
) -> list[tuple[Affine, Affine]]:
    """Forward and backward seconds of every block on `device` as `α·b + β`, least squares over `batch_sizes`."""
    sizes = sorted(set(batch_sizes))
    per_size = [block_op_costs(chain, example_inputs, b, compute_dtype=compute_dtype) for b in sizes]

    def total(ops: list[OpCost]) -> float:
        return sum(device.op_time_s(op) for op in ops)

    return [
        (
            Affine.fit(sizes, [total(per_size[k][i][0]) for k in range(len(sizes))]),
            Affine.fit(sizes, [total(per_size[k][i][1]) for k in range(len(sizes))]),
        )
        for i in range(len(chain))
    ]
