"""The HTML report's schedule chart: a plan's simulated timeline as inline SVG, every box with its hover text.

One row per pipeline rank of one replica, a box per compute action in its stage's colour (forward light, backward
dark, weight gradient hatched) carrying its micro-batch number where the number fits and in its hover text always;
strips under the boxes for the boundary sends; grey for idle time; the gradient sync and the optimizer step after
the pipeline. A ZeRO-3 plan's boxes are cut into the chain's blocks, each block's all-gathers and reduce-scatter
drawn on a lane of their own under its compute, where the plan priced them (`pyplan.report.zero3`).
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from html import escape

from pyplan.plan import Plan
from pyplan.report.figure import time_unit
from pyplan.report.gantt import Timeline, timeline
from pyplan.report.show import fmt_fraction
from pyplan.report.zero3 import ALL_GATHER, COMPUTE, REDUCE_SCATTER, Span, Zero3Detail
from pyplan.solve.schedules import Event
from pyplan.units import fmt_seconds

__all__ = ["Chart", "schedule_chart"]

# Geometry in px: the plot between the row labels and the idle shares; each rank's row holds the compute lane, the
# send strip under it and, for ZeRO-3, the collectives' lane.
_WIDTH, _LEFT, _RIGHT, _TOP, _AXIS = 1120, 92, 64, 8, 34
_BOX_H, _SEND_Y, _SEND_H, _LANE_Y, _LANE_H = 26, 28, 4, 35, 12
_FONT_PX, _DIGIT_PX = 11, 6.6  # micro-batch numbers: font size, and the width of a digit at that size
# tab20's (dark, light) pairs, less its grey, which sends, idle time, the sync and the optimizer use.
_TAB20 = (
    ("#1f77b4", "#aec7e8"),
    ("#ff7f0e", "#ffbb78"),
    ("#2ca02c", "#98df8a"),
    ("#d62728", "#ff9896"),
    ("#9467bd", "#c5b0d5"),
    ("#8c564b", "#c49c94"),
    ("#e377c2", "#f7b6d2"),
    ("#bcbd22", "#dbdb8d"),
    ("#17becf", "#9edae5"),
)
_COLLECTIVE_FILL = {ALL_GATHER: "#59a14f", REDUCE_SCATTER: "#b07aa1"}
_SEND_FILL, _IDLE_FILL, _SYNC_FILL, _OPTIMIZER_FILL = "#555555", "#eeeeee", "#bbbbbb", "#666666"
_OP_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}


@dataclass(frozen=True)
class Chart:
    """The chart as the report embeds it: the SVG, its title (HTML text, so it wraps) and the legend's entries
    ((CSS background of the swatch, label))."""

    svg: str
    title: str
    legend: tuple[tuple[str, str], ...]


def schedule_chart(plan: Plan, detail: Zero3Detail | None = None) -> Chart:
    """`plan`'s simulated timeline (`pyplan.report.gantt.timeline`) drawn as SVG; with `detail`, its ZeRO-3
    collectives block by block."""
    tl = timeline(plan)
    blocks = [(st.first_block, st.last_block) for st in plan.stages]
    pitch = _LANE_Y + _LANE_H + 8 if detail else _SEND_Y + _SEND_H + 8
    height = _TOP + pitch * tl.num_ranks + _AXIS
    scale = _Scale(tl.iteration_s)
    palette = _palette(len(tl.stage_rank))
    parts = [
        f'<svg class="schedule" width="{_WIDTH}" height="{height}" '
        f'viewBox="0 0 {_WIDTH} {height}" role="img" font-family="system-ui, sans-serif" font-size="{_FONT_PX}">',
        "<title>" + escape(_title(tl, detail)) + "</title>",
        '<defs><pattern id="hatch" patternUnits="userSpaceOnUse" width="5" height="5" '
        'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="5" stroke="#000" stroke-width="1"/>'
        "</pattern></defs>",
    ]
    parts += _axis(tl, scale, height)
    for r in range(tl.num_ranks):
        parts += _row_frame(tl, r, _TOP + pitch * r, scale, detail is not None)
    for e in tl.events:
        parts += _event(e, _TOP + pitch * e.rank, scale, palette[e.stage], blocks[e.stage], detail)
    for s in tl.sends:
        what = "activation" if s.op == "F" else "input gradient"
        text = (
            f"send: the {what} of micro-batch {s.microbatch} from stage {s.stage} to stage {s.to_stage}, "
            f"{fmt_seconds(s.end_s - s.start_s)}"
        )
        parts.append(
            _rect(
                scale.x(s.start_s),
                _TOP + pitch * s.rank + _SEND_Y,
                scale.w(s.start_s, s.end_s),
                _SEND_H,
                "send",
                _SEND_FILL,
                title=text,
                extra=' fill-opacity="0.6"',
            )
        )
    parts += _tail(tl, scale, pitch)
    parts.append("</svg>")
    svg = "\n".join(parts)
    return Chart(svg=svg, title=_title(tl, detail), legend=_legend(tl, palette, detail, '<rect class="rest"' in svg))


@dataclass(frozen=True)
class _Scale:
    """Seconds to px along the time axis."""

    total_s: float

    def x(self, t: float) -> float:
        return _LEFT + (t / self.total_s if self.total_s > 0 else 0.0) * (_WIDTH - _LEFT - _RIGHT)

    def w(self, start_s: float, end_s: float) -> float:
        return self.x(end_s) - self.x(start_s)


def _palette(num_stages: int) -> list[tuple[str, str]]:
    """(dark, light) of each stage: tab20's pairs for a few stages, else hues spread around the wheel."""
    if num_stages <= len(_TAB20):
        return list(_TAB20[:num_stages])

    def hex_of(rgb: tuple[float, float, float]) -> str:
        return "#" + "".join(f"{round(255 * c):02x}" for c in rgb)

    hues = [0.9 * s / (num_stages - 1) for s in range(num_stages)]
    return [(hex_of(colorsys.hls_to_rgb(h, 0.38, 0.65)), hex_of(colorsys.hls_to_rgb(h, 0.78, 0.7))) for h in hues]


