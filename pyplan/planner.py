"""The search of one call, step by step: the candidate space of the chain at each degree of tensor parallelism
(`tensor_parallel_chains`) and of expert parallelism (`expert_parallel_search`), the C++ search over it (`Space`),
each candidate refined as the runtime trains it (`Refiner`), and the ranking of what fits. pyplan.api.search runs
these steps; this module joins the profile (pyplan.profile) and the runtime's own figures (pyplan.runtime) to the
core's search (pyplan.solve).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from torch import nn

from pyplan import _core
from pyplan._torch import is_meta_module
from pyplan.errors import PlanError, TraceError
from pyplan.graph.chain import Block, Chain
from pyplan.graph.experts import ExpertLayer
from pyplan.graph.layergraph import Affine, Piecewise
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.tensor_parallel import TpPlan, derive_tp_plan, restrict_tp_plan, vocab_parallel_loss
from pyplan.graph.trace import ExampleInputs, Examples
from pyplan.hardware.catalog import GPU, Link
from pyplan.hardware.cluster import Cluster, NodeGroup
from pyplan.model_state import optimizer_step_bytes
from pyplan.plan import (
    ZERO_STAGES,
    Layout,
    Plan,
    Prediction,
    StagePlan,
    Workload,
)
from pyplan.profile.capture import add_loss, chain_at_degree, is_local, pricing, tp_comm_times
from pyplan.profile.expert_chain import chain_at_expert_degree
from pyplan.profile.host import local_host_costs
from pyplan.profile.loss import LossFn, TargetFn, remat_with_loss, with_loss
from pyplan.profile.measure import CheckpointCosts, checkpoint_call_s, checkpoint_costs
from pyplan.profile.nodes import node_profile
from pyplan.profile.remat import remat_bytes
from pyplan.runtime.experts import expert_refusal
from pyplan.runtime.units import gathered_bytes, remat_kind, unit_segments, zero3_overlap
from pyplan.runtime.vocab_loss import vocab_slice_loss
from pyplan.solve.dag_search import dag_plans
from pyplan.solve.remat import RematProfile
from pyplan.solve.remat_search import (
    RELAXED_SHARES,
    StageParams,
    refine_plan,
    relaxed_chain,
)
from pyplan.solve.state import exact_state
from pyplan.solve.tied import (
    TiedParameter,
    tied_copies,
    tied_parameters,
    tied_sync_s,
    with_tied_state,
    with_tied_sync,
)
from pyplan.units import fmt_bytes

__all__ = [
    "EP_PLACEMENTS",
    "EP_ZERO_STAGES",
    "SEARCHED_SCHEDULES",
    "STAGES_PER_RANK",
    "TIE",
    "TP_ZERO_STAGES",
    "Found",
    "Refiner",
    "Searched",
    "Searcher",
    "Space",
    "frontier",
    "infeasible_reason",
    "local_numel",
    "memory_per_process",
    "plan_of",
    "rank_plans",
    "rank_ties",
    "search_degrees",
    "tensor_parallel_chains",
    "with_ep",
    "with_tp",
]

# The ZeRO stages planned beside tensor parallelism: what the runtime runs with it (pyplan/runtime/trainer.py;
# ZeRO-3 without pipeline stages, as without tensor parallelism).
TP_ZERO_STAGES = (0, 1, 3)
# The schedules the search evaluates; the zero-bubble ones need split input/weight-gradient times first.
SEARCHED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
# The stages (model chunks) a pipeline rank may hold: 1 under GPipe and 1F1B, 2 or more under the interleaved schedules
# (Megatron-LM's published layouts run 3; each v more costs the search little, benchmarks/PLAN_SPEED.md).
STAGES_PER_RANK = (1, 2, 3, 4)
# Beside expert parallelism: ZeRO 0, what the runtime runs it with (ZeroRedundancyOptimizer and FSDP2 would shard the
# experts as if every replica held the same ones, pyplan/runtime/experts.py `expert_refusal`); and the replicas of a
# stage on neighbouring ranks, so that an expert-parallel group spans the nodes it is priced on
# (pyplan/profile/expert_chain.py).
EP_ZERO_STAGES = (0,)
EP_PLACEMENTS = ("dp-inner",)


def _zero3_mode(mode: str) -> str:
    """The remat mode a ZeRO-3 plan's stage is refined with: its runtime checkpoints whole FSDP units (the model's
    own modules, `unit_segments`), selectively or not, or none of them."""
    return {"none": "none", "selective": "selective segments", "auto": "any segments"}.get(mode, "segments")


def _time_tables(blocks: Sequence[Block]) -> dict[str, list[float]]:
    """The search's tables of times measured at several sizes (`Piecewise`), when every block's are, at the union
    of their sizes (the loss's and the blocks' agree when both were measured); else none, and the search uses
    each block's line."""
    fwd: list[Piecewise] = []
    bwd: list[Piecewise] = []
    for blk in blocks:
        if not (isinstance(blk.fwd_time_s, Piecewise) and isinstance(blk.bwd_time_s, Piecewise)):
            return {}
        fwd.append(blk.fwd_time_s)
        bwd.append(blk.bwd_time_s)
    sizes = sorted({b for t in fwd + bwd for b in t.sizes})
    return {
        "time_sizes": [float(b) for b in sizes],
        "fwd_points_s": [t(b) for t in fwd for b in sizes],
        "bwd_points_s": [t(b) for t in bwd for b in sizes],
    }


def _unused(link: Link) -> Link:
    """`link` as a one-GPU search takes it: figures it never uses where it has none."""
    if link.latency_s is not None and link.bw_bytes_per_s is not None:
        return link
    return replace(link, latency_s=0.0, bw_bytes_per_s=1.0)


def memory_per_process(cluster: Cluster) -> float:
    """A GPU's memory, or for `local` on the CPU the machine's memory shared by the processes on it."""
    gpu = cluster.gpu
    assert gpu.memory_bytes is not None
    if is_local(gpu) and gpu.device_type == "cpu":
        return gpu.memory_bytes / cluster.gpus_per_node
    return float(gpu.memory_bytes)


