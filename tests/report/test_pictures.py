"""The pictures: the Gantt chart drawn from the simulator's events, the time/cost frontier, the HTML report."""

from __future__ import annotations

import random
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from pyplan.api import PlanSearch
from pyplan.cli.main import main
from pyplan.emit.planfile import PlanFile, write_plan_file
from pyplan.errors import PlanError
from pyplan.plan import Plan
from pyplan.report.gantt import event_gid, gantt_figure, timeline, write_gantt
from pyplan.report.html import html_report, write_html_report
from pyplan.report.pareto import frontier, pareto_data, pareto_figure, parse_weights, write_pareto
from pyplan.solve.schedules import simulate
from tests.report.conftest import PipelinePlan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


needs_matplotlib = pytest.mark.skipif(not _has_matplotlib(), reason="draws pictures: pip install 'pyplan[plot]'")
COMPUTE_GID = re.compile(r"^([FBIW])-r(\d+)-s(\d+)-m(\d+)$")


def _compute_boxes(fig: object) -> dict[str, object]:
    (ax,) = fig.axes  # type: ignore[attr-defined]
    return {p.get_gid(): p for p in ax.patches if p.get_gid() and COMPUTE_GID.match(p.get_gid())}


@needs_matplotlib
@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"),
    [("GPipe", 4, 6, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 2, 4, 2), ("LoopedBFS", 3, 3, 2)],
)
def test_gantt_boxes_are_the_simulated_events(
    pipeline_plan: PipelinePlan, schedule: str, pp: int, m: int, v: int
) -> None:
    plan, sends = pipeline_plan(schedule, pp, m, stages_per_rank=v, exposed_comm_s=5e-4)
    sim = simulate(
        schedule,
        [s.forward_s for s in plan.stages],
        [s.backward_s for s in plan.stages],
        num_microbatches=m,
        stages_per_rank=v,
        send_forward_s=sends,
        send_backward_s=sends,
    )
    tl = timeline(plan)
    # As data: the simulator's events, start and end of each op, and the plan's predicted pipeline time.
    assert [e[:4] for e in tl.events] == [e[:4] for e in sim.events]
    for got, want in zip(tl.events, sim.events):
        assert got.start_s == pytest.approx(want.start_s, rel=1e-9)
        assert got.end_s == pytest.approx(want.end_s, rel=1e-9)
    assert len(tl.events) == 2 * m * pp * v
    assert tl.simulation.makespan_s == pytest.approx(plan.predicted.pipeline_s, rel=1e-9)
    assert tl.iteration_s == pytest.approx(plan.predicted.iteration_s, rel=1e-9)

    # As drawn: one box per event, in its rank's row, from its start to its end.
    boxes = _compute_boxes(gantt_figure(tl))
    assert Counter(int(COMPUTE_GID.match(g).group(2)) for g in boxes) == Counter(e.rank for e in sim.events)
    scale = 1e3  # the axis is in ms for these plans
    for e in tl.events:
        box = boxes[event_gid(e)]
        assert box.get_x() == pytest.approx(e.start_s * scale)
        assert box.get_width() == pytest.approx((e.end_s - e.start_s) * scale)
        assert e.rank - 0.5 < box.get_y() < e.rank + 0.5


