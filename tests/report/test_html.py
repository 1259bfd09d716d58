"""The HTML report's page and schedule chart, read as markup: the title wraps and keeps the full name, every compute
box carries its micro-batch, and a ZeRO-3 plan draws each block's all-gathers and reduce-scatter beside its compute
where the plan priced them (not pixels: the structure and the labels)."""

from __future__ import annotations

import itertools
import random
import re
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import replace
from html.parser import HTMLParser

import pytest
import torch

from pyplan.api import PlanSearch, search
from pyplan.emit.planfile import PlanFile
from pyplan.hardware.cluster import Cluster
from pyplan.load import load_model
from pyplan.plan import Workload
from pyplan.report.chart import schedule_chart
from pyplan.report.html import html_report
from pyplan.report.zero3 import ALL_GATHER, COMPUTE, REDUCE_SCATTER, dp_span, zero3_detail, zero3_events
from pyplan.runtime.units import zero3_overlap
from pyplan.solve.schedules import simulate
from tests.report.conftest import PipelinePlan

LONG_NAME = "hf:" + ",".join(f"option_number_{k}=value_{k}" for k in range(12))


def _svg(page: str) -> ET.Element:
    """The page's one inline SVG, parsed as XML (it must be well formed)."""
    (svg,) = re.findall(r"<svg\b.*?</svg>", page, re.S)
    return ET.fromstring(svg)


def _title(node: ET.Element) -> str:
    found = node.find("title")
    return found.text or "" if found is not None else ""


