"""Per-operation profile of a chain: each fx operation's roofline seconds in the forward and the backward, the
bytes autograd saves for it and the parameters it reads first, on fake tensors (for the operation-level stage
assignment of pyplan/solve/dag_search.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from pyplan._torch import OpRecorder, run_without_compute, storage_key, tensor_leaves
from pyplan.graph.chain import Chain
from pyplan.graph.linearize import static_closure
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.hardware.catalog import GPU
from pyplan.profile.analytic import OpCost, Roofline, op_class
from pyplan.profile.memory import SavedRecorder
from pyplan.solve.dag_search import NodeProfile

__all__ = ["node_profile"]

# The machine balance (FLOP per byte) assumed for the per-operation estimate when the GPU has no roofline figures
# (`local` before `pyplan calibrate`); only ratios inside a block matter. 10 is a typical CPU's.
_NOMINAL_FLOP_PER_BYTE = 10.0


class _NodeRecorder(SavedRecorder):
    """Runs the traced graph and charges each aten op to the fx node it runs for: forward ops to the node being
    run, backward ops to the node whose forward made the autograd node running them; and each storage saved for
    backward to the node that produced it (SavedRecorder)."""

    def __init__(self, gm: fx.GraphModule, recorder: OpRecorder, exclude: set[int]) -> None:
        super().__init__(gm, exclude)
        self.recorder = recorder
        self.forward_spans: list[tuple[int, int, str]] = []  # (first op, end, node) in recorder.ops
        self.backward_marks: list[tuple[int, str]] = []  # (first op, node): from here on the ops are the node's
        self.owner: dict[Any, str] = {}  # autograd node -> fx node

    def run_node(self, n: fx.Node) -> Any:
        start = len(self.recorder.ops)
        result = super().run_node(n)
        self.forward_spans.append((start, len(self.recorder.ops), n.name))
        for t in tensor_leaves(result):
            self._own(t.grad_fn, n.name)
        return result

    def _own(self, fn: Any, name: str) -> None:
        """Mark the autograd nodes made by node `name` (those its outputs reach that no earlier node made)."""
        stack = [fn]
        while stack:
            f = stack.pop()
            if f is None or f in self.owner:
                continue
            self.owner[f] = name
            f.register_prehook(self._prehook(name))
            stack.extend(g for g, _ in f.next_functions)

    def _prehook(self, name: str) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            self.backward_marks.append((len(self.recorder.ops), name))

        return hook


def _roofline(gpu: GPU) -> Roofline:
    """The GPU's roofline, or a nominal one of _NOMINAL_FLOP_PER_BYTE when it has no figures."""
    if gpu.peak_flops_per_s and gpu.hbm_bw_bytes_per_s:
        return Roofline.from_gpu(gpu)
    bw = 1e11
    return Roofline({k: _NOMINAL_FLOP_PER_BYTE * bw for k in ("fp64", "fp32", "bf16", "fp16")}, bw)


def node_profile(chain: Chain, example_inputs: ExampleInputs, batch_size: int, gpu: GPU) -> NodeProfile:
    """Per-operation analytic figures of `chain` at `batch_size` on `gpu`'s roofline: one forward and backward on
    fake tensors."""
    roofline = _roofline(gpu)
    graph, gm = chain.graph, chain.graph.module
    order = chain.order
    index = {name: v for v, name in enumerate(order)}
    inputs = inputs_at(example_inputs, batch_size)

    def run(convert: Callable[[torch.Tensor], torch.Tensor]) -> tuple[_NodeRecorder, list[Any]]:
        exclude = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        with OpRecorder() as ops:
            rec = _NodeRecorder(gm, ops, exclude)
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
                out = rec.run(*[convert(t) for t in inputs])
            roots = [t for t in tensor_leaves(out) if t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        return rec, list(ops.ops)

    rec, ops = run_without_compute(gm, run)

    def seconds(first: int, end: int) -> float:
        return sum(
            roofline.op_time_s(OpCost(name, op_class(name), flops, nbytes, dtype, view))
            for name, flops, nbytes, dtype, view, _ in ops[first:end]
        )

    fwd = [0.0] * len(order)
    for first, end, name in rec.forward_spans:
        if name in index:
            fwd[index[name]] += seconds(first, end)
    bwd = [0.0] * len(order)
    marks = [*rec.backward_marks, (len(ops), "")]
    for (first, name), (end, _) in itertools.pairwise(marks):
        if name in index:
            bwd[index[name]] += seconds(first, end)

    # Storages of static nodes count on the first operation that reads them, as memory.py counts them per block.
    owner = {name: name for name in order}
    for name in order:
        for s in static_closure(graph, [name]):
            owner.setdefault(s, name)
    saved = [0.0] * len(order)
    for nbytes, producer in rec.saved.values():
        if producer in owner:
            saved[index[owner[producer]]] += nbytes

    counted: set[int] = set()
    params, tensors = [0] * len(order), [0] * len(order)
    for v, name in enumerate(order):
        for p in _parameters(chain, name):
            if id(p) not in counted:
                counted.add(id(p))
                params[v] += p.numel()
                tensors[v] += 1
    block_of = {name: i for i, b in enumerate(chain.blocks) for name in b.nodes}
    return NodeProfile(
        names=tuple(order),
        block=tuple(block_of[name] for name in order),
        fwd_weight_s=tuple(fwd),
        bwd_weight_s=tuple(bwd),
        saved_bytes=tuple(saved),
        params=tuple(params),
        param_tensors=tuple(tensors),
        batch_size=batch_size,
    )


def _parameters(chain: Chain, name: str) -> list[torch.nn.Parameter]:
    """The parameters operation `name` uses: its module's, and those its static inputs read."""
    graph, gm = chain.graph, chain.graph.module
    out: list[torch.nn.Parameter] = []
    for n in [name, *static_closure(graph, [name])]:
        node = graph.node(n)
        if node.op == "call_module":
            out += [p for _, p in gm.get_submodule(node.target).named_parameters(remove_duplicate=False)]
        elif node.op == "get_attr":
            value: Any = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.nn.Parameter):
                out.append(value)
    return out
