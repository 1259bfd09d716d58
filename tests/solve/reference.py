"""Readable pure-Python versions of the C++ core's cost formulas and partition, used only by tests."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BruteForce",
    "Evaluated",
    "all_gather_time_s",
    "bubble_fraction",
    "evaluate_partition",
    "hierarchical_allreduce_time_s",
    "in_flight_microbatches",
    "optimizer_step_time_s",
    "p2p_time_s",
    "partition_brute_force",
    "pipeline_time_s",
    "reduce_scatter_time_s",
    "ring_allreduce_time_s",
    "zero_model_state_bytes",
]


def p2p_time_s(bytes: float, *, latency_s: float, bw_bytes_per_s: float) -> float:
    """α-β point-to-point send."""
    return latency_s + bytes / bw_bytes_per_s


def reduce_scatter_time_s(bytes: float, num_ranks: int, *, latency_s: float, bw_bytes_per_s: float) -> float:
    """d−1 ring steps, each moving 1/d of the tensor."""
    d = num_ranks
    return (d - 1) * (latency_s + bytes / (d * bw_bytes_per_s))


def all_gather_time_s(bytes: float, num_ranks: int, *, latency_s: float, bw_bytes_per_s: float) -> float:
    """The mirror of reduce-scatter: the same d−1 steps."""
    return reduce_scatter_time_s(bytes, num_ranks, latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)


def ring_allreduce_time_s(bytes: float, num_ranks: int, *, latency_s: float, bw_bytes_per_s: float) -> float:
    """2(d−1)·(α + G/(d·BW)), Jansen's thesis eq. 5.1."""
    d = num_ranks
    return 2 * (d - 1) * (latency_s + bytes / (d * bw_bytes_per_s))


def hierarchical_allreduce_time_s(
    bytes: float,
    gpus_per_node: int,
    num_nodes: int,
    *,
    intra_latency_s: float,
    intra_bw_bytes_per_s: float,
    inter_latency_s: float,
    inter_bw_bytes_per_s: float,
) -> float:
    """Reduce-scatter in the node, all-reduce of the 1/g shard across nodes, all-gather in the node."""
    g, n = gpus_per_node, num_nodes
    inside = 2 * (g - 1) * (intra_latency_s + bytes / (g * intra_bw_bytes_per_s))
    across = 2 * (n - 1) * (inter_latency_s + bytes / (g * n * inter_bw_bytes_per_s))
    return inside + across


