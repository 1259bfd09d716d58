"""Layout.stage_of_node: stages assigned per operation, in plan.json and against the model the runtime cuts."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from pyplan import load_model, trace
from pyplan.emit.planfile import PlanFile, plan_file_from_json
from pyplan.errors import PlanError
from pyplan.graph.linearize import operations
from pyplan.hardware import Cluster
from pyplan.plan import Layout, Plan, Prediction, StagePlan, StageRemat, Workload
from pyplan.remat_plan import no_remat
from pyplan.runtime.stages import cut_model

MODEL = "grouped-mlp-tiny"


def _ops() -> list[str]:
    spec = load_model(f"zoo:{MODEL}")
    return operations(trace(spec.build(), spec.example_inputs, batch_size=2))


def _assignment(ops: list[str]) -> dict[str, int]:
    """The last layer of every branch but one on stage 1, with the last branch, the join and the head."""
    late = [n for n in ops if n.startswith("branches_") and n.endswith(("_2", "_3"))]
    tail = ops[ops.index("getitem_7") + 1 :]
    return {n: int(n in late or n in tail) for n in ops}


def _layout(stage_of_node: dict[str, int], **changes: Any) -> Layout:
    counts = [list(stage_of_node.values()).count(s) for s in (0, 1)]
    fields: dict[str, Any] = {
        "dp": 1,
        "pp": 2,
        "micro_batch_size": 2,
        "num_microbatches": 2,
        "schedule": "1F1B",
        "cut_positions": (0, counts[0], counts[0] + counts[1]),
        "stage_of_node": stage_of_node,
    }
    return Layout(**{**fields, **changes})


def _document(layout: Layout) -> dict[str, Any]:
    stages = tuple(StagePlan(0, 0, 0.0, 0.0, 0.0, 0.0, 1) for _ in range(layout.num_stages))
    plan = Plan(layout, stages, Prediction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, ""))
    return PlanFile(f"zoo:{MODEL}", Workload(global_batch=4), Cluster.from_catalog("t4", 2), plan).to_json()


def test_round_trip_through_plan_json() -> None:
    ops = _ops()
    layout = _layout(_assignment(ops))
    data = json.loads(json.dumps(_document(layout)))
    assert data["plan"]["stage_of_node"] == _assignment(ops)
    assert plan_file_from_json(data).plan.layout == layout
    # A layout of contiguous stages writes no stage_of_node, as plan files did before the field.
    contiguous = replace(layout, stage_of_node={})
    assert "stage_of_node" not in contiguous.to_json()
    assert Layout.from_json(contiguous.to_json()) == contiguous


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(stage_of_node=[0, 1]), "layout.stage_of_node: expected an object of node name to stage"),
        (lambda d: d["stage_of_node"].update(stem=2), "stage_of_node['stem'] must be a stage in 0..1, got 2"),
        (lambda d: d["stage_of_node"].update(stem="0"), "stage_of_node['stem'] must be a stage in 0..1, got '0'"),
        (lambda d: d["stage_of_node"].update(stem=True), "stage_of_node['stem'] must be a stage in 0..1, got True"),
        (lambda d: d["stage_of_node"].update(stem=1), "stage_of_node puts 24 operations on stage 0, its cut"),
        (lambda d: d["stage_of_node"].update(extra=0), "stage_of_node puts 26 operations on stage 0, its cut"),
    ],
)
def test_malformed_values_are_one_line_errors(change: Any, message: str) -> None:
    data = json.loads(json.dumps(_document(_layout(_assignment(_ops())))))
    change(data["plan"])
    with pytest.raises(PlanError) as err:
        plan_file_from_json(data, "plan file 'p.json'")
    assert str(err.value).startswith("plan file 'p.json': ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_no_remat_with_stage_of_node() -> None:
    ops = _ops()
    layout = _layout(_assignment(ops))
    remat = tuple(StageRemat(layout.cut_positions[k : k + 2], no_remat(0, 1)) for k in range(2))
    with pytest.raises(PlanError, match="a layout with stage_of_node has no remat plans"):
        replace(layout, remat=remat)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(unknown=m.pop("head")), "stage_of_node names 'unknown', which is not an operation"),
        (lambda m: m.update(stem=1, head=0), "puts 'stem' on stage 1 and its reader 'relu' on stage 0: stages must"),
        (lambda m: m.update(getitem=1, branches_0_0=1, branches_0_1=1),
         "puts 'chunk', which is not one tensor, on stage 0 and its reader 'getitem' on stage 1"),
    ],
)  # fmt: skip
def test_the_runtime_checks_the_assignment_against_the_model(edit: Any, message: str) -> None:
    spec = load_model(f"zoo:{MODEL}")
    stage_of_node = _assignment(_ops())
    edit(stage_of_node)
    with pytest.raises(PlanError) as err:
        cut_model(spec.build(), spec.example_inputs, _layout(stage_of_node))
    assert message in str(err.value) and "\n" not in str(err.value)
