"""DAG stage assignment in the search: per-operation figures, the search's costs restated, and the plans it adds."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
import torch

from pyplan import _core, load_model
from pyplan.api import chain_for, search
from pyplan.emit.planfile import PlanFile, plan_file_from_json
from pyplan.emit.script import render_script
from pyplan.graph.chain import Chain
from pyplan.graph.split import run_pieces
from pyplan.hardware import Cluster
from pyplan.plan import Plan, Workload
from pyplan.profile.nodes import node_profile
from pyplan.runtime.stages import cut_model
from pyplan.solve.dag_search import NodeProfile, PipelineConfig, StageCosts, evaluate, too_coarse, worth_solving
from pyplan.solve.state import stage_state_bytes
from pyplan.solve.tied import tied_parameters, tied_sync_s
from pyplan.spec import ModelSpec

REL = 1e-9  # the search's figures restated in Python: only the order of summation differs

# Two GPUs and an odd global batch: no data parallelism, so every plan is a 2-stage pipeline (or one GPU), and
# micro-batches of 1 make 7 of them, so the pipeline's bottleneck stage sets its time.
GPUS, GLOBAL_BATCH, MICRO = 2, 7, (1,)


Setup = tuple[ModelSpec, torch.nn.Module, Cluster, Workload, Chain]


def _setup(name: str, gpus: int = GPUS, global_batch: int = GLOBAL_BATCH) -> Setup:
    spec = load_model(f"zoo:{name}")
    model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", gpus)
    workload = Workload(global_batch=global_batch)
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    return spec, model, cluster, workload, chain


@pytest.fixture(scope="module")
def grouped() -> Setup:
    return _setup("grouped-mlp-tiny")


def _search(setup: Setup, **options: object) -> Plan:
    spec, model, cluster, workload, chain = setup
    return search(model, spec.example_inputs, cluster, workload, chain=chain, allow_fewer_gpus=False,
                  micro_batch_sizes=MICRO, schedules=("GPipe", "1F1B"), **options).best  # fmt: skip


def _block_work(chain: Chain, b: int) -> list[float]:
    return [blk.fwd_time_s(b) + blk.bwd_time_s(b) for blk in chain.blocks]  # type: ignore[misc]


def _contiguous(nodes: NodeProfile, plan: Plan) -> list[int]:
    """The plan's chain partition, operation by operation."""
    return [next(s for s, st in enumerate(plan.stages) if st.first_block <= i <= st.last_block) for i in nodes.block]


def _costs(cluster: Cluster, workload: Workload, plan: Plan) -> StageCosts:
    """The plan's configuration on a one-node cluster: the pipeline link and the dp groups stay inside the node."""
    lay = plan.layout
    config = PipelineConfig(
        dp=lay.dp,
        pp=lay.pp,
        micro_batch_size=lay.micro_batch_size,
        num_microbatches=lay.num_microbatches,
        schedule=lay.schedule,
        zero_stage=lay.zero_stage,
        placement=lay.placement,
        in_flight=tuple(st.in_flight for st in plan.stages),
        dp_gpus_per_node=lay.dp,
    )
    return StageCosts(cluster, workload, config, gpu_mem_bytes=cluster.gpu.memory_bytes * 0.9, scale=1.0,
                      price_per_gpu_s=0.0)  # fmt: skip


def test_node_profile_shares_out_exactly_what_the_blocks_hold(grouped: Setup) -> None:
    spec, _, cluster, _, chain = grouped
    nodes = node_profile(chain, spec.example_inputs, 3, cluster.gpu)
    assert nodes.names == tuple(chain.order)
    for i, blk in enumerate(chain.blocks):
        ops = [v for v, j in enumerate(nodes.block) if j == i]
        assert [nodes.names[v] for v in ops] == list(blk.nodes)
        assert sum(nodes.saved_bytes[v] for v in ops) == blk.saved_bytes(3)  # type: ignore[misc]
        assert sum(nodes.params[v] for v in ops) == blk.param_numel
        assert sum(nodes.param_tensors[v] for v in ops) == blk.param_tensors
    # Every Linear runs a matmul forward and two backward; indexing a tuple runs nothing.
    for name, f, g in zip(nodes.names, nodes.fwd_weight_s, nodes.bwd_weight_s):
        if name.startswith("branches_") and int(name.rsplit("_", 1)[1]) % 2 == 0:
            assert f > 0 and g > f, name
        if name.startswith("getitem"):
            assert f == g == 0, name


