"""ZeRO-3's collectives as the plan prices them, event by event, for the HTML report's schedule chart.

The planner prices a ZeRO-3 plan block by block (pyplan/planner.py, `Refiner._block_times`): each block's
weights are all-gathered over the data-parallel replicas before its forward and again before its backward, its
gradients reduce-scattered after its backward (half an all-reduce each, over the links the replicas span), the
collectives on the link one after another beside the compute (`zero3_overlap`, pyplan/runtime/units.py).
`zero3_detail` prices the same collectives from the search's chain and replays that overlap keeping every event, so
the chart can draw each block's compute and collectives where the plan put them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pyplan import _core
from pyplan.graph.chain import Chain
from pyplan.hardware import Cluster
from pyplan.plan import Plan, Workload

__all__ = ["Span", "Zero3Detail", "dp_span", "zero3_detail", "zero3_events"]

COMPUTE, ALL_GATHER, REDUCE_SCATTER = "compute", "all-gather", "reduce-scatter"


@dataclass(frozen=True)
class Span:
    """One event of a micro-batch's forward or backward: `kind` COMPUTE, ALL_GATHER or REDUCE_SCATTER, of chain block
    `block`, from `start_s` to `end_s` after the pass began (the forward at the first block, the backward at the
    last)."""

    kind: str
    block: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Zero3Detail:
    """One micro-batch's forward and backward over the chain under ZeRO-3, as the plan prices them.

    `forward_share_s[i]` and `backward_share_s[i]` are block i's parts of the pass (`zero3_overlap`'s): the time from
    the end of the block before to its own end, waits for the link included; a stage's forward or backward is the sum
    of its blocks' shares. `dp` replicas take part in each collective."""

    block_names: tuple[str, ...]
    dp: int
    forward: tuple[Span, ...]
    backward: tuple[Span, ...]
    forward_share_s: tuple[float, ...]
    backward_share_s: tuple[float, ...]


def zero3_events(
    fwd_s: Sequence[float], bwd_s: Sequence[float], gather_s: Sequence[float], scatter_s: Sequence[float]
) -> tuple[list[Span], list[Span], list[float], list[float]]:
    """`zero3_overlap`'s simulation, keeping its events: (forward spans, backward spans, forward shares, backward
    shares). Compute runs on one stream; the all-gathers and reduce-scatters on the link, one after another. Forward:
    the first all-gather is waited for, block i+1's issued when block i starts. Backward, from the last block: its
    all-gather is waited for, block i−1's issued when block i starts, block i's reduce-scatter when it ends, and the
    pass waits for the last reduce-scatter (in the first block's share)."""
    n = len(fwd_s)
    if not (len(bwd_s) == len(gather_s) == len(scatter_s) == n):
        raise ValueError("zero3_events needs one forward, backward, gather and scatter time per block")
    forward: list[Span] = []
    shares_f: list[float] = []
    if n:
        forward.append(Span(ALL_GATHER, 0, 0.0, gather_s[0]))
    link = gathered = gather_s[0] if n else 0.0
    end = 0.0
    for i in range(n):
        start = max(end, gathered)
        if i + 1 < n:  # the next block's all-gather, issued now
            issued = max(link, start)
            link = gathered = issued + gather_s[i + 1]
            forward.append(Span(ALL_GATHER, i + 1, issued, link))
        forward.append(Span(COMPUTE, i, start, start + fwd_s[i]))
        shares_f.append(start + fwd_s[i] - end)
        end = start + fwd_s[i]
    backward: list[Span] = []
    shares_b = [0.0] * n
    if n:
        backward.append(Span(ALL_GATHER, n - 1, 0.0, gather_s[-1]))
    link = gathered = gather_s[-1] if n else 0.0
    end = 0.0
    for i in range(n - 1, -1, -1):
        start = max(end, gathered)
        if i > 0:
            issued = max(link, start)
            link = gathered = issued + gather_s[i - 1]
            backward.append(Span(ALL_GATHER, i - 1, issued, link))
        backward.append(Span(COMPUTE, i, start, start + bwd_s[i]))
        shares_b[i] = start + bwd_s[i] - end
        end = start + bwd_s[i]
        issued = max(link, end)  # this block's reduce-scatter, issued at its end
        link = issued + scatter_s[i]
        backward.append(Span(REDUCE_SCATTER, i, issued, link))
    if n:
        shares_b[0] += max(0.0, link - end)
    return forward, backward, shares_f, shares_b


