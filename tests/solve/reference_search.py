"""A brute-force plan search under the model of cpp/include/pyplan/search.h, used only by tests.

It evaluates every configuration (d, p, v, b, m, schedule, ZeRO stage, placement) with every contiguous
partition of the chain: per configuration it keeps the partition with the least closed-form pipeline time
(the one the C++ partition finds), then simulates it. No pruning, no sharing: slow and plain on purpose.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pyplan.solve.schedules import pipeline_order, simulate, stage_placement
from tests.solve import reference

__all__ = ["Hardware", "Outcome", "Planned", "ProfiledChain", "Space", "search_brute_force"]

_SINGLE_STAGE = ("GPipe", "1F1B")  # one stage per rank; the interleaved schedules take any allowed v >= 2


@dataclass(frozen=True)
class ProfiledChain:
    """Per block (L): times α·b + β (or, with `time_sizes`, the line between the neighbouring points of the
    block's row of `fwd_points_s`/`bwd_points_s`) and saved bytes; per cut (L+1): live bytes."""

    fwd_alpha_s: Sequence[float]
    fwd_beta_s: Sequence[float]
    bwd_alpha_s: Sequence[float]
    bwd_beta_s: Sequence[float]
    act_per_sample_bytes: Sequence[float]
    act_fixed_bytes: Sequence[float]
    params: Sequence[float]
    cut_per_sample_bytes: Sequence[float]
    cut_fixed_bytes: Sequence[float]
    param_tensors: Sequence[float] = ()  # [L], empty: none
    cut_tensors: Sequence[float] = ()  # [L+1], empty: none
    time_sizes: Sequence[float] = ()  # [K], empty: times are α·b + β
    fwd_points_s: Sequence[float] = ()  # [L*K], block i's at time_sizes[k] at i*K + k
    bwd_points_s: Sequence[float] = ()  # [L*K]

    def time_s(self, block: int, b: int, *, forward: bool) -> float:
        """The block's forward or backward seconds at micro-batch size b."""
        if not self.time_sizes:
            if forward:
                return self.fwd_alpha_s[block] * b + self.fwd_beta_s[block]
            return self.bwd_alpha_s[block] * b + self.bwd_beta_s[block]
        sizes = list(self.time_sizes)
        n = len(sizes)
        row = (self.fwd_points_s if forward else self.bwd_points_s)[block * n : (block + 1) * n]
        k = min(max(bisect.bisect_left(sizes, b), 1), n - 1)
        slope = (row[k] - row[k - 1]) / (sizes[k] - sizes[k - 1])
        return max(0.0, row[k - 1] + slope * (b - sizes[k - 1]))


@dataclass(frozen=True)
class Host:
    """search.h's HostCosts."""

    stage_forward_s: float = 0.0
    stage_backward_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    optimizer_tensor_s: float = 0.0
    optimizer_element_s: float = 0.0
    sync_overlaps_backward: bool = True


@dataclass(frozen=True)
class Hardware:
    num_gpus: int
    gpus_per_node: int
    gpu_mem_bytes: float
    mem_bw_bytes_per_s: float
    intra: tuple[float, float]  # (latency_s, bw_bytes_per_s)
    inter: tuple[float, float]
    price_per_gpu_s: float
    intra_collective: tuple[float, float] | None = None  # None: intra
    inter_collective: tuple[float, float] | None = None
    host: Host = Host()


@dataclass(frozen=True)
class Space:
    global_batch: int
    bytes_per_param: tuple[float, float, float]  # weights, gradients, optimizer state
    micro_batch_sizes: Sequence[int] = ()
    schedules: Sequence[str] = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
    stages_per_rank: Sequence[int] = (1, 2, 3, 4)  # allowed v: 1 for GPipe and 1F1B, 2 or more interleaved
    zero_stages: Sequence[int] = (0, 1, 2, 3)
    placements: Sequence[str] = ("pp-inner", "dp-inner")
    allow_fewer_gpus: bool = False
    zero3_single_stage: bool = False
    zero3_gather_bytes: float = 0.0  # 0: the weights' bytes
    zero3_reduce_bytes: float = 0.0  # 0: the gradients' bytes
    objective: str = "time"
    weight: float = 0.0
    fixed_cuts: Sequence[int] = ()  # the partition, from 0 to L: only configurations of that many stages
    fresh_gradients: bool = False  # one replica frees its gradients every step (search.h step 3)


@dataclass(frozen=True)
class Planned:
    """One feasible configuration and its predictions."""

    dp: int
    pp: int
    stages_per_rank: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    zero_stage: int
    placement: str
    cuts: tuple[int, ...]
    iteration_s: float
    cost_per_iteration: float
    peak_memory_bytes: float
    objective: float


@dataclass(frozen=True)
class Outcome:
    feasible: list[Planned]
    least_need_bytes: float  # over the infeasible configurations; inf when there are none
    num_candidates: int


def _gpu(placement: str, d: int, p: int, k: int, r: int, tp: int = 1) -> int:
    """The first GPU of replica k's pipeline rank r; with tensor parallelism its tp GPUs follow it."""
    return (k * p + r if placement == "pp-inner" else r * d + k) * tp


def _pipeline_inter(d: int, p: int, v: int, g: int, placement: str, tp: int = 1) -> bool:
    pairs = [(r, r + 1) for r in range(p - 1)] + ([(p - 1, 0)] if v > 1 and p > 1 else [])
    node = functools.partial(_gpu, placement, d, p, tp=tp)
    return any(node(k, a) // g != node(k, b) // g for k in range(d) for a, b in pairs)


def _dp_shape(d: int, p: int, g: int, placement: str, tp: int = 1) -> tuple[int, int]:
    """(g', n'): the same g' members of every dp group in each of n' nodes, else a flat ring (1, d). With tensor
    parallelism, the group of each tp index (their nodes are alike)."""
    counts = set()
    for r in range(p):
        per_node: dict[int, int] = {}
        for k in range(d):
            node = _gpu(placement, d, p, k, r, tp) // g
            per_node[node] = per_node.get(node, 0) + 1
        counts |= set(per_node.values())
    if len(counts) == 1:
        (c,) = counts
        return c, d // c
    return 1, d


@dataclass(frozen=True)
class _Config:
    d: int
    p: int
    v: int
    b: int
    m: int
    schedule: str
    zero: int
    placement: str


def _configurations(num_blocks: int, hw: Hardware, space: Space, tp: int = 1) -> list[_Config]:
    """Every (d, p, b, m, schedule, ZeRO stage, placement) of search.h's enumeration, deduplicated alike; with
    tensor parallelism d·p groups of tp GPUs."""
    n, batch = hw.num_gpus // tp, space.global_batch
    out = []
    for d in range(1, n + 1):
        for p in range(1, n // d + 1):
            if (d * p != n and not space.allow_fewer_gpus) or batch % d or p > num_blocks:
                continue
            per_replica = batch // d
            for b in sorted(set(space.micro_batch_sizes or range(1, per_replica + 1))):
                if per_replica % b:
                    continue
                m = per_replica // b
                for schedule in space.schedules:
                    for v in sorted(set(space.stages_per_rank)):
                        if (v == 1) != (schedule in _SINGLE_STAGE):
                            continue
                        if space.fixed_cuts and p * v + 1 != len(space.fixed_cuts):
                            continue
                        if p * v > num_blocks or (v > 1 and p < 2) or reference_rejects(schedule, p, m, v):
                            continue
                        zeros = [0] if d == 1 else space.zero_stages
                        if space.zero3_single_stage and (p * v > 1 or schedule != "1F1B"):
                            zeros = [z for z in zeros if z != 3]
                        placements = space.placements[:1] if d == 1 or p == 1 else space.placements
                        out += [_Config(d, p, v, b, m, schedule, z, pl) for z in zeros for pl in placements]
    return out


@dataclass(frozen=True)
class Bound:
    """A lower bound on a configuration's memory need (not exact: named only when no need is)."""

    bytes: float


def _evaluate(chain: ProfiledChain, hw: Hardware, space: Space, c: _Config, tp: int = 1) -> Planned | float | Bound:
    """The planned configuration, or the memory its fullest GPU would need when it does not fit. With tensor
    parallelism `chain` is what one of the tp GPUs of each group runs, and every one of them pays."""
    num_blocks = len(chain.fwd_alpha_s)
    param_b, grad_b, optim_b = space.bytes_per_param
    inter = c.p > 1 and _pipeline_inter(c.d, c.p, c.v, hw.gpus_per_node, c.placement, tp)
    link = hw.inter if inter else hw.intra
    shape = _dp_shape(c.d, c.p, hw.gpus_per_node, c.placement, tp)

    intra_c, inter_c = hw.intra_collective or hw.intra, hw.inter_collective or hw.inter
    host = hw.host

    def allreduce_s(nbytes: float) -> float:
        return reference.hierarchical_allreduce_time_s(
            nbytes,
            shape[0],
            shape[1],
            intra_latency_s=intra_c[0],
            intra_bw_bytes_per_s=intra_c[1],
            inter_latency_s=inter_c[0],
            inter_bw_bytes_per_s=inter_c[1],
        )

    # 1. Block times at b, with ZeRO-3's all-gathers and reduce-scatter; memory at b.
    fwd = [chain.time_s(i, c.b, forward=True) for i in range(num_blocks)]
    bwd = [chain.time_s(i, c.b, forward=False) for i in range(num_blocks)]
    if c.zero == 3:
        gather_b, reduce_b = space.zero3_gather_bytes or param_b, space.zero3_reduce_bytes or grad_b
        for i, params in enumerate(chain.params):
            fwd[i] += allreduce_s(params * gather_b) / 2
            bwd[i] += allreduce_s(params * gather_b) / 2 + allreduce_s(params * reduce_b) / 2
    act = [chain.act_per_sample_bytes[i] * c.b + chain.act_fixed_bytes[i] for i in range(num_blocks)]
    cut = [chain.cut_per_sample_bytes[k] * c.b + chain.cut_fixed_bytes[k] for k in range(num_blocks + 1)]
    per_param = {"param_bytes": param_b, "grad_bytes": grad_b, "optim_bytes": optim_b}
    state = [sum(reference.zero_model_state_bytes(x, c.d, c.zero, **per_param)) for x in chain.params]
    grads = [reference.zero_model_state_bytes(x, c.d, c.zero, **per_param)[1] for x in chain.params]

    # 3. The partition with the least closed-form time among those whose stages fit. In flight: the
    # partition's rule with one stage per rank, the simulated peak (it depends only on the order) with several.
    stages = c.p * c.v
    if c.v == 1:
        in_flight = [reference.in_flight_microbatches(c.schedule, s, stages, c.m) for s in range(stages)]
    else:
        unit = [1.0] * stages
        in_flight = list(simulate(c.schedule, unit, unit, num_microbatches=c.m, stages_per_rank=c.v).peak_in_flight)
    # 9. What a stage holds beside its state and in-flight activations: receive buffers of its input posted ahead
    # of their forward, the first stage's batch or the last input gradient; output gradients and 1F1B's last
    # warm-up send (search.h).
    placement = stage_placement(c.schedule, c.p, c.v)
    order = [[(a.stage, a.op, a.microbatch) for a in rank] for rank in pipeline_order(c.schedule, c.p, c.m, c.v)]
    inputs, gradients = reference.receive_buffers(reference.lower_order(c.schedule, order, placement), placement)
    held_in = [reference.held_input_cuts(c.m, in_flight[s], s) + (inputs[s] - in_flight[s] if inputs[s] else 0)
               for s in range(stages)]  # fmt: skip
    held_out = [gradients[s] + reference.warmup_send_held(c.schedule, c.m, stages, s) if s < stages - 1 else 0
                for s in range(stages)]  # fmt: skip
    # 3. One replica and one stage per rank: a stage that runs every forward before its first backward makes its
    # gradients after its activations peak, and leaves out min(gradients, n·saved) (search.h).
    fresh = [space.fresh_gradients and c.d == 1 and c.v == 1 and in_flight[s] == c.m for s in range(stages)]
    found = reference.partition_brute_force(
        fwd,
        bwd,
        act,
        state,
        cut,
        num_stages=stages,
        num_microbatches=c.m,
        mem_limit_bytes=[hw.gpu_mem_bytes] * stages,
        schedule="1F1B" if c.schedule == "1F1B" else "GPipe",
        latency_s=link[0],
        bw_bytes_per_s=link[1],
        in_flight_per_stage=in_flight,
        input_buffer_cuts=held_in,
        output_buffer_cuts=held_out,
        grad_bytes=grads,
        fresh_grads=fresh,
        only=space.fixed_cuts,
    )
    if found.best_pipeline_time is None:
        # Several stages per rank: the stage limits are necessary only, the need a lower bound (search.cpp).
        need = hw.gpu_mem_bytes + found.least_overflow_bytes
        return need if c.v == 1 else Bound(need)
    cuts = found.best_pipeline_time.cuts
    spans = [range(cuts[s], cuts[s + 1]) for s in range(stages)]
    # 8. Host costs per stage and micro-batch: bookkeeping, and the messages of its input and output cuts.
    tensors = list(chain.cut_tensors) or [0.0] * (num_blocks + 1)
    tensors[0] = tensors[-1] = 0.0
    messages = [host.message_s * (tensors[cuts[s]] + tensors[cuts[s + 1]]) for s in range(stages)]
    f_s = [sum(fwd[i] for i in blocks) + host.stage_forward_s + messages[s] for s, blocks in enumerate(spans)]
    b_s = [sum(bwd[i] for i in blocks) + host.stage_backward_s + messages[s] for s, blocks in enumerate(spans)]

    # 4. The simulated makespan.
    sends = [link[0] + cut[cuts[s + 1]] / link[1] for s in range(stages - 1)]
    sim = simulate(
        c.schedule,
        f_s,
        b_s,
        num_microbatches=c.m,
        stages_per_rank=c.v,
        send_forward_s=sends,
        send_backward_s=sends,
    )
    assert list(sim.peak_in_flight) == in_flight  # the peak depends only on the order
    rank_mem, rank_state = [0.0] * c.p, [0.0] * c.p
    per_microbatch = [sum(act[i] for i in blocks) + cut[cuts[s]] for s, blocks in enumerate(spans)]
    # 3. Activations: each stage's own peak with one stage per rank; with several, the rank's peak over time, its
    # order walked action by action (search.h).
    if c.v > 1:
        for r, actions in enumerate(order):
            rank_mem[r] += reference.rank_activation_bytes(actions, per_microbatch)
    for s, blocks in enumerate(spans):
        stage_state = sum(state[i] for i in blocks)
        rank_state[s % c.p] += stage_state
        rank_mem[s % c.p] += stage_state + (in_flight[s] * per_microbatch[s] if c.v == 1 else 0.0)
        if fresh[s]:
            rank_mem[s % c.p] -= min(sum(grads[i] for i in blocks), in_flight[s] * sum(act[i] for i in blocks))
        # 9. Receive buffers, the batch, the last input gradient, a kept send (above).
        rank_mem[s % c.p] += held_in[s] * cut[cuts[s]] + held_out[s] * cut[cuts[s + 1]]
    if max(rank_mem) > hw.gpu_mem_bytes:
        return max(rank_mem)

    # 5.-7. Exposed gradient sync, optimizer step, totals.
    exposed = 0.0
    rank_sync = [0.0] * c.p
    if c.d > 1 and c.zero < 3:
        for s, blocks in enumerate(spans):
            sync = allreduce_s(sum(chain.params[i] for i in blocks) * grad_b)
            rank_sync[s % c.p] += sync
            if host.sync_overlaps_backward:
                exposed = max(exposed, sync - b_s[s])
        if not host.sync_overlaps_backward:
            exposed = max(rank_sync)
    shard = c.d if c.zero >= 1 else 1
    param_tensors = list(chain.param_tensors) or [0.0] * num_blocks
    rank_elements, rank_tensors = [0.0] * c.p, [0.0] * c.p
    for s, blocks in enumerate(spans):
        rank_elements[s % c.p] += sum(chain.params[i] for i in blocks) / shard
        rank_tensors[s % c.p] += sum(param_tensors[i] for i in blocks)

    def optimizer_s(r: int) -> float:
        body = max(2 * rank_state[r] / hw.mem_bw_bytes_per_s, rank_elements[r] * host.optimizer_element_s)
        return body + rank_tensors[r] * host.optimizer_tensor_s

    optimizer = max(optimizer_s(r) for r in range(c.p))
    t = sim.makespan_s + exposed + optimizer + host.step_s
    cost = c.d * c.p * tp * hw.price_per_gpu_s * t
    objective = {"time": t, "cost": cost, "weighted": cost + space.weight * t}[space.objective]
    return Planned(c.d, c.p, c.v, c.b, c.m, c.schedule, c.zero, c.placement, cuts, t, cost, max(rank_mem), objective)


def search_brute_force(chain: ProfiledChain, hw: Hardware, space: Space, tp: int = 1) -> Outcome:
    """Every configuration with the closed-form-best of every contiguous partition, simulated; with `tp`, on
    groups of tp consecutive GPUs (inside a node), each running `chain` (one tensor-parallel rank's blocks)."""
    configs = _configurations(len(chain.fwd_alpha_s), hw, space, tp)
    results = [_evaluate(chain, hw, space, c, tp) for c in configs]
    feasible = [r for r in results if isinstance(r, Planned)]
    needs = [r for r in results if isinstance(r, float)]
    bounds = [r.bytes for r in results if isinstance(r, Bound)]
    return Outcome(feasible, min(needs or bounds, default=math.inf), len(configs))


def reference_rejects(schedule: str, p: int, m: int, v: int) -> bool:
    """torch 2.13's refusals for the searched schedules (simulate.h's torch_rejection)."""
    if schedule == "1F1B":
        return m < p
    if schedule == "Interleaved1F1B":
        return m % max(1, m // p) != 0
    return False
