"""The simulated pipeline timeline of a plan: its events as data, then a Gantt chart with one row per rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyplan.errors import PlanError
from pyplan.plan import Plan
from pyplan.report.figure import new_figure, picture_format, save_figure, time_unit
from pyplan.report.show import boundary_send_s, fmt_fraction
from pyplan.solve.schedules import Event, Simulation, simulate, stage_placement
from pyplan.units import fmt_seconds

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Send", "Timeline", "event_gid", "gantt_figure", "timeline", "write_gantt"]

_BACKWARD_OPS = ("B", "I")


@dataclass(frozen=True)
class Send:
    """A tensor on its way between two ranks: the activation after a forward ("F"), or the input gradient
    after a backward ("B" or "I"); it leaves `rank` at `start_s` and has arrived at `end_s`."""

    rank: int
    stage: int
    to_stage: int
    op: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Timeline:
    """One iteration of a plan's pipeline as simulated, for one data-parallel replica.

    `simulation.events` are the compute actions (the boxes of the chart); `sends` the boundary transfers
    (they overlap computation and delay only the receiver); after the makespan every rank waits for the
    exposed part of the gradient sync and then runs the optimizer step.
    """

    schedule: str
    num_ranks: int
    num_microbatches: int
    stage_rank: tuple[int, ...]
    simulation: Simulation
    sends: tuple[Send, ...]
    exposed_comm_s: float
    optimizer_s: float
    predicted_pipeline_s: float
    # Per stage, the share of its forward and backward spent in tensor parallelism's collectives (0 without).
    tp_comm_share: tuple[float, ...] = ()

    @property
    def events(self) -> tuple[Event, ...]:
        return self.simulation.events

    @property
    def iteration_s(self) -> float:
        return self.simulation.makespan_s + self.exposed_comm_s + self.optimizer_s

    def to_json(self) -> dict[str, Any]:
        sim = self.simulation
        return {
            "schedule": self.schedule,
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "stage_rank": list(self.stage_rank),
            "makespan_s": sim.makespan_s,
            "predicted_pipeline_s": self.predicted_pipeline_s,
            "busy_s": list(sim.busy_s),
            "idle_s": list(sim.idle_s),
            "exposed_comm_s": self.exposed_comm_s,
            "optimizer_s": self.optimizer_s,
            "events": [e._asdict() for e in sim.events],
            "sends": [vars(s) for s in self.sends],
            "tp_comm_share": list(self.tp_comm_share),
        }


def timeline(plan: Plan) -> Timeline:
    """Re-simulate `plan`'s pipeline from its layout and its stages' forward and backward times.

    The sends are the planner's own boundary times, recovered from the stages (see `boundary_send_s`), so the
    simulated makespan is the plan's predicted `pipeline_s`. Zero-bubble schedules get a zero weight-gradient
    time, as in the planner, which does not split the backward yet.
    """
    lay, stages = plan.layout, plan.stages
    if not any(s.forward_s > 0 or s.backward_s > 0 for s in stages):
        raise PlanError("the plan has no forward and backward times per stage (an older plan.json): plan it again")
    sends_s = boundary_send_s(stages)
    sim = simulate(
        lay.schedule,
        [s.forward_s for s in stages],
        [s.backward_s for s in stages],
        num_microbatches=lay.num_microbatches,
        stages_per_rank=lay.stages_per_rank,
        backward_weight_s=[0.0] * len(stages),
        send_forward_s=sends_s,
        send_backward_s=sends_s,
    )
    stage_rank = tuple(stage_placement(lay.schedule, lay.pp, lay.stages_per_rank))
    sends = []
    for e in sim.events:
        to = e.stage + 1 if e.op == "F" else e.stage - 1 if e.op in _BACKWARD_OPS else -1
        if 0 <= to < len(stages) and stage_rank[to] != e.rank:
            d = sends_s[min(e.stage, to)]
            if d > 0:
                sends.append(Send(e.rank, e.stage, to, e.op, e.microbatch, e.end_s, e.end_s + d))
    return Timeline(
        schedule=lay.schedule,
        num_ranks=lay.pp,
        num_microbatches=lay.num_microbatches,
        stage_rank=stage_rank,
        simulation=sim,
        sends=tuple(sends),
        exposed_comm_s=plan.predicted.exposed_comm_s,
        optimizer_s=plan.predicted.optimizer_s,
        predicted_pipeline_s=plan.predicted.pipeline_s,
        tp_comm_share=tuple(s.tp_comm_s / (s.forward_s + s.backward_s) if s.tp_comm_s else 0.0 for s in stages),
    )


def event_gid(e: Event) -> str:
    """The id of an event's box in the figure (and in an SVG): `F-r0-s1-m3`."""
    return f"{e.op}-r{e.rank}-s{e.stage}-m{e.microbatch}"


