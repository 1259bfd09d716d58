"""Linearize a LayerGraph: find the cut points of its topological order and group nodes into a Chain.

A cut between two nodes is valid when every value live across it (computed before, used after) is a single
tensor: that set is what one pipeline stage sends the next, so a skip connection or an attention mask that
spans the cut rides along instead of being lost. Values that depend on no model input (parameters, buffers
and what is computed from them alone) are never sent; each stage recomputes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import torch

from pyplan.errors import TraceError
from pyplan.graph.chain import Block, Chain, Cut
from pyplan.graph.layergraph import Affine, LayerGraph
from pyplan.graph.masks import is_batch_size
from pyplan.graph.split import batch_carrier

__all__ = ["CutPoints", "cut_points", "linearize", "operations", "static_closure"]


def operations(graph: LayerGraph) -> list[str]:
    """The graph's operations in traced order: every node but placeholders, the output and static values."""
    return [n.name for n in graph.nodes if n.op not in ("placeholder", "output") and not n.static]


def _checked_order(graph: LayerGraph, order: Sequence[str]) -> list[str]:
    """`order` when it lists every operation of `graph` once, each after the operations it reads."""
    ops = set(operations(graph))
    seen: set[str] = set()
    for name in order:
        if name not in ops or name in seen:
            why = "is not an operation of the graph" if name not in ops else "is listed twice"
            raise TraceError(f"the node order names '{name}', which {why}")
        ahead = [i for i in graph.node(name).inputs if i in ops and i not in seen]
        if ahead:
            raise TraceError(f"the node order puts '{name}' before '{ahead[0]}', which it reads")
        seen.add(name)
    if len(seen) != len(ops):
        missing = next(n for n in operations(graph) if n not in seen)
        raise TraceError(f"the node order leaves out the operation '{missing}'")
    return list(order)


class CutPoints:
    """Every cut of the topological order of a graph's non-static nodes, with its live set.

    `cuts[c]` is the cut before `order[c]` (c = len(order): after the last node); `invalid[c]` says why cut c
    cannot be a stage boundary, or is absent when it can. `order` is the traced order unless another topological
    order of the same operations is given (a stage assignment of the DAG, sorted by stage).
    """

    def __init__(self, graph: LayerGraph, order: Sequence[str] | None = None) -> None:
        self.graph = graph
        self.order = operations(graph) if order is None else _checked_order(graph, order)
        n_pos = len(self.order)
        position = {name: i for i, name in enumerate(self.order)}
        for n in graph.nodes:
            if n.op == "placeholder":
                position[n.name] = -1
            elif n.op == "output":
                position[n.name] = n_pos
        last_use: dict[str, int] = {}
        for n in graph.nodes:
            if n.name not in position or n.op == "placeholder":
                continue
            for i in n.inputs:
                if i in position:
                    last_use[i] = max(last_use.get(i, -1), position[n.name])
        self.position = position

        # Sweep the cuts left to right, adding a value after its definition and dropping it after its last use.
        by_def: dict[int, list[str]] = {}
        for name, p in position.items():
            if name in last_use and last_use[name] > p:
                by_def.setdefault(p, []).append(name)
        last_batch_read = _last_batch_read(graph, position)
        live: dict[str, int] = {}
        self.cuts: list[Cut] = []
        self.invalid: dict[int, str] = {}
        for c in range(n_pos + 1):
            for name in by_def.get(c - 1, []):
                live[name] = last_use[name]
            for name in [v for v, last in live.items() if last < c]:
                del live[name]
            names = tuple(sorted(live, key=lambda v: (position[v], v)))
            total = Affine()
            for v in names:
                total = total + graph.node(v).bytes
            self.cuts.append(Cut(position=c, live=names, bytes=total))
            bad = next((v for v in names if not graph.node(v).is_tensor), None)
            if bad is not None and 0 < c < n_pos:
                node = graph.node(bad)
                kind = "no tensor" if not node.outputs else f"{len(node.outputs)} tensors in a container"
                self.invalid[c] = f"value '{bad}' ({node.op} {node.target}, {kind}) is live across it"
            elif 0 < c <= last_batch_read and c < n_pos and batch_carrier(graph, names) is None:
                self.invalid[c] = "the batch size is read after it, and no value live across it grows with the batch"

    def valid(self, c: int) -> bool:
        return c not in self.invalid

    @property
    def candidates(self) -> list[Cut]:
        return [cut for cut in self.cuts if self.valid(cut.position)]


