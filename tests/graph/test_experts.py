"""Mixture-of-experts layers found in captured graphs (pyplan/graph/experts.py) and `pyplan inspect --ep`."""

from __future__ import annotations

import functools
import importlib.util
import json
import os

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

from pyplan import load_model, trace
from pyplan.cli.main import main
from pyplan.errors import TraceError
from pyplan.graph.experts import ExpertLayer, expert_leaves, find_expert_layers, is_experts_module
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.trace import call_at, input_tensors, output_tensors
from pyplan.report.inspect import collapsed, expert_parallel_data, render_expert_parallel

REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real")
MIXTRAL_STYLE = os.path.join(REAL, "moe_mixtral_style.py")
DEEPSEEK_STYLE = os.path.join(REAL, "moe_deepseek_style.py")
ROUTED_BY_VALUE = os.path.join(REAL, "routed_by_value.py")
_TINY = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,vocab_size=128,seq_len=16"
HF_MIXTRAL = f"hf:mixtral:{_TINY},intermediate_size=128,num_local_experts=4"
HF_QWEN2_MOE = (
    f"hf:qwen2_moe:{_TINY},intermediate_size=128,moe_intermediate_size=32,shared_expert_intermediate_size=64,"
    "num_experts=8,num_experts_per_tok=2"
)
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="no transformers")


@functools.cache
def _captured(ref: str, whole: bool) -> tuple[nn.Module, LayerGraph]:
    """The model and its capture, each layer's experts kept whole (`whole`) or traced into."""
    spec = load_model(ref)
    torch.manual_seed(0)
    model = spec.build()
    leaves = expert_leaves(model) if whole else ()
    return model, trace(model, spec.example_inputs, leaf_modules=leaves, batch_size=2)


def _figures(layer: ExpertLayer) -> tuple:
    return (layer.num_experts, layer.top_k, layer.hidden, layer.expert_params, layer.shared_params,
            layer.router_params, layer.gated, layer.intermediate, layer.score, layer.layout)  # fmt: skip


@pytest.mark.parametrize("whole", [False, True])
def test_mixtral_style_experts_are_a_list_of_swiglu_mlps(whole: bool) -> None:
    _, graph = _captured(MIXTRAL_STYLE, whole)
    plan = find_expert_layers(graph)
    assert [x.path for x in plan.layers] == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert not plan.unrouted
    # 8 SwiGLU experts of 3 x 32 x 48 weights, top 2 of a softmax router (8 x 32, no bias), no shared expert.
    assert {_figures(x) for x in plan.layers} == {(8, 2, 32, 3 * 32 * 48, 0, 8 * 32, True, 48, "softmax", "list")}
    assert [x.router for x in plan.layers] == ["layers.0.moe.gate", "layers.1.moe.gate"]
    assert all(x.kept_whole == whole and x.problem == "" for x in plan.layers)
    assert [x.why_not(e) for e in (1, 2, 4, 8) for x in plan.layers] == [""] * 8
    assert plan.layers[0].why_not(3) == "3 does not divide its 8 experts"
    assert plan.degrees(16) == (1, 2, 4, 8)


@pytest.mark.parametrize("whole", [False, True])
def test_deepseek_style_experts_are_grouped_beside_a_shared_expert(whole: bool) -> None:
    _, graph = _captured(DEEPSEEK_STYLE, whole)
    plan = find_expert_layers(graph)
    # Layer 0 is dense: no MoE layer there.
    assert [x.path for x in plan.layers] == ["layers.1.mlp.experts", "layers.2.mlp.experts"]
    # 16 experts of (32 x 32 + 16 x 32) weights (a fused gate and up projection), 4 chosen on sigmoid scores (the
    # choice's bias is a buffer), weights gathered from the scores; a shared SwiGLU of 3 x 32 x 32.
    assert {_figures(x) for x in plan.layers} == {(16, 4, 32, 3 * 32 * 16, 3 * 32 * 32, 16 * 32, True, 16, "sigmoid",
                                                   "grouped")}  # fmt: skip
    assert [x.shared for x in plan.layers] == [("layers.1.mlp.shared_expert",), ("layers.2.mlp.shared_expert",)]
    assert all(x.kept_whole == whole and x.problem == "" for x in plan.layers)
    assert plan.degrees(16) == (1, 2, 4, 8, 16)


