"""Measured forward and backward time of each block on the local device, at several micro-batch sizes.

The times are kept as curves through the measured points (`Piecewise`: linear between neighbouring sizes), not
one line t(b) = α·b + β: a line through small sizes missed vgg-tiny's blocks at 16 samples by 25-50 % on a CPU.
`pyplan.profile.capture.chain_for` times the sizes its plans may use (`measured_batch_sizes`).

Each block runs on the inputs it receives in the full model. On the CPU the blocks run as a stage runs them,
every forward in order and then every backward in reverse (`warmup` untimed passes, then `repeats` timed ones,
medians kept), so that each block finds the caches as a training step leaves them: timed alone and again and
again, a block found its weights and inputs in a warm cache, and resnet-tiny's forwards (b = 8) were timed 8-10 %
short of the same blocks in sequence. The process keeps the memory it frees (pyplan/runtime/heap.py), as the
runtime's ranks do: with glibc's default the timed passes paid page faults (vgg-tiny's forwards at b = 16 read
4.9 ms against 4.4 ms). On the CPU a block is timed with a fixed number of threads, by the thread's CPU time (one
thread) or wall time. On CUDA the blocks run in passes too, CUDA events recorded between them and no wait for the
GPU inside a pass, so that a block's time is what it adds to the stage's stream: its kernels, and the launches the
GPU waits for where the host issues them slower than they run. Timed alone, each block waited for the GPU and then
launched into an empty queue, paying its launches in full: on an H200, vgg16-cifar10's one-GPU steps (micro-batches
of 64-256, the profile timed at 1-32) were predicted 75-194 % over measured without remat; timed in passes and at
the plans' own sizes, 37-52 % (resnet50, 16-64: 3-41 %), the excess growing as the micro-batch shrinks, as a
per-block host cost does: each block timed in a pass still makes its own autograd call, which a stage makes once.
So the whole model is timed in the same passes and the blocks' sum brought down to it, as on the CPU (`_spread`;
not yet run on a GPU).
Warm-up passes run until the GPU has worked for CUDA_WARM_S, as its clocks ramp up from idle.

On the CPU the sizes are timed in turn within each repetition, not one after the other: a shared VM's speed moves
by tens of percent from one second to the next (gpt-tiny's forward and backward at b = 8, one thread, CPU time:
7.9-12.6 ms in one-second medians over a minute, in phases of 1-10 s), and sizes timed one after the other each
took a snapshot of a different moment: one profile had vgg-tiny's b = 8 at 8.72 ms and its b = 16 at 10.43 ms (the
same blocks took 5.0-10.0 and 8.9-16.0 ms during the runs), a curve no plan between the sizes could trust. In
turn, each size's medians sample the whole window alike.

A rank that trains beside others on one CPU shares the machine's last-level cache, memory bandwidth and clock with
them, and runs slower than alone: timed alone and then with a second process running the same work on the other
core of this project's 2-core VM, a whole training step ran 2-3 % slower (resnet-tiny, vgg-tiny) and 1-16 % slower
(gpt-tiny, b = 16), while a matrix product held in the core's own cache did not slow at all. So the CPU blocks can
be timed under `TimingOptions.corun` companion processes (forked, each running the same blocks over and over, as
the other ranks of a data- or pipeline-parallel step do at the same time); `pyplan.profile.capture.chain_for` asks
for one per other rank the cluster places on this machine.

On the CPU a block timed alone also pays for being called alone: the module call and, above all, one autograd
engine run per backward (about 50 µs on a 2-core x86 VM, against a few µs per op), which a stage running many
blocks in one forward and one backward pays once. Summed over a stage's blocks, that overhead made stage times
20-45 % too long (benchmarks/accuracy.py). It is measured on programs of one and nine trivial ops timed the same
way (the overhead is what a program of zero ops would take, t₁ − (t₉ − t₁)/8) and taken off every block's times,
down to at least the cost of one trivial op. That leaves what real blocks pay beyond a trivial program (more inputs and
outputs, their leaves' gradients): gpt-tiny's 17 blocks summed 0.56-0.64 ms more than the whole model run as one
call and one backward, at micro-batches of 2 to 32 (8-10 % at 8). So the whole model is timed too, in the same
passes' conditions, and the blocks' sum is brought down to it (`_spread`: equal shares per block, forward and
backward apart). By default only for a process timed alone (`TimingOptions.whole`). On 2 CPU ranks the whole
model's call is faster than the blocks' sum too (the stage module called directly on a rank, in the same rounds
as the blocks timed again beside the other rank: 10-13 % on resnet-tiny, 2-4 % on vgg-tiny), but the stage in the
pipeline trainer (2x1 plans, under DDP) paid 2-5 % more forward and 3-7 % more backward CPU time than that call,
which no host cost charges yet, so that the blocks' sum came nearer: the 2-rank matrix's signed median error was
-11 % to -23 % in three runs with the whole model's time, -9 % to +3 % in three without (benchmarks/accuracy.py,
one noisy day). Alone (one rank, one process), the blocks' sum over-predicted 33 of 36
steps (median error 20 %); with the whole model's time the signed errors centred on -1 % and -9 % in two runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from pyplan._torch import tensor_leaves, torch_threads
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Piecewise
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.pieces import backward, block_inputs, block_modules, forward, leaf_inputs
from pyplan.remat_plan import full_remat, no_remat
from pyplan.runtime.heap import keep_freed_memory
from pyplan.runtime.remat import apply_remat

__all__ = ["CheckpointCosts", "TimingOptions", "block_times", "checkpoint_call_s", "checkpoint_costs", "local_device"]


@dataclass(frozen=True)
class TimingOptions:
    """How to time: `threads` is the CPU thread count (fixed so timings repeat); medians of `repeats` runs; on the
    CPU, with `corun` other processes running the same blocks meanwhile (the ranks beside this one in training),
    and the blocks brought down to the whole model's time or not (`whole`)."""

    warmup: int = 2
    repeats: int = 5
    threads: int = 1
    corun: int = 0
    # On the CPU, bring the blocks' sum down to the whole model's time (`_spread`); None: when the blocks are timed
    # alone (corun == 0), as a process that trains alone on its machine runs (see the module docstring).
    whole: bool | None = None