class _Headings(HTMLParser):
    """The text of the page's h1 and the attributes of the elements inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.text = ""
        self.spans: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "h1":
            self.inside = True
        elif self.inside:
            self.spans.append(dict(attrs))

    def handle_endtag(self, tag: str) -> None:
        if tag == "h1":
            self.inside = False

    def handle_data(self, data: str) -> None:
        if self.inside:
            self.text += data


@pytest.fixture(scope="module")
def zero3() -> tuple[PlanFile, PlanSearch]:
    """gpt-tiny (meta) on 4 A100s under ZeRO-3: 4 replicas of one stage, 2 micro-batches each."""
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 4, price_per_gpu_hour=2.0, currency="USD")
    workload = Workload(global_batch=16)
    found = search(model, spec.example_inputs, cluster, workload, zero_stages=(3,), pipeline_ranks=(1,),
                   data_parallel=(4,), num_microbatches=(2,), loss=spec.loss, target=spec.target)  # fmt: skip
    return PlanFile(model="zoo:gpt-tiny", workload=workload, cluster=cluster, plan=found.best), found


def test_a_long_model_name_wraps_and_keeps_its_full_name_on_hover(searched: tuple[PlanFile, PlanSearch]) -> None:
    document, result = searched
    page = html_report(replace(document, model=LONG_NAME), search=result)
    headings = _Headings()
    headings.feed(page)
    assert LONG_NAME in headings.text
    (span,) = headings.spans
    assert span["class"] == "model" and span["title"] == LONG_NAME
    # The title wraps anywhere (a name has no spaces), the name itself ellipsizes within the page's width.
    assert re.search(r"h1 \{[^}]*overflow-wrap: anywhere", page)
    assert re.search(r"h1 \.model \{[^}]*text-overflow: ellipsis[^}]*white-space: nowrap", page, re.S)
    # Text cells wrap too (the summary holds the name); wide tables scroll inside the page instead of widening it.
    assert re.search(r"td\.l \{[^}]*overflow-wrap: anywhere", page)
    assert page.count('<div class="scroll"><table>') == page.count("<table>")
    # The chart's title is HTML (it wraps), the chart no wider than the page and scaled down on a narrower one.
    assert re.search(r'<p class="chart-title">[^<]+</p>', page)
    assert int(_svg(page).get("width", "0")) <= 1200
    assert re.search(r"\.chart svg \{[^}]*max-width: 100%", page)


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"),
    [("GPipe", 4, 6, 1), ("1F1B", 4, 8, 1), ("Interleaved1F1B", 2, 4, 2), ("1F1B", 8, 32, 1)],
)
def test_every_compute_box_carries_its_microbatch(
    searched: tuple[PlanFile, PlanSearch], pipeline_plan: PipelinePlan, schedule: str, pp: int, m: int, v: int
) -> None:
    """One box per simulated action; its number drawn where it fits (on every box of these pipelines but the
    longest, where the narrowest boxes give it in their hover text only) and always in its hover text."""
    document, _ = searched
    plan, _ = pipeline_plan(schedule, pp, m, stages_per_rank=v, exposed_comm_s=5e-4)
    svg = _svg(html_report(replace(document, plan=plan)))
    boxes = [g for g in svg.iter("g") if "box" in g.get("class", "").split()]
    sim = simulate(schedule, [s.forward_s for s in plan.stages], [s.backward_s for s in plan.stages],
                   num_microbatches=m, stages_per_rank=v)  # fmt: skip
    drawn = Counter((g.get("class", "").split()[1], int(g.get("data-stage", "-1")), int(g.get("data-microbatch", "-1")))
                    for g in boxes)  # fmt: skip
    assert drawn == Counter((e.op, e.stage, e.microbatch) for e in sim.events)
    labelled = 0
    for g in boxes:
        mb = g.get("data-microbatch")
        assert f"micro-batch {mb}," in _title(g)
        (outline,) = [r for r in g.iter("rect") if r.get("class") == "outline"]
        numbers = [t.text for t in g.iter("text") if t.get("class") == "mb"]
        fits = float(outline.get("width", "0")) >= 6.6 * len(str(mb)) + 4
        assert numbers == ([mb] if fits else [])
        labelled += bool(numbers)
    if pp * m <= 32:
        assert labelled == len(boxes)
    else:
        assert 0 < labelled < len(boxes)


def test_a_zero3_plan_draws_each_blocks_collectives_beside_its_compute(zero3: tuple[PlanFile, PlanSearch]) -> None:
    document, found = zero3
    plan = document.plan
    assert (plan.layout.zero_stage, plan.layout.dp, plan.layout.pp, plan.layout.num_microbatches) == (3, 4, 1, 2)
    page = html_report(document, search=found)
    svg = _svg(page)
    n, m = len(found.chain.blocks), plan.layout.num_microbatches
    blocks, b = found.chain.blocks, plan.layout.micro_batch_size
    timed = {
        "F": [i for i in range(n) if blocks[i].fwd_time_s(b) > 0],
        "B": [i for i in range(n) if blocks[i].bwd_time_s(b) > 0],
    }
    assert len(timed["F"]) > n // 2
    boxes = [g for g in svg.iter("g") if "box" in g.get("class", "").split()]
    assert Counter(g.get("class") for g in boxes) == {"box F": m, "box B": m}
    for g in boxes:
        cut = [int(r.get("data-block", "-1")) for r in g.iter("rect") if r.get("class") == "block"]
        assert sorted(cut) == timed[g.get("class", "")[-1]]  # the box cut into the chain's blocks that take time
        assert all(
            f"micro-batch {g.get('data-microbatch')}," in _title(r) for r in g.iter("rect") if r.get("class") == "block"
        )
    gathers = [r for r in svg.iter("rect") if r.get("class") == ALL_GATHER]
    scatters = [r for r in svg.iter("rect") if r.get("class") == REDUCE_SCATTER]
    # Each block's weights gathered for its forward and its backward, its gradients reduce-scattered, per micro-batch.
    assert Counter((r.get("data-pass"), r.get("data-block"), r.get("data-microbatch")) for r in gathers) == {
        (p, str(i), str(k)): 1 for p in ("F", "B") for i in range(n) for k in range(m)
    }
    assert Counter((r.get("data-block"), r.get("data-microbatch")) for r in scatters) == {
        (str(i), str(k)): 1 for i in range(n) for k in range(m)
    }
    name = found.chain.blocks[5].name
    assert any(f"all-gather of block 5 ({name})'s weights for its forward, micro-batch 1" in _title(r) for r in gathers)
    assert any(f"reduce-scatter of block 5 ({name})'s gradients, micro-batch 0" in _title(r) for r in scatters)

    # Beside its compute: a block's all-gather ends before its compute starts, its reduce-scatter starts after it ends.
    def span(r: ET.Element) -> tuple[float, float]:
        x = float(r.get("x", "0"))
        return x, x + float(r.get("width", "0"))

    compute = {
        (g.get("class", "")[-1], r.get("data-block"), g.get("data-microbatch")): span(r)
        for g in boxes
        for r in g.iter("rect")
        if r.get("class") == "block"
    }
    for r in gathers:
        key = (r.get("data-pass", ""), r.get("data-block", ""), r.get("data-microbatch", ""))
        assert key not in compute or span(r)[1] <= compute[key][0] + 0.01
    for r in scatters:
        key = ("B", r.get("data-block", ""), r.get("data-microbatch", ""))
        assert key not in compute or span(r)[0] >= compute[key][1] - 0.01
    # The legend and the note say what the lane is.
    assert "all-gather of a block&#x27;s weights" in page and "reduce-scatter of a block&#x27;s gradients" in page
    assert "on the lane under the compute" in page


def test_the_chart_is_the_overlap_the_plan_priced(zero3: tuple[PlanFile, PlanSearch]) -> None:
    """The blocks' shares of each pass add up to the stage's priced forward and backward, and are zero3_overlap's."""
    document, found = zero3
    plan = document.plan
    detail = zero3_detail(plan, found.chain, document.cluster, document.workload)
    assert detail is not None and detail.dp == 4
    (stage,) = plan.stages
    assert sum(detail.forward_share_s) == pytest.approx(stage.forward_s, rel=1e-9)
    assert sum(detail.backward_share_s) == pytest.approx(stage.backward_s, rel=1e-9)
    # Another cluster's links price other collectives: not this plan's, so nothing is drawn.
    slow = Cluster.from_catalog("a100-80g", 16, gpus_per_node=2)
    assert zero3_detail(plan, found.chain, slow, document.workload) is None
    # Without the search's blocks (pyplan show --report) the chart says where they are drawn.
    page = html_report(document)
    assert not [r for r in _svg(page).iter("rect") if r.get("class") in (ALL_GATHER, REDUCE_SCATTER)]
    assert "write the report with `pyplan plan ... --report`" in page
    chart = schedule_chart(plan, detail)
    assert "ZeRO-3 over 4 replicas" in chart.title