def test_a_capture_keeps_experts_whole_and_computes_the_same() -> None:
    """Under torch.export (keyword inputs) and torch.fx alike: one call_module per layer with (hidden, index,
    weights), a copy of the module sharing its parameters, and the model left as it was."""
    for ref, paths in ((DEEPSEEK_STYLE, ["layers.1.mlp.experts", "layers.2.mlp.experts"]),
                       (MIXTRAL_STYLE, ["layers.0.moe.experts", "layers.1.moe.experts"])):  # fmt: skip
        model, graph = _captured(ref, True)
        gm = graph.module
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in paths]
        assert [n.target for n in calls] == paths and all(len(n.args) == 3 for n in calls)
        for path in paths:
            whole, own = gm.get_submodule(path), model.get_submodule(path)
            assert whole is not own and "forward" not in vars(own)
            assert [id(p) for p in whole.parameters()] == [id(p) for p in own.parameters()]
        spec = load_model(ref)
        args, kwargs = call_at(spec.example_inputs, 2)
        with torch.no_grad():
            torch.testing.assert_close(gm(*input_tensors((args, kwargs))), output_tensors(model(*args, **kwargs)))


def test_experts_sharing_a_module_with_their_router_do_not_split() -> None:
    _, graph = _captured(ROUTED_BY_VALUE, False)
    plan = find_expert_layers(graph)
    assert [x.path for x in plan.layers] == ["layers.0.moe", "layers.1.moe", "layers.2.moe"]
    layer = plan.layers[0]
    assert (layer.num_experts, layer.top_k, layer.router, layer.router_params) == (4, 1, "layers.0.moe.router", 64)
    assert layer.why_not(2) == layer.problem
    assert layer.problem.startswith("its router and its experts are one module (Experts)")
    assert plan.degrees(8) == (1,)
    assert expert_leaves(load_model(ROUTED_BY_VALUE).build()) == ()