def local_device() -> torch.device:
    """The device measured mode uses: CUDA when present, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class _Clock:
    """Seconds a region takes: CUDA events on a GPU; on the CPU with one thread, the thread's CPU time (what the
    block costs, whatever else the machine runs at the same moment); with several threads, wall time."""

    def __init__(self, device: torch.device, threads: int, *, defer: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if threads == 1 else time.perf_counter
        # On CUDA with `defer`, regions are recorded without waiting for the GPU; `settle` waits and appends them.
        self.defer = defer
        self._pending: list[tuple[list[float], torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def region(self, out: list[float]) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((out, start, end))
            if not self.defer:
                self.settle()
        else:
            t0 = self.now()
            yield
            out.append(self.now() - t0)

    def settle(self) -> None:
        """Wait for the GPU to reach the regions recorded so far and append their seconds."""
        if self._pending:
            self._pending[-1][2].synchronize()
            for out, start, end in self._pending:
                out.append(start.elapsed_time(end) / 1e3)
            self._pending.clear()


def _time_block(
    mod: nn.Module, args: Sequence[object], clock: _Clock, warmup: int, repeats: int, *, first: bool
) -> tuple[float, float]:
    """Median forward and backward seconds of one block run alone on `args`."""
    fwd: list[float] = []
    bwd: list[float] = []
    for rep in range(warmup + repeats):
        f_out: list[float] = fwd if rep >= warmup else []
        b_out: list[float] = bwd if rep >= warmup else []
        leaves = leaf_inputs(args, first=first)
        with clock.region(f_out):
            _, roots = forward(mod, leaves)
        grads = [torch.ones_like(t) for t in roots]
        with clock.region(b_out):
            backward(roots, grads)
    return statistics.median(fwd), statistics.median(bwd)


class _Ops(nn.Module):
    """`n` trivial ops on a small tensor: the programs that measure the overhead of timing a block alone."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            x = x * 1.5
        return x


