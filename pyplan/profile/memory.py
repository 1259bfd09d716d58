"""Exact memory: bytes saved for backward per block (the model state's bytes are pyplan/model_state.py's).

Saved bytes are measured, not estimated: the traced graph runs under `saved_tensors_hooks`, every saved
storage is counted once, parameters and buffers are excluded, and each storage is charged to the block whose
node produced it (an op's own temporaries, such as a dropout mask, to the block of that op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from pyplan._torch import run_without_compute, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import static_closure
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile.pieces import RepeatedBlocks, mirror

__all__ = ["SavedBytes", "SavedRecorder", "saved_bytes"]


class SavedRecorder(fx.Interpreter):
    """Runs the graph and charges each storage saved for backward to the node that produced it."""

    def __init__(self, gm: fx.GraphModule, exclude: set[int]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.exclude = exclude
        self.producer: dict[int, str] = {}
        self.saved: dict[int, tuple[int, str]] = {}
        self.current = ""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.exclude and key not in self.saved:
            self.saved[key] = (t.untyped_storage().nbytes(), self.producer.get(key, self.current))
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        result = super().run_node(n)
        for t in tensor_leaves(result):
            self.producer.setdefault(storage_key(t), n.name)
        return result


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward at one batch size: per block, and the model inputs kept for backward."""

    per_block: list[int]
    inputs: int

    @property
    def total(self) -> int:
        return self.inputs + sum(self.per_block)


# A storage in a piece's log: ("in", k) the piece's k-th input's, ("new", m) the m-th new one it made, ("static", p,
# k) the k-th output of its static node at position p (recomputed in each piece that reads it, made once in the whole
# model), ("pre", key) one that existed before (a constant).
Ref = tuple[Any, ...]


class _PieceRecorder(fx.Interpreter):
    """Runs one piece as SavedRecorder runs the model, and logs what it records in terms a repeat of the piece can
    replay: storages as `Ref`s, nodes by their position in the piece."""

    def __init__(self, mod: fx.GraphModule, args: Sequence[Any], exclude: set[int], static: set[str]) -> None:
        super().__init__(mod, garbage_collect_values=False)
        self.exclude, self.static = exclude, static
        self.names = [n.name for n in mod.graph.nodes]
        self.position = {name: i for i, name in enumerate(self.names)}
        self.refs: dict[int, Ref] = {}
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                self.refs.setdefault(storage_key(a), ("in", k))
        self.before = {
            storage_key(v)
            for n in mod.graph.nodes
            if n.op == "get_attr" and isinstance(v := self.fetch_attr(str(n.target)), torch.Tensor)
        }
        self.log: list[tuple[str, Ref, Any, int, int]] = []  # (event, ref, global key, bytes, node position)
        self.replayable = True
        self.current = 0
        self.held: list[torch.Tensor] = []  # every storage seen, kept alive so that no identity is reused

    def _ref(self, t: torch.Tensor, node: str | None = None, index: int = 0) -> tuple[Ref, Any] | None:
        key = storage_key(t)
        if key in self.exclude:
            return None
        if key not in self.refs:
            self.held.append(t)
            if key in self.before:
                self.refs[key] = ("pre", key)
                self.replayable = False
            elif node is not None and node in self.static:
                self.refs[key] = ("static", self.position[node], index)
            else:
                self.refs[key] = ("new", len(self.refs))
        ref = self.refs[key]
        return ref, (("static", self.names[ref[1]], ref[2]) if ref[0] == "static" else key)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        got = self._ref(t)
        if got is not None:
            self.log.append(("pack", got[0], got[1], t.untyped_storage().nbytes(), self.current))
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = self.position[n.name]
        result = super().run_node(n)
        for k, t in enumerate(tensor_leaves(result)):
            got = self._ref(t, n.name, k)
            if got is not None:
                self.log.append(("produce", got[0], got[1], 0, self.current))
        return result


def _apply(
    log: Sequence[tuple[str, Ref, Any, int, int]],
    key_of: Callable[[Ref, Any], Any],
    names: Sequence[str],
    producer: dict[Any, str],
    saved: dict[Any, tuple[int, str]],
) -> None:
    """What SavedRecorder records of a piece's log: each storage's producer (the first node that outputs it) and each
    saved storage's bytes and producer, once; `key_of(ref, key)` the storage's identity in the model's run."""
    for event, ref, key, nbytes, position in log:
        key = key_of(ref, key)
        if event == "produce":
            producer.setdefault(key, names[position])
        elif key not in saved:
            saved[key] = (nbytes, producer.get(key, names[position]))


def _replayed(
    ref: Ref, key: Any, *, args: Sequence[Any], names: Sequence[str], made: dict[Ref, int], index: int
) -> Any:
    """The identity in the model's run of a storage of piece `index`'s log replayed on `args`: an input's storage, a
    static node's output by its name, an output's new storage (`made`), or a new one of the replay's own."""
    if ref[0] == "in":
        return storage_key(args[ref[1]])
    if ref[0] == "static":
        return ("static", names[ref[1]], ref[2])
    return made.get(ref, ("replay", index, ref[1]))


