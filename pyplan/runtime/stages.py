"""Stage modules from a Layout: the traced model cut at the planned positions, each piece passing its live set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from pyplan._torch import is_view
from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.linearize import linearize, operations
from pyplan.graph.split import piece
from pyplan.graph.trace import ExampleInputs, LeafSpec, trace
from pyplan.plan import Layout
from pyplan.runtime.remat import RematModule, apply_remat
from pyplan.solve.schedules import stage_placement

__all__ = ["StageModule", "cut_model", "local_stages", "stage_io", "tied_parameters"]


class StageModule(nn.Module):
    """A piece of the traced model as a pipeline stage: outputs become a contiguous tuple of tensors.

    torch's PipelineStage sends only contiguous tensors. The split-backward schedules (zero bubble) detach a
    stage's outputs in place once its input gradient is done, which fails for an output that is a view and breaks
    the weight gradient when an output is also read inside the stage (saved for backward) or is an input passed
    through: with `copy_shared_outputs` such outputs are returned as copies. The piece itself stays as traced
    (its submodules keep their qualified names, so parameters are named as in the original model).
    """

    def __init__(
        self,
        piece: fx.GraphModule | RematModule,
        *,
        last: bool,
        copy_shared_outputs: bool = False,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.piece = piece
        self.last = last
        # Mixed precision: the piece runs under autocast (weights stay fp32, the optimizer's master copy).
        self.autocast_dtype = autocast_dtype
        output = next(n for n in piece.graph.nodes if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], tuple) else (output.args[0],)
        self.copy_views = copy_shared_outputs
        self.copy = tuple(
            copy_shared_outputs and isinstance(v, fx.Node) and (v.op == "placeholder" or len(v.users) > 1)
            for v in values
        )

    def forward(self, *args: torch.Tensor) -> Any:
        if self.autocast_dtype is None:
            out = self.piece(*args)
        else:
            device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            with torch.autocast(device_type=device, dtype=self.autocast_dtype):
                out = self.piece(*args)
        if self.last:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        return tuple(
            t.clone() if c or (self.copy_views and is_view(t)) else t.contiguous() for t, c in zip(outs, self.copy)
        )


def cut_model(
    model: nn.Module,
    example_inputs: ExampleInputs,
    layout: Layout,
    *,
    leaf_modules: Iterable[LeafSpec] = (),
    copy_shared_outputs: bool = False,
    autocast_dtype: torch.dtype | None = None,
    transform: Callable[[LayerGraph], None] | None = None,
) -> tuple[Chain, list[StageModule]]:
    """Trace `model` and cut it into the layout's stages (all of them; a rank keeps its own).

    With the layout's `stage_of_node` the cuts fall in the traced order sorted by stage, so each stage is the
    operations assigned to it. `transform` changes the traced graph in place before it is cut, keeping its nodes'
    names (tensor parallelism: pyplan/runtime/tensor_parallel.py)."""
    graph = trace(model, example_inputs, leaf_modules=leaf_modules, batch_size=layout.micro_batch_size)
    if transform is not None:
        transform(graph)
    check_span(graph, layout)
    order = _stage_order(graph, layout.stage_of_node) if layout.stage_of_node else None
    chain = linearize(graph, positions=layout.cut_positions[1:-1], order=order)
    if len(chain) != layout.num_stages:
        raise PlanError(f"the plan's cuts make {len(chain)} stages, the layout says {layout.num_stages}")
    n = len(chain)
    return chain, [
        StageModule(
            module,
            last=s == n - 1,
            copy_shared_outputs=copy_shared_outputs,
            autocast_dtype=autocast_dtype,
        )
        for s, module in enumerate(_stage_modules(graph, chain, layout))
    ]


def check_span(graph: LayerGraph, layout: Layout) -> None:
    """The plan's cut positions span the traced model's operations, or one line: the plan is another model's."""
    end = len(operations(graph))
    if layout.cut_positions[0] != 0 or layout.cut_positions[-1] != end:
        raise PlanError(
            f"the plan's cut positions {list(layout.cut_positions)} do not span this model's {end} nodes; "
            "was the plan made for another model?"
        )


