"""`pyplan show`: the plan's figures as data, and the command's tables and JSON."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from rich.console import Console

from pyplan.api import PlanSearch
from pyplan.cli.main import main
from pyplan.emit.planfile import PlanFile, write_plan_file
from pyplan.hardware.cluster import Cluster
from pyplan.plan import Workload
from pyplan.report.show import STAGE_COLUMNS, _inert, boundary_send_s, render_show, show_data, text_bar, time_rows
from pyplan.units import fmt_bytes, fmt_seconds
from tests.report.conftest import PipelinePlan


def test_show_data_of_a_searched_plan(searched: tuple[PlanFile, PlanSearch]) -> None:
    document, _ = searched
    plan, data = document.plan, show_data(document)
    pred = plan.predicted

    # The stages cover the chain's blocks in order, each with its rank and times.
    stages = data["stages"]
    assert [s["stage"] for s in stages] == list(range(plan.layout.num_stages))
    assert stages[0]["first_block"] == 0
    assert all(a["last_block"] + 1 == b["first_block"] for a, b in pairwise(stages))
    assert all(s["blocks"] == s["last_block"] - s["first_block"] + 1 > 0 for s in stages)
    assert [s["forward_s"] for s in stages] == [s.forward_s for s in plan.stages]

    # Memory per GPU of the pipeline: the stages it holds, against the A100's 80 GiB.
    memory = data["memory"]
    assert len(memory) == plan.layout.pp
    assert sorted(s for m in memory for s in m["stages"]) == list(range(plan.layout.num_stages))
    assert max(m["used_bytes"] for m in memory) == pytest.approx(pred.peak_memory_bytes, rel=1e-12)
    assert all(m["capacity_bytes"] == 80 * 2**30 for m in memory)

    # The time breakdown adds up to the iteration.
    assert sum(s for _, s in time_rows(data)) == pytest.approx(pred.iteration_s, rel=1e-12)
    assert data["time"]["bubble_fraction"] == pred.bubble_fraction

    # Cost with its currency, per iteration, per 1M samples and per epoch (1000 samples of 16: 63 iterations).
    cost = data["cost"]
    assert cost["currency"] == "USD"
    assert cost["per_iteration"] == pred.cost_per_iteration
    assert cost["per_million_samples"] == pytest.approx(pred.cost_per_iteration * 1e6 / 16)
    assert cost["iterations_per_epoch"] == math.ceil(1000 / 16)
    assert cost["per_epoch"] == pytest.approx(pred.cost_per_iteration * 63)
    json.dumps(data)  # plain data


def test_boundary_sends_come_back_from_the_stage_times(pipeline_plan: PipelinePlan) -> None:
    plan, sends = pipeline_plan("1F1B", 4, 8)
    assert boundary_send_s(plan.stages) == pytest.approx(sends, rel=1e-9)
    assert boundary_send_s(plan.stages[:1]) == []


def test_text_bar() -> None:
    assert text_bar(0, 80) == "░" * 20
    assert text_bar(80, 80) == "█" * 20
    assert text_bar(120, 80) == "█" * 20
    assert text_bar(40, 80) == "█" * 10 + "░" * 10
    assert text_bar(61.2, 80) == "█" * 15 + "▎" + "░" * 4  # 15.3 cells
    assert all(len(text_bar(x, 7)) == 20 for x in (0.0, 0.01, 3.3, 6.99, 7.0))


def _write(tmp_path: Path, document: PlanFile) -> str:
    path = tmp_path / "plan.json"
    write_plan_file(path, document)
    return str(path)


def test_cli_show_prints_the_stages_and_the_memory_bars(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    cluster: Cluster,
    pipeline_plan: PipelinePlan,
) -> None:
    plan, _ = pipeline_plan("GPipe", 4, 6, stage_memory_bytes=55e9)
    document = PlanFile(model="zoo:gpt-tiny", workload=Workload(global_batch=24), cluster=cluster, plan=plan)
    assert main(["show", _write(tmp_path, document)]) == 0
    out = capsys.readouterr().out
    for first, last in ((0, 2), (3, 5), (6, 8), (9, 11)):
        assert f"{first}..{last}" in out
    # 55 GB of 85.9 GB is 64.0 %: 12.8 cells of 20.
    assert out.count("████████████▊░░░░░░░ 51.2 GiB / 80 GiB (64.0%)") == 4
    for part in ("compute", "pipeline bubble", "exposed communication", "optimizer", "USD"):
        assert part in out


def test_cli_show_json_is_show_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], searched: tuple[PlanFile, PlanSearch]
) -> None:
    document, _ = searched
    assert main(["show", _write(tmp_path, document), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(show_data(document)))


def test_cli_show_of_a_missing_file_is_an_input_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1


def test_show_prints_the_plan_files_strings_as_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cluster: Cluster, pipeline_plan: PipelinePlan
) -> None:
    """A plan file can neither style the terminal (rich markup) nor move it (control characters)."""
    plan, _ = pipeline_plan("GPipe", 4, 6, stage_memory_bytes=55e9)
    model = "/tmp/[bold red]evil[/bold red].py"
    document = PlanFile(model=model, workload=Workload(global_batch=24), cluster=cluster, plan=plan)
    assert main(["show", _write(tmp_path, document)]) == 0
    assert "[bold red]evil[/bold red]" in capsys.readouterr().out
    shown = _inert({"gpu": "a100\x1b[5m[blink]x[/blink]", "n": [1.5, "[b]"]})
    assert shown == {"gpu": "a100\\x1b[5m\\[blink]x\\[/blink]", "n": [1.5, "\\[b]"]}


def _shown(document: PlanFile, width: int) -> str:
    console = Console(width=width, record=True, emoji=False)
    render_show(show_data(document), console)
    return console.export_text()


def test_show_at_80_columns_cuts_no_header_or_figure(cluster: Cluster, pipeline_plan: PipelinePlan) -> None:
    """Too wide for one table at 80 columns, the stages are shown as two (times, memory), every figure whole."""
    plan, _ = pipeline_plan("Interleaved1F1B", 4, 8, stages_per_rank=2, stage_memory_bytes=25e9)
    document = PlanFile(model="zoo:gpt-tiny", workload=Workload(global_batch=32), cluster=cluster, plan=plan)
    assert "stages: memory" not in _shown(document, 160)
    text = _shown(document, 80)
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    assert "stages: times per micro-batch" in text and "stages: memory" in text
    for header in (*STAGE_COLUMNS, "used / capacity"):
        assert re.search(rf"┃ +{re.escape(header)} +┃", text), header
    for st in plan.stages:
        for figure in (fmt_seconds(st.forward_s), fmt_seconds(st.backward_s), fmt_bytes(st.memory_bytes)):
            assert figure in text
    assert f"{fmt_bytes(50e9)} / 80 GiB (58.2%)" in text


def test_show_of_one_stage_has_no_schedule_placement_or_bubble(cluster: Cluster, pipeline_plan: PipelinePlan) -> None:
    plan, _ = pipeline_plan("1F1B", 1, 1)
    document = PlanFile(model="zoo:gpt-tiny", workload=Workload(global_batch=4), cluster=cluster, plan=plan)
    text = _shown(document, 160)
    assert "dp 2 x pp 1: one stage, no pipeline" in text
    assert not any(word in text for word in ("1F1B", "placement", "bubble", "schedule"))
    assert "pipeline bubble" in _shown(replace(document, plan=pipeline_plan("1F1B", 2, 2)[0]), 160)