def _title(tl: Timeline, detail: Zero3Detail | None) -> str:
    sim = tl.simulation
    if tl.num_ranks == 1:
        head = f"One stage, {tl.num_microbatches} micro-batch{'es' if tl.num_microbatches > 1 else ''}"
    else:
        head = f"{tl.schedule}: {tl.num_ranks} ranks, {tl.num_microbatches} micro-batches"
        head += f"; pipeline {fmt_seconds(sim.makespan_s)} (bubble {fmt_fraction(sim.bubble_fraction)})"
    head += f", iteration {fmt_seconds(tl.iteration_s)}"
    if detail is not None:
        head += (
            f"; ZeRO-3 over {detail.dp} replicas: each block's weights all-gathered before its forward and its "
            "backward, its gradients reduce-scattered after its backward, beside the compute"
        )
    return head


def _fmt(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".")


def _rect(x: float, y: float, w: float, h: float, cls: str, fill: str, *, title: str = "", extra: str = "") -> str:
    inner = f"<title>{escape(title)}</title>" if title else ""
    attrs = f'class="{cls}" x="{_fmt(x)}" y="{_fmt(y)}" width="{_fmt(max(w, 0.0))}" height="{_fmt(h)}" fill="{fill}"'
    return f"<rect {attrs}{extra}>{inner}</rect>" if inner else f"<rect {attrs}{extra}/>"


def _axis(tl: Timeline, scale: _Scale, height: float) -> list[str]:
    """Vertical grid lines at round times, labelled under the rows in the unit the iteration reads best in."""
    factor, unit = time_unit(tl.iteration_s)
    total = tl.iteration_s * factor
    if total <= 0:
        return []
    step = _nice_step(total / 8)
    out = ['<g class="axis" fill="#444">']
    bottom = height - _AXIS + 4
    for k in range(int(total / step + 1e-9) + 1):
        t = k * step
        x = scale.x(t / factor)
        out.append(f'<line x1="{_fmt(x)}" y1="{_TOP}" x2="{_fmt(x)}" y2="{_fmt(bottom)}" stroke="#ddd"/>')
        out.append(f'<text x="{_fmt(x)}" y="{_fmt(bottom + 13)}" text-anchor="middle">{_tick(t)}</text>')
    out.append(f'<text x="{_fmt(scale.x(tl.iteration_s) + 6)}" y="{_fmt(bottom + 13)}">{escape(unit)}</text>')
    out.append("</g>")
    return out


def _nice_step(raw: float) -> float:
    """The least of 1, 2 and 5 times a power of ten that is at least `raw`."""
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))


def _tick(t: float) -> str:
    return f"{t:.6g}"


def _row_frame(tl: Timeline, r: int, y: float, scale: _Scale, lanes: bool) -> list[str]:
    """A rank's labels (its stages at the left, its idle share at the right) and its idle background."""
    sim = tl.simulation
    stages = ",".join(str(s) for s, rank in enumerate(tl.stage_rank) if rank == r)
    idle = sim.idle_s[r] / sim.makespan_s if sim.makespan_s > 0 else 0.0
    mid = y + _BOX_H / 2
    out = [
        f'<text class="rank" x="{_LEFT - 8}" y="{_fmt(mid - 2)}" text-anchor="end">rank {r}</text>',
        f'<text x="{_LEFT - 8}" y="{_fmt(mid + 11)}" text-anchor="end" fill="#666" font-size="10">'
        f"stage {stages}</text>",
        _rect(
            scale.x(0.0),
            y,
            scale.w(0.0, sim.makespan_s),
            _BOX_H,
            "idle",
            _IDLE_FILL,
            title=f"rank {r}: idle {fmt_fraction(idle)} of the pipeline",
        ),
        f'<text x="{_fmt(scale.x(tl.iteration_s) + 6)}" y="{_fmt(mid + 4)}" fill="#444">'
        f"idle {fmt_fraction(idle)}</text>",
    ]
    if lanes:
        out.append(
            f'<text x="{_LEFT - 8}" y="{_fmt(y + _LANE_Y + _LANE_H - 2)}" text-anchor="end" fill="#666" '
            'font-size="9">collectives</text>'
        )
    return out


