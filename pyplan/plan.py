"""The plan types: Workload (what to train), Plan (how), Prediction (what it will cost), with JSON forms."""

from __future__ import annotations

from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from pyplan import _core
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.tensor_parallel import STYLES as TP_STYLES
from pyplan.model_state import (
    OPTIMIZERS,
    PRECISIONS,
    ModelState,
    ShardedUnitBytes,
    activation_scale,
    model_state_bytes,
    sharded_unit_bytes,
)
from pyplan.remat_plan import RematPlan

__all__ = [
    "OBJECTIVES",
    "PLACEMENTS",
    "SCHEMA_VERSION",
    "SPLIT_BACKWARD",
    "Layout",
    "Plan",
    "PlanSearch",
    "Prediction",
    "StagePlan",
    "StageRemat",
    "Workload",
    "master_refusal",
]

SCHEMA_VERSION = 1
OBJECTIVES = ("time", "cost", "weighted")
PLACEMENTS = ("pp-inner", "dp-inner")
# The ZeRO stages plans use (Rajbhandari et al. 2020): 0 replicates the model state (DDP); 1 shards the optimizer
# state (ZeroRedundancyOptimizer beside DDP); 3 shards parameters, gradients and optimizer state, and only in plans of
# one pipeline stage, where the runtime trains the model's own modules under FSDP2 (pyplan/runtime/sharded.py).
# Over several stages torch.distributed.pipelining defers FSDP2's reduce-scatter and reshard to the step's end
# (PipelineStage.backward_maybe_with_nosync), holding every unsharded gradient and parameter: not ZeRO-3's memory.
ZERO_STAGES = (0, 1, 3)
ZERO_REFUSED = {
    2: "ZeRO-2 is not offered: pyplan's runtime would keep every gradient (DDP beside ZeroRedundancyOptimizer, "
    "which is ZeRO-1); plan ZeRO-1, or ZeRO-3 without pipeline stages",
}


