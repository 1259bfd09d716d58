"""What ZeRO-3 as FSDP2 runs it shards, and what that costs: the modules it makes units of, the blocks each
outermost unit spans, the bytes it holds gathered at a step's peak, and how its collectives overlap the compute.

The planner prices plans with these and the runtime (pyplan/runtime/sharded.py) shards by the same units; this
module imports no part of torch.distributed, so that planning does not load FSDP and DTensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from pyplan.plan import Layout
from pyplan.remat_plan import Checkpoint, Keep, SelectiveCheckpoint

__all__ = ["gathered_bytes", "outermost_units", "remat_kind", "shard_units", "unit_segments", "zero3_overlap"]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own, deepest first: the children of every `nn.ModuleList` and
    `nn.Sequential` that own parameters. The root, sharded last, holds the rest."""
    units = [
        child
        for parent in model.modules()
        if isinstance(parent, (nn.ModuleList, nn.Sequential))
        for child in parent.children()
        if any(True for _ in child.parameters())
    ]
    depth = {id(m): name.count(".") for name, m in model.named_modules()}
    return sorted(units, key=lambda m: -depth[id(m)])


def remat_kind(layout: Layout) -> str:
    """ "none" (every block keeps its activations), "units" (some blocks checkpointed in one level, as checkpointing
    whole units makes them: the runtime then checkpoints every unit), "selective units" (the same, selectively
    checkpointed) or "other" (nested checkpoints, offloading, blocks checkpointed selectively on their own)."""
    items = [it for r in layout.remat if r is not None for it in r.plan.items]
    if all(isinstance(it, Keep) for it in items):
        return "none"
    for kind, name in ((SelectiveCheckpoint, "selective units"), (Checkpoint, "units")):
        if all(
            isinstance(it, Keep) or (type(it) is kind and all(isinstance(x, Keep) for x in it.inner.items))
            for it in items
        ):
            return name
    return "other"


def outermost_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of `shard_units` inside no other unit, with their names: the ones the runtime checkpoints."""
    names = {id(m): name for name, m in model.named_modules()}
    units = [(names[id(u)], u) for u in shard_units(model)]
    paths = {p for p, _ in units}
    return [(p, u) for p, u in units if not any(a in paths for a in _ancestors(p))]


def _ancestors(path: str) -> list[str]:
    """The paths of the modules above `path`, outermost first: "a.b.c" -> ["a", "a.b"]."""
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def unit_segments(model: nn.Module, block_names: Sequence[str]) -> list[tuple[int, int]]:
    """The blocks each outermost unit spans, as [start, stop) runs of consecutive blocks (blocks are named by the
    module they come from): what checkpointing those units recomputes."""
    paths = {p for p, _ in outermost_units(model)}

    def unit_of(block: str) -> str | None:
        return next((p for p in (*_ancestors(block), block) if p in paths), None)

    owners = [unit_of(name) for name in block_names]
    runs: list[tuple[int, int]] = []
    for i, owner in enumerate(owners):
        if owner is None:
            continue
        if runs and owners[runs[-1][0]] == owner and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def gathered_bytes(
    model: nn.Module, param_bytes: float, grad_bytes: float, numel: Callable[[str], float] | None = None
) -> float:
    """Bytes FSDP2 holds unsharded beside the shards at a step's peak, at `param_bytes` and `grad_bytes` an element.

    The root unit stays gathered from its forward to the end of its backward (FSDP2 does not reshard the root after
    forward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_lazy_init`), with its gradient before the last
    reduce-scatter; a layer unit is gathered in its forward and again in its backward beside the next one, which is
    prefetched, and its unsharded gradient lives until its reduce-scatter: (P + G)·root + (2·P + G)·largest unit.

    `numel` (a parameter's name -> the elements one rank holds) gives the sizes beside tensor parallelism, where the
    units are the outermost ones (`TracedUnits` shards one piece per outermost unit)."""
    units = shard_units(model) if numel is None else [u for _, u in outermost_units(model)]
    names = {id(p): name for name, p in model.named_parameters()}
    size = (lambda p: float(p.numel())) if numel is None else (lambda p: numel(names[id(p)]))
    claimed: set[int] = set()
    largest = 0.0
    for unit in units:
        own = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in own)
        largest = max(largest, sum(size(p) for p in own))
    root = sum(size(p) for p in model.parameters() if id(p) not in claimed)
    return (param_bytes + grad_bytes) * root + (2 * param_bytes + grad_bytes) * largest


def zero3_overlap(
    fwd_s: Sequence[float], bwd_s: Sequence[float], gather_s: Sequence[float], scatter_s: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Each block's share of one micro-batch's forward and backward under ZeRO-3 as FSDP2 runs it: the compute on
    one stream, the collectives on the link one after another (`gather_s`: a block's all-gather of its weights,
    `scatter_s`: the reduce-scatter of its gradients), simulated event by event.

    Forward: the first all-gather is waited for; block i+1's is issued when block i starts (FSDP2 prefetches the
    next unit's all-gather while the current one computes), and a block starts once the one before has finished
    and its own weights are gathered. Backward, from the last block: its all-gather is waited for; block i−1's is
    issued when block i starts, block i's reduce-scatter when it ends, and the step waits for the last
    reduce-scatter. A block's share is the time from the end of the block before to its own end (the last
    reduce-scatter's wait goes to the first block's backward). With the link always ahead of the compute this is
    max(fwd_i, gather_{i+1}) (+ gather_0 for the first block) and max(bwd_i, gather_{i−1} + scatter_{i+1}); in
    total it is never more than the compute and the communication one after the other, nor less than either."""
    n = len(fwd_s)
    if not (len(bwd_s) == len(gather_s) == len(scatter_s) == n):
        raise ValueError("zero3_overlap needs one forward, backward, gather and scatter time per block")
    fwd: list[float] = []
    link = gathered = gather_s[0] if n else 0.0
    end = 0.0
    for i in range(n):
        start = max(end, gathered)
        if i + 1 < n:  # the next block's all-gather, issued now
            link = gathered = max(link, start) + gather_s[i + 1]
        fwd.append(start + fwd_s[i] - end)
        end = start + fwd_s[i]
    bwd = [0.0] * n
    link = gathered = gather_s[-1] if n else 0.0
    end = 0.0
    for i in range(n - 1, -1, -1):
        start = max(end, gathered)
        if i > 0:
            link = gathered = max(link, start) + gather_s[i - 1]
        bwd[i] = start + bwd_s[i] - end
        end = start + bwd_s[i]
        link = max(link, end) + scatter_s[i]  # this block's reduce-scatter, issued at its end
    if n:
        bwd[0] += max(0.0, link - end)
    return fwd, bwd
