"""Profiling a Chain: measured time per block, exact saved bytes, live memory for remat, parameters and FLOPs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from pyplan._torch import is_meta_module, run_without_compute
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.model_state import ModelState, model_state_bytes
from pyplan.profile.flops import block_flops
from pyplan.profile.live import LiveMemory
from pyplan.profile.measure import TimingOptions, block_times, local_device
from pyplan.profile.memory import saved_bytes
from pyplan.profile.pieces import RepeatedBlocks, block_inputs
from pyplan.profile.remat import remat_bytes, remat_chain
from pyplan.solve.remat import RematBytes, RematProfile

__all__ = [
    "LiveMemory",
    "ModelState",
    "RematBytes",
    "RematProfile",
    "TimingOptions",
    "block_flops",
    "block_times",
    "default_batch_sizes",
    "local_device",
    "measured_batch_sizes",
    "model_state_bytes",
    "profile",
    "remat_bytes",
    "remat_chain",
    "saved_bytes",
    "sizes_from_two",
]


def default_batch_sizes(batch_size: int) -> tuple[int, ...]:
    """Micro-batch sizes to time at: a quarter, half and all of `batch_size` (at least two distinct sizes)."""
    sizes = sorted({max(1, batch_size // 4), max(1, batch_size // 2), batch_size})
    return tuple(sizes) if len(sizes) >= 2 else (batch_size, 2 * batch_size)


def sizes_from_two(sizes: Sequence[int]) -> tuple[int, ...]:
    """`sizes` with none below 2, for a model that cannot train on one sample (a BatchNorm over 1x1 maps): at
    least two distinct sizes."""
    kept = sorted({max(2, b) for b in sizes})
    return tuple(kept) if len(kept) > 1 else (kept[0], 2 * kept[0])


# The largest micro-batch a measured profile times: beyond it a block's time grows along its last segment, as the
# per-sample cost of a batch that fills the machine does, and profiling stays a matter of seconds on a CPU. A GPU
# fills only at far larger batches, and times them in milliseconds, so there the sizes go up to
# MAX_MEASURED_BATCH_CUDA.
MAX_MEASURED_BATCH = 32
MAX_MEASURED_BATCH_CUDA = 512


def measured_batch_sizes(largest: int, *, cap: int | None = None) -> tuple[int, ...]:
    """Micro-batch sizes a measured profile times at, for plans of micro-batches up to `largest` samples: the
    powers of two from 1 up to it (and `largest` itself), at most `cap` (default: MAX_MEASURED_BATCH on the CPU,
    MAX_MEASURED_BATCH_CUDA on a GPU; see `Piecewise` for why several)."""
    if cap is None:
        cap = MAX_MEASURED_BATCH_CUDA if local_device().type == "cuda" else MAX_MEASURED_BATCH
    top = max(2, min(largest, cap))
    sizes = {1 << k for k in range(top.bit_length()) if 1 << k <= top} | {top}
    return tuple(sorted(sizes))


def _runs_at(chain: Chain, example_inputs: ExampleInputs, batch_size: int, blocks: RepeatedBlocks | None) -> None:
    """Every distinct block's forward at `batch_size` samples, nothing recorded (on fake or meta tensors): a model
    that cannot run at that size (a BatchNorm that sees one value per channel) fails here as training would, where
    no pass of the profile runs at that size."""
    table = RepeatedBlocks.of(chain) if blocks is None else blocks
    inputs = inputs_at(example_inputs, batch_size)
    run_without_compute(
        chain.graph.module, lambda convert: block_inputs(table.mods, [convert(t) for t in inputs], table)
    )


def profile(
    chain: Chain,
    example_inputs: ExampleInputs,
    *,
    measure: bool = True,
    batch_sizes: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    options: TimingOptions | None = None,
    blocks: RepeatedBlocks | None = None,
    count_flops: bool = True,
    check_smallest: bool = True,
) -> Chain:
    """A copy of `chain` whose blocks carry FLOPs (unless not `count_flops`: a caller that has them from another
    recording), saved bytes and (when `measure`) fitted times. Without counting FLOPs, nothing else runs at the
    smallest size: with `check_smallest` each distinct block's forward runs there, so that a model that cannot run
    at that size fails as it would train.

    FLOPs and saved bytes are counted on fake tensors (meta for a meta-built model), so they cost no compute;
    times are measured on `device` (default: CUDA when present, else the CPU with `options.threads` threads).
    `blocks`: the chain's table of distinct blocks (`RepeatedBlocks.of`), when the caller has it already.
    """
    sizes = tuple(batch_sizes) if batch_sizes else default_batch_sizes(chain.graph.batch_size)
    if len(set(sizes)) < 2:
        raise PlanError(f"profiling needs two or more distinct micro-batch sizes, got {list(sizes)}")
    ends = (min(sizes), max(sizes))
    if count_flops:
        flops = block_flops(chain, example_inputs, ends, blocks=blocks)
    else:
        flops = [(b.flops_fwd, b.flops_bwd) for b in chain.blocks]
        if check_smallest:
            _runs_at(chain, example_inputs, ends[0], blocks)
    # Saved bytes at 2 samples or more: at 1 a transpose can be a contiguous view, and a block that saves a copy
    # of its input at 2 saves the input itself at 1 (nn.TransformerEncoder), which no line through both describes.
    low = max(2, ends[0])
    saved, inputs_saved = saved_bytes(chain, example_inputs, (low, max(ends[1], 2 * low)), blocks=blocks)
    times: list[tuple[object, object]] = [(None, None)] * len(chain)
    if measure:
        if is_meta_module(chain.graph.module):
            raise PlanError("a model built on the meta device has no weights to time; profile it with measure=False")
        dev = torch.device(device) if device is not None else local_device()
        times = list(block_times(chain, example_inputs, sizes, device=dev, options=options or TimingOptions()))
    blocks = [
        dataclasses.replace(b, flops_fwd=f, flops_bwd=g, saved_bytes=s, fwd_time_s=t[0], bwd_time_s=t[1])
        for b, (f, g), s, t in zip(chain.blocks, flops, saved, times)
    ]
    return dataclasses.replace(chain, blocks=blocks, input_saved_bytes=inputs_saved)
