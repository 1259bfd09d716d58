"""Capture and profile a model once, for a cluster's GPU: `chain_for` traces and linearizes it, then times its
blocks (measured on this machine for `local`, an analytic roofline for a catalog GPU), their saved bytes and
working memory, every profiler reading the same example inputs (`Examples`); `add_loss` folds the loss in."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pyplan._torch import is_meta_module, one_value_per_channel
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import linearize
from pyplan.graph.sequence_parallel import SequenceZone
from pyplan.graph.tensor_parallel import TpPlan
from pyplan.graph.trace import ExampleInputs, Examples, LeafSpec, call_at, trace
from pyplan.hardware.catalog import GPU, LOCAL
from pyplan.hardware.cluster import Cluster
from pyplan.model_state import AUTOCAST_PRECISIONS, COMPUTE_DTYPES
from pyplan.plan import Workload
from pyplan.profile import default_batch_sizes, measured_batch_sizes, profile, sizes_from_two
from pyplan.profile.analytic import Roofline, analytic_blocks
from pyplan.profile.attention import AttentionTarget, TargetKernels
from pyplan.profile.autocast import NoKernelInDtype
from pyplan.profile.cache import ProfileCache, ProfileKey, analytic_target, measured_target
from pyplan.profile.loss import LossCost, LossFn, TargetFn, loss_cost, with_loss
from pyplan.profile.measure import TimingOptions, local_device
from pyplan.profile.pieces import RepeatedBlocks
from pyplan.profile.remat import remat_bytes
from pyplan.profile.tensor_parallel import collective_bytes, collective_times, local_chain

__all__ = ["add_loss", "chain_for", "is_local", "pricing", "timing_options"]

# The catalog peak each precision computes at.
_PEAK_OF = {
    "bf16-mixed": "bf16",
    "fp16-mixed": "fp16",
    "fp32": "fp32",
    "bf16-master": "bf16",
    "bf16-master-bf16-grads": "bf16",
}


def pricing(gpu: GPU, roofline: Roofline | None) -> Roofline | None:
    """The roofline that prices a block's ops for the share of its forward a selective recomputation takes: the
    analytic profile's, else the calibrated local device's (None where it is not calibrated: a nominal one)."""
    if roofline is not None:
        return roofline
    try:
        return Roofline.from_gpu(gpu)
    except PlanError:
        return None


def is_local(gpu: GPU) -> bool:
    return gpu.name == LOCAL


def timing_options(cluster: Cluster) -> TimingOptions:
    """How `chain_for` times a model on this machine for `cluster`: on the CPU, beside as many companion processes
    as the cluster places other ranks on one machine, up to the cores beside the timed one (see
    pyplan/profile/measure.py); on CUDA alone."""
    base = TimingOptions()
    if local_device().type != "cpu":
        return base
    ranks = max(g.gpus_per_node for g in cluster.groups)
    cores = max(1, (os.cpu_count() or 1) // base.threads)
    return replace(base, corun=max(0, min(ranks, cores) - 1))


def chain_for(
    model: nn.Module,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    *,
    leaf_modules: Iterable[LeafSpec] = (),
    min_blocks: int = 16,
    max_blocks: int = 128,
    cache: ProfileCache | None = None,
    autocast: bool = True,
) -> tuple[Chain, str]:
    """Trace, linearize and profile `model` for the cluster's GPU: measured on this machine for `local`,
    analytic (a roofline over the recorded ops) for a catalog GPU. Returns the chain and how it was timed.

    With `cache`, a profile made before for the same model, inputs and target is reused (the model is traced
    symbolically again and checked against the cached graph, see pyplan/profile/cache.py), and a new one is
    stored. `autocast`: a mixed precision computes under autocast, as every layout but ZeRO-3's one-stage FSDP
    runs it; False prices it as FSDP2's policy computes, in its 16-bit weights (a search of ZeRO-3 alone)."""
    leaf_modules = tuple(leaf_modules)
    trace_batch = min(4, workload.global_batch)
    target = _Target.of(model, cluster, workload, autocast)
    key = None
    if cache is not None:
        key = ProfileKey.of(
            model,
            example_inputs,
            trace_batch=trace_batch,
            batch_sizes=target.sizes,
            target=target.describe(),
            leaf_modules=leaf_modules,
            min_blocks=min_blocks,
            max_blocks=max_blocks,
        )
        call = call_at(example_inputs, max(2, trace_batch))
        hit = cache.load(key, model, call, leaf_modules=leaf_modules, min_blocks=min_blocks, max_blocks=max_blocks)
        if hit is not None:
            return hit
    examples = Examples(example_inputs)
    graph = trace(model, examples, leaf_modules=leaf_modules, batch_size=trace_batch)
    chain = linearize(graph, min_blocks=min_blocks, max_blocks=max_blocks)
    profiled, how = target.profile(chain, examples)
    if cache is not None and key is not None:
        cache.store(key, chain, profiled, how)
    return profiled, how