@dataclass(frozen=True)
class _Overhead:
    """Seconds of forward and backward a block pays for being timed alone, and the cost of one trivial op (the
    least a block is charged)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    op_forward_s: float = 0.0
    op_backward_s: float = 0.0

    def remove(self, fwd: float, bwd: float) -> tuple[float, float]:
        return max(fwd - self.forward_s, self.op_forward_s), max(bwd - self.backward_s, self.op_backward_s)


def _overhead(device: torch.device, clock: _Clock) -> _Overhead:
    """The call overhead of a block timed alone on the CPU (see the module docstring); none on CUDA, whose events
    time the kernels alone. Many repeats: the figures are a few µs apart."""
    if device.type == "cuda":
        return _Overhead()
    x = torch.randn(8, device=device)
    one, many = (_time_block(fx.symbolic_trace(_Ops(n)), (x,), clock, 5, 51, first=False) for n in (1, _MANY_OPS))

    def split(t1: float, tn: float) -> tuple[float, float]:
        # One op's cost is the slope between the programs of 1 and _MANY_OPS ops; a loaded host's noise can leave
        # it at or below 0 (1 and 2 ops once gave t2 < t1: every block's time then fell to 0), and then each op is
        # charged its average share of the longer program. The overhead is what the line gives at 0 ops.
        op = (tn - t1) / (_MANY_OPS - 1)
        if op <= 0:
            op = tn / _MANY_OPS
        return max(0.0, t1 - op), op

    (over_f, op_f), (over_b, op_b) = split(one[0], many[0]), split(one[1], many[1])
    return _Overhead(over_f, over_b, op_f, op_b)


# The longer of the two trivial programs `_overhead` times: their difference of _MANY_OPS - 1 ops, not 1, stands
# above the timer's noise.
_MANY_OPS = 9


def _pass(
    mods: Sequence[fx.GraphModule],
    args: Sequence[Sequence[object]],
    clock: _Clock,
    fwd: Sequence[list[float]],
    bwd: Sequence[list[float]],
) -> None:
    """The blocks run once as a stage runs them: every forward in order, then every backward in reverse, each
    block's activations freed by its backward; each block's seconds appended to its list in `fwd` and `bwd`."""
    roots: list[list[torch.Tensor]] = []
    for i, (mod, a) in enumerate(zip(mods, args)):
        leaves = leaf_inputs(a, first=i == 0)
        with clock.region(fwd[i]):
            _, out = forward(mod, leaves)
        roots.append(out)
    for i in reversed(range(len(mods))):
        grads = [torch.ones_like(t) for t in roots[i]]
        with clock.region(bwd[i]):
            backward(roots[i], grads)
        roots[i] = []


def _whole(
    module: nn.Module, inputs: Sequence[torch.Tensor], clock: _Clock, fwd: list[float], bwd: list[float]
) -> None:
    """The whole traced model run once, one call and one autograd run, as a stage runs its blocks; its forward and
    backward seconds appended to `fwd` and `bwd`."""
    with clock.region(fwd):
        out = module(*inputs)
    roots = [t for t in tensor_leaves(out) if t.requires_grad]
    grads = [torch.ones_like(t) for t in roots]
    with clock.region(bwd):
        backward(roots, grads)
    del out, roots, grads


_WHOLE_FLOOR = 0.5


def _spread(
    times: Sequence[tuple[float, float]], whole: tuple[float, float], overhead: _Overhead
) -> list[tuple[float, float]]:
    """Block times (overhead removed) less equal shares of what their sum exceeds the whole model by (less one
    call's overhead), forward and backward apart, none below the cost of one trivial op; unchanged where the sum
    does not exceed it, or where the whole model took less than _WHOLE_FLOOR of it (then it did not do the
    blocks' work: the per-call cost this removes was 8-10 % of gpt-tiny's blocks at b = 8)."""
    out = [list(t) for t in times]
    calls = (overhead.forward_s, overhead.backward_s)
    floors = (overhead.op_forward_s, overhead.op_backward_s)
    for k in (0, 1):
        total = sum(t[k] for t in out)
        target = whole[k] - calls[k]
        if target < total * _WHOLE_FLOOR:
            # Not the blocks' work run as one (a model output with no gradient: no backward to time): kept.
            continue
        excess = total - target
        # Equal shares, the blocks with the least room above their floor first: one that cannot give its share
        # gives its room, and what it could not give is shared among the rest.
        by_room = sorted(out, key=lambda t: t[k] - floors[k])
        for i, t in enumerate(by_room):
            if excess <= 0:
                break
            cut = min(excess / (len(by_room) - i), max(0.0, t[k] - floors[k]))
            t[k] -= cut
            excess -= cut
    return [(f, b) for f, b in out]


_PR_SET_PDEATHSIG = 1


def _companion(work: Callable[[], None], parent: int) -> None:
    """A forked companion's life: `work` over and over until its parent kills it (or dies: the kernel then kills
    it); never returns. Exit status 1 if `work` raised."""
    try:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == parent:  # else the parent died before prctl
            torch.set_num_threads(1)
            while True:
                work()
    except BaseException:
        os._exit(1)
    os._exit(0)


@contextlib.contextmanager
def _companions(count: int, work: Callable[[], None]) -> Iterator[None]:
    """`count` forked processes running `work` over and over while inside (none for 0, or where there is no
    fork); killed on the way out. Raises RuntimeError if one stopped on its own (its `work` failed), which would
    leave the timings taken without it."""
    if count <= 0 or not hasattr(os, "fork"):
        yield
        return
    pids: list[int] = []
    parent = os.getpid()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: forking with threads alive
            for _ in range(count):
                pid = os.fork()
                if pid == 0:
                    _companion(work, parent)
                pids.append(pid)
        yield
        stopped = [pid for pid in pids if os.waitpid(pid, os.WNOHANG) != (0, 0)]
        if stopped:
            pids = [pid for pid in pids if pid not in stopped]
            raise RuntimeError("a process running the blocks beside the timed one stopped; time with corun=0")
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _cpu_times(
    chain: Chain, example_inputs: ExampleInputs, sizes: Sequence[int], opts: TimingOptions
) -> list[list[tuple[float, float]]]:
    """Per size, per block, forward and backward seconds on the CPU: the blocks run as a stage runs them (`_pass`),
    then, where they are brought down to it (`TimingOptions.whole`), the whole model (`_whole`); each size in turn
    in every repetition, so that each size's medians sample the whole timing window; under `opts.corun`
    companions running the same passes. Overhead removed, and the blocks' sum brought down to the whole model's
    (`_spread`) where asked."""
    mods = block_modules(chain)
    module = chain.graph.module
    inputs = [[t.to("cpu") for t in inputs_at(example_inputs, b)] for b in sizes]
    args = [block_inputs(mods, x) for x in inputs]
    clock = _Clock(torch.device("cpu"), opts.threads)
    overhead = _overhead(torch.device("cpu"), clock)
    sink: list[list[float]] = [[] for _ in mods]

    def work() -> None:
        for a in args:
            _pass(mods, a, clock, sink, sink)
        for lst in sink:
            lst.clear()

    spread = opts.whole if opts.whole is not None else opts.corun == 0
    fwd = [[[] for _ in mods] for _ in sizes]
    bwd = [[[] for _ in mods] for _ in sizes]
    whole: list[tuple[list[float], list[float]]] = [([], []) for _ in sizes]
    with _companions(opts.corun, work):
        for rep in range(opts.warmup + opts.repeats):
            timed = rep >= opts.warmup
            for k in range(len(sizes)):
                _pass(mods, args[k], clock, fwd[k] if timed else sink, bwd[k] if timed else sink)
                if spread:  # the whole model is timed only where the blocks are brought down to it
                    _whole(module, inputs[k], clock, *(whole[k] if timed else ([], [])))
            for lst in sink:
                lst.clear()
    out = []
    for k in range(len(sizes)):
        times = [overhead.remove(statistics.median(f), statistics.median(b)) for f, b in zip(fwd[k], bwd[k])]
        if spread:
            times = _spread(times, (statistics.median(whole[k][0]), statistics.median(whole[k][1])), overhead)
        out.append(times)
    return out


# Seconds of warm-up passes on a GPU before any is timed: its clocks ramp up from idle (an H200 read 345 MHz idle and
# 1980 MHz after a few matrix products).
CUDA_WARM_S = 0.5
# The least a block is charged on a GPU when brought down to the whole model (`_spread`): one kernel launch (the
# H200's calibration measured 10.5 µs; the fastest GPUs launch in about 5).
CUDA_LAUNCH_S = 5e-6


def _cuda_times(
    chain: Chain, example_inputs: ExampleInputs, sizes: Sequence[int], device: torch.device, opts: TimingOptions
) -> list[list[tuple[float, float]]]:
    """Per size, per block, forward and backward seconds on a GPU: the blocks run as a stage runs them (`_pass`),
    events recorded between them and waited for once a pass, then the whole model (`_whole`), whose time the blocks'
    sum is brought down to (`_spread`; see the module docstring); each size in turn in every repetition, after
    warm-up passes lasting at least CUDA_WARM_S."""
    mods = block_modules(chain)
    module = chain.graph.module
    inputs = [[t.to(device) for t in inputs_at(example_inputs, b)] for b in sizes]
    args = [block_inputs(mods, x) for x in inputs]
    clock = _Clock(device, opts.threads, defer=True)
    fwd = [[[] for _ in mods] for _ in sizes]
    bwd = [[[] for _ in mods] for _ in sizes]
    whole: list[tuple[list[float], list[float]]] = [([], []) for _ in sizes]
    sink: list[list[float]] = [[] for _ in mods]
    start, rep = time.perf_counter(), 0
    while rep < opts.warmup or time.perf_counter() - start < CUDA_WARM_S:
        for k in range(len(sizes)):
            _pass(mods, args[k], clock, sink, sink)
            _whole(module, inputs[k], clock, [], [])
            clock.settle()
        for lst in sink:
            lst.clear()
        rep += 1
    for _ in range(opts.repeats):
        for k in range(len(sizes)):
            _pass(mods, args[k], clock, fwd[k], bwd[k])
            clock.settle()
            _whole(module, inputs[k], clock, *whole[k])
            clock.settle()
    return [
        _spread(
            [(statistics.median(f), statistics.median(b)) for f, b in zip(fwd[k], bwd[k])],
            (statistics.median(whole[k][0]), statistics.median(whole[k][1])),
            _Overhead(op_forward_s=CUDA_LAUNCH_S, op_backward_s=CUDA_LAUNCH_S),
        )
        for k in range(len(sizes))
    ]


def block_times(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_sizes: Sequence[int],
    *,
    device: torch.device | None = None,
    options: TimingOptions | None = None,
) -> list[tuple[Piecewise, Piecewise]]:
    """Forward and backward seconds of every block at each of `batch_sizes` (two or more), as curves through
    the measured points (linear between them, see `Piecewise`).

    The traced module is moved to `device` (default: `local_device()`); its parameters are shared with the
    user's model, which moves with it.
    """
    sizes = sorted(set(batch_sizes))
    if len(sizes) < 2:
        raise ValueError(f"timing needs two or more distinct micro-batch sizes, got {list(batch_sizes)}")
    device = device or local_device()
    options = options or TimingOptions()
    if device.type == "cpu":
        keep_freed_memory()  # as the runtime's CPU ranks run: no page faults on memory a step freed
    chain.graph.module.to(device)
    with torch_threads(options.threads), torch.enable_grad():
        if device.type == "cpu":
            per_size = _cpu_times(chain, example_inputs, sizes, options)
        else:
            per_size = _cuda_times(chain, example_inputs, sizes, device, options)
    for p in chain.graph.module.parameters():
        p.grad = None
    return [
        (
            Piecewise.through(sizes, [per_size[k][i][0] for k in range(len(sizes))]),
            Piecewise.through(sizes, [per_size[k][i][1] for k in range(len(sizes))]),
        )
        for i in range(len(chain))
    ]


class _Checkpointed(nn.Module):
    """A trivial op under `torch.utils.checkpoint` (non-reentrant), as a remat plan wraps a segment."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)


