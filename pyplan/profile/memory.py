"""Exact memory: bytes saved for backward per block, and parameter, gradient and optimizer-state bytes.

Saved bytes are measured, not estimated: the traced graph runs under `saved_tensors_hooks`, every saved
storage is counted once, parameters and buffers are excluded, and each storage is charged to the block whose
node produced it (an op's own temporaries, such as a dropout mask, to the block of that op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from pyplan._torch import run_without_compute, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import Affine
from pyplan.graph.linearize import static_closure
from pyplan.graph.trace import ExampleInputs, inputs_at

__all__ = [
    "OPTIMIZERS",
    "PRECISIONS",
    "ModelState",
    "SavedBytes",
    "model_state_bytes",
    "optimizer_step_bytes",
    "saved_bytes",
]

# Optimizer states per parameter element, in units of the master dtype: what torch.optim keeps in `state`.
OPTIMIZERS: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
# Optimizers that also keep a `step` counter: a 0-dim float32 tensor per parameter tensor (torch.optim.Adam/AdamW).
_STEP_TENSOR = {"adam", "adamw"}
# Bytes per element of (weights used in compute, gradients, master copy or None when the weights are the master).
# Mixed precision is what pyplan's runtime runs, torch's autocast: the weights, their gradients and the optimizer
# state stay fp32 and each op casts its inputs to 16 bits (the copies live with the activations), so a parameter
# holds 4 + 4 + Adam's 8 bytes, not the 2 + 2 + 12 of 16-bit weights beside an fp32 master copy (Megatron-LM,
# DeepSpeed). The totals agree; what ZeRO-1 shards does not: measured on gpt-tiny at dp = 2, 1,423,384 and
# 1,421,400 bytes held per rank against 1,185,280 under the 2 + 2 + 12 convention, 1,422,336 under this one.
PRECISIONS: dict[str, tuple[int, int, int | None]] = {
    "fp32": (4, 4, None),
    "bf16-mixed": (4, 4, None),
    "fp16-mixed": (4, 4, None),
}


@dataclass(frozen=True)
class ModelState:
    """Bytes of model state for a set of parameters under one optimizer and precision.

    The convention (printed with every memory figure, since tools disagree): `param_bytes` the weights used in
    compute, `grad_bytes` their gradients, `optimizer_bytes` the master copy (mixed precision) plus the
    optimizer's states in the master dtype plus Adam's per-tensor step counters.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def model_state_bytes(numel: int, tensors: int, *, optimizer: str = "adamw", precision: str = "fp32") -> ModelState:
    """Model-state bytes of `numel` parameter elements in `tensors` tensors (mixed Adam: 2 + 2 + 12 per element)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    weight, grad, master = PRECISIONS[precision]
    master_bytes = master if master is not None else weight
    optimizer_bytes = OPTIMIZERS[optimizer] * master_bytes * numel
    if master is not None:
        optimizer_bytes += master * numel
    if optimizer in _STEP_TENSOR:
        optimizer_bytes += 4 * tensors
    return ModelState(param_bytes=weight * numel, grad_bytes=grad * numel, optimizer_bytes=optimizer_bytes)


def optimizer_step_bytes(
    optimizer: str, precision: str, *, elements: float, largest_tensor: float, foreach: bool
) -> float:
    """Bytes an optimizer step holds beside the model state, over `elements` parameter elements whose largest tensor
    has `largest_tensor` elements (torch 2.13's defaults, as `pyplan.runtime.optim.optimizer_factory` builds them).

    Adam and AdamW divide by sqrt(exp_avg_sq) + eps made out of place, in the master dtype. On the CPU torch runs
    them tensor by tensor: measured on mlp-tiny's one-device plans, the step peaked with two such temporaries of its
    largest tensors live beside the whole state (16,384 + 16,640 bytes). On a GPU the foreach path makes them for
    every tensor at once (`torch._foreach_sqrt` of the exp_avg_sq list; from torch's source, not measured here).
    SGD, with or without momentum, updates in place."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    if optimizer not in _STEP_TENSOR:
        return 0.0
    weight, _, master = PRECISIONS[precision]
    master_bytes = master if master is not None else weight
    return float(master_bytes * (elements if foreach else 2 * largest_tensor))


class SavedRecorder(fx.Interpreter):
    """Runs the graph and charges each storage saved for backward to the node that produced it."""

    def __init__(self, gm: fx.GraphModule, exclude: set[int]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.exclude = exclude
        self.producer: dict[int, str] = {}
        self.saved: dict[int, tuple[int, str]] = {}
        self.current = ""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.exclude and key not in self.saved:
            self.saved[key] = (t.untyped_storage().nbytes(), self.producer.get(key, self.current))
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        result = super().run_node(n)
        for t in tensor_leaves(result):
            self.producer.setdefault(storage_key(t), n.name)
        return result


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward at one batch size: per block, and the model inputs kept for backward."""

    per_block: list[int]
    inputs: int

    @property
    def total(self) -> int:
        return self.inputs + sum(self.per_block)


def _saved_at(chain: Chain, example_inputs: ExampleInputs, batch_size: int) -> SavedBytes:
    gm = chain.graph.module
    block_of = {name: i for i, b in enumerate(chain.blocks) for name in b.nodes}
    placeholders = {n.name for n in chain.graph.placeholders}
    inputs = inputs_at(example_inputs, batch_size)

    def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> SavedRecorder:
        exclude = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        rec = SavedRecorder(gm, exclude)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            rec.run(*[convert(t) for t in inputs])
        return rec

    rec = run_without_compute(gm, run)
    # A storage produced by a static node (a buffer slice, a constant) is charged to the first block reading it.
    owner = dict(block_of)
    for i, b in enumerate(chain.blocks):
        for name in static_closure(chain.graph, b.nodes):
            owner.setdefault(name, i)
    per_block = [0] * len(chain.blocks)
    from_inputs = 0
    for nbytes, producer in rec.saved.values():
        if producer in placeholders:
            from_inputs += nbytes
        else:
            per_block[owner.get(producer, 0)] += nbytes
    return SavedBytes(per_block=per_block, inputs=from_inputs)


def saved_bytes(
    chain: Chain, example_inputs: ExampleInputs, batch_sizes: tuple[int, int]
) -> tuple[list[Affine], Affine]:
    """Saved-for-backward bytes of each block and of the model inputs, as `per_sample·b + fixed`.

    Measured on fake (or meta) tensors at two batch sizes; bytes are affine in b, so two points are exact.
    """
    b1, b2 = batch_sizes
    s1, s2 = _saved_at(chain, example_inputs, b1), _saved_at(chain, example_inputs, b2)
    blocks = [Affine.from_two(b1, x, b2, y) for x, y in zip(s1.per_block, s2.per_block)]
    return blocks, Affine.from_two(b1, s1.inputs, b2, s2.inputs)