def _last_batch_read(graph: LayerGraph, position: dict[str, int]) -> int:
    """The last position whose node reads the batch size off a model input (directly, or through values computed
    from it alone), -1 where none does: a piece after a cut reads it off a value it receives."""
    if graph.module is None:
        return -1
    derived = {n.name for n in graph.module.graph.nodes if is_batch_size(n)}
    last = -1
    for n in graph.nodes:
        if not any(i in derived for i in n.inputs):
            continue
        if n.static and n.op != "output":
            derived.add(n.name)
        elif n.name in position:
            last = max(last, position[n.name])
    return last


def cut_points(graph: LayerGraph, order: Sequence[str] | None = None) -> CutPoints:
    """Every cut of `graph` (of `order`, when given) with its live set and whether it can be a stage boundary."""
    return CutPoints(graph, order)


def _keys(graph: LayerGraph, order: Sequence[str], depth: int) -> list[str]:
    """Each node's module path cut to `depth` parts; top-level functions join the block before them."""
    keys: list[str | None] = []
    for name in order:
        path = graph.node(name).module_path
        keys.append(".".join(path.split(".")[:depth]) if path else None)
    first = next((k for k in keys if k is not None), "")
    out: list[str] = []
    for k in keys:
        out.append(k if k is not None else (out[-1] if out else first))
    return out


def _boundaries(points: CutPoints, depth: int | None) -> list[int]:
    """The valid cuts where the module key at `depth` changes (every valid cut when depth is None)."""
    n_pos = len(points.order)
    if depth is None:
        inner = [c for c in range(1, n_pos) if points.valid(c)]
    else:
        keys = _keys(points.graph, points.order, depth)
        inner = [c for c in range(1, n_pos) if keys[c - 1] != keys[c] and points.valid(c)]
    return [0, *inner, n_pos]


def _grouped(coarse: Sequence[int], fine: Sequence[int], most: int) -> list[int]:
    """The finer level's blocks (cuts `fine`) taken k at a time inside each block of the coarser one (`coarse`),
    counted from its start, for the least k that gives at most `most` blocks: 128 transformer layers in one
    coarse block become 64 blocks of two, aligned on the first layer; `coarse` where no k does."""
    inside = [[c for c in fine if a < c < b] for a, b in itertools.pairwise(coarse)]
    for k in range(2, max(map(len, inside), default=0) + 2):
        chosen = sorted({*coarse, *(c for cuts in inside for c in cuts[k - 1 :: k])})
        if len(chosen) - 1 <= most:
            return chosen
    return list(coarse)


def _block_name(graph: LayerGraph, nodes: Sequence[str], depth: int | None) -> str:
    """The longest module path shared by the block's nodes, else `first..last`."""
    keys = list(dict.fromkeys(_keys(graph, nodes, depth if depth is not None else 1 << 16)))
    parts = [k.split(".") for k in keys]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if common and common[0]:
        return ".".join(common)
    return keys[0] or "(top)" if len(keys) == 1 else f"{keys[0] or '(top)'}..{keys[-1] or '(top)'}"


def static_closure(graph: LayerGraph, names: Sequence[str]) -> list[str]:
    """Static nodes (get_attr and what is computed from them alone) that `names` read, transitively."""
    seen: dict[str, None] = {}
    stack = [i for n in names for i in graph.node(n).inputs if graph.node(i).static]
    while stack:
        s = stack.pop()
        if s in seen:
            continue
        seen[s] = None
        stack.extend(i for i in graph.node(s).inputs if graph.node(i).static)
    return list(seen)