# Row geometry, in row units around the row's centre y = rank (the axis is inverted: larger y is lower).
_BOX = (-0.36, 0.62)  # compute boxes: offset of the top, height
_SEND = (0.30, 0.10)  # the send strip under the boxes
_TP = (-0.36, 0.12)  # the strip along a box's top: its share of tensor-parallel collectives
_WIDTH_IN = 13.0
# tab20's dark/light pairs, less its grey (pair 7), which sends, idle time, sync and the optimizer use;
# more stages than pairs take their colours from the turbo map instead.
_HUES = (0, 1, 2, 3, 4, 5, 6, 8, 9)
# Each stage's (dark, light) colours, by stage.
_Palette = list[tuple[Any, Any]]
# The parts after the pipeline, each (name, seconds, face colour, hatch).
_Tail = list[tuple[str, float, str, str | None]]


def _draw_box(ax: Axes, x: float, w: float, y: float, *, linewidth: float = 0.4, **style: Any) -> None:
    from matplotlib.patches import Rectangle  # optional: matplotlib, only for pictures

    ax.add_patch(Rectangle((x, y + _BOX[0]), w, _BOX[1], linewidth=linewidth, edgecolor="black", **style))


def gantt_figure(tl: Timeline, *, title: str | None = None) -> Figure:
    """The chart: a row per rank, a box per compute action (stage colour; forward light, backward dark,
    weight-gradient hatched) with its micro-batch number, send strips under the boxes, idle gaps left grey, and
    the gradient sync and optimizer step after the pipeline."""
    fig = new_figure(_WIDTH_IN, 1.6 + 0.55 * tl.num_ranks, what="the Gantt chart")
    ax = fig.add_subplot()
    scale, unit = time_unit(tl.iteration_s)
    palette = _stage_colours(len(tl.stage_rank))
    tail = _tail_parts(tl)
    _draw_compute(ax, tl, palette, scale)
    _draw_sends(ax, tl, scale)
    _draw_tail(ax, tl, tail, scale)
    _label_axes(ax, tl, scale, unit, title)
    _legend(fig, tl, palette, tail)
    return fig


def _stage_colours(num_stages: int) -> _Palette:
    """(dark, light) of each stage: tab20's pairs for a few stages, else a spread of turbo and its tint."""
    from matplotlib import colormaps  # optional: matplotlib, only for pictures

    if num_stages <= len(_HUES):
        cmap = colormaps["tab20"]
        return [(cmap(2 * _HUES[stage]), cmap(2 * _HUES[stage] + 1)) for stage in range(num_stages)]
    colours: _Palette = []
    for stage in range(num_stages):
        hue = colormaps["turbo"](0.05 + 0.9 * stage / (num_stages - 1))[:3]
        colours.append((tuple(0.75 * c for c in hue), tuple(0.4 * c + 0.6 for c in hue)))
    return colours


def _tail_parts(tl: Timeline) -> _Tail:
    """What every rank does after the pipeline, in order: (name, seconds, face colour, hatch)."""
    return [("sync", tl.exposed_comm_s, "#bbbbbb", "xx"), ("optimizer", tl.optimizer_s, "#666666", None)]


def _draw_compute(ax: Axes, tl: Timeline, palette: _Palette, scale: float) -> None:
    """Each rank's row grey up to the makespan (idle), then a box per compute action with its micro-batch number
    where the box is wide enough."""
    from matplotlib.patches import Rectangle  # optional: matplotlib, only for pictures

    sim = tl.simulation
    p = tl.num_ranks
    total = tl.iteration_s * scale
    axes_in = _WIDTH_IN - 1.8
    for r in range(p):
        ax.add_patch(
            Rectangle((0, r + _BOX[0]), sim.makespan_s * scale, _BOX[1], facecolor="#eeeeee", edgecolor="none")
        )
    edge = 0.4 if len(sim.events) <= 64 * p else 0.1  # thin outlines where boxes are narrow
    for e in sim.events:
        dark, light = palette[e.stage]
        x, w = e.start_s * scale, (e.end_s - e.start_s) * scale
        face = light if e.op == "F" else dark
        hatch = "////" if e.op == "W" else None
        _draw_box(ax, x, w, e.rank, facecolor=face, hatch=hatch, linewidth=edge, gid=event_gid(e))
        share = tl.tp_comm_share[e.stage] if tl.tp_comm_share and e.op != "W" else 0.0
        if share > 0:  # the collectives interleave with the split layers' compute: shown as the box's share
            ax.add_patch(Rectangle((x + w * (1 - share), e.rank + _TP[0]), w * share, _TP[1], facecolor="black",
                                   edgecolor="none", gid=f"tp-{event_gid(e)}"))  # fmt: skip
        label = str(e.microbatch)
        if total > 0 and w / total * axes_in >= 0.05 + 0.065 * len(label):
            ax.text(
                x + w / 2,
                e.rank + _BOX[0] + _BOX[1] / 2,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="black" if e.op == "F" else "white",
            )


