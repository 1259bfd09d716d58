"""Model state: the bytes of parameters, gradients and optimizer state per element, by optimizer and precision.

Plain arithmetic over the workload's choices, below everything that plans, measures or runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AUTOCAST_PRECISIONS",
    "COMPUTE_DTYPES",
    "MASTER_PRECISIONS",
    "OPTIMIZERS",
    "PRECISIONS",
    "ModelState",
    "ShardedUnitBytes",
    "activation_scale",
    "model_state_bytes",
    "optimizer_step_bytes",
    "output_dtypes",
    "sharded_unit_bytes",
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
# ZeRO-3 holds the same fp32 shards under mixed precision; only what it gathers is 16-bit (`ShardedUnitBytes`).
# "bf16-master" is Megatron-LM's bf16 ("bf16 param, fp32 grads": 18 bytes, 6 + 12/d with its distributed optimizer;
# Megatron-LM README.md, "Distributed Optimizer"): the model's weights are bf16, each gradient is accumulated in an
# fp32 buffer, and the optimizer steps fp32 master weights and states (ZeRO-1 shards those 12 bytes).
# "bf16-master-bf16-grads" accumulates and reduces the gradients in bf16 (NeMo's performance recipes,
# grad_reduce_in_fp32=False: 4 + 12/d, and an fp32 copy of the replica's gradients while the optimizer steps).
PRECISIONS: dict[str, tuple[int, int, int | None]] = {
    "fp32": (4, 4, None),
    "bf16-mixed": (4, 4, None),
    "fp16-mixed": (4, 4, None),
    "bf16-master": (2, 4, 4),
    "bf16-master-bf16-grads": (2, 2, 4),
}
# Precisions whose weights are 16-bit beside fp32 master weights in the optimizer (pyplan/runtime/master.py).
MASTER_PRECISIONS = ("bf16-master", "bf16-master-bf16-grads")

# 16-bit types of the mixed precisions: ZeRO-3 gathers its units' weights in them.
_COMPUTE_BYTES: dict[str, int] = {
    "fp32": 4,
    "bf16-mixed": 2,
    "fp16-mixed": 2,
    "bf16-master": 2,
    "bf16-master-bf16-grads": 2,
}


# The dtype (torch's name) each precision computes in (None: as the model is), and those that compute under
# autocast (the others' 16-bit weights compute in their own dtype).
COMPUTE_DTYPES: dict[str, str | None] = {
    "fp32": None,
    "bf16-mixed": "bfloat16",
    "fp16-mixed": "float16",
    "bf16-master": "bfloat16",
    "bf16-master-bf16-grads": "bfloat16",
}
AUTOCAST_PRECISIONS = ("bf16-mixed", "fp16-mixed")


def activation_scale(precision: str) -> float:
    """Saved activations and boundary tensors are traced in fp32; a 16-bit precision keeps most in 16 bits."""
    return 0.5 if precision != "fp32" else 1.0


def output_dtypes(precision: str, autocast: bool = True) -> tuple[str | None, str | None]:
    """The dtype (torch's name) of a model's floating output at `precision` (None: as traced) and the one the
    runtime's loss takes it in (None: as it comes): autocast's last matrix product returns 16 bits and the
    pipeline's loss, run outside autocast, takes them so; 16-bit weights' logits, and a mixed precision's where it
    runs without autocast (ZeRO-3's FSDP2 policy, whose output dtype is fp32), are cast to fp32 for the loss
    (pyplan/runtime/trainer.py `_in_fp32`, as Megatron-LM does; pyplan/runtime/sharded.py), unless the loss
    computes in fp32 by itself (`pyplan.spec.upcasts_itself`: pyplan's cross-entropy takes them as they come)."""
    compute = COMPUTE_DTYPES[precision]
    if compute is None:
        return None, None
    return compute, "float32" if precision in MASTER_PRECISIONS or not autocast else None


@dataclass(frozen=True)
class ShardedUnitBytes:
    """Bytes per parameter element of what ZeRO-3 (FSDP2) moves and holds unsharded for a unit: its weights as
    all-gathered (and held while the unit computes), their gradients as autograd makes them, and the gradients as
    reduce-scattered.

    Under mixed precision pyplan's runtime runs FSDP2's own policy, as torchtitan does: `MixedPrecisionPolicy(
    param_dtype=<16-bit>, reduce_dtype=float32)`; the fp32 shards stay the optimizer's master weights, the units
    are gathered in 16 bits and compute in them (no autocast), and their 16-bit gradients are copied into an fp32
    buffer and reduce-scattered in fp32 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
    `foreach_reduce`)."""

    gathered: int
    grad: int
    reduced: int


def sharded_unit_bytes(precision: str) -> ShardedUnitBytes:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    compute = _COMPUTE_BYTES[precision]
    return ShardedUnitBytes(gathered=compute, grad=compute, reduced=4)


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
    SGD, with or without momentum, updates in place. Beside 16-bit gradients the master weights step with an fp32
    copy of them, made for all at once (pyplan/runtime/master.py)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{optimizer}'; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    weight, grad, master = PRECISIONS[precision]
    copies = float(master * elements) if master is not None and grad < master else 0.0
    if optimizer not in _STEP_TENSOR:
        return copies
    master_bytes = master if master is not None else weight
    return copies + float(master_bytes * (elements if foreach else 2 * largest_tensor))