@dataclass(frozen=True)
class Workload:
    """What is trained: the global batch per optimizer step, the optimizer and the precision.

    `precision` is "fp32" or autocast mixed precision over fp32 weights ("bf16-mixed", "fp16-mixed");
    the bytes per parameter of weights, gradients and optimizer state follow from both (see `bytes_per_param`).
    `dataset_samples`, when given, turns per-iteration figures into per-epoch ones.
    """

    global_batch: int
    optimizer: str = "adamw"
    precision: str = "fp32"
    dataset_samples: int | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise PlanError(f"the global batch must be a positive number of samples, got {self.global_batch}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"unknown optimizer '{self.optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
        if self.precision not in PRECISIONS:
            raise PlanError(f"unknown precision '{self.precision}'; choose one of {', '.join(PRECISIONS)}")
        if self.dataset_samples is not None and self.dataset_samples < 1:
            raise PlanError(f"the dataset size must be positive, got {self.dataset_samples}")

    @property
    def activation_scale(self) -> float:
        """Saved activations and boundary tensors are traced in fp32; mixed precision keeps most in 16 bits."""
        return activation_scale(self.precision)

    def bytes_per_param(self) -> ModelState:
        """Bytes per parameter element of weights, gradients and optimizer state (step counters left out)."""
        return model_state_bytes(1, 0, optimizer=self.optimizer, precision=self.precision)

    def sharded_unit_bytes(self) -> ShardedUnitBytes:
        """Bytes per parameter element ZeRO-3 gathers, holds as unsharded gradients, and reduce-scatters."""
        return sharded_unit_bytes(self.precision)

    def state_bytes_per_gpu(self, params: float, dp: int, zero_stage: int) -> float:
        """Model-state bytes of `params` parameter elements on one GPU of `dp` replicas under a ZeRO stage."""
        per = self.bytes_per_param()
        return _core.zero_model_state_bytes(
            params,
            dp,
            zero_stage,
            param_bytes=float(per.param_bytes),
            grad_bytes=float(per.grad_bytes),
            optim_bytes=float(per.optimizer_bytes),
        ).total_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Workload:
        return Workload(**_known(Workload, data, "workload"))


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: blocks [first_block, last_block] of the chain and what it holds and takes.

    With the layout's `stage_of_node` a stage may hold part of a block: [first_block, last_block] is then the
    range of blocks its operations come from, and neighbouring stages may share a block.

    `time_s` is the stage's time per micro-batch in the partition's model: `forward_s` + `backward_s` plus the
    boundary sends; `memory_bytes` = `state_bytes` (weights, gradients, optimizer state after ZeRO sharding)
    + `activation_bytes` (`in_flight` micro-batches of saved activations, received inputs and outputs, which the
    PipelineStage keeps to the end of the backward, and one backward's working memory; where a rank holds several
    stages, whose own peaks come at different times, the stage's share of its rank's peak over the schedule: the
    micro-batches it has in flight then, at most `in_flight`, and the working memory on the stage that runs then,
    so that the rank's stages sum to what it holds at its peak) + `buffer_bytes` (the
    runtime's receive buffers beyond the inputs in flight, as many as the schedule holds at once: inputs received
    ahead of their forward and output gradients received or handed over, none and one under GPipe and 1F1B
    (pyplan/runtime/recv.py, _core.receive_buffers); the input gradient it keeps from its last backward while
    others are in flight, the rest of the replica's batch on the first stage, and the output of Schedule1F1B's last
    warm-up send) - `unmade_grad_bytes` (of the gradients in `state_bytes`, those not yet made at the stage's peak:
    on one data-parallel replica zero_grad frees them every step, and a stage whose every micro-batch runs its
    forward first, as under GPipe, peaks in its first backward); or, where that is more, the optimizer step's:
    `state_bytes` + `optimizer_step_bytes` (Adam's out-of-place sqrt(exp_avg_sq) + eps), and the replica's batch on
    the first stage (the schedule's receive buffers are gone by then). With a
    rematerialization plan (the layout's `remat`), `backward_s` includes `recompute_s` and the exposed offload
    `transfer_s` per micro-batch, less `checkpoint_forward_s`. Of `recompute_s`, `checkpoint_s` is what the
    checkpoints cost beyond running blocks again (their calls, torch's hooks on saved tensors), and
    `checkpoint_forward_s` the part of that paid in their first, non-saving pass, which `forward_s` includes.
    With tensor parallelism `tp_comm_s` is the split layers' collectives per micro-batch, forward and backward,
    which `forward_s` and `backward_s` include.
    """

    first_block: int
    last_block: int
    memory_bytes: float
    state_bytes: float
    activation_bytes: float
    time_s: float
    in_flight: int
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    checkpoint_s: float = 0.0  # of recompute_s, the checkpoints' calls and hooks
    checkpoint_forward_s: float = 0.0  # of checkpoint_s, what the forward pays (in forward_s)
    transfer_s: float = 0.0
    buffer_bytes: float = 0.0  # receive buffers beyond those in flight, the batch, a kept send (in memory_bytes)
    unmade_grad_bytes: float = 0.0  # gradients of state_bytes not yet made at the peak (taken off memory_bytes)
    optimizer_step_bytes: float = 0.0  # the optimizer step's temporaries beside state and buffers (see memory_bytes)
    tp_comm_s: float = 0.0  # tensor parallelism's collectives per micro-batch (in forward_s and backward_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StageRemat:
    """One stage's rematerialization plan, for the runtime: `positions` are the boundaries of the blocks the plan
    numbers (node positions as `Layout.cut_positions`, from the stage's first cut to its last), `plan` numbers
    those blocks from 0 (pyplan/solve/remat.py: which keep their activations, which are checkpointed, which
    offloaded)."""

    positions: tuple[int, ...]
    plan: RematPlan

    def __post_init__(self) -> None:
        if list(self.positions) != sorted(set(self.positions)) or len(self.positions) < 2:
            raise PlanError(f"remat positions must be at least 2 increasing positions, got {list(self.positions)}")
        if (self.plan.first, self.plan.last) != (0, len(self.positions) - 2):
            raise PlanError(
                f"the remat plan covers blocks {self.plan.first}..{self.plan.last}, "
                f"its positions make blocks 0..{len(self.positions) - 2}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"positions": list(self.positions), "plan": self.plan.to_json()}

    @staticmethod
    def from_json(data: Any) -> StageRemat:
        if not isinstance(data, dict) or set(data) != {"positions", "plan"}:
            raise PlanError(f"layout.remat[]: expected {{positions, plan}}, got {data!r}")
        try:
            return StageRemat(tuple(int(x) for x in data["positions"]), RematPlan.from_json(data["plan"]))
        except (ValueError, TypeError) as exc:
            raise PlanError(f"layout.remat[]: {exc}") from None


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to cost, per optimizer step (one iteration of the global batch)."""

    iteration_s: float
    samples_per_s: float
    peak_memory_bytes: float
    bubble_fraction: float
    pipeline_s: float
    exposed_comm_s: float
    optimizer_s: float
    cost_per_iteration: float
    currency: str
    cost_per_epoch: float | None = None
    recompute_s: float = 0.0  # recomputation and exposed offload transfers on the busiest stage, per iteration
    host_step_s: float = 0.0  # the runtime's per-step host cost (zero_grad, schedule set-up), in iteration_s
    tp_comm_s: float = 0.0  # tensor parallelism's collectives on the busiest stage, per iteration (in pipeline_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# Schedules whose backward splits into input and weight gradients (torch's zero-bubble schedules): their weight
# gradients come from autograd.grad, outside autograd's accumulation and DDP's and FSDP2's hooks.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class Layout:
    """How the GPUs are used: what a runtime needs to build and run the pipeline, and nothing predicted.

    dp replicas of a pipeline of pp ranks, each rank holding `stages_per_rank` stages (more than one for the
    interleaved and V-shaped schedules); each replica runs `num_microbatches` micro-batches of
    `micro_batch_size` samples per optimizer step, so the global batch is dp · num_microbatches ·
    micro_batch_size. `placement` says which dimension is contiguous in rank order: "pp-inner" puts a
    pipeline's ranks next to each other (inside a node when they fit), "dp-inner" the replicas of a stage.
    `cut_positions` are the stage boundaries as positions in the traced graph's node order (see `Cut`),
    pp · stages_per_rank + 1 of them from 0 to the end, so a runtime re-traces the model and cuts it there.
    `tp` GPUs of one node split each layer (tensor parallelism, inside a node; rank order keeps a tensor-parallel
    group contiguous), as `tp_plan` says: module name -> torchtitan's style (`ColwiseParallel`, `RowwiseParallel`),
    pyplan/graph/tensor_parallel.py. GPUs used: dp · tp · pp. `sequence_parallel` (tp > 1 only): the values between
    the split layers are each rank's slice of the tokens (pyplan/graph/sequence_parallel.py).
    `ep` replicas of each stage split every mixture-of-experts layer's routed experts between them (expert
    parallelism, carved out of dp: ep divides dp; pyplan/runtime/experts.py); a layout with ep > 1 indexes the graph
    captured with each layer's experts kept whole (`leaf_modules=expert_leaves(model)`, pyplan/graph/experts.py).
    `remat`, when not empty, has one entry per stage: its rematerialization plan, or None to keep everything.
    `stage_of_node`, when not empty, gives the stage of every operation of the traced graph (fx node name →
    stage) for stages that are not contiguous in the traced order (pyplan/solve/dag_search.py): stages never
    decrease along the graph's edges, and `cut_positions` index the traced order sorted by stage (ties in traced
    order), so they count each stage's operations. A runtime cuts that order; values read beyond a stage are
    passed on as at any cut. Such a layout has no `remat`.
    """

    dp: int
    pp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    cut_positions: tuple[int, ...]
    zero_stage: int = 0
    placement: str = "pp-inner"
    stages_per_rank: int = 1
    remat: tuple[StageRemat | None, ...] = ()
    # Left out of the hash (a dict is not hashable; layouts that differ only here hash alike, compare unequal).
    stage_of_node: dict[str, int] = field(default_factory=dict, hash=False)
    tp: int = 1
    tp_plan: dict[str, str] = field(default_factory=dict, hash=False)
    sequence_parallel: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.pp < 1 or self.micro_batch_size < 1 or self.num_microbatches < 1:
            raise PlanError(
                f"dp, pp, micro_batch_size and num_microbatches must be positive, got {self.dp}, {self.pp}, "
                f"{self.micro_batch_size}, {self.num_microbatches}"
            )
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise PlanError(f"tp must be a positive whole number, got {self.tp!r}")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise PlanError(f"ep must be a positive whole number dividing dp {self.dp}, got {self.ep!r}")
        if (self.tp > 1) != bool(self.tp_plan):
            raise PlanError(f"a layout with tp {self.tp} needs {'a' if self.tp > 1 else 'no'} tp_plan")
        if not isinstance(self.sequence_parallel, bool) or (self.sequence_parallel and self.tp == 1):
            raise PlanError(
                f"sequence_parallel must be true or false, and false at tp 1; got {self.sequence_parallel!r}"
            )
        if not all(isinstance(k, str) and v in TP_STYLES for k, v in self.tp_plan.items()):
            raise PlanError(f"tp_plan maps module names to {', '.join(TP_STYLES)}")
        if self.schedule not in _core.SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r} (known: {', '.join(_core.SCHEDULES)})")
        if self.zero_stage == 2:
            raise PlanError(ZERO_REFUSED[2])
        if self.zero_stage not in (0, 1, 3):
            raise PlanError(f"zero_stage must be 0, 1 or 3, got {self.zero_stage}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"placement must be one of {', '.join(PLACEMENTS)}, got '{self.placement}'")
        stages = self.pp * self.stages_per_rank
        if len(self.cut_positions) != stages + 1 or list(self.cut_positions) != sorted(set(self.cut_positions)):
            raise PlanError(
                f"cut_positions must be {stages + 1} increasing positions for {stages} stages, "
                f"got {list(self.cut_positions)}"
            )
        if self.remat and len(self.remat) != stages:
            raise PlanError(f"remat has {len(self.remat)} entries, the layout has {stages} stages")
        for k, r in enumerate(self.remat):
            if r is not None and (r.positions[0], r.positions[-1]) != self.cut_positions[k : k + 2]:
                raise PlanError(
                    f"stage {k}'s remat positions {r.positions[0]}..{r.positions[-1]} are not its cuts "
                    f"{self.cut_positions[k]}..{self.cut_positions[k + 1]}"
                )
        if self.stage_of_node:
            self._check_stage_of_node(stages)

    def _check_stage_of_node(self, stages: int) -> None:
        """The mapping's values are stages, and the cut positions count each stage's operations."""
        for name, s in self.stage_of_node.items():
            if not isinstance(name, str) or isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < stages:
                raise PlanError(f"stage_of_node[{name!r}] must be a stage in 0..{stages - 1}, got {s!r}")
        if self.remat:
            raise PlanError("a layout with stage_of_node has no remat plans (they follow contiguous stages)")
        counts = Counter(self.stage_of_node.values())
        for k in range(stages):
            size = self.cut_positions[k + 1] - self.cut_positions[k]
            if counts[k] != size:
                raise PlanError(
                    f"stage_of_node puts {counts[k]} operations on stage {k}, its cut positions "
                    f"{self.cut_positions[k]}..{self.cut_positions[k + 1]} hold {size}"
                )

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def global_batch(self) -> int:
        return self.dp * self.num_microbatches * self.micro_batch_size

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, remat=()))
        data["cut_positions"] = list(self.cut_positions)
        data["remat"] = [None if r is None else r.to_json() for r in self.remat]
        if not self.stage_of_node:
            del data["stage_of_node"]  # a plan of contiguous stages reads as it did before the field existed
        if self.tp == 1:
            del data["tp"], data["tp_plan"]  # likewise a plan without tensor parallelism
        if not self.sequence_parallel:
            del data["sequence_parallel"]
        if self.ep == 1:
            del data["ep"]  # likewise a plan without expert parallelism
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> Layout:
        known = _known(Layout, data, "layout", extra=_PLAN_ONLY)
        known["cut_positions"] = tuple(known.get("cut_positions", ()))
        remat = known.get("remat") or []
        if not isinstance(remat, list):
            raise PlanError(f"layout.remat: expected a list, got {type(remat).__name__}")
        known["remat"] = tuple(None if r is None else StageRemat.from_json(r) for r in remat)
        stage_of_node = known.get("stage_of_node") or {}
        if not isinstance(stage_of_node, dict):
            raise PlanError(
                f"layout.stage_of_node: expected an object of node name to stage, got {type(stage_of_node).__name__}"
            )
        known["stage_of_node"] = dict(stage_of_node)
        tp_plan = known.get("tp_plan") or {}
        if not isinstance(tp_plan, dict):
            raise PlanError(f"layout.tp_plan: expected an object of module name to style, got {type(tp_plan).__name__}")
        known["tp_plan"] = dict(tp_plan)
        return Layout(**known)


@dataclass(frozen=True)
class Plan:
    """A Layout with its stages and predictions: what the planner recommends and why."""

    layout: Layout
    stages: tuple[StagePlan, ...]
    predicted: Prediction

    def to_json(self) -> dict[str, Any]:
        return {
            **self.layout.to_json(),
            "stages": [s.to_json() for s in self.stages],
            "predicted": self.predicted.to_json(),
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> Plan:
        layout = Layout.from_json(data)
        stages = tuple(StagePlan(**_known(StagePlan, s, "plan.stages[]")) for s in data.get("stages", []))
        predicted = Prediction(**_known(Prediction, data.get("predicted", {}), "plan.predicted"))
        return Plan(layout=layout, stages=stages, predicted=predicted)


_PLAN_ONLY = frozenset({"stages", "predicted"})


def _known(cls: type, data: dict[str, Any], where: str, extra: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The fields of `cls` in `data` (keys in `extra` are allowed and skipped); an unknown or missing required
    field is an error naming it."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected an object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names - extra)
    if unknown:
        raise PlanError(f"{where}: unknown field '{unknown[0]}'")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanError(f"{where}: missing field '{missing[0]}'")
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class PlanSearch:
    """The best plan, the next best, and the time/cost Pareto frontier, with the chain they were made from."""

    best: Plan
    alternatives: tuple[Plan, ...]
    pareto: tuple[Plan, ...]
    candidates: int
    evaluated: int
    chain: Chain = field(repr=False, compare=False)
    profiled_on: str = ""
    # The tensor-parallel degrees searched, and those asked for but left out, each with why.
    tensor_parallel: tuple[int, ...] = (1,)
    tp_left_out: tuple[tuple[int, str], ...] = ()
    # Likewise the expert-parallel degrees.
    expert_parallel: tuple[int, ...] = (1,)
    ep_left_out: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = {
            "plan": self.best.to_json(),
            "alternatives": [p.to_json() for p in self.alternatives],
            "pareto": [p.to_json() for p in self.pareto],
            "candidates": self.candidates,
            "evaluated": self.evaluated,
            "profiled_on": self.profiled_on,
        }
        if self.tensor_parallel != (1,) or self.tp_left_out:
            out["tensor_parallel"] = {
                "searched": list(self.tensor_parallel),
                "left_out": {str(t): why for t, why in self.tp_left_out},
            }
        if self.expert_parallel != (1,) or self.ep_left_out:
            out["expert_parallel"] = {
                "searched": list(self.expert_parallel),
                "left_out": {str(e): why for e, why in self.ep_left_out},
            }
        return out


def master_refusal(layout: Layout) -> str:
    """Why a layout cannot train 16-bit weights beside fp32 master weights, or "": the runtime's MasterWeights
    runs under ZeRO 0 and 1, with schedules whose backward reaches autograd's gradient accumulation (not the
    split-backward ones)."""
    if layout.zero_stage not in (0, 1):
        return f"runs under ZeRO 0 or 1, not {layout.zero_stage}; plan it with --zero 1, or with bf16-mixed"
    if layout.schedule in SPLIT_BACKWARD:
        return f"does not run {layout.schedule} (its weight gradients skip autograd's accumulation); choose another"
    return ""
