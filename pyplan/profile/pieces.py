"""Run the blocks of a chain one at a time: the inputs each block receives, and one forward and backward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import is_meta_module, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.describe import describe, describe_module, tensor_layout
from pyplan.graph.split import pieces

__all__ = ["RepeatedBlocks", "backward", "block_inputs", "block_modules", "forward", "leaf_inputs", "mirror"]


def block_modules(chain: Chain) -> list[fx.GraphModule]:
    """One piece per block of `chain`, each piece's code generated when it first runs: a profile pass runs the
    distinct blocks alone (`RepeatedBlocks`)."""
    return pieces(chain, lazy=True)


def block_inputs(
    mods: Sequence[fx.GraphModule], inputs: Sequence[torch.Tensor], repeated: RepeatedBlocks | None = None
) -> list[tuple[Any, ...]]:
    """The arguments each piece receives when the pieces run in sequence on `inputs` (no autograd).

    With `repeated`, a piece that repeats an earlier one on inputs of the same kind (meta tensors: shapes and
    nothing else) is not run: its outputs are made like the earlier piece's (`mirror`), so that every cut holds
    values of the shapes, strides and storage sharing running it would give."""
    args: tuple[Any, ...] = tuple(inputs)
    collected = []
    ran: dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]] = {}  # key -> the first such piece's inputs, outputs
    with torch.no_grad():
        for i, m in enumerate(mods):
            collected.append(args)
            key = repeated.key(i, args) if repeated is not None else None
            mirrored = mirror(*ran[key], args) if key is not None and key in ran else None
            if mirrored is not None:
                args = mirrored[0]
                continue
            out = m(*args)
            given, args = args, out if isinstance(out, tuple) else (out,)
            if key is not None:
                ran.setdefault(key, (given, args))
    return collected


def mirror(
    given: Sequence[Any], made: Sequence[Any], args: Sequence[Any]
) -> tuple[tuple[Any, ...], dict[int, int]] | None:
    """The outputs a piece would make from `args`, where the same piece made `made` from `given` (inputs of the same
    shapes, strides, storage sharing and `requires_grad`), and which new storage stands for each of `made`'s: an
    output that is an input, or a view of one, is the same of `args`; the others are new storages of the same
    sizes, shared among the outputs as `made` shares them, that need grad where `made`'s do. None where an output
    is neither a tensor nor a plain value, or one storage holds outputs of different dtypes or needs."""
    inputs: dict[int, torch.Tensor] = {}
    for a, b in zip(given, args, strict=True):
        if isinstance(a, torch.Tensor):
            inputs.setdefault(storage_key(a), b)
    new: dict[int, torch.Tensor] = {}
    out: list[Any] = []
    for t in made:
        if not isinstance(t, torch.Tensor):
            if isinstance(t, (list, tuple, dict)):
                return None
            out.append(t)
            continue
        same = next((b for a, b in zip(given, args) if a is t), None)
        if same is not None:
            out.append(same)
            continue
        key = storage_key(t)
        base = inputs.get(key)
        if base is not None and base.requires_grad and not t.requires_grad:
            base = base.detach()  # a view that autograd does not follow
        if base is None:
            base = new.get(key)
            if base is None:
                nbytes = t.untyped_storage().nbytes()
                flat = torch.empty(nbytes // t.element_size(), dtype=t.dtype, device=t.device)
                base = new[key] = flat.requires_grad_(t.requires_grad)
        if base.dtype != t.dtype or base.requires_grad != t.requires_grad:
            return None
        out.append(base.as_strided(t.shape, t.stride(), t.storage_offset()))
    return tuple(out), {key: storage_key(b) for key, b in new.items()}


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


def _inputs(args: Sequence[Any]) -> list[Any]:
    """Each input's shape, dtype, stride and `requires_grad`, and which earlier input shares its storage (an op
    reading one storage twice moves its bytes once)."""
    first: dict[int, int] = {}
    return [
        (tensor_layout(a), a.storage_offset(), first.setdefault(storage_key(a), i))
        if isinstance(a, torch.Tensor)
        else a
        for i, a in enumerate(args)
    ]


class RepeatedBlocks:
    """The table of a chain's distinct blocks: recognizes blocks that repeat an earlier block exactly, so that a
    profile pass runs each distinct block once and the repeats share its result.

    Two blocks are the same when their graphs are the same op for op (modules compared by class, configuration,
    parameter shapes and hooks, functions by their code and what they close over, not by name), and their inputs
    have the same shapes, dtypes, strides and `requires_grad`: then the ops they run, and so their FLOPs, op costs
    and bytes, are the same. The layers of a transformer, the bottlenecks of a ResNet stage and one
    tensor-parallel rank's layers are such blocks. Only models on the meta device are compared (on fake or real
    tensors values could steer the ops), and a block that shares a parameter with another block (tied weights) is
    always run, since its gradient accumulates into the other's. A block's graph is described once, whatever the
    passes and batch sizes that ask (`key`).
    """

    def __init__(self, mods: Sequence[fx.GraphModule], model: nn.Module) -> None:
        self.enabled = is_meta_module(model)
        users: dict[int, set[int]] = {}
        for i, m in enumerate(mods):
            for p in m.parameters():
                users.setdefault(id(p), set()).add(i)
        self.shared = {i for blocks in users.values() if len(blocks) > 1 for i in blocks}
        self.mods = list(mods)
        self._graphs: dict[int, str] = {}

    @staticmethod
    def of(chain: Chain) -> RepeatedBlocks:
        """The table of `chain`'s blocks, with their pieces (`block_modules`)."""
        return RepeatedBlocks(block_modules(chain), chain.graph.module)

    def key(self, index: int, args: Sequence[Any]) -> str | None:
        """What block `index` does with `args` (its leaf inputs), or None when it must run whatever it repeats."""
        if not self.enabled or index in self.shared:
            return None
        if index not in self._graphs:
            self._graphs[index] = self._graph(index)
        return f"{self._graphs[index]}|{_inputs(args)!r}"

    def _graph(self, index: int) -> str:
        """Block `index`'s graph op for op, nodes named by their position."""
        mod = self.mods[index]
        position = {n.name: i for i, n in enumerate(mod.graph.nodes)}
        ops = []
        for n in mod.graph.nodes:
            if n.op == "call_module":
                target: Any = describe_module(mod.get_submodule(n.target), position)
            elif n.op == "get_attr":
                attr = mod
                for part in n.target.split("."):
                    attr = getattr(attr, part)
                if isinstance(attr, torch.Tensor):
                    target = tensor_layout(attr)
                elif isinstance(attr, nn.Module):
                    target = describe_module(attr, position)
                else:  # a constant of a higher-order op (a vmapped mask function's TreeSpec): by its value
                    target = (type(attr).__qualname__, repr(attr))
            elif n.op == "placeholder":
                target = None  # inputs are named after the values they receive, which differ block to block
            elif n.op == "call_method":
                target = n.target  # a method's name
            else:
                target = describe(n.target, position)  # a function, or a closure over the nodes it acts on
            refs = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{position[a.name]}")
            ops.append((n.op, target, refs))
        return repr(ops)
