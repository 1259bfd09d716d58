"""The receive buffers each pipeline stage holds under every schedule, as measured, against the plan's count.

A torchrun launch of 4 ranks (pp 4, 64 micro-batches, gloo, float64; tests/runtime/conftest.py) runs every schedule
pyplan's runtime runs (tests/runtime/_recv_buffers.py): the most receive buffers alive on each stage when a
computation starts, and the training against one process on the same global batch. torch's own PipelineStage would
hold 64 of each kind on every stage.
"""

from __future__ import annotations

from typing import Any

import pytest

from pyplan import _core
from pyplan.solve.schedules import simulate, stage_placement
from tests.runtime.conftest import Launches

SCHEDULES = {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
PP = 4
TOL = 1e-9  # float64: the rounding of sums taken in another order
# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((PP, "_recv_buffers"),)


@pytest.fixture(scope="module")
def launched(launches: Launches) -> list[dict[str, Any]]:
    """What _recv_buffers.py measured, one record per schedule."""
    records = launches.part(PP, "_recv_buffers").results()
    assert {r["schedule"] for r in records} == SCHEDULES
    return records


@pytest.mark.distributed
def test_each_stage_holds_the_receive_buffers_the_plan_counts(launched: list[dict[str, Any]]) -> None:
    for r in launched:
        v, m, cut = r["v"], r["m"], r["cut_bytes"]
        plan = _core.receive_buffers(r["schedule"], PP, m, v)
        stages = {int(s): kinds for s, kinds in r["stages"].items()}
        assert sorted(stages) == list(range(PP * v))
        for s, kinds in stages.items():
            (inputs, input_bytes), (gradients, gradient_bytes) = kinds["input"], kinds["gradient"]
            where = (r["schedule"], s)
            assert inputs == plan["inputs"][s], (where, inputs, plan["inputs"])
            assert gradients == plan["gradients"][s], (where, gradients, plan["gradients"])
            # One tensor per boundary here: each buffer a micro-batch's input or output gradient.
            assert input_bytes == inputs * cut[s] and gradient_bytes == gradients * cut[s + 1], where


@pytest.mark.distributed
def test_stages_hold_what_is_in_flight_not_every_micro_batch(launched: list[dict[str, Any]]) -> None:
    """Inputs: the micro-batches in flight, and at most one more received ahead of its forward (which the plan's
    buffer_bytes counts beyond the activations); output gradients: one under GPipe and 1F1B."""
    for r in launched:
        v, m = r["v"], r["m"]
        n = simulate(r["schedule"], [1.0] * (PP * v), [1.0] * (PP * v), backward_weight_s=[0.5] * (PP * v),
                     num_microbatches=m, stages_per_rank=v).peak_in_flight  # fmt: skip
        placement = stage_placement(r["schedule"], PP, v)
        for s in range(1, PP * v):
            inputs, gradients = r["stages"][str(s)]["input"][0], r["stages"][str(s - 1)]["gradient"][0]
            if placement[s - 1] != placement[s]:
                assert n[s] <= inputs <= n[s] + 1, (r["schedule"], s, inputs, n[s])
            if v == 1:
                assert gradients == 1, (r["schedule"], s - 1, gradients)
    one_f_one_b = next(r for r in launched if r["schedule"] == "1F1B")
    held = [one_f_one_b["stages"][str(s)]["input"][0] for s in range(PP)]
    assert held == [0, 3, 2, 1]  # torch's PipelineStage: 64 each


@pytest.mark.distributed
def test_pipelines_train_like_one_process(launched: list[dict[str, Any]]) -> None:
    for r in launched:
        assert r["loss"] < TOL and r["grad"] < TOL and r["param"] < TOL, r
