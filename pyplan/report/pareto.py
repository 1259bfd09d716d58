"""Predicted time against cost of a set of plans: the Pareto frontier and the best plan under each `C + w·T`.

The picture is the gradient-accumulation paper's Figure 4 (Huang et al.): one point per feasible
configuration, the frontier of configurations no other beats on both time and cost, and the optimum of the
weighted objective `C_iter + w·T_iter` for w in {0, 2^8, 2^12, 2^16} (cost in the plans' currency, time in
seconds), which are points of that frontier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyplan.errors import PlanError
from pyplan.plan import Plan, PlanSearch
from pyplan.report.figure import new_figure, picture_format, save_figure, time_unit
from pyplan.units import fmt_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_WEIGHTS",
    "frontier",
    "pareto_data",
    "pareto_figure",
    "parse_weights",
    "plans_of",
    "write_pareto",
]

DEFAULT_WEIGHTS: tuple[float, ...] = (0, 2**8, 2**12, 2**16)


def parse_weights(text: str) -> tuple[float, ...]:
    """Weights from the command line: `0,256,4096,65536` or `0,2^8,2^12,2^16`."""
    weights = []
    for item in text.split(","):
        item = item.strip()
        try:
            base, _, power = item.partition("^")
            w = float(base) ** float(power) if power else float(base)
        except ValueError:
            raise PlanError(f"weight '{item}' is not a number (e.g. 0,256,4096 or 0,2^8,2^12)") from None
        if not (w >= 0 and math.isfinite(w)):
            raise PlanError(f"weights of cost + w x time must be finite and non-negative, got {item}")
        weights.append(w)
    return tuple(weights)


def frontier(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Which (time, cost) points are non-dominated: no other point is at most as slow and as dear, and
    strictly better in one. Equal points are all on the frontier (neither dominates the other)."""
    flags = [False] * len(points)
    order = sorted(range(len(points)), key=lambda i: points[i])
    least_cost_faster = math.inf  # the least cost among strictly faster points
    for _, same_time in groupby(order, key=lambda i: points[i][0]):
        group = list(same_time)
        cheapest = points[group[0]][1]  # sorted by cost within the same time
        if cheapest < least_cost_faster:
            for i in group:
                flags[i] = points[i][1] == cheapest
        least_cost_faster = min(least_cost_faster, cheapest)
    return flags


def plans_of(plans: PlanSearch | Sequence[Plan], chosen: Plan | None = None) -> tuple[list[Plan], Plan | None]:
    """The distinct plans to draw and the chosen one: a search gives its best, alternatives and frontier,
    and its best is the chosen plan unless another is given."""
    if isinstance(plans, PlanSearch):
        chosen = plans.best if chosen is None else chosen
        plans = [plans.best, *plans.alternatives, *plans.pareto]
    distinct = list(dict.fromkeys(plans))
    if chosen is not None and chosen not in distinct:
        distinct.append(chosen)
    return distinct, chosen


def _weight_label(w: float) -> str:
    if w > 0 and float(w).is_integer() and int(w) & (int(w) - 1) == 0:
        return f"2^{int(w).bit_length() - 1}"
    return f"{w:g}"


def pareto_data(
    plans: PlanSearch | Sequence[Plan],
    *,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
    chosen: Plan | None = None,
) -> dict[str, Any]:
    """The points (time, cost and layout of each distinct plan), which are on the frontier, which is
    chosen, and the best point under each weight."""
    distinct, chosen = plans_of(plans, chosen)
    if not distinct:
        raise PlanError("no plans to draw: the time/cost picture needs at least one feasible plan")
    currencies = {p.predicted.currency for p in distinct}
    if "" in currencies:
        raise PlanError(
            "the plans have no price, so no cost axis: give --price-per-gpu-hour with --currency, or an --instance"
        )
    if len(currencies) > 1:
        raise PlanError(f"the plans are priced in different currencies ({', '.join(sorted(currencies))})")
    xy = [(p.predicted.iteration_s, p.predicted.cost_per_iteration) for p in distinct]
    on_frontier = frontier(xy)
    points = [
        {
            "index": i,
            "time_s": t,
            "cost": c,
            "gpus": p.layout.num_gpus,
            "dp": p.layout.dp,
            "pp": p.layout.pp,
            "micro_batch_size": p.layout.micro_batch_size,
            "num_microbatches": p.layout.num_microbatches,
            "schedule": p.layout.schedule,
            "zero_stage": p.layout.zero_stage,
            "frontier": on_frontier[i],
            "chosen": p == chosen,
        }
        for i, (p, (t, c)) in enumerate(zip(distinct, xy))
    ]
    best = []
    for w in weights:
        i = min(range(len(xy)), key=lambda k: (xy[k][1] + w * xy[k][0], distinct[k].layout.num_gpus, k))
        best.append({"weight": w, "label": _weight_label(w), "index": i, "objective": xy[i][1] + w * xy[i][0]})
    return {"currency": currencies.pop(), "points": points, "weighted": best}


