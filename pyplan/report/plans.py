"""`pyplan plan`: the chosen plan and its alternatives as a table."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from pyplan.plan import Plan
from pyplan.report.units import fmt_bytes, fmt_seconds

__all__ = ["render_plans"]


def _cost(plan: Plan) -> str:
    p = plan.predicted
    return f"{p.cost_per_iteration:.4g} {p.currency}" if p.currency else "-"


def render_plans(plans: Sequence[Plan], console: Console, *, title: str, memory_bytes: float) -> None:
    """One row per plan, the chosen one first: layout, time, throughput, memory per GPU, bubble, cost."""
    table = Table(title=title, caption=f"memory per GPU planned against {fmt_bytes(memory_bytes)}")
    for col in (
        "#",
        "GPUs",
        "dp",
        "pp",
        "v",
        "micro-batch",
        "GA",
        "schedule",
        "ZeRO",
        "placement",
        "iteration",
        "samples/s",
        "memory/GPU",
        "bubble",
        "cost/iter",
    ):
        table.add_column(col, justify="left" if col in ("schedule", "placement") else "right")
    for i, plan in enumerate(plans):
        lay, pred = plan.layout, plan.predicted
        table.add_row(
            "best" if i == 0 else str(i),
            str(lay.num_gpus),
            str(lay.dp),
            str(lay.pp),
            str(lay.stages_per_rank),
            str(lay.micro_batch_size),
            str(lay.num_microbatches),
            lay.schedule,
            str(lay.zero_stage),
            lay.placement,
            fmt_seconds(pred.iteration_s),
            f"{pred.samples_per_s:.4g}",
            fmt_bytes(pred.peak_memory_bytes),
            f"{pred.bubble_fraction:.1%}",
            _cost(plan),
        )
    console.print(table)
