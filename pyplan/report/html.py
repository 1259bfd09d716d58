"""One self-contained HTML report of a plan: the tables of `pyplan show`, its schedule chart and the time/cost
picture, with inline CSS, the chart as inline SVG (every box with its hover text) and the picture embedded as base64
PNG, so it opens offline."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from pyplan._files import write_atomic
from pyplan.emit.planfile import PlanFile
from pyplan.plan import Plan, PlanSearch
from pyplan.report.chart import Chart, schedule_chart
from pyplan.report.figure import figure_bytes
from pyplan.report.pareto import DEFAULT_WEIGHTS, pareto_data, pareto_figure
from pyplan.report.show import (
    NO_PRICE,
    STAGE_COLUMNS,
    STAGES_CAPTION,
    cost_rows,
    fmt_fraction,
    fmt_money,
    show_data,
    stage_rows,
    state_convention,
    summary_rows,
    time_rows,
)
from pyplan.report.zero3 import zero3_detail
from pyplan.units import fmt_bytes, fmt_seconds

__all__ = ["html_report", "write_html_report"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; overflow-wrap: anywhere; }
h1 .model { display: inline-block; max-width: 100%; overflow: hidden; text-overflow: ellipsis; white-space: nowrap;
            vertical-align: bottom; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; } td.l, th.l { text-align: left; }
td.l { white-space: normal; overflow-wrap: anywhere; }
caption { caption-side: bottom; font-size: 0.8em; color: #666; text-align: left; padding-top: 0.3em; }
.bar { display: inline-block; width: 200px; height: 0.8em; background: #eee; vertical-align: middle;
       margin-right: 0.5em; }
.bar > span { display: block; height: 100%; }
.ok { background: #59a14f; } .warn { background: #edc948; }
.full { background: #e15759; } .time { background: #4e79a7; }
img { max-width: 100%; } .note { color: #666; font-size: 0.85em; }
.chart-title { font-size: 0.95em; margin: 0.4em 0; }
.chart { overflow-x: auto; } .chart svg { display: block; max-width: 100%; height: auto; }
.chart g.box:hover .outline { stroke-width: 2; }
.chart rect.block:hover, .chart rect.all-gather:hover, .chart rect.reduce-scatter:hover, .chart rect.send:hover {
  stroke: #000; stroke-width: 1.2; }
.legend { list-style: none; padding: 0; margin: 0.4em 0; display: flex; flex-wrap: wrap; gap: 0.3em 1.2em;
          font-size: 0.85em; color: #444; }
.legend .swatch { display: inline-block; width: 1.1em; height: 0.8em; margin-right: 0.35em; vertical-align: middle;
                  border: 1px solid #888; }
"""


def _table(
    header: Sequence[str] | None, rows: Sequence[Sequence[str]], *, left: Sequence[int] = (), caption: str = ""
) -> str:
    """An HTML table (no header row when `header` is None); cells are escaped unless they are already markup
    (a `_Markup`); columns in `left` are left-aligned."""

    def cell(tag: str, i: int, value: str) -> str:
        cls = ' class="l"' if i in left else ""
        text = str(value) if isinstance(value, _Markup) else escape(str(value))
        return f"<{tag}{cls}>{text}</{tag}>"

    head = "<thead><tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr></thead>" if header else ""
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f'<div class="scroll"><table>{cap}{head}<tbody>{body}</tbody></table></div>'


class _Markup(str):
    """A table cell that is already HTML."""


def _bar(value: float, total: float, kind: str) -> _Markup:
    share = min(max(value / total, 0.0), 1.0) if total > 0 else 0.0
    return _Markup(f'<span class="bar"><span class="{kind}" style="width: {share * 100:.1f}%"></span></span>')


def _memory_cell(used: float, capacity: float) -> _Markup:
    if not capacity:
        return _Markup(escape(f"{fmt_bytes(used)} (capacity unknown)"))
    share = used / capacity
    kind = "ok" if share < 0.7 else "warn" if share <= 0.9 else "full"
    text = escape(f"{fmt_bytes(used)} / {fmt_bytes(capacity)} ({fmt_fraction(share)})")
    return _Markup(_bar(used, capacity, kind) + text)


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _summary(data: dict[str, Any]) -> str:
    return _table(None, summary_rows(data), left=(0, 1))


def _stages(data: dict[str, Any]) -> str:
    return _table(STAGE_COLUMNS, stage_rows(data), left=(2,), caption=STAGES_CAPTION)


def _memory(data: dict[str, Any]) -> str:
    rows = [
        (
            str(x["rank"]),
            ",".join(map(str, x["stages"])),
            fmt_bytes(x["state_bytes"]),
            fmt_bytes(x["activation_bytes"]),
            _memory_cell(x["used_bytes"], x["capacity_bytes"]),
        )
        for x in data["memory"]
    ]
    header = ("rank", "stages", "state", "act", "used / capacity")
    return _table(header, rows, left=(4,), caption=state_convention(data))


def _time(data: dict[str, Any]) -> str:
    total = data["time"]["iteration_s"]
    rows = [
        (name, fmt_seconds(s), fmt_fraction(s / total if total > 0 else 0.0), _bar(s, total, "time"))
        for name, s in time_rows(data)
    ]
    rows.append(("iteration", fmt_seconds(total), "100%", ""))
    caption = f"{data['time']['samples_per_s']:.4g} samples/s; bubble: idle ranks, waiting for sends included"
    return _table(("part", "time", "share", ""), rows, left=(0, 3), caption=caption)


