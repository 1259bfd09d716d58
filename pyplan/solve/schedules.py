"""Pipeline schedules as the per-rank action orders torch runs, and their event simulation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pyplan import _core
from pyplan.errors import PlanError

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Simulation",
    "default_stages_per_rank",
    "in_flight_peaks",
    "pipeline_order",
    "simulate",
    "simulate_order",
    "stage_placement",
    "torch_rejection",
    "warmup_send_held",
]

# torch.distributed.pipelining's schedule names (`get_schedule_class`), in the C++ core's order.
SCHEDULES: tuple[str, ...] = tuple(_core.SCHEDULES)

_SINGLE_STAGE = ("GPipe", "1F1B")


class Action(NamedTuple):
    """One computation of one stage on one micro-batch.

    `op` is torch's letter: "F" forward, "B" full backward, "I" the input-gradient half of the backward,
    "W" the weight-gradient half (zero-bubble schedules split B into I and W).
    """

    stage: int
    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"  # torch's spelling: "3F0"


class Event(NamedTuple):
    """An action as simulated: which rank ran it, from `start_s` to `end_s`."""

    rank: int
    stage: int
    op: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """The simulated timeline of one pipeline iteration (forward and backward of every micro-batch).

    `peak_in_flight[s]` is the most micro-batches whose forward on stage s has ended and whose last
    backward action (B, or W) has not: activation memory of stage s scales with it. `events` are made from the
    core's tuples when first read: a refinement that reads the makespan alone simulates hundreds of schedules of
    thousands of actions each.
    """

    makespan_s: float
    busy_s: tuple[float, ...]  # [rank]
    idle_s: tuple[float, ...]  # [rank], makespan_s - busy_s
    peak_in_flight: tuple[int, ...]  # [stage]
    event_tuples: tuple[tuple[int, int, str, int, float, float], ...] = field(repr=False)  # as Event's fields

    @functools.cached_property
    def events(self) -> tuple[Event, ...]:
        """The actions as simulated, by start time, then rank."""
        return tuple(map(Event._make, self.event_tuples))

    @property
    def bubble_fraction(self) -> float:
        """Share of the ranks' time spent idle: (p−1)/(m+p−1) for a balanced GPipe or 1F1B."""
        total = self.makespan_s * len(self.busy_s)
        return sum(self.idle_s) / total if total > 0 else 0.0


def default_stages_per_rank(schedule: str) -> int:
    """1 for the single-stage schedules (GPipe, 1F1B), 2 for the others."""
    _check_name(schedule)
    return 1 if schedule in _SINGLE_STAGE else 2