def checkpoint_call_s(device: torch.device | None = None, opts: TimingOptions | None = None) -> float:
    """Seconds one `torch.utils.checkpoint` call adds to a training step (its wrapper in the forward, the
    recomputation's bookkeeping in the backward), beyond running its contents: a trivial op timed with and
    without the wrapper. On the CPU this is tens of µs per call, which a plan of many small checkpointed blocks
    pays many times."""
    device = device or local_device()
    opts = opts or TimingOptions()
    x = torch.randn(8, device=device)
    with torch_threads(opts.threads):
        clock = _Clock(device, opts.threads)
        plain = _time_block(_Ops(1), (x,), clock, 5, 51, first=False)
        wrapped = _time_block(_Checkpointed(_Ops(1)), (x,), clock, 5, 51, first=False)
    return max(0.0, (wrapped[0] + wrapped[1]) - (plain[0] + plain[1]))


@dataclass(frozen=True)
class CheckpointCosts:
    """What checkpoints cost on this device beyond running their blocks again (`checkpoint_costs`): per block,
    the seconds it adds to a checkpoint it is inside (`block_s`: torch's hooks on its saved tensors in both
    passes), and the share of a checkpoint's cost (its call and its blocks' hooks) paid in its first, non-saving
    pass (`forward_share`); the rest is paid in the backward, around the recomputation."""

    block_s: tuple[float, ...]
    forward_share: float = 0.0