@pytest.mark.parametrize("name", ["gpt-tiny", "grouped-mlp-tiny"])
def test_evaluate_reproduces_the_search_on_the_chain_partition(name: str) -> None:
    spec, model, cluster, workload, chain = _setup(name)
    plan = _search((spec, model, cluster, workload, chain), stage_dag=False)
    assert plan.layout.pp == 2 and not plan.layout.stage_of_node
    costs = _costs(cluster, workload, plan)
    nodes = node_profile(chain, spec.example_inputs, plan.layout.micro_batch_size, cluster.gpu)
    stages, predicted = evaluate(chain, nodes, costs, _contiguous(nodes, plan))
    b = plan.layout.micro_batch_size
    # The api adds the last stage's own copy of the tied embedding (weight, gradient, AdamW state: 16 B each).
    tied_copy = [0.0, 256 * 64 * 16.0] if name == "gpt-tiny" else [0.0, 0.0]
    for got, want, copy in zip(stages, plan.stages, tied_copy):
        for field in ("forward_s", "backward_s", "time_s", "buffer_bytes"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), rel=REL), field
        # ... and each tensor's Adam step counter, which the bytes per parameter leave out (pyplan/solve/state.py).
        params = {id(p): p for blk in chain.blocks[want.first_block : want.last_block + 1]
                  for p in map(chain.graph.module.get_parameter, blk.param_names)}  # fmt: skip
        counters = stage_state_bytes([tuple(p.shape) for p in params.values()], workload, 1, 0) - (
            workload.state_bytes_per_gpu(sum(p.numel() for p in params.values()), 1, 0)
        )
        assert counters == 4 * len(params)
        assert got.state_bytes + copy + counters == pytest.approx(want.state_bytes, rel=REL)
        assert (got.first_block, got.last_block, got.in_flight) == (want.first_block, want.last_block, want.in_flight)
        # The search's own activation model (saved bytes and the input cut per micro-batch in flight); the plan
        # it returns has the replayed working memory instead (pyplan/planner.py), which DAG stages cannot replay.
        blocks = chain.blocks[want.first_block : want.last_block + 1]
        act = want.in_flight * (sum(blk.saved_bytes(b) for blk in blocks) + chain.cuts[want.first_block].bytes(b))
        assert got.activation_bytes == pytest.approx(act, rel=REL)
        assert want.activation_bytes >= act * (1 - REL)
        assert got.memory_bytes == pytest.approx(got.state_bytes + act + got.buffer_bytes, rel=REL)
    for field in ("pipeline_s", "optimizer_s", "bubble_fraction"):
        assert getattr(predicted, field) == pytest.approx(getattr(plan.predicted, field), rel=REL), field
    # The api adds the tied embedding's all-reduce to every pipeline plan, DAG-assigned ones too (after evaluate).
    group = cluster.groups[0]
    links = {"intra": group.intra_link, "inter": group.inter_link, "gpus_per_node": cluster.gpus_per_node}
    grad_bytes = float(workload.bytes_per_param().grad_bytes)
    tied = tied_sync_s(plan.layout, chain, tied_parameters(chain), grad_bytes, **links)
    assert (name == "gpt-tiny") == (tied > 0)
    assert predicted.iteration_s + tied == pytest.approx(plan.predicted.iteration_s, rel=REL)


def _candidates(chain: Chain, cluster: Cluster, workload: Workload, host: dict[str, float | bool]) -> list:
    """The C++ search's pipeline candidates (GPipe, 1F1B) for `chain`, called as pyplan.api.search calls it, with
    host costs (which the api passes only for the local CPU)."""
    blocks, group, per = chain.blocks, cluster.groups[0], workload.bytes_per_param()
    result = _core.search(
        *([getattr(getattr(b, t), k) for b in blocks] for t in ("fwd_time_s", "bwd_time_s", "saved_bytes")
          for k in ("per_sample", "fixed")),
        [float(b.param_numel) for b in blocks],
        [c.bytes.per_sample for c in chain.cuts],
        [c.bytes.fixed for c in chain.cuts],
        num_gpus=cluster.gpus,
        gpus_per_node=cluster.gpus_per_node,
        gpu_mem_bytes=cluster.gpu.memory_bytes * 0.9,
        mem_bw_bytes_per_s=cluster.gpu.hbm_bw_bytes_per_s,
        intra_latency_s=group.intra_link.latency_s,
        intra_bw_bytes_per_s=group.intra_link.bw_bytes_per_s,
        inter_latency_s=group.inter_link.latency_s,
        inter_bw_bytes_per_s=group.inter_link.bw_bytes_per_s,
        global_batch=workload.global_batch,
        param_bytes=float(per.param_bytes),
        grad_bytes=float(per.grad_bytes),
        optim_bytes=float(per.optimizer_bytes),
        micro_batch_sizes=[2],
        schedules=["GPipe", "1F1B"],
        zero_stages=[0, 1, 3],
        top_k=40,
        param_tensors=[float(b.param_tensors) for b in blocks],
        cut_tensors=[float(len(c.live)) for c in chain.cuts],
        intra_collective=group.intra_link.collective,
        inter_collective=group.inter_link.collective,
        host=host,
    )  # fmt: skip
    return [c for c in [*result.top, *result.pareto] if c.pp > 1]


