"""torch 2.13's own per-rank action orders, built in one process from stub stages (the tests' oracle)."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as torch_schedules

__all__ = ["executed_order", "lowered_order", "pipeline_order"]

_COMPUTE = {"F", "B", "I", "W"}


class _StubStage:
    """Just enough of a PipelineStage to construct a schedule; records the compute it is asked to run."""

    def __init__(self, stage_index: int, num_stages: int, num_ranks: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = num_ranks
        self.group_rank = 0
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.output_chunks: list[Any] = []
        self.log: list[str] = []  # the computations
        self.steps: list[str] = []  # the computations and the receives a real stage would post

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        if not self.is_first:
            self.steps.append(f"{self.stage_index}RECV_F{mb}")
        return []

    def get_bwd_recv_ops(self, mb: int) -> list[Any]:
        if not self.is_last:
            self.steps.append(f"{self.stage_index}RECV_B{mb}")
        return []

    def get_fwd_send_ops(self, mb: int) -> list[Any]:
        return []

    get_bwd_send_ops = get_fwd_send_ops

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.log.append(f"{self.stage_index}F{mb}")
        self.steps.append(self.log[-1])

    def backward_one_chunk(self, mb: int, **kwargs: Any) -> None:
        self.log.append(f"{self.stage_index}B{mb}")
        self.steps.append(self.log[-1])

    def perform_reduce_grad(self, *args: Any) -> None:
        pass

    def clear_runtime_states(self) -> None:
        pass


def _tokens(actions: list[Any]) -> list[str]:
    """Compute actions as torch spells them ("3F0"), idle slots and REDUCE_GRAD dropped, OVERLAP_F_B
    replaced by its parts in the order the runtime runs them."""
    out: list[str] = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions is not None:
            out.extend(_tokens(list(a.sub_actions)))
        elif a.computation_type.value in _COMPUTE:
            out.append(str(a))
    return out


def _build(schedule: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Any:
    cls = torch_schedules.get_schedule_class(schedule)
    num_stages = num_ranks * stages_per_rank
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(_StubStage(0, num_stages, num_ranks), num_microbatches)
    stages = [_StubStage(i * num_ranks, num_stages, num_ranks) for i in range(stages_per_rank)]
    return cls(stages, num_microbatches)


def pipeline_order(schedule: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> list[list[str]]:
    """The schedule's `pipeline_order`, per rank; for multi-stage schedules also checked against the
    compute actions of `pipeline_order_with_comms`, the list the runtime executes."""
    sched = _build(schedule, num_ranks, num_microbatches, stages_per_rank)
    order = [_tokens(sched.pipeline_order[r]) for r in range(num_ranks)]
    if hasattr(sched, "pipeline_order_with_comms"):
        executed = [_tokens(sched.pipeline_order_with_comms[r]) for r in range(num_ranks)]
        assert executed == order, "torch's pipeline_order and pipeline_order_with_comms disagree"
    return order


def executed_order(schedule: str, num_ranks: int, num_microbatches: int, *, receives: bool = False) -> list[list[str]]:
    """For a single-stage schedule (GPipe, 1F1B), what `_step_microbatches` computes on each rank; with `receives`,
    also the receives it asks its stage for ("1RECV_F0"), in order."""
    cls = torch_schedules.get_schedule_class(schedule)
    order = []
    for rank in range(num_ranks):
        stage = _StubStage(rank, num_ranks, num_ranks)
        sched = cls(stage, num_microbatches)
        sched._initialize_stage = lambda *args, **kwargs: None  # no process group, nothing to set up
        sched._step_microbatches()
        order.append(stage.steps if receives else stage.log)
    return order


def lowered_order(schedule: str, order: list[list[tuple[int, str, int]]], stage_rank: list[int]) -> list[list[str]]:
    """torch's lowering (`_add_send_recv`) of a multi-stage schedule's compute `order` ((stage, op, micro-batch) per
    rank) with its stages placed by `stage_rank`: the order with sends and receives ("1SEND_F0", "2RECV_F0")."""
    kinds = {"F": "FORWARD", "B": "FULL_BACKWARD", "I": "BACKWARD_INPUT", "W": "BACKWARD_WEIGHT"}
    actions = {
        r: [torch_schedules._Action(s, torch_schedules._ComputationType[kinds[op]], k) for s, op, k in rank]
        for r, rank in enumerate(order)
    }
    lowered = torch_schedules._add_send_recv(actions, stage_to_rank=lambda s: stage_rank[s], num_stages=len(stage_rank))
    return [[str(a) for a in lowered[r]] for r in range(len(order))]
