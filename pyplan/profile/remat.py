"""The figures of the rematerialization model (pyplan.solve.remat) per block, measured on fake or real tensors.

Each block runs alone as `piece(chain, i, i + 1)`, on the values of cut i that running the blocks before it
produced, received as a pipeline stage receives them (fresh tensors that need grad when float, behind an identity
whose backward keeps the gradient that reaches them; the model's own inputs need none). `LiveMemory` counts what
the block allocates beyond those inputs, parameters and buffers. The blocks are measured from the last one back,
so that each receives its output gradients as the next block's backward makes them:

  kept_bytes             live after a saving forward, with the outputs held: saved tensors and outputs;
  fwd_peak_bytes         the peak of that forward;
  out_bytes              live after a non-saving forward, as a checkpointed segment runs it the first time (grad
                         enabled, every saved tensor dropped by a saved-tensors hook): the new output storages
                         (a value passed through or a view of an input is held by whoever made it);
  out_values             those storages one by one, as (bytes, last cut live, savers): the last cut each is live at
                         (a residual stream lives across several cuts: a checkpointed segment holds it at its
                         output cut), and the blocks whose saving forward saves that storage (the block itself,
                         later blocks that read it), found from the storages each block saves in a third forward
                         under a saved-tensors hook; none for a BatchNorm output read by an add or a residual sum
                         read by a ReLU;
  saves                  whether the block's saving forward saves any tensor at all (parameters included): an add,
                         a view or a flatten saves none, so a recomputation that reaches it stops before it;
  fwd_nosave_peak_bytes  the peak of the non-saving forward;
  bwd_peak_bytes         the peak of the backward from the saving forward's outputs, held: kept bytes, output
                         gradients (made by autograd when the backward starts and freed once used, one storage
                         for the outputs whose gradients the next block's backward makes as one, e.g. an add's),
                         input gradients (kept to the end, as the block before receives them) and temporaries;
                         parameter gradients are left out (model state). An output that is an input only passed on
                         is not backpropagated: its gradient, made before, lives on beside the backward. One the
                         block also reads gets its gradient from the next block as an output gradient too, and
                         autograd sums the block's share into it (out of place under a dispatch mode such as
                         LiveMemory's, so the sum is counted);
  grad_bytes[c]          the gradients of cut c's values as the backward of block c leaves them, each storage once
                         (an add hands its output's gradient to both its inputs); the model's own inputs get none,
                         the model's outputs one each (numel x element size).

Bytes are exactly affine in the batch size, so two batch sizes give `RematBytes` as `Affine`s.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from pyplan._torch import (
    OpRecorder,
    SelectiveForward,
    is_meta_module,
    never_unpacked,
    run_without_compute,
    saving_nothing,
    selective_saves,
    storage_key,
    tensor_leaves,
)
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.split import pieces
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.analytic import OpCost, Roofline, op_class
from pyplan.profile.autocast import AutocastAbove
from pyplan.profile.live import LiveMemory
from pyplan.profile.pieces import RepeatedBlocks, block_inputs, leaf_inputs
from pyplan.solve.remat import BlockMemory, RematBytes, RematChain, RematProfile, remat_chain_of

__all__ = ["block_memory", "remat_bytes", "remat_chain"]


# Which values of a cut share a gradient storage, as the backward of the block that reads them makes them (an add
# hands its output's gradient to both its inputs, a split's are views of one): groups of positions among the cut's
# values, with the bytes of each group's storage.
Gradients = tuple[tuple[tuple[int, ...], int], ...]
# A new context for each forward a block runs (autocast's casts, or nothing).
Casts = Callable[[], contextlib.AbstractContextManager[Any]]


class _OutputGradients(torch.autograd.Function):
    """A scalar whose backward hands autograd the gradients of `outputs` as the next block's backward makes them:
    one storage per group (`group[v]` the group of output v, `sizes[g]` its bytes), ones of output v's shape,
    made when the backward starts and freed once used, except the groups given in `held` (already made, and
    kept by the caller: the gradient of a value only passed through, which lives on)."""

    @staticmethod
    def forward(
        ctx: Any, group: Sequence[int], sizes: Sequence[int], held: dict[int, torch.Tensor], *outputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.like = [(t.shape, t.dtype, t.device) for t in outputs]
        ctx.group, ctx.sizes, ctx.held = group, sizes, held
        return torch.zeros((), device=outputs[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        made = dict(ctx.held)
        out = []
        for (shape, dtype, device), g in zip(ctx.like, ctx.group):
            if g not in made:
                made[g] = _storage(ctx.sizes[g], dtype, device)
            out.append(_view(made[g], shape))
        return (None, None, None, *out)


def _storage(nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A gradient storage of `nbytes` (ones), as a flat tensor of `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.ones(max(1, nbytes // size), dtype=dtype, device=device)


def _view(flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A gradient of `shape` on the storage `flat`: a view, or a broadcast one where the storage is smaller (a
    sum's gradient is its output gradient expanded)."""
    numel = math.prod(shape)
    return flat[:numel].view(shape) if numel <= flat.numel() else flat[:1].expand(shape)