@pytest.mark.parametrize("overlap", [True, False])
def test_evaluate_reproduces_the_search_with_host_costs_and_data_parallelism(grouped: Setup, overlap: bool) -> None:
    spec, _, _, _, chain = grouped
    cluster, workload = Cluster.from_catalog("a100-80g", 4), Workload(global_batch=8)
    host = {"stage_forward_s": 3e-5, "stage_backward_s": 5e-5, "message_s": 2e-5, "step_s": 1e-4,
            "optimizer_tensor_s": 1e-6, "optimizer_element_s": 1e-9, "sync_overlaps_backward": overlap}  # fmt: skip
    candidates = _candidates(chain, cluster, workload, host)
    assert {(c.dp, c.zero_stage) for c in candidates} >= {(1, 0), (2, 0), (2, 1), (2, 3)}
    nodes: dict[int, NodeProfile] = {}
    for c in candidates:
        b = c.micro_batch_size
        nodes.setdefault(b, node_profile(chain, spec.example_inputs, b, cluster.gpu))
        costs = StageCosts(cluster, workload, PipelineConfig.of(c), cluster.gpu.memory_bytes * 0.9, 1.0, 0.0, host)
        own = [next(s for s in range(c.pp) if c.cuts[s] <= i < c.cuts[s + 1]) for i in nodes[b].block]
        stages, predicted = evaluate(chain, nodes[b], costs, own)
        for field, want in (("forward_s", c.stage_forward_s), ("backward_s", c.stage_backward_s),
                            ("time_s", c.stage_time_s), ("state_bytes", c.stage_state_bytes),
                            ("activation_bytes", c.stage_act_bytes),
                            ("buffer_bytes", c.stage_buffer_bytes)):  # fmt: skip
            assert [getattr(st, field) for st in stages] == pytest.approx(want, rel=REL), (field, c)
        for field, value in (("iteration_s", c.iteration_s), ("pipeline_s", c.makespan_s),
                             ("exposed_comm_s", c.exposed_sync_s), ("optimizer_s", c.optimizer_s),
                             ("host_step_s", c.host_step_s), ("peak_memory_bytes", c.peak_memory_bytes)):  # fmt: skip
            assert getattr(predicted, field) == pytest.approx(value, rel=REL), (field, c)


