"""Plans with expert parallelism: each mixture-of-experts block priced at E = 1, 2, 4 as pyplan/profile/experts.py
prices it (by hand here), the saved bytes per routed pair against real experts, the search over E as the best of
each E's search, and the degree reaching the CLI's table, plan.json and `pyplan show`, with its refusals."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pyplan._torch import meta_build
from pyplan.api import search
from pyplan.cli.main import main
from pyplan.emit.planfile import read_plan_file
from pyplan.errors import InfeasibleError, PlanError
from pyplan.graph.experts import expert_leaves, find_expert_layers
from pyplan.graph.layergraph import Affine
from pyplan.hardware import Cluster
from pyplan.load import load_model
from pyplan.plan import Plan, Workload
from pyplan.profile.analytic import Roofline
from pyplan.profile.capture import chain_for
from pyplan.profile.expert_chain import chain_at_expert_degree, envelope, expert_block_costs, saved_elements_per_pair
from pyplan.profile.experts import ExpertShape, expert_cost

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "real")
MIXTRAL = os.path.join(MODELS, "moe_mixtral_style.py")
# Nodes of 2 GPUs: expert parallelism 4 spans 2 nodes, so both links carry all-to-all traffic.
CLUSTER = Cluster.from_catalog("a100-80g", 8, gpus_per_node=2)
WORKLOAD = Workload(global_batch=16, precision="bf16-mixed")


def _meta(path: str) -> tuple[Any, nn.Module]:
    spec = load_model(path)
    with meta_build():
        return spec, spec.build()


@pytest.fixture(scope="module")
def mixtral() -> tuple[Any, nn.Module, Any]:
    """The Mixtral-style model on the meta device, captured with its experts kept whole and profiled on the A100's
    roofline."""
    spec, model = _meta(MIXTRAL)
    chain, _ = chain_for(model, spec.example_inputs, CLUSTER, WORKLOAD, leaf_modules=expert_leaves(model))
    return spec, model, chain


def _by_hand(layer: Any, degree: int, b: int, tokens: float) -> tuple[float, float]:
    """One layer's forward and backward seconds at micro-batch b on CLUSTER, from experts.py's functions: the
    roofline of the busiest rank's routed FLOPs and its experts' weights, and two all-to-alls each way."""
    per_node = math.gcd(degree, CLUSTER.gpus_per_node)
    group = CLUSTER.groups[0]
    cost = expert_cost(ExpertShape.of(layer), degree=degree, tokens=tokens * b, dtype_bytes=2, ranks_per_node=per_node,
                       nodes=degree // per_node, intra_link=group.intra_link, inter_link=group.inter_link)  # fmt: skip
    roof = Roofline.from_gpu(CLUSTER.gpu)
    flop_s = roof.peak("bfloat16") * roof.efficiency.compute["matmul"]
    bytes_s = roof.mem_bw_bytes_per_s * roof.efficiency.memory["matmul"]
    weights = layer.num_experts // degree * layer.expert_params * 2  # bf16
    forward = max(cost.routed_forward_flops / flop_s, weights / bytes_s) + cost.forward_comm_s
    backward = max(2 * cost.routed_forward_flops / flop_s, 2 * weights / bytes_s) + cost.backward_comm_s
    return forward, backward


def test_each_moe_block_priced_at_e_1_2_4_by_hand(mixtral: tuple[Any, nn.Module, Any]) -> None:
    _, _, chain = mixtral
    layers = find_expert_layers(chain.graph).layers
    assert [x.path for x in layers] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    x = layers[0]
    assert (x.num_experts, x.top_k, x.hidden, x.intermediate, x.gated, x.kept_whole) == (8, 2, 32, 48, True, True)
    # On the meta device the profile runs no expert: the experts' block holds their parameters and nothing else.
    holders = {i for i, blk in enumerate(chain.blocks) for n in blk.nodes if n.endswith("_moe_experts")}
    assert all(chain.blocks[i].saved_bytes == Affine(0.0, 0.0) for i in holders)
    tokens = 8  # SEQ tokens a sample, all routed
    for degree in (1, 2, 4):
        priced = chain_at_expert_degree(chain, layers, degree, CLUSTER, WORKLOAD)
        for i, (before, after) in enumerate(zip(chain.blocks, priced.blocks, strict=True)):
            if i not in holders:
                assert after is before
                continue
            for b in range(1, 41):
                fwd, bwd = _by_hand(x, degree, b, tokens)
                assert after.fwd_time_s(b) == pytest.approx(before.fwd_time_s(b) + fwd, rel=1e-9)
                assert after.bwd_time_s(b) == pytest.approx(before.bwd_time_s(b) + bwd, rel=1e-9)
            # Per routed pair, fp32 as traced: input 32, gate, up, silu and product 4 x 48 on the expert's rank,
            # the expert's output 32 on the token's.
            assert after.saved_bytes == Affine(tokens * 2 * (32 + 4 * 48 + 32) * 4, 0.0)
            assert after.param_numel == before.param_numel - (8 - 8 // degree) * x.expert_params
            assert after.flops_fwd(3) == pytest.approx(3 * tokens * 2 * 2 * x.expert_params)
            kept = priced.memory.blocks[i].kept_bytes
            assert kept.per_sample == chain.memory.blocks[i].kept_bytes.per_sample + after.saved_bytes.per_sample
        if degree == 1:
            costs = expert_block_costs(chain, layers, 1, CLUSTER, WORKLOAD)
            assert all(c.comm_s(64) == 0 and c.params_not_held == 0 for c in costs)
    # A profile measured on this machine ran and timed the experts: no compute added, the all-to-alls alone.
    timed = expert_block_costs(chain, layers, 2, CLUSTER, WORKLOAD, experts_timed=True)
    assert all(c.compute_fwd_s(7) == c.compute_bwd_s(7) == 0 and c.comm_s(7) > 0 for c in timed)


def test_the_envelope_is_exact_at_every_whole_size() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lines = [Affine(rng.choice([0.0, rng.uniform(0, 5)]), rng.uniform(0, 300)) for _ in range(rng.randint(1, 3))]
        curve = envelope(lines)
        for b in range(1, 400):
            assert curve(b) == pytest.approx(max(a(b) for a in lines), rel=1e-12, abs=1e-12)


def test_degrees_that_do_not_split_a_layer_are_one_line(mixtral: tuple[Any, nn.Module, Any]) -> None:
    spec, model, chain = mixtral
    layers = find_expert_layers(chain.graph).layers
    with pytest.raises(PlanError, match=r"^expert parallelism 3 does not split 'layers.0.moe.experts': 3 does not"):
        chain_at_expert_degree(chain, layers, 3, CLUSTER, WORKLOAD)
    # Experts traced into (no expert leaves): priced by their ops at E = 1, refused above.
    traced, _ = chain_for(model, spec.example_inputs, CLUSTER, WORKLOAD)
    inside = find_expert_layers(traced.graph).layers
    assert chain_at_expert_degree(traced, inside, 1, CLUSTER, WORKLOAD) is traced
    with pytest.raises(PlanError, match="traced into, not kept whole"):
        chain_at_expert_degree(traced, inside, 2, CLUSTER, WORKLOAD)


def _saved_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the storages the module's forward makes and keeps for the backward (its parameters and inputs left
    out, each storage once), on real CPU tensors."""
    outside = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *inputs)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in outside:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())