@needs_matplotlib
def test_gantt_of_a_searched_plan(tmp_path: Path, searched: tuple[PlanFile, PlanSearch]) -> None:
    _, result = searched
    for plan in (result.best, *result.alternatives):
        tl = timeline(plan)
        assert tl.simulation.makespan_s == pytest.approx(plan.predicted.pipeline_s, rel=1e-9)
    path = tmp_path / "schedule.png"
    write_gantt(result.best, path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000
    assert [p.name for p in tmp_path.iterdir()] == ["schedule.png"]  # no temporary file left


@needs_matplotlib
def test_gantt_svg_has_a_box_per_event(tmp_path: Path, pipeline_plan: PipelinePlan) -> None:
    plan, _ = pipeline_plan("1F1B", 3, 4)
    path = tmp_path / "schedule.svg"
    tl = write_gantt(plan, path)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ids = {el.get("id") for el in root.iter()}
    assert {event_gid(e) for e in tl.events} <= ids


def test_gantt_needs_a_known_picture_format(tmp_path: Path, pipeline_plan: PipelinePlan) -> None:
    plan, _ = pipeline_plan("GPipe", 2, 2)
    with pytest.raises(PlanError, match=r"\.png or \.svg"):
        write_gantt(plan, tmp_path / "schedule.pdf")


def _dominated(i: int, points: list[tuple[float, float]]) -> bool:
    t, c = points[i]
    return any(t2 <= t and c2 <= c and (t2 < t or c2 < c) for t2, c2 in points)


def test_frontier_is_the_non_dominated_points() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        # Few distinct values, so equal times, equal costs and equal points all occur.
        points = [(float(rng.randint(1, 5)), float(rng.randint(1, 5))) for _ in range(n)]
        assert frontier(points) == [not _dominated(i, points) for i in range(n)]


@needs_matplotlib
def test_pareto_of_a_search(searched: tuple[PlanFile, PlanSearch]) -> None:
    _, result = searched
    data = pareto_data(result)
    points = data["points"]
    xy = [(p["time_s"], p["cost"]) for p in points]
    assert [p["frontier"] for p in points] == [not _dominated(i, xy) for i in range(len(xy))]
    # The search's own frontier is on it, its best plan is the chosen one.
    for plan in result.pareto:
        assert any(p["frontier"] for p in points if (p["time_s"], p["cost"]) == _time_cost(plan))
    assert [p["chosen"] for p in points].count(True) == 1 and points[0]["chosen"]
    # The best point of each weight minimizes cost + w * time.
    assert [w["weight"] for w in data["weighted"]] == [0, 256, 4096, 65536]
    for w in data["weighted"]:
        least = min(c + w["weight"] * t for t, c in xy)
        assert w["objective"] == pytest.approx(least, rel=1e-12)
        assert points[w["index"]]["frontier"]
    # As drawn: the highlighted points are exactly the frontier's.
    (ax,) = pareto_figure(data).axes
    collections = {c.get_gid(): c for c in ax.collections}
    drawn = sorted(float(y) for _, y in collections["frontier"].get_offsets())
    assert drawn == sorted(p["cost"] for p in points if p["frontier"])
    assert len(collections["rest"].get_offsets()) == sum(not p["frontier"] for p in points)
    assert len(collections["chosen"].get_offsets()) == 1


def _time_cost(plan: Plan) -> tuple[float, float]:
    return plan.predicted.iteration_s, plan.predicted.cost_per_iteration


@needs_matplotlib
def test_write_pareto_with_user_weights(tmp_path: Path, searched: tuple[PlanFile, PlanSearch]) -> None:
    _, result = searched
    path = tmp_path / "pareto.svg"
    data = write_pareto([result.best, *result.alternatives], path, weights=parse_weights("0, 2^10"))
    assert [w["label"] for w in data["weighted"]] == ["0", "2^10"]
    assert ET.parse(path).getroot().tag.endswith("svg")
    assert not any(p["chosen"] for p in data["points"])  # plans given without a chosen one


def test_pareto_needs_prices_and_numbers(pipeline_plan: PipelinePlan) -> None:
    plan, _ = pipeline_plan("GPipe", 2, 2)
    unpriced = replace(plan, predicted=replace(plan.predicted, currency=""))
    with pytest.raises(PlanError, match="no price"):
        pareto_data([unpriced])
    with pytest.raises(PlanError, match="not a number"):
        parse_weights("0,fast")
    with pytest.raises(PlanError, match="non-negative"):
        parse_weights("-1")


def _outside_data_uris(page: str) -> str:
    return re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)


@needs_matplotlib
def test_html_report_is_one_self_contained_file(tmp_path: Path, searched: tuple[PlanFile, PlanSearch]) -> None:
    document, result = searched
    path = tmp_path / "report.html"
    write_html_report(document, path, search=result)
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    page = path.read_text()
    assert page == html_report(document, search=result)
    rest = _outside_data_uris(page)
    assert "http" not in rest and "//" not in rest  # no link, script, stylesheet or image from elsewhere
    assert not re.search(r"<(script|link|iframe)\b", rest)
    assert page.count('src="data:image/png;base64,') == 1  # the time/cost picture
    assert page.count("<svg") == 1  # the schedule chart, inline (tests/report/test_html.py)
    assert page.count("<table>") == 6  # summary, stages, memory, time, cost, plans ranked
    last = document.plan.stages[-1].last_block
    assert f"0..{document.plan.stages[0].last_block}" in page and f"..{last}</td>" in page
    assert "Pareto" in page or "time/cost" in page


@pytest.fixture
def without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imports of matplotlib fail, as where the `plot` extra is not installed."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.usefixtures("without_matplotlib")
def test_pictures_without_matplotlib_name_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], searched: tuple[PlanFile, PlanSearch]
) -> None:
    document, result = searched
    hint = r"needs matplotlib: pip install 'pyplan\[plot\]'"
    with pytest.raises(PlanError, match=hint):
        write_gantt(document.plan, tmp_path / "g.png")
    with pytest.raises(PlanError, match=hint):
        write_pareto(result, tmp_path / "p.png")
    with pytest.raises(PlanError, match=hint):
        write_html_report(document, tmp_path / "r.html", search=result)  # its time/cost picture
    plan_file = tmp_path / "plan.json"
    write_plan_file(plan_file, document)
    assert main(["show", str(plan_file), "--gantt", str(tmp_path / "g.svg")]) == 2
    assert "pip install 'pyplan[plot]'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