def _names_kept(mods: Sequence[fx.GraphModule], gm: fx.GraphModule) -> bool:
    """Whether every node of the pieces is the model's node of that name (a piece adds none: no copy of a value it
    modifies in place, no batch size read off its inputs, which could take a name)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for mod in mods:
        for n in mod.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            same = nodes.get(n.name)
            if same is None or same.op != n.op or same.target != n.target:
                return False
    return True


def _saved_in_pieces(
    chain: Chain, table: RepeatedBlocks, inputs: Sequence[Any], exclude: set[int]
) -> dict[Any, tuple[int, str]] | None:
    """What SavedRecorder records of the whole model, from its blocks run in sequence as pieces (autograd following
    the values from piece to piece, as through the model), each distinct block once: a repeat's log is replayed on
    its own inputs and its outputs made like the first one's. None where the pieces are not the model's nodes."""
    mods = table.mods
    if not _names_kept(mods, chain.graph.module):
        return None
    static = {n.name for n in chain.graph.nodes if n.static}
    producer: dict[Any, str] = {}
    saved: dict[Any, tuple[int, str]] = {}
    ran: dict[str, tuple[tuple[Any, ...], tuple[Any, ...], _PieceRecorder]] = {}
    held: list[Any] = []  # every piece's values, kept alive so that no storage identity is reused
    args: tuple[Any, ...] = tuple(inputs)
    for i, mod in enumerate(mods):
        names = [n.name for n in mod.graph.nodes]
        key = table.key(i, args)
        if key is not None and key in ran:
            given, made, first = ran[key]
            mirrored = mirror(given, made, args)
            if mirrored is not None:
                outs, new = mirrored
                refs = {first.refs[k]: v for k, v in new.items()}
                key_of = functools.partial(_replayed, args=args, names=names, made=refs, index=i)
                _apply(first.log, key_of, names, producer, saved)
                held.append(outs)
                args = outs
                continue
        rec = _PieceRecorder(mod, args, exclude, static)
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            out = rec.run(*args)
        _apply(rec.log, lambda ref, key: key, names, producer, saved)
        held.append(rec)
        outs = out if isinstance(out, tuple) else (out,)
        if key is not None and rec.replayable:
            ran.setdefault(key, (args, outs, rec))
        args = outs
    return saved


def _saved_at(
    chain: Chain, example_inputs: ExampleInputs, batch_size: int, blocks: RepeatedBlocks | None = None
) -> SavedBytes:
    gm = chain.graph.module
    block_of = {name: i for i, b in enumerate(chain.blocks) for name in b.nodes}
    placeholders = {n.name for n in chain.graph.placeholders}
    inputs = inputs_at(example_inputs, batch_size)

    def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> dict[Any, tuple[int, str]]:
        exclude = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        with torch.enable_grad():
            if blocks is not None and blocks.enabled:
                found = _saved_in_pieces(chain, blocks, [convert(t) for t in inputs], exclude)
                if found is not None:
                    return found
            rec = SavedRecorder(gm, exclude)
            with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                rec.run(*[convert(t) for t in inputs])
        return rec.saved

    saved = run_without_compute(gm, run)
    # A storage produced by a static node (a buffer slice, a constant) is charged to the first block reading it.
    owner = dict(block_of)
    for i, b in enumerate(chain.blocks):
        for name in static_closure(chain.graph, b.nodes):
            owner.setdefault(name, i)
    per_block = [0] * len(chain.blocks)
    from_inputs = 0
    for nbytes, producer in saved.values():
        if producer in placeholders:
            from_inputs += nbytes
        else:
            per_block[owner.get(producer, 0)] += nbytes
    return SavedBytes(per_block=per_block, inputs=from_inputs)


def saved_bytes(
    chain: Chain,
    example_inputs: ExampleInputs,
    batch_sizes: tuple[int, int],
    *,
    blocks: RepeatedBlocks | None = None,
) -> tuple[list[Affine], Affine]:
    """Saved-for-backward bytes of each block and of the model inputs, as `per_sample·b + fixed`.

    Measured on fake (or meta) tensors at two batch sizes; bytes are affine in b, so two points are exact. With
    `blocks` (the chain's table of distinct blocks, a meta model's), the blocks run as pieces in sequence, each
    distinct one once; the figures are those of the whole model's run.
    """
    b1, b2 = batch_sizes
    s1, s2 = _saved_at(chain, example_inputs, b1, blocks), _saved_at(chain, example_inputs, b2, blocks)
    blocks = [Affine.from_two(b1, x, b2, y) for x, y in zip(s1.per_block, s2.per_block)]
    return blocks, Affine.from_two(b1, s1.inputs, b2, s2.inputs)
