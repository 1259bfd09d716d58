"""A remat plan: what each block of a stage does with its activations, as data (pyplan/solve/remat.py solves for
it and prices it, the runtime applies it, a plan file stores it).

A plan is a sequence of items covering consecutive blocks: `Keep` (run the block, saving what its backward needs),
`Offload` (the same, the saved tensors moved to host memory), `Selective` (save only the matmul outputs, recompute
the rest in the backward) and `Checkpoint` / `SelectiveCheckpoint` (run an inner plan without saving, and run it
again before its backward); pyplan/solve/remat.py's docstring gives the semantics in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Checkpoint",
    "Keep",
    "Offload",
    "RematItem",
    "RematPlan",
    "Selective",
    "SelectiveCheckpoint",
    "full_remat",
    "no_remat",
    "periodic",
]


@dataclass(frozen=True)
class Keep:
    """Run block `block` saving what its backward needs."""

    block: int


@dataclass(frozen=True)
class Offload:
    """Run block `block` saving, with its saved tensors moved to host memory until its backward."""

    block: int


@dataclass(frozen=True)
class Selective:
    """Run block `block` under selective checkpointing: saving the outputs of its matrix products and fused
    attention, recomputing its other ops in its backward (`RematChain.selective`)."""

    block: int


@dataclass(frozen=True)
class Checkpoint:
    """Run the blocks of `inner` without saving; recompute them in backward following `inner`."""

    inner: RematPlan


@dataclass(frozen=True)
class SelectiveCheckpoint(Checkpoint):
    """Run the blocks of `inner` (kept blocks only) as one selective checkpoint: the outputs of their matrix
    products and fused attention are saved in the first pass, everything else runs again in the backward, all of
    `inner` at once when the backward reaches it (as checkpointing a whole FSDP unit under torchtitan's op policy).
    Every rule of a `Checkpoint` holds, but for what the first pass leaves beside the output cut (the saved outputs,
    `RematChain.selective_kept_bytes`, and the internal cuts' values they include, `selective_holds`) and the
    recomputation's time (the ops not saved, `selective_recompute_s`)."""

    def __post_init__(self) -> None:
        if not all(isinstance(it, Keep) for it in self.inner.items):
            raise ValueError("a selective checkpoint runs kept blocks only")


RematItem = Keep | Offload | Selective | Checkpoint


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
        """Nested lists: ["keep", i], ["offload", i], ["selective", i], ["checkpoint", [...]],
        ["selective_checkpoint", [...]]."""
        out: list[Any] = []
        for it in self.items:
            if isinstance(it, SelectiveCheckpoint):
                out.append(["selective_checkpoint", it.inner.to_json()])
            elif isinstance(it, Checkpoint):
                out.append(["checkpoint", it.inner.to_json()])
            else:
                out.append([_KINDS[type(it)], it.block])
        return out

    @staticmethod
    def from_json(data: Any) -> RematPlan:
        if not isinstance(data, list) or not data:
            raise ValueError(f"a remat plan is a non-empty list of items, got {data!r}")
        items: list[RematItem] = []
        for entry in data:
            kinds = (*_ITEMS, "checkpoint", "selective_checkpoint")
            if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in kinds):
                raise ValueError(f"remat plan item {entry!r} is not [{'|'.join(kinds)}, value]")
            kind, value = entry
            if kind == "checkpoint":
                items.append(Checkpoint(RematPlan.from_json(value)))
            elif kind == "selective_checkpoint":
                items.append(SelectiveCheckpoint(RematPlan.from_json(value)))
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                items.append(_ITEMS[kind](value))
            else:
                raise ValueError(f"remat plan item {entry!r} needs a block index")
        return RematPlan(tuple(items))

    def describe(self) -> str:
        """Compact text: K3 keeps block 3, O3 offloads it, S3 checkpoints it selectively, C[...] checkpoints what
        is inside, SC[...] checkpoints it selectively as one."""
        parts = []
        for it in self.items:
            if isinstance(it, Checkpoint):
                parts.append(f"{'SC' if isinstance(it, SelectiveCheckpoint) else 'C'}[{it.inner.describe()}]")
            else:
                parts.append(f"{_KINDS[type(it)][0].upper()}{it.block}")
        return " ".join(parts)

    def selective_blocks(self) -> frozenset[int]:
        """The blocks a `Selective` item runs, at any depth."""
        out: set[int] = set()
        for it in self.items:
            if isinstance(it, Checkpoint):
                out |= it.inner.selective_blocks()
            elif isinstance(it, Selective):
                out.add(it.block)
        return frozenset(out)


_ITEMS: dict[str, type[Keep | Offload | Selective]] = {"keep": Keep, "offload": Offload, "selective": Selective}
_KINDS = {v: k for k, v in _ITEMS.items()}


def _first(it: RematItem) -> int:
    return it.inner.first if isinstance(it, Checkpoint) else it.block


def _last(it: RematItem) -> int:
    return it.inner.last if isinstance(it, Checkpoint) else it.block


def _shift(it: RematItem, offset: int) -> RematItem:
    if isinstance(it, Checkpoint):
        return type(it)(it.inner.shifted(offset))
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


def full_remat(start: int, stop: int, *, last: bool = False) -> RematPlan:
    """Checkpoint every block on its own except the last (with `last`, the last too): only block inputs are kept.
    The last block's backward runs right after its forward where one micro-batch is in flight, so recomputing it
    buys nothing there; where several are, its activations are held once for each, as Megatron-LM's uniform
    recomputation does not hold them."""
    items: list[RematItem] = [Checkpoint(RematPlan((Keep(i),))) for i in range(start, stop - 1)]
    items.append(Checkpoint(RematPlan((Keep(stop - 1),))) if last else Keep(stop - 1))
    return RematPlan(tuple(items))
