"""`pyplan inspect`: the blocks of a profiled chain with time, FLOPs, parameters and bytes; with --tp how tensor
parallelism splits the model, with --ep how expert parallelism splits its mixture-of-experts layers.

The tables fit the console without cutting a figure: times only where measured, FLOP columns dropped where the
names would otherwise have too little room, and a name too long for its column keeps its distinguishing tail
(`…layers.12.mlp`), or where the tails would collide, is folded over lines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from pyplan.errors import PlanError
from pyplan.graph.chain import Chain
from pyplan.graph.experts import ExpertPlan
from pyplan.graph.sequence_parallel import SequenceZone
from pyplan.graph.tensor_parallel import TpPlan
from pyplan.model_state import model_state_bytes
from pyplan.units import fmt_bytes, fmt_count, fmt_seconds

__all__ = [
    "expert_parallel_data",
    "inspect_data",
    "render_expert_parallel",
    "render_inspect",
    "render_tensor_parallel",
    "tensor_parallel_data",
]


def _at(a: Any, b: int) -> float | None:
    return a(b) if a is not None else None


def inspect_data(
    chain: Chain,
    *,
    model: str,
    batch_size: int,
    device: str,
    threads: int,
    optimizer: str = "adamw",
    precision: str = "fp32",
) -> dict[str, Any]:
    """The JSON document `pyplan inspect --json` prints (keys documented in the README)."""
    b = batch_size
    blocks = []
    for i, blk in enumerate(chain.blocks):
        cut = chain.cuts[i + 1]
        state = model_state_bytes(blk.param_numel, blk.param_tensors, optimizer=optimizer, precision=precision)
        blocks.append(
            {
                "index": i,
                **blk.to_json(),
                "grad_bytes": state.grad_bytes,
                "optimizer_bytes": state.optimizer_bytes,
                "flops_fwd": _at(blk.flops_fwd, b),
                "flops_bwd": _at(blk.flops_bwd, b),
                "cut_bytes_per_sample": cut.bytes.per_sample,
                "cut_fixed_bytes": cut.bytes.fixed,
                "cut_live": list(cut.live),
                "fwd_time_s": _at(blk.fwd_time_s, b),
                "bwd_time_s": _at(blk.bwd_time_s, b),
            }
        )
    total_state = model_state_bytes(
        chain.param_numel, sum(blk.param_tensors for blk in chain.blocks), optimizer=optimizer, precision=precision
    )
    measured = all(blk.fwd_time_s is not None for blk in chain.blocks)
    saved_inputs = chain.input_saved_bytes(b) if chain.input_saved_bytes else 0.0
    return {
        "model": model,
        "batch_size": b,
        "device": device if measured else "meta (not timed)",
        "threads": threads,
        "measured": measured,
        "params": chain.param_numel,
        "param_bytes": sum(blk.param_bytes for blk in chain.blocks),
        "optimizer": optimizer,
        "precision": precision,
        "model_state_bytes": vars(total_state),
        "flops_fwd": sum(x["flops_fwd"] or 0.0 for x in blocks),
        "flops_bwd": sum(x["flops_bwd"] or 0.0 for x in blocks),
        "activation_bytes": saved_inputs + sum(_at(blk.saved_bytes, b) or 0.0 for blk in chain.blocks),
        "input_saved_bytes": saved_inputs,
        "fwd_time_s": sum(x["fwd_time_s"] for x in blocks) if measured else None,
        "bwd_time_s": sum(x["bwd_time_s"] for x in blocks) if measured else None,
        "blocks": blocks,
    }


MIN_NAME = 12  # the fewest columns a name is given before figures are dropped for it


def shortened(names: Sequence[str], room: int) -> list[str] | None:
    """`names` fitted to `room` columns: each too long keeps its tail from a dot (`…layers.12.mlp`), or its last
    characters; None where two different names would then read the same."""
    out = []
    for name in names:
        if len(name) <= room:
            out.append(name)
            continue
        parts = name.split(".")
        tails = (".".join(parts[k:]) for k in range(1, len(parts)))
        tail = next((t for t in tails if len(t) < room), name[len(name) - room + 1 :])
        out.append(f"…{tail}")
    return out if len(set(out)) == len(set(names)) else None


def _width(table: Table, console: Console) -> int:
    """The columns the table takes with no cell wrapped."""
    return Measurement.get(console, console.options.update_width(10**4), table).maximum


def _inspect_table(data: dict[str, Any], columns: Sequence[str], names: Sequence[str], fold: bool) -> Table:
    b = data["batch_size"]
    where = f"{data['device']}, {data['threads']} thread(s)" if data["measured"] else data["device"]
    table = Table(
        title=f"{data['model']}: {len(data['blocks'])} blocks, batch {b}, {where}",
        caption="act: bytes saved for backward; cut: bytes live across the cut after the block (a stage boundary)",
    )
    for col in columns:
        if col == "block":
            table.add_column(col, overflow="fold" if fold else "ellipsis", no_wrap=not fold)
        else:
            table.add_column(col.replace(" ", "\n"), justify="right", no_wrap=True)
    for x, name in zip(data["blocks"], names):
        act = x["activation_bytes_per_sample"] * b + x["activation_fixed_bytes"]
        cut = x["cut_bytes_per_sample"] * b + x["cut_fixed_bytes"]
        cells = {
            "#": str(x["index"]),
            "block": name,
            "params": fmt_count(x["params"]),
            "fwd FLOPs": fmt_count(x["flops_fwd"]),
            "bwd FLOPs": fmt_count(x["flops_bwd"]),
            "act": fmt_bytes(act),
            "cut": fmt_bytes(cut),
            "fwd": fmt_seconds(x["fwd_time_s"]),
            "bwd": fmt_seconds(x["bwd_time_s"]),
        }
        table.add_row(*(cells[c] for c in columns))
    table.add_section()
    total = {
        "block": "total",
        "params": fmt_count(data["params"]),
        "fwd FLOPs": fmt_count(data["flops_fwd"]),
        "bwd FLOPs": fmt_count(data["flops_bwd"]),
        "act": fmt_bytes(data["activation_bytes"]),
        "fwd": fmt_seconds(data["fwd_time_s"]),
        "bwd": fmt_seconds(data["bwd_time_s"]),
    }
    table.add_row(*(total.get(c, "") for c in columns))
    return table


def render_inspect(data: dict[str, Any], console: Console) -> None:
    """Print the inspect table, one row per block and a total row, fitted to the console (see the module)."""
    columns = ["#", "block", "params", "fwd FLOPs", "bwd FLOPs", "act", "cut"]
    columns += ["fwd", "bwd"] if data["measured"] else []
    droppable = ["bwd FLOPs", "fwd FLOPs"]
    names = [x["name"] for x in data["blocks"]]
    longest = max(map(len, names), default=0)
    while True:
        # The block column's room: the console less the other columns (those of a table whose names are blank).
        room = console.width - _width(_inspect_table(data, columns, [""] * len(names), fold=False), console)
        room += len("total")
        if room >= min(longest, MIN_NAME) or not droppable:
            break
        columns.remove(droppable.pop(0))
    short = shortened(names, max(room, len("total")))
    table = _inspect_table(data, columns, short or names, fold=short is None)
    dropped = [c for c in ("fwd FLOPs", "bwd FLOPs") if c not in columns]
    if dropped:
        table.caption = f"{table.caption}; not shown for the width: {', '.join(dropped)} (--json has every figure)"
    console.print(table)


def tensor_parallel_data(plan: TpPlan, zone: SequenceZone, degree: int, vocab_loss: bool = False) -> dict[str, Any]:
    """How the model splits at `degree` (`pyplan inspect --tp`, the "tensor_parallel" key of its JSON): every split
    module's style, fused pieces, every Linear left whole with the reason, sequence parallelism, and whether the
    loss runs on each rank's slice of the vocabulary (`vocab_loss`, `vocab_parallel_loss`)."""
    styles = plan.styles(degree)
    pieces = {m: n for r in plan.regions if r.splits_at(degree) for m, n in r.parts.items()}
    whole = dict(plan.replicated)
    for r in plan.regions:
        if not r.splits_at(degree):
            bad = next(x for x in r.sizes if x % degree)
            whole.update(dict.fromkeys(r.columns + r.rows, f"{degree} does not divide {bad} (heads or features)"))
    for x in (*plan.embeddings, *plan.output_layers):
        if not x.splits_at(degree):
            whole[x.module] = f"{degree} does not divide its vocabulary"
    return {
        "degree": degree,
        "styles": styles,
        "pieces": pieces,
        "whole": whole,
        "sequence_parallel": bool(zone),
        "sequence_parallel_reason": zone.reason,
        "partial_gradients": list(zone.params),
        "region_partial_gradients": list(plan.partial_params(degree)),
        "vocab_parallel_loss": vocab_loss,
    }


