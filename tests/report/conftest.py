"""Plans to report on: one searched for gpt-tiny on 8 A100s, and hand-made pipelines with known times."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pyplan.api import PlanSearch, search
from pyplan.emit.planfile import PlanFile
from pyplan.hardware.cluster import Cluster
from pyplan.load import load_model
from pyplan.plan import Layout, Plan, Prediction, StagePlan, Workload
from pyplan.solve.schedules import simulate, stage_placement

PRICE_PER_GPU_HOUR = 2.0


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    return Cluster.from_catalog("a100-80g", 8, price_per_gpu_hour=PRICE_PER_GPU_HOUR, currency="USD")


@pytest.fixture(scope="session")
def searched(cluster: Cluster) -> tuple[PlanFile, PlanSearch]:
    """The best plan for gpt-tiny (built on the meta device) as a plan.json document, and its search."""
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    workload = Workload(global_batch=16, dataset_samples=1000)
    result = search(model, spec.example_inputs, cluster, workload, top_k=20)
    return PlanFile(model="zoo:gpt-tiny", workload=workload, cluster=cluster, plan=result.best), result


PipelinePlan = Callable[..., tuple[Plan, list[float]]]


@pytest.fixture
def pipeline_plan() -> PipelinePlan:
    """A factory of pipeline plans with seeded stage times and boundary sends, predicted by the simulator the
    way the planner predicts them; returns the plan and its sends."""

    def make(
        schedule: str,
        pp: int,
        num_microbatches: int,
        *,
        stages_per_rank: int = 1,
        dp: int = 2,
        stage_memory_bytes: float = 12e9,
        exposed_comm_s: float = 0.0,
        optimizer_s: float = 1e-3,
        seed: int = 0,
    ) -> tuple[Plan, list[float]]:
        rng = random.Random(seed)
        num_stages = pp * stages_per_rank
        fwd = [rng.uniform(1e-3, 3e-3) for _ in range(num_stages)]
        bwd = [2 * f * rng.uniform(0.8, 1.2) for f in fwd]
        sends = [rng.uniform(1e-4, 4e-4) for _ in range(num_stages - 1)]
        sim = simulate(
            schedule,
            fwd,
            bwd,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            send_forward_s=sends,
            send_backward_s=sends,
        )
        padded = [0.0, *sends, 0.0]
        stages = tuple(
            StagePlan(
                first_block=3 * s,
                last_block=3 * s + 2,
                memory_bytes=stage_memory_bytes,
                state_bytes=stage_memory_bytes / 3,
                activation_bytes=stage_memory_bytes * 2 / 3,
                time_s=fwd[s] + bwd[s] + padded[s] + padded[s + 1],
                in_flight=min(num_microbatches, num_stages - s),
                forward_s=fwd[s],
                backward_s=bwd[s],
            )
            for s in range(num_stages)
        )
        layout = Layout(
            dp=dp,
            pp=pp,
            micro_batch_size=2,
            num_microbatches=num_microbatches,
            schedule=schedule,
            cut_positions=tuple(range(0, 10 * num_stages + 1, 10)),
            stages_per_rank=stages_per_rank,
        )
        ranks = stage_placement(schedule, pp, stages_per_rank)
        iteration_s = sim.makespan_s + exposed_comm_s + optimizer_s
        predicted = Prediction(
            iteration_s=iteration_s,
            samples_per_s=layout.global_batch / iteration_s,
            peak_memory_bytes=max(stage_memory_bytes * ranks.count(r) for r in range(pp)),
            bubble_fraction=sim.bubble_fraction,
            pipeline_s=sim.makespan_s,
            exposed_comm_s=exposed_comm_s,
            optimizer_s=optimizer_s,
            cost_per_iteration=layout.num_gpus * PRICE_PER_GPU_HOUR / 3600 * iteration_s,
            currency="USD",
        )
        return Plan(layout=layout, stages=stages, predicted=predicted), sends

    return make
