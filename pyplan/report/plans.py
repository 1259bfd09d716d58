"""`pyplan plan`: the chosen plan and its alternatives as a table that fits the terminal.

A plan of one pipeline stage has no schedule, placement or bubble to show: `-` there, and no such columns when no
row has a pipeline. The planner ranks plans predicted within a tie of each other by fewer GPUs, then less memory, so
a row can be a little faster than one ranked above it: the caption then says so.

Where the full table is wider than the console, it is narrowed step by step, never by cutting a number: short
headers first, then short schedule and placement names, then `v` folded into `pp` (4x2), then the columns a
decision needs least dropped (bubble, GPUs, samples/s, placement), each change named in the caption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from pyplan.plan import Plan
from pyplan.units import fmt_bytes, fmt_seconds

__all__ = ["render_plans"]

_SHORT_HEADERS = {
    "micro-batch": "b",
    "memory/GPU": "mem/GPU",
    "iteration": "iter",
    "samples/s": "smp/s",
    "schedule": "sched",
    "ZeRO": "Z",
    "placement": "place",
}
_SHORT_SCHEDULES = {"Interleaved1F1B": "I1F1B", "LoopedBFS": "LBFS"}  # the searched schedules with long names
_SHORT_PLACEMENTS = {"pp-inner": "pp", "dp-inner": "dp"}
_DROPPED_LAST = ("bubble", "GPUs", "samples/s", "placement")  # dropped in this order where the table is too wide
_PIPELINE_ONLY = ("v", "schedule", "placement", "bubble")  # `-` on a row of one stage, gone when every row has one


def _cost(plan: Plan) -> str:
    p = plan.predicted
    return f"{p.cost_per_iteration:.4g} {p.currency}" if p.currency else "-"


@dataclass
class _Column:
    name: str
    cells: list[str]
    left: bool = False
    header: str = ""

    def width(self) -> int:
        return max(len(self.header or self.name), *(len(c) for c in self.cells))


def _columns(
    plans: Sequence[Plan], *, short_names: bool, fold_v: bool, tp_searched: bool, ep_searched: bool = False
) -> list[_Column]:
    schedule: Callable[[str], str] = (lambda s: _SHORT_SCHEDULES.get(s, s)) if short_names else (lambda s: s)
    placement: Callable[[str], str] = (lambda s: _SHORT_PLACEMENTS.get(s, s)) if short_names else (lambda s: s)
    lays, preds = [p.layout for p in plans], [p.predicted for p in plans]
    pp = [f"{x.pp}x{x.stages_per_rank}" if fold_v and x.stages_per_rank > 1 else str(x.pp) for x in lays]
    piped = [x.pp > 1 for x in lays]
    columns = [
        _Column("#", ["best" if i == 0 else str(i) for i in range(len(plans))]),
        _Column("GPUs", [str(x.num_gpus) for x in lays]),
        _Column("dp", [str(x.dp) for x in lays]),
        _Column("ep", [str(x.ep) for x in lays]),
        _Column("tp", [f"{x.tp}{'+SP' if x.sequence_parallel else ''}" for x in lays]),
        _Column("pp", pp),
        _Column("v", [str(x.stages_per_rank) for x in lays]),
        _Column("micro-batch", [str(x.micro_batch_size) for x in lays]),
        _Column("GA", [str(x.num_microbatches) for x in lays]),
        _Column("schedule", [schedule(x.schedule) for x in lays], left=True),
        _Column("ZeRO", [str(x.zero_stage) for x in lays]),
        _Column("placement", [placement(x.placement) for x in lays], left=True),
        _Column("iteration", [fmt_seconds(p.iteration_s) for p in preds]),
        _Column("samples/s", [f"{p.samples_per_s:.4g}" for p in preds]),
        _Column("memory/GPU", [fmt_bytes(p.peak_memory_bytes) for p in preds]),
        _Column("bubble", [f"{p.bubble_fraction:.1%}" for p in preds]),
        _Column("cost/iter", [_cost(p) for p in plans]),
    ]
    for c in columns:
        if c.name in _PIPELINE_ONLY:
            c.cells = [cell if pipe else "-" for cell, pipe in zip(c.cells, piped)]
    if not any(piped):
        columns = [c for c in columns if c.name not in _PIPELINE_ONLY]
    if fold_v:
        columns = [c for c in columns if c.name != "v"]
    if not tp_searched and all(x.tp == 1 for x in lays):
        columns = [c for c in columns if c.name != "tp"]
    if not ep_searched and all(x.ep == 1 for x in lays):
        columns = [c for c in columns if c.name != "ep"]
    if all(c == "-" for c in columns[-1].cells):
        columns.pop()  # no prices: no cost column
    return columns


def _table_width(columns: Sequence[_Column]) -> int:
    return sum(c.width() + 3 for c in columns) + 1  # a cell's padding and border, and the last border


def _fitted(
    plans: Sequence[Plan], width: int, *, tp_searched: bool = False, ep_searched: bool = False
) -> tuple[list[_Column], list[str]]:
    """The columns of the widest table that fits `width`, and what was changed to make it fit."""
    notes: list[str] = []
    short_headers = short_names = fold_v = False
    dropped: list[str] = []

    def build() -> list[_Column]:
        columns = _columns(plans, short_names=short_names, fold_v=fold_v, tp_searched=tp_searched,
                           ep_searched=ep_searched)  # fmt: skip
        for c in columns:
            c.header = _SHORT_HEADERS.get(c.name, c.name) if short_headers else c.name
        return [c for c in columns if c.name not in dropped]

    columns = build()
    steps = ["headers", "names", "fold", *_DROPPED_LAST]
    while _table_width(columns) > width and steps:
        step = steps.pop(0)
        if step == "headers":
            short_headers = True
            notes.append("b = micro-batch, Z = ZeRO stage")
        elif step == "names":
            short_names = True
            shortened = sorted({s for p in plans if (s := p.layout.schedule) in _SHORT_SCHEDULES})
            if shortened:
                notes.append(", ".join(f"{_SHORT_SCHEDULES[s]} = {s}" for s in shortened))
        elif step == "fold":
            fold_v = True
            if any(p.layout.stages_per_rank > 1 for p in plans):
                notes.append("pp PxV: P ranks with V stages each")
        else:
            dropped.append(step)
        columns = build()
    if dropped:
        notes.append(f"not shown for the width: {', '.join(dropped)} (--json has every figure)")
    return columns, notes


def _ties(plans: Sequence[Plan]) -> list[str]:
    """A note naming the rows ranked below a plan they beat on time and equal or beat on cost: under any objective
    (time, cost, cost + w·time) those were ties, which the planner breaks by fewer GPUs, then less memory."""
    faster: dict[int, float] = {}
    for j in range(1, len(plans)):
        pj = plans[j].predicted
        for above in plans[:j]:
            pa = above.predicted
            if pj.iteration_s < pa.iteration_s and pj.cost_per_iteration <= pa.cost_per_iteration:
                faster[j] = max(faster.get(j, 0.0), 1 - pj.iteration_s / pa.iteration_s)
    if not faster:
        return []
    rows = ", ".join(map(str, faster))
    verb = "is" if len(faster) == 1 else "are"
    return [
        f"{'row' if len(faster) == 1 else 'rows'} {rows} {verb} up to {max(faster.values()) * 100:.2g} % faster than "
        "a row above: a tie, ranked by fewer GPUs, then less memory"
    ]


def render_plans(
    plans: Sequence[Plan],
    console: Console,
    *,
    title: str,
    memory_bytes: float,
    tp_searched: bool = False,
    ep_searched: bool = False,
) -> None:
    """One row per plan, the chosen one first: layout, time, throughput, memory per GPU, bubble, cost; as many
    columns as the console's width holds, numbers never cut. `tp_searched`: tensor parallelism was in the space,
    so its column shows even where every row has none; `ep_searched` likewise expert parallelism (the ep column: of
    the dp replicas, how many split each mixture-of-experts layer's experts)."""
    columns, notes = _fitted(plans, console.width, tp_searched=tp_searched, ep_searched=ep_searched)
    if any(c.name in _PIPELINE_ONLY and "-" in c.cells for c in columns):
        notes.insert(0, "-: one stage, no pipeline")
    caption = "; ".join([f"memory per GPU planned against {fmt_bytes(memory_bytes)}", *notes, *_ties(plans)])
    table = Table(title=title, caption=caption)
    for c in columns:
        table.add_column(c.header, justify="left" if c.left else "right", no_wrap=True)
    for i in range(len(plans)):
        table.add_row(*(c.cells[i] for c in columns))
    console.print(table)