def plan_of(c: Any, chain: Chain, currency: str, workload: Workload) -> Plan:
    layout = Layout(
        dp=c.dp,
        pp=c.pp,
        micro_batch_size=c.micro_batch_size,
        num_microbatches=c.num_microbatches,
        schedule=c.schedule,
        cut_positions=tuple(chain.cuts[k].position for k in c.cuts),
        zero_stage=c.zero_stage,
        placement=c.placement,
        stages_per_rank=c.stages_per_rank,
    )
    stages = tuple(
        StagePlan(
            first_block=c.cuts[s],
            last_block=c.cuts[s + 1] - 1,
            memory_bytes=c.stage_state_bytes[s]
            + c.stage_act_bytes[s]
            + c.stage_buffer_bytes[s]
            - c.stage_unmade_grad_bytes[s],
            state_bytes=c.stage_state_bytes[s],
            activation_bytes=c.stage_act_bytes[s],
            buffer_bytes=c.stage_buffer_bytes[s],
            unmade_grad_bytes=c.stage_unmade_grad_bytes[s],
            time_s=c.stage_time_s[s],
            in_flight=c.stage_in_flight[s],
            forward_s=c.stage_forward_s[s],
            backward_s=c.stage_backward_s[s],
        )
        for s in range(len(c.cuts) - 1)
    )
    iterations = math.ceil(workload.dataset_samples / workload.global_batch) if workload.dataset_samples else None
    predicted = Prediction(
        iteration_s=c.iteration_s,
        samples_per_s=c.samples_per_s,
        peak_memory_bytes=c.peak_memory_bytes,
        bubble_fraction=c.bubble_fraction,
        pipeline_s=c.makespan_s,
        exposed_comm_s=c.exposed_sync_s,
        optimizer_s=c.optimizer_s,
        host_step_s=c.host_step_s,
        cost_per_iteration=c.cost_per_iteration,
        currency=currency,
        cost_per_epoch=c.cost_per_iteration * iterations if iterations is not None else None,
    )
    return Plan(layout=layout, stages=stages, predicted=predicted)


@dataclass(frozen=True)
class Searcher:
    """What every search of one call shares, whatever chain and cluster it searches (one per degree of tensor
    parallelism): the model, the workload, the objective, the pins and the remat options."""

    model: nn.Module
    examples: Examples
    workload: Workload
    objective: str
    memory_fraction: float
    pins: dict[str, Any]
    wide: int
    remat: str
    offload: str
    offload_bw_bytes_per_s: float
    loss: LossFn | None = None
    target: TargetFn | None = None
    autocast: bool = True  # a mixed precision computes under autocast (not ZeRO-3's FSDP alone): chain_for's

    def plans(
        self,
        chain: Chain,
        cluster: Cluster,
        say: Callable[[str], None],
        *,
        zero_stages: Sequence[int] = ZERO_STAGES,
        local_numel: Callable[[str], float] | None = None,
        sync_after_backward: bool = False,
        narrowed: Mapping[str, list[Any]] | None = None,
    ) -> tuple[list[Plan], Any, list[Any], Refiner]:
        """The refined plans of `chain` on `cluster` that fit, with the C++ searches' results and the refiner;
        `zero_stages` narrows the ZeRO stages searched; `local_numel` (a parameter's name -> the elements one rank
        holds) sizes ZeRO-3's gathered units beside tensor parallelism; `sync_after_backward`: the replicas'
        gradients (ZeRO 0 and 1) are averaged after the backward, not during it, as beside tensor parallelism (DDP
        takes no DTensors: pyplan/runtime/trainer.py); `narrowed` replaces pins by narrower lists (never empty: an
        empty pin is no pin)."""
        space = Space.of(chain, cluster, self.workload, self.objective, self.memory_fraction)
        if sync_after_backward:
            space = replace(space, host={**space.host, "sync_overlaps_backward": False})
        pins = {**self.pins, "zero_stages": [z for z in self.pins["zero_stages"] or ZERO_STAGES if z in zero_stages]}
        pins.update(narrowed or {})
        refiner = Refiner.of(
            space, self.model, self.examples, self.remat, self.offload, self.offload_bw_bytes_per_s, local_numel
        )
        plain = space.run(pins, self.wide) if self.remat in ("none", "auto") else None
        relaxed = (
            [space.run(pins, self.wide, refiner.profile, share) for share in RELAXED_SHARES]
            if self.remat != "none"
            else []
        )
        say("refining")
        every = (refiner.refined([plain], "none") if plain is not None else []) + refiner.refined(relaxed, self.remat)
        return every, plain, relaxed, refiner


@dataclass(frozen=True)
class Found:
    """What the searches of one call found: every refined plan that fits, at every degree searched."""

    plans: list[Plan]
    searched: list[tuple[int, int]]  # the (tensor-parallel, expert-parallel) degrees of each search, in order
    runs: list[tuple[Any, list[Any]]]  # each search's C++ results (plain, relaxed)
    refiners: list[Refiner]  # each search's refiner
    left_out: list[tuple[int, str]]  # the tensor-parallel degrees asked for and not searched, each with why
    ep_left_out: list[tuple[int, str]] = field(default_factory=list)  # likewise the expert-parallel degrees

    @property
    def degrees(self) -> list[int]:
        """The tensor-parallel degrees searched, in order."""
        return list(dict.fromkeys(t for t, _ in self.searched))

    @property
    def expert_degrees(self) -> list[int]:
        """The expert-parallel degrees searched, in order."""
        return list(dict.fromkeys(e for _, e in self.searched))

    @property
    def results(self) -> list[Any]:
        """Every C++ search's result."""
        return [r for plain, relaxed in self.runs for r in (plain, *relaxed) if r is not None]

    @property
    def refiner(self) -> Refiner | None:
        """The refiner of the search without tensor or expert parallelism (None: it was not searched)."""
        return self.refiners[self.searched.index((1, 1))] if (1, 1) in self.searched else None


