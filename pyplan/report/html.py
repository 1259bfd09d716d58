"""One self-contained HTML report of a plan: the tables of `pyplan show`, its Gantt chart and the time/cost
picture, with inline CSS and the pictures embedded as base64 PNG, so it opens offline."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from pyplan._files import write_atomic
from pyplan.emit.planfile import PlanFile
from pyplan.plan import Plan, PlanSearch
from pyplan.report.figure import figure_bytes
from pyplan.report.gantt import gantt_figure, timeline
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
from pyplan.units import fmt_bytes, fmt_seconds

__all__ = ["html_report", "write_html_report"]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { background: #f5f5f5; } td.l, th.l { text-align: left; }
caption { caption-side: bottom; font-size: 0.8em; color: #666; text-align: left; padding-top: 0.3em; }
.bar { display: inline-block; width: 200px; height: 0.8em; background: #eee; vertical-align: middle;
       margin-right: 0.5em; }
.bar > span { display: block; height: 100%; }
.ok { background: #59a14f; } .warn { background: #edc948; }
.full { background: #e15759; } .time { background: #4e79a7; }
img { max-width: 100%; } .note { color: #666; font-size: 0.85em; }
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
    return f"<table>{cap}{head}<tbody>{body}</tbody></table>"


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


def html_report(
    document: PlanFile,
    *,
    search: PlanSearch | None = None,
    weights: Sequence[float] = DEFAULT_WEIGHTS,
) -> str:
    """The report as one HTML page: the plan's tables and Gantt chart; with `search`, also the plans it
    ranked and, when they are priced, the time/cost picture with the frontier and the best plan per weight."""
    data = show_data(document)
    gantt = timeline(document.plan)
    gantt_png = figure_bytes(gantt_figure(gantt), "png", dpi=110)
    lay = data["layout"]
    title = f"pyplan: {data['model']} on {lay['num_gpus']} x {data['cluster']['gpu']}"
    parts = [
        f"<h1>{escape(title)}</h1>",
        _summary(data),
        "<h2>Stages</h2>",
        _stages(data),
        "<h2>Memory per GPU</h2>",
        _memory(data),
        "<h2>Time per iteration</h2>",
        _time(data),
        "<h2>Cost</h2>",
        _cost(data),
        "<h2>Pipeline schedule (simulated)</h2>",
        _image(gantt_png, "Gantt chart of the simulated pipeline"),
        '<p class="note">One row per rank of one pipeline replica; forward light, backward dark; grey strips '
        "under the boxes are boundary sends; blank stretches are idle time.</p>",
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
