"""The figures of the rematerialization model (pyplan.solve.remat) per block, measured on fake or real tensors.

Each block runs alone as `piece(chain, i, i + 1)`, on the values of cut i that running the blocks before it
produced, received as a pipeline stage receives them (fresh leaves that need grad when float; the model's own
inputs need none). `LiveMemory` counts what the block allocates beyond those inputs, parameters and buffers:

  kept_bytes             live after a saving forward, with the outputs held: saved tensors and outputs;
  fwd_peak_bytes         the peak of that forward;
  out_bytes              live after a non-saving forward, as a checkpointed segment runs it the first time (grad
                         enabled, every saved tensor dropped by a saved-tensors hook): the new output storages
                         (a value passed through or a view of an input is held by whoever made it);
  out_values             those storages one by one with the last cut each is live at (a residual stream lives
                         across several cuts: a checkpointed segment holds it at its output cut);
  fwd_nosave_peak_bytes  the peak of that forward;
  bwd_peak_bytes         the peak of the backward from the saving forward's outputs: kept bytes, output gradients
                         (ones of the outputs' shapes, made by autograd when the backward starts and freed once
                         used, as the next block's input gradients would be), input gradients (kept to the end,
                         as `.grad` of the inputs) and temporaries; parameter gradients are left out (model
                         state). An output that is an input passed through is not backpropagated; its gradient
                         (in the cut's gradient on both sides) is added once;
  free_bytes             what of kept_bytes a saving forward of block i+1 frees (outputs neither block saves nor
                         passes on), measured by running blocks i and i+1 together;
  grad_bytes[c]          the gradients of cut c's values that require grad: the float values a pipeline stage
                         would send back (numel x element size; the model's own inputs get none).

Bytes are exactly affine in the batch size, so two batch sizes give `RematBytes` as `Affine`s.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from pyplan._torch import run_without_compute, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.split import pieces
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.live import LiveMemory
from pyplan.profile.pieces import RepeatedBlocks, block_inputs, leaf_inputs
from pyplan.solve.remat import RematChain

__all__ = ["BlockMemory", "RematBytes", "RematProfile", "block_memory", "remat_bytes", "remat_chain"]


@dataclass(frozen=True)
class BlockMemory:
    """The bytes of one block at one batch size (see the module docstring)."""

    kept_bytes: int
    out_bytes: int
    fwd_peak_bytes: int
    fwd_nosave_peak_bytes: int
    bwd_peak_bytes: int
    free_bytes: int = 0
    out_values: tuple[tuple[int, int], ...] = ()  # (bytes, last cut live) per new output storage


@dataclass(frozen=True)
class RematBytes:
    """The bytes of one block as `per_sample·b + fixed`."""

    kept_bytes: Affine
    out_bytes: Affine
    fwd_peak_bytes: Affine
    fwd_nosave_peak_bytes: Affine
    bwd_peak_bytes: Affine
    free_bytes: Affine
    out_values: tuple[tuple[Affine, int], ...] = ()

    def at(self, batch_size: int) -> BlockMemory:
        def value(a: Affine) -> int:
            return round(a(batch_size))

        values = tuple((value(b), last) for b, last in self.out_values)
        return BlockMemory(
            value(self.kept_bytes),
            sum(b for b, _ in values) if values else value(self.out_bytes),
            value(self.fwd_peak_bytes),
            value(self.fwd_nosave_peak_bytes),
            value(self.bwd_peak_bytes),
            value(self.free_bytes),
            values,
        )


@dataclass(frozen=True)
class RematProfile:
    """The memory figures of a whole chain: per block, and the gradient bytes per cut (one more than blocks)."""

    blocks: tuple[RematBytes, ...]
    grad_bytes: tuple[Affine, ...]

    def chain(self, batch_size: int, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> RematChain:
        """The RematChain at `batch_size`, with the blocks' forward and backward seconds at that size."""
        mems = [b.at(batch_size) for b in self.blocks]
        return _remat_chain(mems, [round(g(batch_size)) for g in self.grad_bytes], fwd_s, bwd_s)


def _discard(t: torch.Tensor) -> None:
    return None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("a non-saving forward was backpropagated")


def _grad_bytes(values: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_leaves(list(values)) if t.requires_grad)


