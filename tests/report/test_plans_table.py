"""`pyplan plan`'s table fits the console: narrowed step by step, never a number cut."""

from __future__ import annotations

import torch
from rich.console import Console

from pyplan import load_model
from pyplan.api import search
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.report.plans import render_plans
from pyplan.units import fmt_bytes, fmt_seconds


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