def checkpoint_costs(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_size: int,
    *,
    call_s: float | None = None,
    device: torch.device | None = None,
    options: TimingOptions | None = None,
) -> CheckpointCosts:
    """Per block, the seconds it adds to a checkpoint it is inside beyond running its forward once more: each
    block timed alone plain and under `torch.utils.checkpoint` (non-reentrant), forward and backward; the wrapped
    run also recomputes the forward and pays the call (`call_s`, default `checkpoint_call_s()`), the rest is
    torch's hooks on the block's saved tensors in both passes (on a CPU about 5-15 µs per saved tensor, so
    a block of many small ops pays more than its forward suggests). With two blocks or more, scaled to what the
    whole chain pays in pyplan's runtime (`_as_in_the_runtime`), which also gives the forward pass's share of
    the calls and hooks; with one, that share is the block's alone. Costs are at least 0, the share in [0, 1]."""
    device = device or local_device()
    options = options or TimingOptions()
    call = checkpoint_call_s(device, options) if call_s is None else call_s
    # A difference of two similar times: more repeats than a block's own timing.
    options = replace(options, repeats=max(options.repeats, 11))
    chain.graph.module.to(device)
    with torch_threads(options.threads), torch.enable_grad():
        mods = block_modules(chain)
        args = block_inputs(mods, [t.to(device) for t in inputs_at(example_inputs, batch_size)])
        clock = _Clock(device, options.threads)
        alone = []  # per block: its forward; what a checkpoint adds beyond recomputing it and the call; in forward
        for i, (mod, a) in enumerate(zip(mods, args)):
            f, b = _time_block(mod, a, clock, options.warmup, options.repeats, first=i == 0)
            fw, bw = _time_block(_Checkpointed(mod), a, clock, options.warmup, options.repeats, first=i == 0)
            alone.append((f, max(0.0, fw + bw - 2 * f - b - call), max(0.0, fw - f)))
        if len(mods) >= 2:
            costs = _as_in_the_runtime(chain, mods, args[0], alone, batch_size, call, clock, options)
        else:
            paid = sum(x + call for _, x, _ in alone)
            share = min(1.0, sum(y for _, _, y in alone) / paid) if paid > 0 else 0.0
            costs = CheckpointCosts(tuple(x for _, x, _ in alone), share)
    for p in chain.graph.module.parameters():
        p.grad = None
    return costs