def search_degrees(
    searcher: Searcher,
    bare: Chain,
    chain: Chain,
    cluster: Cluster,
    degrees: Sequence[int],
    styles: Mapping[str, str] | None,
    sequence_parallel: bool,
    say: Callable[[str], None],
    *,
    experts: Sequence[ExpertLayer] = (),
    expert_degrees: Sequence[int] = (1,),
) -> Found:
    """The searches at each degree of tensor parallelism in `degrees` (1: none) and of expert parallelism in
    `expert_degrees` (1: none). Without expert parallelism: at tensor parallelism 1 on `chain` (the profiled chain,
    its loss included; `bare` without it), above 1 on the chain one rank runs (`tensor_parallel_chains`), as
    `styles` and `sequence_parallel` allow. Each expert-parallel degree E > 1 is searched at tensor parallelism 1
    (`expert_parallel_search`). A model's mixture-of-experts layers (`experts`, found in the capture that keeps their
    experts whole) are priced in every chain by pyplan/profile/expert_chain.py, at E = 1 too: the profile of such a
    capture holds none of the experts' work. A degree whose rank graph does not run, that splits nothing or whose pins
    leave no configuration is left out with why, unless it is the only one asked for."""
    experts_timed = is_local(cluster.gpu) and not is_meta_module(searcher.model)

    def at(c: Chain, e: int) -> Chain:
        return chain_at_expert_degree(c, experts, e, cluster, searcher.workload, experts_timed=experts_timed)

    plans: list[Plan] = []
    searched: list[tuple[int, int]] = []
    runs: list[tuple[Any, list[Any]]] = []
    refiners: list[Refiner] = []
    left_out: list[tuple[int, str]] = []
    if 1 in expert_degrees and 1 in degrees:
        say("searching")
        plans, plain, relaxed, refiner = searcher.plans(at(chain, 1), cluster, say)
        searched.append((1, 1))
        runs.append((plain, relaxed))
        refiners.append(refiner)
    tp_degrees = degrees if 1 in expert_degrees else ()
    for degree, chain_t, cluster_t, split, comm, sp in tensor_parallel_chains(bare, chain, tp_degrees, styles,
                                                                             sequence_parallel, searcher, cluster,
                                                                             left_out):  # fmt: skip
        say(f"tensor parallelism {degree}")
        try:
            found_t, plain_t, relaxed_t, refiner_t = searcher.plans(at(chain_t, 1), cluster_t, lambda step: None,
                                                            zero_stages=TP_ZERO_STAGES,
                                                            local_numel=local_numel(searcher.model, split, degree),
                                                            sync_after_backward=True)  # fmt: skip
        except PlanError as exc:
            # The pins leave no configuration at this degree (a pipeline of 2 on the one group of 4 GPUs that
            # tensor parallelism 4 makes of 4): the other degrees answer, unless this was the only one asked for.
            if len(degrees) == 1 and len(expert_degrees) == 1:
                raise
            left_out.append((degree, str(exc)))
            continue
        plans += [with_tp(p, degree, split, comm, sp) for p in found_t]
        searched.append((degree, 1))
        runs.append((plain_t, relaxed_t))
        refiners.append(refiner_t)
    ep_left_out: list[tuple[int, str]] = []
    for e in (e for e in expert_degrees if e > 1):
        say(f"expert parallelism {e}")
        try:
            if 1 not in degrees:
                raise PlanError(
                    f"expert parallelism {e} is planned at tensor parallelism 1 (the runtime does not run it beside "
                    "tensor parallelism), which the tensor-parallel degrees asked for leave out"
                )
            found_e, plain_e, relaxed_e, refiner_e = expert_parallel_search(searcher, chain, cluster, experts, e,
                                                                            experts_timed)  # fmt: skip
        except PlanError as exc:
            if len(expert_degrees) == 1:
                raise
            ep_left_out.append((e, str(exc)))
            continue
        plans += [with_ep(p, e) for p in found_e]
        searched.append((1, e))
        runs.append((plain_e, relaxed_e))
        refiners.append(refiner_e)
    if not searched:
        why = [f"tensor parallelism {t}: {w}" for t, w in left_out] + [f"expert parallelism {e}: {w}"
                                                                        for e, w in ep_left_out]  # fmt: skip
        raise PlanError(f"no degree asked for can be searched ({'; '.join(why) or 'none asked for'})")
    return Found(plans, searched, runs, refiners, left_out, ep_left_out)


def expert_parallel_search(
    searcher: Searcher,
    chain: Chain,
    cluster: Cluster,
    experts: Sequence[ExpertLayer],
    degree: int,
    experts_timed: bool,
) -> tuple[list[Plan], Any, list[Any], Refiner]:
    """The search at expert-parallel degree `degree` > 1, as `Searcher.plans` returns it: on the chain one rank of
    an expert-parallel group runs (pyplan/profile/expert_chain.py), at tensor parallelism 1, pinned to what the
    runtime trains with expert parallelism (pyplan/runtime/experts.py) within the caller's own pins: data-parallel
    degrees that `degree` divides, ZeRO 0, the schedules of one stage per rank where stages share parameters, the
    replicas of a stage on neighbouring ranks (`EP_PLACEMENTS`). One line (PlanError) where the model has no layer to
    split, `degree` does not split every layer, or the pins leave nothing.

    Why `degree` divides dp: the expert-parallel group is carved out of the data-parallel replicas, each group of E
    of them holding every expert once, as torchtitan and Megatron-LM do. torchtitan's `ParallelDims._validate`
    (torchtitan/distributed/parallel_dims.py at 0119de156de5) asserts `(dp_shard * cp) % ep == 0` ("EP would borrow
    all cp and some dp_shard degree"); Megatron-LM's `initialize_model_parallel` (megatron/core/parallel_state.py at
    d98e8a64ddf3) builds the experts' grid as expert_tensor x expert_model x expert_data x pipeline ranks over the
    same world as the dense grid, so that ep x expert-dp = tp x cp x dp / expert_tp."""
    if not experts:
        raise PlanError(
            f"expert parallelism {degree} splits no layer: the model has no mixture-of-experts layer (a router's "
            "top-k choice feeding experts that hold one set of parameters each)"
        )
    workload, pins = searcher.workload, searcher.pins
    probe = Layout(dp=degree, pp=1, micro_batch_size=1, num_microbatches=1, schedule="1F1B",
                   cut_positions=(0, len(chain.order)), ep=degree)  # fmt: skip
    refused = expert_refusal(probe, workload.precision)
    if refused:
        raise PlanError(f"expert parallelism {refused}")
    dps = [d for d in pins["data_parallel"] or range(degree, cluster.gpus + 1, degree) if d % degree == 0]
    if not dps:
        given = (
            f"--dp {', '.join(map(str, pins['data_parallel']))}" if pins["data_parallel"] else f"{cluster.gpus} GPUs"
        )
        raise PlanError(f"expert parallelism {degree} needs a data-parallel degree it divides, and {given} leave none")
    zero = [z for z in pins["zero_stages"] or ZERO_STAGES if z in EP_ZERO_STAGES]
    if not zero:
        raise PlanError(
            f"expert parallelism {degree} runs under ZeRO 0 (ZeroRedundancyOptimizer and FSDP2 would shard the experts "
            "as if every replica held the same ones); the ZeRO stages asked for leave it out"
        )
    shared = bool(tied_parameters(chain))  # the runtime refuses stages sharing parameters on one rank
    runnable = ("GPipe", "1F1B") if shared else SEARCHED_SCHEDULES
    schedules = [s for s in pins["schedules"] or SEARCHED_SCHEDULES if s in runnable]
    if not schedules:
        raise PlanError(
            f"expert parallelism {degree} runs one stage per rank where stages share parameters (GPipe, 1F1B); the "
            "schedules asked for leave it out"
        )
    placements = [p for p in pins["placements"] or EP_PLACEMENTS if p in EP_PLACEMENTS]
    if not placements:
        raise PlanError(
            f"expert parallelism {degree} is planned with a stage's replicas on neighbouring ranks (placement "
            "dp-inner), which the placements asked for leave out"
        )
    chain_e = chain_at_expert_degree(chain, experts, degree, cluster, workload, experts_timed=experts_timed)
    narrowed = {"data_parallel": dps, "schedules": schedules, "placements": placements}
    return searcher.plans(chain_e, cluster, lambda step: None, zero_stages=EP_ZERO_STAGES, narrowed=narrowed)


