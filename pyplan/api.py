"""The library calls: `plan(...) -> Plan` and `search(...) -> PlanSearch`, from a model and a cluster."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn

from pyplan._torch import without_dynamo
from pyplan.errors import InfeasibleError, PlanError, TraceError
from pyplan.graph.chain import Chain
from pyplan.graph.experts import expert_leaves, find_expert_layers
from pyplan.graph.trace import ExampleInputs, Examples, LeafSpec
from pyplan.hardware.cluster import Cluster
from pyplan.model_state import MASTER_PRECISIONS
from pyplan.plan import (
    OBJECTIVES,
    PLACEMENTS,
    ZERO_REFUSED,
    ZERO_STAGES,
    Plan,
    PlanSearch,
    Workload,
)
from pyplan.planner import (
    SEARCHED_SCHEDULES,
    STAGES_PER_RANK,
    Searcher,
    frontier,
    infeasible_reason,
    memory_per_process,
    rank_plans,
    search_degrees,
)
from pyplan.profile.capture import add_loss, chain_for
from pyplan.profile.loss import LossFn, TargetFn
from pyplan.solve.remat_search import (
    OFFLOAD_MODES,
    REMAT_MODES,
)

__all__ = [
    "SEARCHED_SCHEDULES",
    "STAGES_PER_RANK",
    "PlanSearch",
    "add_loss",
    "chain_for",
    "memory_per_process",
    "plan",
    "search",
]


@without_dynamo()  # nothing compiles while planning: torch's marked functions run as they are
def search(
    model: nn.Module,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    *,
    objective: str = "time",
    weight: float = 0.0,
    top_k: int = 5,
    schedules: Sequence[str] = SEARCHED_SCHEDULES,
    zero_stages: Sequence[int] = ZERO_STAGES,
    placements: Sequence[str] = PLACEMENTS,
    micro_batch_sizes: Sequence[int] = (),
    allow_fewer_gpus: bool = True,
    memory_fraction: float = 0.9,
    leaf_modules: Iterable[LeafSpec] = (),
    chain: Chain | None = None,
    remat: str = "none",
    offload: str = "none",
    offload_bw_bytes_per_s: float = 25e9,
    stage_dag: bool = True,
    loss: LossFn | None = None,
    target: TargetFn | None = None,
    data_parallel: Sequence[int] = (),
    pipeline_ranks: Sequence[int] = (),
    num_microbatches: Sequence[int] = (),
    stages_per_rank: Sequence[int] = STAGES_PER_RANK,
    stage_cuts: Sequence[int] = (),
    tensor_parallel: Sequence[int] = (1,),
    tp_plan: Mapping[str, str] | None = None,
    sequence_parallel: bool = True,
    expert_parallel: Sequence[int] = (1,),
    progress: Callable[[str], None] | None = None,
) -> PlanSearch:
    """Every way to train `model` on `cluster` that fits, ranked by `objective`.

    `objective` is "time" (iteration time), "cost" (money per iteration) or "weighted" (cost + weight·time, the
    objective of Huang et al.). `memory_fraction` of each GPU's memory is planned for (the rest is left to the
    CUDA context, allocator fragmentation and temporaries). Pass `chain` to reuse a profile.
    `remat` "auto" also plans configurations that fit only with recomputation, each stage with its optimal
    remat plan (and, with `offload` "auto", activation offloading to host memory over a link of
    `offload_bw_bytes_per_s`, PCIe 4.0 x16 by default); "full" and "periodic" force that plan on every stage
    (see pyplan/solve/remat_search.py). `loss(output, target)` with `target(b)` (None: zeros like the output) is
    the training loss: its time and saved bytes join the last block (pyplan/profile/loss.py); without it the loss
    is left out. `stage_dag` also assigns stages operation by operation to the pipelines
    whose chain is too coarse to balance (pyplan/solve/dag_search.py), except for a model with mixture-of-experts
    layers. `data_parallel`, `pipeline_ranks`,
    `num_microbatches` (gradient-accumulation steps), like `micro_batch_sizes`, `schedules` and `zero_stages`,
    restrict the search to the values given (empty: any): pins, for "what does this configuration cost";
    `stages_per_rank` lists the stages (model chunks) a pipeline rank may hold, 1 under GPipe and 1F1B, 2 or more
    under the interleaved schedules (stage s on rank s mod pp, Megatron-LM's virtual pipeline stages);
    `stage_cuts` pins the partition, the blocks (numbered from 0, as `pyplan inspect` lists them) at which stages
    2, 3, ... start, so that only pipelines of that many stages are planned, cut there.
    `tensor_parallel` lists the degrees of tensor parallelism to plan (1: none; each must divide the GPUs of a
    node, where the split layers stay): each layer split as the plan derived from the model's graph says
    (pyplan/graph/tensor_parallel.py), or as much of it as `tp_plan` (module name -> style) names, priced on the
    catalog GPU's analytic profile at that degree (pyplan/profile/tensor_parallel.py); ZeRO-3 shards each rank's
    split tensors over the replicas (FSDP + TP). `sequence_parallel` also splits the values between the split
    layers by their tokens where the model allows it (pyplan/graph/sequence_parallel.py): less memory, the same
    bytes on the link; with a `tp_plan`, only if it names a norm `SequenceParallel` (torchtitan's way of asking
    for it).
    A model with mixture-of-experts layers (pyplan/graph/experts.py) is captured with each layer's routed experts
    kept whole (`expert_leaves(model)` joins `leaf_modules`): its plans' cut positions index that capture, as the
    runtime's must (plan.json's `leaf_modules` carry them), and its experts are priced by the cost model of
    pyplan/profile/experts.py (pyplan/profile/expert_chain.py). `expert_parallel` lists the degrees of expert
    parallelism to plan (1: none): each E > 1 splits every layer's experts over E data-parallel replicas, searched at
    tensor parallelism 1, with dp a multiple of E, ZeRO 0 and the stage's replicas on neighbouring ranks
    (pyplan/planner.py `expert_parallel_search`); a degree that splits no layer, or that the pins leave nothing of,
    is left out with why (`PlanSearch.ep_left_out`).
    `progress(step)` is told each step as it starts: "tracing and profiling", "searching", "refining",
    "assigning operations to stages", "tensor parallelism t", "expert parallelism E".

    The steps: check the options, capture and profile once (`chain_for`), search the space (`Space`), refine each
    candidate (`Refiner`), rank, and assign operations to the stages of pipelines too coarse to balance.
    """
    say = progress or (lambda step: None)
    examples = Examples(example_inputs)
    _check_options(objective, remat, offload, memory_fraction, zero_stages, schedules,
                   data_parallel=data_parallel, pipeline_ranks=pipeline_ranks, num_microbatches=num_microbatches,
                   micro_batch_sizes=micro_batch_sizes, stage_cuts=stage_cuts, stages_per_rank=stages_per_rank,
                   tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)  # fmt: skip
    zero_stages = _master_zero_stages(workload, zero_stages)
    profiled_on = "given chain"
    # A mixed precision computes under autocast but in ZeRO-3's one-stage FSDP (FSDP2's 16-bit policy).
    under_autocast = set(zero_stages) != {3}
    if chain is None:
        say("tracing and profiling")
        chain, profiled_on = _captured(model, examples, cluster, workload, tuple(leaf_modules), under_autocast)
    chain, micro_batch_sizes = _trainable(chain, micro_batch_sizes, workload)
    fixed_cuts = _fixed_cuts(stage_cuts, len(chain.blocks))
    bare = chain
    if loss is not None and chain.loss is None and not chain.graph.returns_loss:
        # (A model that returns its own loss computes it in its last block, which the profile timed already.)
        chain = add_loss(chain, model, examples, cluster, workload, loss, target, autocast=under_autocast)
    # The candidate space as the C++ search takes it: the pins, and what ranks the candidates.
    pins = dict(micro_batch_sizes=list(micro_batch_sizes), data_parallel=list(data_parallel),
                pipeline_ranks=list(pipeline_ranks), num_microbatches=list(num_microbatches), schedules=list(schedules),
                stages_per_rank=list(stages_per_rank),
                zero_stages=list(zero_stages), placements=list(placements), allow_fewer_gpus=allow_fewer_gpus,
                objective=objective, weight=weight, fixed_cuts=fixed_cuts)  # fmt: skip
    how = Searcher(model, examples, workload, objective, memory_fraction, pins, max(4 * top_k, 20), remat, offload,
               offload_bw_bytes_per_s, loss, target, autocast=under_autocast)  # fmt: skip
    # The layers whose experts the capture kept whole: their work is the cost model's (the profile holds none of it).
    experts = [layer for layer in find_expert_layers(bare.graph).layers if layer.kept_whole]
    found = search_degrees(how, bare, chain, cluster, tensor_parallel, tp_plan, sequence_parallel, say,
                           experts=experts, expert_degrees=expert_parallel)  # fmt: skip
    if not found.plans:
        raise InfeasibleError(infeasible_reason(found, remat, memory_fraction))
    plain = found.runs[0][0]
    top, pareto = rank_plans(found.plans, objective, weight)[:top_k], frontier(found.plans)
    refiner = found.refiner
    # Not for a mixture of experts: the operations' own profile holds none of the experts' work (expert_chain.py
    # prices them per block).
    by_operation = stage_dag and not fixed_cuts and not experts
    if by_operation and refiner is not None and plain is not None and plain.feasible:
        say("assigning operations to stages")
        dag = refiner.operation_level([*plain.top, *plain.pareto], examples, objective, weight)
        if dag:
            top, pareto = rank_plans([*top, *dag], objective, weight)[:top_k], frontier([*pareto, *dag])
    results = found.results
    candidates, evaluated = sum(r.num_candidates for r in results), sum(r.num_evaluated for r in results)
    return PlanSearch(top[0], tuple(top[1:]), tuple(pareto), candidates, evaluated, chain, profiled_on,
                      tuple(found.degrees), tuple(found.left_out), tuple(found.expert_degrees),
                      tuple(found.ep_left_out))  # fmt: skip


def _captured(
    model: nn.Module,
    examples: Examples,
    cluster: Cluster,
    workload: Workload,
    leaf_modules: tuple[LeafSpec, ...],
    autocast: bool,
) -> tuple[Chain, str]:
    """`chain_for`'s chain, each mixture-of-experts layer's routed experts kept whole (one node, at every degree of
    expert parallelism). What `expert_leaves` proposes from the parameters alone is confirmed by the capture: where
    keeping the proposed modules whole fails to capture (a module shaped like a set of experts that is not one),
    the model is captured as it is, and the experts the graph then shows are priced as captured."""
    experts = expert_leaves(model)
    if not experts:
        return chain_for(model, examples, cluster, workload, leaf_modules=leaf_modules, autocast=autocast)
    try:
        return chain_for(model, examples, cluster, workload, leaf_modules=(*leaf_modules, *experts), autocast=autocast)
    except TraceError:
        return chain_for(model, examples, cluster, workload, leaf_modules=leaf_modules, autocast=autocast)


def _check_options(
    objective: str,
    remat: str,
    offload: str,
    memory_fraction: float,
    zero_stages: Sequence[int],
    schedules: Sequence[str],
    **pins: Sequence[int],
) -> None:
    """One line for the first option `search` cannot take."""
    for name, values in pins.items():
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in values):
            raise PlanError(f"{name} takes whole numbers of at least 1, got {list(values)}")
    cuts = list(pins.get("stage_cuts", ()))
    if any(a >= b for a, b in itertools.pairwise(cuts)):
        raise PlanError(f"stage_cuts must rise, got {cuts}: the blocks at which stages 2, 3, ... start")
    if remat not in REMAT_MODES:
        raise PlanError(f"unknown remat mode '{remat}'; choose one of {', '.join(REMAT_MODES)}")
    if offload not in OFFLOAD_MODES:
        raise PlanError(f"unknown offload mode '{offload}'; choose one of {', '.join(OFFLOAD_MODES)}")
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective '{objective}'; choose one of {', '.join(OBJECTIVES)}")
    if not 0 < memory_fraction <= 1:
        raise PlanError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    for stage in zero_stages:
        if stage in ZERO_REFUSED:
            raise PlanError(ZERO_REFUSED[stage])
        if stage not in ZERO_STAGES:
            raise PlanError(f"unknown ZeRO stage {stage}; choose from {', '.join(map(str, ZERO_STAGES))}")
    unknown = [s for s in schedules if s not in SEARCHED_SCHEDULES]
    if unknown:
        raise PlanError(f"schedule '{unknown[0]}' is not searched; choose from {', '.join(SEARCHED_SCHEDULES)}")
    chunks = list(pins.get("stages_per_rank", STAGES_PER_RANK))
    if not chunks:
        raise PlanError("stages_per_rank is empty: give 1 (GPipe, 1F1B) or 2 or more (the interleaved schedules)")
    single = {"GPipe", "1F1B"}
    if not any((1 in chunks) if s in single else any(v > 1 for v in chunks) for s in schedules):
        raise PlanError(
            f"no schedule asked for runs {', '.join(map(str, chunks))} stage(s) per rank: GPipe and 1F1B run 1, "
            f"the interleaved schedules 2 or more (asked for {', '.join(schedules)})"
        )


def _master_zero_stages(workload: Workload, zero_stages: Sequence[int]) -> list[int]:
    """The ZeRO stages to search: beside 16-bit weights with fp32 master weights (pyplan/runtime/master.py) the
    runtime trains ZeRO 0 and 1; one line where nothing the options ask is left."""
    if workload.precision not in MASTER_PRECISIONS:
        return list(zero_stages)
    left = [z for z in zero_stages if z in (0, 1)]
    if not left:
        raise PlanError(f"{workload.precision} runs under ZeRO 0 or 1; plan it with --zero 1, or bf16-mixed")
    return left


def _trainable(chain: Chain, micro_batch_sizes: Sequence[int], workload: Workload) -> tuple[Chain, Sequence[int]]:
    """The profiled chain, and the micro-batch sizes the model can train on (a BatchNorm that sees one value per
    channel below `chain.min_micro_batch`, see chain_for)."""
    if any(b.fwd_time_s is None or b.bwd_time_s is None or b.saved_bytes is None for b in chain.blocks):
        raise PlanError("the chain has blocks without times or saved bytes; profile it first")
    if chain.min_micro_batch <= 1:
        return chain, micro_batch_sizes
    allowed = [b for b in micro_batch_sizes or range(1, workload.global_batch + 1) if b >= chain.min_micro_batch]
    if not allowed:
        raise PlanError(
            f"the model trains on micro-batches of {chain.min_micro_batch} samples or more (a BatchNorm sees "
            f"one value per channel below), none of {list(micro_batch_sizes)} is"
        )
    return chain, allowed


def _fixed_cuts(stage_cuts: Sequence[int], num_blocks: int) -> list[int]:
    """The pinned partition as the C++ search takes it, from 0 to the last block; empty when not pinned."""
    if not stage_cuts:
        return []
    if stage_cuts[-1] >= num_blocks:
        raise PlanError(
            f"stage_cuts {list(stage_cuts)} go past the model's {num_blocks} blocks (numbered 0-{num_blocks - 1}; "
            "`pyplan inspect` lists them)"
        )
    return [0, *stage_cuts, num_blocks]


def plan(
    model: nn.Module,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    **options: Any,
) -> Plan:
    """The best plan to train `model` on `cluster` (see `search` for the options)."""
    return search(model, example_inputs, cluster, workload, **options).best