def _routing(tokens: int, hidden: int, experts: int, k: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(tokens, hidden, requires_grad=True)
    weights, index = torch.topk(torch.randn(tokens, experts).softmax(-1), k)
    return x, index, (weights / weights.sum(-1, keepdim=True)).requires_grad_()


def test_saved_bytes_per_routed_pair_against_real_experts() -> None:
    """The Mixtral-style model's experts run every expert on every token (a dense reference): each (token, expert)
    keeps the gate, up, silu and product outputs (4f), the expert's output (h), its routing share (one float) and
    the choice mask (k bools). transformers' eager Mixtral experts gather each routed pair: they keep the priced
    2h + 4f and their own h (torch's index_add_ keeps its source) with 20 bytes of indices and weight."""
    torch.manual_seed(0)
    spec = load_model(MIXTRAL)
    experts = spec.build().layers[0].moe.experts
    h, f, n, k = 32, 48, 8, 2
    for tokens in (16, 32):
        dense = _saved_bytes(experts, *_routing(tokens, h, n, k))
        assert dense == tokens * n * (4 * (4 * f + h) + 4 + k)
    assert saved_elements_per_pair(h, f, gated=True) + h == 2 * h + 4 * f
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=n, num_experts_per_tok=k)
    config._experts_implementation = "eager"
    hf = MixtralExperts(config)
    nn.init.normal_(hf.gate_up_proj)
    nn.init.normal_(hf.down_proj)
    for tokens in (16, 32):
        pairs = tokens * k
        priced = pairs * (saved_elements_per_pair(h, f, gated=True) + h) * 4
        assert _saved_bytes(hf, *_routing(tokens, h, n, k)) == priced + pairs * (4 * h + 20)