def with_ep(p: Plan, degree: int) -> Plan:
    """A plan of the search at expert-parallel `degree` as what it is: its layout's ep."""
    return replace(p, layout=replace(p.layout, ep=degree))


def tensor_parallel_chains(
    bare: Chain,
    chain: Chain,
    degrees: Sequence[int],
    styles: Mapping[str, str] | None,
    sequence_parallel: bool,
    how: Searcher,
    cluster: Cluster,
    left_out: list[tuple[int, str]],
) -> Iterator[tuple[int, Chain, Cluster, dict[str, str], list[tuple[Affine, Affine]], bool]]:
    """Each degree above 1 that splits a layer: the chain one rank of it runs (with the loss of `chain`, on the
    gathered output, as one process runs it), the cluster as the search sees it (a tensor-parallel group of t GPUs
    in place of each GPU: t times the price, g/t of them per node), the styles the runtime applies, each block's
    collectives (forward, backward seconds), and whether the values between the split layers are split by their
    tokens (asked for, and the model allows it at that degree). A degree that splits no layer goes to `left_out`
    with why."""
    wanted = [t for t in degrees if t > 1]
    if not wanted:
        return
    for t in wanted:
        cluster.tensor_parallel_groups(t)  # one line for a degree the nodes cannot hold
    if is_local(cluster.gpu) and not is_meta_module(how.model):
        raise PlanError("tensor parallelism is planned on a catalog GPU's analytic profile; give --gpu NAME")
    plan = derive_tp_plan(bare.graph)
    if styles is not None:
        plan = restrict_tp_plan(plan, styles, bare.graph)
        sequence_parallel = sequence_parallel and "SequenceParallel" in styles.values()
        for t in wanted:  # every layer the user names splits at every degree asked for
            left = [m for m, style in styles.items() if m not in plan.styles(t) and style != "SequenceParallel"]
            if left:
                why = _no_split(TpPlan(regions=tuple(r for r in plan.regions if left[0] in r.columns + r.rows),
                                       embeddings=plan.embeddings, output_layers=plan.output_layers), t)  # fmt: skip
                raise PlanError(f"TP plan: tensor parallelism {t} cannot split '{left[0]}': {why}")
    for t in wanted:
        if not plan.styles(t):
            if len(degrees) == 1:
                raise PlanError(f"tensor parallelism {t} splits no layer of the model: {_no_split(plan, t)}")
            left_out.append((t, _no_split(plan, t)))
            continue
        zone = sequence_zone(bare.graph, plan, t) if sequence_parallel else None
        zone = zone if zone else None
        try:
            chain_t = chain_at_degree(bare, plan, t, how.examples, cluster, how.workload, zone, autocast=how.autocast)
        except TraceError as exc:
            # One rank's graph does not run (a model that reads values runs for real, where a vocabulary split
            # over the ranks sees ids outside its shard): without this degree, unless it was the one asked for.
            if len(degrees) == 1:
                raise
            cause = exc.__cause__ or exc
            first = (str(cause).strip().splitlines() or [""])[0]
            left_out.append((t, f"one rank's graph does not run ({type(cause).__name__}: {first})"))
            continue
        # The loss on each rank's slice of the logits where it can (torchtitan's loss_parallel), else on the whole;
        # recorded as the runtime computes its slice (in fp32, the softmax kept and its gradient made in place).
        vocab = chain.loss is not None and vocab_parallel_loss(bare.graph, plan, t, how.loss)
        if vocab:
            chain_t = add_loss(chain_t, how.model, how.examples, cluster, how.workload, vocab_slice_loss, how.target,
                               autocast=how.autocast)  # fmt: skip
        elif chain.loss is not None:
            chain_t = with_loss(chain_t, chain.loss)
        comm = tp_comm_times(bare, plan, t, cluster, how.workload, zone, vocab_parallel=vocab)
        yield t, chain_t, cluster.tensor_parallel_groups(t), plan.styles(t), comm, zone is not None


def local_numel(model: nn.Module, styles: Mapping[str, str], degree: int) -> Callable[[str], float]:
    """A parameter's name -> the elements one rank of tensor parallelism `degree` holds under `styles`: a split
    weight (column or row), a column Linear's bias, a split embedding's rows, each a degree-th; the rest whole."""
    split = {f"{m}.weight" for m, style in styles.items() if style in ("ColwiseParallel", "RowwiseParallel")}
    split |= {f"{m}.bias" for m, style in styles.items() if style == "ColwiseParallel"}
    sizes = {name: float(p.numel()) for name, p in model.named_parameters(remove_duplicate=False)}
    return lambda name: sizes[name] / degree if name in split else sizes[name]


def with_tp(
    p: Plan, degree: int, styles: dict[str, str], comm: Sequence[tuple[Affine, Affine]], sequence_parallel: bool
) -> Plan:
    """A plan of the search at `degree` as what it is: its layout's tp, styles and sequence parallelism, each
    stage's collectives per micro-batch, the busiest stage's per iteration."""
    b, lay = p.layout.micro_batch_size, p.layout
    stages = tuple(
        replace(st, tp_comm_s=sum(comm[i][0](b) + comm[i][1](b) for i in range(st.first_block, st.last_block + 1)))
        for st in p.stages
    )
    busiest = max(stages, key=lambda st: st.time_s)
    predicted = replace(p.predicted, tp_comm_s=lay.num_microbatches * busiest.tp_comm_s)
    layout = replace(lay, tp=degree, tp_plan=styles, sequence_parallel=sequence_parallel)
    return replace(p, layout=layout, stages=stages, predicted=predicted)


def _no_split(plan: TpPlan, t: int) -> str:
    """Why degree t splits nothing, in a clause."""
    for r in plan.regions:
        bad = [s for s in r.sizes if s % t]
        if bad:
            return f"{t} does not divide {bad[0]} (heads or features of '{r.columns[0]}')"
    for x in (*plan.embeddings, *plan.output_layers):
        return f"{t} does not divide the {getattr(x, 'vocab', None) or x.out_features} rows of '{x.module}'"
    first = next(iter(plan.replicated.items()), None)
    return f"no layer follows Megatron's pattern ({first[0]}: {first[1]})" if first else "it has no Linear layers"


