"""Tensor parallelism at run time: captured models split over a DeviceMesh axis train exactly what one process
trains (zoo gpt-tiny: plain fx, a fused QKV, tied embeddings; a Hugging Face Llama: torch.export, rotary, SwiGLU,
grouped-query attention; a Hugging Face BERT), alone and beside data parallelism."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from pyplan.errors import PlanError
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.tensor_parallel import TpPlan, derive_tp_plan
from pyplan.graph.trace import Examples, trace
from pyplan.load import load_model
from pyplan.runtime.tensor_parallel import tp_styles
from tests.runtime.conftest import Launches

# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((4, "_tensor_parallel"),)
TOL = 1e-10  # float64: the rounding of sums taken in another order is ~1e-15 here
MAX_NORM = 0.05  # the worker's clipping threshold


@pytest.fixture(scope="module")
def gpt() -> LayerGraph:
    spec = load_model("zoo:gpt-tiny")
    return trace(spec.build(), Examples(spec.example_inputs), batch_size=2)


def test_gpt_tiny_splits_its_fused_qkv_in_three_pieces_and_its_vocabulary(gpt: LayerGraph) -> None:
    styles = tp_styles(gpt, derive_tp_plan(gpt), 2)
    qkv = styles["transformer.h.0.attn.c_attn"]
    assert isinstance(qkv, ColwiseParallel) and getattr(qkv, "parts", 1) == 3
    assert type(styles["transformer.h.0.mlp.c_fc"]) is ColwiseParallel
    assert isinstance(styles["transformer.h.0.attn.c_proj"], RowwiseParallel)
    embedding, head = styles["transformer.wte"], styles["lm_head"]
    assert isinstance(embedding, RowwiseParallel) and embedding.input_layouts == (Replicate(),)
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert len(styles) == 10


def test_a_tied_weight_split_in_one_layer_and_read_whole_in_another_is_refused(gpt: LayerGraph) -> None:
    # gpt-tiny's embedding and output layer share one weight: splitting only one of them cannot run.
    plan = derive_tp_plan(gpt)
    with pytest.raises(PlanError, match=r"'lm_head' splits the parameter .* which 'transformer.wte' reads whole"):
        tp_styles(gpt, TpPlan(output_layers=plan.output_layers), 2)
    with pytest.raises(PlanError, match=r"'transformer.wte' splits the parameter .* which 'lm_head' reads whole"):
        tp_styles(gpt, TpPlan(embeddings=plan.embeddings), 2)


@pytest.mark.distributed
def test_tensor_parallel_trains_like_one_process(launches: Launches) -> None:
    results = launches.part(4, "_tensor_parallel").results()
    failed = [r for r in results if not r["ok"]]
    assert not failed, failed[:2]
    # Dropout draws the same masks on the ranks of the tp axis once they share a random state.
    dropout = [r for r in results if r["model"] == "dropout"]
    assert len(dropout) == 4 and all(r["synced_agree"] and not r["reseeded_agree"] for r in dropout)
    # ZeRO-1 beside tensor parallelism: each replica holds the optimizer state the plan counts for its share (the
    # fullest one exactly that), and after the step the replicas' parameters are equal.
    zero1 = [r for r in results if r["model"] == "zero1"]
    assert len(zero1) == 4 and all(r["replicas_agree"] for r in zero1)
    assert max(r["held"] for r in zero1) == zero1[0]["planned"] and min(r["held"] for r in zero1) > 0
    # bf16 weights beside fp32 master weights at dp 2 x tp 2 with sequence parallelism, ZeRO-1: each rank holds the
    # model state the plan counts (the fullest replica exactly that), the replicas agree after the step, and the
    # gradients are one process's bf16 arithmetic up to bf16's rounding of matrix products split over two ranks
    # (1.5e-2 of the norm here).
    master = [r for r in results if r["model"] == "master"]
    assert len(master) == 4 and all(r["replicas_agree"] and r["dtypes"] == ["torch.bfloat16"] for r in master)
    assert max(r["held"] for r in master) == master[0]["planned"] and min(r["held"] for r in master) > 0, master
    assert all(r["grad_err"] < 3e-2 for r in master), master
    # ZeRO-3 beside it (FSDP2 over the traced model's pieces): each rank holds the model state the plan counts for
    # its tp-local shapes, and a checkpoint of it resumes exactly under ZeRO-3 and under ZeRO-1.
    zero3 = [r for r in results if r["model"] == "zero3"]
    assert len(zero3) == 4 and all(r["held"] == r["planned"] > 0 for r in zero3), zero3[0]
    assert all(err == 0.0 for r in zero3 for err in r["resumed"].values()), zero3
    # The loss on each rank's slice of the vocabulary is the loss on the whole logits, and so is its gradient.
    vocab = [r for r in results if r["model"] == "vocab_loss"]
    assert len(vocab) == 4 and all(r["loss_err"] <= TOL and r["grad_err"] <= TOL for r in vocab), vocab
    runs = [r for r in results if r["model"] not in ("dropout", "zero1", "master", "zero3", "vocab_loss")]
    kinds = {(r["model"].split(":")[1], r["dp"], r["sp"]) for r in runs}
    assert kinds == {(m, dp, sp) for m, dp in (("gpt-tiny", 1), ("gpt-tiny", 2), ("llama", 1), ("bert", 1),
                                               ("gpt2", 1))
                     for sp in (False, True)} | {("nemotron", 1, True), ("qwen3", 1, True),
                                                 ("persimmon", 1, True)}  # fmt: skip
    assert sum("tie_word_embeddings=True" in r["model"] for r in runs) == 4  # 2 ranks, with and without SP
    for r in runs:
        where = f"{r['model']} dp={r['dp']} sp={r['sp']} rank {r['rank']}"
        # Sequence parallelism: the row Linears give each rank half the tokens (a vocabulary-parallel embedding,
        # before the zone, all of them); without it every output has all of them.
        tokens = set(r["row_tokens"])
        assert (r["tokens"] // 2 in tokens) == r["sp"] and tokens <= {r["tokens"], r["tokens"] // 2}, where
        assert r["loss_err"] <= TOL, where
        assert r["grad_err"] <= TOL, (where, r["grad_worst"], r["grad_err"])
        assert r["pieces_err"] <= TOL, (where, "cut in two pieces", r["pieces_worst"], r["pieces_err"])
        assert r["param_err"] <= TOL, (where, r["param_worst"], r["param_err"])
        # The clipping scaled the gradients, by the norm one process computes.
        assert r["ref_norm"] > MAX_NORM, where
        assert abs(r["norm"] - r["ref_norm"]) <= TOL * r["ref_norm"], where
        assert abs(r["weighted_norm"] - r["ref_norm"]) <= TOL * r["ref_norm"], where
        # Every parameter is a DTensor, split ones among them; gpt-tiny's fused QKV splits each of Q, K and V.
        assert "(Replicate(),)" in r["placements"] and "(Shard(dim=0),)" in r["placements"], where
        if "gpt-tiny" in r["model"]:
            assert "(_StridedShard(dim=0, sf=3),)" in r["placements"], where
        if "gpt2" in r["model"]:  # Conv1D's fused QKV, its weight laid out (in, out): split along its outputs
            assert "(_StridedShard(dim=1, sf=3),)" in r["placements"], where
    # With sequence parallelism, a layer of GPT-2 (Hugging Face's Conv1D and gpt-tiny's Linears) saves at run time
    # the bytes the profile of the rank counts for it: the Linears' gathered inputs as each rank's slice, gathered
    # again in backward (Megatron-LM's way), which the training above went through.
    layers = [r for r in runs if r["layer_saved"] is not None]
    assert {(r["model"].split(":")[1].split(",")[0], r["sp"], r["dp"]) for r in layers} == {
        ("gpt2", True, 1),
        ("gpt-tiny", True, 1),
    }
    assert len(layers) == 4, layers  # 2 ranks each
    for r in layers:
        where = f"{r['model']} rank {r['rank']}: measured {r['layer_saved']}, profiled {r['layer_profiled']}"
        assert r["layer_saved"] == r["layer_profiled"] > 0, where
