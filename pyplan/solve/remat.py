"""Rematerialization and offloading plans for a chain: the memory model, the plan type and its exact replay.

The model (Beaumont et al. 2019, "Optimal checkpointing for heterogeneous chains", with the offloading of
Beaumont et al. 2021), counted strictly: a schedule is a sequence of operations on the blocks of a chain, and
its peak is the most bytes ever live, transients included. Bytes are counted beyond what the caller holds
anyway: the chain's input (cut 0) and the gradient of its output (cut L), both resident.

Per block i (one micro-batch), with everything measured beyond the block's own inputs:
  fwd_s / bwd_s        forward and backward time;
  kept_bytes           what a *saving* forward leaves: the tensors autograd saves plus the block's outputs;
  out_bytes            what a *non-saving* forward leaves: the outputs alone (the next cut);
  fwd_peak_bytes       the peak during a saving forward (≥ kept_bytes);
  fwd_nosave_peak_bytes  the peak during a non-saving forward (≥ out_bytes);
  bwd_peak_bytes       the peak during backward, counting kept_bytes, the output gradient, the input gradient
                       and the temporaries;
and per cut c, grad_bytes[c], the gradient of the values live at cut c (what a backward leaves behind); and
  free_bytes           what of block i's kept bytes is freed once block i+1 has run a saving forward on them:
                       outputs that neither block saves (a BatchNorm output read by a ReLU, a residual sum) and
                       that no checkpoint holds;
  out_values           block i's outputs as (bytes, last cut they are live at): a value passed through later
                       blocks (a residual stream) stays live across several cuts. live_from(s, k), the bytes at
                       cut k made by blocks s..k−1, is what a checkpointed segment starting at s holds at cut k:
                       the segment's input values are held by whoever held them before.

Operations, with `cur` the live bytes before each:
  F(i, save)    needs cut i's values; peak cur + fwd_peak (save) or cur + fwd_nosave_peak;
                leaves kept_bytes (save), or for a non-saving forward the stored cut i+1: live_from(a, i+1)
                with a the first block of its checkpointed segment (out_bytes when a = i). Inside a segment
                the input (cut i) is freed once done, except the segment's own input.
                A saving forward whose input is block i−1's kept bytes frees free_bytes[i−1] of them, unless
                a checkpoint starting at block i holds that input (it then stays whole until released).
  F(i, offload) a saving forward whose saved tensors (kept − out) are copied to the host while the block
                computes: exposed time max(0, τ − fwd_s), τ = (kept − out)/offload_bw; leaves out_bytes.
  prefetch(i)   copies them back while the next operation (the backward of block i+1) computes:
                exposed max(0, τ − that op's time); the bytes are live from the prefetch on.
  B(i)          needs block i's kept bytes and the gradient of cut i+1; peak cur − kept − grad[i+1] + bwd_peak
                (kept as live now: less what a saving forward of block i+1 freed);
                frees both, leaves grad[i] (the formula holds whether grad[i+1] is counted in cur or is the
                resident output gradient of the chain).
  free X(c)     drops the stored values of cut c (a checkpoint's output, once its consumers are done).

A plan is a nested tree, which is also how it runs in torch: a sequence of items covering consecutive blocks,
each `Keep(i)` (run block i saving), `Offload(i)` (run it saving, saved tensors moved to the host) or
`Checkpoint(inner)` (run the blocks of `inner` without saving, keep only their output; in backward, recompute
them following `inner` itself, with the output's gradient present). In torch: `Checkpoint` is
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` around `inner`, nested as deep as the tree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "Checkpoint",
    "Keep",
    "Offload",
    "RematChain",
    "RematItem",
    "RematPlan",
    "RematResult",
    "Replay",
    "checkpoint_calls",
    "full_remat",
    "min_budget",
    "no_remat",
    "periodic",
    "plan_ops",
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
    free_bytes: tuple[float, ...] = ()  # [L]; empty: nothing freed
    out_values: tuple[tuple[tuple[float, int], ...], ...] = ()  # [L] (bytes, last cut); empty: live one cut
    checkpoint_s: float = 0.0  # the cost of one checkpoint call (its wrapper and recomputation bookkeeping)
    # [L]; empty: none. What block i adds to each checkpoint it is inside, beyond fwd_s: torch's hooks on its
    # saved tensors in the non-saving pass and in the recomputation (pyplan/profile/measure.py).
    checkpoint_block_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.fwd_s)
        if not self.checkpoint_block_s:
            object.__setattr__(self, "checkpoint_block_s", (0.0,) * n)
        if len(self.checkpoint_block_s) != n:
            raise ValueError(f"checkpoint_block_s has {len(self.checkpoint_block_s)} entries, the chain has {n} blocks")
        if not self.free_bytes:
            object.__setattr__(self, "free_bytes", (0.0,) * n)
        if len(self.free_bytes) != n:
            raise ValueError(f"free_bytes has {len(self.free_bytes)} entries, the chain has {n} blocks")
        if not self.out_values:
            object.__setattr__(self, "out_values", tuple(((b, i + 1),) for i, b in enumerate(self.out_bytes)))
        if len(self.out_values) != n:
            raise ValueError(f"out_values has {len(self.out_values)} entries, the chain has {n} blocks")
        for i, values in enumerate(self.out_values):
            if any(not i + 1 <= last <= n for _, last in values):
                raise ValueError(f"block {i}'s output values must be live from cut {i + 1} to at most cut {n}")
            if abs(sum(b for b, _ in values) - self.out_bytes[i]) > 1e-9 * max(1.0, self.out_bytes[i]):
                raise ValueError(f"block {i}'s output values do not add up to its out_bytes")

    def live_from(self, start: int, cut: int) -> float:
        """Bytes live at `cut` made by blocks start..cut−1."""
        return self._live[start * (len(self) + 1) + cut]

    def live_from_matrix(self) -> list[float]:
        """live_from(s, k) for every s ≤ k−1, flat as [s·(L+1) + k] (0 elsewhere): what the C++ DP reads."""
        return list(self._live)

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

    def sub(self, start: int, stop: int) -> RematChain:
        """Blocks [start, stop) as a chain of their own."""
        return RematChain(
            self.fwd_s[start:stop],
            self.bwd_s[start:stop],
            self.kept_bytes[start:stop],
            self.out_bytes[start:stop],
            self.fwd_peak_bytes[start:stop],
            self.fwd_nosave_peak_bytes[start:stop],
            self.bwd_peak_bytes[start:stop],
            self.grad_bytes[start : stop + 1],
            self.free_bytes[start:stop],
            tuple(tuple((b, min(last, stop) - start) for b, last in v) for v in self.out_values[start:stop]),
            self.checkpoint_s,
            self.checkpoint_block_s[start:stop],
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: list(getattr(self, k)) for k in _VECTORS}
        out["out_values"] = [[list(v) for v in vs] for vs in self.out_values]
        out["checkpoint_s"] = self.checkpoint_s
        out["checkpoint_block_s"] = list(self.checkpoint_block_s)
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> RematChain:
        fields: dict[str, Any] = {k: tuple(float(v) for v in data[k]) for k in _VECTORS if k in data}
        fields["out_values"] = tuple(tuple((float(b), int(c)) for b, c in vs) for vs in data.get("out_values", []))
        fields["checkpoint_s"] = float(data.get("checkpoint_s", 0.0))
        fields["checkpoint_block_s"] = tuple(float(v) for v in data.get("checkpoint_block_s", []))
        return RematChain(**fields)


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
    "free_bytes",
)


@dataclass(frozen=True)
class Keep:
    """Run block `block` saving what its backward needs."""

    block: int


@dataclass(frozen=True)
class Offload:
    """Run block `block` saving, with its saved tensors moved to host memory until its backward."""

    block: int


@dataclass(frozen=True)
class Checkpoint:
    """Run the blocks of `inner` without saving; recompute them in backward following `inner`."""

    inner: RematPlan


RematItem = Keep | Offload | Checkpoint


@dataclass(frozen=True)
class RematPlan:
    """Items covering consecutive blocks, in order (see the module docstring)."""

    items: tuple[RematItem, ...]

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("a remat plan covers at least one block")
        expected = self.first
        for it in self.items:
            if _first(it) != expected:
                raise ValueError(f"remat plan items must cover consecutive blocks: expected {expected}, got {it}")
            expected = _last(it) + 1

    @property
    def first(self) -> int:
        return _first(self.items[0])

    @property
    def last(self) -> int:
        return _last(self.items[-1])

    @property
    def blocks(self) -> range:
        return range(self.first, self.last + 1)

    def shifted(self, offset: int) -> RematPlan:
        """The same plan with every block index moved by `offset`."""
        return RematPlan(tuple(_shift(it, offset) for it in self.items))

    def to_json(self) -> list[Any]:
        """Nested lists: ["keep", i], ["offload", i], ["checkpoint", [...]]."""
        out: list[Any] = []
        for it in self.items:
            if isinstance(it, Keep):
                out.append(["keep", it.block])
            elif isinstance(it, Offload):
                out.append(["offload", it.block])
            else:
                out.append(["checkpoint", it.inner.to_json()])
        return out

    @staticmethod
    def from_json(data: Any) -> RematPlan:
        if not isinstance(data, list) or not data:
            raise ValueError(f"a remat plan is a non-empty list of items, got {data!r}")
        items: list[RematItem] = []
        for entry in data:
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in ("keep", "offload", "checkpoint")):
                raise ValueError(f"remat plan item {entry!r} is not [keep|offload|checkpoint, value]")
            kind, value = entry
            if kind == "checkpoint":
                items.append(Checkpoint(RematPlan.from_json(value)))
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                items.append(Keep(value) if kind == "keep" else Offload(value))
            else:
                raise ValueError(f"remat plan item {entry!r} needs a block index")
        return RematPlan(tuple(items))

    def describe(self) -> str:
        """Compact text: K3 keeps block 3, O3 offloads it, C[...] checkpoints what is inside."""
        parts = []
        for it in self.items:
            if isinstance(it, Keep):
                parts.append(f"K{it.block}")
            elif isinstance(it, Offload):
                parts.append(f"O{it.block}")
            else:
                parts.append(f"C[{it.inner.describe()}]")
        return " ".join(parts)


def _first(it: RematItem) -> int:
    return it.inner.first if isinstance(it, Checkpoint) else it.block


def _last(it: RematItem) -> int:
    return it.inner.last if isinstance(it, Checkpoint) else it.block


def _shift(it: RematItem, offset: int) -> RematItem:
    if isinstance(it, Checkpoint):
        return Checkpoint(it.inner.shifted(offset))
    return type(it)(it.block + offset)


def no_remat(start: int, stop: int) -> RematPlan:
    """Keep every block of [start, stop)."""
    return RematPlan(tuple(Keep(i) for i in range(start, stop)))


def periodic(start: int, stop: int, segments: int) -> RematPlan:
    """`torch.utils.checkpoint.checkpoint_sequential`: `segments` equal segments, all but the last
    checkpointed (each recomputed keeping everything), the last run normally."""
    n = stop - start
    if not 1 <= segments <= n:
        raise ValueError(f"{segments} segments for {n} blocks")
    size = -(-n // segments)  # checkpoint_sequential's segment size: ceil(n / segments)
    items: list[RematItem] = []
    a = start
    while a + size < stop:
        items.append(Checkpoint(no_remat(a, a + size)))
        a += size
    items.extend(Keep(i) for i in range(a, stop))
    return RematPlan(tuple(items))


def full_remat(start: int, stop: int) -> RematPlan:
    """Checkpoint every block on its own except the last: only block inputs are kept."""
    items: list[RematItem] = [Checkpoint(RematPlan((Keep(i),))) for i in range(start, stop - 1)]
    items.append(Keep(stop - 1))
    return RematPlan(tuple(items))


# One operation of a schedule: ("F", i, "save"|"nosave"|"offload"), ("B", i), ("prefetch", i), ("free", c).
Op = tuple[Any, ...]


def plan_ops(plan: RematPlan) -> list[Op]:
    """The operations that running `plan` performs, in order (see the module docstring)."""
    ops: list[Op] = []
    _first_pass(plan, ops)
    _backward(plan, ops)
    return ops


def _first_pass(plan: RematPlan, ops: list[Op]) -> None:
    for it in plan.items:
        if isinstance(it, Keep):
            ops.append(("F", it.block, "save"))
        elif isinstance(it, Offload):
            ops.append(("F", it.block, "offload"))
        else:
            a, b = it.inner.first, it.inner.last
            for j in range(a, b + 1):
                ops.append(("F", j, "nosave"))
                if j > a:
                    ops.append(("free", j))


def _backward(plan: RematPlan, ops: list[Op]) -> None:
    for it in reversed(plan.items):
        if isinstance(it, Checkpoint):
            ops.append(("free", it.inner.last + 1))
            _first_pass(it.inner, ops)
            _backward(it.inner, ops)
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


def replay(chain: RematChain, plan: RematPlan, *, offload_bw_bytes_per_s: float = math.inf) -> Replay:
    """Run `plan` on the model of the module docstring, operation by operation, plus `checkpoint_s` per
    checkpoint call (`checkpoint_calls`) and, per such call, its blocks' `checkpoint_block_s`."""
    if plan.first != 0 or plan.last != len(chain) - 1:
        raise ValueError(f"the plan covers blocks {plan.first}..{plan.last}, the chain has {len(chain)}")
    first: list[Op] = []
    _first_pass(plan, first)
    rep = replay_ops(chain, plan_ops(plan), offload_bw_bytes_per_s=offload_bw_bytes_per_s, forward_ops=len(first))
    extra = chain.checkpoint_s * checkpoint_calls(plan) + _checkpoint_blocks_s(chain, plan)
    return replace(rep, time_s=rep.time_s + extra, recompute_s=rep.recompute_s + extra)