def _cost(data: dict[str, Any]) -> str:
    rows = cost_rows(data)
    return _table(("per", "cost"), rows, left=(0,)) if rows else f'<p class="note">{escape(NO_PRICE)}.</p>'


def _alternatives(plans: Sequence[Plan]) -> str:
    rows = []
    for i, p in enumerate(plans):
        lay, pred = p.layout, p.predicted
        rows.append(
            (
                "best" if i == 0 else str(i),
                str(lay.num_gpus),
                f"{lay.dp} x {lay.tp}{' + SP' if lay.sequence_parallel else ''} x {lay.pp}",
                str(lay.stages_per_rank),
                f"{lay.num_microbatches} x {lay.micro_batch_size}",
                lay.schedule,
                str(lay.zero_stage),
                lay.placement,
                fmt_seconds(pred.iteration_s),
                f"{pred.samples_per_s:.4g}",
                fmt_bytes(pred.peak_memory_bytes),
                fmt_fraction(pred.bubble_fraction),
                fmt_money(pred.cost_per_iteration, pred.currency),
            )
        )
    header = (
        "#",
        "GPUs",
        "dp x tp x pp",
        "v",
        "GA x micro-batch",
        "schedule",
        "ZeRO",
        "placement",
        "iteration",
        "samples/s",
        "memory/GPU",
        "bubble",
        "cost/iter",
    )
    return _table(header, rows, left=(5, 7))


def _chart(chart: Chart) -> list[str]:
    """The schedule chart: its title (it wraps), the SVG and its legend."""
    legend = "".join(
        f'<li><span class="swatch" style="background: {escape(css)}"></span>{escape(label)}</li>'
        for css, label in chart.legend
    )
    return [
        f'<p class="chart-title">{escape(chart.title)}</p>',
        f'<div class="chart">{chart.svg}</div>',
        f'<ul class="legend">{legend}</ul>',
    ]


def _chart_note(pp: int, sharded: bool, detailed: bool, search: PlanSearch | None) -> str:
    """What the chart shows, in a line: its rows, where to hover, and for ZeRO-3 where the collectives are."""
    rows = "One row per rank of one pipeline replica" if pp > 1 else "One replica (every replica runs the same)"
    text = f"{rows}; hover over a box for its micro-batch{', block' if detailed else ''} and times."
    if sharded and detailed:
        text += (
            " Each block's all-gathers and reduce-scatter run on the lane under the compute, one after another on the"
            " link, where the plan priced them; a box waits (white) where the link is behind."
        )
    elif sharded:
        why = (
            "this plan was not searched on the blocks at hand (tensor parallelism or stages assigned operation by "
            "operation)"
            if search is not None
            else "the per-block times are the search's: write the report with `pyplan plan ... --report`"
        )
        text += f" Its ZeRO-3 collectives are in the boxes' times, not drawn: {why}."
    return f'<p class="note">{escape(text)}</p>'


def html_report(
    document: PlanFile,
    *,
    search: PlanSearch | None = None,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
) -> str:
    """The report as one HTML page: the plan's tables and schedule chart; with `search`, also the plans it
    ranked and, when they are priced, the time/cost picture with the frontier and the best plan per weight."""
    data = show_data(document)
    plan = document.plan
    detail = None
    if search is not None:
        detail = zero3_detail(plan, search.chain, document.cluster, document.workload)
    lay = data["layout"]
    model = data["model"]
    title = f"pyplan: {model} on {lay['num_gpus']} x {data['cluster']['gpu']}"
    parts = [
        f'<h1>pyplan: <span class="model" title="{escape(model)}">{escape(model)}</span> on '
        f"{escape(str(lay['num_gpus']))} x {escape(data['cluster']['gpu'])}</h1>",
        _summary(data),
        "<h2>Stages</h2>",
        _stages(data),
        "<h2>Memory per GPU</h2>",
        _memory(data),
        "<h2>Time per iteration</h2>",
        _time(data),
        "<h2>Cost</h2>",
        _cost(data),
        "<h2>Schedule (simulated)</h2>" if plan.layout.pp == 1 else "<h2>Pipeline schedule (simulated)</h2>",
        *_chart(schedule_chart(plan, detail)),
        _chart_note(plan.layout.pp, plan.layout.zero_stage == 3 and plan.layout.dp > 1, detail is not None, search),
    ]
    if search is not None:
        parts += ["<h2>Plans ranked</h2>", _alternatives([search.best, *search.alternatives])]
        if search.best.predicted.currency:
            pdata = pareto_data(search, weights=weights, chosen=document.plan)
            png = figure_bytes(pareto_figure(pdata), "png", dpi=110)
            parts += [
                "<h2>Time and cost</h2>",
                _image(png, "predicted time against cost, Pareto frontier"),
                '<p class="note">Best plan under cost + w x time for w = '
                + escape(", ".join(b["label"] for b in pdata["weighted"]))
                + ".</p>",
            ]
        else:
            parts.append('<p class="note">No price was given, so no time/cost picture.</p>')
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


def write_html_report(
    document: PlanFile,
    path: str | Path,
    *,
    search: PlanSearch | None = None,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
) -> None:
    """Write `html_report` to `path` atomically."""
    write_atomic(path, html_report(document, search=search, weights=weights))
