"""ModelSpec: a model builder with its example inputs, loss and target, as a model file defines them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pyplan.cross_entropy import fused_cross_entropy

__all__ = [
    "ExampleBatch",
    "Inputs",
    "ModelSpec",
    "cross_entropy",
    "default_loss",
    "default_target",
    "own_loss",
    "upcasts_itself",
]

Inputs = tuple[torch.Tensor, ...]
# What example_inputs(b) may return: a tensor, a tuple of tensors (positional), a dict (keyword arguments), or
# (args, kwargs); pyplan.graph.trace.input_tensors flattens it.
ExampleBatch = torch.Tensor | tuple[Any, ...] | dict[str, Any]


def cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position, the classes along the logits' last dimension (B·T positions for a
    language model's (B, T, V) logits, B for a classifier's (B, C)); `output` is the logits, or an output holding
    them as `.logits` (a transformers ModelOutput). Beside tensor parallelism it runs on each rank's slice of the
    vocabulary (pyplan.runtime.tensor_parallel.VocabParallelLoss), as torchtitan's `loss_parallel` does.

    It computes in fp32 on 16-bit logits, over chunks of rows, and keeps no copy of the logits for the backward
    (pyplan.cross_entropy): the runtime hands it the logits as the model makes them (`upcasts_itself`). Targets of
    -100 count for nothing, as `torch.nn.functional.cross_entropy`'s `ignore_index`."""
    # (A Proxy when torch.fx traces the loss with the model: the logits themselves.)
    logits = output if isinstance(output, (torch.Tensor, torch.fx.Proxy)) else output.logits
    if isinstance(logits, torch.fx.Proxy):
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten())
    return fused_cross_entropy(logits.flatten(0, -2), target.flatten())


def upcasts_itself(loss: Any) -> bool:
    """Whether `loss` computes in fp32 on 16-bit logits by itself, so that the runtime gives it the logits as they
    come, not a copy cast to fp32 for it (pyplan's `cross_entropy`)."""
    return loss is cross_entropy


def default_target(output: torch.Tensor) -> torch.Tensor:
    """A target for models that define none: zeros shaped like the output (regression to 0)."""
    return torch.zeros_like(output)


def own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself: the first floating-point scalar among its output tensors (labels or
    targets among its inputs; transformers' models return `loss` first, nanoGPT's `(logits, loss)` second)."""
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return next((t for t in tensors if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()), None)


def default_loss(output: Any, target: torch.Tensor | None) -> torch.Tensor:
    """The loss of a model that defines none: its own when it computes one (`own_loss`), else the mean squared error
    against `target` (zeros when there is none, or an empty placeholder)."""
    own = own_loss(output)
    if own is not None:
        return own
    if target is None or target.numel() == 0:
        target = default_target(output)
    return torch.nn.functional.mse_loss(output, target)


@dataclass(frozen=True)
class ModelSpec:
    """Everything pyplan needs to know about one model.

    `build()` returns a fresh module (call it under `torch.device("meta")` to build without weights);
    `example_inputs(b)` the inputs of one batch of b samples, batch along dim 0 of every tensor (a tuple passed
    positionally, a dict of keyword arguments, or (args, kwargs));
    `target(b)` the target of that batch (None: use `default_target` of the output);
    `loss(output, target)` a scalar loss, mean-reduced over the batch (None: `default_loss`).
    """

    name: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int], ExampleBatch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    target: Callable[[int], torch.Tensor] | None = None
    published_params: int | None = None
    source: str = ""
