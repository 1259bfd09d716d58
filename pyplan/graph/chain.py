"""The Chain the solvers consume: blocks between chosen cut points, each cut with its live tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyplan.graph.layergraph import Affine, LayerGraph

if TYPE_CHECKING:
    from pyplan.solve.remat import RematProfile

__all__ = ["Block", "Chain", "Cut"]


@dataclass(frozen=True)
class Cut:
    """A place between two nodes of the topological order where the model can be split.

    `position` is the index, in the chain's node order, of the first node after the cut (0: before every node,
    len(order): after the last). `live` names every value computed before the cut and used after it, in order of
    definition: this is what a pipeline boundary sends, skip tensors and masks included. `bytes` is their total.
    """

    position: int
    live: tuple[str, ...]
    bytes: Affine

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "live": list(self.live),
            "bytes_per_sample": self.bytes.per_sample,
            "fixed_bytes": self.bytes.fixed,
        }


@dataclass(frozen=True)
class Block:
    """The nodes between two consecutive chosen cuts, with what profiling measured of them.

    Parameters are counted in the first block that uses them (tied weights once). `saved_bytes` counts the
    storages produced inside the block and saved for backward by any block, so the blocks' sum plus the chain's
    `input_saved_bytes` is exactly what a whole training step keeps for backward. Times and FLOPs are per
    micro-batch of b samples as `per_sample·b + fixed`; measured times are `Piecewise` curves through the sizes
    they were measured at (call them at b; `per_sample`/`fixed` hold their least-squares line); times are None
    until measured.
    """

    name: str
    nodes: tuple[str, ...]
    param_names: tuple[str, ...] = ()
    param_numel: int = 0
    param_bytes: int = 0
    param_tensors: int = 0
    buffer_bytes: int = 0
    flops_fwd: Affine | None = None
    flops_bwd: Affine | None = None
    saved_bytes: Affine | None = None
    fwd_time_s: Affine | None = None
    bwd_time_s: Affine | None = None

    def to_json(self) -> dict[str, Any]:
        def pair(prefix: str, a: Affine | None, unit: str = "") -> dict[str, float | None]:
            return {
                f"{prefix}_alpha{unit}": a.per_sample if a else None,
                f"{prefix}_beta{unit}": a.fixed if a else None,
            }

        return {
            "name": self.name,
            "nodes": list(self.nodes),
            "params": self.param_numel,
            "param_bytes": self.param_bytes,
            "param_tensors": self.param_tensors,
            "buffer_bytes": self.buffer_bytes,
            "flops_fwd_per_sample": self.flops_fwd.per_sample if self.flops_fwd else None,
            "flops_fwd_fixed": self.flops_fwd.fixed if self.flops_fwd else None,
            "flops_bwd_per_sample": self.flops_bwd.per_sample if self.flops_bwd else None,
            "flops_bwd_fixed": self.flops_bwd.fixed if self.flops_bwd else None,
            "activation_bytes_per_sample": self.saved_bytes.per_sample if self.saved_bytes else None,
            "activation_fixed_bytes": self.saved_bytes.fixed if self.saved_bytes else None,
            **pair("fwd", self.fwd_time_s),
            **pair("bwd", self.bwd_time_s),
        }


@dataclass(frozen=True)
class LossCost:
    """The loss of one micro-batch as `α·b + β`: forward and backward seconds, bytes saved for the backward
    (pyplan/profile/loss.py profiles it; `Chain.loss` says it is in the last block)."""

    fwd_time_s: Affine
    bwd_time_s: Affine
    saved_bytes: Affine
    # Live at the peak of its backward: the output's gradient and temporaries.
    bwd_peak_bytes: Affine = field(default_factory=lambda: Affine(0.0, 0.0))


@dataclass
class Chain:
    """Blocks 0..n-1 and cuts 0..n: block i lies between `cuts[i]` and `cuts[i+1]`.

    `order` is the topological order of the non-static nodes (positions of cuts index into it);
    `candidates` every valid cut of that order, chosen or not, for finer re-linearization;
    `input_saved_bytes` the model inputs that training keeps for backward (e.g. token ids of an embedding);
    `loss`, when set, the loss's cost, already added to the last block's times and saved bytes; `memory` the
    per-block working memory (pyplan/profile/remat.py's profile, without the loss), for the exact replay of a
    stage's activations; `min_micro_batch` the least micro-batch the model trains on (2 when a BatchNorm sees one
    value per channel on one sample).
    """

    blocks: list[Block]
    cuts: list[Cut]
    order: list[str]
    candidates: list[Cut]
    graph: LayerGraph = field(repr=False, compare=False)
    input_saved_bytes: Affine | None = None
    loss: LossCost | None = None
    memory: RematProfile | None = None
    min_micro_batch: int = 1

    def __post_init__(self) -> None:
        if len(self.cuts) != len(self.blocks) + 1:
            raise ValueError(f"a chain of {len(self.blocks)} blocks needs {len(self.blocks) + 1} cuts")

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def param_numel(self) -> int:
        return sum(b.param_numel for b in self.blocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "blocks": [b.to_json() for b in self.blocks],
            "cuts": [c.to_json() for c in self.cuts],
            "input_saved_bytes_per_sample": self.input_saved_bytes.per_sample if self.input_saved_bytes else None,
        }