class _OutputGradients(torch.autograd.Function):
    """A scalar whose backward hands ones shaped like `outputs` to autograd, which frees each once it is used
    (as the gradient arriving from the next block would be, rather than held to the end by the caller)."""

    @staticmethod
    def forward(ctx: Any, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.like = [(t.shape, t.dtype, t.device) for t in outputs]
        return torch.zeros((), device=outputs[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like)


def _measure_block(
    mod: fx.GraphModule, args: Sequence[Any], first: bool, lasts: Iterable[int]
) -> tuple[BlockMemory, int]:
    """One block's figures, and the gradient bytes of its outputs (the next cut); `lasts[v]` is the last cut
    where output v is live."""
    params = list(mod.parameters())
    for p in params:
        p.grad = None
    leaves = leaf_inputs(args, first=first)
    with LiveMemory() as mem:
        out = mod(*leaves)
        kept = mem.current_bytes
        fwd_peak = mem.peak_bytes
        outs = tensor_leaves(out)
        passed = [t for t in outs if any(t is a for a in leaves)]
        roots = [t for t in outs if t.requires_grad and not any(t is a for a in passed)]
        start = mem.mark()
        if roots:
            source = _OutputGradients.apply(*roots)
            seed = torch.ones_like(source)
            mem.ignore([source, seed])  # the scalar and its gradient are scaffolding
            del roots
            source.backward(seed)
    mem.ignore(p.grad for p in params if p.grad is not None)
    bwd_peak = mem.peak_bytes_since(start) + _grad_bytes(passed)
    out_grad = _grad_bytes(outs)
    del out, outs, passed
    for p in params:
        p.grad = None

    leaves = leaf_inputs(args, first=first)
    with LiveMemory() as mem, torch.autograd.graph.saved_tensors_hooks(_discard, _never_unpacked):
        out = mod(*leaves)
        nosave_peak = mem.peak_bytes
    # The outputs a non-saving forward leaves, value by value with the last cut each is live at: new storages
    # only (a value passed through, or a view of an input, is held by whoever made it).
    inputs = {storage_key(t) for t in tensor_leaves(list(leaves))}
    values: dict[Any, list[int]] = {}
    for t, last in zip(tensor_leaves(out), lasts):
        key = storage_key(t)
        if key not in inputs:
            size_last = values.setdefault(key, [t.untyped_storage().nbytes(), last])
            size_last[1] = max(size_last[1], last)
    del out
    out_values = tuple((size, last) for size, last in values.values())
    out_bytes = sum(size for size, _ in out_values)
    return BlockMemory(kept, out_bytes, fwd_peak, max(nosave_peak, out_bytes), bwd_peak, 0, out_values), out_grad


def _last_cuts(args: Sequence[Sequence[Any]], i: int) -> Iterable[int]:
    """For each value block i returns (cut i+1's values, in order), the last cut where its storage is live,
    under any name (a later block may pass it on as a view or as itself). `args[c]` are cut c's values."""
    n = len(args)
    if i == n - 1:
        return itertools.repeat(n)  # the model's outputs: live at the last cut only
    last: dict[Any, int] = {}
    for c in range(i + 1, n):
        for t in tensor_leaves(list(args[c])):
            last[storage_key(t)] = c
    return [last[storage_key(t)] for t in tensor_leaves(list(args[i + 1]))]


def _freed_by_next(
    a: fx.GraphModule, b: fx.GraphModule, args: Sequence[Any], first: bool, kept_a: int, kept_b: int
) -> int:
    """What of block a's kept bytes a saving forward of block b (the next one) frees: a's outputs that neither
    saves nor passes on. Live after both, beyond a's inputs, is kept(a) + kept(b) − that."""
    leaves = leaf_inputs(args, first=first)
    with LiveMemory() as mem:
        out = a(*leaves)
        values = out if isinstance(out, tuple) else (out,)
        del out
        out_b = b(*values)
        del values
        both = mem.current_bytes
    del out_b
    return max(0, kept_a + kept_b - both)


@contextlib.contextmanager
def _state_kept(module: torch.nn.Module) -> Iterator[None]:
    """Gradients and buffers as they were before (a real run accumulates the one and updates the other)."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def block_memory(
    chain: Chain, example_inputs: ExampleInputs, batch_size: int, *, fake: bool = True
) -> tuple[list[BlockMemory], list[int]]:
    """Every block's bytes at `batch_size`, and the gradient bytes per cut (index 0: the model's inputs, none).

    `fake` runs on fake tensors (meta for a model built on the meta device): nothing is computed or allocated;
    otherwise the blocks really run, on the model's own weights (left as they were, gradients and buffers
    included). Inputs go to the device of the model's parameters.
    """
    inputs = inputs_at(example_inputs, batch_size)
    gm = chain.graph.module
    device = next((p.device for p in gm.parameters() if not p.is_meta), torch.device("cpu"))

    def measure(convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[BlockMemory], list[int]]:
        mods = pieces(chain)  # inside the fake context: get_attr values are copied from the stand-ins
        args = block_inputs(mods, [convert(t.to(device)) for t in inputs])
        # A block that repeats an earlier one (a transformer layer, a ResNet bottleneck; meta models only) on
        # inputs of the same kind, whose values live as far past it, has the same figures: measured once. Every
        # block still runs once in block_inputs, so the cuts' live values are the real ones.
        repeated = RepeatedBlocks(mods, chain.graph.module)
        keys: list[tuple[str, tuple[int, ...]] | None] = []
        done: dict[tuple[str, tuple[int, ...]], tuple[BlockMemory, int]] = {}
        figures, grads = [], [0]
        with torch.enable_grad():
            for i, (mod, a) in enumerate(zip(mods, args)):
                lasts = _last_cuts(args, i)
                key = repeated.key(i, leaf_inputs(a, first=i == 0))
                # The last block's outputs live to the end (an endless iterator): measured, never reused.
                last_block = i == len(mods) - 1
                keys.append(None if key is None or last_block else (key, tuple(c - i for c in lasts)))
                if keys[-1] is not None and keys[-1] in done:
                    fig, g = done[keys[-1]]
                    fig = replace(fig, out_values=tuple((b, last + i) for b, last in fig.out_values))
                else:
                    fig, g = _measure_block(mod, a, first=i == 0, lasts=lasts)
                    if keys[-1] is not None:
                        done[keys[-1]] = (replace(fig, out_values=tuple((b, c - i) for b, c in fig.out_values)), g)
                figures.append(fig)
                grads.append(g)
            freed_by: dict[tuple[Any, Any], int] = {}
            for i in range(len(mods) - 1):
                pair = (keys[i], keys[i + 1]) if keys[i] is not None and keys[i + 1] is not None else None
                if pair is not None and pair in freed_by:
                    freed = freed_by[pair]
                else:
                    kept = figures[i].kept_bytes, figures[i + 1].kept_bytes
                    freed = _freed_by_next(mods[i], mods[i + 1], args[i], i == 0, *kept)
                    if pair is not None:
                        freed_by[pair] = freed
                figures[i] = replace(figures[i], free_bytes=freed)
        return figures, grads

    if fake:
        return run_without_compute(gm, measure)
    with _state_kept(gm):
        return measure(lambda t: t)


def remat_bytes(
    chain: Chain, example_inputs: ExampleInputs, batch_sizes: tuple[int, int], *, fake: bool = True
) -> RematProfile:
    """Every block's bytes as `per_sample·b + fixed`, from two batch sizes (exact: bytes are affine in b)."""
    b1, b2 = batch_sizes
    if b1 == b2:
        raise ValueError(f"two distinct batch sizes are needed, got {b1} twice")
    m1, g1 = block_memory(chain, example_inputs, b1, fake=fake)
    m2, g2 = block_memory(chain, example_inputs, b2, fake=fake)

    def line(name: str, x: BlockMemory, y: BlockMemory) -> Affine:
        return Affine.from_two(b1, getattr(x, name), b2, getattr(y, name))

    names = [n for n in BlockMemory.__dataclass_fields__ if n != "out_values"]

    def values(x: BlockMemory, y: BlockMemory) -> tuple[tuple[Affine, int], ...]:
        if [last for _, last in x.out_values] != [last for _, last in y.out_values]:
            raise ValueError("a block's outputs differ between the two batch sizes")
        return tuple((Affine.from_two(b1, bx, b2, by), last) for (bx, last), (by, _) in zip(x.out_values, y.out_values))

    blocks = tuple(
        RematBytes(**{n: line(n, x, y) for n in names}, out_values=values(x, y)) for x, y in zip(m1, m2)
    )
    return RematProfile(blocks, tuple(Affine.from_two(b1, x, b2, y) for x, y in zip(g1, g2)))


