"""Build and run a planned pipeline under torchrun: device mesh, stages, data parallelism, schedule, step.

Terms: a *rank* is one process (one GPU); the mesh has a "dp" axis (replicas) and a "pp" axis (pipeline ranks).
With placement "pp-inner" the ranks of one pipeline are consecutive (mesh shape (dp, pp), row-major); with
"dp-inner" the replicas of one stage are (mesh shape (pp, dp)). With tensor parallelism a "tp" axis is the
innermost: the GPUs that split a layer are consecutive ranks, inside a node (mesh shape (dp, pp, tp) or
(pp, dp, tp)).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from pyplan.errors import PlanError
from pyplan.graph.experts import expert_leaves, find_expert_layers
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.tensor_parallel import derive_tp_plan, restrict_tp_plan, vocab_parallel_loss
from pyplan.graph.trace import ExampleInputs, LeafSpec, inputs_at, trace
from pyplan.plan import SPLIT_BACKWARD, Layout, master_refusal
from pyplan.runtime.affinity import pin_rank
from pyplan.runtime.clip import clip_gradients
from pyplan.runtime.experts import ExpertShards, apply_expert_parallel, expert_groups, expert_refusal
from pyplan.runtime.heap import keep_freed_memory
from pyplan.runtime.master import MasterWeights
from pyplan.runtime.optim import OptimizerFactory, OptimizerSpec, optimizer_factory
from pyplan.runtime.recv import LeanStage, ReceiveLedger, lower_receives, lowers_receives
from pyplan.runtime.sharded import ShardedTrainer, build_sharded_trainer
from pyplan.runtime.stages import check_span, cut_model, local_stages, stage_io, tied_parameters
from pyplan.runtime.tensor_parallel import (
    VocabParallelLoss,
    Zero1Optimizer,
    apply_tensor_parallel,
    grad_norm_weight,
    own_values,
    sync_gradients,
)
from pyplan.runtime.units import remat_kind
from pyplan.solve.schedules import stage_placement
from pyplan.spec import ModelSpec, default_loss, upcasts_itself

with warnings.catch_warnings():
    # torch.distributed.optim scripts its functional optimizers with torch.jit.script when imported, which
    # torch 2.13 deprecates with a warning on every import.
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = [
    "OptimizerFactory",
    "OptimizerSpec",
    "PipelineTrainer",
    "build_mesh",
    "build_trainer",
    "optimizer_factory",
    "replica_slice",
]

# Precisions whose stages hold 16-bit weights beside fp32 master weights in the optimizer (MasterWeights): the
# weights' dtype and the gradients'.
_MASTER = {
    "bf16-master": (torch.bfloat16, torch.float32),
    "bf16-master-bf16-grads": (torch.bfloat16, torch.bfloat16),
}
_AUTOCAST = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, **dict.fromkeys(_MASTER)}


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The (dp, pp) mesh over the world, laid out by the layout's placement, with the tp axis innermost when the
    layout splits layers."""
    world = dist.get_world_size()
    if world != layout.num_gpus:
        tp = f" x tp {layout.tp}" if layout.tp > 1 else ""
        raise PlanError(
            f"the plan needs {layout.num_gpus} processes (dp {layout.dp}{tp} x pp {layout.pp}), got {world}"
        )
    names = ("dp", "pp") if layout.placement == "pp-inner" else ("pp", "dp")
    sizes = {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp}
    if layout.tp > 1:
        names = (*names, "tp")
    return init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)


def replica_slice(layout: Layout, dp_rank: int) -> slice:
    """The samples of the global batch that replica `dp_rank` trains on."""
    per_replica = layout.num_microbatches * layout.micro_batch_size
    return slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)