def torch_rejection(schedule: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> str:
    """Why torch 2.13 refuses to build `schedule` for this shape; "" when it accepts it."""
    v = _stages_per_rank(schedule, stages_per_rank)
    return _call(_core.torch_rejection, schedule, num_ranks, num_microbatches, v)


def warmup_send_held(schedule: str, num_microbatches: int, num_stages: int, stage: int) -> bool:
    """Whether `stage` keeps one output beyond its micro-batches in flight through its peak: Schedule1F1B keeps the
    Work of its last warm-up send, with its tensor, until the steady phase ends (simulate.h)."""
    _check_name(schedule)
    return bool(_core.warmup_send_held(schedule, num_microbatches, num_stages, stage))


def stage_placement(schedule: str, num_ranks: int, stages_per_rank: int | None = None) -> list[int]:
    """[stage] -> rank: stage s on rank s mod p, or V-shaped ({r, 2p−1−r} on rank r) for ZBVZeroBubble
    and DualPipeV."""
    v = _stages_per_rank(schedule, stages_per_rank)
    return _call(_core.stage_placement, schedule, num_ranks, v)


def in_flight_peaks(
    schedule: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> list[list[tuple[int, ...]]]:
    """Per rank, the vectors of its stages' micro-batches in flight (its stages in increasing order) at which its
    activations may peak: for any bytes A_j ≥ 0 each micro-batch of stage j holds, the most the rank holds over the
    schedule's time, max_t Σ_j n_j(t)·A_j, is the largest Σ_j n_j·A_j over these (simulate.h's in_flight_peaks).
    The stages' own peaks (`Simulation.peak_in_flight`) need not coincide: Megatron-LM's 530B (p 35, v 3, m 280)
    has 70, 69 and 35 on rank 0, never more than 139 at once."""
    v = _stages_per_rank(schedule, stages_per_rank)
    peaks = _call(_core.in_flight_peaks, schedule, num_ranks, num_microbatches, v)
    return [[tuple(x) for x in rank] for rank in peaks]


def pipeline_order(
    schedule: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> list[list[Action]]:
    """Per rank, its compute actions in the order torch 2.13's schedule class runs them.

    This is torch's `pipeline_order` without its idle slots (and, for GPipe and 1F1B, the order their
    `_step_microbatches` executes). Raises PlanError, with torch's reason, for a shape torch rejects.
    """
    v = _stages_per_rank(schedule, stages_per_rank)
    order = _call(_core.schedule_order, schedule, num_ranks, num_microbatches, v)
    return [[Action(*a) for a in rank] for rank in order]


def simulate_order(
    order: Sequence[Sequence[Action | tuple[int, str, int]]],
    stage_rank: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    num_microbatches: int,
    backward_weight_s: Sequence[float] | None = None,
    send_forward_s: float | Sequence[float] = 0.0,
    send_backward_s: float | Sequence[float] = 0.0,
) -> Simulation:
    """Simulates any per-rank order (see `simulate`); `stage_rank[s]` is the rank that holds stage s."""
    actions = [[(int(a[0]), str(a[1]), int(a[2])) for a in rank] for rank in order]
    return _simulated(
        actions, stage_rank, forward_s, backward_s, num_microbatches, backward_weight_s, send_forward_s, send_backward_s
    )


def _simulated(
    actions: list[list[tuple[int, str, int]]],
    stage_rank: Sequence[int],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    num_microbatches: int,
    backward_weight_s: Sequence[float] | None,
    send_forward_s: float | Sequence[float],
    send_backward_s: float | Sequence[float],
) -> Simulation:
    """The core's simulation of `actions` (per rank, (stage, op, micro-batch) tuples)."""
    num_stages = len(forward_s)
    if backward_weight_s is None:
        if any(a[1] in ("I", "W") for rank in actions for a in rank):
            raise PlanError(
                "the order splits the backward into I and W actions: give backward_weight_s "
                "(the weight-gradient share of backward_s, per stage)"
            )
        backward_weight_s = [0.0] * num_stages
    result = _call(
        _core.simulate,
        actions,
        [int(r) for r in stage_rank],
        _floats(forward_s),
        _floats(backward_s),
        _floats(backward_weight_s),
        _per_boundary(send_forward_s, num_stages, "send_forward_s"),
        _per_boundary(send_backward_s, num_stages, "send_backward_s"),
        num_microbatches,
    )
    return Simulation(
        makespan_s=result["makespan_s"],
        busy_s=tuple(result["busy_s"]),
        idle_s=tuple(result["idle_s"]),
        peak_in_flight=tuple(result["peak_in_flight"]),
        event_tuples=tuple(result["events"]),
    )


def simulate(
    schedule: str,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    *,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    backward_weight_s: Sequence[float] | None = None,
    send_forward_s: float | Sequence[float] = 0.0,
    send_backward_s: float | Sequence[float] = 0.0,
) -> Simulation:
    """Simulates one iteration of `schedule` over len(forward_s) stages.

    forward_s[s], backward_s[s]: seconds of stage s's forward and full backward for one micro-batch.
    backward_weight_s[s]: the weight-gradient part W of backward_s[s] (the input-gradient part I is the
    rest); needed by the zero-bubble schedules, which run I and W as separate actions.
    send_forward_s, send_backward_s: seconds to send the activation from stage s to s+1 and the gradient
    back, per boundary (one value for all boundaries, or one per boundary); free between two stages on the
    same rank. The stages are spread over len(forward_s) / stages_per_rank ranks as torch places them.
    """
    v = _stages_per_rank(schedule, stages_per_rank)
    if v < 1 or len(forward_s) % v != 0:
        raise PlanError(f"{len(forward_s)} stages do not split into {v} stages per rank")
    num_ranks = len(forward_s) // v
    return _simulated(
        _call(_core.schedule_order, schedule, num_ranks, num_microbatches, v),  # `pipeline_order`'s, as tuples
        stage_placement(schedule, num_ranks, v),
        forward_s,
        backward_s,
        num_microbatches,
        backward_weight_s,
        send_forward_s,
        send_backward_s,
    )


def _stages_per_rank(schedule: str, stages_per_rank: int | None) -> int:
    return default_stages_per_rank(schedule) if stages_per_rank is None else stages_per_rank


def _check_name(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r} (known: {', '.join(SCHEDULES)})")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Calls into the core, reporting its ValueErrors (bad input, deadlocks) as PlanError."""
    try:
        return fn(*args)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _floats(values: Sequence[float]) -> list[float]:
    return [float(x) for x in values]


def _per_boundary(value: float | Sequence[float], num_stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * max(num_stages - 1, 0)
    values = _floats(value)
    if len(values) != num_stages - 1:
        raise PlanError(f"{name} has {len(values)} entries for {num_stages - 1} stage boundaries")
    return values