# A memory limit no plan reaches: what a plan needs, found by refining it without one.
UNBOUNDED_BYTES = float(2**70)


def infeasible_reason(found: Found, remat: str, memory_fraction: float) -> str:
    """Why no plan was found, in one line. Where the search's count of the saved activations lets plans fit and the
    stages' working memory then overflows every one, what the plan that needs least memory needs (at any degree
    searched), and the `--memory-fraction` that admits it (if any does)."""
    plain, relaxed = found.runs[0] if found.runs else (None, [])
    reason = plain.reason if plain is not None and plain.reason else (relaxed[0].reason if relaxed else "")
    suffix = f" (even with rematerialization: {remat})" if remat != "none" else ""
    needed = [
        (p, refiner.space, degrees)
        for degrees, (first, _), refiner in zip(found.searched, found.runs, found.refiners, strict=True)
        if first is not None and first.feasible
        for p in [refiner.least_needed([first])]
        if p is not None
    ]
    if not needed:
        if plain is not None and plain.feasible:
            reason = "every plan that fits the saved activations overflows with the stages' working memory"
        return f"{reason or 'no configuration fits'}{suffix}"
    closest, space, degrees = min(needed, key=lambda x: x[0].predicted.peak_memory_bytes)
    return _needs(closest, space, degrees, memory_fraction) + suffix


def _needs(p: Plan, space: Space, degrees: tuple[int, int], memory_fraction: float) -> str:
    """One line: what plan `p` (of the search at (tensor-parallel, expert-parallel) `degrees`) needs per GPU against
    what is planned for, and the memory fraction that admits it."""
    gpu = space.cluster.gpu
    whole = memory_per_process(space.cluster)
    need = p.predicted.peak_memory_bytes
    lay = p.layout
    tp, ep = degrees
    what = (
        f"dp={lay.dp} {f'ep={ep} ' if ep > 1 else ''}{f'tp={tp} ' if tp > 1 else ''}pp={lay.pp} "
        f"b={lay.micro_batch_size} GA={lay.num_microbatches} ZeRO-{lay.zero_stage}"
    )
    line = (
        f"no plan fits in the {fmt_bytes(whole * memory_fraction)} planned for on each {gpu.name} "
        f"(--memory-fraction {memory_fraction:g} of {fmt_bytes(whole)}): the one that needs least ({what}) needs "
        f"{fmt_bytes(need)}, {need / whole:.0%} of the GPU"
    )
    fraction = math.ceil(need / whole * 100) / 100
    if fraction <= 1.0:
        return f"{line}; --memory-fraction {fraction:.2f} admits it"
    return f"{line}, more than it has; recompute (--remat auto), shard the state (--zero), or add GPUs"


@dataclass(frozen=True)
class Searched:
    """A C++ search result with its candidates of at most 2 stages per rank kept apart (`Space.run`), as the planner
    reads it: those candidates first, then the overall top and frontier."""

    feasible: bool
    top: tuple[Any, ...]
    pareto: tuple[Any, ...]
    num_candidates: int
    num_evaluated: int
    reason: str

    @staticmethod
    def of(result: Any) -> Searched:
        """`result`, searched with `two_chunks_apart`."""
        return Searched(
            feasible=result.feasible,
            top=(*result.top_two_chunks, *result.top),
            pareto=(*result.pareto_two_chunks, *result.pareto),
            num_candidates=result.num_candidates,
            num_evaluated=result.num_evaluated,
            reason=result.reason,
        )


