"""Rematerialization and offloading plans for a chain: the memory model, the plan type and its exact replay.

The model (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous chains", with the offloading of
Beaumont et al. 2021), counted strictly: a schedule is a sequence of operations on the blocks of a chain, and
its peak is the most bytes ever live, transients included. Bytes are counted beyond what the caller holds
anyway: the chain's input (cut 0) and the gradient of its output (cut L), both resident.

Per block i (one micro-batch), with everything measured beyond the block's own inputs (pyplan/profile/remat.py):
  fwd_s / bwd_s        forward and backward time;
  kept_bytes           what a *saving* forward leaves: the tensors autograd saves plus the block's outputs;
  out_bytes            what a *non-saving* forward leaves: the outputs alone (the next cut);
  fwd_peak_bytes       the peak during a saving forward (≥ kept_bytes);
  fwd_nosave_peak_bytes  the peak during a non-saving forward (≥ out_bytes);
  bwd_peak_bytes       the peak during backward, counting kept_bytes with every output held, the output
                       gradient as the next block's backward makes it, the input gradient and the temporaries;
  out_values           the outputs storage by storage, as (bytes, last cut live): a value passed through later
                       blocks (a residual stream) stays live across several cuts. live_from(s, k), the bytes at
                       cut k made by blocks s..k−1, is what a checkpointed segment starting at s holds at cut k:
                       the segment's input values are held by whoever held them before;
  out_savers           for each value, the blocks whose saving forward saves it (the block itself, later blocks
                       that read it): a ReLU saves its output, a LayerNorm or a Linear its input, an add nothing;
  saves                whether the saving forward saves anything at all (an add, a view: no);
and per cut c, grad_bytes[c], the gradients of the values live at cut c as the backward of block c leaves them,
one storage counted once (an add hands the same gradient to both its inputs).

What torch holds, and so what the model counts (each measured on the fine chains of the zoo, where the model
meets the live peak of a training step to the byte, tests/runtime/test_remat.py):
  - A value lives while something holds it: the forward until its last reader has run, the saving forward of a
    saver until that saver's backward, a checkpoint whose input it is until that checkpoint's backward is done.
    So a value none of whose readers saves it dies with its last reader's saving forward (a BatchNorm output
    read by an add, the token embedding read by the add of the position embedding two blocks on, a
    checkpoint's output read by a ReLU), and one saved by a reader dies with that reader's backward.
  - The run of saving forwards since the last checkpoint (or offloaded block, or the start of a recomputation)
    *owns* the values it made, and a checkpoint's output values once it has run: these die as above. A
    checkpoint takes its input cut from the run (torch keeps its inputs with it, `saved_args`), and so does an
    offloaded block (its output waits whole for the prefetch): values the run had are then held until the
    backward of whoever made them, as are the values the forward of the caller holds.
  - A checkpoint's first pass runs its blocks without saving: its readers inside did not save a value it passes
    out, so only savers from its output cut on count (a residual value read by a LayerNorm inside the segment
    and by an add after it dies with that add).
  - A backward never holds the block's outputs unless the block saves them (their consumers' backwards are all
    done), except the chain's outputs in its first pass, which the caller holds: bwd_peak counts every output
    held, so the outputs dead by then are taken off. A stage's caller holds its outputs until the whole backward
    is done: `with_outputs_held` charges them to every other block's backward peak.
  - torch's non-reentrant checkpoint recomputes until the last tensor its first pass saved is back (early
    stop): the blocks at the end of a segment that save nothing are not run again, and their backward, which
    needs nothing saved, runs before the recomputation. A checkpoint of blocks that save nothing at all is never
    recomputed and holds nothing, not even its input: it runs as those blocks kept.
  - Where two blocks read a value, autograd sums their gradient shares; under a dispatch mode such as
    LiveMemory's it does so out of place, one gradient more for a moment (in bwd_peak, as profiled).

Operations, with `cur` the live bytes before each:
  F(i, save)    needs cut i's values; peak cur + fwd_peak; leaves kept_bytes (its outputs as values) and
                frees the owned values whose last reader i is and that no saver from their making on saved.
  F(i, nosave)  peak cur + fwd_nosave_peak; leaves the stored cut i+1: live_from(a, i+1) with a the first
                block of its checkpointed segment. Inside a segment the input (cut i) is freed once done; the
                segment's first forward takes its input cut from the run.
  F(i, offload) a saving forward whose saved tensors (kept − out) are copied to the host while the block
                computes: exposed time max(0, τ − fwd_s), τ = (kept − out)/offload_bw; frees as F(i, save),
                leaves out_bytes whole and ends the run.
  prefetch(i)   copies them back while the next operation (the backward of block i+1) computes:
                exposed max(0, τ − that op's time); the bytes are live from the prefetch on.
  B(i)          needs block i's kept bytes (unless it saves nothing) and the gradient of cut i+1; first the
                values of the run at its forward, and its own, that no saver up to i saved (and that the caller
                does not hold) die; peak cur − kept as live − grad[i+1] + bwd_peak − its dead outputs;
                frees the kept bytes and the gradient, leaves grad[i] (the formula holds whether grad[i+1] is
                counted in cur or is the resident output gradient of the chain). A block a recomputation never
                ran: peak cur − grad[i+1] + bwd_peak − out_bytes.
  free X(c)     drops the stored values of cut c (a checkpoint's output, once its consumers are done).

A plan is a nested tree, which is also how it runs in torch: a sequence of items covering consecutive blocks,
each `Keep(i)` (run block i saving), `Offload(i)` (run it saving, saved tensors moved to the host) or
`Checkpoint(inner)` (run the blocks of `inner` without saving, keep only their output; in backward, recompute
them following `inner` itself, with the output's gradient present). In torch: `Checkpoint` is
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around `inner`, nested as deep as the tree.

What the model leaves out, seen on hand-made nested plans (the first one counts less than torch holds, the others
more): a checkpoint nested inside another one's first pass keeps its own input cut until its forward returns
(the caller's frame holds the arguments), which matters when it spans several blocks and starts after its
parent; a nested checkpoint's input is kept by its parent's recomputation only until its own recomputation has
run, the model keeps it to the end of its backward; a checkpoint's input dies within the backward of its first
block, before that backward's last step (summing the input's gradient shares), the model counts it through;
a recomputation stops before a checkpoint that ends its segment (its first pass is not run again). The DP never
ends a segment with a checkpoint, and the others are rare in its plans: of about 160 distinct plans it chose for
resnet-tiny, gpt-tiny and vgg-tiny (40 budgets, 97 to 500 slots), one was predicted 6 % above its measured
peak, none below, the rest to the byte.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pyplan import _core
from pyplan.errors import InfeasibleError, PlanError
from pyplan.graph.layergraph import Affine
from pyplan.remat_plan import (
    Checkpoint,
    Keep,
    Offload,
    RematItem,
    RematPlan,
    Selective,
    SelectiveCheckpoint,
    full_remat,
    no_remat,
    periodic,
)

__all__ = [
    "BlockMemory",
    "RematBytes",
    "RematChain",
    "RematProfile",
    "RematResult",
    "Replay",
    "checkpoint_calls",
    "checkpoint_cost_s",
    "checkpoint_forward_s",
    "min_budget",
    "plan_ops",
    "remat_chain_of",
    "replay",
    "replay_ops",
    "solve",
]


@dataclass(frozen=True)
class RematChain:
    """The per-block figures of the model above, for one micro-batch (seconds and bytes)."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    kept_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    fwd_peak_bytes: tuple[float, ...]
    fwd_nosave_peak_bytes: tuple[float, ...]
    bwd_peak_bytes: tuple[float, ...]
    grad_bytes: tuple[float, ...]  # [L + 1], per cut
    out_values: tuple[tuple[tuple[float, int], ...], ...] = ()  # [L] (bytes, last cut); empty: live one cut
    # [L], one entry per output value: the blocks whose saving forward saves it (the block itself, later blocks
    # that read it), in order. Empty: every value is saved by its block and the next (held to its backward).
    out_savers: tuple[tuple[tuple[int, ...], ...], ...] = ()
    saves: tuple[bool, ...] = ()  # [L]; whether the block's saving forward saves anything. Empty: all do.
    checkpoint_s: float = 0.0  # the cost of one checkpoint call (its wrapper and recomputation bookkeeping)
    # [L]; empty: none. What block i adds to each checkpoint it is inside, beyond fwd_s: torch's hooks on its
    # saved tensors in the non-saving pass and in the recomputation (pyplan/profile/measure.py).
    checkpoint_block_s: tuple[float, ...] = ()
    # Of a checkpoint's cost (checkpoint_s and its blocks' checkpoint_block_s), the share paid in its first,
    # non-saving pass; the rest is paid in the backward (`checkpoint_forward_s`).
    checkpoint_forward_share: float = 0.0
    # [L] or empty (no block can run selectively): what block i's forward leaves under selective checkpointing
    # (its outputs and the outputs of the ops it saves), and what recomputing its other ops costs in its backward.
    selective_kept_bytes: tuple[float, ...] = ()
    selective_recompute_s: tuple[float, ...] = ()
    # [L], per output value (empty: none): whether selective checkpointing holds it to the block's backward.
    selective_holds: tuple[tuple[bool, ...], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        if not 0.0 <= self.checkpoint_forward_share <= 1.0:
            raise ValueError(f"checkpoint_forward_share is {self.checkpoint_forward_share}, it must be in [0, 1]")
        for name in ("bwd_s", "kept_bytes", "out_bytes", "fwd_peak_bytes", "fwd_nosave_peak_bytes", "bwd_peak_bytes"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, the chain has {n} blocks")
        if len(self.grad_bytes) != n + 1:
            raise ValueError(f"grad_bytes has {len(self.grad_bytes)} entries, the chain has {n + 1} cuts")
        if not self.checkpoint_block_s:
            object.__setattr__(self, "checkpoint_block_s", (0.0,) * n)
        if len(self.checkpoint_block_s) != n:
            raise ValueError(f"checkpoint_block_s has {len(self.checkpoint_block_s)} entries, the chain has {n} blocks")
        if not self.out_values:
            object.__setattr__(self, "out_values", tuple(((b, i + 1),) for i, b in enumerate(self.out_bytes)))
        if len(self.out_values) != n:
            raise ValueError(f"out_values has {len(self.out_values)} entries, the chain has {n} blocks")
        if not self.out_savers:
            savers = [(i, i + 1) if i + 1 < n else (i,) for i in range(n)]
            object.__setattr__(self, "out_savers", tuple((savers[i],) * len(v) for i, v in enumerate(self.out_values)))
        if len(self.out_savers) != n:
            raise ValueError(f"out_savers has {len(self.out_savers)} entries, the chain has {n} blocks")
        for name in ("selective_kept_bytes", "selective_recompute_s", "selective_holds"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, the chain has {n} blocks")
        if any(h and len(h) != len(v) for h, v in zip(self.selective_holds, self.out_values)):
            raise ValueError("selective_holds needs one entry per output value of each block")
        if not self.saves:
            object.__setattr__(self, "saves", (True,) * n)
        if len(self.saves) != n:
            raise ValueError(f"saves has {len(self.saves)} entries, the chain has {n} blocks")
        for i, (values, savers) in enumerate(zip(self.out_values, self.out_savers)):
            if any(not i + 1 <= last <= n for _, last in values):
                raise ValueError(f"block {i}'s output values must be live from cut {i + 1} to at most cut {n}")
            if abs(sum(b for b, _ in values) - self.out_bytes[i]) > 1e-9 * max(1.0, self.out_bytes[i]):
                raise ValueError(f"block {i}'s output values do not add up to its out_bytes")
            if len(savers) != len(values):
                raise ValueError(f"block {i} has {len(values)} output values and {len(savers)} savers")
            for (_, last), qs in zip(values, savers):
                if list(qs) != sorted(set(qs)) or any(not i <= q <= min(last, n - 1) for q in qs):
                    raise ValueError(f"block {i}'s output live to cut {last} cannot be saved by blocks {list(qs)}")
                if any(not self.saves[q] for q in qs):
                    raise ValueError(f"block {i}'s output is saved by blocks {list(qs)}, one of which saves nothing")

    def live_from(self, start: int, cut: int) -> float:
        """Bytes live at `cut` made by blocks start..cut−1."""
        return self._live[start * (len(self) + 1) + cut]

    @functools.cached_property
    def _live(self) -> tuple[float, ...]:
        n = len(self)
        out = [0.0] * (n * (n + 1))
        for s in range(n):
            total = 0.0
            # live_from(s, k) = Σ_{j=s}^{k-1} (values of j live at k): add block k−1's values, drop the ended.
            ending = [0.0] * (n + 2)
            for k in range(s + 1, n + 1):
                for b, last in self.out_values[k - 1]:
                    total += b
                    ending[last + 1] += b
                total -= ending[k]
                out[s * (n + 1) + k] = total
        return tuple(out)

    def __len__(self) -> int:
        return len(self.fwd_s)

    def with_outputs_held(self) -> RematChain:
        """The chain as a stage runs it: its outputs (the values live at its last cut) held by the caller through
        the whole backward, as a PipelineStage keeps a micro-batch's output until its backward is done and a
        trainer keeps the model's output beside the loss. The last block's backward peak counts them already;
        every other block's is charged them (the model above frees them with the last block's saved tensors).
        Measured on gpt-tiny with every block checkpointed, at 16 samples: the step peaks in an MLP block's
        backward with the 524 KB of logits still live, 501 KB above the chain's own figures."""
        n = len(self)
        held = sum(b for values in self.out_values for b, last in values if last == n)
        peaks = tuple(p + held if i < n - 1 else p for i, p in enumerate(self.bwd_peak_bytes))
        return replace(self, bwd_peak_bytes=peaks)

    def sub(self, start: int, stop: int) -> RematChain:
        """Blocks [start, stop) as a chain of their own: values live past `stop` are its outputs."""

        return RematChain(
            fwd_s=self.fwd_s[start:stop],
            bwd_s=self.bwd_s[start:stop],
            kept_bytes=self.kept_bytes[start:stop],
            out_bytes=self.out_bytes[start:stop],
            fwd_peak_bytes=self.fwd_peak_bytes[start:stop],
            fwd_nosave_peak_bytes=self.fwd_nosave_peak_bytes[start:stop],
            bwd_peak_bytes=self.bwd_peak_bytes[start:stop],
            grad_bytes=self.grad_bytes[start : stop + 1],
            out_values=tuple(tuple((b, min(last, stop) - start) for b, last in v) for v in self.out_values[start:stop]),
            out_savers=tuple(
                tuple(tuple(q - start for q in qs if q < stop) for qs in v) for v in self.out_savers[start:stop]
            ),
            saves=self.saves[start:stop],
            checkpoint_s=self.checkpoint_s,
            checkpoint_block_s=self.checkpoint_block_s[start:stop],
            checkpoint_forward_share=self.checkpoint_forward_share,
            selective_kept_bytes=self.selective_kept_bytes[start:stop],
            selective_recompute_s=self.selective_recompute_s[start:stop],
            selective_holds=self.selective_holds[start:stop],
        )

    def selective(self, blocks: frozenset[int]) -> RematChain:
        """The chain with `blocks` run under selective checkpointing, as kept blocks of other figures: each leaves
        its selective kept bytes, and its backward first recomputes the ops it did not save (one checkpoint call
        more, `checkpoint_s` and the block's `checkpoint_block_s`, split as a checkpoint's between the passes). Its
        backward peaks as a kept block's (the recomputation makes again what a saving forward saves), and the
        checkpoint holds the block's input cut until then: the block is a saver of every value live at its input,
        and of its output values it holds itself (`selective_holds`).
        """
        if not blocks:
            return self
        if not self.selective_kept_bytes:
            raise ValueError("the chain has no figures for selective checkpointing")
        kept, fwd, bwd, saves = list(self.kept_bytes), list(self.fwd_s), list(self.bwd_s), list(self.saves)
        savers = [list(map(list, v)) for v in self.out_savers]
        share = self.checkpoint_forward_share
        for i in blocks:
            call = self.checkpoint_s + self.checkpoint_block_s[i]
            kept[i] = self.selective_kept_bytes[i]
            fwd[i] += share * call
            bwd[i] += self.selective_recompute_s[i] + (1 - share) * call
            saves[i] = True
            for j in range(i):
                for x, (_, last) in enumerate(self.out_values[j]):
                    if last >= i and i not in savers[j][x]:
                        savers[j][x] = sorted([*savers[j][x], i])
            held = self.selective_holds[i] if self.selective_holds else ()
            for x, holds in enumerate(held):
                if holds and i not in savers[i][x]:
                    savers[i][x] = sorted([*savers[i][x], i])
        return replace(
            self,
            kept_bytes=tuple(kept),
            fwd_s=tuple(fwd),
            bwd_s=tuple(bwd),
            saves=tuple(saves),
            out_savers=tuple(tuple(tuple(q) for q in v) for v in savers),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: list(getattr(self, k)) for k in _VECTORS}
        out["out_values"] = [[list(v) for v in vs] for vs in self.out_values]
        out["out_savers"] = [[list(qs) for qs in v] for v in self.out_savers]
        out["saves"] = list(self.saves)
        out["checkpoint_s"] = self.checkpoint_s
        out["checkpoint_block_s"] = list(self.checkpoint_block_s)
        out["checkpoint_forward_share"] = self.checkpoint_forward_share
        out["selective_kept_bytes"] = list(self.selective_kept_bytes)
        out["selective_recompute_s"] = list(self.selective_recompute_s)
        out["selective_holds"] = [list(h) for h in self.selective_holds]
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> RematChain:
        fields: dict[str, Any] = {k: tuple(float(v) for v in data[k]) for k in _VECTORS if k in data}
        fields["out_values"] = tuple(tuple((float(b), int(c)) for b, c in vs) for vs in data.get("out_values", []))
        fields["out_savers"] = tuple(tuple(tuple(int(q) for q in qs) for qs in v) for v in data.get("out_savers", []))
        fields["saves"] = tuple(bool(v) for v in data.get("saves", []))
        fields["checkpoint_s"] = float(data.get("checkpoint_s", 0.0))
        fields["checkpoint_block_s"] = tuple(float(v) for v in data.get("checkpoint_block_s", []))
        fields["checkpoint_forward_share"] = float(data.get("checkpoint_forward_share", 0.0))
        for name in ("selective_kept_bytes", "selective_recompute_s"):
            fields[name] = tuple(float(v) for v in data.get(name, []))
        fields["selective_holds"] = tuple(tuple(bool(h) for h in v) for v in data.get("selective_holds", []))
        return RematChain(**fields)


@dataclass(frozen=True)
class BlockMemory:
    """The bytes of one block at one batch size (see the module docstring)."""

    kept_bytes: int
    out_bytes: int
    fwd_peak_bytes: int
    fwd_nosave_peak_bytes: int
    bwd_peak_bytes: int
    # (bytes, last cut live, the blocks that save it) per new output storage
    out_values: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    saves: bool = True
    # Under selective checkpointing (pyplan._torch.SELECTIVE_SAVE_OPS): what the forward leaves, outputs held, and
    # the share of the forward's time its recomputation takes (the ops it does not save, priced by a roofline).
    selective_kept_bytes: int = 0
    selective_share: float = 1.0
    # Per output value: whether selective checkpointing holds it to the block's backward (its storage is the
    # output of an op it saves, as a projection's output that is the block's output).
    selective_holds: tuple[bool, ...] = ()


@dataclass(frozen=True)
class RematBytes:
    """The bytes of one block as `per_sample·b + fixed`."""

    kept_bytes: Affine
    out_bytes: Affine
    fwd_peak_bytes: Affine
    fwd_nosave_peak_bytes: Affine
    bwd_peak_bytes: Affine
    out_values: tuple[tuple[Affine, int, tuple[int, ...]], ...] = ()  # (bytes, last cut live, savers)
    saves: bool = True
    # The last block with the loss folded in (pyplan/profile/loss.py): the peak of the loss's backward, which runs
    # before the block's own; the block's backward peak is the larger of the two at each batch size.
    loss_bwd_peak_bytes: Affine | None = None
    selective_kept_bytes: Affine | None = None  # None: not measured (a selective block then keeps what it would)
    selective_share: float = 1.0
    selective_holds: tuple[bool, ...] = ()

    def at(self, batch_size: int) -> BlockMemory:
        def value(a: Affine) -> int:
            return round(a(batch_size))

        values = tuple((value(b), last, saver) for b, last, saver in self.out_values)
        bwd_peak = value(self.bwd_peak_bytes)
        if self.loss_bwd_peak_bytes is not None:
            bwd_peak = max(bwd_peak, value(self.loss_bwd_peak_bytes))
        kept = value(self.kept_bytes)
        return BlockMemory(
            kept,
            sum(b for b, _, _ in values) if values else value(self.out_bytes),
            value(self.fwd_peak_bytes),
            value(self.fwd_nosave_peak_bytes),
            bwd_peak,
            values,
            self.saves,
            kept if self.selective_kept_bytes is None else value(self.selective_kept_bytes),
            self.selective_share,
            self.selective_holds,
        )


@dataclass(frozen=True)
class RematProfile:
    """The memory figures of a whole chain: per block, and the gradient bytes per cut (one more than blocks)."""

    blocks: tuple[RematBytes, ...]
    grad_bytes: tuple[Affine, ...]

    def chain(self, batch_size: int, fwd_s: Sequence[float], bwd_s: Sequence[float]) -> RematChain:
        """The RematChain at `batch_size`, with the blocks' forward and backward seconds at that size."""
        mems = [b.at(batch_size) for b in self.blocks]
        return remat_chain_of(mems, [round(g(batch_size)) for g in self.grad_bytes], fwd_s, bwd_s)


def remat_chain_of(
    mems: Sequence[BlockMemory], grads: Sequence[int], fwd_s: Sequence[float], bwd_s: Sequence[float]
) -> RematChain:
    """The RematChain of blocks with memory `mems`, gradient bytes per cut `grads` and these times."""
    return RematChain(
        fwd_s=tuple(float(t) for t in fwd_s),
        bwd_s=tuple(float(t) for t in bwd_s),
        kept_bytes=tuple(float(m.kept_bytes) for m in mems),
        out_bytes=tuple(float(m.out_bytes) for m in mems),
        fwd_peak_bytes=tuple(float(m.fwd_peak_bytes) for m in mems),
        fwd_nosave_peak_bytes=tuple(float(m.fwd_nosave_peak_bytes) for m in mems),
        bwd_peak_bytes=tuple(float(m.bwd_peak_bytes) for m in mems),
        grad_bytes=tuple(float(g) for g in grads),
        out_values=tuple(tuple((float(b), last) for b, last, _ in m.out_values) for m in mems),
        out_savers=tuple(tuple(savers for _, _, savers in m.out_values) for m in mems),
        saves=tuple(m.saves for m in mems),
        selective_kept_bytes=tuple(float(m.selective_kept_bytes) for m in mems),
        selective_recompute_s=tuple(m.selective_share * float(t) for m, t in zip(mems, fwd_s)),
        selective_holds=tuple(m.selective_holds for m in mems),
    )


# The per-block and per-cut vectors of a RematChain, in the order the C++ core takes them.
_VECTORS = (
    "fwd_s",
    "bwd_s",
    "kept_bytes",
    "out_bytes",
    "fwd_peak_bytes",
    "fwd_nosave_peak_bytes",
    "bwd_peak_bytes",
    "grad_bytes",
)


# One operation of a schedule: ("F", i, "save"|"nosave"|"offload"), ("B", i), ("prefetch", i), ("free", c).
Op = tuple[Any, ...]


def plan_ops(plan: RematPlan, saves: Sequence[bool] | None = None) -> list[Op]:
    """The operations that running `plan` performs, in order (see the module docstring). `saves[i]`: whether
    block i saves anything (default: every block does)."""
    ops: list[Op] = []
    _first_pass(plan, ops, saves)
    _backward(plan, ops, saves)
    return ops


def _packs(plan: RematPlan, saves: Sequence[bool] | None) -> bool:
    """Whether a checkpoint of `plan` holds anything: a block in it that saves (else torch keeps no reference to
    the checkpoint, its input included, and never recomputes it: it runs as kept blocks that save nothing)."""
    return any(
        _packs(it.inner, saves) if isinstance(it, Checkpoint) else not saves or saves[it.block] for it in plan.items
    )


def _first_pass(plan: RematPlan, ops: list[Op], saves: Sequence[bool] | None) -> None:
    for it in plan.items:
        if isinstance(it, Keep | Selective):
            ops.append(("F", it.block, "save"))
        elif isinstance(it, Offload):
            ops.append(("F", it.block, "offload"))
        elif not _packs(it.inner, saves):
            ops.extend(("F", j, "save") for j in it.inner.blocks)
        else:
            a, b = it.inner.first, it.inner.last
            selective = isinstance(it, SelectiveCheckpoint)
            for j in range(a, b + 1):
                # The last block of a selective checkpoint holds the outputs it saves to the checkpoint's backward.
                ops.append(("F", j, "nosave", "holds") if selective and j == b else ("F", j, "nosave"))
                if j > a:
                    ops.append(("free", j))
                if selective:
                    ops.append(("cache", j, b))  # the outputs it saves, from the block's forward on


def _backward(plan: RematPlan, ops: list[Op], saves: Sequence[bool] | None) -> None:
    for it in reversed(plan.items):
        if isinstance(it, Checkpoint) and not _packs(it.inner, saves):
            ops.extend(("B", j) for j in reversed(it.inner.blocks))
        elif isinstance(it, Checkpoint):
            ops.append(("free", it.inner.last + 1))
            items = it.inner.items
            # The recomputation stops once the last tensor its first pass saved is recomputed: trailing blocks
            # that save nothing are not run again, and their backward (which needs nothing) comes first.
            keep = len(items)
            while keep and not _packs(RematPlan(items[keep - 1 : keep]), saves):
                keep -= 1
            if keep < len(items):
                ops.extend(("B", j) for j in range(it.inner.last, RematPlan(items[keep : keep + 1]).first - 1, -1))
            again = RematPlan(items[:keep])
            if isinstance(it, SelectiveCheckpoint):
                # The recomputation hands back the saved outputs and runs the other ops again.
                ops.extend(("uncache", j) for j in it.inner.blocks)
                start = len(ops)
                _first_pass(again, ops, saves)
                ops[start:] = [(*op, "selective") if op[0] == "F" else op for op in ops[start:]]
            else:
                _first_pass(again, ops, saves)
            _backward(again, ops, saves)
        else:
            if isinstance(it, Offload):
                # The prefetch overlaps the backward of the next block when that is the previous operation.
                at = len(ops) - 1 if ops and ops[-1] == ("B", it.block + 1) else len(ops)
                ops.insert(at, ("prefetch", it.block))
            ops.append(("B", it.block))


@dataclass(frozen=True)
class Replay:
    """What a schedule costs: its time (compute, recompute, exposed transfers), peak and what it keeps."""

    time_s: float
    peak_bytes: float
    recompute_s: float
    transfer_s: float
    after_forward_bytes: float  # live at the end of the first forward pass: what each micro-batch in flight holds
    # The peak with the parameter gradients the backward makes counted too, from none (`param_grad_bytes`), as in
    # the first backward of a step whose gradients zero_grad freed; peak_bytes when none are given.
    peak_with_grads_bytes: float = 0.0


def replay(
    chain: RematChain,
    plan: RematPlan,
    *,
    offload_bw_bytes_per_s: float = math.inf,
    param_grad_bytes: Sequence[float] = (),
) -> Replay:
    """Run `plan` on the model of the module docstring, operation by operation, plus `checkpoint_s` per
    checkpoint call (`checkpoint_calls`) and, per such call, its blocks' `checkpoint_block_s`. With
    `param_grad_bytes` (per block), `peak_with_grads_bytes` also counts each block's parameter gradients from its
    backward on."""
    if plan.first != 0 or plan.last != len(chain) - 1:
        raise ValueError(f"the plan covers blocks {plan.first}..{plan.last}, the chain has {len(chain)}")
    selective = plan.selective_blocks()
    chain = chain.selective(selective)
    first: list[Op] = []
    _first_pass(plan, first, chain.saves)
    ops = plan_ops(plan, chain.saves)
    rep = replay_ops(
        chain,
        ops,
        offload_bw_bytes_per_s=offload_bw_bytes_per_s,
        forward_ops=len(first),
        param_grad_bytes=param_grad_bytes,
    )
    extra = checkpoint_cost_s(chain, plan)
    # A selective block's recomputation is in its backward's time already (`RematChain.selective`).
    again = sum(chain.selective_recompute_s[i] for i in selective)
    return replace(rep, time_s=rep.time_s + extra, recompute_s=rep.recompute_s + extra + again)


def _time_s(chain: RematChain, plan: RematPlan) -> float:
    """`replay(chain, plan).time_s` without offloading, from the operations alone (no memory replayed)."""
    chain = chain.selective(plan.selective_blocks())
    ops = plan_ops(plan, chain.saves)
    run = sum(_op_s(chain, op) for op in ops if op[0] in ("F", "B"))
    return run + checkpoint_cost_s(chain, plan)


def _op_s(chain: RematChain, op: Op) -> float:
    """The time of a forward or backward operation: a selective recomputation runs the ops it did not save."""
    if op[0] == "B":
        return chain.bwd_s[op[1]]
    return chain.selective_recompute_s[op[1]] if op[-1] == "selective" else chain.fwd_s[op[1]]


def _cached_bytes(chain: RematChain, j: int, last: int) -> float:
    """What a selective checkpoint's first pass keeps of block j beside its output cut: the outputs of the ops it
    saves that are not the block's outputs, and, inside the checkpoint (j < last), the block's output values it
    saves too (the stored cut that holds them is freed after the next block)."""
    if not chain.selective_kept_bytes:
        raise ValueError("the chain has no figures for selective checkpointing")
    cached = max(0.0, chain.selective_kept_bytes[j] - chain.out_bytes[j])
    if j < last and chain.selective_holds and chain.selective_holds[j]:  # the last block's: its "holds" forward
        cached += sum(b for (b, _), h in zip(chain.out_values[j], chain.selective_holds[j]) if h)
    return cached


def _call_s(chain: RematChain, inner: RematPlan) -> float:
    """What one call of a checkpoint around `inner` costs beyond running its blocks: `checkpoint_s` and its blocks'
    `checkpoint_block_s`."""
    return chain.checkpoint_s + sum(chain.checkpoint_block_s[inner.first : inner.last + 1])


def checkpoint_cost_s(chain: RematChain, plan: RematPlan) -> float:
    """What `plan`'s checkpoints cost beyond running blocks again: each call `checkpoint_calls` counts (a
    checkpoint's own, then those of its recomputation) at `_call_s`."""
    return sum(
        _call_s(chain, it.inner) + checkpoint_cost_s(chain, it.inner) for it in plan.items if isinstance(it, Checkpoint)
    )


def checkpoint_forward_s(chain: RematChain, plan: RematPlan) -> float:
    """Of `checkpoint_cost_s`, the part paid in the forward pass: `checkpoint_forward_share` of the calls the
    forward makes (a checkpoint nested in another first runs in the backward, during the outer one's
    recomputation)."""
    return chain.checkpoint_forward_share * sum(
        _call_s(chain, it.inner) for it in plan.items if isinstance(it, Checkpoint)
    )


def checkpoint_calls(plan: RematPlan) -> int:
    """Checkpoint calls a training step of `plan` makes, counting each checkpoint once per pass that runs it
    saving: its own call, then those of its recomputation (calls nested inside a non-saving pass are left out:
    an approximation, they cost the same wrapper but no bookkeeping of saved tensors)."""
    return sum(1 + checkpoint_calls(it.inner) for it in plan.items if isinstance(it, Checkpoint))


@dataclass
class _Value:
    """One copy of an output value in a replay: block `block`'s value `index`, made by a first pass or by a
    recomputation, held by `holder` (("A", i) a saving forward's output, ("X", c) a stored cut); its savers from
    block `since` on save it (a stored cut's were skipped by the non-saving pass that made it); `owned` until a
    checkpoint or an offloaded block takes its cut (see the module docstring)."""

    block: int
    index: int
    bytes: float
    last: int
    savers: tuple[int, ...]
    since: int
    recomputed: bool
    holder: tuple[str, int]
    owned: bool = True

    def saved_by(self, lo: int, hi: int) -> bool:
        """Whether a block in [max(since, lo), hi] saves it."""
        return any(max(self.since, lo) <= q <= hi for q in self.savers)


def replay_ops(
    chain: RematChain,
    ops: Sequence[Op],
    *,
    offload_bw_bytes_per_s: float = math.inf,
    forward_ops: int | None = None,
    param_grad_bytes: Sequence[float] = (),
) -> Replay:
    """Replay any operation sequence; raise ValueError when an operation lacks what it needs.

    `param_grad_bytes` (per block, empty: none): the parameter gradients block i's backward makes, which live from
    then on (model state, left out of peak_bytes); `peak_with_grads_bytes` counts them beside everything else, at
    block i's backward peak with its own (autograd accumulates them during it).

    Live objects: ("A", i) block i's kept bytes beyond its outputs (its saved tensors: the mark that its saving
    forward ran), ("X", c) the stored values of cut c (c ≥ 1; from a non-saving pass, or an offloaded block's
    outputs), ("H", i) block i's saved bytes on the host, ("G", c) the gradient of cut c, and each output value
    of a saving forward or a non-saving pass on its own (`_Value`, held by an A or an X). Cut 0 and the gradient
    of cut L are resident and not counted.
    """
    n = len(chain)
    if param_grad_bytes and len(param_grad_bytes) != n:
        raise ValueError(f"param_grad_bytes has {len(param_grad_bytes)} entries, the chain has {n} blocks")
    state = _Replaying(chain, ops, offload_bw_bytes_per_s, tuple(param_grad_bytes))
    for k, op in enumerate(ops):
        if forward_ops is not None and k == forward_ops:
            state.after_forward = state.cur
        kind = op[0]
        if kind == "F":
            state.forward(k, op)
        elif kind == "prefetch":
            state.prefetch(k, op[1])
        elif kind == "B":
            state.backward(op[1])
        elif kind == "cache":
            state.add(("S", op[1]), _cached_bytes(chain, op[1], op[2]))
        elif kind == "uncache":
            state.drop(("S", op[1]))
        elif kind == "free":
            state.free(op[1])
        else:
            raise ValueError(f"unknown operation {op!r}")
    if forward_ops is not None and forward_ops >= len(ops):
        state.after_forward = state.cur
    done = {key for key in state.live if key[0] != "X" or key[1] != 0}
    if done or state.values:
        raise ValueError(f"the schedule leaves {sorted(done)} live")
    return Replay(
        state.time_s, state.peak, state.recompute_s, state.transfer_s, state.after_forward, state.peak_with_grads
    )


@dataclass
class _Replaying:
    """The state of a replay (`replay_ops`): what is live and its bytes, the value copies, the clock and peaks."""

    chain: RematChain
    ops: Sequence[Op]
    offload_bw_bytes_per_s: float
    param_grad_bytes: tuple[float, ...]
    live: dict[tuple[str, int], float] = field(default_factory=dict)
    values: dict[int, _Value] = field(default_factory=dict)  # the live value copies, by serial
    held: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # A or X → the serials of its values
    serials: Iterator[int] = field(default_factory=itertools.count)
    cur: float = 0.0
    peak: float = 0.0
    made_grads: float = 0.0
    peak_with_grads: float = 0.0
    time_s: float = 0.0
    recompute_s: float = 0.0
    transfer_s: float = 0.0
    after_forward: float = 0.0
    computed: set[int] = field(default_factory=set)
    segment_start: dict[int, int] = field(default_factory=dict)  # stored cut c → the first block of its segment
    # block i → the owned values at its input cut when its saving forward ran, its own outputs' copies, and
    # whether that forward was a recomputation
    at_forward: dict[int, tuple[list[int], list[int], bool]] = field(default_factory=dict)

    def has_cut(self, c: int) -> bool:
        return c == 0 or ("X", c) in self.live or ("A", c - 1) in self.live

    def add(self, key: tuple[str, int], size: float) -> None:
        if key in self.live:
            raise ValueError(f"{key} is computed twice without being freed")
        self.live[key] = size
        self.cur += size

    def drop(self, key: tuple[str, int]) -> None:
        self.cur -= self.live.pop(key)
        for s in self.held.pop(key, []):
            self.drop_value(s)

    def make(self, block: int, index: int, holder: tuple[str, int], recomputed: bool, *, owned: bool = True) -> int:
        serial = next(self.serials)
        b, last = self.chain.out_values[block][index]
        since = holder[1] if holder[0] == "X" else block
        savers = self.chain.out_savers[block][index]
        self.values[serial] = _Value(block, index, b, last, savers, since, recomputed, holder, owned)
        self.held.setdefault(holder, []).append(serial)
        self.cur += b
        return serial

    def drop_value(self, serial: int) -> None:
        v = self.values.pop(serial, None)
        if v is not None:
            self.cur -= v.bytes

    def owned_at(self, cut: int) -> list[int]:
        return [s for s, v in self.values.items() if v.owned and v.block < cut <= v.last]

    def dead(self, v: _Value, i: int) -> bool:
        """Whether value v is dead during block i's backward: saved by none of its savers up to block i, and not
        an output of the chain held by the caller (a first pass's)."""
        return not v.saved_by(v.block, i) and (v.last < len(self.chain) or v.recomputed)

    def tau(self, i: int) -> float:
        return (self.chain.kept_bytes[i] - self.chain.out_bytes[i]) / self.offload_bw_bytes_per_s

    def forward(self, k: int, op: Op) -> None:
        """Block op[1]'s forward, saving ("save"), offloading ("offload") or not ("nosave")."""
        chain, i, save = self.chain, op[1], op[2]
        if not self.has_cut(i):
            raise ValueError(f"forward of block {i} without the values of cut {i}")
        t = _op_s(chain, op)
        again = i in self.computed
        if again:
            self.recompute_s += t
        self.computed.add(i)
        self.time_s += t
        if save == "nosave":
            self._nosave(k, op, again)
            return
        self.peak = max(self.peak, self.cur + chain.fwd_peak_bytes[i])
        self.peak_with_grads = max(self.peak_with_grads, self.cur + chain.fwd_peak_bytes[i] + self.made_grads)
        older = self.owned_at(i)
        for s in older:  # the values whose last reader this is, saved by none of their readers, die
            v = self.values[s]
            if v.last == i and not v.saved_by(v.block, i):
                self.drop_value(s)
        older = [s for s in older if s in self.values]
        if save == "offload":
            exposed = max(0.0, self.tau(i) - t)
            self.time_s += exposed
            self.transfer_s += exposed
            for s in self.owned_at(i + 1):  # an offloaded block's output waits whole: the run of owned values ends
                self.values[s].owned = False
            self.add(("X", i + 1), chain.out_bytes[i])
            self.segment_start[i + 1] = i
            self.live[("H", i)] = 0.0
            self.at_forward[i] = (older, [], again)
        else:
            self.add(("A", i), chain.kept_bytes[i] - chain.out_bytes[i])
            own = [self.make(i, x, ("A", i), again) for x in range(len(chain.out_values[i]))]
            self.at_forward[i] = (older, own, again)

    def _nosave(self, k: int, op: Op, again: bool) -> None:
        """A forward that saves nothing: its outputs stored at the next cut, with those of its segment."""
        chain, ops, i = self.chain, self.ops, op[1]
        self.peak = max(self.peak, self.cur + chain.fwd_nosave_peak_bytes[i])
        self.peak_with_grads = max(self.peak_with_grads, self.cur + chain.fwd_nosave_peak_bytes[i] + self.made_grads)
        # Inside a segment (its input is freed right after), the segment's values live on.
        inside = k + 1 < len(ops) and ops[k + 1] == ("free", i) and ("X", i) in self.live
        start = self.segment_start[i] if inside else i
        if not inside:
            for s in self.owned_at(i):  # the checkpoint holds its input until its backward is done
                self.values[s].owned = False
        self.segment_start[i + 1] = start
        self.add(("X", i + 1), 0.0)
        kept_out = chain.selective_holds[i] if op[-1] == "holds" and chain.selective_holds else ()
        for j in range(start, i + 1):
            for x, (_, last) in enumerate(chain.out_values[j]):
                if last >= i + 1:
                    serial = self.make(j, x, ("X", i + 1), again)
                    if j == i and x < len(kept_out) and kept_out[x]:
                        self.values[serial].owned = False  # no reader frees it: the checkpoint holds it

    def prefetch(self, k: int, i: int) -> None:
        """Block i's saved tensors back from the host, overlapping the next backward if there is one."""
        if ("H", i) not in self.live:
            raise ValueError(f"prefetch of block {i}, which was not offloaded")
        del self.live[("H", i)]
        nxt = self.ops[k + 1] if k + 1 < len(self.ops) else None
        overlap = self.chain.bwd_s[nxt[1]] if nxt is not None and nxt[0] == "B" and nxt[1] != i else 0.0
        exposed = max(0.0, self.tau(i) - overlap)
        self.time_s += exposed
        self.transfer_s += exposed
        self.drop(("X", i + 1))
        self.add(("A", i), self.chain.kept_bytes[i] - self.chain.out_bytes[i])
        older, _, again = self.at_forward[i]
        own = [self.make(i, x, ("A", i), again, owned=False) for x in range(len(self.chain.out_values[i]))]
        self.at_forward[i] = (older, own, again)

    def backward(self, i: int) -> None:
        """Block i's backward: at its peak every output still held, then its saved tensors and the gradient of
        its output cut freed, the gradient of its input cut made."""
        chain, n = self.chain, len(self.chain)
        ran = ("A", i) in self.live
        if chain.saves[i] and not ran:
            raise ValueError(f"backward of block {i} without its saved tensors")
        if ran and not self.has_cut(i):
            raise ValueError(f"backward of block {i} without the values of cut {i}")
        if i < n - 1 and ("G", i + 1) not in self.live:
            raise ValueError(f"backward of block {i} before the gradient of cut {i + 1}")
        older, own, _ = self.at_forward.pop(i, ([], [], False)) if ran else ([], [], False)
        for s in older + own:  # what nobody holds any more by now: saved by none of its readers so far
            if s in self.values and self.dead(self.values[s], i):
                self.drop_value(s)
        # bwd_peak counts every output held; those dead now are not (a block that never ran: a recomputation
        # stopped before it, all its outputs).
        if ran:
            copies = [self.values[s] for s in own if s in self.values]
            gone = sum(b for x, (b, _) in enumerate(chain.out_values[i]) if all(v.index != x for v in copies))
            held_now = self.live[("A", i)] + sum(v.bytes for v in copies)
        else:
            gone, held_now = chain.out_bytes[i], 0.0
        at_peak = self.cur - held_now - chain.grad_bytes[i + 1] + chain.bwd_peak_bytes[i] - gone
        self.peak = max(self.peak, at_peak)
        if self.param_grad_bytes:
            self.made_grads += self.param_grad_bytes[i]
        self.peak_with_grads = max(self.peak_with_grads, at_peak + self.made_grads)
        self.time_s += chain.bwd_s[i]
        if ran:
            self.drop(("A", i))
        if i < n - 1:
            self.drop(("G", i + 1))
        if i > 0:
            self.add(("G", i), chain.grad_bytes[i])

    def free(self, i: int) -> None:
        """The stored values of cut i freed (a segment's input, once its recomputation has its own)."""
        if ("X", i) not in self.live:
            raise ValueError(f"free of cut {i}, which is not stored")
        if i < len(self.chain) and ("A", i) in self.live:
            raise ValueError(f"free of cut {i} while block {i}'s saved tensors (which hold it) are live")
        self.drop(("X", i))


@dataclass(frozen=True)
class RematResult:
    """The plan `solve` chose and what it costs, replayed in bytes (no slots)."""

    plan: RematPlan
    time_s: float
    peak_bytes: float
    recompute_s: float
    transfer_s: float
    after_forward_bytes: float
    budget_bytes: float
    min_budget_bytes: float  # the least peak any allowed plan reaches


def _plan_of_steps(steps: Sequence[tuple[str, int]], offset: int) -> RematPlan:
    stack: list[list[RematItem]] = [[]]
    for token, block in steps:
        if token == "keep":
            stack[-1].append(Keep(block + offset))
        elif token == "offload":
            stack[-1].append(Offload(block + offset))
        elif token == "begin":
            stack.append([])
        else:
            inner = RematPlan(tuple(stack.pop()))
            stack[-1].append(Checkpoint(inner))
    return RematPlan(tuple(stack[0]))


def _arrays(chain: RematChain) -> list[Any]:
    """The chain as the C++ core takes it: the per-block and per-cut vectors, every output value as (block,
    bytes, last cut, savers), and which blocks save anything."""
    values = [
        (i, b, last, list(savers))
        for i, (vs, qs) in enumerate(zip(chain.out_values, chain.out_savers))
        for (b, last), savers in zip(vs, qs)
    ]
    return [*(list(getattr(chain, k)) for k in _VECTORS), values, list(chain.saves)]


def min_budget(chain: RematChain, *, offload: bool = False, max_depth: int | None = None) -> float:
    """The least peak (bytes) of any plan: below it no budget is feasible."""
    return _core.remat_min_peak(*_arrays(chain), offload=offload, max_depth=-1 if max_depth is None else max_depth)


def _no_worse_than_baselines(
    chain: RematChain, plan: RematPlan, rep: Replay, max_depth: int | None, fits: Callable[[Replay], bool]
) -> tuple[RematPlan, Replay]:
    """`plan`, or a faster plan everyone has that fits (keep all, checkpoint_sequential's segment counts,
    checkpoint every block): slots round every size up, so a plan that fits in bytes may not fit in slots."""
    n = len(chain)
    checkpoints = max_depth is None or max_depth >= 1
    # checkpoint_sequential's plan depends on the segment size alone: one segment count per size.
    counts = {-(-n // k): k for k in range(n, 0, -1)}.values() if checkpoints else ()
    others = (full_remat(0, n), *(periodic(0, n, k) for k in counts)) if checkpoints else ()
    for other in (no_remat(0, n), *others):
        if _time_s(chain, other) >= rep.time_s:
            continue  # no faster: its memory does not matter
        got = replay(chain, other)
        if fits(got):
            plan, rep = other, got
    return plan, rep


def solve(
    chain: RematChain,
    budget_bytes: float,
    *,
    slots: int = 500,
    offload_bw_bytes_per_s: float | None = None,
    max_depth: int | None = None,
    in_flight: int = 1,
    first_block: int = 0,
    baselines: bool = True,
) -> RematResult:
    """The least-time plan whose peak stays within `budget_bytes` (the C++ DP of pyplan/remat.h).

    Memory is discretized into `slots` (1 to `_core.MAX_REMAT_SLOTS`; sizes rounded up, the budget down), so the
    plan always fits in bytes; it is optimal up to that rounding, exactly optimal when every size is a multiple of
    budget/slots. `offload_bw`
    enables offloading over a link of that bandwidth; `max_depth` limits checkpoint nesting (1: checkpoint sets,
    as checkpoint_sequential; None: unbounded, Rotor); `in_flight` micro-batches held at once must fit as
    peak + (in_flight − 1)·after_forward. Block indices of the plan start at `first_block`. With `baselines`,
    no remat, full remat and every `checkpoint_sequential` segment count are replayed too (in bytes), and one of
    them is returned when it is faster and fits: slot rounding can hide such a plan from the DP.
    Raises InfeasibleError naming the least budget when nothing fits.
    """
    bw = offload_bw_bytes_per_s or 0.0

    def dp(budget: float) -> Any:
        try:
            return _core.remat(
                *_arrays(chain),
                # An unlimited budget is the most memory any input may name (the core's bound, far past any device).
                budget_bytes=min(budget, _core.MAX_BYTES),
                slots=slots,
                offload_bw_bytes_per_s=bw,
                max_depth=-1 if max_depth is None else max_depth,
                in_flight=in_flight,
                checkpoint_s=chain.checkpoint_s,
                checkpoint_block_s=list(chain.checkpoint_block_s),
            )
        except ValueError as exc:
            raise PlanError(f"rematerialization: {exc}") from None

    def fits(rep: Replay) -> bool:
        return rep.peak_bytes + (in_flight - 1) * rep.after_forward_bytes <= budget_bytes

    r = dp(budget_bytes)
    if not r.feasible and r.min_budget_bytes <= budget_bytes:
        # A plan fits in bytes, but slots round every size up and hide the plans at the edge of the budget (as
        # at exactly the least budget): ask with a few slots more and keep an answer whose replay fits in bytes.
        for extra in (1, 4, 16, slots / 10):
            wider = dp(budget_bytes * (1 + extra / slots))
            if wider.feasible and fits(
                replay(chain, _plan_of_steps(wider.plan, 0), offload_bw_bytes_per_s=bw or math.inf)
            ):
                r = wider
                break
    if not r.feasible:
        raise InfeasibleError(f"rematerialization: {r.reason}")
    plan = _plan_of_steps(r.plan, 0)
    rep = replay(chain, plan, offload_bw_bytes_per_s=bw if bw > 0 else math.inf)
    if baselines:
        plan, rep = _no_worse_than_baselines(chain, plan, rep, max_depth, fits)
    return RematResult(
        plan=plan.shifted(first_block) if first_block else plan,
        time_s=rep.time_s,
        peak_bytes=rep.peak_bytes,
        recompute_s=rep.recompute_s,
        transfer_s=rep.transfer_s,
        after_forward_bytes=rep.after_forward_bytes,
        budget_bytes=budget_bytes,
        min_budget_bytes=r.min_budget_bytes,
    )
