"""A chain as one tensor-parallel rank runs it: the blocks profiled on the rank's shards, plus the collectives.

At degree t (pyplan/graph/tensor_parallel.py's plan), a block's compute, saved activations and parameters are
those of the rank's graph (`local_module`: the split matmuls at their real shapes), and its time gains the
collectives of Megatron's f and g operators (Shoeybi et al. 2019, Fig. 3) on the link inside a node:
- a region's row-parallel outputs are all-reduced in forward, the gradient of its column-parallel input in
  backward (one all-reduce per distinct input: Q, K and V read one);
- a vocabulary-parallel embedding's output is all-reduced in forward;
- an output layer's logits are all-gathered in forward, its input's gradient all-reduced in backward.
The collectives block the computation that follows them (torch's DTensor styles issue them synchronously on the
compute stream), so they add to the block's time; nothing overlaps them. Sequence parallelism is not modelled
yet: the values between regions stay whole on every rank, as Korthikanti et al. 2022, Table 2's "tensor
parallel" row counts them (sbh·(10 + 24/t) without the attention scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pyplan import _core
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import linearize
from pyplan.graph.tensor_parallel import TpPlan, local_module
from pyplan.graph.trace import ExampleInputs, graph_of

__all__ = ["TpCollectives", "collective_bytes", "collective_times", "local_chain"]


@dataclass(frozen=True)
class TpCollectives:
    """One block's tensor-parallel traffic per micro-batch, as bytes of the whole tensor each collective produces
    (`per_sample·b + fixed`): all-reduced in forward and in backward, all-gathered in forward."""

    fwd_all_reduce: Affine
    bwd_all_reduce: Affine
    fwd_all_gather: Affine


def local_chain(chain: Chain, plan: TpPlan, degree: int, example_inputs: ExampleInputs) -> Chain:
    """The blocks of `chain` (same cuts, same names) as rank 0 of degree `degree` computes them, not yet profiled:
    its parameters are the rank's shards and every recorded shape is the rank's."""
    gm = local_module(chain.graph, plan, degree)
    graph = graph_of(gm, example_inputs, chain.graph.batch_size, chain.graph.leaf_modules)
    local = linearize(graph, positions=[c.position for c in chain.cuts[1:-1]], order=chain.order)
    blocks = [replace(lb, name=b.name) for lb, b in zip(local.blocks, chain.blocks, strict=True)]
    return replace(local, blocks=blocks)


def collective_bytes(chain: Chain, plan: TpPlan, degree: int) -> list[TpCollectives]:
    """Per block of `chain` (the whole model's), the tensor-parallel traffic at `degree`: each collective in the
    block of the node that issues it (a row Linear's output, the first column Linear reading an input, an
    embedding, an output layer)."""
    where = {node: i for i, block in enumerate(chain.blocks) for node in block.nodes}
    fwd_ar: list[Affine] = [Affine() for _ in chain.blocks]
    bwd_ar: list[Affine] = [Affine() for _ in chain.blocks]
    fwd_ag: list[Affine] = [Affine() for _ in chain.blocks]
    graph = chain.graph
    if degree > 1:
        for region in plan.regions:
            if not region.splits_at(degree):
                continue
            for node in region.outputs:
                fwd_ar[where[node]] += graph.node(node).bytes
            for value in region.inputs:
                readers = [u for u in region.sharded if u in where and value in graph.node(u).inputs]
                first = min(readers, key=where.__getitem__)
                bwd_ar[where[first]] += graph.node(value).bytes
        for e in plan.embeddings:
            if e.splits_at(degree):
                fwd_ar[where[e.node]] += graph.node(e.node).bytes
        for o in plan.output_layers:
            if o.splits_at(degree):
                fwd_ag[where[o.node]] += graph.node(o.node).bytes
                bwd_ar[where[o.node]] += graph.node(o.input).bytes
    return [TpCollectives(a, b, c) for a, b, c in zip(fwd_ar, bwd_ar, fwd_ag)]


def _line(seconds_per_byte: float, latency_s: float, size: Affine) -> Affine:
    if size.per_sample == 0 and size.fixed == 0:
        return Affine()
    return Affine(seconds_per_byte * size.per_sample, latency_s + seconds_per_byte * size.fixed)


def collective_times(
    traffic: Sequence[TpCollectives], degree: int, latency_s: float, bw_bytes_per_s: float, scale: float = 1.0
) -> list[tuple[Affine, Affine]]:
    """Seconds each block's collectives take in forward and in backward, as `α·b + β`: ring all-reduce
    2(t−1)(lat + S/(t·bw)) and all-gather (t−1)(lat + S/(t·bw)) (`_core`'s closed forms, Jansen eq. 5.1), S the
    traffic's bytes times `scale` (activations traced in fp32, kept in 16 bits under mixed precision)."""
    if degree == 1:
        return [(Affine(), Affine()) for _ in traffic]
    ring = _core.ring_allreduce_time_s(1.0, degree, latency_s=0.0, bw_bytes_per_s=bw_bytes_per_s)
    gather = _core.all_gather_time_s(1.0, degree, latency_s=0.0, bw_bytes_per_s=bw_bytes_per_s)
    ring_lat = _core.ring_allreduce_time_s(0.0, degree, latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)
    gather_lat = _core.all_gather_time_s(0.0, degree, latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)
    out = []
    for c in traffic:
        fwd = _line(ring * scale, ring_lat, c.fwd_all_reduce) + _line(gather * scale, gather_lat, c.fwd_all_gather)
        out.append((fwd, _line(ring * scale, ring_lat, c.bwd_all_reduce)))
    return out
