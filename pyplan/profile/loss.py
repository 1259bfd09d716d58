"""The loss as part of the last block: its forward and backward time and the bytes it saves for backward.

A pipeline's last stage computes the loss of every micro-batch after its forward and backpropagates from it; the
loss's own work (a language model's cross-entropy over the vocabulary: a log-softmax over the logits, saved for
the backward) belongs to that stage. The model's trace stops at its output, so the loss is profiled apart, on
the model's output at each micro-batch size, and added to the chain's last block (`with_loss`).

Times: measured on this machine (the thread's CPU time on a CPU with one thread, less the call overhead a piece
timed alone pays, as pyplan/profile/measure.py times blocks), or the roofline time of the aten ops the loss runs
on a catalog GPU. Saved bytes: the storages autograd saves during the loss's forward, recorded on fake (or meta)
tensors, less the model's output where the loss saves it (pyplan's cross-entropy, a mean squared error): its stage
holds it anyway, and the chain's last block counts it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from pyplan._torch import OpRecorder, storage_key, torch_threads
from pyplan.graph.chain import Chain, LossCost
from pyplan.graph.layergraph import Affine, Piecewise
from pyplan.model_state import activation_scale, output_dtypes
from pyplan.profile.analytic import OpCost, Roofline, op_class
from pyplan.profile.live import LiveMemory
from pyplan.profile.measure import (
    TimingOptions,
    _Clock,
    _companions,
    _overhead,
    _time_block,
    local_device,
)
from pyplan.solve.remat import RematProfile
from pyplan.spec import upcasts_itself

__all__ = ["LossCost", "LossFn", "TargetFn", "loss_cost", "remat_with_loss", "with_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TargetFn = Callable[[int], torch.Tensor]


class _Loss(nn.Module):
    """The loss of a fixed target as a module of the model's output, so it can be timed like a block."""

    def __init__(self, loss_fn: LossFn, target: torch.Tensor | None) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.target = target

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        target = self.target if self.target is not None else torch.zeros_like(output)
        return self.loss_fn(output, target)


