"""Run blocks of a traced model following a RematPlan: kept, offloaded to the host, or checkpointed and recomputed.

`apply_remat(chain, plan)` builds a module for the blocks the plan covers (the whole model, or one pipeline
stage's range). Its forward passes the tuple of values live at each cut from block to block, as the pieces of
pyplan.graph.split do, and wraps them following the plan's tree:

  Keep(i)            block i runs as is;
  Offload(i)         block i runs under `torch.autograd.graph.save_on_cpu`: what it saves waits on the host;
  Selective(i)       block i runs under `checkpoint(..., use_reentrant=False, context_fn=selective_contexts)`:
                     the outputs of its matrix products and fused attention are saved, its other ops run again
                     in its backward (pyplan._torch.SELECTIVE_SAVE_OPS);
  Checkpoint(inner)  `torch.utils.checkpoint.checkpoint(run inner, *values, use_reentrant=False)`: the blocks of
                     `inner` save nothing, and run again following `inner` when backward reaches them;
  SelectiveCheckpoint(inner)  the same with `context_fn=selective_contexts`: the outputs of the matrix products
                     and fused attention of `inner` are saved, the rest runs again.

Parameters and buffers are the traced module's own (shared, not copied) under their names in the original
model, so `state_dict()` and `named_parameters()` read as those of `piece(chain, first, last + 1)`.

What torch does that the plan's model does not say: a checkpointed block runs its forward twice, so a BatchNorm
in training mode updates its running statistics twice (gradients are unaffected); an `Offload` inside a
`Checkpoint` sends its saved tensors to the host during the first, non-saving pass already (the innermost
saved-tensors hook wins over the checkpoint's), and its recomputation copies them once more and drops the copy;
save_on_cpu brings each saved tensor back when the op that saved it runs its backward, not a block at a time;
and on the CPU an `Offload` keeps the very tensors (`.cpu()` of a CPU tensor is itself), as `Keep` would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from pyplan._torch import selective_contexts
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.split import piece
from pyplan.remat_plan import Checkpoint, Keep, Offload, RematPlan, Selective, SelectiveCheckpoint

__all__ = ["RematModule", "apply_remat"]

# The forward of one block's piece, called with the RematModule as `self`.
BlockCode = Callable[..., Any]


class RematModule(nn.Module):
    """Blocks `plan.first..plan.last` of a chain as one module that runs them following `plan`.

    It takes the values live at cut `plan.first` (the model's inputs when the plan starts at block 0) and
    returns those live at cut `plan.last + 1` as a tuple (the model's output when the plan ends at the last
    block), like `piece(chain, first, last + 1)`. `graph` is that piece's graph (what StageModule reads of a
    stage's outputs). `pin_memory` for `Offload`: page-locked host copies (default: when the values are on CUDA).
    """

    def __init__(self, chain: Chain, plan: RematPlan, *, pin_memory: bool | None = None) -> None:
        super().__init__()
        if plan.last >= len(chain):
            raise PlanError(f"the remat plan covers blocks {plan.first}..{plan.last}, the chain has {len(chain)}")
        whole = piece(chain, plan.first, plan.last + 1)
        # The whole range's modules, parameters and buffers become this module's, under the same names.
        for name, child in whole.named_children():
            self.add_module(name, child)
        for name, p in whole.named_parameters(recurse=False):
            self.register_parameter(name, p)
        persistent = set(whole.state_dict(keep_vars=True))
        for name, b in whole.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name in persistent)
        self.graph: fx.Graph = whole.graph
        self.plan = plan
        self.pin_memory = pin_memory
        # Each block's piece reads its submodules and constants by the same attribute paths as the whole range,
        # so its generated forward runs with this module as `self`: one set of modules, whatever `.to()` does.
        self._code: dict[int, BlockCode] = {i: type(piece(chain, i, i + 1)).forward for i in plan.blocks}

    def forward(self, *values: Any) -> Any:
        return self._run(self.plan, *values)

    def _run(self, plan: RematPlan, *values: Any) -> Any:
        out: Any = values
        del values  # this frame holds each cut's values only until the next block has run
        for item in plan.items:
            out = self._item(item, out if isinstance(out, tuple) else (out,))
        return out

    def _item(self, item: Keep | Offload | Selective | Checkpoint, values: tuple[Any, ...]) -> Any:
        if isinstance(item, Keep):
            return self._code[item.block](self, *values)
        if isinstance(item, Selective):
            run = functools.partial(self._code[item.block], self)
            return checkpoint(run, *values, use_reentrant=False, context_fn=selective_contexts)
        if isinstance(item, Offload):
            pin = self.pin_memory
            if pin is None:
                pin = any(isinstance(v, torch.Tensor) and v.is_cuda for v in values)
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return self._code[item.block](self, *values)
        context = {"context_fn": selective_contexts} if isinstance(item, SelectiveCheckpoint) else {}
        return checkpoint(functools.partial(self._run, item.inner), *values, use_reentrant=False, **context)

    def extra_repr(self) -> str:
        return f"plan={self.plan.describe()}"


def apply_remat(chain: Chain, plan: RematPlan, *, pin_memory: bool | None = None) -> RematModule:
    """The blocks `plan` covers (global block indices of `chain`), run following `plan` (see RematModule).

    A whole model: a plan over blocks 0..len(chain)-1, e.g. `apply_remat(chain, periodic(0, len(chain), 4))`;
    a pipeline stage of blocks [start, stop): a plan over start..stop-1.
    """
    return RematModule(chain, plan, pin_memory=pin_memory)