def _event(
    e: Event, y: float, scale: _Scale, colours: tuple[str, str], blocks: tuple[int, int], detail: Zero3Detail | None
) -> list[str]:
    """One compute action: its box with its micro-batch number where it fits, and hover text; with `detail`, the
    blocks it runs and their collectives on the lane under it."""
    fill = colours[1] if e.op == "F" else colours[0]
    x, w = scale.x(e.start_s), scale.w(e.start_s, e.end_s)
    text = (
        f"{_OP_NAMES.get(e.op, e.op)} of micro-batch {e.microbatch}, stage {e.stage} on rank {e.rank}: "
        f"{fmt_seconds(e.end_s - e.start_s)} (from {fmt_seconds(e.start_s)} to {fmt_seconds(e.end_s)})"
    )
    out = [
        f'<g class="box {e.op}" data-rank="{e.rank}" data-stage="{e.stage}" data-microbatch="{e.microbatch}">'
        f"<title>{escape(text)}</title>"
    ]
    spans: list[tuple[Span, float, float]] = []
    if detail is not None and e.op in ("F", "B"):
        spans, rest_s = _block_spans(e, blocks, detail)
        out += _blocks(e, y, scale, fill, spans, rest_s, detail.block_names)
    else:
        out.append(_rect(x, y, w, _BOX_H, "compute", fill))
    if e.op == "W":
        out.append(_rect(x, y, w, _BOX_H, "hatch", "url(#hatch)"))
    out.append(_rect(x, y, w, _BOX_H, "outline", "none", extra=' stroke="#000" stroke-width="0.6"'))
    label = str(e.microbatch)
    if w >= _DIGIT_PX * len(label) + 4:
        colour = "#000" if e.op == "F" else "#fff"
        out.append(
            f'<text class="mb" x="{_fmt(x + w / 2)}" y="{_fmt(y + _BOX_H / 2 + 4)}" text-anchor="middle" '
            f'fill="{colour}" pointer-events="none">{label}</text>'
        )
    out.append("</g>")
    if detail is not None:
        out += _collectives(e, y + _LANE_Y, scale, spans, detail.block_names)
    return out


def _blocks(
    e: Event,
    y: float,
    scale: _Scale,
    fill: str,
    spans: list[tuple[Span, float, float]],
    rest_s: float,
    names: tuple[str, ...],
) -> list[str]:
    """A ZeRO-3 box: white where it waits for the link, a box per block's compute, and faded from `rest_s` on, what
    the plan adds to the blocks."""
    name = _OP_NAMES[e.op]
    out = [_rect(scale.x(e.start_s), y, scale.w(e.start_s, e.end_s), _BOX_H, "wait", "#ffffff")]
    if scale.w(rest_s, e.end_s) >= 0.5:
        text = (
            f"{name} of micro-batch {e.microbatch}: {fmt_seconds(e.end_s - rest_s)} the plan adds to the blocks "
            "(the host's costs per stage, recomputation, checkpoint calls)"
        )
        out.append(_rect(scale.x(rest_s), y, scale.w(rest_s, e.end_s), _BOX_H, "rest", fill, title=text,
                         extra=' fill-opacity="0.45"'))  # fmt: skip
    for span, start_s, end_s in spans:
        if span.kind != COMPUTE:
            continue
        text = (
            f"{name} of micro-batch {e.microbatch}, block {span.block} ({names[span.block]}): "
            f"{fmt_seconds(end_s - start_s)}"
        )
        out.append(_rect(scale.x(start_s), y, scale.w(start_s, end_s), _BOX_H, "block", fill, title=text,
                         extra=f' data-block="{span.block}" stroke="#ffffff" stroke-width="0.5"'))  # fmt: skip
    return out