@dataclass
class PipelineTrainer:
    """One rank's share of a planned pipeline: its stages, optimizer and schedule."""

    layout: Layout
    mesh: DeviceMesh
    stage_indices: list[int]
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    schedule: Any
    device: torch.device
    # Per tied weight held on several pipeline ranks: this rank's copy, the group of the ranks holding one, and
    # whether this rank is the first of them (the copy that counts once in the gradient's norm).
    tied_groups: list[tuple[list[nn.Parameter], dist.ProcessGroup, bool]] = field(default_factory=list)
    manual_grads: bool = False
    # Zero the gradients in place instead of freeing them: DDP's gradients are views into its buckets, and freed
    # ones come back as new tensors that DDP copies into the buckets, two copies at the step's peak (gpt-tiny,
    # 2 x 1: 4.21 MB freed, 3.73 MB in place, as a single process trains).
    zero_in_place: bool = False
    grad_norm: float = float("nan")  # the gradient's norm at the last step that clipped
    experts: ExpertShards | None = None  # this rank's slices of the experts under expert parallelism
    input_dtype: torch.dtype | None = None  # floating inputs cast to the stages' 16-bit weights' dtype
    # The receive buffers this rank's stages hold, and the most held (pyplan/runtime/recv.py).
    receives: ReceiveLedger = field(default_factory=ReceiveLedger)

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_indices

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by their names in the original model, as full tensors."""
        out: dict[str, torch.Tensor] = {}
        for mod in self.modules:
            inner = mod.module if isinstance(mod, DistributedDataParallel) else mod
            for name, p in inner.piece.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                out[name] = full.detach()
        return out

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under every name they have in the original model (a
        weight tied inside a stage under both), as the stages hold them (DTensor shards under ZeRO-3)."""
        out: dict[str, torch.Tensor] = {}
        for mod in self.modules:
            inner = mod.module if isinstance(mod, DistributedDataParallel) else mod
            out.update(inner.piece.state_dict(keep_vars=True))
        return out

    def _clipped_gradients(self) -> list[tuple[torch.Tensor, float]]:
        """Each gradient of this rank once, with its weight in the norm over the world (`clip_gradients`)."""
        later = {id(p) for params, _, first in self.tied_groups if not first for p in params}
        spread = self.experts.norm_factor if self.experts is not None else lambda p: 1.0
        return [(g, 0.0 if id(p) in later else self._norm_weight(g) * spread(p)) for p, g in self._gradients()]

    def _gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Each parameter of this rank once with its gradient, where it has one: the fp32 one beside 16-bit
        weights (MasterWeights)."""
        if isinstance(self.optimizer, MasterWeights):
            return self.optimizer.gradients()
        return [(p, p.grad) for p in _unique_parameters(self.modules) if p.grad is not None]

    def _norm_weight(self, g: torch.Tensor) -> float:
        """The weight of a gradient's local square in the norm over the world: the ranks holding the same values
        count once (a DTensor's replicated axes, `grad_norm_weight`), and every replica holds what a mesh without
        the dp axis holds (ZeRO-3's shards are on the dp axis, tensor parallelism's beside it)."""
        if not isinstance(g, DTensor):
            return 1.0 / (self.layout.dp * self.layout.tp)
        return grad_norm_weight(g) / (1 if "dp" in (g.device_mesh.mesh_dim_names or ()) else self.layout.dp)

    def step(
        self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None, max_norm: float | None = None
    ) -> list[torch.Tensor]:
        """One optimizer step on this replica's samples, the gradient clipped to `max_norm` if given (its norm
        before clipping in `grad_norm`); returns the per-micro-batch losses on the last stage."""
        self.optimizer.zero_grad(set_to_none=not self.zero_in_place)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.has_last:
            if target is None:
                # torch splits a target into micro-batches: an empty one per sample, which a model's own loss and
                # default_loss (zeros) ignore.
                samples = self.layout.micro_batch_size * self.layout.num_microbatches
                target = torch.empty(samples, 0)
            kwargs = {"target": target.to(self.device), "losses": losses}
        args = tuple(_input(t, self.device, self.input_dtype) for t in inputs) if self.has_first else ()
        # return_outputs=False: by default the last stage keeps every micro-batch's output and concatenates them
        # (2·m outputs alive at the end of the step, the logits of a language model); only the losses are needed.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self._finish_gradients()
        if max_norm is not None:
            self.grad_norm = clip_gradients(self._clipped_gradients(), max_norm)
        self.optimizer.step()
        return losses

    def _finish_gradients(self) -> None:
        if self.experts is not None:
            self.experts.reduce_gradients()  # over the replicas holding the same experts (runtime/experts.py)
        params = _unique_parameters(self.modules)
        if self.layout.tp > 1:
            sync_gradients(params)  # each gradient in its parameter's layout (pyplan/runtime/tensor_parallel.py)
        master = self.optimizer if isinstance(self.optimizer, MasterWeights) else None
        if master is not None:
            # Summed over the replicas while the backward ran (MasterWeights' buckets), or beside tensor parallelism
            # after it, once each gradient has its parameter's layout; the mean over micro-batches and replicas.
            master.reduce_gradients()
            if self.layout.tp > 1:
                master.place()
            for _, g in master.gradients():
                local = own_values(g)
                if self.layout.tp > 1 and self.layout.dp > 1:
                    dist.all_reduce(local, group=self.mesh["dp"].get_group())
                local.div_(self.layout.dp * self.layout.num_microbatches)
        elif self.manual_grads:
            # Mean over micro-batches and replicas, once per parameter (see build_trainer).
            group = self.mesh["dp"].get_group()
            for p in params:
                if p.grad is None:
                    continue
                local = own_values(p.grad)
                if self.layout.dp > 1:
                    dist.all_reduce(local, group=group)
                local.div_(self.layout.dp * self.layout.num_microbatches)
        for tied, group, _ in self.tied_groups:
            for p in tied:
                # Every member must join the collective, with zeros if its copy got no gradient.
                if master is not None:
                    dist.all_reduce(master.main_grad(p, create=True), group=group)
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(own_values(p.grad), group=group)


def _tied_groups(
    layout: Layout, mesh: DeviceMesh, stage_params: dict[int, dict[str, nn.Parameter]], tied: list[Any]
) -> list[tuple[list[nn.Parameter], dist.ProcessGroup, bool]]:
    """A process group per tied parameter, replica and tensor-parallel rank, over the ranks holding its stages;
    every rank creates every group in the same order (new_group is collective), and keeps the ones it belongs
    to."""
    placement = stage_placement(layout.schedule, layout.pp, layout.stages_per_rank)
    ranks = mesh.mesh  # [dp, pp] or [pp, dp] tensor of global ranks, [..., tp] with tensor parallelism
    if layout.tp == 1:
        ranks = ranks.unsqueeze(-1)
    me = dist.get_rank()
    groups = []
    for t in tied:
        pp_ranks = sorted({placement[s] for s in t.stages})
        if len(pp_ranks) < 2:
            continue
        for d, j in itertools.product(range(layout.dp), range(layout.tp)):
            members = [int(ranks[d, r, j] if layout.placement == "pp-inner" else ranks[r, d, j]) for r in pp_ranks]
            group = dist.new_group(members)
            if me in members:
                # One copy per rank: a rank holding two of the stages holds one Parameter for both.
                params = [stage_params[s][name] for s, name in t.names.items() if s in stage_params]
                groups.append((params[:1], group, me == members[0]))
    return groups


def build_trainer(
    spec: ModelSpec,
    model: nn.Module,
    layout: Layout,
    make_optimizer: OptimizerFactory,
    *,
    device: torch.device | None = None,
    leaf_modules: Iterable[LeafSpec] = (),
    example_inputs: ExampleInputs | None = None,
    precision: str = "fp32",
) -> PipelineTrainer | ShardedTrainer:
    """This rank's stages of `model` cut by `layout`, wrapped for data parallelism, with the planned schedule.

    Call on every rank after `dist.init_process_group`, with the same model (same seed) everywhere.
    `precision` "bf16-mixed" or "fp16-mixed" runs every stage under autocast, weights and optimizer in fp32; a plan
    of one stage under ZeRO-3 runs FSDP2's mixed-precision policy instead (pyplan/runtime/sharded.py).
    "bf16-master" holds bf16 weights, fp32 gradients and fp32 master weights in the optimizer
    (pyplan/runtime/master.py), under ZeRO 0 or 1; "bf16-master-bf16-grads" the same with bf16 gradients.
    """
    device = device or torch.device("cpu")
    if layout.tp > 1 and layout.zero_stage == 3 and layout.num_stages > 1:
        raise PlanError(
            "ZeRO-3 beside tensor parallelism runs without pipeline stages; plan it with one stage, or ZeRO-1"
        )
    # The split-backward schedules' autograd.grad skips DDP's and FSDP2's hooks (torch issue #144530,
    # TORCH_FACTS.md): gradients are averaged over dp by hand after the step, and ZeRO-3 is refused.
    if layout.zero_stage == 3 and layout.schedule in SPLIT_BACKWARD:
        raise PlanError(
            f"{layout.schedule} with ZeRO-3 trains wrong weights on torch 2.13 (FSDP2 misses its weight "
            "gradients); choose another schedule or ZeRO stage"
        )
    if precision not in _AUTOCAST:
        raise PlanError(f"unknown precision '{precision}'; choose one of {', '.join(_AUTOCAST)}")
    if expert_refusal(layout, precision):
        raise PlanError(f"expert parallelism {expert_refusal(layout, precision)}")
    if precision in _MASTER:
        refused = master_refusal(layout)
        if refused:
            raise PlanError(f"{precision} {refused}")
    examples = example_inputs if example_inputs is not None else spec.example_inputs
    trainer: PipelineTrainer | ShardedTrainer
    if layout.zero_stage == 3 and layout.num_stages == 1 and layout.dp > 1:
        # ZeRO-3 as FSDP runs it, on the model's own modules (pyplan/runtime/sharded.py).
        if remat_kind(layout) == "other":
            raise PlanError(
                "ZeRO-3 without pipeline stages trains the model's own modules: it checkpoints every unit or none, "
                "not nested checkpoints or offloading; plan it with pyplan, or with ZeRO-1"
            )
        # The plan checked against the model before the world, as cut_model checks a pipeline's.
        graph = trace(model, examples, leaf_modules=leaf_modules, batch_size=layout.micro_batch_size)
        check_span(graph, layout)
        mesh = build_mesh(layout, device.type)
        loss_fn = spec.loss or default_loss
        if layout.tp > 1:  # the traced model split over the tp axis, sharded piece by piece
            loss_fn = _split_layers(graph, layout=layout, mesh=mesh, loss=spec.loss)
        trainer = build_sharded_trainer(
            model,
            layout,
            mesh,
            make_optimizer,
            examples,
            device,
            loss_fn,
            _AUTOCAST[precision],
            graph if layout.tp > 1 else None,
        )
    else:
        trainer = _pipeline_trainer(
            spec, model, layout, make_optimizer, device, tuple(leaf_modules), examples, precision
        )
    if device.type == "cpu":
        keep_freed_memory()  # a step reuses what the last one freed, without page faults (pyplan/runtime/heap.py)
        pin_rank()  # unless PYPLAN_PIN_CPUS=0; after the process groups, so that gloo's threads move too
    return trainer


def _pipeline_trainer(
    spec: ModelSpec,
    model: nn.Module,
    layout: Layout,
    make_optimizer: OptimizerFactory,
    device: torch.device,
    leaf_modules: tuple[LeafSpec, ...],
    examples: ExampleInputs,
    precision: str,
) -> PipelineTrainer:
    """The pipeline's stages on this rank, each under DDP or FSDP2 over the replicas, their optimizer and schedule.
    The plan is checked against the model (cut_model) before the world: a plan for another model fails the same
    anywhere."""
    split_backward = layout.schedule in SPLIT_BACKWARD
    weights, grads = _MASTER.get(precision, (None, None))
    # Tensor parallelism splits the traced graph before it is cut, over the mesh's tp axis: the mesh comes first.
    mesh = build_mesh(layout, device.type) if layout.tp > 1 else None
    losses: list[Any] = []  # the loss the split model trains with (_split_layers)
    # Expert parallelism cuts the capture that keeps each MoE layer's experts whole (pyplan/graph/experts.py).
    expert_paths = expert_leaves(model) if layout.ep > 1 else ()
    chain, stages = cut_model(
        model,
        examples,
        layout,
        leaf_modules=(*leaf_modules, *expert_paths),
        copy_shared_outputs=split_backward,
        autocast_dtype=_AUTOCAST[precision],
        transform=functools.partial(_split_layers, layout=layout, mesh=mesh, loss=spec.loss, found=losses)
        if mesh is not None
        else None,
    )
    mesh = mesh or build_mesh(layout, device.type)
    mine = local_stages(layout, mesh["pp"].get_local_rank())
    io = stage_io(stages, inputs_at(examples, layout.micro_batch_size))
    tied = tied_parameters(stages)
    stage_params = {s: dict(stages[s].piece.named_parameters()) for s in mine}
    tied_groups = _tied_groups(layout, mesh, stage_params, tied)
    if tied and layout.zero_stage == 3:
        raise PlanError("tied parameters across pipeline stages are not supported with ZeRO-3 yet; use ZeRO 0-1")
    # Gradients are averaged by hand, not by DDP and torch's per-stage scaling, when the split-backward schedules
    # bypass DDP's hooks, or when two stages on this rank share a parameter (each stage would scale it, and each
    # DDP would reduce it).
    shared = len(_unique_parameters(stages[s] for s in mine)) < sum(len(list(stages[s].parameters())) for s in mine)
    # DDP takes no DTensor parameters: with tensor parallelism the replicas' gradients are averaged by hand too;
    # and 16-bit weights' fp32 gradients are not the parameters' own (MasterWeights).
    manual_grads = split_backward or shared or layout.tp > 1 or weights is not None
    experts = (
        apply_expert_parallel(
            [stages[s] for s in mine],
            find_expert_layers(chain.graph).layers,
            chain.graph.module,
            expert_groups(mesh, layout.ep),
            shared_parameters=shared,
        )
        if layout.ep > 1
        else None
    )
    if manual_grads and layout.zero_stage == 3 and layout.dp > 1:
        raise PlanError("stages sharing parameters on one rank are not supported with ZeRO-3 yet; use ZeRO 0-1")
    modules = [_data_parallel(stages[s].to(device, weights), layout, mesh, manual_grads) for s in mine]
    # Receive buffers allocated as receives are posted and dropped once read, not m of each for the stage's life.
    receives = ReceiveLedger()
    pipeline_stages = [
        LeanStage(
            module,
            s,
            layout.num_stages,
            device,
            input_args=tuple(_example(t, weights) for t in io[s][0]),
            output_args=tuple(_example(t, weights) for t in io[s][1]),
            group=mesh["pp"].get_group(),
            ledger=receives,
        )
        for s, module in zip(mine, modules)
    ]
    params, dp_group = _unique_parameters(modules), mesh["dp"].get_group()
    optimizer = (
        _master_weights(params, modules, layout, make_optimizer, dp_group, grads or torch.float32)
        if weights is not None
        else _optimizer(params, layout, make_optimizer, dp_group)
    )
    cls = get_schedule_class(layout.schedule)
    stage_arg = pipeline_stages[0] if issubclass(cls, PipelineScheduleSingle) else pipeline_stages
    loss_fn = losses[0] if losses else spec.loss or default_loss
    if weights is not None:
        loss_fn = _in_fp32(loss_fn)
    schedule = cls(stage_arg, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=not manual_grads)
    if lowers_receives(schedule):  # its receives posted where the plan counts them
        lower_receives(schedule, layout.schedule, layout.pp, layout.num_microbatches, layout.stages_per_rank)
    # Gradients kept in place between steps where the plan counts them held (DDP's buckets; the fp32 gradients of
    # 16-bit weights over replicas, as Megatron-LM's buffers), freed on one replica.
    in_place = any(isinstance(m, DistributedDataParallel) for m in modules) or (weights is not None and layout.dp > 1)
    return PipelineTrainer(
        layout,
        mesh,
        mine,
        modules,
        optimizer,
        schedule,
        device,
        tied_groups,
        manual_grads,
        in_place,
        experts=experts,
        input_dtype=weights,
        receives=receives,
    )


def _master_weights(
    params: list[nn.Parameter],
    modules: list[nn.Module],
    layout: Layout,
    make_optimizer: OptimizerFactory,
    dp_group: dist.ProcessGroup,
    grads: torch.dtype,
) -> MasterWeights:
    """The optimizer of 16-bit weights: fp32 master weights, sharded over the replicas under ZeRO-1, with the
    gradients in `grads`, summed over the replicas while the backward runs: each once it has had its accumulations
    of a step, one per micro-batch of each of this rank's stages that holds it."""
    if not isinstance(make_optimizer, OptimizerSpec):
        raise PlanError("16-bit weights train through master weights: give the optimizer as an OptimizerSpec")
    held = [{id(p) for p in m.parameters()} for m in modules]
    accumulations = [layout.num_microbatches * sum(id(p) in h for h in held) for p in params]
    group = dp_group if layout.dp > 1 and layout.zero_stage == 1 else None
    replicas = dp_group if layout.dp > 1 and layout.tp == 1 else None  # buckets of plain tensors, not DTensors
    return MasterWeights(
        params, make_optimizer, group, grad_dtype=grads, replicas=replicas, accumulations=accumulations
    )