def _times(chain: Chain, batch_size: int, time_scale: float) -> tuple[list[float], list[float]]:
    """The blocks' seconds at `batch_size`; 0 for blocks never timed (a memory-only chain)."""
    fwd = [b.fwd_time_s(batch_size) * time_scale if b.fwd_time_s else 0.0 for b in chain.blocks]
    bwd = [b.bwd_time_s(batch_size) * time_scale if b.bwd_time_s else 0.0 for b in chain.blocks]
    return fwd, bwd


def _remat_chain(
    mems: Sequence[BlockMemory], grads: Sequence[int], fwd_s: Sequence[float], bwd_s: Sequence[float]
) -> RematChain:
    return RematChain(
        fwd_s=tuple(float(t) for t in fwd_s),
        bwd_s=tuple(float(t) for t in bwd_s),
        kept_bytes=tuple(float(m.kept_bytes) for m in mems),
        out_bytes=tuple(float(m.out_bytes) for m in mems),
        fwd_peak_bytes=tuple(float(m.fwd_peak_bytes) for m in mems),
        fwd_nosave_peak_bytes=tuple(float(m.fwd_nosave_peak_bytes) for m in mems),
        bwd_peak_bytes=tuple(float(m.bwd_peak_bytes) for m in mems),
        grad_bytes=tuple(float(g) for g in grads),
        free_bytes=tuple(float(m.free_bytes) for m in mems),
        out_values=tuple(tuple((float(b), last) for b, last in m.out_values) for m in mems),
    )


def remat_chain(
    chain: Chain, example_inputs: ExampleInputs, batch_size: int, *, time_scale: float = 1.0, fake: bool = True
) -> RematChain:
    """The RematChain of `chain` at `batch_size`: bytes measured at that size, times from the blocks' fitted
    `fwd_time_s`/`bwd_time_s` (times `time_scale`, e.g. to another device's speed; 0 where never timed)."""
    mems, grads = block_memory(chain, example_inputs, batch_size, fake=fake)
    fwd, bwd = _times(chain, batch_size, time_scale)
    return _remat_chain(mems, grads, fwd, bwd)