def test_search_splits_the_coarse_block_of_a_branching_model(grouped: Setup) -> None:
    spec, model, cluster, _, chain = grouped
    chain_only = _search(grouped, stage_dag=False)
    best = _search(grouped)
    # The branches that index one tuple share a block that outweighs half the model: no cut of the chain balances.
    assert too_coarse(_block_work(chain, 1), 2)
    assert not chain_only.layout.stage_of_node
    assert best.layout.pp == 2 and best.layout.stage_of_node
    assert best.predicted.iteration_s < 0.95 * chain_only.predicted.iteration_s
    assert best.predicted.peak_memory_bytes <= cluster.gpu.memory_bytes * 0.9
    # The stages share the coarse block and are not contiguous in the traced order.
    stages = [best.layout.stage_of_node[name] for name in chain.order]
    assert stages != sorted(stages)
    assert best.stages[0].last_block >= best.stages[1].first_block
    # Its figures are evaluate's for its assignment (the search adds nothing beyond them on a catalog GPU).
    nodes = node_profile(chain, spec.example_inputs, 1, cluster.gpu)
    got, predicted = evaluate(chain, nodes, _costs(cluster, grouped[3], best), stages)
    assert got == best.stages
    assert predicted.iteration_s == pytest.approx(best.predicted.iteration_s, rel=REL)

    # The plan file carries the assignment, and the runtime's stages compute the model and its gradients.
    document = PlanFile("zoo:grouped-mlp-tiny", grouped[3], cluster, best)
    assert plan_file_from_json(json.loads(json.dumps(document.to_json()))).plan == best
    embedded = render_script(document).split('PLAN = json.loads(r"""')[1].split('""")')[0]
    assert plan_file_from_json(json.loads(embedded)).plan.layout == best.layout
    _, pieces = cut_model(model, spec.example_inputs, best.layout)
    x, y = spec.example_inputs(2), spec.target(2)
    assert spec.loss is not None
    spec.loss(run_pieces(pieces, *x), y).backward()
    staged = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    spec.loss(model(*x), y).backward()
    assert staged.keys() == dict(model.named_parameters()).keys()
    for n, p in model.named_parameters():
        torch.testing.assert_close(staged[n], p.grad, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(("name", "gpus"), [("gpt-tiny", 4), ("resnet-tiny", 8), ("vgg-tiny", 4)])
def test_chain_models_keep_their_plans(name: str, gpus: int) -> None:
    # An odd global batch on all the GPUs: every plan is a pipeline of `gpus` stages over fine enough blocks.
    spec, model, cluster, workload, chain = _setup(name, gpus, 15)
    options = {"chain": chain, "top_k": 8, "allow_fewer_gpus": False}
    with_dag = search(model, spec.example_inputs, cluster, workload, **options)  # type: ignore[arg-type]
    without = search(model, spec.example_inputs, cluster, workload, stage_dag=False, **options)  # type: ignore[arg-type]
    assert with_dag.to_json() == without.to_json()
    for p in [with_dag.best, *with_dag.alternatives]:
        assert p.layout.pp == gpus and not p.layout.stage_of_node
        if p.layout.stages_per_rank == 1:  # the pipelines the DAG assignment is for
            assert not too_coarse(_block_work(chain, p.layout.micro_batch_size), p.layout.num_stages)


@pytest.mark.parametrize(
    ("work", "stages", "coarse"),
    [([1.0, 1.0, 1.0, 1.0], 2, False), ([2.0, 1.0, 1.0], 2, False), ([3.1, 1.0, 1.0, 1.0], 2, True),
     ([1.0, 2.0, 1.0], 4, True), ([], 2, False)],
)  # fmt: skip
def test_too_coarse_means_one_block_outweighs_the_ideal_stage(work: Sequence[float], stages: int, coarse: bool) -> None:
    assert too_coarse(work, stages) is coarse


def test_a_solve_is_tried_only_when_balancing_could_pay() -> None:
    """(m - 1) x (bottleneck - ideal) against 2 % of the iteration: balanced stages or one micro-batch never pay."""
    from types import SimpleNamespace

    def cand(f: list[float], m: int, t: float) -> object:
        return SimpleNamespace(stage_forward_s=f, stage_backward_s=[0.0] * len(f), num_microbatches=m, iteration_s=t)

    assert worth_solving(cand([3.0, 1.0], m=8, t=30.0))  # 7 x (3 - 2) = 7 s of 30
    assert not worth_solving(cand([2.0, 2.0], m=8, t=20.0))  # balanced
    assert not worth_solving(cand([3.0, 1.0], m=1, t=4.0))  # no steady phase to shorten
    assert not worth_solving(cand([2.01, 1.99], m=2, t=4.0))  # 0.01 s of 4: below 2 %


def test_planning_chains_needs_no_ortools() -> None:
    """A machine without OR-Tools (a GPU host with no package index) imports pyplan and plans chains; the DAG
    stage assignment, the one user of CP-SAT, names the missing package in one line."""
    import subprocess
    import sys

    program = """
import sys
sys.modules["ortools"] = None  # as if it were not installed
import pyplan, pyplan.cli
from pyplan import load_model
from pyplan.api import search
from pyplan.errors import PlanError
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.solve import dag_search
spec = load_model("zoo:mlp-tiny")
found = search(spec.build(), spec.example_inputs, Cluster.from_catalog("a100-80g", 2), Workload(global_batch=8),
               stage_dag=False)
assert found.best.layout.dp * found.best.layout.pp <= 2
try:
    dag_search._ilp()
except PlanError as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "needs OR-Tools: pip install 'ortools>=9.10'" in done.stdout