def dp_span(dp: int, pp: int, gpus_per_node: int, placement: str) -> tuple[int, int]:
    """(GPUs per node, nodes) of each stage's data-parallel group, as the search lays the ranks on nodes (search.cpp,
    `layout_of`): replica k of pipeline rank r is GPU k·pp + r ("pp-inner") or r·dp + k ("dp-inner"); a group whose
    runs of GPUs on one node differ in length counts as one GPU per node."""

    def gpu(k: int, r: int) -> int:
        return k * pp + r if placement == "pp-inner" else r * dp + k

    runs: set[int] = set()
    for r in range(pp):
        run = 0
        for k in range(dp):
            run += 1
            if k + 1 == dp or gpu(k + 1, r) // gpus_per_node != gpu(k, r) // gpus_per_node:
                runs.add(run)
                run = 0
    if len(runs) == 1:
        (common,) = runs
        return common, dp // common
    return 1, dp


def zero3_detail(plan: Plan, chain: Chain, cluster: Cluster, workload: Workload) -> Zero3Detail | None:
    """The plan's ZeRO-3 events from the chain it was searched on; None where the plan shards nothing (ZeRO below 3,
    one replica) or the chain is not what its stages were priced from (tensor parallelism prices one rank's chain;
    stages assigned operation by operation; a chain without times, other blocks), checked against the stages' priced
    forward and backward: their blocks' shares, or more where the plan adds the host's costs or recomputation."""
    lay = plan.layout
    if lay.zero_stage != 3 or lay.dp < 2 or lay.tp > 1 or lay.stage_of_node:
        return None
    blocks = chain.blocks
    fwd_times = [blk.fwd_time_s for blk in blocks]
    bwd_times = [blk.bwd_time_s for blk in blocks]
    if not blocks or plan.stages[-1].last_block >= len(blocks) or None in fwd_times or None in bwd_times:
        return None
    b = lay.micro_batch_size
    group = cluster.groups[0]
    per_node, nodes = dp_span(lay.dp, lay.pp, group.gpus_per_node, lay.placement)
    (intra_latency, intra_bw), (inter_latency, inter_bw) = group.intra_link.collective, group.inter_link.collective

    def half_allreduce(nbytes: float) -> float:
        whole = _core.hierarchical_allreduce_time_s(
            nbytes,
            per_node,
            nodes,
            intra_latency_s=intra_latency,
            intra_bw_bytes_per_s=intra_bw,
            inter_latency_s=inter_latency,
            inter_bw_bytes_per_s=inter_bw,
        )
        return whole / 2

    unit = workload.sharded_unit_bytes()
    forward, backward, shares_f, shares_b = zero3_events(
        [t(b) for t in fwd_times if t is not None],
        [t(b) for t in bwd_times if t is not None],
        [half_allreduce(blk.param_numel * unit.gathered) for blk in blocks],
        [half_allreduce(blk.param_numel * unit.reduced) for blk in blocks],
    )
    for st in plan.stages:
        span = slice(st.first_block, st.last_block + 1)
        own_f, own_b = sum(shares_f[span]), sum(shares_b[span])
        if plan.predicted.host_step_s == 0 and st.recompute_s == 0:  # the stage is its blocks' shares
            if not (
                math.isclose(own_f, st.forward_s, rel_tol=1e-9) and math.isclose(own_b, st.backward_s, rel_tol=1e-9)
            ):
                return None
        elif own_f > st.forward_s * (1 + 1e-9) or own_b > st.backward_s * (1 + 1e-9):
            return None  # the plan adds to the blocks' shares (the host's costs, recomputation), never takes away
    return Zero3Detail(
        block_names=tuple(blk.name for blk in blocks),
        dp=lay.dp,
        forward=tuple(forward),
        backward=tuple(backward),
        forward_share_s=tuple(shares_f),
        backward_share_s=tuple(shares_b),
    )