def zero_model_state_bytes(
    num_params: float,
    num_replicas: int,
    zero_stage: int,
    *,
    param_bytes: float,
    grad_bytes: float,
    optim_bytes: float,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per GPU; stage k shards optimizer, gradients, weights."""
    psi, d = num_params, num_replicas
    optim = optim_bytes * psi / d if zero_stage >= 1 else optim_bytes * psi
    grad = grad_bytes * psi / d if zero_stage >= 2 else grad_bytes * psi
    param = param_bytes * psi / d if zero_stage >= 3 else param_bytes * psi
    return param, grad, optim


def pipeline_time_s(stage_time_s: Sequence[float], num_microbatches: int) -> float:
    """Σ_s t_s + (m−1)·max_s t_s, Huang et al. eq. 1."""
    return sum(stage_time_s) + (num_microbatches - 1) * max(stage_time_s)


def bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Idle share of a balanced pipeline: bubble (p−1)·t/v over total m·t + (p−1)·t/v."""
    bubble = (num_stages - 1) / num_chunks
    return bubble / (num_microbatches + bubble)


def optimizer_step_time_s(bytes_read: float, bytes_written: float, mem_bw_bytes_per_s: float) -> float:
    """Every byte read and written once at memory bandwidth."""
    return (bytes_read + bytes_written) / mem_bw_bytes_per_s


def in_flight_microbatches(schedule: str, stage: int, num_stages: int, num_microbatches: int) -> int:
    """GPipe keeps all m micro-batches' activations; 1F1B keeps min(m, p−s) on stage s."""
    if schedule == "GPipe":
        return num_microbatches
    return min(num_microbatches, num_stages - stage)


def extra_input_cuts(num_microbatches: int, in_flight: int) -> int:
    """Input cuts a stage s > 0 holds beyond its in-flight inputs: receive buffers for the other m − n
    micro-batches, and its last backward's input gradient when n < m (partition.h)."""
    return num_microbatches - in_flight + (in_flight < num_microbatches)


def held_input_cuts(num_microbatches: int, in_flight: int, stage: int) -> int:
    """Input cuts a stage holds beyond its in-flight inputs: extra_input_cuts for a later stage, the rest of the
    replica's batch (m − n) for the first (partition.h)."""
    return extra_input_cuts(num_microbatches, in_flight) if stage > 0 else num_microbatches - in_flight


def warmup_send_held(schedule: str, num_microbatches: int, num_stages: int, stage: int) -> int:
    """1 when a 1F1B stage keeps its last warm-up send's output past that micro-batch's backward (simulate.h)."""
    w = min(num_microbatches, num_stages - stage)
    return int(schedule == "1F1B" and stage < num_stages - 1 and w >= 2 and num_microbatches >= 2 * w - 1)


@dataclass(frozen=True)
class Evaluated:
    """One partition, measured by the formulas of partition.h."""

    cuts: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    stage_state_bytes: tuple[float, ...]
    stage_act_bytes: tuple[float, ...]
    overflow_bytes: float  # max over stages of need − limit; ≤ 0 when it fits
    pipeline_time_s: float
    bottleneck_s: float
    sum_s: float

    @property
    def fits(self) -> bool:
        return self.overflow_bytes <= 0


def evaluate_partition(
    cuts: Sequence[int],
    fwd_time_s: Sequence[float],
    bwd_time_s: Sequence[float],
    act_bytes: Sequence[float],
    state_bytes: Sequence[float],
    cut_bytes: Sequence[float],
    *,
    num_microbatches: int,
    mem_limit_bytes: Sequence[float],
    schedule: str = "1F1B",
    latency_s: float = 0.0,
    bw_bytes_per_s: float = math.inf,
    in_flight_per_stage: Sequence[int] = (),
    receive_buffers: bool = False,
    extra_output_cuts: Sequence[int] = (),
) -> Evaluated:
    """Stage times and memory of the stages [cuts[s], cuts[s+1]), computed directly from the definitions.

    Stage s holds `in_flight_per_stage[s]` micro-batches when given, else the schedule's rule. With
    `receive_buffers`, torch's receive buffers count too: (m − n_s) more inputs (s > 0; on the first stage the
    rest of the batch), the last input gradient when n_s < m (s > 0), and m + extra_output_cuts[s] output-sized
    tensors (s < p − 1).
    """
    num_blocks, p = len(fwd_time_s), len(cuts) - 1

    def send_s(c: int) -> float:
        if c in (0, num_blocks):
            return 0.0
        return p2p_time_s(cut_bytes[c], latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)

    times, states, acts, overflows = [], [], [], []
    for s, (i, j) in enumerate(itertools.pairwise(cuts)):
        blocks = range(i, j)
        times.append(sum(fwd_time_s[k] + bwd_time_s[k] for k in blocks) + send_s(j) + send_s(i))
        in_flight = (
            in_flight_per_stage[s] if in_flight_per_stage else in_flight_microbatches(schedule, s, p, num_microbatches)
        )
        states.append(sum(state_bytes[k] for k in blocks))
        acts.append(in_flight * (sum(act_bytes[k] for k in blocks) + cut_bytes[i]))
        need = states[-1] + acts[-1]
        if receive_buffers:
            m = num_microbatches
            outputs = m + (extra_output_cuts[s] if extra_output_cuts else 0)
            need += held_input_cuts(m, in_flight, s) * cut_bytes[i] + outputs * cut_bytes[j] * (s < p - 1)
        overflows.append(need - mem_limit_bytes[s])
    return Evaluated(
        cuts=tuple(cuts),
        stage_time_s=tuple(times),
        stage_state_bytes=tuple(states),
        stage_act_bytes=tuple(acts),
        overflow_bytes=max(overflows),
        pipeline_time_s=pipeline_time_s(times, num_microbatches),
        bottleneck_s=max(times),
        sum_s=sum(times),
    )


@dataclass(frozen=True)
class BruteForce:
    """The best partition by each objective over every composition, and the least worst overflow."""

    best_pipeline_time: Evaluated | None  # None when nothing fits
    best_bottleneck: Evaluated | None  # least (max t_s, Σ t_s)
    least_overflow_bytes: float


def partition_brute_force(
    fwd_time_s: Sequence[float],
    bwd_time_s: Sequence[float],
    act_bytes: Sequence[float],
    state_bytes: Sequence[float],
    cut_bytes: Sequence[float],
    *,
    num_stages: int,
    num_microbatches: int,
    mem_limit_bytes: Sequence[float],
    schedule: str = "1F1B",
    latency_s: float = 0.0,
    bw_bytes_per_s: float = math.inf,
    in_flight_per_stage: Sequence[int] = (),
    receive_buffers: bool = False,
    extra_output_cuts: Sequence[int] = (),
    only: Sequence[int] = (),
) -> BruteForce:
    """Evaluates every split of the L blocks into num_stages non-empty contiguous stages (or only the split `only`,
    given as its p + 1 cuts)."""
    num_blocks = len(fwd_time_s)
    candidates = [
        evaluate_partition(
            (0, *inner, num_blocks),
            fwd_time_s,
            bwd_time_s,
            act_bytes,
            state_bytes,
            cut_bytes,
            num_microbatches=num_microbatches,
            mem_limit_bytes=mem_limit_bytes,
            schedule=schedule,
            latency_s=latency_s,
            bw_bytes_per_s=bw_bytes_per_s,
            in_flight_per_stage=in_flight_per_stage,
            receive_buffers=receive_buffers,
            extra_output_cuts=extra_output_cuts,
        )
        for inner in (
            [tuple(only[1:-1])] if only else itertools.combinations(range(1, num_blocks), num_stages - 1)
        )
    ]
    fitting = [e for e in candidates if e.fits]
    return BruteForce(
        best_pipeline_time=min(fitting, key=lambda e: e.pipeline_time_s, default=None),
        best_bottleneck=min(fitting, key=lambda e: (e.bottleneck_s, e.sum_s), default=None),
        least_overflow_bytes=min(e.overflow_bytes for e in candidates),
    )
