"""Run the blocks of a chain one at a time: the inputs each block receives, and one forward and backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from pyplan._torch import tensor_leaves
from pyplan.graph.split import pieces

__all__ = ["backward", "block_inputs", "block_modules", "forward", "leaf_inputs"]

block_modules = pieces


def block_inputs(mods: Sequence[fx.GraphModule], inputs: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    """The arguments each piece receives when the pieces run in sequence on `inputs` (no autograd)."""
    args: tuple[Any, ...] = tuple(inputs)
    collected = []
    with torch.no_grad():
        for m in mods:
            collected.append(args)
            out = m(*args)
            args = out if isinstance(out, tuple) else (out,)
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