def test_a_zero3_plan_that_recomputes_its_units_ends_each_backward_in_the_recomputation() -> None:
    """Every unit checkpointed: the blocks' shares as priced, then what the plan adds (recomputation) at the box's
    end, said in its hover text and the legend."""
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    cluster, workload = Cluster.from_catalog("a100-80g", 4), Workload(global_batch=16)
    pins = {"zero_stages": (3,), "pipeline_ranks": (1,), "data_parallel": (4,), "num_microbatches": (1,)}
    found = search(
        model, spec.example_inputs, cluster, workload, remat="full", loss=spec.loss, target=spec.target, **pins
    )
    plan = found.best
    (stage,) = plan.stages
    assert stage.recompute_s > 0
    page = html_report(PlanFile(model="zoo:gpt-tiny", workload=workload, cluster=cluster, plan=plan), search=found)
    svg = _svg(page)
    (backward,) = [g for g in svg.iter("g") if g.get("class") == "box B"]
    (rest,) = [r for r in backward.iter("rect") if r.get("class") == "rest"]
    (outline,) = [r for r in backward.iter("rect") if r.get("class") == "outline"]
    assert "recomputation" in _title(rest)
    assert float(rest.get("x", "0")) + float(rest.get("width", "0")) == pytest.approx(
        float(outline.get("x", "0")) + float(outline.get("width", "0")), abs=0.02
    )
    px_per_s = float(outline.get("width", "0")) / stage.backward_s
    assert float(rest.get("width", "0")) == pytest.approx(stage.recompute_s * px_per_s, abs=0.02)
    assert [g for g in svg.iter("g") if g.get("class") == "box F" and any(r.get("class") == "rest" for r in g)] == []
    assert "faded: what the plan adds to the blocks" in page


def test_zero3_events_replay_zero3_overlap() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 7)
        f = [rng.uniform(0.0, 2.0) for _ in range(n)]
        b = [rng.uniform(0.0, 4.0) for _ in range(n)]
        g = [rng.uniform(0.0, 1.5) for _ in range(n)]
        s = [rng.uniform(0.0, 1.5) for _ in range(n)]
        forward, backward, shares_f, shares_b = zero3_events(f, b, g, s)
        want_f, want_b = zero3_overlap(f, b, g, s)
        assert shares_f == pytest.approx(want_f) and shares_b == pytest.approx(want_b)
        for spans, compute_s in ((forward, f), (backward, b)):
            work = {x.block: x for x in spans if x.kind == COMPUTE}
            assert [work[i].end_s - work[i].start_s for i in range(n)] == pytest.approx(compute_s)
            link = sorted((x for x in spans if x.kind != COMPUTE), key=lambda x: x.start_s)
            # One link: its collectives one after another; the compute on one stream.
            assert all(a.end_s <= z.start_s + 1e-12 for a, z in itertools.pairwise(link))
            order = sorted(work.values(), key=lambda x: x.start_s)
            assert all(a.end_s <= z.start_s + 1e-12 for a, z in itertools.pairwise(order))
            for x in link:
                if x.kind == ALL_GATHER:
                    assert x.end_s <= work[x.block].start_s + 1e-12
                else:
                    assert x.start_s >= work[x.block].end_s - 1e-12
        # The pass ends with the last reduce-scatter: the backward's shares add up to it.
        assert sum(shares_b) == pytest.approx(max(x.end_s for x in backward))
        assert sum(shares_f) == pytest.approx(max(x.end_s for x in forward if x.kind == COMPUTE))


def test_dp_span_lays_replicas_on_nodes_as_the_search_does() -> None:
    assert dp_span(4, 1, 8, "pp-inner") == (4, 1)
    assert dp_span(16, 1, 8, "pp-inner") == (8, 2)
    assert dp_span(3, 1, 2, "pp-inner") == (1, 3)  # runs of 2 and 1 GPUs on a node
    assert dp_span(4, 2, 4, "pp-inner") == (2, 2)  # rank r's replicas are GPUs r, r+2, r+4, r+6
    assert dp_span(4, 2, 4, "dp-inner") == (4, 1)
    # Across nodes the chart prices what the search priced (the stage's forward matches, else no detail).
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 16, gpus_per_node=8)
    workload = Workload(global_batch=16)
    found = search(model, spec.example_inputs, cluster, workload, zero_stages=(3,), pipeline_ranks=(1,),
                   data_parallel=(16,), loss=spec.loss, target=spec.target)  # fmt: skip
    detail = zero3_detail(found.best, found.chain, cluster, workload)
    assert detail is not None and detail.dp == 16
