"""`pyplan inspect`: the blocks of a profiled chain with time, FLOPs, parameters and bytes.

The tables fit the console without cutting a figure: times only where measured, FLOP columns dropped where the
names would otherwise have too little room, and a name too long for its column keeps its distinguishing tail
(`…layers.12.mlp`), or where the tails would collide, is folded over lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from pyplan.graph.chain import Chain
from pyplan.graph.sequence_parallel import SequenceZone
from pyplan.graph.tensor_parallel import TpPlan
from pyplan.model_state import model_state_bytes
from pyplan.units import fmt_bytes, fmt_count, fmt_seconds

__all__ = ["inspect_data", "render_inspect", "render_tensor_parallel", "tensor_parallel_data"]


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
