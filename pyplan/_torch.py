"""The one module that calls private torch APIs: fake tensors, module reparametrization, storage identity."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

__all__ = ["FakeTensorMode", "is_meta_module", "no_compute", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind `t` (shared by its views); works on real, meta and fake tensors."""
    return t.untyped_storage()._cdata


def is_meta_module(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers())


@contextlib.contextmanager
def no_compute(module: torch.nn.Module) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Run `module` without computing or allocating: on meta if it was built there, else on fake tensors.

    Inside, the module's parameters and buffers are stand-ins (meta or fake) that gradients accumulate into;
    the real ones and their `.grad` are untouched. Yields `convert`, which turns an input into the same kind.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    if is_meta_module(module):
        grads = {name: p.grad for name, p in params.items()}
        try:
            yield lambda t: t.to("meta")
        finally:
            for name, p in params.items():
                p.grad = grads[name]
        return
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {**params, **dict(module.named_buffers(remove_duplicate=False))}
        fakes = {name: mode.from_tensor(t) for name, t in state.items()}
        with _reparametrize_module(module, fakes, tie_weights=True):
            yield mode.from_tensor