@dataclass(frozen=True)
class _Target:
    """Where and how a chain is timed: measured on this machine (`roofline` None), or on the roofline of a catalog
    GPU computing in `compute_dtype` (under autocast, or in 16-bit weights), at the micro-batch sizes `sizes`.
    `cast_memory`: under autocast, the memory recorded as autocast holds it (off for a tensor-parallel rank's chain,
    whose collectives' stand-ins hold what the runtime's do not once cast: its traced bytes are halved)."""

    gpu: GPU
    sizes: tuple[int, ...]
    roofline: Roofline | None
    compute_dtype: str | None
    autocast: bool
    timing: TimingOptions
    cast_memory: bool = True
    # Whether the profile checks that the smallest size runs (a BatchNorm that sees one value per channel): a
    # tensor-parallel rank's chain runs the ops of the chain that was checked.
    check_smallest: bool = True

    @staticmethod
    def of(model: nn.Module, cluster: Cluster, workload: Workload, autocast: bool = True) -> _Target:
        gpu = cluster.gpu
        measured = is_local(gpu) and not is_meta_module(model)
        # Measured times at the sizes plans use (they are not linear in b); analytic ones are (FLOPs and bytes are).
        sizes = (
            measured_batch_sizes(workload.global_batch)
            if measured
            else default_batch_sizes(min(4, workload.global_batch))
        )
        if measured and workload.precision != "fp32":
            raise PlanError("measured profiling on this machine runs in fp32; plan `local` with --precision fp32")
        if not measured and (not gpu.peak_flops_per_s or not gpu.hbm_bw_bytes_per_s):
            raise PlanError(f"GPU '{gpu.name}' has no peak FLOP/s or memory bandwidth; run `pyplan calibrate` first")
        if not measured and _PEAK_OF[workload.precision] not in gpu.peak_flops_per_s:
            others = [p for p, key in _PEAK_OF.items() if key in gpu.peak_flops_per_s]
            raise PlanError(
                f"GPU '{gpu.name}' has no {_PEAK_OF[workload.precision]} peak in the catalog (it runs no "
                f"{workload.precision} kernels); plan it with --precision {' or '.join(others) or 'another GPU'}"
            )
        roofline = None if measured else Roofline.from_gpu(gpu)
        autocast = autocast and workload.precision in AUTOCAST_PRECISIONS
        return _Target(
            gpu, tuple(sizes), roofline, COMPUTE_DTYPES[workload.precision], autocast, timing_options(cluster)
        )

    def describe(self) -> dict[str, Any]:
        """The target as the profile cache keys it."""
        if self.roofline is None:
            return measured_target(self.gpu, local_device(), self.timing)
        return analytic_target(self.gpu, self.roofline, self.compute_dtype, self.autocast)

    def profile(self, chain: Chain, examples: Examples) -> tuple[Chain, str]:
        """The chain profiled at the target's sizes; a model with a BatchNorm over a 1x1 map, which cannot train on
        one sample, profiled from 2 samples, its plans' micro-batches of 2 or more. A user's autograd Function that
        mixes dtypes under autocast is one line, and so is an op that CUDA has no kernel for in the dtype autocast
        gives it."""
        try:
            return self._at(chain, examples, self.sizes)
        except NoKernelInDtype as exc:
            dtype = str(exc.dtype).removeprefix("torch.")
            raise PlanError(
                f"{exc.op}{f' in {exc.where}' if exc.where else ''} gets {dtype} under autocast, as it would on "
                f"CUDA, where torch has no {dtype} kernel for it ({exc.message}); plan it with --precision fp32"
            ) from None
        except (ValueError, ZeroDivisionError) as exc:
            if one_value_per_channel(exc) is None:
                raise
        except RuntimeError as exc:
            where = _function_frame(exc) if self.autocast else None
            if where is None:
                raise
            raise PlanError(
                f"{where} does not run under {self.compute_dtype} autocast, as CUDA would run it: "
                f"{str(exc).strip().splitlines()[0]}; plan it with --precision fp32, or make the Function cast its "
                "inputs (torch.amp.custom_fwd and custom_bwd)"
            ) from None
        try:
            profiled, how = self._at(chain, examples, sizes_from_two(self.sizes))
        except (ValueError, ZeroDivisionError) as again:
            if one_value_per_channel(again) is None:
                raise
            raise PlanError(
                "the model cannot train on micro-batches of 1 or 2 samples (a BatchNorm sees one value per "
                "channel); enlarge the input or the last feature map"
            ) from None
        return replace(profiled, min_micro_batch=2), how

    def _at(self, chain: Chain, examples: Examples, sizes: tuple[int, ...]) -> tuple[Chain, str]:
        """Times, saved bytes and the blocks' working memory at `sizes`. A catalog GPU runs fused attention where
        torch would select it there (pyplan/profile/attention.py)."""
        gpu, roofline = self.gpu, self.roofline
        attention = (
            TargetKernels(AttentionTarget(gpu.arch, self.compute_dtype))
            if roofline is not None and gpu.arch is not None and gpu.device_type == "cuda"
            else None
        )
        # The table of the chain's distinct blocks, shared by every pass below: each runs a block once per
        # distinct structure (on a meta model; a fake one's pieces are made in each pass's fake context).
        table = RepeatedBlocks.of(chain) if is_meta_module(chain.graph.module) else None
        with attention if attention is not None else contextlib.nullcontext():
            if roofline is None:
                profiled = profile(chain, examples, batch_sizes=sizes, options=self.timing, blocks=table)
                how = "measured on this machine"
            else:
                # FLOPs come from the ops recorded for the times (the same counts as block_flops', one pass less).
                profiled = profile(
                    chain,
                    examples,
                    measure=False,
                    batch_sizes=sizes,
                    blocks=table,
                    count_flops=False,
                    check_smallest=self.check_smallest,
                )
                got = analytic_blocks(
                    profiled,
                    examples,
                    roofline,
                    sizes,
                    compute_dtype=self.compute_dtype,
                    autocast=self.autocast,
                    blocks=table,
                )
                blocks = [
                    replace(b, fwd_time_s=f, bwd_time_s=g, flops_fwd=ff, flops_bwd=fg)
                    for b, (f, g), (ff, fg) in zip(profiled.blocks, got.times, got.flops, strict=True)
                ]
                profiled, how = replace(profiled, blocks=blocks), f"analytic roofline of {gpu.name}"
            # The blocks' working memory, for the exact replay of every plan's stages (search); cached with the
            # rest. At 2 samples or more: at 1 a transpose can be a contiguous view, and a block that keeps a copy
            # of its input at 2 keeps the input itself at 1 (nn.TransformerEncoder), which no line through both
            # describes.
            low = max(2, min(sizes))
            # Under autocast as the step holds its tensors (16-bit copies, fp32 norms and residuals), on a catalog
            # GPU (this machine's measured profile runs as this machine trains).
            use = self.autocast and roofline is not None and self.cast_memory
            casts = getattr(torch, self.compute_dtype) if use else None
            memory = remat_bytes(
                profiled, examples, (low, 2 * low), roofline=pricing(gpu, roofline), autocast=casts, blocks=table
            )
        if attention is not None and attention.chosen:
            how = f"{how}, attention {', '.join(sorted(attention.chosen))}"
        return replace(profiled, memory=memory), how


