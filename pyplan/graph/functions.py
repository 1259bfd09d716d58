"""Custom autograd Functions kept whole through capture: each call becomes one op that runs the Function itself.

A `torch.autograd.Function` written by hand (a parallel scan, a fused kernel's wrapper) often has a forward that
is only valid without autograd (in-place writes into views of its output) and a backward that is not the
derivative of its forward's ops. torch.export traces through the forward and keeps neither property: the captured
graph holds the forward's ops, and their autograd backward fails or computes something else. Under `kept_whole`,
every call of a user's Function (one defined outside torch) is captured as one `pyplan::autograd_function` op
instead. Run with autograd, the op calls the Function's own `apply`, so its forward and its backward run as
written; on fake and meta tensors it runs the forward without autograd to learn its outputs.

The op names its call by a key into a registry of the Functions captured in this process: the class, and the
non-tensor arguments of the call (they are part of the call, not inputs of the graph). Every process that runs a
captured graph has captured it itself, so the registry holds the key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = ["KEPT_WHOLE", "KeptWhole", "is_kept_whole", "kept_whole", "run_kept_whole"]

_OP_NAME = "autograd_function"
_LIB = torch.library.Library("pyplan", "FRAGMENT")
_LIB.define(f"{_OP_NAME}(str key, Tensor?[] tensors) -> Tensor[]")


class KeptWhole(Exception):
    """Raised under torch.fx's symbolic trace at a Function call: fx cannot learn its outputs, so the capture falls
    back to torch.export, which keeps the call whole."""


@dataclass(frozen=True)
class _Call:
    """A Function and how one call site calls it: where the tensors go among its arguments, and the rest."""

    function: type[torch.autograd.Function]
    args_spec: TreeSpec
    constants: tuple[Any, ...]  # the non-tensor leaves of the arguments, None where a tensor goes

    def arguments(self, tensors: list[torch.Tensor | None]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return tree_unflatten(leaves, self.args_spec)


_TENSOR = object()  # the place of a tensor among a call's leaves
_CALLS: dict[str, _Call] = {}
_ORIGINAL_APPLY = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]


def _run(key: str, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The call's output tensors, in pytree order, from the Function's own apply."""
    call = _CALLS[key]
    args, kwargs = call.arguments(tensors)
    # On meta inputs the tensors the forward makes go to meta too (SEW-D's XSoftmax fills with
    # `torch.tensor(finfo.min)`, a CPU scalar that CUDA takes beside its inputs and meta refuses).
    on_meta = any(t is not None and t.device.type == "meta" for t in tensors)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        out = _ORIGINAL_APPLY(call.function, *args, **kwargs)
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    if not leaves:
        raise TypeError(f"{call.function.__qualname__}.forward returned no tensor")
    return leaves


def _without_autograd(key: str, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The outputs with no graph recorded (fake, meta and no-grad runs): fresh tensors, as the op's schema says."""
    inputs = {id(t) for t in tensors if t is not None}
    with torch.no_grad():
        return [t.clone() if id(t) in inputs or t._is_view() else t for t in _run(key, tensors)]


_LIB.impl(_OP_NAME, _run, "Autograd")
_LIB.impl(_OP_NAME, _without_autograd, "CompositeExplicitAutograd")
torch.library.register_fake(f"pyplan::{_OP_NAME}", _without_autograd, lib=_LIB)
_OP = getattr(torch.ops.pyplan, _OP_NAME).default


# The op a kept-whole Function's call is captured as.
KEPT_WHOLE = _OP


def run_kept_whole(args: tuple[Any, ...], kwargs: dict[str, Any], *, autograd: bool) -> list[torch.Tensor]:
    """The outputs of a call of KEPT_WHOLE (its arguments), from the Function itself: its `apply` above autograd
    (`autograd`), its forward without autograd below it. For a mode that sees the op and must see the Function's own
    ops: it pushes itself again around this call, as autocast's emulation does (CUDA autocast casts inside a
    Function's forward)."""
    return (_run if autograd else _without_autograd)(*args, **kwargs)


def _is_users(function: type) -> bool:
    """A Function defined outside torch (torch's own, such as checkpointing's, are captured as torch captures them)."""
    return not function.__module__.startswith("torch.")


def _key(call: _Call) -> str:
    """The registry key of a call: the Function's name and the index of its constants among the calls seen."""
    name = f"{call.function.__module__}.{call.function.__qualname__}"
    for key, known in _CALLS.items():
        if known == call:
            return key
    key = f"{name}#{sum(1 for k in _CALLS if k.rpartition('#')[0] == name)}"
    _CALLS[key] = call
    return key


def _apply(function: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    """Function.apply while capturing: a user's Function becomes one op; torch's own run as they are."""
    if not _is_users(function):
        return _ORIGINAL_APPLY(function, *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    if any(isinstance(x, fx.Proxy) for x in leaves):
        raise KeptWhole(function.__qualname__)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = tuple(_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    key = _key(_Call(function, spec, constants))
    outputs = iter(_OP(key, tensors))
    # The output's structure from the Function's forward run on the capture's fake tensors.
    with torch.no_grad():
        shape = _ORIGINAL_APPLY(function, *args, **kwargs)
    flat, out_spec = tree_flatten(shape)
    return tree_unflatten([next(outputs) if isinstance(x, torch.Tensor) else x for x in flat], out_spec)


@contextlib.contextmanager
def kept_whole() -> Iterator[None]:
    """Within: every call of a user's autograd Function is captured as one op that runs the Function itself."""
    saved = vars(torch.autograd.Function)["apply"]  # the classmethod itself, not one bound to Function
    torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.autograd.Function.apply = saved  # type: ignore[method-assign]


def is_kept_whole(node: fx.Node) -> bool:
    """A graph node that calls a Function kept whole."""
    return node.op == "call_function" and node.target is _OP