def _in_fp32(loss: Any) -> Any:
    """`loss` on the last stage's output in fp32 (16-bit logits' cross-entropy loses digits; Megatron-LM casts
    them too), unless it computes in fp32 by itself (`upcasts_itself`: pyplan's cross-entropy takes the 16-bit
    logits). Under autocast the schedule computes the loss outside the stage's autocast region, on the 16-bit
    logits as they come."""
    if upcasts_itself(loss):
        return loss

    def fp32_loss(output: Any, target: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            output = output.float()
        return loss(output, target)

    return fp32_loss


def _input(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """An input as the first stage takes it: on its device, floating values in the weights' dtype."""
    if dtype is not None and t.is_floating_point():
        return t.to(device, dtype).contiguous()
    return t.to(device).contiguous()


def _split_layers(
    graph: LayerGraph, *, layout: Layout, mesh: DeviceMesh, loss: Any, found: list[Any] | None = None
) -> Any:
    """Split the traced model's layers over the mesh's tp axis as the plan says (its `tp_plan`, which must be what
    pyplan derives from this model's graph at that degree); the loss to train with (also appended to `found`): on
    each rank's slice of the vocabulary where it applies (`vocab_parallel_loss`, as the plan prices it), else
    `loss` (or the default) on the logits gathered whole."""
    plan = restrict_tp_plan(derive_tp_plan(graph), layout.tp_plan, graph)
    if plan.styles(layout.tp) != layout.tp_plan:
        missing = sorted(set(layout.tp_plan) - set(plan.styles(layout.tp)))
        raise PlanError(
            f"the plan's tp_plan does not split this model at tp {layout.tp} ({', '.join(missing[:3])}); "
            "was the plan made for another model?"
        )
    vocab = vocab_parallel_loss(graph, plan, layout.tp, loss)
    apply_tensor_parallel(graph, plan, mesh["tp"], sequence_parallel=layout.sequence_parallel, vocab_parallel=vocab)
    loss_fn = VocabParallelLoss(mesh["tp"]) if vocab else loss or default_loss
    if found is not None:
        found.append(loss_fn)
    return loss_fn


def _data_parallel(module: nn.Module, layout: Layout, mesh: DeviceMesh, manual_grads: bool) -> nn.Module:
    """A stage as its replicas train it: sharded by FSDP2 under ZeRO-3, else under DDP unless its gradients are
    averaged by hand."""
    if layout.dp > 1 and layout.zero_stage == 3:
        fully_shard(module, mesh=mesh["dp"])
    elif layout.dp > 1 and not manual_grads:
        # Gradients as views into DDP's all-reduce buckets: one copy of the gradients, as the plan counts
        # (the default keeps the buckets beside the gradients: 4 more bytes per fp32 parameter).
        module = DistributedDataParallel(module, process_group=mesh["dp"].get_group(), gradient_as_bucket_view=True)
    return module


def _optimizer(
    params: list[nn.Parameter], layout: Layout, make_optimizer: OptimizerFactory, dp_group: dist.ProcessGroup
) -> torch.optim.Optimizer:
    """The optimizer over this rank's parameters: ZeRO-1 shards its state over the replicas (torch's
    ZeroRedundancyOptimizer; `Zero1Optimizer` for the DTensors of tensor parallelism, which it cannot broadcast)."""
    if not (layout.dp > 1 and layout.zero_stage == 1):
        return make_optimizer(params)
    if not isinstance(make_optimizer, OptimizerSpec):
        raise PlanError("ZeRO-1 shards the optimizer: give it as an OptimizerSpec(class, kwargs)")
    if layout.tp > 1:
        return Zero1Optimizer(params, make_optimizer, dp_group)
    return ZeroRedundancyOptimizer(
        params, optimizer_class=make_optimizer.cls, process_group=dp_group, **make_optimizer.kwargs
    )


def _example(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` as PipelineStage's example of a micro-batch: on the meta device, with the strides of a new contiguous
    tensor. Meta: torch up to 2.11 keeps the examples it is given for the life of the stage, and a language model's
    last stage was given a micro-batch of logits (gpt2-small on an H200: 206 MB a sample beyond the plan). Strides:
    the micro-batches that step() splits off a contiguous batch have them, and is_contiguous ignores the stride of a
    size-1 dimension (a (1, T) row cut from a (1, T + 1) draw keeps stride T + 1), while PipelineStage compares
    strides exactly on torch 2.11 (seen on an H200: gpt2-small at micro-batch 1, "stride mismatch: expected
    (1025, 1) actual (1024, 1)")."""
    floating = dtype is not None and t.is_floating_point()
    return t.to("meta", dtype if floating else t.dtype).clone(memory_format=torch.contiguous_format)


def _unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Every parameter once, though two stages on one rank may share one (tied embeddings)."""
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())
