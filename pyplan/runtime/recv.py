"""Receive buffers held while the schedule needs them: allocated when a receive is posted, dropped once consumed.

torch 2.13's PipelineStage allocates a stage's input and output-gradient receive buffers for every micro-batch
when the schedule is prepared (`_setup_forward_recv_info`, `_setup_backward_recv_info` in
torch/distributed/pipelining/stage.py) and keeps them for its life: m of each, where a pipeline needs only those
in flight (Megatron-LM makes each receive's tensor when it posts the receive: `_communicate` in
megatron/core/pipeline_parallel/p2p_communication.py, commit 2fd6e2b7). `LeanStage` keeps torch's receive
descriptors (`_RecvInfo`) without their tensors, allocates a tensor when torch asks for the receive's op, and
drops its own references when torch reads the received value: an input becomes the stage's input and lives as
long as the backward needs it, an output gradient as long as the backward reads it.

The multi-stage schedules post their receives where the order torch lowers from its `pipeline_order` puts them, an
order padded with idle slots that pyplan does not model. `lower_receives` gives such a schedule pyplan's lowering
of the same compute order (`_core.lower_order`: torch's own `_add_send_recv` over the order without idle slots,
cpp/include/pyplan/simulate.h), so the runtime holds what the plan counts (`_core.receive_buffers`).

Every call into torch's private pipelining API is in this module.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import _make_tensor_from_meta
from torch.distributed.pipelining.stage import _RecvInfo

from pyplan import _core

__all__ = ["GRADIENT", "INPUT", "Held", "LeanStage", "ReceiveLedger", "lower_receives", "lowers_receives"]

INPUT = "input"  # a stage's input, received from the previous stage
GRADIENT = "gradient"  # the gradient of a stage's output, received from (or handed over by) the next stage


@dataclass
class Held:
    """Receive buffers of one stage and kind: how many, and their bytes."""

    count: int = 0
    nbytes: int = 0


@dataclass
class ReceiveLedger:
    """The receive buffers alive on this rank by (stage, kind), and the most alive when a computation starts.

    A buffer counts from its allocation until its tensor is freed (a weak reference's finalizer, which runs in
    whichever thread frees it: hence the lock). Peaks are sampled at the start of every forward and backward
    computation on the rank, where the memory they add to is in use; `count` and `nbytes` peak independently.
    """

    live: dict[tuple[int, str], Held] = field(default_factory=dict)
    peak: dict[tuple[int, str], Held] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hold(self, stage: int, kind: str, tensor: torch.Tensor) -> None:
        key = (stage, kind)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            held = self.live.setdefault(key, Held())
            held.count += 1
            held.nbytes += nbytes
        weakref.finalize(tensor, self._drop, key, nbytes).atexit = False

    def _drop(self, key: tuple[int, str], nbytes: int) -> None:
        with self._lock:
            held = self.live[key]
            held.count -= 1
            held.nbytes -= nbytes

    def sample(self) -> None:
        with self._lock:
            for key, held in self.live.items():
                peak = self.peak.setdefault(key, Held())
                peak.count = max(peak.count, held.count)
                peak.nbytes = max(peak.nbytes, held.nbytes)


def _unallocated(info: _RecvInfo) -> _RecvInfo:
    """The same receive, without its tensor."""
    return _RecvInfo(info.input_name, info.source, None, info.tensor_meta, is_root_arg=info.is_root_arg)


class LeanStage(PipelineStage):
    """torch's PipelineStage whose receive buffers exist from the posting of their receive until consumed.

    An unallocated receive is a `_RecvInfo` with its tensor metadata and no buffer (torch's own buffer-less
    receives, of values that carry no gradient, have neither); every path of torch's stage that reads a buffer
    runs after the receive's op was asked for or a same-rank neighbour handed the value over.
    """

    def __init__(self, *args: Any, ledger: ReceiveLedger, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = ledger
        # The ops handed to the schedule per (kind, micro-batch): emptied once their value is read, since the
        # schedule keeps its list of them in a local variable until its next receive (Schedule1F1B).
        self._posted: dict[tuple[str, int], list[dist.P2POp]] = {}

    # ---- receive descriptors without tensors ------------------------------------------------------------

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        # torch's descriptors for one micro-batch (one buffer, dropped here), copied for each.
        super()._setup_forward_recv_info(1, has_backward)
        first = self.args_recv_info[0]
        for k in range(num_microbatches):
            self.args_recv_info[k] = tuple(_unallocated(info) for info in first)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[_RecvInfo, ...]:
        return tuple(_unallocated(info) for info in super()._create_grad_recv_info(act_send_info))

    # ---- allocated when the receive is posted --------------------------------------------------------------

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._allocate(self.args_recv_info[fwd_chunk_id], INPUT)
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self._posted[(INPUT, fwd_chunk_id)] = ops
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if not self.has_backward or self.is_last:
            return []
        self._allocate(self.grad_recv_info[bwd_chunk_id], GRADIENT)
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self._posted[(GRADIENT, bwd_chunk_id)] = ops
        return ops

    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        # torch zeroes the preallocated buffer of a gradient the next stage did not make; here it is made.
        infos = self.grad_recv_info[mb_index]
        filled = tuple(
            _make_tensor_from_meta(info.tensor_meta, self.device).zero_()
            if grad is None and info.tensor_meta is not None
            else grad
            for info, grad in zip(infos, next_stage_bwd_outputs, strict=True)
        )
        super().set_local_bwd_input(filled, mb_index)
        for info in infos:
            if info.buffer is not None:
                self.ledger.hold(self.stage_index, GRADIENT, info.buffer)

    def _allocate(self, infos: Sequence[_RecvInfo], kind: str) -> None:
        for info in infos:
            if info.is_root_arg or info.tensor_meta is None or info.buffer is not None:
                continue
            info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
            self.ledger.hold(self.stage_index, kind, info.buffer)

    # ---- dropped once read --------------------------------------------------------------------------------

    def _retrieve_recv_activations(self, fwd_chunk_id: int) -> tuple[Any, ...]:
        activations = super()._retrieve_recv_activations(fwd_chunk_id)
        self._release(self.args_recv_info[fwd_chunk_id], (INPUT, fwd_chunk_id))
        return activations

    def _retrieve_recv_grads(self, bwd_chunk_id: int) -> tuple[Any, ...]:
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        self._release(self.grad_recv_info[bwd_chunk_id], (GRADIENT, bwd_chunk_id))
        return grads

    def _release(self, infos: Sequence[_RecvInfo], posted: tuple[str, int]) -> None:
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None
        # The receive has completed (torch waited on it before reading): its op keeps no tensor alive.
        for op in self._posted.pop(posted, ()):
            op.tensor = torch.empty(0, device=op.tensor.device)

    # ---- peaks sampled where computation starts -----------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.ledger.sample()
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        self.ledger.sample()
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        # The schedule keeps each loss to the step's end and hands it to the caller: with its graph, whose nodes
        # lead to the stage's input (a leaf's AccumulateGrad holds it), that kept every input of the last stage
        # alive. The split backward's input half detaches it already.
        if isinstance(loss, torch.Tensor) and not loss._is_view():
            loss.detach_()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        self.ledger.sample()
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


# The lowered order's steps as torch's action types.
_STEPS = {
    ("compute", "F"): torch_schedules._ComputationType.FORWARD,
    ("compute", "B"): torch_schedules._ComputationType.FULL_BACKWARD,
    ("compute", "I"): torch_schedules._ComputationType.BACKWARD_INPUT,
    ("compute", "W"): torch_schedules._ComputationType.BACKWARD_WEIGHT,
    ("send", "F"): torch_schedules._ComputationType.SEND_F,
    ("receive", "F"): torch_schedules._ComputationType.RECV_F,
    ("send", "B"): torch_schedules._ComputationType.SEND_B,
    ("receive", "B"): torch_schedules._ComputationType.RECV_B,
}


def lowers_receives(schedule: Any) -> bool:
    """Whether `schedule` runs an order of explicit sends and receives (the multi-stage schedules), which
    `lower_receives` replaces; GPipe and 1F1B post each receive just before the computation that reads it."""
    return isinstance(schedule, torch_schedules._PipelineScheduleRuntime)


def lower_receives(schedule: Any, name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> None:
    """Run `schedule` (torch's class for the schedule `name`) on pyplan's lowered order: its compute order with
    the sends and receives `_core.lower_order` places, then torch's own passes for FSDP2's unshard and reshard and
    the gradient reduction after each stage's last backward (as `_prepare_schedule_with_comms` adds them)."""
    lowered = _core.lower_order(name, num_ranks, num_microbatches, stages_per_rank)
    actions: dict[int, list[Any]] = {}
    for rank, steps in enumerate(lowered):
        order = [torch_schedules._Action(stage, _STEPS[(step, op)], k) for step, stage, op, k in steps]
        order = torch_schedules._add_unshard_reshard(order)
        actions[rank] = torch_schedules._add_reduce_grad(order, num_microbatches)
    schedule._prepare_schedule_with_comms(actions, format="compute_comms")
