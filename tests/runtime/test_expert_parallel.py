"""Expert parallelism under torchrun trains exactly what one process trains (tests/runtime/_expert_parallel.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

from pyplan import load_model, trace
from pyplan.errors import PlanError
from pyplan.graph.experts import ExpertLayer, expert_leaves, find_expert_layers
from pyplan.plan import Layout
from pyplan.runtime.experts import (
    ExpertGroups,
    ExpertParallel,
    apply_expert_parallel,
    expert_refusal,
    expert_slices,
)
from tests.runtime.conftest import Launches

TOL = 1e-10  # float64, as the script compares
# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((4, "_expert_parallel"),)
MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real")


def _name(model: str) -> str:
    return model.split(":")[1] if model.startswith("hf:") else os.path.basename(model).removesuffix(".py")


@pytest.mark.distributed
def test_experts_split_over_replicas_train_like_one_process(launches: Launches) -> None:
    results = launches.part(4, "_expert_parallel").results()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:3]
    # Both models over the replicas of 2 pipeline stages (EP 2 x pp 2) and over 4 replicas (EP 2, each expert on 2
    # ranks), EP 4 with the gradient clipped, 2 stages per rank with a stage's replicas adjacent, bf16 autocast (a
    # smoke check to 0.1, the script's own); Hugging Face's Mixtral (eager experts, float64) where transformers is.
    runs = {(_name(r["model"]), r["dp"], r["pp"], r["ep"], r["schedule"]) for r in results}
    ours = ("moe_mixtral_style", "moe_deepseek_style")
    expected = {(m, 2, 2, 2, "1F1B") for m in ours} | {(m, 4, 1, 2, "GPipe") for m in ours}
    expected |= {("moe_deepseek_style", 4, 1, 4, "1F1B"), ("moe_mixtral_style", 2, 2, 2, "Interleaved1F1B")}
    expected |= {("moe_mixtral_style", 4, 1, 2, "1F1B")}
    expected |= {("mixtral", 2, 2, 2, "1F1B")} if importlib.util.find_spec("transformers") else set()
    assert runs == expected
    assert all(r["expert_params"] > 0 for r in results), "a configuration sharded no experts"
    assert any("clip" in r for r in results)
    assert [r["precision"] for r in results if "precision" in r] == ["bf16-mixed"]
    exact = [r for r in results if "precision" not in r]
    for kind in ("worst_param", "worst_grad", "worst_loss", "worst_norm"):
        assert max(r[kind] for r in exact) <= TOL, (kind, max(exact, key=lambda r: r[kind]))


def test_layout_ep_divides_dp() -> None:
    base = dict(dp=4, pp=1, micro_batch_size=2, num_microbatches=2, schedule="1F1B", cut_positions=(0, 10))
    assert Layout(**base, ep=2).to_json()["ep"] == 2
    assert "ep" not in Layout(**base).to_json()
    assert Layout.from_json(Layout(**base, ep=4).to_json()).ep == 4
    for bad in (3, 0, True):
        with pytest.raises(PlanError, match="ep must be a positive whole number dividing dp 4"):
            Layout(**base, ep=bad)


def test_expert_parallelism_refuses_what_it_does_not_run() -> None:
    base = dict(dp=2, pp=1, micro_batch_size=2, num_microbatches=2, cut_positions=(0, 10), ep=2)
    assert expert_refusal(Layout(**base, schedule="1F1B"), "fp32") == ""
    assert expert_refusal(Layout(**base, schedule="1F1B"), "bf16-mixed") == ""
    assert "ZeRO 0, not 1" in expert_refusal(Layout(**base, schedule="1F1B", zero_stage=1), "fp32")
    zero_bubble = Layout(**{**base, "cut_positions": (0, 5, 10)}, schedule="ZBVZeroBubble", stages_per_rank=2)
    assert "does not run ZBVZeroBubble" in expert_refusal(zero_bubble, "fp32")
    assert "not bf16-master" in expert_refusal(Layout(**base, schedule="1F1B"), "bf16-master")
    assert expert_refusal(Layout(**{**base, "ep": 1}, schedule="1F1B", zero_stage=3), "fp32") == ""


@pytest.mark.parametrize("model", ["moe_mixtral_style", "moe_deepseek_style"])
def test_a_rank_holds_its_slice_of_every_layer_under_the_names_of_the_model(model: str) -> None:
    """What one rank of 2 keeps (its half of each layer's experts, checked against the whole module, left out of
    DDP), without a process group: the all-to-alls run only in the forward, which torchrun's test runs."""
    spec = load_model(os.path.join(MODELS, f"{model}.py"))
    torch.manual_seed(0)
    whole = spec.build()
    graph = trace(whole, spec.example_inputs, leaf_modules=expert_leaves(whole), batch_size=2)
    stage = nn.Module()
    stage.piece = graph.module
    layers = find_expert_layers(graph).layers
    groups = ExpertGroups(degree=2, rank=1, group=None, replicas=None, dp=2)  # type: ignore[arg-type]
    shards = apply_expert_parallel([stage], layers, graph.module, groups)
    own = dict(whole.named_parameters())
    slices = expert_slices(stage.piece)
    held = {id(p) for n, p in stage.piece.named_parameters() if n in slices}
    assert slices and {id(p) for p in shards.params} == held
    for name, p in stage.piece.named_parameters():
        if name in slices:
            full, rows = slices[name]
            torch.testing.assert_close(p, own[full][rows] if rows is not None else own[full], rtol=0, atol=0)
        else:
            assert p is own[name]
    assert all(isinstance(stage.piece.get_submodule(x.path), ExpertParallel) for x in layers)
    assert sorted(stage._ddp_params_and_buffers_to_ignore) == sorted(f"piece.{n}" for n in slices)
    assert shards.norm_factor(shards.params[0]) == 2.0 and shards.norm_factor(next(iter(own.values()))) == 1.0


def _experts_layer(module: nn.Module, top_k: int = 2) -> tuple[nn.Module, ExpertLayer]:
    """A model holding `module` as its experts (4 of hidden 8), with the layer detection would report."""
    holder = nn.Module()
    holder.experts = module
    layer = ExpertLayer(path="experts", num_experts=4, top_k=top_k, hidden=8, expert_params=64, shared_params=0,
                        router_params=32, gated=False, intermediate=8, router="gate", kept_whole=True)  # fmt: skip
    return holder, layer


def test_experts_whose_slice_or_combine_differs_are_refused() -> None:
    class Squashed(nn.Module):
        """The weighted sum of the experts' outputs, squashed after: not a sum a rank can split."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 8))

        def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            dense = weights.new_zeros(hidden.shape[0], self.w.shape[0]).scatter_add(1, index, weights)
            return torch.tanh((dense.t().unsqueeze(-1) * torch.matmul(hidden, self.w)).sum(0))

    class Sized(Squashed):
        """Sized by a constant number of experts, not by its parameters."""

        def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            dense = weights.new_zeros(hidden.shape[0], 4).scatter_add(1, index, weights)
            return (dense.t().unsqueeze(-1) * torch.matmul(hidden, self.w)).sum(0)

    groups = ExpertGroups(degree=2, rank=1, group=None, replicas=None, dp=2)  # type: ignore[arg-type]
    for module, message in ((Squashed(), "do not compute a token as the weighted sum of its experts' outputs"),
                            (Sized(), "compute otherwise on a slice of their experts (RuntimeError")):  # fmt: skip
        holder, layer = _experts_layer(module)
        stage = nn.Module()
        stage.piece = holder
        with pytest.raises(PlanError, match=message.replace("(", r"\(")):
            apply_expert_parallel([stage], [layer], holder, groups)