def _blocks(graph: LayerGraph, order: Sequence[str], positions: Sequence[int], depth: int | None) -> list[Block]:
    """Blocks between consecutive positions, with parameters counted where first used."""
    gm = graph.module
    counted: set[int] = set()
    blocks = []
    for start, stop in itertools.pairwise(positions):
        nodes = tuple(order[start:stop])
        params: dict[str, torch.Tensor] = {}
        buffers: dict[int, torch.Tensor] = {}
        for name in [*nodes, *static_closure(graph, nodes)]:
            node = graph.node(name)
            if node.op == "call_module":
                mod = gm.get_submodule(node.target)
                params.update({f"{node.target}.{k}": p for k, p in mod.named_parameters(remove_duplicate=False)})
                buffers.update({id(b): b for b in mod.buffers()})
            elif node.op == "get_attr":
                value = _get_attr(gm, node.target)
                if isinstance(value, torch.nn.Parameter):
                    params[node.target] = value
                elif isinstance(value, torch.Tensor):
                    buffers[id(value)] = value
        fresh = {}
        for k, p in params.items():
            if id(p) not in counted:
                counted.add(id(p))
                fresh[k] = p
        blocks.append(
            Block(
                name=_block_name(graph, nodes, depth),
                nodes=nodes,
                param_names=tuple(params),
                param_numel=sum(p.numel() for p in fresh.values()),
                param_bytes=sum(p.numel() * p.element_size() for p in fresh.values()),
                param_tensors=len(fresh),
                buffer_bytes=sum(b.numel() * b.element_size() for b in buffers.values()),
            )
        )
    return blocks


def _get_attr(root: torch.nn.Module, target: str) -> object:
    obj: object = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def linearize(
    graph: LayerGraph,
    *,
    min_blocks: int = 16,
    max_blocks: int = 128,
    depth: int | None = None,
    positions: Sequence[int] | None = None,
    order: Sequence[str] | None = None,
) -> Chain:
    """Group the nodes of `graph` into a Chain of blocks.

    By default blocks follow the module hierarchy: the shallowest level of module paths whose valid boundaries
    give at least `min_blocks` blocks, without passing `max_blocks` (e.g. one block per transformer layer of
    GPT-2, one per bottleneck of ResNet-50; finer for small models). Where that level has too few blocks and the
    next too many, the next level's blocks are taken a few at a time (`_grouped`: two layers a block for a
    128-layer GPT). `depth` fixes the level instead; `positions` gives the cuts explicitly (0 and the end are
    added; each must be valid). `order` replaces the traced order of the operations by another topological order
    of them (positions then index it).
    """
    points = cut_points(graph, order)
    n_pos = len(points.order)
    spans = False  # blocks that group several modules of their level
    if n_pos == 0:
        raise TraceError("the traced model has no operations to place on stages")
    if positions is not None:
        chosen = sorted({0, n_pos, *positions})
        bad = [c for c in chosen if not 0 <= c <= n_pos or not points.valid(c)]
        if bad:
            c = bad[0]
            why = points.invalid.get(c, f"it is outside 0..{n_pos}")
            raise TraceError(f"cannot cut before position {c}: {why}; choose a cut from the candidates")
        level = depth
    elif depth is not None:
        chosen, level = _boundaries(points, depth), depth
    else:
        deepest = max((len(graph.node(n).module_path.split(".")) for n in points.order), default=1)
        level, chosen = 1, _boundaries(points, 1)
        for d in range(2, deepest + 1):
            if len(chosen) - 1 >= min_blocks:
                break
            trial = _boundaries(points, d)
            if len(trial) - 1 > max_blocks:
                grouped = _grouped(chosen, trial, max_blocks)
                if len(grouped) > len(chosen):
                    level, chosen, spans = d, grouped, True
                break
            level, chosen = d, trial
    blocks = _blocks(graph, points.order, chosen, level)
    if spans:  # a group of modules is named by its first and last
        for i, b in enumerate(blocks):
            keys = list(dict.fromkeys(_keys(graph, b.nodes, level)))
            if len(keys) > 1 and all(keys):
                blocks[i] = replace(b, name=f"{keys[0]}..{keys[-1]}")
    return Chain(
        blocks=blocks,
        cuts=[points.cuts[c] for c in chosen],
        order=points.order,
        candidates=points.candidates,
        graph=graph,
    )