def chain_at_degree(
    chain: Chain,
    plan: TpPlan,
    degree: int,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    zone: SequenceZone | None = None,
    *,
    autocast: bool = True,
) -> Chain:
    """`chain` (chain_for's, before its loss) as one rank of tensor-parallel degree `degree` runs it on the
    cluster's catalog GPU: every block profiled on the rank's shards (and, with a sequence-parallel `zone`, on its
    tokens between the split layers), its times with the collectives on the link inside a node
    (pyplan/profile/tensor_parallel.py); `autocast` as chain_for takes it."""
    target = _Target.of(chain.graph.module, cluster, workload, autocast)
    if target.roofline is None:
        raise PlanError("tensor parallelism is planned on a catalog GPU's analytic profile; give --gpu NAME")
    if degree == 1:
        return chain
    examples = Examples(example_inputs)
    local = local_chain(chain, plan, degree, examples, zone)
    profiled, _ = replace(target, cast_memory=False, check_smallest=False).profile(local, examples)
    times = tp_comm_times(chain, plan, degree, cluster, workload, zone)
    blocks = [
        replace(b, fwd_time_s=b.fwd_time_s + f, bwd_time_s=b.bwd_time_s + g)
        for b, (f, g) in zip(profiled.blocks, times, strict=True)
    ]
    return replace(profiled, blocks=blocks)