def pareto_figure(data: dict[str, Any], *, title: str | None = None) -> Figure:
    """Every point in grey, the frontier in orange joined by its staircase, the chosen plan as a star, and
    each weight's best point labelled `w = 2^k`. Axes are logarithmic when a range spans more than 20x."""
    fig = new_figure(8.0, 5.5, what="the time/cost picture")
    ax = fig.add_subplot()
    points = data["points"]
    scale, unit = time_unit(max(p["time_s"] for p in points))
    xs = [p["time_s"] * scale for p in points]
    ys = [p["cost"] for p in points]
    front = sorted((i for i, p in enumerate(points) if p["frontier"]), key=lambda i: (xs[i], ys[i]))
    rest = [i for i, p in enumerate(points) if not p["frontier"]]

    ax.scatter([xs[i] for i in rest], [ys[i] for i in rest], s=14, color="#9e9e9e", label="configuration", gid="rest")
    ax.plot([xs[i] for i in front], [ys[i] for i in front], color="#f28e2b", linewidth=1.2, drawstyle="steps-post")
    ax.scatter(
        [xs[i] for i in front],
        [ys[i] for i in front],
        s=36,
        color="#f28e2b",
        edgecolor="black",
        linewidth=0.5,
        zorder=3,
        label="Pareto frontier",
        gid="frontier",
    )
    for i in front:
        p = points[i]
        ax.annotate(
            f"{p['dp']}x{p['pp']}, {p['num_microbatches']}x{p['micro_batch_size']}",
            (xs[i], ys[i]),
            xytext=(5, -9),
            textcoords="offset points",
            fontsize=7,
            color="#555555",
        )
    chosen = [i for i, p in enumerate(points) if p["chosen"]]
    if chosen:
        ax.scatter(
            [xs[i] for i in chosen],
            [ys[i] for i in chosen],
            s=220,
            marker="*",
            color="#e15759",
            edgecolor="black",
            linewidth=0.6,
            zorder=4,
            label="chosen plan",
            gid="chosen",
        )
    labels: dict[int, list[str]] = {}
    for b in data["weighted"]:
        labels.setdefault(b["index"], []).append(b["label"])
    for n, (i, names) in enumerate(labels.items()):
        ax.annotate(
            "w = " + ", ".join(names),
            (xs[i], ys[i]),
            xytext=(12, 10 + 12 * (n % 2)),
            textcoords="offset points",
            fontsize=8,
            arrowprops={"arrowstyle": "-", "color": "#4e79a7", "linewidth": 0.8},
            color="#4e79a7",
            gid=f"weight-{i}",
        )
    for axis, values in (("x", xs), ("y", ys)):
        positive = [v for v in values if v > 0]
        if positive and max(positive) > 20 * min(positive):
            (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    ax.set_xlabel(f"predicted time per iteration ({unit})")
    ax.set_ylabel(f"predicted cost per iteration ({data['currency']})")
    ax.grid(linewidth=0.3, alpha=0.5)
    if title is None:
        fastest = min(p["time_s"] for p in points)
        title = (
            f"{len(points)} configurations, {len(front)} on the frontier (fastest {fmt_seconds(fastest)}); "
            "labels: dp x pp, micro-batches x size"
        )
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def write_pareto(
    plans: PlanSearch | Sequence[Plan],
    path: str | Path,
    *,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
    chosen: Plan | None = None,
    title: str | None = None,
) -> dict[str, Any]:
    """Draw the time/cost picture of `plans` (a search, or plans) to `path` (.png or .svg, written
    atomically); returns its data (see `pareto_data`)."""
    picture_format(path)
    data = pareto_data(plans, weights=weights, chosen=chosen)
    save_figure(pareto_figure(data, title=title), path)
    return data