def _stage_order(graph: LayerGraph, stage_of_node: dict[str, int]) -> list[str]:
    """The traced order of the operations sorted by their stage (stable), after checking the assignment against
    the model: it names the model's operations (as many as the cut positions span: every one), stages never
    decrease along an edge, and only single tensors cross."""
    ops = operations(graph)
    unknown = sorted(set(stage_of_node) - set(ops))
    if unknown:
        raise PlanError(
            f"the plan's stage_of_node names '{unknown[0]}', which is not an operation of this model; "
            "was the plan made for another model?"
        )
    for name in ops:
        for i in graph.node(name).inputs:
            if i not in stage_of_node or stage_of_node[i] == stage_of_node[name]:
                continue
            if stage_of_node[i] > stage_of_node[name]:
                raise PlanError(
                    f"stage_of_node puts '{i}' on stage {stage_of_node[i]} and its reader '{name}' on stage "
                    f"{stage_of_node[name]}: stages must not decrease along the graph's edges"
                )
            if not graph.node(i).is_tensor:
                raise PlanError(
                    f"stage_of_node puts '{i}', which is not one tensor, on stage {stage_of_node[i]} and its "
                    f"reader '{name}' on stage {stage_of_node[name]}: a stage can send only single tensors"
                )
    return sorted(ops, key=lambda name: stage_of_node[name])


def _stage_modules(graph: LayerGraph, chain: Chain, layout: Layout) -> list[nn.Module]:
    """Each stage's piece, or with a remat plan the stage's blocks run following it (apply_remat)."""
    if not layout.remat:
        return [piece(chain, s, s + 1) for s in range(len(chain))]
    positions = sorted(set(layout.cut_positions).union(*(r.positions for r in layout.remat if r is not None)))
    fine = linearize(graph, positions=positions[1:-1])
    index = {p: k for k, p in enumerate(positions)}
    modules: list[nn.Module] = []
    for s, r in enumerate(layout.remat):
        first, stop = index[layout.cut_positions[s]], index[layout.cut_positions[s + 1]]
        if r is None:
            modules.append(piece(fine, first, stop))
        elif [index[p] for p in r.positions] != list(range(first, stop + 1)):
            raise PlanError(f"stage {s}'s remat positions {list(r.positions)} overlap another stage's blocks")
        else:
            modules.append(apply_remat(fine, r.plan.shifted(first)))
    return modules


def local_stages(layout: Layout, pp_rank: int) -> list[int]:
    """The stage indices a pipeline rank holds, in increasing order (loop or V placement of the schedule)."""
    placement = stage_placement(layout.schedule, layout.pp, layout.stages_per_rank)
    return [s for s, r in enumerate(placement) if r == pp_rank]


def _args(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def stage_io(
    stages: Sequence[StageModule], micro_batch: Sequence[torch.Tensor]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Example (inputs, outputs) of every stage for one micro-batch, as PipelineStage's input_args/output_args.

    Float tensors between stages carry `requires_grad=True` on both sides (a mismatch hangs the schedule);
    integer and boolean tensors (masks, token ids) carry none. The model's own inputs need no gradient.
    """

    def marked(ts: tuple[torch.Tensor, ...], grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in ts)

    io = []
    args: tuple[torch.Tensor, ...] = tuple(micro_batch)
    with torch.no_grad():
        for s, stage in enumerate(stages):
            out = _args(stage(*args))
            io.append((marked(args, grad=s > 0), marked(out, grad=True)))
            args = out
    return io


@dataclass(frozen=True)
class TiedParameter:
    """A parameter used by several stages (tied embeddings): its name in each stage that holds a copy.

    Names differ between stages (`transformer.wte.weight` in the first, `lm_head.weight` in the last).
    """

    names: dict[int, str]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted(self.names))


def tied_parameters(stages: Sequence[StageModule]) -> list[TiedParameter]:
    """Parameters that appear in more than one stage; their gradients must be summed across those stages."""
    holders: dict[int, dict[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.piece.named_parameters(remove_duplicate=True):
            holders.setdefault(id(p), {}).setdefault(s, name)
    tied = [TiedParameter(names) for names in holders.values() if len(names) > 1]
    return sorted(tied, key=lambda t: min(t.names.items()))
