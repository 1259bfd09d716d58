"""What a graph's call targets and modules do, as plain hashable data: two calls described alike compute alike.

A rewritten graph calls closures that name the nodes they act on (pyplan/graph/sequence_parallel.py's scatters and
gathers); described with those names as positions, the calls of a model's identical layers come out the same. The
profile's table of distinct blocks (pyplan/profile/pieces.py) and the recorder of a graph's shapes
(pyplan/graph/trace.py) tell repeats apart by it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

__all__ = ["describe", "describe_module", "module_hooks", "own_tensors", "tensor_layout"]


def _primitives(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """A module's plain attributes (sizes, flags, rates): what may steer its forward beyond `extra_repr`."""
    return tuple(
        (k, repr(v))
        for k, v in sorted(vars(module).items())
        if not k.startswith("_") and (v is None or isinstance(v, bool | int | float | str | tuple | torch.dtype))
    )


def tensor_layout(t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor as a description holds it: shape, dtype, `requires_grad` and strides."""
    return (tuple(t.shape), t.dtype, t.requires_grad, t.stride() if t.layout == torch.strided else None)


# How many functions and objects deep `describe` follows closures and attributes; a value deeper than this is told
# apart by its identity.
_DEPTH = 8


def describe(value: Any, names: Mapping[str, int], depth: int = 0) -> Any:
    """What `value` (a call target, a hook, what a function closes over) does, as plain data: a node's name as its
    position given by `names` (in a piece, or among a call's inputs: a rewritten graph's calls name the nodes they
    act on), a function by its code, defaults and closure, an object by its type and public attributes. What it
    cannot tell apart safely (deeper than _DEPTH, or of an unknown kind) is described by its identity, so that two
    blocks are never taken for the same on its account."""
    if depth > _DEPTH:
        return ("id", id(value))
    deeper = depth + 1
    if value is None or isinstance(value, bool | int | float | complex | torch.dtype | torch.device):
        return value
    if isinstance(value, str):
        return f"%{names[value]}" if value in names else value
    if isinstance(value, fx.Node):
        return f"%{names.get(value.name, value.name)}"
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(describe(v, names, depth) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((describe(k, names, depth), describe(v, names, depth)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", tensor_layout(value))
    if isinstance(value, nn.Module):
        return describe_module(value, names, depth)
    if isinstance(value, functools.partial):
        return ("partial", *(describe(x, names, deeper) for x in (value.func, value.args, value.keywords)))
    if isinstance(value, types.MethodType):
        return ("method", value.__func__.__qualname__, describe(value.__self__, names, deeper))
    if isinstance(value, types.FunctionType):
        cells = tuple(describe(c.cell_contents, names, deeper) for c in value.__closure__ or ())
        return ("function", value.__code__, value.__name__, describe(value.__defaults__, names, deeper), cells)
    if isinstance(value, types.BuiltinFunctionType | type):
        return value  # module-level: the same object wherever it is called
    if hasattr(value, "__dict__") and not callable(value):
        public = {k: v for k, v in vars(value).items() if not k.startswith("_")}
        return (type(value), describe(public, names, deeper))
    return ("id", id(value))  # an aten op is one object wherever it is called: told apart by identity alone


def module_hooks(module: nn.Module) -> tuple[Any, ...]:
    """The forward hooks of a module (a rewritten graph's scatters and gathers around a split layer)."""
    return tuple(
        tuple(hooks.values())
        for hooks in (module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs, module._forward_hooks)
    )


def own_tensors(table: Mapping[str, torch.Tensor | None]) -> list[tuple[str, torch.Tensor]]:
    """A module's own parameters or buffers (its `_parameters` or `_buffers` table) as `named_parameters(recurse=
    False)` or `named_buffers(recurse=False)` lists them: each tensor once, empty entries left out (read off the
    table: nn.Module's generators cost more than what describes the tensors)."""
    seen: set[torch.Tensor] = set()
    out = []
    for name, t in table.items():
        if t is not None and t not in seen:
            seen.add(t)
            out.append((name, t))
    return out


def describe_module(module: nn.Module, names: Mapping[str, int], depth: int = 0) -> tuple[Any, ...]:
    """A module and each of its submodules: class, mode, configuration, parameter and buffer layouts, hooks."""
    # (A leaf, most modules a graph calls, is its own only module.)
    modules = module.named_modules() if module._modules else (("", module),)
    return tuple(
        (
            name,
            type(m),
            m.training,
            m.extra_repr(),
            _primitives(m),
            tuple((n, tensor_layout(p)) for n, p in own_tensors(m._parameters)),
            tuple((n, tensor_layout(b)) for n, b in own_tensors(m._buffers)),
            describe(module_hooks(m), names, depth + 1),
        )
        for name, m in modules
    )