def _output_info(chain: Chain, batch_size: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the model's output at `batch_size`, from the trace (batch along dim 0)."""
    graph = chain.graph
    out = next(n for n in graph.nodes if n.op == "output")
    producer = graph.node(out.inputs[0]) if len(out.inputs) == 1 else None
    if producer is None or not producer.is_tensor or len(producer.outputs) != 1:
        raise ValueError("a loss needs a model whose output is one tensor")
    info = producer.outputs[0]
    traced = graph.batch_size
    if not info.shape or (info.shape[0] * batch_size) % traced:
        raise ValueError(f"the model's output {list(info.shape)} has no batch dimension first")
    return (info.shape[0] * batch_size // traced, *info.shape[1:]), getattr(torch, info.dtype.removeprefix("torch."))


def _analytic(
    chain: Chain,
    loss_fn: LossFn,
    target_fn: TargetFn | None,
    batch_size: int,
    precision: str = "fp32",
    autocast: bool = True,
) -> tuple[float, list[OpCost], list[OpCost], float]:
    """Saved bytes, the forward and backward aten ops of the loss at `batch_size` and its backward's peak of new
    storages (the output's gradient included), on meta tensors shaped like the model's output (no model run).

    At a 16-bit `precision` the output is 16-bit, as the runtime's last stage returns it, and the loss runs as
    the runtime runs it (on logits cast to `loss_dtype`, unless the loss `upcasts_itself`); the bytes are given in
    the chain's units, fp32 as traced, which the search scales by the precision's `activation_scale`: the loss's
    real bytes over that scale."""
    shape, dtype = _output_info(chain, batch_size)
    compute, loss_dtype = output_dtypes(precision, autocast)
    if dtype == torch.float32 and compute is not None:
        dtype = getattr(torch, compute)
    out = torch.empty(shape, dtype=dtype, device="meta").requires_grad_(dtype.is_floating_point)
    if (
        loss_dtype is not None
        and dtype.is_floating_point
        and dtype != getattr(torch, loss_dtype)
        and not upcasts_itself(loss_fn)
    ):
        loss_fn = _cast_first(loss_fn, getattr(torch, loss_dtype))
    target = target_fn(batch_size).to("meta") if target_fn is not None else None
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    fwd, bwd = OpRecorder(), OpRecorder()
    with torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fwd:
            loss = _Loss(loss_fn, target)(out)
        with bwd, LiveMemory() as live:
            loss.backward()

    def costs(rec: OpRecorder) -> list[OpCost]:
        return [OpCost(n, op_class(n), fl, nb, dt, view) for n, fl, nb, dt, view, _ in rec.ops if not view]

    saved.pop(storage_key(out), None)  # the model's output: its stage holds it anyway, with the chain's last block
    units = activation_scale(precision)
    return sum(saved.values()) / units, costs(fwd), costs(bwd), live.peak_bytes / units


def _cast_first(loss_fn: LossFn, dtype: torch.dtype) -> LossFn:
    def cast(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output.to(dtype), target)

    return cast


def loss_cost(
    chain: Chain,
    loss_fn: LossFn,
    target_fn: TargetFn | None,
    batch_sizes: Sequence[int],
    *,
    roofline: Roofline | None = None,
    device: torch.device | None = None,
    options: TimingOptions | None = None,
    precision: str = "fp32",
    autocast: bool = True,
) -> LossCost:
    """The loss's cost at each of `batch_sizes` (two or more), fitted: measured on `device` (default
    `local_device()`) when `roofline` is None, else the roofline time of its ops. `target_fn(b)` gives the target
    of b samples (None: zeros like the output, pyplan.spec.default_target). `precision` is the workload's: the
    loss of a 16-bit output is priced and counted as the runtime computes it (`_analytic`; `autocast` as
    chain_for takes it)."""
    sizes = sorted(set(batch_sizes))
    analytic = [_analytic(chain, loss_fn, target_fn, b, precision, autocast) for b in sizes]
    saved = Affine.fit(sizes, [float(a[0]) for a in analytic])
    peak = Affine.fit(sizes, [float(a[3]) for a in analytic])
    if roofline is not None:
        fwd = [roofline.sequence_time_s(a[1]) for a in analytic]
        bwd = [roofline.sequence_time_s(a[2]) for a in analytic]
        return LossCost(Affine.fit(sizes, fwd), Affine.fit(sizes, bwd), saved, peak)
    device = device or local_device()
    options = options or TimingOptions()
    chain.graph.module.to(device)
    fwd, bwd = [], []
    with torch_threads(options.threads), torch.enable_grad():
        clock = _Clock(device, options.threads)
        overhead = _overhead(device, clock)
        for b in sizes:
            shape, dtype = _output_info(chain, b)
            out = torch.randn(shape, device=device).to(dtype)
            target = target_fn(b).to(device) if target_fn is not None else None
            loss = _Loss(loss_fn, target)

            def work(loss: nn.Module = loss, out: torch.Tensor = out) -> None:
                _time_block(loss, (out,), clock, 0, 1, first=False)

            with _companions(options.corun, work):
                f, g = overhead.remove(*_time_block(loss, (out,), clock, options.warmup, options.repeats, first=False))
            fwd.append(f)
            bwd.append(g)
    return LossCost(Piecewise.through(sizes, fwd), Piecewise.through(sizes, bwd), saved, peak)


def with_loss(chain: Chain, loss: LossCost) -> Chain:
    """The chain with the loss added to its last block's times and saved bytes (`Chain.loss` set)."""
    if chain.loss is not None:
        raise ValueError("the chain's last block already holds a loss")
    last = chain.blocks[-1]
    if last.fwd_time_s is None or last.bwd_time_s is None or last.saved_bytes is None:
        raise ValueError("the chain must be profiled before its loss is added")
    blocks = [
        *chain.blocks[:-1],
        replace(
            last,
            fwd_time_s=last.fwd_time_s + loss.fwd_time_s,
            bwd_time_s=last.bwd_time_s + loss.bwd_time_s,
            saved_bytes=last.saved_bytes + loss.saved_bytes,
        ),
    ]
    return replace(chain, blocks=blocks, loss=loss)


def remat_with_loss(remat: RematProfile, loss: LossCost) -> RematProfile:
    """The remat profile with the loss folded into the last block: the loss's saved bytes kept from the block's
    forward to its backward (and in its forward peak: the loss runs between the two); the loss's backward, which
    runs first, peaks with the block's kept bytes, the loss's saved bytes and the loss's own peak (the output's
    gradient and temporaries); the block's own backward then holds that gradient as its output gradient. The
    gradient of the model's output is made by the loss, so it is counted in those peaks, not given (the chain's
    last gradient becomes zero: the replay takes a given output gradient as resident).

    Measured on gpt-tiny at 16 samples: the live bytes peak in the loss's backward, with the logits, the
    log-softmax output, its gradient and the logits' gradient (524 KB each) live beside the saved activations;
    counting the loss's peak on top of the block's own, less a given output gradient, left out 393 KB."""
    tail = remat.blocks[-1]
    tail = replace(
        tail,
        kept_bytes=tail.kept_bytes + loss.saved_bytes,
        fwd_peak_bytes=tail.fwd_peak_bytes + loss.saved_bytes,
        loss_bwd_peak_bytes=tail.kept_bytes + loss.saved_bytes + loss.bwd_peak_bytes,
    )
    grads = (*remat.grad_bytes[:-1], Affine(0.0, 0.0))
    return replace(remat, blocks=(*remat.blocks[:-1], tail), grad_bytes=grads)