def render_tensor_parallel(data: dict[str, Any], console: Console) -> None:
    """Print how the model splits: one row per module, split or whole, then sequence parallelism. Module names and
    styles stay on one line (a long name keeps its tail, as in `render_inspect`); the notes wrap."""
    rows = []
    for module, style in data["styles"].items():
        n = data["pieces"].get(module)
        rows.append((module, style, f"{n} fused pieces, each split" if n else ""))
    whole = [(module, "whole", why) for module, why in data["whole"].items()]
    style_width = max((len(r[1]) for r in rows + whole), default=0)
    note_width = min(max((len(r[2]) for r in rows + whole), default=0), len("3 fused pieces, each split"))
    room = console.width - style_width - max(note_width, len("note")) - 10  # three columns' padding and borders
    modules = [r[0] for r in rows + whole]
    short = shortened(modules, max(room, MIN_NAME))
    names = short or modules
    table = Table(title=f"tensor parallelism {data['degree']}: {len(data['styles'])} modules split")
    table.add_column("module", no_wrap=short is not None, overflow="fold")
    table.add_column("style", no_wrap=True)
    table.add_column("note", overflow="fold")
    for name, (_, style, note) in zip(names, rows):
        table.add_row(name, style, note)
    if whole:
        table.add_section()
        for name, (_, style, note) in zip(names[len(rows) :], whole):
            table.add_row(name, style, note)
    console.print(table)
    if data["region_partial_gradients"]:
        console.print(
            f"{len(data['region_partial_gradients'])} parameters read beside each rank's slice of the heads or "
            "features (a norm per head) have their gradients summed over the ranks"
        )
    if data["sequence_parallel"]:
        console.print(
            f"sequence parallelism: yes; the values between the split layers hold 1/{data['degree']} of the tokens "
            f"({len(data['partial_gradients'])} parameters read there have their gradients summed over the ranks)"
        )
    else:
        console.print(f"sequence parallelism: no; {data['sequence_parallel_reason']}", markup=False)
    if data["vocab_parallel_loss"]:
        console.print(f"loss: on each rank's 1/{data['degree']} of the vocabulary (the logits are never gathered)")
    else:
        console.print(
            "loss: on the logits gathered whole (only pyplan.cross_entropy over a split output layer's logits "
            "runs on each rank's slice of the vocabulary)",
            markup=False,
        )