def _as_in_the_runtime(
    chain: Chain,
    mods: Sequence[nn.Module],
    inputs: Sequence[Any],
    alone: Sequence[tuple[float, float, float]],
    batch_size: int,
    call: float,
    clock: _Clock,
    options: TimingOptions,
) -> CheckpointCosts:
    """The blocks' checkpoint costs scaled to what the runtime pays: the whole chain run by pyplan's RematModule
    (one forward, one backward) under full remat (every block but the last in a checkpoint of its own) against
    no remat; beyond recomputing the blocks (their profiled forward) and the calls, the rest is the blocks'
    share, divided in proportion to what each adds when timed alone. The forward share is what the forward
    pass adds over what the calls and hooks add in all.

    Timed alone, a block under a checkpoint also pays the module call of its recomputation, which the runtime's
    checkpoints, running the blocks' code, do not: measured on resnet-tiny at b = 8, the blocks alone added 5.1-5.6
    ms of hooks a micro-batch against 2-3 ms in the RematModule."""
    n = len(mods)
    plain = _module_s(apply_remat(chain, no_remat(0, n)), inputs, clock, options)
    full = _module_s(apply_remat(chain, full_remat(0, n)), inputs, clock, options)
    forward = [
        blk.fwd_time_s(batch_size) if blk.fwd_time_s is not None else f for blk, (f, _, _) in zip(chain.blocks, alone)
    ]
    in_chain = max(0.0, sum(full) - sum(plain) - sum(forward[: n - 1]) - call * (n - 1))
    total = sum(x for _, x, _ in alone[: n - 1])
    scale = in_chain / total if total > 0 else 0.0
    paid = in_chain + call * (n - 1)
    share = min(1.0, max(0.0, full[0] - plain[0]) / paid) if paid > 0 else 0.0
    return CheckpointCosts(tuple(x * scale for _, x, _ in alone), share)


def _module_s(module: nn.Module, inputs: Sequence[Any], clock: _Clock, options: TimingOptions) -> tuple[float, float]:
    """Median seconds of one forward and of one backward of `module` on the model's `inputs`."""
    fwd: list[float] = []
    bwd: list[float] = []
    for rep in range(options.warmup + options.repeats):
        with clock.region(fwd if rep >= options.warmup else []):
            out = module(*leaf_inputs(inputs, first=True))
        with clock.region(bwd if rep >= options.warmup else []):
            backward([t for t in tensor_leaves(out) if t.requires_grad])
    return statistics.median(fwd), statistics.median(bwd)