# A Mixtral-style model large enough that its experts' state matters: 32 experts of 3 x 256 x 1024 per layer.
def _big_moe(folder: Path) -> str:
    source = Path(MIXTRAL).read_text()
    source = source.replace("VOCAB, SEQ, DIM, HEADS, FFN, LAYERS = 64, 8, 32, 4, 48, 2",
                            "VOCAB, SEQ, DIM, HEADS, FFN, LAYERS = 256, 64, 256, 4, 1024, 2")  # fmt: skip
    source = source.replace("EXPERTS, TOP_K = 8, 2", "EXPERTS, TOP_K = 32, 2")
    path = folder / "big_moe.py"
    path.write_text(source)
    return str(path)


def _objective(p: Plan) -> tuple[float, int, float]:
    return (p.predicted.iteration_s, p.layout.num_gpus, p.predicted.peak_memory_bytes)


def test_the_search_over_e_is_the_best_of_each_e(tmp_path: Path) -> None:
    spec, model = _meta(_big_moe(tmp_path))
    cluster = Cluster.from_catalog("a100-80g", 8, gpus_per_node=4)
    workload = Workload(global_batch=64, precision="bf16-mixed")
    kw = dict(loss=spec.loss, target=spec.target, stage_dag=False, top_k=4)
    every = search(model, spec.example_inputs, cluster, workload, expert_parallel=(1, 2, 4, 8), **kw)
    assert every.expert_parallel == (1, 2, 4, 8) and every.ep_left_out == ()
    alone = {}
    for e in (1, 2, 4, 8):
        try:
            alone[e] = search(model, spec.example_inputs, cluster, workload, expert_parallel=(e,), chain=every.chain,
                              **kw)  # fmt: skip
        except InfeasibleError:
            continue
        plans = (alone[e].best, *alone[e].alternatives)
        assert {p.layout.ep for p in plans} == {e}
        if e > 1:
            assert all(p.layout.dp % e == 0 and p.layout.zero_stage == 0 and p.layout.tp == 1 for p in plans)
            assert all(p.layout.placement == "dp-inner" for p in plans)
    best = min((found.best for found in alone.values()), key=_objective)
    assert _objective(every.best) == pytest.approx(_objective(best), rel=1e-3)
    # Here the experts' gradients, all-reduced for N/E experts a rank, cost less than the all-to-alls add.
    assert every.best.layout.ep == best.layout.ep > 1
    # The same configuration at each E: N/E experts a rank hold less state, and send tokens both ways.
    pins = dict(data_parallel=(8,), pipeline_ranks=(1,), micro_batch_sizes=(8,), zero_stages=(0,), **kw)
    same = [search(model, spec.example_inputs, cluster, workload, expert_parallel=(e,), chain=every.chain, **pins).best
            for e in (1, 2, 4, 8)]  # fmt: skip
    memory = [p.predicted.peak_memory_bytes for p in same]
    assert memory == sorted(memory, reverse=True) and memory[0] > memory[-1]