def expert_parallel_data(plan: ExpertPlan, degree: int, model: str) -> dict[str, Any]:
    """How expert parallelism of `degree` splits the model's mixture-of-experts layers (`pyplan inspect --ep`, the
    "expert_parallel" key of its JSON): every layer's figures (pyplan/graph/experts.py's ExpertLayer) with `splits`
    and `why` it does not, and the modules of experts whose routing was not recognized. One line naming the problem
    and the fix (PlanError) for a degree below 1, a model without experts, or a degree that divides no layer's
    experts."""
    if degree < 1:
        raise PlanError(f"--ep takes a degree of 1 or more (ranks that split each layer's experts), got {degree}")
    if not plan:
        raise PlanError(
            f"--ep: {model} has no mixture-of-experts layer (a router's top-k choice feeding experts that hold one "
            "set of parameters each); leave --ep out"
        )
    counts = sorted({x.num_experts for x in plan.layers})
    if plan.layers and all(x.num_experts % degree for x in plan.layers):
        common = math.gcd(*counts)
        fits = [e for e in range(2, common + 1) if common % e == 0]
        fix = f"choose {', '.join(map(str, fits))}" if fits else "no degree above 1 divides them all"
        raise PlanError(
            f"--ep {degree} divides the experts of no layer ({' or '.join(map(str, counts))} experts); {fix}"
        )
    layers = [
        {
            **x.to_json(),
            "splits": x.splits_at(degree),
            "why": x.why_not(degree),
            "experts_per_rank": x.num_experts // degree if x.splits_at(degree) else x.num_experts,
        }
        for x in plan.layers
    ]
    return {"degree": degree, "layers": layers, "unrouted": dict(plan.unrouted)}


