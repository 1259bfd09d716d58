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
    "held_input_cuts",
    "hierarchical_allreduce_time_s",
    "in_flight_microbatches",
    "lower_order",
    "optimizer_step_time_s",
    "p2p_time_s",
    "partition_brute_force",
    "pipeline_time_s",
    "rank_activation_bytes",
    "receive_buffers",
    "reduce_scatter_time_s",
    "ring_allreduce_time_s",
    "warmup_send_held",
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


def rank_activation_bytes(order: Sequence[tuple[int, str, int]], bytes_per_microbatch: Sequence[float]) -> float:
    """The most one rank's stages hold at once as it runs `order` (its (stage, op, micro-batch) actions), each
    micro-batch of stage s holding bytes_per_microbatch[s] from the end of its F to the end of its B or W: the
    counts walked action by action, the sum taken after every one."""
    now = [0] * len(bytes_per_microbatch)
    most = 0.0
    for stage, op, _ in order:
        if op == "F":
            now[stage] += 1
        elif op in ("B", "W"):
            now[stage] -= 1
        most = max(most, sum(n * b for n, b in zip(now, bytes_per_microbatch)))
    return most


def held_input_cuts(num_microbatches: int, in_flight: int, stage: int) -> int:
    """Input cuts a stage holds beyond its in-flight inputs and its receive buffers: the rest of the replica's batch
    (m − n) on the first, its last backward's input gradient when n < m on a later one (partition.h)."""
    return num_microbatches - in_flight if stage == 0 else int(in_flight < num_microbatches)


def lower_order(
    schedule: str, order: Sequence[Sequence[tuple[int, str, int]]], stage_rank: Sequence[int]
) -> list[list[tuple[str, int, str, int]]]:
    """Each rank's (step, stage, op, micro-batch) with its sends and receives (simulate.h): GPipe and 1F1B receive
    just before the action that reads and send just after the one that makes; the others are lowered in rounds
    over the ranks, an action taken once what it reads has been received or made on its rank."""
    num_stages = len(stage_rank)
    if schedule in ("GPipe", "1F1B"):
        out: list[list[tuple[str, int, str, int]]] = []
        for rank in order:
            steps = []
            for s, op, k in rank:
                forward, kind = op == "F", "F" if op == "F" else "B"
                if (s > 0) if forward else (op != "W" and s < num_stages - 1):
                    steps.append(("receive", s, kind, k))
                steps.append(("compute", s, op, k))
                if (s < num_stages - 1) if forward else (op != "W" and s > 0):
                    steps.append(("send", s, kind, k))
            out.append(steps)
        return out
    done: set[tuple[int, str, int]] = set()  # (stage, "F" or "B", micro-batch) made, or received on its rank
    out = [[] for _ in order]
    position = [0] * len(order)
    while any(position[r] < len(order[r]) for r in range(len(order))):
        progress = False
        for r, rank in enumerate(order):
            if position[r] == len(rank):
                continue
            s, op, k = rank[position[r]]
            if op == "F" and s > 0:
                ready = ("F", s, k) in done
            elif op in ("B", "I") and s < num_stages - 1:
                ready = ("B", s, k) in done
            else:
                ready = True
            if not ready:
                continue
            out[r].append(("compute", s, op, k))
            if op == "F" and s < num_stages - 1:
                done.add(("F", s + 1, k))  # the next stage's input: made here, or received there
                if stage_rank[s + 1] != r:
                    out[r].append(("send", s, "F", k))
                    out[stage_rank[s + 1]].append(("receive", s + 1, "F", k))
            if op in ("B", "I") and s > 0:
                done.add(("B", s - 1, k))
                if stage_rank[s - 1] != r:
                    out[r].append(("send", s, "B", k))
                    out[stage_rank[s - 1]].append(("receive", s - 1, "B", k))
            position[r] += 1
            progress = True
        assert progress, "the order cannot be lowered"
    return out