def tp_comm_times(
    chain: Chain,
    plan: TpPlan,
    degree: int,
    cluster: Cluster,
    workload: Workload,
    zone: SequenceZone | None = None,
    *,
    vocab_parallel: bool = False,
) -> list[tuple[Affine, Affine]]:
    """Each block's tensor-parallel collectives at `degree` (with a sequence-parallel `zone`, its; with
    `vocab_parallel`, the loss on each rank's slice of the logits), forward and backward seconds as `α·b + β`, on
    the link inside a node (pyplan/profile/tensor_parallel.py)."""
    latency_s, bw = cluster.groups[0].intra_link.collective
    traffic = collective_bytes(chain, plan, degree, zone, vocab_parallel=vocab_parallel)
    return collective_times(traffic, degree, latency_s, bw, workload.activation_scale)


def add_loss(
    chain: Chain,
    model: nn.Module,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    loss: LossFn,
    target: TargetFn | None = None,
    *,
    autocast: bool = True,
) -> Chain:
    """`chain` (from chain_for) with the loss in its last block, timed as chain_for times the blocks: measured on
    this machine, or on the roofline of the cluster's GPU (pyplan/profile/loss.py); `autocast` as chain_for
    takes it."""
    return with_loss(chain, _loss_cost(chain, model, example_inputs, cluster, workload, loss, target, autocast))


def _loss_cost(
    chain: Chain,
    model: nn.Module,
    example_inputs: ExampleInputs,
    cluster: Cluster,
    workload: Workload,
    loss: LossFn,
    target: TargetFn | None,
    autocast: bool = True,
) -> LossCost:
    gpu = cluster.gpu
    measured = is_local(gpu) and not is_meta_module(model)
    sizes = (
        measured_batch_sizes(workload.global_batch) if measured else default_batch_sizes(min(4, workload.global_batch))
    )
    try:
        if measured:
            return loss_cost(chain, loss, target, sizes, options=timing_options(cluster))
        return loss_cost(
            chain, loss, target, sizes, roofline=Roofline.from_gpu(gpu), precision=workload.precision, autocast=autocast
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PlanError(f"the loss cannot be computed on the model's output: {first}") from None


_TORCH_DIR = os.path.dirname(torch.__file__)


def _function_frame(exc: BaseException) -> str | None:
    """Where a dtype error under autocast was raised inside a user's torch.autograd.Function (`Name.backward at
    file:line`, the innermost such frame outside torch), else None."""
    if "scalar type" not in str(exc) and "dtype" not in str(exc):
        return None
    found = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if (
            code.co_name in ("forward", "backward")
            and "ctx" in frame.f_locals
            and not code.co_filename.startswith(_TORCH_DIR)
        ):
            ctx = frame.f_locals["ctx"]
            owner = getattr(ctx, "_forward_cls", None) or type(ctx)
            name = getattr(owner, "__qualname__", type(ctx).__name__)
            found = f"{name}.{code.co_name} at {os.path.basename(code.co_filename)}:{line}"
    return found