class _Capture(torch.autograd.Function):
    """The identity on one block input; its backward keeps the gradient that reaches it (summed by autograd over
    every reader, as the node of the block that made the value would receive it) and passes nothing on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sink: list[torch.Tensor]) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.sink.append(grad)
        return None, None


def _values(out: Any, last: bool) -> list[Any]:
    """A block's outputs as the values of its output cut (the model's outputs: their tensors, in order)."""
    if last:
        return tensor_leaves(out)
    return list(out) if isinstance(out, tuple) else [out]


def _gradient_groups(grads: Sequence[torch.Tensor | None]) -> Gradients:
    """The groups of positions whose gradients share a storage, with its bytes (no gradient: no group)."""
    groups: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for k, g in enumerate(grads):
        if g is not None:
            key = storage_key(g)
            groups.setdefault(key, []).append(k)
            sizes[key] = g.untyped_storage().nbytes()
    return tuple((tuple(ks), sizes[key]) for key, ks in groups.items())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class _Saves:
    """What one block's saving forward saves: anything at all, which of its inputs (positions among the input
    tensors) and which of its output values (in out_values' order)."""

    any: bool
    inputs: frozenset[int]
    outputs: tuple[bool, ...]


# The roofline that prices a block's ops to find the share of its forward a selective recomputation takes, where
# no device's is given: one of a CPU core (100 GFLOP/s, 10 GB/s).
NOMINAL_ROOFLINE = Roofline({"fp32": 1e11, "fp64": 1e11, "bf16": 1e11, "fp16": 1e11}, 1e10)


def _selective_share(ops: Sequence[tuple[str, float, float, str, bool, float]], roofline: Roofline) -> float:
    """The share of a forward's roofline time in the ops selective checkpointing does not save."""
    saves = selective_saves([name for name, *_ in ops])
    times = [
        (save, roofline.op_time_s(OpCost(name, op_class(name), flops, nbytes, dtype, view)))
        for save, (name, flops, nbytes, dtype, view, _) in zip(saves, ops, strict=True)
    ]
    total = sum(t for _, t in times)
    return sum(t for saved, t in times if not saved) / total if total > 0 else 0.0


def _measure_block(
    mod: fx.GraphModule,
    args: Sequence[Any],
    first: bool,
    lasts: Iterable[int],
    incoming: Gradients | None,
    roofline: Roofline,
    casts: Casts = contextlib.nullcontext,
) -> tuple[BlockMemory, Gradients, _Saves, int]:
    """One block's figures (savers not yet known), how the gradients of its input cut come out of its backward,
    what it saves, and the bytes of its output cut's gradients. `lasts[v]` is the last cut where output v is
    live; `incoming`: how the gradients of its output cut arrive (None for the model's outputs: one storage each)."""
    params = list(mod.parameters())
    for p in params:
        p.grad = None
    leaves = leaf_inputs(args, first=first)
    sinks: list[list[torch.Tensor]] = [[] for _ in leaves]
    inputs = [
        _Capture.apply(a, sinks[k]) if isinstance(a, torch.Tensor) and a.requires_grad else a
        for k, a in enumerate(leaves)
    ]
    read = _read_inputs(mod)
    with LiveMemory() as mem:
        with casts():
            out = mod(*inputs)
        kept = mem.current_bytes
        fwd_peak = mem.peak_bytes
        outs = _values(out, incoming is None)
        wanted = [k for k, t in enumerate(outs) if isinstance(t, torch.Tensor) and t.requires_grad]
        groups = incoming if incoming is not None else tuple(((k,), _nbytes(outs[k])) for k in wanted)
        group = {k: g for g, (members, _) in enumerate(groups) for k in members}
        # An output no later block backpropagates into (a float mask the layers read without grad) gets none.
        wanted = [k for k in wanted if k in group]
        # An input only passed on is not backpropagated through the block: its gradient (made by later blocks)
        # lives on beside it. Every other output's gradient is handed to autograd, which sums the block's share
        # into it where the block also reads that input (out of place under a dispatch mode such as LiveMemory's).
        through = {k: j for k, t in enumerate(outs) for j, a in enumerate(inputs) if t is a and j not in read}
        roots = [k for k in wanted if k not in through]
        start = mem.mark()
        held = {group[k]: _storage(groups[group[k]][1], outs[k].dtype, outs[k].device) for k in through if k in group}
        if roots:
            source = _OutputGradients.apply(
                [group[k] for k in roots], [size for _, size in groups], held, *[outs[k] for k in roots]
            )
            seed = torch.ones_like(source)
            mem.ignore([source, seed])  # the scalar and its gradient are scaffolding
            source.backward(seed)
            del source, seed
    mem.ignore(p.grad for p in params if p.grad is not None)
    bwd_peak = mem.peak_bytes_since(start)
    # The gradients of the input cut: what reached each input read, or that of the output it is passed on as.
    passed_as = {j: k for k, j in through.items()}
    grads = [
        held.get(group.get(passed_as[j], -1)) if j in passed_as else (sinks[j][0] if sinks[j] else None)
        for j in range(len(inputs))
    ]
    made = () if first else _gradient_groups(grads)
    del out, outs, held, grads, sinks, inputs
    for p in params:
        p.grad = None

    nosave_peak, out_values = _nosave_forward(mod, args, first, lasts, casts)
    out_bytes = sum(size for size, _, _ in out_values)
    selective_kept, holds, recorded = _selective_forward(mod, args, first, casts)
    if len(holds) != len(out_values):
        raise RuntimeError(f"selective checkpointing changed the block's outputs ({len(holds)}, not {len(out_values)})")
    memory = BlockMemory(
        kept,
        out_bytes,
        fwd_peak,
        max(nosave_peak, out_bytes),
        bwd_peak,
        out_values,
        selective_kept_bytes=selective_kept,
        selective_share=_selective_share(recorded, roofline),
        selective_holds=holds,
    )
    return memory, made, _saved_by(mod, args, first, casts), sum(size for _, size in groups)


def _nosave_forward(
    mod: fx.GraphModule, args: Sequence[Any], first: bool, lasts: Iterable[int], casts: Casts
) -> tuple[int, tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """A non-saving forward's peak, and the outputs it leaves, value by value with the last cut each is live at:
    new storages only (a value passed through, or a view of an input, is held by whoever made it)."""
    leaves = leaf_inputs(args, first=first)
    with LiveMemory() as mem, saving_nothing(), casts():
        out = mod(*leaves)
        nosave_peak = mem.peak_bytes
    before = {storage_key(t) for t in tensor_leaves(list(leaves))}
    values: dict[Any, list[int]] = {}
    for t, last in zip(tensor_leaves(out), lasts):
        key = storage_key(t)
        if key not in before:
            size_last = values.setdefault(key, [t.untyped_storage().nbytes(), last])
            size_last[1] = max(size_last[1], last)
    del out
    return nosave_peak, tuple((size, last, ()) for size, last in values.values())


def _selective_forward(
    mod: fx.GraphModule, args: Sequence[Any], first: bool, casts: Casts
) -> tuple[int, tuple[bool, ...], list[Any]]:
    """Selective checkpointing: what the forward leaves (its outputs and the outputs of the ops it saves; the
    checkpoint holds the block's inputs, made before), whether it holds each new output, and the ops it ran (its
    recomputation runs again those it does not save)."""
    leaves = leaf_inputs(args, first=first)
    before = {storage_key(t) for t in tensor_leaves(list(leaves))}
    recorder = OpRecorder()
    with LiveMemory() as mem, recorder:
        with casts(), SelectiveForward() as selective:
            out = mod(*leaves)
        selective_kept = mem.current_bytes
        keys = list(dict.fromkeys(k for t in tensor_leaves(out) if (k := storage_key(t)) not in before))
        del out
        holds = tuple(mem.holds(k) for k in keys)  # held by the checkpoint's cache (`selective.kept`) or not
        del selective
    return selective_kept, holds, list(recorder.ops)


def _read_inputs(mod: fx.GraphModule) -> set[int]:
    """The positions of the block's inputs that some operation reads (not only returned as they are)."""
    return {
        k
        for k, node in enumerate(n for n in mod.graph.nodes if n.op == "placeholder")
        if any(user.op != "output" for user in node.users)
    }


def _saved_by(mod: fx.GraphModule, args: Sequence[Any], first: bool, casts: Casts) -> _Saves:
    """Which storages the block's saving forward saves: a forward whose saved-tensors hook collects each tensor
    it is given (held until compared, so that no storage identity is reused meanwhile)."""
    saved: list[torch.Tensor] = []
    leaves = leaf_inputs(args, first=first)
    with torch.autograd.graph.saved_tensors_hooks(saved.append, never_unpacked), casts():
        out = mod(*leaves)
    keys = {storage_key(t) for t in saved}
    ins = tensor_leaves(list(leaves))
    inputs = {storage_key(t) for t in ins}
    new: dict[int, bool] = {}
    for t in tensor_leaves(out):
        key = storage_key(t)
        if key not in inputs:
            new[key] = key in keys
    inputs_saved = frozenset(k for k, t in enumerate(ins) if storage_key(t) in keys)
    return _Saves(bool(saved), inputs_saved, tuple(new.values()))


def _savers(
    args: Sequence[Sequence[Any]], saves: Sequence[_Saves], i: int, lasts: Sequence[int]
) -> list[tuple[int, ...]]:
    """For each value block i outputs (new storages, in order, with the last cut each is live at), the blocks whose
    saving forward saves its storage: block i itself and the later blocks that read it at their input cut.
    `args[c]` are cut c's values (the storages are followed under any name, as in _last_cuts)."""
    n = len(args)
    if i == n - 1:
        return [(i,) if own else () for own in saves[i].outputs]
    before = {storage_key(t) for t in tensor_leaves(list(args[i]))}
    keys = list(dict.fromkeys(k for k in map(storage_key, tensor_leaves(list(args[i + 1]))) if k not in before))
    out = []
    for key, own, last in zip(keys, saves[i].outputs, lasts, strict=True):
        savers = [i] if own else []
        for c in range(i + 1, min(last, n - 1) + 1):
            held = tensor_leaves(list(args[c]))
            if any(storage_key(held[k]) == key for k in saves[c].inputs):
                savers.append(c)
        out.append(tuple(savers))
    return out


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
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_size: int,
    *,
    fake: bool = True,
    roofline: Roofline | None = None,
    autocast: torch.dtype | None = None,
    blocks: RepeatedBlocks | None = None,
) -> tuple[list[BlockMemory], list[int]]:
    """Every block's bytes at `batch_size`, and the gradient bytes per cut (index 0: the model's inputs, none).

    `fake` runs on fake tensors (meta for a model built on the meta device): nothing is computed or allocated;
    otherwise the blocks really run, on the model's own weights (left as they were, gradients and buffers
    included). Inputs go to the device of the model's parameters. `roofline` prices the ops of each block for
    the share of its forward a selective recomputation takes (default: `NOMINAL_ROOFLINE`). With `autocast` (a
    16-bit dtype) every forward runs under CUDA autocast's casts (`AutocastAbove`): the bytes are the ones a
    mixed-precision step holds, its 16-bit copies of the weights and inputs of products, its fp32 norms and
    residuals. `blocks`: the chain's table of distinct blocks, when the caller has it already.
    """

    def casts() -> contextlib.AbstractContextManager[Any]:
        """A new cast cache for each forward, as autocast's lives for its region."""
        return AutocastAbove(autocast) if autocast is not None else contextlib.nullcontext()

    roof = roofline or NOMINAL_ROOFLINE
    inputs = inputs_at(example_inputs, batch_size)
    gm = chain.graph.module
    device = next((p.device for p in gm.parameters() if not p.is_meta), torch.device("cpu"))

    def measure(convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[BlockMemory], list[int]]:
        # A block that repeats an earlier one (a transformer layer, a ResNet bottleneck; meta models only) on
        # inputs of the same kind, whose values live as far past it, has the same figures: measured once. In
        # block_inputs its outputs are made like the earlier block's, so that the cuts' values share storages as
        # running it would (_last_cuts and _savers follow them).
        if blocks is not None and blocks.enabled:
            repeated = blocks
        else:  # inside the fake context: get_attr values are copied from the stand-ins
            repeated = RepeatedBlocks(pieces(chain), chain.graph.module)
        mods = repeated.mods
        with casts():
            args = block_inputs(mods, [convert(t.to(device)) for t in inputs], repeated)
        n = len(mods)
        done: dict[Any, tuple[BlockMemory, Gradients, _Saves, int]] = {}
        figures: list[BlockMemory] = [BlockMemory(0, 0, 0, 0, 0)] * n
        saves: list[_Saves] = [_Saves(True, frozenset(), ())] * n
        made: list[Gradients] = [()] * n  # how each cut's gradients come out of its reader's backward
        grads = [0] * (n + 1)
        # From the last block back: a block's backward receives its output cut's gradients as the next one makes
        # them.
        with torch.enable_grad():
            for i in reversed(range(n)):
                mod, a = mods[i], args[i]
                lasts = _last_cuts(args, i)
                incoming = made[i + 1] if i + 1 < n else None
                key = repeated.key(i, leaf_inputs(a, first=i == 0))
                # The last block's outputs live to the end (an endless iterator): measured, never reused.
                reuse = None if key is None or i == n - 1 else (key, tuple(c - i for c in lasts), incoming)
                if reuse is not None and reuse in done:
                    fig, made[i], saves[i], grads[i + 1] = done[reuse]
                    fig = replace(fig, out_values=tuple((b, last + i, ()) for b, last, _ in fig.out_values))
                else:
                    fig, made[i], saves[i], grads[i + 1] = _measure_block(mod, a, i == 0, lasts, incoming, roof, casts)
                    if reuse is not None:
                        relative = tuple((b, c - i, ()) for b, c, _ in fig.out_values)
                        done[reuse] = (replace(fig, out_values=relative), made[i], saves[i], grads[i + 1])
                figures[i] = fig
        for i, fig in enumerate(figures):
            lasts = [last for _, last, _ in fig.out_values]
            savers = _savers(args, saves, i, lasts)
            values = tuple((b, last, q) for (b, last, _), q in zip(fig.out_values, savers, strict=True))
            figures[i] = replace(fig, out_values=values, saves=saves[i].any)
        return figures, grads

    if fake:
        return run_without_compute(gm, measure)
    with _state_kept(gm):
        return measure(lambda t: t)


def remat_bytes(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_sizes: tuple[int, int],
    *,
    fake: bool = True,
    roofline: Roofline | None = None,
    autocast: torch.dtype | None = None,
    blocks: RepeatedBlocks | None = None,
) -> RematProfile:
    """Every block's bytes as `per_sample·b + fixed`, from two batch sizes (exact: bytes are affine in b); the
    selective recomputation's share of each forward at the larger size, priced by `roofline`.

    Bytes are in the chain's units, fp32 as traced, which the search scales by the precision's activation scale
    (a 16-bit precision: 1/2). With `autocast` (as `block_memory` takes it) they are recorded as the step holds
    them, so they are given over that scale: the real bytes once the search has scaled them. `blocks` as
    `block_memory` takes it."""
    b1, b2 = batch_sizes
    if b1 == b2:
        raise ValueError(f"two distinct batch sizes are needed, got {b1} twice")
    # The pieces of a meta model made once for both sizes (a fake model's are made in each fake context).
    table = RepeatedBlocks.of(chain) if blocks is None and is_meta_module(chain.graph.module) else blocks
    m1, g1 = block_memory(chain, example_inputs, b1, fake=fake, roofline=roofline, autocast=autocast, blocks=table)
    m2, g2 = block_memory(chain, example_inputs, b2, fake=fake, roofline=roofline, autocast=autocast, blocks=table)
    units = 1.0 if autocast is None else autocast.itemsize / 4  # a 16-bit precision's activation_scale

    def from_two(x: float, y: float) -> Affine:
        return Affine.from_two(b1, x / units, b2, y / units)

    def line(name: str, x: BlockMemory, y: BlockMemory) -> Affine:
        return from_two(getattr(x, name), getattr(y, name))

    others = ("out_values", "saves", "selective_share", "selective_holds")
    names = [n for n in BlockMemory.__dataclass_fields__ if n not in others]

    def values(x: BlockMemory, y: BlockMemory) -> tuple[tuple[Affine, int, tuple[int, ...]], ...]:
        if [v[1:] for v in x.out_values] != [v[1:] for v in y.out_values] or x.saves != y.saves:
            raise ValueError("a block's outputs differ between the two batch sizes")
        return tuple(
            (from_two(bx, by), last, saver) for (bx, last, saver), (by, _, _) in zip(x.out_values, y.out_values)
        )

    blocks = tuple(
        RematBytes(
            **{n: line(n, x, y) for n in names},
            out_values=values(x, y),
            saves=x.saves,
            selective_share=y.selective_share,
            selective_holds=y.selective_holds,
        )
        for x, y in zip(m1, m2)
    )
    return RematProfile(blocks, tuple(from_two(x, y) for x, y in zip(g1, g2)))


def _times(chain: Chain, batch_size: int, time_scale: float) -> tuple[list[float], list[float]]:
    """The blocks' seconds at `batch_size`; 0 for blocks never timed (a memory-only chain)."""
    fwd = [b.fwd_time_s(batch_size) * time_scale if b.fwd_time_s else 0.0 for b in chain.blocks]
    bwd = [b.bwd_time_s(batch_size) * time_scale if b.bwd_time_s else 0.0 for b in chain.blocks]
    return fwd, bwd


def remat_chain(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_size: int,
    *,
    time_scale: float = 1.0,
    fake: bool = True,
    roofline: Roofline | None = None,
) -> RematChain:
    """The RematChain of `chain` at `batch_size`: bytes measured at that size, times from the blocks' fitted
    `fwd_time_s`/`bwd_time_s` (times `time_scale`, e.g. to another device's speed; 0 where never timed)."""
    mems, grads = block_memory(chain, example_inputs, batch_size, fake=fake, roofline=roofline)
    fwd, bwd = _times(chain, batch_size, time_scale)
    return remat_chain_of(mems, grads, fwd, bwd)