class _SoftExperts(nn.Module):
    """Grouped experts every token uses, weighted by a softmax over all of them: no top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))
        self.v = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.einsum("te,eto->to", weights, torch.matmul(F.relu(torch.matmul(x, self.w)), self.v))


class _Routed(nn.Module):
    def __init__(self, soft: bool) -> None:
        super().__init__()
        self.soft = soft
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = _SoftExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        weights, index = torch.topk(probs, 2)
        if self.soft:
            return x + self.experts(x, index, probs)
        dense = torch.zeros_like(probs).scatter(1, index, weights)
        return x + self.experts(x, index, dense)


def test_experts_whose_routing_is_not_a_top_k_choice_do_not_split() -> None:
    model = nn.Sequential(_Routed(soft=False), _Routed(soft=True))
    assert is_experts_module(model, "0.experts") and expert_leaves(model) == ("0.experts", "1.experts")
    # The first layer's experts read dense (tokens, experts) weights beside the top-k indices; the second's a softmax
    # over every expert, the scores before the choice: neither is (hidden, top-k indices, top-k weights).
    plan = find_expert_layers(trace(model, torch.randn(6, 8), leaf_modules=expert_leaves(model)))
    assert [x.path for x in plan.layers] == ["0.experts", "1.experts"]
    assert "takes weights of shape (6, 4) beside indices of shape (6, 2)" in plan.layers[0].problem
    assert "reads 3 values from outside it (hidden, index, hidden)" in plan.layers[1].problem
    # Traced into, their forwards read no indices at all.
    plan = find_expert_layers(trace(model, torch.randn(6, 8)))
    assert [x.router for x in plan.layers] == ["0.gate", "1.gate"]
    assert all("reads 2 values from outside it" in x.problem for x in plan.layers)
    assert plan.degrees(4) == (1,)


def test_models_without_experts_have_no_layers() -> None:
    _, graph = _captured("zoo:gpt-tiny", False)
    plan = find_expert_layers(graph)
    assert not plan and plan.layers == () and plan.degrees() == (1,)


@needs_transformers
def test_hf_mixtral_experts_grouped_in_3d_parameters() -> None:
    for whole in (False, True):
        _, graph = _captured(HF_MIXTRAL, whole)
        plan = find_expert_layers(graph)
        assert [x.path for x in plan.layers] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        # 4 experts with gate_up_proj (4, 256, 64) and down_proj (4, 64, 128); the router's weight is (4, 64).
        assert {_figures(x) for x in plan.layers} == {(4, 2, 64, 3 * 64 * 128, 0, 4 * 64, True, 128, "softmax",
                                                       "grouped")}  # fmt: skip
        assert all(x.kept_whole == whole and x.router.endswith(".mlp.gate") for x in plan.layers)


@needs_transformers
def test_hf_qwen2_moe_shared_expert_and_its_gate() -> None:
    _, graph = _captured(HF_QWEN2_MOE, False)
    plan = find_expert_layers(graph)
    layer = plan.layers[0]
    assert _figures(layer) == (8, 2, 64, 3 * 64 * 32, 3 * 64 * 64 + 64, 8 * 64, True, 32, "softmax", "grouped")
    assert layer.shared == ("model.layers.0.mlp.shared_expert", "model.layers.0.mlp.shared_expert_gate")
    assert len(plan.layers) == 2 and plan.layers[1].splits_at(8)


@needs_transformers
def test_hf_gpt_oss_experts_found_and_a_layer_stack_is_not_experts() -> None:
    """gpt-oss's experts default their indices and weights to None and are found beside their router; BERT's encoder
    (a list of 2 layers called with optional masks, a token-type embedding of 2 rows deeper in its parent) is not
    taken for experts."""
    spec = load_model(f"hf:gpt_oss:{_TINY},intermediate_size=128,num_local_experts=4,head_dim=16")
    with torch.device("meta"):
        model = spec.build()
    assert expert_leaves(model) == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    graph = trace(model, spec.example_inputs, leaf_modules=expert_leaves(model), batch_size=2)
    plan = find_expert_layers(graph)
    assert [x.path for x in plan.layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(x.kept_whole and x.num_experts == 4 and x.splits_at(2) for x in plan.layers)
    bert = load_model("hf:bert:hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128,"
                      "vocab_size=128,seq_len=16")  # fmt: skip
    with torch.device("meta"):
        assert expert_leaves(bert.build()) == ()


@needs_transformers
def test_hf_eager_experts_capture_only_kept_whole() -> None:
    """transformers' eager experts loop over the experts the router picked, a branch on values: kept whole, the
    model captures, and the graph runs them."""
    ref = f"{HF_MIXTRAL},experts_implementation=eager"
    spec = load_model(ref)
    with pytest.raises(TraceError, match="branches on a tensor's values"):
        trace(spec.build(), spec.example_inputs, batch_size=2)
    model, graph = _captured(ref, True)
    assert [x.kept_whole for x in find_expert_layers(graph).layers] == [True, True]
    args, kwargs = call_at(spec.example_inputs, 2)
    with torch.no_grad():
        torch.testing.assert_close(graph.module(*input_tensors((args, kwargs))), output_tensors(model(*args, **kwargs)))


def test_collapsed_paths() -> None:
    assert collapsed(["a.0.b", "a.1.b", "a.3.b"]) == "a.{0,1,3}.b"
    assert collapsed([f"m.layers.{i}.mlp" for i in range(32)]) == "m.layers.{0..31}.mlp"
    assert collapsed(["x.y"]) == "x.y"
    assert collapsed(["a.0.b", "c.1.d"]) == "a.0.b (+1 more)"


def test_expert_parallel_report_groups_identical_layers() -> None:
    _, graph = _captured(DEEPSEEK_STYLE, True)
    data = expert_parallel_data(find_expert_layers(graph), 8, "deepseek")
    assert [x["experts_per_rank"] for x in data["layers"]] == [2, 2] and all(x["splits"] for x in data["layers"])
    console = Console(width=80, record=True, color_system=None)
    render_expert_parallel(data, console)
    text = console.export_text()
    assert "layers.{1,2}.mlp.experts" in text and "2 experts" in text and "4 of 16" in text
    assert max(map(len, text.splitlines())) <= 80


def test_inspect_ep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", MIXTRAL_STYLE, "--ep", "2", "--analytic", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["expert_parallel"]
    assert data["degree"] == 2 and [x["path"] for x in data["layers"]] == [
        "layers.0.moe.experts",
        "layers.1.moe.experts",
    ]
    assert all(x["splits"] and x["experts_per_rank"] == 4 and x["kept_whole"] for x in data["layers"])
    # The blocks are those of the capture a plan with expert parallelism cuts: each layer's experts one node.
    assert main(["inspect", MIXTRAL_STYLE, "--ep", "4", "--analytic"]) == 0
    out = capsys.readouterr().out
    assert "expert parallelism 4: 2 of 2 mixture-of-experts layers split" in out and "2 experts" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([DEEPSEEK_STYLE, "--ep", "3"], "--ep 3 divides the experts of no layer (16 experts); choose 2, 4, 8, 16"),
        (
            [MIXTRAL_STYLE, "--ep", "0"],
            "--ep takes a degree of 1 or more (ranks that split each layer's experts), got 0",
        ),
        (["zoo:mlp-tiny", "--ep", "2"], "--ep: mlp-tiny has no mixture-of-experts layer"),
    ],
)
def test_inspect_ep_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", *argv, "--analytic"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
