"""DAG stage assignment in the plan search: pipelines whose chain blocks are too coarse to balance.

Linearization cuts the traced graph only where every value live across the cut is one tensor, and groups its
operations into blocks by module; on a branching graph (parallel branches that index one tuple, an Inception
block) one block can hold more work than a stage should, and no partition of the chain balances the pipeline.
For such pipelines the search also assigns every operation its own stage with the CP-SAT model of
pyplan/solve/ilp.py (stage indices never decrease along an edge, every value crossing a boundary is sent, the
same memory limit, the same closed form Σ_s t_s + (m − 1)·max_s t_s the chain partition minimizes), costs the
assignment with the search's terms (cpp/include/pyplan/search.h, steps 1-9, restated here with the same event
simulation; test_dag_search checks them against the search on the chain's own partitions), and offers it when it
beats the chain's plan.

Per-operation figures. Profiling is per block, so each block's forward and backward seconds at the candidate's
micro-batch (ZeRO-3's collectives included, as search.h step 1 adds them per block) are shared out over its
operations in proportion to an analytic estimate: the roofline time of the aten ops each operation runs in
the forward, and of those its autograd nodes run in the backward, recorded on fake tensors (node_profile).
Saved activation bytes are shared out likewise in proportion to the storages each operation produces and
autograd saves (pyplan/profile/memory.py's rule, per operation instead of per block); parameters count on
their first user, as linearize counts them per block. On a split of the blocks at their own boundaries every
stage then sums exactly what the chain's stage sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from pyplan import _core
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.hardware.cluster import Cluster
from pyplan.plan import Layout, Plan, Prediction, StagePlan, Workload
from pyplan.solve.schedules import simulate, warmup_send_held

if TYPE_CHECKING:
    from pyplan.solve.ilp import StageAssignment, StageDag

__all__ = [
    "DAG_SCHEDULES",
    "DAG_SOLVES",
    "DAG_TIME_LIMIT_S",
    "DAG_WORKERS",
    "NodeProfile",
    "PipelineConfig",
    "StageCosts",
    "dag_plans",
    "evaluate",
    "too_coarse",
    "worth_solving",
]

# The schedules with one stage per rank, whose in-flight counts the stage model knows (GPipe m, 1F1B min(m, p − s)).
DAG_SCHEDULES = ("GPipe", "1F1B")
# CP-SAT's limit per assignment. The chain DP over the operations' traced order warm-starts it (assign_stages), so
# a solve cut short still returns an assignment no worse than the best contiguous split of that order; the DAGs of
# the small branching models in the tests solve to optimality in well under a second. 5 s bounds what one solve
# adds to a search that otherwise takes milliseconds, on the 2 workers of a small machine.
DAG_TIME_LIMIT_S = 5.0
DAG_WORKERS = 2
# At most this many pipeline configurations (the best ranked first) get a solve, so a search adds at most
# DAG_SOLVES x DAG_TIME_LIMIT_S seconds of CP-SAT.
DAG_SOLVES = 3


@dataclass(frozen=True)
class NodeProfile:
    """Analytic figures of every operation of a chain (in `chain.order`) at one micro-batch size.

    block[v]          the chain block that holds operation v;
    fwd_weight_s[v]   roofline seconds of the aten ops operation v runs in the forward;
    bwd_weight_s[v]   the same for the ops its autograd nodes run in the backward;
    saved_bytes[v]    storages it produces that autograd saves for backward (an op's own temporaries included);
    params[v]         parameter elements it uses first (in the chain's order), param_tensors[v] their tensors.
    """

    names: tuple[str, ...]
    block: tuple[int, ...]
    fwd_weight_s: tuple[float, ...]
    bwd_weight_s: tuple[float, ...]
    saved_bytes: tuple[float, ...]
    params: tuple[int, ...]
    param_tensors: tuple[int, ...]
    batch_size: int


class _Candidate(Protocol):
    """What dag_plans reads of a search candidate (pyplan._core.Candidate)."""

    dp: int
    pp: int
    stages_per_rank: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    zero_stage: int
    placement: str
    pipeline_inter: bool
    dp_gpus_per_node: int
    dp_nodes: int
    cuts: list[int]
    stage_in_flight: list[int]
    stage_forward_s: list[float]
    stage_backward_s: list[float]
    iteration_s: float


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline configuration of the search (a candidate's choices), with the layout facts its costs use:
    whether the pipeline link leaves the node, and how each stage's dp group lies on nodes (search.h, step 2)."""

    dp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    zero_stage: int
    placement: str
    in_flight: tuple[int, ...]
    pipeline_inter: bool = False
    dp_gpus_per_node: int = 1
    dp_nodes: int = 1

    @staticmethod
    def of(c: _Candidate) -> PipelineConfig:
        return PipelineConfig(
            dp=c.dp,
            pp=c.pp,
            micro_batch_size=c.micro_batch_size,
            num_microbatches=c.num_microbatches,
            schedule=c.schedule,
            zero_stage=c.zero_stage,
            placement=c.placement,
            in_flight=tuple(c.stage_in_flight),
            pipeline_inter=c.pipeline_inter,
            dp_gpus_per_node=c.dp_gpus_per_node,
            dp_nodes=c.dp_nodes,
        )


@dataclass(frozen=True)
class StageCosts:
    """The cost terms of search.h for one configuration on one cluster and workload.

    `host` is the runtime's host costs as the search takes them (search.h step 8, HostCosts by field name; empty:
    none, as for a catalog GPU)."""

    cluster: Cluster
    workload: Workload
    config: PipelineConfig
    gpu_mem_bytes: float
    scale: float  # activation bytes per traced (fp32) byte
    price_per_gpu_s: float
    host: Mapping[str, float | bool] = field(default_factory=dict)

    def host_s(self, key: str) -> float:
        return float(self.host.get(key, 0.0))

    def allreduce_s(self, nbytes: float) -> float:
        """The dp group's all-reduce over the links' collective figures (step 2); a reduce-scatter or an
        all-gather costs half."""
        group = self.cluster.groups[0]
        (intra_latency, intra_bw), (inter_latency, inter_bw) = group.intra_link.collective, group.inter_link.collective
        return _core.hierarchical_allreduce_time_s(
            nbytes,
            self.config.dp_gpus_per_node,
            self.config.dp_nodes,
            intra_latency_s=intra_latency,
            intra_bw_bytes_per_s=intra_bw,
            inter_latency_s=inter_latency,
            inter_bw_bytes_per_s=inter_bw,
        )

    def link(self) -> tuple[float, float]:
        """(latency_s, bw_bytes_per_s) of the pipeline link."""
        group = self.cluster.groups[0]
        link = group.inter_link if self.config.pipeline_inter else group.intra_link
        assert link.latency_s is not None and link.bw_bytes_per_s is not None
        return link.latency_s, link.bw_bytes_per_s

    def state_bytes(self, params: float) -> float:
        """Model-state bytes of `params` parameter elements on one GPU under the configuration's ZeRO stage."""
        return self.workload.state_bytes_per_gpu(params, self.config.dp, self.config.zero_stage)

    def optimizer_s(self, state_bytes: float, params: float, tensors: float) -> float:
        """The optimizer step of a rank (step 6, with step 8's per-element and per-tensor host costs)."""
        elements = params / (self.config.dp if self.config.zero_stage >= 1 else 1)
        hbm = self.cluster.gpu.hbm_bw_bytes_per_s
        streamed = _core.optimizer_step_time_s(state_bytes, state_bytes, hbm)
        per_tensor_s = tensors * self.host_s("optimizer_tensor_s")
        return max(streamed, elements * self.host_s("optimizer_element_s")) + per_tensor_s

    def block_times_s(self, chain: Chain) -> tuple[list[float], list[float]]:
        """Each block's forward and backward seconds at the micro-batch, with ZeRO-3's collectives (step 1)."""
        b = self.config.micro_batch_size
        per = self.workload.bytes_per_param()
        fwd, bwd = [], []
        for blk in chain.blocks:
            assert blk.fwd_time_s is not None and blk.bwd_time_s is not None
            f, g = blk.fwd_time_s(b), blk.bwd_time_s(b)
            if self.config.zero_stage == 3:
                gather = self.allreduce_s(blk.param_numel * per.param_bytes) / 2
                f += gather
                g += gather + self.allreduce_s(blk.param_numel * per.grad_bytes) / 2
            fwd.append(f)
            bwd.append(g)
        return fwd, bwd


def too_coarse(block_work_s: Sequence[float], num_stages: int) -> bool:
    """A chain too coarse to balance `num_stages` stages: one block's work exceeds the ideal stage's, W/S.

    No partition of such a chain gets its bottleneck down to W/S, however the other blocks fall; only splitting
    that block can.
    """
    return max(block_work_s, default=0.0) > sum(block_work_s) / num_stages


# A solve is tried only when balancing the stages perfectly could save at least this share of the candidate's
# iteration time (CP-SAT takes up to DAG_TIME_LIMIT_S; batch planning runs hundreds of searches).
DAG_MIN_GAIN = 0.02


def worth_solving(cand: _Candidate) -> bool:
    """Whether any assignment could beat the candidate by DAG_MIN_GAIN: the bottleneck stage sets (m − 1) of the
    pipeline's steps, and no assignment's bottleneck is below the ideal W/S of the same work."""
    work = [f + b for f, b in zip(cand.stage_forward_s, cand.stage_backward_s)]
    if not work or cand.iteration_s <= 0:
        return False
    gain = (cand.num_microbatches - 1) * (max(work) - sum(work) / len(work))
    return gain >= DAG_MIN_GAIN * cand.iteration_s


def _split(totals: Sequence[float], weights: Sequence[float], block: Sequence[int]) -> list[float]:
    """Each block's total shared out over its operations in proportion to their weights (evenly when all are 0)."""
    sums, counts = [0.0] * len(totals), [0] * len(totals)
    for w, i in zip(weights, block):
        sums[i] += w
        counts[i] += 1
    return [totals[i] * (w / sums[i] if sums[i] > 0 else 1.0 / counts[i]) for w, i in zip(weights, block)]


def _ilp() -> ModuleType:
    """pyplan.solve.ilp, imported where a DAG is solved: OR-Tools (CP-SAT) is needed only there, so a machine
    without it (a GPU host with no package index) still plans chains, profiles and runs plans."""
    try:
        from pyplan.solve import ilp  # ortools: optional at import, needed only for DAG stage assignment
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("ortools"):
            raise
        raise PlanError(
            "the stage assignment of a branching graph needs OR-Tools: pip install 'ortools>=9.10' "
            "(or search with stage_dag=False to plan chain partitions only)"
        ) from None
    return ilp


@dataclass(frozen=True)
class _NodeCosts:
    """Per-operation seconds at the configuration's micro-batch, their blocks and parameters, and the StageDag
    (operation seconds, activation and state bytes, boundary bytes) assign_stages and evaluate_stages take."""

    fwd_s: list[float]
    bwd_s: list[float]
    block: tuple[int, ...]
    params: tuple[int, ...]
    param_tensors: tuple[int, ...]
    dag: StageDag


def _node_costs(chain: Chain, nodes: NodeProfile, costs: StageCosts) -> _NodeCosts:
    b = costs.config.micro_batch_size
    block_fwd, block_bwd = costs.block_times_s(chain)
    fwd = _split(block_fwd, nodes.fwd_weight_s, nodes.block)
    bwd = _split(block_bwd, nodes.bwd_weight_s, nodes.block)
    saved = [blk.saved_bytes(b) * costs.scale if blk.saved_bytes is not None else 0.0 for blk in chain.blocks]
    act = _split(saved, nodes.saved_bytes, nodes.block)
    dag = _ilp().stage_dag_from_layergraph(
        chain.graph,
        batch_size=b,
        time_s={name: f + g for name, f, g in zip(nodes.names, fwd, bwd)},
        act_bytes=dict(zip(nodes.names, act)),
        state_bytes={name: costs.state_bytes(p) for name, p in zip(nodes.names, nodes.params)},
    )
    if dag.names != nodes.names:
        raise RuntimeError("the StageDag's operations are not the chain's: linearize and ilp disagree on the order")
    # Boundary tensors are traced in fp32; the search scales them as it scales every cut.
    dag = replace(
        dag,
        out_bytes=tuple(x * costs.scale for x in dag.out_bytes),
        input_bytes=tuple(x * costs.scale for x in dag.input_bytes),
    )
    return _NodeCosts(fwd, bwd, nodes.block, nodes.params, nodes.param_tensors, dag)


@dataclass(frozen=True)
class _Evaluation:
    stages: tuple[StagePlan, ...]
    predicted: Prediction
    objective: float


def evaluate(
    chain: Chain,
    nodes: NodeProfile,
    costs: StageCosts,
    stage_of_node: Sequence[int],
    *,
    objective: str = "time",
    weight: float = 0.0,
    currency: str = "",
) -> tuple[tuple[StagePlan, ...], Prediction]:
    """The stages and prediction of an assignment of the chain's operations (`stage_of_node[v]` for
    `chain.order[v]`) by the terms of search.h: stage sums, sends over the pipeline link, ZeRO state, in-flight
    activations, the simulated schedule, the exposed gradient sync and the optimizer step. Memory is reported, not
    checked; PlanError when the assignment is not monotone along the edges or leaves a stage empty."""
    got = _evaluate(_node_costs(chain, nodes, costs), costs, stage_of_node, objective, weight, currency)
    return got.stages, got.predicted


def _evaluate(
    nc: _NodeCosts,
    costs: StageCosts,
    stage_of_node: Sequence[int],
    objective: str,
    weight: float,
    currency: str,
) -> _Evaluation:
    c = costs.config
    p, m = c.pp, c.num_microbatches
    latency_s, bw = costs.link()
    # Boundary bytes, stage times with sends, state and in-flight activations, as the stage model counts them.
    figures = _ilp().evaluate_stages(
        nc.dag,
        stage_of_node,
        num_microbatches=m,
        schedule=c.schedule,
        in_flight_per_stage=c.in_flight,
        latency_s=latency_s,
        bw_bytes_per_s=bw,
    )
    if len(figures.stage_time_s) != p:
        raise PlanError(f"the assignment uses {len(figures.stage_time_s)} stages, the configuration has {p}")
    send = [latency_s + x / bw for x in figures.boundary_bytes]
    messages = [0.0, *_crossing_values(nc.dag, stage_of_node, p), 0.0]  # [p + 1]: values sent at each boundary
    overlapped = bool(costs.host.get("sync_overlaps_backward", True))
    stages: list[StagePlan] = []
    exposed = optimizer = 0.0
    received = _core.receive_buffers(c.schedule, p, c.num_microbatches, 1)
    for s in range(p):
        stage, sync, step = _stage_plan(nc, costs, figures, s, send, messages, received)
        exposed = max(exposed, sync - stage.backward_s if overlapped else sync)
        optimizer = max(optimizer, step)
        stages.append(stage)
    # Step 4: the schedule's makespan.
    sim = simulate(
        c.schedule,
        [st.forward_s for st in stages],
        [st.backward_s for st in stages],
        num_microbatches=m,
        stages_per_rank=1,
        send_forward_s=send,
        send_backward_s=send,
    )
    # Step 7: the totals.
    step_s = costs.host_s("step_s")
    iteration = sim.makespan_s + exposed + optimizer + step_s
    cost = c.dp * c.pp * costs.price_per_gpu_s * iteration
    iterations = _iterations(costs.workload)
    predicted = Prediction(
        iteration_s=iteration,
        samples_per_s=costs.workload.global_batch / iteration if iteration > 0 else math.inf,
        peak_memory_bytes=max(st.memory_bytes for st in stages),
        bubble_fraction=sim.bubble_fraction,
        pipeline_s=sim.makespan_s,
        exposed_comm_s=exposed,
        optimizer_s=optimizer,
        cost_per_iteration=cost,
        currency=currency,
        cost_per_epoch=cost * iterations if iterations is not None else None,
        host_step_s=step_s,
    )
    value = iteration if objective == "time" else cost if objective == "cost" else cost + weight * iteration
    return _Evaluation(tuple(stages), predicted, value)


def _stage_plan(
    nc: _NodeCosts,
    costs: StageCosts,
    figures: StageAssignment,
    s: int,
    send: Sequence[float],
    messages: Sequence[float],
    received: Mapping[str, Sequence[int]],
) -> tuple[StagePlan, float, float]:
    """Stage s of an assignment as the stage model counts it, with its gradient sync's seconds and its optimizer
    step's (`figures`: ilp.evaluate_stages's boundary bytes, stage times, state and in-flight activations;
    `received`: the schedule's receive buffers per stage, _core.receive_buffers)."""
    c = costs.config
    p, m = c.pp, c.num_microbatches
    members = figures.stage_nodes(s)
    # Steps 3 and 8: the stage's operations, and the host's per-stage and per-message work.
    messages_s = costs.host_s("message_s") * (messages[s] + messages[s + 1])
    f = sum(nc.fwd_s[v] for v in members) + costs.host_s("stage_forward_s") + messages_s
    g = sum(nc.bwd_s[v] for v in members) + costs.host_s("stage_backward_s") + messages_s
    state, act = figures.stage_state_bytes[s], figures.stage_act_bytes[s]
    # Step 9: the runtime's receive buffers (search.h): those of the input beyond the n in flight (counted with the
    # activations; none where each receive is posted just before its forward, as GPipe and 1F1B do) and those of
    # the output's gradient (one, the backward's); the first stage's whole batch, the last input gradient
    # (partition.h's held_input_cuts); 1F1B's last warm-up send (simulate.h's warmup_send_held).
    n = figures.stage_in_flight[s]
    ahead = received["inputs"][s] - n if received["inputs"][s] > 0 else 0
    into = (_core.held_input_cuts(m, n, s) + ahead) * (
        figures.boundary_bytes[s - 1] if s > 0 else sum(nc.dag.input_bytes)
    )
    outputs = received["gradients"][s] + warmup_send_held(c.schedule, m, p, s)
    buffer = into + (outputs * figures.boundary_bytes[s] if s < p - 1 else 0.0)
    # Steps 5 and 6: the stage's gradient sync, overlapped with its backward or not; the optimizer step.
    params = sum(nc.params[v] for v in members)
    grad_bytes = costs.workload.bytes_per_param().grad_bytes
    sync = costs.allreduce_s(params * grad_bytes) if c.dp > 1 and c.zero_stage < 3 else 0.0
    step = costs.optimizer_s(state, params, sum(nc.param_tensors[v] for v in members))
    stage = StagePlan(
        first_block=min(nc.block[v] for v in members),
        last_block=max(nc.block[v] for v in members),
        memory_bytes=state + act + buffer,
        state_bytes=state,
        activation_bytes=act,
        time_s=f + g + (send[s] if s < p - 1 else 0.0) + (send[s - 1] if s > 0 else 0.0),
        in_flight=n,
        forward_s=f,
        backward_s=g,
        buffer_bytes=buffer,
    )
    return stage, sync, step


def _crossing_values(dag: StageDag, stage_of_node: Sequence[int], p: int) -> list[float]:
    """[p − 1] how many values (node outputs, graph inputs) cross each boundary: the messages a boundary sends,
    as the chain counts a cut's live values."""
    count = [0.0] * max(p - 1, 0)
    last = {u: p - 1 for u in dag.output_nodes}
    for u, v in dag.edges:
        last[u] = max(last.get(u, -1), stage_of_node[v])
    for u, stage in last.items():
        for s in range(stage_of_node[u], stage):
            count[s] += 1
    last_input: dict[int, int] = {}
    for k, v in dag.input_edges:
        last_input[k] = max(last_input.get(k, 0), stage_of_node[v])
    for stage in last_input.values():
        for s in range(stage):
            count[s] += 1
    return count


def _iterations(workload: Workload) -> int | None:
    """Optimizer steps per epoch, when the workload gives its dataset size."""
    return math.ceil(workload.dataset_samples / workload.global_batch) if workload.dataset_samples else None


def _stage_of_block(cand: _Candidate, block: int) -> int:
    """The stage of the candidate's chain partition that holds `block`."""
    return next(s for s in range(len(cand.cuts) - 1) if cand.cuts[s] <= block < cand.cuts[s + 1])


def _layout(chain: Chain, c: PipelineConfig, stage_of_node: Sequence[int]) -> Layout:
    """The layout of an assignment: the traced order sorted by stage, cut where the stage changes, and the
    assignment by node name unless that order is the traced one (then the cuts alone say it)."""
    counts = [stage_of_node.count(s) for s in range(c.pp)]
    cuts = [0]
    for k in counts:
        cuts.append(cuts[-1] + k)
    contiguous = list(stage_of_node) == sorted(stage_of_node)
    return Layout(
        dp=c.dp,
        pp=c.pp,
        micro_batch_size=c.micro_batch_size,
        num_microbatches=c.num_microbatches,
        schedule=c.schedule,
        cut_positions=tuple(cuts),
        zero_stage=c.zero_stage,
        placement=c.placement,
        stage_of_node={} if contiguous else dict(zip(chain.order, stage_of_node)),
    )


def dag_plans(
    candidates: Sequence[_Candidate],
    chain: Chain,
    nodes: Callable[[int], NodeProfile],
    cluster: Cluster,
    workload: Workload,
    *,
    gpu_mem_bytes: float,
    scale: float,
    price_per_gpu_s: float,
    currency: str,
    objective: str,
    weight: float,
    host: Mapping[str, float | bool] | None = None,
) -> list[Plan]:
    """Plans whose stages are assigned operation by operation, for the search's pipeline candidates (pp ≥ 2, one
    stage per rank: GPipe, 1F1B) whose chain is too coarse (too_coarse at the candidate's micro-batch): each
    assignment that beats its candidate's objective, evaluated by the same terms as the candidate's own partition.

    Candidates are taken in the given order (the search's ranking), each configuration once, at most DAG_SOLVES
    of them, each solve within DAG_TIME_LIMIT_S. A candidate with no assignment that fits gets no plan.
    """
    profiles: dict[int, NodeProfile] = {}
    seen: set[PipelineConfig] = set()
    plans: list[Plan] = []
    for cand in candidates:
        if cand.pp < 2 or cand.stages_per_rank != 1 or cand.schedule not in DAG_SCHEDULES:
            continue
        config = PipelineConfig.of(cand)
        if config in seen:
            continue
        costs = StageCosts(cluster, workload, config, gpu_mem_bytes, scale, price_per_gpu_s, dict(host or {}))
        fwd, bwd = costs.block_times_s(chain)
        if not too_coarse([f + g for f, g in zip(fwd, bwd)], config.pp) or len(chain.order) < config.pp:
            continue
        if not worth_solving(cand):
            continue
        if len(seen) == DAG_SOLVES:
            break
        seen.add(config)
        b = config.micro_batch_size
        if b not in profiles:
            profiles[b] = nodes(b)
        nc = _node_costs(chain, profiles[b], costs)
        latency_s, bw = costs.link()
        try:
            got: StageAssignment = _ilp().assign_stages(
                nc.dag,
                num_stages=config.pp,
                num_microbatches=config.num_microbatches,
                mem_limit_bytes=[gpu_mem_bytes] * config.pp,
                schedule=config.schedule,
                in_flight_per_stage=config.in_flight,
                latency_s=latency_s,
                bw_bytes_per_s=bw,
                time_limit_s=DAG_TIME_LIMIT_S,
                num_workers=DAG_WORKERS,
            )
        except PlanError:
            # Nothing fits (InfeasibleError), or the time ran out before any assignment was found (with no
            # contiguous split of the traced order to start from): the candidate keeps its chain plan.
            continue
        # The candidate's own partition, operation by operation, by the same terms (its figures are the
        # search's: test_dag_search checks that).
        own = _evaluate(nc, costs, [_stage_of_block(cand, i) for i in nc.block], objective, weight, currency)
        dag = _evaluate(nc, costs, got.stage_of_node, objective, weight, currency)
        if dag.objective < own.objective * (1 - 1e-9) and dag.predicted.peak_memory_bytes <= gpu_mem_bytes:
            plans.append(Plan(_layout(chain, config, got.stage_of_node), dag.stages, dag.predicted))
    return plans