def test_pins_that_leave_an_e_nothing_leave_it_out(mixtral: tuple[Any, nn.Module, Any]) -> None:
    spec, model, chain = mixtral
    kw = dict(loss=spec.loss, target=spec.target, chain=chain, stage_dag=False)
    found = search(model, spec.example_inputs, CLUSTER, WORKLOAD, expert_parallel=(1, 2, 3), data_parallel=(2, 3), **kw)
    assert found.expert_parallel == (1, 2)
    assert dict(found.ep_left_out) == {3: "expert parallelism 3 does not split 'layers.0.moe.experts': 3 does not "
                                          "divide its 8 experts"}  # fmt: skip
    assert json.loads(json.dumps(found.to_json()))["expert_parallel"] == {
        "searched": [1, 2],
        "left_out": {"3": dict(found.ep_left_out)[3]},
    }
    zero1 = search(model, spec.example_inputs, CLUSTER, WORKLOAD, expert_parallel=(1, 2), zero_stages=(1,), **kw)
    assert zero1.expert_parallel == (1,) and "runs under ZeRO 0" in dict(zero1.ep_left_out)[2]
    for pins, message in (
        (dict(data_parallel=(3,)), "expert parallelism 2 needs a data-parallel degree it divides, and --dp 3"),
        (dict(zero_stages=(3,)), "expert parallelism 2 runs under ZeRO 0"),
        (dict(tensor_parallel=(2,)), "expert parallelism 2 is planned at tensor parallelism 1"),
    ):
        with pytest.raises(PlanError, match=message):
            search(model, spec.example_inputs, CLUSTER, WORKLOAD, expert_parallel=(2,), **pins, **kw)
    master = Workload(global_batch=16, precision="bf16-master")
    with pytest.raises(PlanError, match="expert parallelism runs with fp32, bf16-mixed, fp16-mixed, not bf16-master"):
        search(model, spec.example_inputs, CLUSTER, master, expert_parallel=(2,), **kw)
    gpt_spec, gpt = _meta("zoo:gpt-tiny")
    with pytest.raises(PlanError, match=r"^expert parallelism 2 splits no layer: the model has no mixture-of-experts"):
        search(gpt, gpt_spec.example_inputs, CLUSTER, WORKLOAD, expert_parallel=(2,))


def _plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_plans_shows_and_writes_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = (MIXTRAL, "--gpus", "8", "--gpu", "a100-80g", "--gpus-per-node", "4", "--global-batch", "16", "--tp", "1")
    # A model with mixture-of-experts layers on a catalog GPU: every E dividing its 8 experts and the 8 GPUs.
    code, out, _ = _plan_cli(capsys, *base, "--json")
    assert code == 0 and json.loads(out)["expert_parallel"] == {"searched": [1, 2, 4, 8], "left_out": {}}
    # Pinned to 2: the table's ep column, the header line, plan.json and `pyplan show`.
    plan = tmp_path / "plan.json"
    code, out, _ = _plan_cli(capsys, *base, "--ep", "2", "--out", str(plan))
    assert code == 0 and "expert parallelism searched at 2 (--ep 1: none)" in out
    header = next(line for line in out.splitlines() if "┃ dp" in line)
    assert [c.strip() for c in header.split("┃")][3:5] == ["dp", "ep"]
    doc = read_plan_file(plan)
    assert doc.plan.layout.ep == 2 and doc.leaf_modules == ("layers.0.moe.experts", "layers.1.moe.experts")
    assert json.loads(plan.read_text())["plan"]["ep"] == 2
    capsys.readouterr()
    assert main(["show", str(plan)]) == 0
    shown = capsys.readouterr().out
    assert f"dp {doc.plan.layout.dp} (ep 2) x pp" in shown
    assert "each mixture-of-experts layer's experts split over 2 of the dp replicas" in shown
    # A dense model: no ep column and no record unless asked; asked, the degree is left out with why.
    code, out, _ = _plan_cli(capsys, "zoo:gpt-tiny", "--gpus", "2", "--gpu", "a100-80g", "--tp", "1", "--json")
    assert code == 0 and "expert_parallel" not in json.loads(out)
    code, out, _ = _plan_cli(capsys, "zoo:gpt-tiny", "--gpus", "2", "--gpu", "a100-80g", "--tp", "1", "--ep", "1,2",
                             "--json")  # fmt: skip
    assert code == 0 and "has no mixture-of-experts layer" in json.loads(out)["expert_parallel"]["left_out"]["2"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--ep", "two"), "--ep takes auto, a degree or degrees separated by commas (e.g. 1,2,4), got 'two'"),
        (("--ep", "0"), "--ep takes degrees of at least 1, got '0'"),
        (("--ep", "1,,2"), "--ep takes auto, a degree or degrees separated by commas (e.g. 1,2,4), got '1,,2'"),
        (("--ep", "3"), "expert parallelism 3 does not split 'layers.0.moe.experts': 3 does not divide its 8 experts"),
        (("--ep", "2", "--zero", "1"), "expert parallelism 2 runs under ZeRO 0"),
        (("--ep", "2", "--dp", "1"), "expert parallelism 2 needs a data-parallel degree it divides, and --dp 1"),
        (("--ep", "2", "--tp", "2"), "expert parallelism 2 is planned at tensor parallelism 1"),
    ],
)
def test_bad_ep_is_one_line_exit_2(flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _plan_cli(capsys, MIXTRAL, "--gpus", "4", "--gpu", "a100-80g", "--global-batch", "8", *flags)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
