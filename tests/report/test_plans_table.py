"""`pyplan plan`'s table fits the console: narrowed step by step, never a number cut."""

from __future__ import annotations

from dataclasses import replace

import torch
from rich.console import Console

from pyplan import load_model
from pyplan.api import search
from pyplan.hardware import Cluster
from pyplan.plan import Plan, Workload
from pyplan.report.plans import render_plans
from pyplan.units import fmt_bytes, fmt_seconds
from tests.report.conftest import PipelinePlan


def test_the_table_fits_80_columns_and_cuts_no_number() -> None:
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 16, price_per_gpu_hour=2.0, currency="USD")
    found = search(model, spec.example_inputs, cluster, Workload(global_batch=64), top_k=6, pipeline_ranks=(4,))
    plans = [found.best, *found.alternatives]
    assert any(p.layout.stages_per_rank > 1 for p in plans)  # an interleaved schedule: the widest names
    for width, dropped in ((200, False), (120, None), (80, True)):
        console = Console(width=width, record=True, emoji=False)
        render_plans(plans, console, title="gpt-tiny", memory_bytes=8e10)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width
        assert "…" not in text
        for p in plans:  # every figure a decision needs, whole
            assert fmt_seconds(p.predicted.iteration_s) in text
            assert fmt_bytes(p.predicted.peak_memory_bytes) in text
            assert f"{p.predicted.cost_per_iteration:.4g} USD" in text
        if dropped is not None:
            assert ("not shown for the width" in " ".join(text.split())) == dropped
    assert "Interleaved1F1B" in text or "I1F1B" in text


def _render(plans: list[Plan], width: int = 200) -> str:
    console = Console(width=width, record=True, emoji=False)
    render_plans(plans, console, title="t", memory_bytes=8e10)
    return console.export_text()


def _timed(plan: Plan, iteration_s: float) -> Plan:
    return replace(plan, predicted=replace(plan.predicted, iteration_s=iteration_s, cost_per_iteration=0.0))


def test_plans_of_one_stage_show_no_schedule_placement_or_bubble(pipeline_plan: PipelinePlan) -> None:
    one, _ = pipeline_plan("1F1B", 1, 1)
    piped, _ = pipeline_plan("GPipe", 2, 4)
    alone = _render([one])
    assert not any(f" {h} " in alone for h in ("schedule", "placement", "bubble", "1F1B", "pp-inner"))
    mixed = _render([one, piped])
    assert "GPipe" in mixed and "-: one stage, no pipeline" in mixed
    row = next(line for line in mixed.splitlines() if "│ best │" in line)
    assert "1F1B" not in row and "pp-inner" not in row and "0.0%" not in row and row.count(" - ") == 4


def test_a_row_faster_than_one_ranked_above_is_named_a_tie(pipeline_plan: PipelinePlan) -> None:
    plan, _ = pipeline_plan("GPipe", 2, 4)
    best, second, third = _timed(plan, 7.59e-3), _timed(plan, 7.58e-3), _timed(plan, 7.60e-3)
    assert "a tie" not in _render([best, third])
    shown = " ".join(_render([best, second, third]).split())
    assert "row 1 is up to 0.13 % faster than a row above: a tie, ranked by fewer GPUs, then less memory" in shown