def _draw_sends(ax: Axes, tl: Timeline, scale: float) -> None:
    """A strip under the boxes for each send, from when it leaves its rank to when it has arrived."""
    from matplotlib.patches import Rectangle  # optional: matplotlib, only for pictures

    for s in tl.sends:
        ax.add_patch(
            Rectangle(
                (s.start_s * scale, s.rank + _SEND[0]),
                (s.end_s - s.start_s) * scale,
                _SEND[1],
                facecolor="#555555",
                edgecolor="none",
                alpha=0.6,
                gid=f"send-{s.op}-r{s.rank}-s{s.stage}-m{s.microbatch}",
            )
        )


def _draw_tail(ax: Axes, tl: Timeline, tail: _Tail, scale: float) -> None:
    """The gradient sync and the optimizer step, one after the other on every rank after the makespan."""
    start = tl.simulation.makespan_s
    for name, seconds, face, hatch in tail:
        if seconds <= 0:
            continue
        for r in range(tl.num_ranks):
            _draw_box(ax, start * scale, seconds * scale, r, facecolor=face, hatch=hatch, gid=f"{name}-r{r}")
        start += seconds


def _label_axes(ax: Axes, tl: Timeline, scale: float, unit: str, title: str | None) -> None:
    """Each rank's idle share at the right and its stages at the left, the time axis, and the title (by default
    the schedule, its shape and its times)."""
    sim = tl.simulation
    p = tl.num_ranks
    total = tl.iteration_s * scale
    for r in range(p):
        share = sim.idle_s[r] / sim.makespan_s if sim.makespan_s > 0 else 0.0
        ax.text(1.005, r, f"idle {fmt_fraction(share)}", transform=ax.get_yaxis_transform(), fontsize=8, va="center")

    stages_of = [[s for s, rank in enumerate(tl.stage_rank) if rank == r] for r in range(p)]
    ax.set_yticks(range(p), [f"rank {r}\nstage {','.join(map(str, st))}" for r, st in enumerate(stages_of)])
    ax.set_ylim(p - 0.4, -0.55)
    ax.set_xlim(0, total if total > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title is None:
        title = (
            f"{tl.schedule}: {p} rank(s), {tl.num_microbatches} micro-batches; "
            f"pipeline {fmt_seconds(sim.makespan_s)} (bubble {fmt_fraction(sim.bubble_fraction)}), "
            f"iteration {fmt_seconds(tl.iteration_s)}"
        )
    ax.set_title(title, fontsize=10)


def _legend(fig: Figure, tl: Timeline, palette: _Palette, tail: _Tail) -> None:
    """The legend under the chart: the stages' colours (the first and last only, for many stages), what the
    shades, strips and grey mean, and the weight gradient and tail when the chart has them."""
    from matplotlib.patches import Patch  # optional: matplotlib, only for pictures

    num_stages = len(tl.stage_rank)
    shown = range(num_stages) if num_stages <= 2 * len(_HUES) else (0, num_stages - 1)
    handles = [Patch(facecolor=palette[s][0], edgecolor="black", linewidth=0.4, label=f"stage {s}") for s in shown]
    handles += [
        Patch(facecolor="white", edgecolor="black", linewidth=0.4, label="forward: light, backward: dark"),
        Patch(facecolor="#555555", alpha=0.6, label="send"),
        Patch(facecolor="#eeeeee", label="idle"),
    ]
    if any(tl.tp_comm_share):
        handles.append(Patch(facecolor="black", label="tensor-parallel collectives (share of the box)"))
    if any(e.op == "W" and e.end_s > e.start_s for e in tl.simulation.events):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="weight gradient"))
    handles += [
        Patch(facecolor=face, edgecolor="black", linewidth=0.4, hatch=hatch, label=name)
        for name, seconds, face, hatch in tail
        if seconds > 0
    ]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)


def write_gantt(plan: Plan, path: str | Path, *, title: str | None = None) -> Timeline:
    """Draw `plan`'s simulated timeline to `path` (.png or .svg, written atomically); returns the timeline."""
    picture_format(path)
    tl = timeline(plan)
    save_figure(gantt_figure(tl, title=title), path)
    return tl
