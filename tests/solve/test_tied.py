"""Tied parameters: found on the chain, their gradient all-reduce charged where stages on different ranks share them."""

from __future__ import annotations

import pytest

from pyplan import load_model
from pyplan.api import search
from pyplan.graph.chain import Chain
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import trace
from pyplan.hardware import Cluster
from pyplan.hardware.catalog import Link
from pyplan.plan import Layout, Workload
from pyplan.solve.tied import tied_parameters, tied_sync_s

INTRA = Link(
    name="intra", latency_s=1e-5, bw_bytes_per_s=1e11, collective_latency_s=2e-5, collective_bw_bytes_per_s=5e10
)
INTER = Link(
    name="inter", latency_s=1e-4, bw_bytes_per_s=1e10, collective_latency_s=3e-4, collective_bw_bytes_per_s=4e9
)


def _chain(name: str) -> Chain:
    spec = load_model(f"zoo:{name}")
    return linearize(trace(spec.build(), spec.example_inputs, batch_size=4))


@pytest.fixture(scope="module")
def gpt() -> Chain:
    return _chain("gpt-tiny")


def _layout(
    chain: Chain, pp: int, *, dp: int = 1, schedule: str = "1F1B", v: int = 1, placement: str = "pp-inner"
) -> Layout:
    """pp·v stages of about equal block counts."""
    n = pp * v
    cuts = [chain.cuts[round(k * len(chain.blocks) / n)].position for k in range(n + 1)]
    return Layout(
        dp=dp,
        pp=pp,
        micro_batch_size=1,
        num_microbatches=2 * pp,
        schedule=schedule,
        cut_positions=tuple(cuts),
        stages_per_rank=v,
        placement=placement,
    )


def _ring(nbytes: float, ranks: int, link: Link) -> float:
    latency, bw = link.collective
    return 2 * (ranks - 1) * (latency + nbytes / (ranks * bw))


def test_the_tied_embedding_is_found_in_the_first_and_last_blocks(gpt: Chain) -> None:
    (tied,) = tied_parameters(gpt)
    assert tied.numel == 256 * 64  # gpt-tiny's wte, reused by lm_head
    assert tied.blocks[0] == 0 and tied.blocks[-1] == len(gpt.blocks) - 1
    assert len(tied.names) == 2  # transformer.wte.weight and lm_head.weight
    assert tied_parameters(_chain("resnet-tiny")) == []


def test_the_sync_is_a_ring_all_reduce_over_the_ranks_holding_it(gpt: Chain) -> None:
    tied = tied_parameters(gpt)
    nbytes = 256 * 64 * 4.0
    links = {"intra": INTRA, "inter": INTER, "gpus_per_node": 2}
    assert tied_sync_s(_layout(gpt, 1), gpt, tied, 4.0, **links) == 0.0  # one rank holds both uses
    assert tied_sync_s(_layout(gpt, 2), gpt, tied, 4.0, **links) == pytest.approx(_ring(nbytes, 2, INTRA))
    # The V schedule puts the first and the last stage on rank 0: nothing to sum across ranks.
    zbv = _layout(gpt, 2, schedule="ZBVZeroBubble", v=2)
    assert tied_sync_s(zbv, gpt, tied, 4.0, **links) == 0.0
    # Interleaved: the last stage is on the last rank.
    inter = _layout(gpt, 2, schedule="Interleaved1F1B", v=2)
    assert tied_sync_s(inter, gpt, tied, 4.0, **links) == pytest.approx(_ring(nbytes, 2, INTRA))
    # Replicas contiguous ("dp-inner") put pipeline ranks 0 and 1 dp GPUs apart: on two nodes of 2 GPUs.
    far = _layout(gpt, 2, dp=2, placement="dp-inner")
    assert tied_sync_s(far, gpt, tied, 4.0, **links) == pytest.approx(_ring(nbytes, 2, INTER))
    near = _layout(gpt, 2, dp=2, placement="pp-inner")
    assert tied_sync_s(near, gpt, tied, 4.0, **links) == pytest.approx(_ring(nbytes, 2, INTRA))


def test_the_search_charges_it_to_pipelines_only() -> None:
    spec = load_model("zoo:gpt-tiny")
    cluster = Cluster.from_catalog("A100-80GB", 2)
    found = search(spec.build(), spec.example_inputs, cluster, Workload(global_batch=16), top_k=50, stage_dag=False)
    plans = [found.best, *found.alternatives]
    piped = [p for p in plans if p.layout.pp == 2 and p.layout.schedule in ("GPipe", "1F1B")]
    assert piped, "expected a 1 x 2 pipeline among the plans"
    group = cluster.groups[0]
    expected = _ring(256 * 64 * 4.0, 2, group.intra_link)
    for p in piped:
        assert p.predicted.exposed_comm_s >= expected * (1 - 1e-9)
        parts = p.predicted.pipeline_s + p.predicted.exposed_comm_s + p.predicted.optimizer_s + p.predicted.host_step_s
        assert p.predicted.iteration_s == pytest.approx(parts, rel=1e-9)


def test_every_rank_holding_a_tied_parameter_pays_for_its_copy() -> None:
    spec = load_model("zoo:gpt-tiny")
    cluster = Cluster.from_catalog("A100-80GB", 2)
    workload = Workload(global_batch=16)
    found = search(spec.build(), spec.example_inputs, cluster, workload, top_k=50, stage_dag=False)
    per = workload.bytes_per_param()
    per_param = per.param_bytes + per.grad_bytes + per.optimizer_bytes
    chain = found.chain
    checked = 0
    for p in [found.best, *found.alternatives]:
        if p.layout.pp != 2 or p.layout.stages_per_rank != 1 or p.layout.zero_stage != 0:
            continue
        for s, st in enumerate(p.stages):
            own = sum(chain.blocks[i].param_numel for i in range(st.first_block, st.last_block + 1)) * per_param
            copy = 256 * 64 * per_param if s == 1 else 0.0  # the last stage's lm_head reuses the first's wte
            # Adam's step counter for each tensor the stage steps, the tied copy's too (pyplan/solve/state.py).
            tensors = {id(chain.graph.module.get_parameter(n)) for i in range(st.first_block, st.last_block + 1)
                       for n in chain.blocks[i].param_names}  # fmt: skip
            assert st.state_bytes == pytest.approx(own + copy + 4 * len(tensors), rel=1e-9)
        ranks = [st.memory_bytes for st in p.stages]
        assert p.predicted.peak_memory_bytes == pytest.approx(max(ranks), rel=1e-9)
        checked += 1
    assert checked
