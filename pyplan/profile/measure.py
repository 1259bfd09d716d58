"""Measured forward and backward time of each block on the local device, fitted to t(b) = α·b + β.

Each block runs alone on the inputs it receives in the full model, as a pipeline stage would run it: warm-up
runs first, then `repeats` timed forward and backward passes whose medians are kept. On CUDA the times come from
CUDA events; on the CPU with a fixed number of threads, from the thread's CPU time (one thread) or wall time.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.pieces import backward, block_inputs, block_modules, forward, leaf_inputs

__all__ = ["TimingOptions", "block_times", "local_device"]


@dataclass(frozen=True)
class TimingOptions:
    """How to time: `threads` is the CPU thread count (fixed so timings repeat); medians of `repeats` runs."""

    warmup: int = 2
    repeats: int = 5
    threads: int = 1


def local_device() -> torch.device:
    """The device measured mode uses: CUDA when present, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Clock:
    """Seconds a region takes: CUDA events on a GPU; on the CPU with one thread, the thread's CPU time (what the
    block costs, whatever else the machine runs at the same moment); with several threads, wall time."""

    def __init__(self, device: torch.device, threads: int) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if threads == 1 else time.perf_counter

    @contextlib.contextmanager
    def region(self, out: list[float]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = self.now()
            yield
            out.append(self.now() - t0)


def _times_at(
    chain: Chain, example_inputs: ExampleInputs, batch_size: int, device: torch.device, opts: TimingOptions
) -> list[tuple[float, float]]:
    mods = block_modules(chain)
    inputs = [t.to(device) for t in inputs_at(example_inputs, batch_size)]
    args = block_inputs(mods, inputs)
    clock = _Clock(device, opts.threads)
    result = []
    for i, (mod, a) in enumerate(zip(mods, args)):
        fwd: list[float] = []
        bwd: list[float] = []
        for rep in range(opts.warmup + opts.repeats):
            f_out: list[float] = fwd if rep >= opts.warmup else []
            b_out: list[float] = bwd if rep >= opts.warmup else []
            leaves = leaf_inputs(a, first=i == 0)
            with clock.region(f_out):
                _, roots = forward(mod, leaves)
            grads = [torch.ones_like(t) for t in roots]
            with clock.region(b_out):
                backward(roots, grads)
        result.append((statistics.median(fwd), statistics.median(bwd)))
    for p in chain.graph.module.parameters():
        p.grad = None
    return result


def block_times(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_sizes: Sequence[int],
    *,
    device: torch.device | None = None,
    options: TimingOptions | None = None,
) -> list[tuple[Affine, Affine]]:
    """Forward and backward seconds of every block as `α·b + β`, least squares over `batch_sizes` (two or more).

    The traced module is moved to `device` (default: `local_device()`); its parameters are shared with the
    user's model, which moves with it.
    """
    sizes = sorted(set(batch_sizes))
    if len(sizes) < 2:
        raise ValueError(f"timing needs two or more distinct micro-batch sizes, got {list(batch_sizes)}")
    device = device or local_device()
    options = options or TimingOptions()
    chain.graph.module.to(device)
    with _threads(options.threads), torch.enable_grad():
        per_size = [_times_at(chain, example_inputs, b, device, options) for b in sizes]
    return [
        (
            Affine.fit(sizes, [per_size[k][i][0] for k in range(len(sizes))]),
            Affine.fit(sizes, [per_size[k][i][1] for k in range(len(sizes))]),
        )
        for i in range(len(chain))
    ]