def collapsed(paths: Sequence[str]) -> str:
    """Module paths that differ in one layer number as one (`layers.{0,1,2}.mlp.experts`, `layers.{0..31}.mlp`);
    others as the first and how many more."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split(".") for p in paths]
    differ = [i for i in range(len(split[0])) if len({len(s) for s in split}) == 1 and len({s[i] for s in split}) > 1]
    if len({len(s) for s in split}) != 1 or len(differ) != 1 or not all(s[differ[0]].isdigit() for s in split):
        return f"{paths[0]} (+{len(paths) - 1} more)"
    at = differ[0]
    numbers = sorted(int(s[at]) for s in split)
    run = numbers == list(range(numbers[0], numbers[-1] + 1)) and len(numbers) > 3
    inner = f"{numbers[0]}..{numbers[-1]}" if run else ",".join(map(str, numbers))
    return ".".join([*split[0][:at], f"{{{inner}}}", *split[0][at + 1 :]])


_SAME = ("num_experts", "top_k", "expert_params", "shared_params", "router_params", "gated", "score", "why")


def render_expert_parallel(data: dict[str, Any], console: Console) -> None:
    """Print how expert parallelism splits the model: one row per mixture-of-experts layer, layers with the same
    figures and verdict in one (`collapsed` paths), then why those that do not split do not, and the modules of
    experts whose routing was not recognized."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for x in data["layers"]:
        groups.setdefault(tuple(x[k] for k in _SAME), []).append(x)
    layers = data["layers"]
    scores = sorted({x["score"] or "raw" for x in layers})
    gated = all(x["gated"] for x in layers)
    table = Table(
        title=f"expert parallelism {data['degree']}: {sum(x['splits'] for x in layers)} of {len(layers)} "
        "mixture-of-experts layers split",
        caption=f"params: one routed expert's{' (gated MLPs)' if gated else ''}; router scores: {', '.join(scores)}",
    )
    table.add_column("experts", overflow="fold")
    for name in ("top-k", "params", "shared", "router", "per rank"):
        table.add_column(name, justify="right", no_wrap=True)
    whys = []
    for rows in groups.values():
        x, paths = rows[0], collapsed([r["path"] for r in rows])
        table.add_row(
            paths,
            f"{x['top_k']} of {x['num_experts']}",
            fmt_count(x["expert_params"]),
            fmt_count(x["shared_params"]) if x["shared_params"] else "-",
            fmt_count(x["router_params"]),
            f"{x['experts_per_rank']} experts" if x["splits"] else "all (whole)",
        )
        if not x["splits"]:
            whys.append(f"{paths}: not split: {x['why']}")
    console.print(table)
    for line in whys:
        console.print(line, markup=False)
    for module, why in data["unrouted"].items():
        console.print(f"{module}: holds experts' parameters, left whole: {why}", markup=False)
