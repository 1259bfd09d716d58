"""A chain as one tensor-parallel rank runs it: the blocks profiled on the rank's shards, plus the collectives.

At degree t (pyplan/graph/tensor_parallel.py's plan), a block's compute, saved activations and parameters are
those of the rank's graph (`local_module`: the split matmuls at their real shapes), and its time gains the
collectives of Megatron's f and g operators (Shoeybi et al. 2019, Fig. 3) on the link inside a node:
- a region's row-parallel outputs are all-reduced in forward, the gradient of its column-parallel input in
  backward (one all-reduce per distinct input: Q, K and V read one);
- a vocabulary-parallel embedding's output is all-reduced in forward;
- an output layer's logits are all-gathered in forward, its input's gradient all-reduced in backward.
With sequence parallelism (pyplan/graph/sequence_parallel.py's zone) a row output is reduce-scattered in forward
and all-gathered in backward, a region's input all-gathered in forward (once per value) and reduce-scattered in
backward: the bytes of the all-reduces they replace (Korthikanti et al. 2022, §4.2.2); and, since the Linears save
a gathered input as the rank's slice, as Megatron-LM does, each such value is all-gathered again in backward (the
forward gather's bytes; the profile of the rank counts the slice saved, pyplan/graph/sequence_parallel.py's
`Gathered`). A zone value another operation reads whole is all-gathered, a whole value sliced into the zone has its
gradient all-gathered. The gradients of the parameters read in the zone (norms) are summed once per step, not
counted (h elements a norm). The collectives block the computation that follows them (torch's DTensor styles issue
them synchronously on the compute stream), so they add to the block's time; nothing overlaps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from pyplan import _core
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import linearize
from pyplan.graph.sequence_parallel import SequenceZone, ShapeOps, rewrite
from pyplan.graph.tensor_parallel import TpPlan, local_module
from pyplan.graph.trace import ExampleInputs, graph_of

__all__ = ["TpCollectives", "collective_bytes", "collective_times", "local_chain"]


@dataclass(frozen=True)
class TpCollectives:
    """One block's tensor-parallel traffic per micro-batch, as bytes of the whole tensor each collective produces
    or reads (`per_sample·b + fixed`), by kind and direction."""

    fwd_all_reduce: Affine = field(default_factory=Affine)
    bwd_all_reduce: Affine = field(default_factory=Affine)
    fwd_all_gather: Affine = field(default_factory=Affine)
    bwd_all_gather: Affine = field(default_factory=Affine)
    fwd_reduce_scatter: Affine = field(default_factory=Affine)
    bwd_reduce_scatter: Affine = field(default_factory=Affine)


def local_chain(
    chain: Chain, plan: TpPlan, degree: int, example_inputs: ExampleInputs, zone: SequenceZone | None = None
) -> Chain:
    """The blocks of `chain` (same cuts, same names) as rank 0 of degree `degree` computes them, not yet profiled:
    its parameters are the rank's shards and every recorded shape is the rank's; with a sequence-parallel `zone`
    the values between regions are the rank's tokens (the collectives' shapes made by `ShapeOps`)."""
    gm = local_module(chain.graph, plan, degree)
    if zone is not None:
        rewrite(gm, zone, ShapeOps(degree), layers=True)
    # Its layers repeat as the chain's do: each distinct block is recorded once (graph_of's `like`).
    graph = graph_of(gm, example_inputs, chain.graph.batch_size, chain.graph.leaf_modules, like=chain)
    local = linearize(graph, positions=[c.position for c in chain.cuts[1:-1]], order=chain.order)
    blocks = [replace(lb, name=b.name) for lb, b in zip(local.blocks, chain.blocks, strict=True)]
    return replace(local, blocks=blocks)


def collective_bytes(
    chain: Chain, plan: TpPlan, degree: int, zone: SequenceZone | None = None, *, vocab_parallel: bool = False
) -> list[TpCollectives]:
    """Per block of `chain` (the whole model's), the tensor-parallel traffic at `degree`: each collective in the
    block of the node that issues it (a row Linear's output, the first column Linear reading an input, an
    embedding, an output layer; with a sequence-parallel `zone`, the nodes that read its values whole or slice
    values into it, and a gathered input's second all-gather, in backward, in the block of its first reader).
    With `vocab_parallel` the output layer's logits stay split and the loss all-reduces three numbers per position
    instead (the max, the sum of exponentials, the target's logit: pyplan.runtime.tensor_parallel.VocabParallelLoss),
    in the last block, where the loss is."""
    where = {node: i for i, block in enumerate(chain.blocks) for node in block.nodes}
    kinds = [f.name for f in fields(TpCollectives)]
    out: list[dict[str, Affine]] = [{k: Affine() for k in kinds} for _ in chain.blocks]
    graph = chain.graph

    def add(kind: str, node: str, value: str) -> None:
        out[where[node]][kind] += graph.node(value).bytes

    scattered = set(zone.rows) if zone is not None else set()
    gathered = dict(zone.gathered) if zone is not None else {}
    if degree > 1:
        for region in plan.regions:
            if not region.splits_at(degree):
                continue
            for node in region.outputs:
                if node in scattered:
                    add("fwd_reduce_scatter", node, node)
                    add("bwd_all_gather", node, node)
                else:
                    add("fwd_all_reduce", node, node)
            for value in region.inputs:
                readers = [u for u in region.sharded if u in where and value in graph.node(u).inputs]
                first = min(readers, key=where.__getitem__)
                if first in gathered:
                    add("fwd_all_gather", first, value)
                    add("bwd_all_gather", first, value)  # gathered again for the weight gradients
                    add("bwd_reduce_scatter", first, value)
                else:
                    add("bwd_all_reduce", first, value)
        for e in plan.embeddings:
            if e.splits_at(degree):
                add("fwd_all_reduce", e.node, e.node)
        for o in plan.output_layers:
            if o.splits_at(degree) and vocab_parallel:
                logits = graph.node(o.node).bytes  # (positions, classes), as traced
                share = 3.0 / o.out_features
                out[-1]["fwd_all_reduce"] += Affine(logits.per_sample * share, logits.fixed * share)
            elif o.splits_at(degree):
                add("fwd_all_gather", o.node, o.node)
            if o.splits_at(degree):
                if o.node in gathered:
                    add("fwd_all_gather", o.node, o.input)
                    add("bwd_all_gather", o.node, o.input)
                    add("bwd_reduce_scatter", o.node, o.input)
                else:
                    add("bwd_all_reduce", o.node, o.input)
    if zone is not None:
        for node, values in zone.whole.items():
            for value in values:
                add("fwd_all_gather", node, value)
        for node, values in zone.split.items():
            for value in values:
                add("bwd_all_gather", node, value)
        for node in zone.exits:
            add("fwd_all_gather", node, node)
    return [TpCollectives(**c) for c in out]


def _line(seconds_per_byte: float, latency_s: float, size: Affine) -> Affine:
    if size.per_sample == 0 and size.fixed == 0:
        return Affine()
    return Affine(seconds_per_byte * size.per_sample, latency_s + seconds_per_byte * size.fixed)


def collective_times(
    traffic: Sequence[TpCollectives], degree: int, latency_s: float, bw_bytes_per_s: float, scale: float = 1.0
) -> list[tuple[Affine, Affine]]:
    """Seconds each block's collectives take in forward and in backward, as `α·b + β`: ring all-reduce
    2(t−1)(lat + S/(t·bw)), all-gather and reduce-scatter (t−1)(lat + S/(t·bw)) (`_core`'s closed forms, Jansen
    eq. 5.1), S the traffic's bytes times `scale` (activations traced in fp32, kept in 16 bits under mixed
    precision)."""
    if degree == 1:
        return [(Affine(), Affine()) for _ in traffic]
    ring = _core.ring_allreduce_time_s(1.0, degree, latency_s=0.0, bw_bytes_per_s=bw_bytes_per_s)
    gather = _core.all_gather_time_s(1.0, degree, latency_s=0.0, bw_bytes_per_s=bw_bytes_per_s)
    ring_lat = _core.ring_allreduce_time_s(0.0, degree, latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)
    gather_lat = _core.all_gather_time_s(0.0, degree, latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)

    def reduce(size: Affine) -> Affine:
        return _line(ring * scale, ring_lat, size)

    def half(size: Affine) -> Affine:  # an all-gather or a reduce-scatter
        return _line(gather * scale, gather_lat, size)

    return [
        (
            reduce(c.fwd_all_reduce) + half(c.fwd_all_gather) + half(c.fwd_reduce_scatter),
            reduce(c.bwd_all_reduce) + half(c.bwd_all_gather) + half(c.bwd_reduce_scatter),
        )
        for c in traffic
    ]