def receive_buffers(
    lowered: Sequence[Sequence[tuple[str, int, str, int]]], stage_rank: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Per stage, the most input receive buffers and output gradients alive at once (simulate.h): an input from its
    receive to the end of the stage's B or W of that micro-batch; an output gradient from its receive, or from the
    next stage's B or I on the same rank, to the end of the stage's B or W."""
    num_stages = len(stage_rank)
    live: dict[str, list[set[int]]] = {kind: [set() for _ in range(num_stages)] for kind in ("F", "B")}
    most = {kind: [0] * num_stages for kind in ("F", "B")}

    def arrive(kind: str, s: int, k: int) -> None:
        live[kind][s].add(k)
        most[kind][s] = max(most[kind][s], len(live[kind][s]))

    for r, steps in enumerate(lowered):
        for step, s, op, k in steps:
            if step == "receive":
                arrive(op, s, k)
            elif step == "compute" and op in ("B", "W"):
                live["F"][s].discard(k)
                live["B"][s].discard(k)
            if step == "compute" and op in ("B", "I") and s > 0 and stage_rank[s - 1] == r:
                arrive("B", s - 1, k)
    return most["F"], most["B"]


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
    stage_unmade_grad_bytes: tuple[float, ...]  # left out of a stage in fresh_grads
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
    input_buffer_cuts: Sequence[int] = (),
    output_buffer_cuts: Sequence[int] = (),
    grad_bytes: Sequence[float] = (),
    fresh_grads: Sequence[bool] = (),
) -> Evaluated:
    """Stage times and memory of the stages [cuts[s], cuts[s+1]), computed directly from the definitions.

    Stage s holds `in_flight_per_stage[s]` micro-batches when given, else the schedule's rule, and when given
    `input_buffer_cuts[s]` more tensors of its input cut and `output_buffer_cuts[s]` of its output cut. A stage with
    `fresh_grads[s]` makes its gradients (`grad_bytes`, part of the state) after its activations peak: its need
    leaves out min(its gradients, in flight × its saved activations).
    """
    num_blocks, p = len(fwd_time_s), len(cuts) - 1

    def send_s(c: int) -> float:
        if c in (0, num_blocks):
            return 0.0
        return p2p_time_s(cut_bytes[c], latency_s=latency_s, bw_bytes_per_s=bw_bytes_per_s)

    times, states, acts, unmade, overflows = [], [], [], [], []
    for s, (i, j) in enumerate(itertools.pairwise(cuts)):
        blocks = range(i, j)
        times.append(sum(fwd_time_s[k] + bwd_time_s[k] for k in blocks) + send_s(j) + send_s(i))
        in_flight = (
            in_flight_per_stage[s] if in_flight_per_stage else in_flight_microbatches(schedule, s, p, num_microbatches)
        )
        states.append(sum(state_bytes[k] for k in blocks))
        acts.append(in_flight * (sum(act_bytes[k] for k in blocks) + cut_bytes[i]))
        fresh = bool(fresh_grads) and fresh_grads[s] and bool(grad_bytes)
        grads = sum(grad_bytes[k] for k in blocks) if fresh else 0.0
        unmade.append(min(grads, in_flight * sum(act_bytes[k] for k in blocks)) if fresh else 0.0)
        need = states[-1] + acts[-1] - unmade[-1]
        if input_buffer_cuts:
            need += input_buffer_cuts[s] * cut_bytes[i]
        if output_buffer_cuts:
            need += output_buffer_cuts[s] * cut_bytes[j]
        overflows.append(need - mem_limit_bytes[s])
    return Evaluated(
        cuts=tuple(cuts),
        stage_time_s=tuple(times),
        stage_state_bytes=tuple(states),
        stage_act_bytes=tuple(acts),
        stage_unmade_grad_bytes=tuple(unmade),
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
    input_buffer_cuts: Sequence[int] = (),
    output_buffer_cuts: Sequence[int] = (),
    grad_bytes: Sequence[float] = (),
    fresh_grads: Sequence[bool] = (),
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
            input_buffer_cuts=input_buffer_cuts,
            output_buffer_cuts=output_buffer_cuts,
            grad_bytes=grad_bytes,
            fresh_grads=fresh_grads,
        )
        for inner in ([tuple(only[1:-1])] if only else itertools.combinations(range(1, num_blocks), num_stages - 1))
    ]
    fitting = [e for e in candidates if e.fits]
    return BruteForce(
        best_pipeline_time=min(fitting, key=lambda e: e.pipeline_time_s, default=None),
        best_bottleneck=min(fitting, key=lambda e: (e.bottleneck_s, e.sum_s), default=None),
        least_overflow_bytes=min(e.overflow_bytes for e in candidates),
    )