def _collectives(
    e: Event, y: float, scale: _Scale, spans: list[tuple[Span, float, float]], names: tuple[str, ...]
) -> list[str]:
    """The all-gathers and reduce-scatters of a ZeRO-3 box's blocks, on the lane at `y`."""
    out = []
    for span, start_s, end_s in spans:
        if span.kind == COMPUTE:
            continue
        where = f"block {span.block} ({names[span.block]})"
        if span.kind == ALL_GATHER:
            what = f"all-gather of {where}'s weights for its {_OP_NAMES[e.op]}"
        else:
            what = f"reduce-scatter of {where}'s gradients"
        text = f"{what}, micro-batch {e.microbatch}: {fmt_seconds(span.end_s - span.start_s)}"
        attrs = f' data-block="{span.block}" data-microbatch="{e.microbatch}" data-pass="{e.op}"'
        out.append(_rect(scale.x(start_s), y, scale.w(start_s, end_s), _LANE_H, span.kind,
                         _COLLECTIVE_FILL[span.kind], title=text,
                         extra=attrs + ' stroke="#ffffff" stroke-width="0.5"'))  # fmt: skip
    return out


def _block_spans(
    e: Event, blocks: tuple[int, int], detail: Zero3Detail
) -> tuple[list[tuple[Span, float, float]], float]:
    """The spans of the blocks of `e`'s stage in its pass, each with its start and end on the chart's clock (the
    pass's events shifted to where the stage's box starts, clipped to the box: in a pipeline the next stage's first
    all-gather is issued during this stage's last block), and where the blocks' shares end: the rest of the box is
    what the plan adds to them (the host's costs per stage, recomputation and checkpoint calls)."""
    first, last = blocks
    if e.op == "F":
        spans, shares = detail.forward, detail.forward_share_s
        base = sum(shares[:first])
    else:
        spans, shares = detail.backward, detail.backward_share_s
        base = sum(shares[last + 1 :])
    out = []
    for span in spans:
        if not first <= span.block <= last:
            continue
        start = min(max(e.start_s + span.start_s - base, e.start_s), e.end_s)
        end = min(max(e.start_s + span.end_s - base, e.start_s), e.end_s)
        if end > start:
            out.append((span, start, end))
    return out, min(e.start_s + sum(shares[first : last + 1]), e.end_s)


def _tail(tl: Timeline, scale: _Scale, pitch: float) -> list[str]:
    """The exposed gradient sync, then the optimizer step, on every rank after the pipeline."""
    out = []
    start = tl.simulation.makespan_s
    for cls, seconds, fill, text in (
        ("sync", tl.exposed_comm_s, _SYNC_FILL, "gradient sync (exposed)"),
        ("optimizer", tl.optimizer_s, _OPTIMIZER_FILL, "optimizer step"),
    ):
        if seconds <= 0:
            continue
        for r in range(tl.num_ranks):
            y = _TOP + pitch * r
            out.append(
                _rect(
                    scale.x(start),
                    y,
                    scale.w(start, start + seconds),
                    _BOX_H,
                    cls,
                    fill,
                    title=f"{text}: {fmt_seconds(seconds)}",
                    extra=' stroke="#000" stroke-width="0.6"',
                )
            )
            if cls == "sync":
                out.append(
                    _rect(
                        scale.x(start),
                        y,
                        scale.w(start, start + seconds),
                        _BOX_H,
                        "hatch",
                        "url(#hatch)",
                        extra=' pointer-events="none"',
                    )
                )
        start += seconds
    return out


def _legend(
    tl: Timeline, palette: list[tuple[str, str]], detail: Zero3Detail | None, adds: bool
) -> tuple[tuple[str, str], ...]:
    """The legend's entries: the stages' colours (the first and last only, for many stages), what shades, strips and
    lanes mean (`adds`: a box ends in what the plan adds to its blocks' shares), and the tail's parts the chart
    has."""
    num_stages = len(tl.stage_rank)
    shown = range(num_stages) if num_stages <= 18 else (0, num_stages - 1)
    out = [(palette[s][0], f"stage {s}") for s in shown]
    out.append((f"linear-gradient(90deg, {palette[0][1]} 50%, {palette[0][0]} 50%)", "forward light, backward dark"))
    if any(e.op == "W" and e.end_s > e.start_s for e in tl.events):
        out.append(("repeating-linear-gradient(45deg, #000 0 1px, #fff 1px 4px)", "weight gradient"))
    if tl.sends:
        out.append((_SEND_FILL, "send between stages"))
    out.append((_IDLE_FILL, "idle"))
    if detail is not None:
        out += [
            (_COLLECTIVE_FILL[ALL_GATHER], "all-gather of a block's weights"),
            (_COLLECTIVE_FILL[REDUCE_SCATTER], "reduce-scatter of a block's gradients"),
            ("#ffffff", "white in a box: waiting for the link"),
        ]
    if adds:
        out.append((f"{palette[0][0]}73", "faded: what the plan adds to the blocks (recomputation, host costs)"))
    if tl.exposed_comm_s > 0:
        out.append((_SYNC_FILL, "gradient sync"))
    if tl.optimizer_s > 0:
        out.append((_OPTIMIZER_FILL, "optimizer step"))
    return tuple(out)
