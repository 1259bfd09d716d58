"""Run the blocks of a chain one at a time: the inputs each block receives, and one forward and backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import is_meta_module, storage_key, tensor_leaves
from pyplan.graph.split import pieces

__all__ = ["RepeatedBlocks", "backward", "block_inputs", "block_modules", "forward", "leaf_inputs"]

block_modules = pieces


def block_inputs(
    mods: Sequence[fx.GraphModule], inputs: Sequence[torch.Tensor], repeated: RepeatedBlocks | None = None
) -> list[tuple[Any, ...]]:
    """The arguments each piece receives when the pieces run in sequence on `inputs` (no autograd).

    With `repeated`, a piece that repeats an earlier one on inputs of the same kind (meta tensors: shapes and
    nothing else) is not run: the earlier piece's outputs stand for its own."""
    args: tuple[Any, ...] = tuple(inputs)
    collected = []
    outputs: dict[str, tuple[Any, ...]] = {}
    with torch.no_grad():
        for i, m in enumerate(mods):
            collected.append(args)
            key = repeated.key(i, args) if repeated is not None else None
            if key is not None and key in outputs:
                args = outputs[key]
                continue
            out = m(*args)
            args = out if isinstance(out, tuple) else (out,)
            if key is not None:
                outputs[key] = args
    return collected


def leaf_inputs(args: Sequence[Any], *, first: bool) -> list[Any]:
    """A piece's inputs as a stage receives them: fresh leaves that need grad if float, except the model's own."""
    return [
        a.detach().requires_grad_(not first and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
        for a in args
    ]


def forward(mod: fx.GraphModule, args: Sequence[Any]) -> tuple[Any, list[torch.Tensor]]:
    """One forward of a piece on `leaf_inputs`; returns the output and the float outputs backward starts from."""
    out = mod(*args)
    return out, [t for t in tensor_leaves(out) if t.requires_grad]


def backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None = None) -> None:
    """Backward from the piece's outputs, with `grads` (default: ones shaped like each output)."""
    if roots:
        torch.autograd.backward(list(roots), list(grads) if grads is not None else [torch.ones_like(t) for t in roots])


def _primitives(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """A module's plain attributes (sizes, flags, rates): what may steer its forward beyond `extra_repr`."""
    return tuple(
        (k, repr(v))
        for k, v in sorted(vars(module).items())
        if not k.startswith("_") and (v is None or isinstance(v, bool | int | float | str | tuple | torch.dtype))
    )


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.requires_grad, t.stride() if t.layout == torch.strided else None)


def _inputs(args: Sequence[Any]) -> list[Any]:
    """Each input's shape, dtype, stride and `requires_grad`, and which earlier input shares its storage (an op
    reading one storage twice moves its bytes once)."""
    first: dict[int, int] = {}
    return [
        (_tensor(a), a.storage_offset(), first.setdefault(storage_key(a), i)) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]


def _module(module: nn.Module) -> tuple[Any, ...]:
    return tuple(
        (
            name,
            type(m),
            m.training,
            m.extra_repr(),
            _primitives(m),
            tuple((n, _tensor(p)) for n, p in m.named_parameters(recurse=False)),
            tuple((n, _tensor(b)) for n, b in m.named_buffers(recurse=False)),
        )
        for name, m in module.named_modules()
    )


class RepeatedBlocks:
    """Recognizes blocks that repeat an earlier block exactly, so a profile pass can reuse its result.

    Two blocks are the same when their graphs are the same op for op (modules compared by class, configuration
    and parameter shapes, not by name), and their inputs have the same shapes, dtypes, strides and
    `requires_grad`: then the ops they run, and so their FLOPs and op costs, are the same. The layers of a
    transformer or the bottlenecks of a ResNet stage are such blocks. Only models on the meta device are
    compared (on fake or real tensors values could steer the ops), and a block that shares a parameter with
    another block (tied weights) is always run, since its gradient accumulates into the other's.
    """

    def __init__(self, mods: Sequence[fx.GraphModule], model: nn.Module) -> None:
        self.enabled = is_meta_module(model)
        users: dict[int, set[int]] = {}
        for i, m in enumerate(mods):
            for p in m.parameters():
                users.setdefault(id(p), set()).add(i)
        self.shared = {i for blocks in users.values() if len(blocks) > 1 for i in blocks}
        self.mods = mods

    def key(self, index: int, args: Sequence[Any]) -> str | None:
        """What block `index` does with `args` (its leaf inputs), or None when it must run whatever it repeats."""
        if not self.enabled or index in self.shared:
            return None
        mod = self.mods[index]
        position: dict[fx.Node, int] = {}
        ops = []
        for i, n in enumerate(mod.graph.nodes):
            position[n] = i
            if n.op == "call_module":
                target: Any = _module(mod.get_submodule(n.target))
            elif n.op == "get_attr":
                attr = mod
                for part in n.target.split("."):
                    attr = getattr(attr, part)
                target = _tensor(attr) if isinstance(attr, torch.Tensor) else _module(attr)
            elif n.op == "placeholder":
                target = None  # inputs are named after the values they receive, which differ block to block
            else:
                target = n.target  # a function or a method name
            refs = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{position[a]}")
            ops.append((n.op, target, refs))
        return repr((ops, _inputs(args)))