def _checkpoint_blocks_s(chain: RematChain, plan: RematPlan) -> float:
    """Σ over the checkpoints `checkpoint_calls` counts of what their blocks add (checkpoint_block_s)."""
    total = 0.0
    for it in plan.items:
        if isinstance(it, Checkpoint):
            total += sum(chain.checkpoint_block_s[it.inner.first : it.inner.last + 1])
            total += _checkpoint_blocks_s(chain, it.inner)
    return total


def checkpoint_calls(plan: RematPlan) -> int:
    """Checkpoint calls a training step of `plan` makes, counting each checkpoint once per pass that runs it
    saving: its own call, then those of its recomputation (calls nested inside a non-saving pass are left out:
    an approximation, they cost the same wrapper but no bookkeeping of saved tensors)."""
    return sum(1 + checkpoint_calls(it.inner) for it in plan.items if isinstance(it, Checkpoint))


def replay_ops(
    chain: RematChain,
    ops: Sequence[Op],
    *,
    offload_bw_bytes_per_s: float = math.inf,
    forward_ops: int | None = None,
) -> Replay:
    """Replay any operation sequence; raise ValueError when an operation lacks what it needs.

    Live objects: ("X", c) the stored values of cut c (c ≥ 1), ("A", i) block i's kept bytes (which hold cut
    i+1's values), ("H", i) block i's saved bytes on the host, ("G", c) the gradient of cut c. Cut 0 and the
    gradient of cut L are resident and not counted.
    """
    n = len(chain)
    live: dict[tuple[str, int], float] = {}
    cur = peak = 0.0
    time_s = recompute_s = transfer_s = 0.0
    after_forward = 0.0
    computed: set[int] = set()
    pinned: set[int] = set()  # blocks whose kept bytes a checkpoint holds whole (its input)
    segment_start: dict[int, int] = {}  # stored cut c → the first block of the segment that made it
    shrunk: set[int] = set()  # blocks whose kept bytes already lost free_bytes

    def has_cut(c: int) -> bool:
        return c == 0 or ("X", c) in live or ("A", c - 1) in live

    def add(key: tuple[str, int], size: float) -> None:
        nonlocal cur
        if key in live:
            raise ValueError(f"{key} is computed twice without being freed")
        live[key] = size
        cur += size

    def drop(key: tuple[str, int]) -> None:
        nonlocal cur
        cur -= live.pop(key)

    def tau(i: int) -> float:
        return (chain.kept_bytes[i] - chain.out_bytes[i]) / offload_bw_bytes_per_s

    for k, op in enumerate(ops):
        if forward_ops is not None and k == forward_ops:
            after_forward = cur
        kind, i = op[0], op[1]
        if kind == "F":
            if not has_cut(i):
                raise ValueError(f"forward of block {i} without the values of cut {i}")
            save = op[2]
            t = chain.fwd_s[i]
            if i in computed:
                recompute_s += t
            computed.add(i)
            time_s += t
            held_by_previous = i > 0 and ("X", i) not in live and ("A", i - 1) in live
            if save == "nosave":
                peak = max(peak, cur + chain.fwd_nosave_peak_bytes[i])
                # Inside a segment (its input is freed right after), the segment's values live on.
                inside = k + 1 < len(ops) and ops[k + 1] == ("free", i) and ("X", i) in live
                start = segment_start[i] if inside else i
                segment_start[i + 1] = start
                add(("X", i + 1), chain.live_from(start, i + 1))
                if held_by_previous:
                    pinned.add(i - 1)
            else:
                peak = max(peak, cur + chain.fwd_peak_bytes[i])
                if held_by_previous and i - 1 not in pinned and i - 1 not in shrunk:
                    shrunk.add(i - 1)
                    live[("A", i - 1)] -= chain.free_bytes[i - 1]
                    cur -= chain.free_bytes[i - 1]
                if save == "offload":
                    exposed = max(0.0, tau(i) - t)
                    time_s += exposed
                    transfer_s += exposed
                    add(("X", i + 1), chain.out_bytes[i])
                    segment_start[i + 1] = i
                    live[("H", i)] = 0.0
                else:
                    add(("A", i), chain.kept_bytes[i])
        elif kind == "prefetch":
            if ("H", i) not in live:
                raise ValueError(f"prefetch of block {i}, which was not offloaded")
            del live[("H", i)]
            nxt = ops[k + 1] if k + 1 < len(ops) else None
            overlap = chain.bwd_s[nxt[1]] if nxt is not None and nxt[0] == "B" and nxt[1] != i else 0.0
            exposed = max(0.0, tau(i) - overlap)
            time_s += exposed
            transfer_s += exposed
            drop(("X", i + 1))
            add(("A", i), chain.kept_bytes[i])
        elif kind == "B":
            if ("A", i) not in live:
                raise ValueError(f"backward of block {i} without its saved tensors")
            if not has_cut(i):
                raise ValueError(f"backward of block {i} without the values of cut {i}")
            if i < n - 1 and ("G", i + 1) not in live:
                raise ValueError(f"backward of block {i} before the gradient of cut {i + 1}")
            peak = max(peak, cur - live[("A", i)] - chain.grad_bytes[i + 1] + chain.bwd_peak_bytes[i])
            time_s += chain.bwd_s[i]
            drop(("A", i))
            pinned.discard(i)
            shrunk.discard(i)
            if i < n - 1:
                drop(("G", i + 1))
            if i > 0:
                add(("G", i), chain.grad_bytes[i])
        elif kind == "free":
            if ("X", i) not in live:
                raise ValueError(f"free of cut {i}, which is not stored")
            if i < n and ("A", i) in live:
                raise ValueError(f"free of cut {i} while block {i}'s saved tensors (which hold it) are live")
            drop(("X", i))
        else:
            raise ValueError(f"unknown operation {op!r}")
    if forward_ops is not None and forward_ops >= len(ops):
        after_forward = cur
    done = {key for key in live if key[0] != "X" or key[1] != 0}
    if done:
        raise ValueError(f"the schedule leaves {sorted(done)} live")
    return Replay(time_s, peak, recompute_s, transfer_s, after_forward)


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


