"""A plan's model state per rank to the byte: how the runtime's ZeRO really splits the parameters.

The search counts the model state as bytes per parameter times the parameters, divided by the replicas where ZeRO
shards (`zero_model_state_bytes`). The runtime splits whole tensors or rows, not bytes:
- ZeRO-1 (`ZeroRedundancyOptimizer`) gives each parameter tensor's optimizer state to one replica, greedily: the
  tensors largest first, each to the replica holding the fewest elements so far (torch's `_partition_parameters`).
  The fullest replica holds more than 1/d.
- ZeRO-3 (FSDP2) splits each tensor along its first dimension into d rows of ⌈n₀/d⌉ (the last padded), and the first
  replica holds full rows of every tensor.
- Adam keeps a 4-byte `step` counter per tensor it steps, which the bytes per parameter leave out.
`exact_state` corrects a plan's stages by these, so that what it predicts is what the fullest replica holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pyplan.model_state import OPTIMIZERS
from pyplan.plan import Plan, Workload
from pyplan.solve.schedules import stage_placement

__all__ = ["exact_state", "stage_state_bytes", "zero1_shares"]

_STEP_COUNTER_BYTES = 4  # torch.optim.Adam/AdamW: a 0-dim float32 `step` per parameter tensor


def zero1_shares(numels: Sequence[int], replicas: int) -> list[list[int]]:
    """The tensors (their indices into `numels`) whose optimizer state each replica keeps under
    ZeroRedundancyOptimizer: largest first (stable among equals), each to the replica with the fewest elements."""
    shares: list[list[int]] = [[] for _ in range(replicas)]
    sizes = [0] * replicas
    for i in sorted(range(len(numels)), key=lambda k: -numels[k]):
        r = sizes.index(min(sizes))
        shares[r].append(i)
        sizes[r] += numels[i]
    return shares


def stage_state_bytes(shapes: Sequence[tuple[int, ...]], workload: Workload, replicas: int, zero_stage: int) -> float:
    """Model-state bytes the fullest replica of a stage holds, from the stage's parameter tensors' shapes."""
    per = workload.bytes_per_param()
    counters = _STEP_COUNTER_BYTES if workload.optimizer in ("adam", "adamw") else 0
    numels = [math.prod(s) for s in shapes]
    if replicas == 1 or zero_stage == 0:
        return (per.param_bytes + per.grad_bytes + per.optimizer_bytes) * sum(numels) + counters * len(numels)
    if zero_stage == 1:
        most = max(
            per.optimizer_bytes * sum(numels[i] for i in share) + counters * len(share)
            for share in zero1_shares(numels, replicas)
        )
        return (per.param_bytes + per.grad_bytes) * sum(numels) + most
    if zero_stage == 3:
        rows = sum(math.ceil(s[0] / replicas) * math.prod(s[1:]) if s else 1 for s in shapes)
        return (per.param_bytes + per.grad_bytes + per.optimizer_bytes) * rows + counters * len(numels)
    raise ValueError(f"ZeRO stage {zero_stage} has no runtime to split it")


def exact_state(plan: Plan, stage_shapes: Sequence[Sequence[tuple[int, ...]]], workload: Workload) -> Plan:
    """`plan` with each stage's model state as the fullest replica holds it (`stage_state_bytes`) in place of the
    search's bytes per parameter: its memory and the peak follow. `stage_shapes[s]` are stage s's parameter shapes."""
    if workload.optimizer not in OPTIMIZERS:
        return plan
    lay = plan.layout
    stages = []
    for st, shapes in zip(plan.stages, stage_shapes):
        exact = stage_state_bytes(shapes, workload, lay.dp, lay.zero_stage)
        delta = exact - workload.state_bytes_per_gpu(sum(math.prod(s) for s in shapes), lay.dp, lay.zero_stage)
        stages.append(replace(st, state_bytes=st.state_bytes + delta, memory_bytes=st.memory_bytes + delta))

    placement = stage_placement(lay.schedule, lay.pp, lay.stages_per_rank)
    ranks: dict[int, float] = {}
    for s, st in enumerate(stages):
        ranks[placement[s]] = ranks.get(placement[s], 0.0) + st.memory_bytes
    predicted = replace(plan.predicted, peak_memory_bytes=max(ranks.values()))
    return replace(plan, stages=tuple(stages), predicted=predicted)
