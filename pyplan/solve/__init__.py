"""Solvers: stage partitioning, schedule simulation and the plan search, over the C++ core."""

from pyplan._core import (
    ModelStateBytes,
    Overflow,
    PartitionResult,
    all_gather_time_s,
    bubble_fraction,
    hierarchical_allreduce_time_s,
    optimizer_step_time_s,
    p2p_time_s,
    partition,
    pipeline_time_s,
    reduce_scatter_time_s,
    ring_allreduce_time_s,
    zero_model_state_bytes,
)

__all__ = [
    "ModelStateBytes",
    "Overflow",
    "PartitionResult",
    "all_gather_time_s",
    "bubble_fraction",
    "hierarchical_allreduce_time_s",
    "optimizer_step_time_s",
    "p2p_time_s",
    "partition",
    "pipeline_time_s",
    "reduce_scatter_time_s",
    "ring_allreduce_time_s",
    "zero_model_state_bytes",
]