@dataclass(frozen=True)
class Space:
    """The search's fixed inputs: the chain's per-block figures, the cluster's links and memory, the workload's
    bytes per parameter and price, as the C++ search (`_core.search`) takes them."""

    chain: Chain
    cluster: Cluster
    workload: Workload
    group: NodeGroup  # the cluster's nodes, links without figures given stand-ins when one GPU sends nothing
    gpu_mem: float  # bytes planned for on each GPU
    scale: float  # saved activations and boundary tensors traced in fp32, at the workload's precision
    price: float  # per GPU-second, 0 when no price is known and none is needed
    currency: str
    host: dict[str, float | bool]  # the runtime's host costs on this machine's CPU (`pyplan calibrate`)
    tables: dict[str, list[float]]  # the blocks' measured times at each batch size (`_time_tables`)

    @staticmethod
    def of(chain: Chain, cluster: Cluster, workload: Workload, objective: str, memory_fraction: float) -> Space:
        price, currency = 0.0, ""
        if objective != "time" or any(g.price_per_gpu_hour is not None for g in cluster.groups):
            money = cluster.price_per_gpu_second()
            price, currency = money.amount, money.currency
        gpu = cluster.gpu
        if gpu.memory_bytes is None or not gpu.hbm_bw_bytes_per_s:
            raise PlanError(f"GPU '{gpu.name}' has no memory size or bandwidth; run `pyplan calibrate` first")
        group = cluster.groups[0]
        if cluster.gpus == 1:
            # One GPU sends nothing: a link without figures (`pyplan calibrate --no-link`, one GPU on the machine)
            # takes no part in its plans, and any positive figures stand in for it.
            group = replace(group, intra_link=_unused(group.intra_link), inter_link=_unused(group.inter_link))
        for link, where in ((group.intra_link, "inside a node"), (group.inter_link, "between nodes")):
            if link.latency_s is None or link.bw_bytes_per_s is None:
                raise PlanError(f"the link {where} ({link.name}) has no latency or bandwidth; run `pyplan calibrate`")
        host = local_host_costs() if is_local(gpu) and gpu.device_type == "cpu" else None
        return Space(
            chain,
            cluster,
            workload,
            group,
            gpu_mem=memory_per_process(cluster) * memory_fraction,
            scale=workload.activation_scale,
            price=price,
            currency=currency,
            host=host.for_search(workload.optimizer) if host is not None else {},
            tables=_time_tables(chain.blocks),
        )

    @property
    def cut_tensors(self) -> list[float]:
        return [float(len(c.live)) for c in self.chain.cuts]

    def run(self, pins: dict[str, Any], top: int, memory: RematProfile | None = None, share: float = 0.0) -> Any:
        """The C++ search over the candidates `pins` allow, its `top` best: with every block's activations kept,
        or with `memory` relaxed by recomputation (`relaxed_chain` at `share`, each block's backward also running
        its forward again).

        Where more than 2 stages per rank are allowed beside 1 or 2, the search also keeps the top and frontier of the
        candidates of at most 2 (`two_chunks_apart`), and the candidates of both are refined (`Searched`): the
        refinement reorders candidates (ZeRO-3's units, recomputation), so a plan of more stages per rank in the top
        list could push out one that refines to the best plan. The candidates of at most 2 are those refined before
        more stages per rank were searched, so a plan changes only where more refine to a better one."""
        chunks = list(pins.get("stages_per_rank", STAGES_PER_RANK))
        if all(v <= 2 for v in chunks) or all(v > 2 for v in chunks):
            return self._run(pins, top, memory, share)
        return Searched.of(self._run({**pins, "two_chunks_apart": True}, top, memory, share))

    def _run(self, pins: dict[str, Any], top: int, memory: RematProfile | None, share: float) -> Any:
        blocks, scale = self.chain.blocks, self.scale
        fwd_a = [b.fwd_time_s.per_sample for b in blocks]
        fwd_b = [b.fwd_time_s.fixed for b in blocks]
        bwd_a = [b.bwd_time_s.per_sample for b in blocks]
        bwd_b = [b.bwd_time_s.fixed for b in blocks]
        act_a = [b.saved_bytes.per_sample * scale for b in blocks]
        # A line through two recorded sizes can cross zero where what a block saves is not affine in the batch (a
        # rank's (b, 1) slice saved as a view at one size and as a copy at the other): never below nothing.
        act_b = [max(0.0, b.saved_bytes.fixed * scale) for b in blocks]
        tables = self.tables
        if memory is not None:
            act_a, act_b, bwd_a, bwd_b = relaxed_chain(fwd_a, fwd_b, bwd_a, bwd_b, memory, scale, share)
            if tables:
                tables = {
                    **tables,
                    "bwd_points_s": [g + f for g, f in zip(tables["bwd_points_s"], tables["fwd_points_s"])],
                }
        per_param, gpu, group = self.workload.bytes_per_param(), self.cluster.gpu, self.group
        unit = self.workload.sharded_unit_bytes()
        try:
            return _core.search(
                fwd_a,
                fwd_b,
                bwd_a,
                bwd_b,
                act_a,
                act_b,
                [float(b.param_numel) for b in blocks],
                [c.bytes.per_sample * scale for c in self.chain.cuts],
                [c.bytes.fixed * scale for c in self.chain.cuts],
                num_gpus=self.cluster.gpus,
                gpus_per_node=self.cluster.gpus_per_node,
                gpu_mem_bytes=self.gpu_mem,
                mem_bw_bytes_per_s=gpu.hbm_bw_bytes_per_s,
                intra_latency_s=group.intra_link.latency_s,
                intra_bw_bytes_per_s=group.intra_link.bw_bytes_per_s,
                inter_latency_s=group.inter_link.latency_s,
                inter_bw_bytes_per_s=group.inter_link.bw_bytes_per_s,
                price_per_gpu_s=self.price,
                global_batch=self.workload.global_batch,
                param_bytes=float(per_param.param_bytes),
                grad_bytes=float(per_param.grad_bytes),
                optim_bytes=float(per_param.optimizer_bytes),
                top_k=top,
                param_tensors=[float(b.param_tensors) for b in blocks],
                cut_tensors=self.cut_tensors,
                intra_collective=group.intra_link.collective,
                inter_collective=group.inter_link.collective,
                host=self.host,
                zero3_single_stage=True,  # see pyplan/plan.py ZERO_STAGES
                zero3_gather_bytes=float(unit.gathered),
                zero3_reduce_bytes=float(unit.reduced),
                # One replica frees its gradients every step (zero_grad, no DDP buckets), so a stage that runs every
                # forward before its first backward has not made them again at its peak: the search leaves out what
                # it surely has not made, and the refinement (unmade_grad_bytes) finds the rest.
                fresh_gradients=True,
                **pins,
                **tables,
            )
        except ValueError as exc:
            raise PlanError(str(exc)) from exc