def _arrays(chain: RematChain) -> list[list[float]]:
    """The chain as the C++ core takes it: the per-block and per-cut vectors, then live_from flat."""
    return [*(list(getattr(chain, k)) for k in _VECTORS), chain.live_from_matrix()]


def min_budget(chain: RematChain, *, offload: bool = False, max_depth: int | None = None) -> float:
    """The least peak (bytes) of any plan: below it no budget is feasible."""
    from pyplan import _core

    return _core.remat_min_peak(*_arrays(chain), offload=offload, max_depth=-1 if max_depth is None else max_depth)


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

    Memory is discretized into `slots` (sizes rounded up, the budget down), so the plan always fits in bytes; it
    is optimal up to that rounding, exactly optimal when every size is a multiple of budget/slots. `offload_bw`
    enables offloading over a link of that bandwidth; `max_depth` limits checkpoint nesting (1: checkpoint sets,
    as checkpoint_sequential; None: unbounded, Rotor); `in_flight` micro-batches held at once must fit as
    peak + (in_flight − 1)·after_forward. Block indices of the plan start at `first_block`. With `baselines`,
    no remat, full remat and every `checkpoint_sequential` segment count are replayed too (in bytes), and one of
    them is returned when it is faster and fits: slot rounding can hide such a plan from the DP.
    Raises InfeasibleError naming the least budget when nothing fits.
    """
    from pyplan import _core
    from pyplan.errors import InfeasibleError

    bw = offload_bw_bytes_per_s or 0.0
    r = _core.remat(
        *_arrays(chain),
        budget_bytes=budget_bytes,
        slots=slots,
        offload_bw_bytes_per_s=bw,
        max_depth=-1 if max_depth is None else max_depth,
        in_flight=in_flight,
        checkpoint_s=chain.checkpoint_s,
        checkpoint_block_s=list(chain.checkpoint_block_s),
    )
    if not r.feasible:
        raise InfeasibleError(f"rematerialization: {r.reason}")
    plan = _plan_of_steps(r.plan, 0)
    rep = replay(chain, plan, offload_bw_bytes_per_s=bw if bw > 0 else math.inf)
    if baselines:
        # Slots round every size up: a plan that fits in bytes may not fit in slots. Never return worse than
        # the plans everyone has (keep all, checkpoint_sequential's segment counts, checkpoint every block).
        n = len(chain)
        checkpoints = max_depth is None or max_depth >= 1
        others = (full_remat(0, n), *(periodic(0, n, k) for k in range(1, n + 1))) if checkpoints else ()
        for other in (no_remat(0, n), *others):
            got = replay(chain, other)
            if got.time_s < rep.time_s and got.peak_bytes + (in_flight - 1) * got.after_forward_bytes <= budget_bytes:
                plan, rep = other, got
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
