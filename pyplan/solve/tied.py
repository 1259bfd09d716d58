"""Parameters shared by stages on different ranks (tied embeddings): their gradients are summed every step.

A language model whose output layer reuses the input embedding's weight holds that weight on its first and last
stage. Each stage's backward produces a partial gradient; after the pipeline drains and before the optimizer step,
the ranks holding the copies all-reduce it (pyplan/runtime/trainer.py, `_finish_gradients`), in every replica at
once. Nothing overlaps it, so the iteration pays a ring all-reduce of the weight's gradient over those ranks, on
the link the pipeline's messages take. For GPT-2 xl (a 50,257 x 1,600 embedding) that is 320 MB of fp32 gradient a
step; for gpt-tiny on 2 CPU processes, a 64 KiB all-reduce measured at 2.2 ms (gloo's wake-up latency, see
pyplan/profile/calibrate.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pyplan import _core
from pyplan.graph.chain import Chain
from pyplan.hardware.catalog import Link
from pyplan.plan import Layout, Plan
from pyplan.solve.schedules import stage_placement

__all__ = ["TiedParameter", "tied_copies", "tied_parameters", "tied_sync_s", "with_tied_state", "with_tied_sync"]


@dataclass(frozen=True)
class TiedParameter:
    """One parameter read by several blocks of the chain, under one name or several."""

    numel: int
    names: tuple[str, ...]
    blocks: tuple[int, ...]  # the blocks that read it, increasing


def tied_parameters(chain: Chain) -> list[TiedParameter]:
    """The parameters that more than one block reads (Block.param_names lists every parameter a block reads;
    names that resolve to one tensor are one parameter)."""
    module = chain.graph.module
    registered = dict(module.named_parameters(remove_duplicate=False))  # one lookup each, not a walk per name
    users: dict[int, tuple[int, set[str], set[int]]] = {}
    for i, block in enumerate(chain.blocks):
        for name in block.param_names:
            tensor = registered.get(name)
            if tensor is None:
                try:
                    tensor = module.get_parameter(name)
                except AttributeError:
                    continue  # not reachable under this name in the traced module
            _, names, blocks = users.setdefault(id(tensor), (tensor.numel(), set(), set()))
            names.add(name)
            blocks.add(i)
    return [
        TiedParameter(numel, tuple(sorted(names)), tuple(sorted(blocks)))
        for numel, names, blocks in users.values()
        if len(blocks) > 1
    ]


def _stages(layout: Layout, chain: Chain, blocks: Sequence[int]) -> list[int]:
    """The stages holding the given blocks under `layout`, in the blocks' order (repeats removed)."""
    stages: list[int] = []
    if layout.stage_of_node:
        found = [layout.stage_of_node[n] for b in blocks for n in chain.blocks[b].nodes if n in layout.stage_of_node]
    else:
        bounds = list(layout.cut_positions)
        found = [bisect.bisect_right(bounds, chain.cuts[b].position) - 1 for b in blocks]
    for s in found:
        if s not in stages:
            stages.append(s)
    return stages


def _stage_ranks(layout: Layout, chain: Chain, blocks: Sequence[int]) -> set[int]:
    """The pipeline ranks (0..pp−1) holding the given blocks under `layout`."""
    placement = stage_placement(layout.schedule, layout.pp, layout.stages_per_rank)
    return {placement[s] for s in _stages(layout, chain, blocks)}


def tied_sync_s(
    layout: Layout,
    chain: Chain,
    tied: Sequence[TiedParameter],
    grad_bytes: float,
    *,
    intra: Link,
    inter: Link,
    gpus_per_node: int,
) -> float:
    """Seconds a step spends all-reducing the tied parameters' gradients: one ring all-reduce per parameter over
    the pipeline ranks that hold it, on the collective α-β of `inter` when those ranks are on different nodes
    (replica 0's; rank placement as search.cpp's layout_of), else `intra`."""
    total = 0.0
    for t in tied:
        ranks = sorted(_stage_ranks(layout, chain, t.blocks))
        if len(ranks) < 2:
            continue
        gpus = [_gpu(layout, r) for r in ranks]
        link = inter if len({g // gpus_per_node for g in gpus}) > 1 else intra
        latency, bw = link.collective
        total += _core.ring_allreduce_time_s(t.numel * grad_bytes, len(ranks), latency_s=latency, bw_bytes_per_s=bw)
    return total


def _gpu(layout: Layout, pipeline_rank: int) -> int:
    """The global rank of replica 0's pipeline rank r: r under "pp-inner", r·dp under "dp-inner"."""
    return pipeline_rank if layout.placement == "pp-inner" else pipeline_rank * layout.dp


def with_tied_sync(plan: Plan, seconds: float) -> Plan:
    """`plan` with `seconds` of exposed communication more per iteration (time, throughput and cost follow)."""
    if seconds <= 0:
        return plan
    p = plan.predicted
    iteration = p.iteration_s + seconds
    ratio = iteration / p.iteration_s
    predicted = replace(
        p,
        iteration_s=iteration,
        samples_per_s=p.samples_per_s / ratio,
        exposed_comm_s=p.exposed_comm_s + seconds,
        cost_per_iteration=p.cost_per_iteration * ratio,
        cost_per_epoch=None if p.cost_per_epoch is None else p.cost_per_epoch * ratio,
    )
    return replace(plan, predicted=predicted)


def tied_copies(layout: Layout, chain: Chain, tied: Sequence[TiedParameter]) -> list[list[TiedParameter]]:
    """Per stage of `layout`, the tied parameters whose own copy its rank keeps there: the chain counts a shared
    parameter once, in the first block that reads it; every other rank holding a stage that reads it keeps a copy,
    charged to its first such stage."""
    placement = stage_placement(layout.schedule, layout.pp, layout.stages_per_rank)
    out: list[list[TiedParameter]] = [[] for _ in range(layout.num_stages)]
    for t in tied:
        stages = _stages(layout, chain, t.blocks)
        charged = {placement[stages[0]]} if stages else set()  # the first block's rank: counted by the chain
        for s in stages:
            if placement[s] not in charged:
                charged.add(placement[s])
                out[s].append(t)
    return out


def with_tied_state(
    plan: Plan, chain: Chain, tied: Sequence[TiedParameter], state_bytes: Callable[[float], float]
) -> Plan:
    """`plan` with the model state of the tied parameters' copies: the chain counts a shared parameter once, in the
    first block that reads it, while every rank holding a stage that reads it keeps its own copy, with its
    gradient and optimizer state (`state_bytes(numel)`, by the plan's ZeRO stage). A rank's copy is charged to
    its first stage that reads it; the plan's peak is its fullest rank's memory again (measured on gpt-tiny's
    last stage, 1 x 2: 262 KB of AdamW state and weight for the 64 KiB embedding)."""
    lay = plan.layout
    placement = stage_placement(lay.schedule, lay.pp, lay.stages_per_rank)
    extra = [sum((state_bytes(t.numel) for t in copies), 0.0) for copies in tied_copies(lay, chain, tied)]
    if not any(extra):
        return plan
    stages_ = tuple(
        replace(st, state_bytes=st.state_bytes + e, memory_bytes=st.memory_bytes + e) if e else st
        for st, e in zip(plan.stages, extra)
    )
    ranks: dict[int, float] = {}
    for s, st in enumerate(stages_):
        ranks[placement[s]] = ranks.get(placement[s], 0.0) + st.memory_bytes
    predicted = replace(plan.predicted, peak_memory_bytes=max(ranks.values()))
    return replace(plan, stages=stages_, predicted=predicted)