@dataclass(frozen=True)
class Refiner:
    """Each candidate of the C++ search as the runtime would train it: its stages replayed block by block with
    their exact working memory (pyplan/solve/remat.py; the search counts saved activations per micro-batch in
    flight, the replay adds outputs, gradients and transients), ZeRO-3's communication beside the compute and its
    gathered units, each rank's copy of a tied parameter. A plan that then does not fit is dropped, so the searches
    return more candidates than asked. The replay also finds the parameter gradients not yet made at the peak of a
    stage of one replica that runs every forward before its first backward (`unmade_grad_bytes`); the search leaves
    out of such a stage's state and activations what it surely has not made there (min(gradients, in flight × saved
    bytes): search.h's fresh_gradients), a lower bound on what the replay leaves out, so that a plan that fits only
    by them reaches the refinement, which decides."""

    space: Space
    model: nn.Module
    profile: RematProfile  # the blocks' working memory, the loss's folded in
    remat: str
    offload_bw_bytes_per_s: float | None  # None: no offloading
    checkpoint_s: float  # a checkpoint call's own cost, measured where the blocks were
    costs: CheckpointCosts
    tied: list[TiedParameter]  # parameters on stages of different ranks, all-reduced after the pipeline drains
    params: StageParams
    gathered: float  # ZeRO-3: the bytes of the units FSDP2 holds gathered beside the shards
    units: list[tuple[int, int]]  # ZeRO-3: the blocks each unit spans (it checkpoints whole units)

    @staticmethod
    def of(
        space: Space,
        model: nn.Module,
        example_inputs: ExampleInputs,
        remat: str,
        offload: str,
        offload_bw_bytes_per_s: float,
        local_numel: Callable[[str], float] | None = None,
    ) -> Refiner:
        chain, workload, gpu = space.chain, space.workload, space.cluster.gpu
        memory = (
            chain.memory
            if chain.memory is not None
            else remat_bytes(chain, example_inputs, (2, 4), roofline=pricing(gpu, None))
        )
        if chain.loss is not None:
            memory = remat_with_loss(memory, chain.loss)
        # On a GPU the host overhead of a checkpoint call runs ahead of the kernels, and an analytic profile has no
        # host to measure: none is charged.
        hosted = remat != "none" and is_local(gpu) and not is_meta_module(model)
        checkpoint_s = checkpoint_call_s() if hosted else 0.0
        costs = (
            checkpoint_costs(chain, example_inputs, min(4, workload.global_batch), call_s=checkpoint_s)
            if hosted
            else CheckpointCosts(())
        )
        unit = workload.sharded_unit_bytes()
        tied = tied_parameters(chain)
        return Refiner(
            space,
            model,
            memory,
            remat,
            offload_bw_bytes_per_s if offload == "auto" else None,
            checkpoint_s,
            costs,
            tied,
            _stage_params(chain, workload, gpu, tied),
            gathered_bytes(model, float(unit.gathered), float(unit.grad), local_numel),
            unit_segments(model, [b.name for b in chain.blocks]),
        )

    def refined(self, results: Iterable[Any], mode: str) -> list[Plan]:
        """The feasible candidates of `results` (each configuration once), refined, that still fit."""
        space = self.space
        seen: set[tuple[Any, ...]] = set()
        out: list[Plan] = []
        for c in [cand for r in results if r.feasible for cand in (*r.top, *r.pareto)]:
            start = self.tied_state(plan_of(c, space.chain, space.currency, space.workload))
            key = _key(start)
            if key in seen:
                continue
            seen.add(key)
            got = self._sharded(self._refine(c, start, _zero3_mode(mode) if c.zero_stage == 3 else mode))
            if got is not None:
                got = exact_state(got, [self._stage_shapes(st) for st in got.stages], space.workload)
            if got is not None and got.predicted.peak_memory_bytes <= space.gpu_mem:
                out.append(self.tied_sync(got))
        return out

    def least_needed(self, results: Iterable[Any]) -> Plan | None:
        """Of the feasible candidates of `results` (without recomputation), refined with no memory limit, the one
        that needs the least memory: what the best plan needs, when none fits."""
        unbounded = replace(self, space=replace(self.space, gpu_mem=UNBOUNDED_BYTES))
        return min(unbounded.refined(results, "none"), key=lambda p: p.predicted.peak_memory_bytes, default=None)

    def operation_level(
        self, candidates: Sequence[Any], example_inputs: ExampleInputs, objective: str, weight: float
    ) -> list[Plan]:
        """Plans whose stages are assigned operation by operation, for the candidates whose chain is too coarse
        to balance (pyplan/solve/dag_search.py), with their tied parameters, that fit."""
        space = self.space
        nodes = functools.partial(node_profile, space.chain, example_inputs, gpu=space.cluster.gpu)
        dag = dag_plans(candidates, space.chain, nodes, space.cluster, space.workload, gpu_mem_bytes=space.gpu_mem,
                        scale=space.scale, price_per_gpu_s=space.price, currency=space.currency,
                        objective=objective, weight=weight, host=space.host)  # fmt: skip
        fitting = (self.tied_sync(self.tied_state(p)) for p in dag)
        return [p for p in fitting if p.predicted.peak_memory_bytes <= space.gpu_mem]

    def _refine(self, c: Any, start: Plan, mode: str) -> Plan | None:
        space, chain = self.space, self.space.chain
        link = space.group.inter_link if c.pipeline_inter else space.group.intra_link
        fwd_times, bwd_times = self._block_times(c)
        return refine_plan(
            start,
            self.profile,
            fwd_times,
            bwd_times,
            scale=space.scale,
            gpu_mem_bytes=space.gpu_mem,
            cut_bytes=lambda b: [cut.bytes(b) * space.scale for cut in chain.cuts],
            positions=[cut.position for cut in chain.cuts],
            send_s=lambda nbytes: link.latency_s + nbytes / link.bw_bytes_per_s,
            stage_sync_s=list(c.stage_sync_s),
            mode=mode,
            offload_bw_bytes_per_s=self.offload_bw_bytes_per_s,
            checkpoint_s=self.checkpoint_s,
            host=space.host,
            cut_tensors=space.cut_tensors,
            checkpoint_block_s=self.costs.block_s,
            checkpoint_forward_share=self.costs.forward_share,
            params=self.params,
            tied_copy_numel=[sum(float(t.numel) for t in ts) for ts in tied_copies(start.layout, chain, self.tied)],
            segments=self.units,
        )

    def _block_times(self, c: Any) -> tuple[Callable[[int], list[float]], Callable[[int], list[float]]]:
        """The blocks' forward and backward seconds at micro-batch b, as functions of b. ZeRO-3 gathers each
        block's weights in its forward and again in its backward, and reduce-scatters its gradients, per
        micro-batch, over the replicas (half an all-reduce each), on streams of their own beside the compute
        (`zero3_overlap`)."""
        blocks, group = self.space.chain.blocks, self.space.group
        fwd_of, bwd_of = [blk.fwd_time_s for blk in blocks], [blk.bwd_time_s for blk in blocks]
        if not (c.zero_stage == 3 and c.dp > 1):
            return (lambda b: [f(b) for f in fwd_of]), (lambda b: [g(b) for g in bwd_of])
        (a_lat, a_bw), (e_lat, e_bw) = group.intra_link.collective, group.inter_link.collective

        def half_allreduce(nbytes: float) -> float:
            whole = _core.hierarchical_allreduce_time_s(
                nbytes,
                c.dp_gpus_per_node,
                c.dp_nodes,
                intra_latency_s=a_lat,
                intra_bw_bytes_per_s=a_bw,
                inter_latency_s=e_lat,
                inter_bw_bytes_per_s=e_bw,
            )
            return whole / 2

        unit = self.space.workload.sharded_unit_bytes()
        gathers = [half_allreduce(blk.param_numel * unit.gathered) for blk in blocks]
        scatters = [half_allreduce(blk.param_numel * unit.reduced) for blk in blocks]

        def overlapped(b: int) -> tuple[list[float], list[float]]:
            return zero3_overlap([f(b) for f in fwd_of], [g(b) for g in bwd_of], gathers, scatters)

        return (lambda b: overlapped(b)[0]), (lambda b: overlapped(b)[1])

    def tied_sync(self, p: Plan) -> Plan:
        """The plan with the all-reduce of its tied parameters' gradients after the pipeline drains."""
        if not self.tied or p.layout.pp < 2:
            return p
        space, grad_bytes = self.space, float(self.space.workload.bytes_per_param().grad_bytes)
        links = {
            "intra": space.group.intra_link,
            "inter": space.group.inter_link,
            "gpus_per_node": space.cluster.gpus_per_node,
        }
        return with_tied_sync(p, tied_sync_s(p.layout, space.chain, self.tied, grad_bytes, **links))

    def tied_state(self, p: Plan) -> Plan:
        """Each rank's own copy of a tied parameter (weights, gradient, optimizer state), before the replay."""
        if not self.tied or p.layout.pp < 2:
            return p
        lay, workload = p.layout, self.space.workload
        return with_tied_state(
            p, self.space.chain, self.tied, lambda n: workload.state_bytes_per_gpu(n, lay.dp, lay.zero_stage)
        )

    def _sharded(self, p: Plan | None) -> Plan | None:
        """A ZeRO-3 plan as the runtime can run it (no recomputation, or every unit's: it trains the model's own
        modules), with its gathered units, if it still fits; any other plan as it is."""
        if p is None or p.layout.zero_stage != 3:
            return p
        if remat_kind(p.layout) == "other":
            return None
        # Gathered while the micro-batches run, resharded before the optimizer step: the pipeline's moment grows.
        gathered = self.gathered
        stages = tuple(
            replace(
                st,
                activation_bytes=st.activation_bytes + gathered,
                memory_bytes=max(
                    st.memory_bytes,
                    st.state_bytes + st.activation_bytes + gathered + st.buffer_bytes - st.unmade_grad_bytes,
                ),
            )
            for st in p.stages
        )
        peak = max(st.memory_bytes for st in stages)
        if peak > self.space.gpu_mem:
            return None
        return replace(p, stages=stages, predicted=replace(p.predicted, peak_memory_bytes=peak))

    def _stage_shapes(self, st: StagePlan) -> list[tuple[int, ...]]:
        """The shapes of the parameter tensors of a stage's blocks, each tensor once (tied names share one)."""
        blocks, params = self.space.chain.blocks, self._params
        seen: dict[int, tuple[int, ...]] = {}
        for name in (n for b in blocks[st.first_block : st.last_block + 1] for n in b.param_names):
            if name in params:
                seen.setdefault(*params[name])
        return list(seen.values())

    @functools.cached_property
    def _params(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Each parameter's name (tied ones under each of their names) -> its identity and shape."""
        module = self.space.chain.graph.module
        return {name: (id(p), tuple(p.shape)) for name, p in module.named_parameters(remove_duplicate=False)}


def _stage_params(chain: Chain, workload: Workload, gpu: GPU, tied: list[TiedParameter]) -> StageParams:
    """The parameters as the refinement counts their gradients and the optimizer step's temporaries: torch's Adam
    runs foreach on a GPU and tensor by tensor on the CPU; ZeRO 1-3 shard the optimizer over the replicas."""
    # Every parameter by each of its names, read once (a lookup by name walks the module path each time).
    numel = {name: p.numel() for name, p in chain.graph.module.named_parameters(remove_duplicate=False)}

    def largest(names: Iterable[str]) -> float:
        return float(max([0, *(numel[name] for name in names if name in numel)]))

    def step_bytes(elements: float, largest_tensor: float, dp: int, zero_stage: int) -> float:
        shard = dp if zero_stage >= 1 else 1
        return optimizer_step_bytes(
            workload.optimizer,
            workload.precision,
            elements=elements / shard,
            largest_tensor=largest_tensor,
            foreach=gpu.device_type != "cpu",
        )

    return StageParams(
        numel=[float(b.param_numel) for b in chain.blocks],
        largest=[largest(b.param_names) for b in chain.blocks],
        tied=[(t.blocks, float(t.numel)) for t in tied],
        grad_bytes=float(workload.bytes_per_param().grad_bytes),
        step_bytes=step_bytes,
    )


def _key(p: Plan, *, choices: bool = True) -> tuple[Any, ...]:
    """Identity of a configuration: the same plan found by both searches counts once (its tensor- and
    expert-parallel degrees are part of it: the same layout at two degrees is two plans). Without `choices`, the
    schedule and the placement are left out (`_distinct`)."""
    lay = p.layout
    chosen = (lay.schedule, lay.placement) if choices else ()
    return (
        lay.dp,
        lay.tp,
        lay.ep,
        lay.pp,
        lay.micro_batch_size,
        *chosen,
        lay.zero_stage,
        lay.cut_positions,
        tuple(r.plan.describe() if r else "" for r in lay.remat),
        tuple(lay.stage_of_node.items()),
    )


T = TypeVar("T")
TIE = 1e-3  # objective values within 0.1 % of each other are a tie (finer than any prediction is right)


def rank_ties(items: Sequence[T], value: Callable[[T], float], tiebreak: Callable[[T], tuple[Any, ...]]) -> list[T]:
    """`items` by increasing `value`, where runs of values within TIE of the run's first are ties, ordered by
    `tiebreak` (then value)."""
    ordered = sorted(items, key=value)
    out: list[T] = []
    run: list[T] = []
    for it in ordered:
        if run and value(it) > value(run[0]) * (1 + TIE):
            out.extend(sorted(run, key=lambda x: (*tiebreak(x), value(x))))
            run = []
        run.append(it)
    out.extend(sorted(run, key=lambda x: (*tiebreak(x), value(x))))
    return out


def rank_plans(plans: list[Plan], objective: str, weight: float) -> list[Plan]:
    """Best first; tied objective values (rank_ties) go to fewer GPUs, then less memory, then fewer micro-batches in
    flight: on one stage GPipe and 1F1B are predicted the same time, and GPipe, holding every micro-batch's
    activations, ran 4-8 % slower (resnet-tiny, benchmarks/accuracy.py); where the gradients it has not made at its
    peak make up for those activations (`unmade_grad_bytes`), the two need the same memory too."""

    def value(p: Plan) -> float:
        t, c = p.predicted.iteration_s, p.predicted.cost_per_iteration
        return t if objective == "time" else c if objective == "cost" else c + weight * t

    def tiebreak(p: Plan) -> tuple[int, float, int]:
        return (p.layout.num_gpus, p.predicted.peak_memory_bytes, sum(st.in_flight for st in p.stages))

    unique = {_key(p): p for p in sorted(plans, key=lambda p: (value(p), *tiebreak(p)), reverse=True)}
    return _distinct(rank_ties(list(unique.values()), value, tiebreak))


def _distinct(ranked: list[Plan]) -> list[Plan]:
    """`ranked` without the plans that differ from a better-ranked one only in the schedule or the placement and
    are predicted the same to the last digit (time, memory, cost): on one pipeline stage of one micro-batch
    GPipe and 1F1B run the same actions, and with one replica or one stage the placement changes no link."""
    seen: set[tuple[Any, ...]] = set()
    out: list[Plan] = []
    for p in ranked:
        pred = p.predicted
        shape = (*_key(p, choices=False), pred.iteration_s, pred.peak_memory_bytes, pred.cost_per_iteration)
        if shape not in seen:
            seen.add(shape)
            out.append(p)
    return out


def frontier(plans: list[Plan]) -> list[Plan]:
    """The plans no other beats in both time and cost, by increasing time."""
    out: list[Plan] = []
    for p in rank_plans(plans, "time", 0.0):
        if not out or p.predicted.cost_per_iteration < out[-1].predicted.cost_per_iteration:
            out.append(p)
    return out
