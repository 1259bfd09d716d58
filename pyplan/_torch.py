"""The one module that calls private torch APIs: fake tensors, module reparametrization, storage identity."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.nn.utils.stateless import _reparametrize_module

__all__ = ["is_meta_module", "run_without_compute", "storage_key"]

T = TypeVar("T")
Convert = Callable[[torch.Tensor], torch.Tensor]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (shared by its views); works on real, meta and fake tensors."""
    return t.untyped_storage()._cdata


def is_meta_module(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


@contextlib.contextmanager
def _grads_kept(module: torch.nn.Module) -> Iterator[None]:
    params = list(module.parameters())
    grads = [p.grad for p in params]
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def run_without_compute(module: torch.nn.Module, fn: Callable[[Convert], T]) -> T:
    """`fn(convert)` with `module` on meta tensors if it was built there, else on fake tensors.

    Nothing is computed or allocated. Parameters and buffers are stand-ins that gradients accumulate into; the
    real ones and their `.grad` are left as they were. `convert` turns an input tensor into the same kind. A real
    model whose forward needs real values (data-dependent control flow inside a leaf module) runs for real.
    """
    if is_meta_module(module):
        with _grads_kept(module):
            return fn(lambda t: t.to("meta"))
    state = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = {name: mode.from_tensor(t) for name, t in state.items()}
            with _reparametrize_module(module, fakes, tie_weights=True):
                return fn(mode.from_tensor)
    except (DataDependentOutputException, DynamicOutputShapeException):
        with _grads_kept(module):
            return fn(lambda t: t)
