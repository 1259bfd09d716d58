"""Exact memory: bytes saved for backward per block (the model state's bytes are pyplan/model_state.py's).

Saved bytes are measured, not estimated: the traced graph runs under `saved_tensors_hooks`, every saved
storage is counted once, parameters and buffers are excluded, and each storage is charged to the block whose
node produced it (an op's own temporaries, such as a dropout mask, to the block of that op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from pyplan._torch import run_without_compute, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import static_closure
from pyplan.graph.trace import ExampleInputs, inputs_at

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


def _saved_at(chain: Chain, example_inputs: ExampleInputs, batch_size: int) -> SavedBytes:
    gm = chain.graph.module
    block_of = {name: i for i, b in enumerate(chain.blocks) for name in b.nodes}
    placeholders = {n.name for n in chain.graph.placeholders}
    inputs = inputs_at(example_inputs, batch_size)

    def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> SavedRecorder:
        exclude = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        rec = SavedRecorder(gm, exclude)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            rec.run(*[convert(t) for t in inputs])
        return rec

    rec = run_without_compute(gm, run)
    # A storage produced by a static node (a buffer slice, a constant) is charged to the first block reading it.
    owner = dict(block_of)
    for i, b in enumerate(chain.blocks):
        for name in static_closure(chain.graph, b.nodes):
            owner.setdefault(name, i)
    per_block = [0] * len(chain.blocks)
    from_inputs = 0
    for nbytes, producer in rec.saved.values():
        if producer in placeholders:
            from_inputs += nbytes
        else:
            per_block[owner.get(producer, 0)] += nbytes
    return SavedBytes(per_block=per_block, inputs=from_inputs)


def saved_bytes(
    chain: Chain, example_inputs: ExampleInputs, batch_sizes: tuple[int, int]
) -> tuple[list[Affine], Affine]:
    """Saved-for-backward bytes of each block and of the model inputs, as `per_sample·b + fixed`.

    Measured on fake (or meta) tensors at two batch sizes; bytes are affine in b, so two points are exact.
    """
    b1, b2 = batch_sizes
    s1, s2 = _saved_at(chain, example_inputs, b1), _saved_at(chain, example_inputs, b2)
    blocks = [Affine.from_two(b1, x, b2, y) for x, y in zip(s1.per_block, s2.per_block)]
    return blocks, Affine.from_two(b1, s1.inputs, b2, s2.inputs)
