"""Tensor-parallel plans derived from captured graphs: Megatron's regions found in a GPT (fx, fused QKV), a
Llama (torch.export, rotary, SwiGLU, grouped-query attention) and a BERT; what stays whole and why; one rank's
graph at each degree; a user's --tp-plan checked against the model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pyplan.errors import PlanError
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.tensor_parallel import TpPlan, derive_tp_plan, local_module, read_tp_plan, restrict_tp_plan
from pyplan.graph.trace import Examples, graph_of, trace
from pyplan.load import load_model

PLAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "plain.py")
LLAMA = "hf:llama:hidden_size=64,intermediate_size=96,num_hidden_layers=2,num_attention_heads=4," \
        "num_key_value_heads=2,vocab_size=100,seq_len=8"  # fmt: skip
BERT = "hf:bert:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,vocab_size=100," \
       "seq_len=8"  # fmt: skip


def _graph(ref: str):
    spec = load_model(ref)
    examples = Examples(spec.example_inputs)
    return trace(spec.build(), examples, batch_size=2), examples


@pytest.fixture(scope="module")
def gpt():
    return _graph("zoo:gpt-tiny")


@pytest.fixture(scope="module")
def llama():
    return _graph(LLAMA)


def test_a_gpt_splits_attention_over_heads_and_the_mlp_over_its_features(gpt) -> None:
    graph, _ = gpt
    plan = derive_tp_plan(graph)
    by_column = {r.columns: r for r in plan.regions}
    attn = by_column[("transformer.h.0.attn.c_attn",)]
    assert attn.rows == ("transformer.h.0.attn.c_proj",)
    assert attn.parts == {"transformer.h.0.attn.c_attn": 3}  # Q, K and V in one Linear: a slice of each
    assert 4 in attn.sizes  # the heads: a degree must divide them
    mlp = by_column[("transformer.h.0.mlp.c_fc",)]
    assert mlp.rows == ("transformer.h.0.mlp.c_proj",)
    assert len(plan.regions) == 4
    # The token embedding and the output layer share their weight and split it alike (over the vocabulary); the
    # position embedding, looked up by computed positions, stays whole.
    assert [e.module for e in plan.embeddings] == ["transformer.wte"]
    assert [o.module for o in plan.output_layers] == ["lm_head"]
    assert plan.styles(2)["transformer.h.1.attn.c_attn"] == "ColwiseParallel"
    assert plan.styles(2)["transformer.h.1.mlp.c_proj"] == "RowwiseParallel"
    assert plan.styles(2)["transformer.wte"] == "RowwiseParallel"
    # 8 does not divide 4 heads: the attention stays whole there, the MLP (256 features) splits.
    assert "transformer.h.0.attn.c_attn" not in plan.styles(8)
    assert "transformer.h.0.mlp.c_fc" in plan.styles(8)
    assert plan.degrees(8) == (1, 2, 4, 8)


def test_a_llama_pulls_key_and_value_into_the_query_region_and_splits_kv_heads(llama) -> None:
    graph, _ = llama
    plan = derive_tp_plan(graph)
    regions = {r.rows: r for r in plan.regions}
    attn = regions[("model.layers.0.self_attn.o_proj",)]
    assert set(attn.columns) == {f"model.layers.0.self_attn.{x}_proj" for x in "qkv"}
    assert attn.splits_at(2) and not attn.splits_at(4)  # 2 KV heads
    mlp = regions[("model.layers.0.mlp.down_proj",)]
    assert set(mlp.columns) == {"model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert mlp.splits_at(4) and not mlp.splits_at(5)  # 96 features
    assert len(attn.inputs) == 1 and len(mlp.inputs) == 1  # one all-reduce of the input's gradient each
    assert [e.module for e in plan.embeddings] == ["model.embed_tokens"]
    assert [o.module for o in plan.output_layers] == ["lm_head"]


def test_a_bert_splits_its_self_attention_and_intermediate_layers() -> None:
    graph, _ = _graph(BERT)
    plan = derive_tp_plan(graph)
    columns = {c for r in plan.regions for c in r.columns}
    rows = {c for r in plan.regions for c in r.rows}
    assert {f"bert.encoder.layer.1.attention.self.{x}" for x in ("query", "key", "value")} <= columns
    assert "bert.encoder.layer.1.attention.output.dense" in rows
    assert "bert.encoder.layer.1.intermediate.dense" in columns and "bert.encoder.layer.1.output.dense" in rows
    # The decoder shares its weight with the word embedding, which a padding index keeps whole: both stay whole.
    assert not plan.output_layers and not plan.embeddings
    assert "tied" in plan.replicated["cls.predictions.decoder"]


def test_a_squared_relu_mlp_splits_like_any_other() -> None:
    """Nemotron's MLP (up, squared ReLU, down; no gate): torch.square acts on each element, so the region stands."""
    graph, _ = _graph(
        "hf:nemotron:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,head_dim=16,"
        "num_key_value_heads=2,vocab_size=100,seq_len=8"
    )
    plan = derive_tp_plan(graph)
    assert plan.styles(2)["model.layers.1.mlp.up_proj"] == "ColwiseParallel"
    assert plan.styles(2)["model.layers.1.mlp.down_proj"] == "RowwiseParallel"
    assert not any(name.endswith("mlp.up_proj") for name in plan.replicated)


def test_a_norm_over_each_heads_features_stays_inside_the_attention_region() -> None:
    """Qwen3 normalizes each head's query and key (RMSNorm over the head size: a mean over the last dimension while
    the heads are sharded), Persimmon with a LayerNorm, so their attention splits; OLMo-2 normalizes the whole
    projection (a mean along the sharded dimension), so its attention stays whole, with the reason."""
    tiny = "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2," \
           "vocab_size=100,seq_len=8"  # fmt: skip
    qwen3 = derive_tp_plan(_graph(f"hf:qwen3:{tiny},head_dim=16")[0])
    assert {qwen3.styles(2)[f"model.layers.1.self_attn.{x}_proj"] for x in "qkvo"} == {
        "ColwiseParallel", "RowwiseParallel"}  # fmt: skip
    assert qwen3.styles(2)["model.layers.1.self_attn.o_proj"] == "RowwiseParallel" and not qwen3.replicated
    # Each rank normalizes its own heads with the whole norm weight: its gradient there is a partial sum.
    assert set(qwen3.partial_params(2)) == {
        f"model.layers.{i}.self_attn.{x}_norm.weight" for i in (0, 1) for x in "qk"}  # fmt: skip
    # Persimmon: its fused QKV viewed per head and picked by index, a LayerNorm over each head's query and key.
    persimmon = derive_tp_plan(_graph(f"hf:persimmon:{tiny.replace(',num_key_value_heads=2', '')}")[0])
    assert persimmon.styles(2)["model.layers.1.self_attn.query_key_value"] == "ColwiseParallel"
    assert not persimmon.replicated
    assert {"model.layers.1.self_attn.q_layernorm.weight", "model.layers.1.self_attn.q_layernorm.bias"} <= set(
        persimmon.partial_params(2))  # fmt: skip
    olmo2 = derive_tp_plan(_graph(f"hf:olmo2:{tiny}")[0])
    assert "model.layers.1.self_attn.q_proj" not in olmo2.styles(2)
    assert "q_norm" in olmo2.replicated["model.layers.1.self_attn.q_proj"]


def test_what_has_no_megatron_pattern_stays_whole_with_the_reason() -> None:
    """nn.TransformerEncoder's attention projects Q, K and V with one packed weight and unflattens it: not
    followed, so it stays whole; its feed-forward layers split."""
    graph, _ = _graph(f"{PLAIN}:transformer_encoder")
    plan = derive_tp_plan(graph)
    assert [r.columns for r in plan.regions] == [("layers.0.linear1",), ("layers.1.linear1",)]
    assert "unflatten" in plan.replicated["layers.0.self_attn"]


@pytest.mark.parametrize("degree", [2, 4])
def test_one_ranks_graph_holds_its_shards_and_runs_on_them(gpt, degree: int) -> None:
    graph, examples = gpt
    plan = derive_tp_plan(graph)
    full = dict(graph.module.named_parameters())
    for rank in range(degree):
        gm = local_module(graph, plan, degree, rank)
        local = dict(gm.named_parameters())
        assert set(local) == set(full)
        # a slice of each of Q, K and V (rows of c_attn: [Q; K; V]), the rank's own
        q, k, v = full["transformer.h.0.attn.c_attn.weight"].detach().chunk(3)
        want = torch.cat([x.chunk(degree)[rank] for x in (q, k, v)])
        assert torch.equal(local["transformer.h.0.attn.c_attn.weight"], want)
        proj = full["transformer.h.0.attn.c_proj.weight"]
        assert torch.equal(local["transformer.h.0.attn.c_proj.weight"], proj.chunk(degree, 1)[rank])
        assert torch.equal(local["transformer.h.0.attn.c_proj.bias"], full["transformer.h.0.attn.c_proj.bias"])
        assert local["transformer.wte.weight"].shape == (256 // degree, 64)
        assert local["transformer.wpe.weight"].shape == full["transformer.wpe.weight"].shape
        shapes = {n.name: n.outputs[0].shape for n in graph_of(gm, examples, 2).nodes if n.outputs}
        assert shapes["scaled_dot_product_attention"] == (2, 4 // degree, 32, 16)
        assert shapes["lm_head"] == (2, 32, 256 // degree)  # gathered by the style, not in the graph
    # The original is untouched.
    assert graph.module.get_submodule("transformer.h.0.attn.c_attn").weight.shape == (192, 64)


def test_a_rank_of_the_llama_reshapes_its_heads_itself(llama) -> None:
    graph, examples = llama
    gm = local_module(graph, derive_tp_plan(graph), 2)
    shapes = {n.name: n.outputs[0].shape for n in graph_of(gm, examples, 2).nodes if n.outputs}
    assert shapes["scaled_dot_product_attention"] == (2, 2, 8, 16)  # 4 heads / 2, key and value repeated 2x
    assert shapes["linear_6"] == (2, 8, 64)  # down_proj: partial sums of the whole hidden size


def test_a_tied_embedding_that_export_reads_under_one_name_splits_as_two_layers() -> None:
    """torch.export reads Hugging Face's tied token embedding and output layer both as `lm_head.weight`: the
    embedding is named after the module that made the weight, the output layer after its own, and a rank's graph
    holds the vocabulary's half once (not a half of the half)."""
    graph, examples = _graph(f"{LLAMA},tie_word_embeddings=True")
    plan = derive_tp_plan(graph)
    assert [e.module for e in plan.embeddings] == ["model.embed_tokens"]
    assert [o.module for o in plan.output_layers] == ["lm_head"]
    styles = plan.styles(2)
    assert (styles["model.embed_tokens"], styles["lm_head"]) == ("RowwiseParallel", "ColwiseParallel")
    gm = local_module(graph, plan, 2)
    assert gm.get_parameter("lm_head.weight").shape == (50, 64)
    shapes = {n.name: n.outputs[0].shape for n in graph_of(gm, examples, 2).nodes if n.outputs}
    assert shapes[plan.output_layers[0].node] == (2, 8, 50)


def test_hugging_face_gpt2s_conv1d_layers_split_as_transposed_linears() -> None:
    """GPT-2's Conv1D is `addmm(bias, x.view(-1, in), weight)` with the weight laid out (in, out): its QKV is fused
    (three pieces, reshaped to (b, t, 3h) before the split), its projections read `view(-1, h)`, whose h a rank
    divides (the other size already infers itself); the ids reach the embedding reshaped. Sequence parallelism
    meets each Linear at its reshapes: a row output is reduce-scattered once viewed back from (b·t, h) to
    (b, t, h), and a column's input gathered before it is flattened."""
    graph, examples = _graph("hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=100,seq_len=8,bos_token_id=0,"
                             "eos_token_id=0")  # fmt: skip
    plan = derive_tp_plan(graph)
    assert [(r.columns, r.rows, dict(r.parts)) for r in plan.regions][:2] == [
        (("transformer.h.0.attn.c_attn",), ("transformer.h.0.attn.c_proj",), {"transformer.h.0.attn.c_attn": 3}),
        (("transformer.h.0.mlp.c_fc",), ("transformer.h.0.mlp.c_proj",), {}),
    ]
    assert [e.module for e in plan.embeddings] == ["transformer.wte"] and not plan.replicated
    gm = local_module(graph, plan, 2)
    assert gm.get_parameter("transformer.h.0.attn.c_attn.weight").shape == (64, 96)  # (in, out / 2)
    assert gm.get_parameter("transformer.h.0.attn.c_proj.weight").shape == (32, 64)  # (in / 2, out)
    shapes = {n.name: n.outputs[0].shape for n in graph_of(gm, examples, 2).nodes if n.outputs}
    assert shapes["scaled_dot_product_attention"] == (2, 2, 8, 16)
    zone = sequence_zone(graph, plan, 2)
    assert zone, zone.reason
    rows = [o for r in plan.regions for o in r.outputs]
    assert zone.rows == tuple(rows) and set(zone.unflattened) == set(rows)
    for row, view in zone.unflattened.items():  # (b·t, h) viewed back to (b, t, h): the tokens at dimension 1
        assert shapes[row] == (16, 64) and shapes[view] == (2, 8, 64) and zone.dims[view] == 1
    # Each region reads its input flattened, (b·t, h); the first reads the embeddings' sum, whole before any row
    # output, so it is not gathered.
    inputs = [r.inputs[0] for r in plan.regions]
    assert [shapes[v] for v in inputs] == [(16, 64)] * 4
    assert set(zone.flattened) == set(inputs[1:]) and set(zone.flattened.values()) == {1}
    nodes = {n.name: n for n in graph.module.graph.nodes}
    assert {u.name for v in zone.flattened for u in nodes[v].users} == set(zone.gathered)
    assert "transformer.h.1.ln_1.weight" in zone.params


def test_a_tp_plan_file_is_checked_against_the_model(gpt, tmp_path: Path) -> None:
    graph, _ = gpt
    plan = derive_tp_plan(graph)
    path = tmp_path / "tp.json"

    def use(data: object) -> TpPlan:
        path.write_text(json.dumps(data))
        return restrict_tp_plan(plan, read_tp_plan(path), graph)

    mlp = {"transformer.h.0.mlp.c_fc": "ColwiseParallel", "transformer.h.0.mlp.c_proj": "RowwiseParallel"}
    got = use({**mlp, "transformer.wte": "RowwiseParallel", "lm_head": "ColwiseParallel"})
    assert [r.columns for r in got.regions] == [("transformer.h.0.mlp.c_fc",)]
    assert set(got.styles(2)) == {*mlp, "transformer.wte", "lm_head"}
    with pytest.raises(PlanError, match=r"^TP plan: the model has no module 'transformer.h.0.mlp.fc'"):
        use({"transformer.h.0.mlp.fc": "ColwiseParallel"})
    with pytest.raises(PlanError, match=r"unknown style 'Colwise' for '[a-z0-9_.]+'; choose one of ColwiseParallel"):
        use({"transformer.h.0.mlp.c_fc": "Colwise"})
    with pytest.raises(PlanError, match=r"SequenceParallel does not fit 'transformer.h.0.mlp.c_fc' \(a linear\)"):
        use({"transformer.h.0.mlp.c_fc": "SequenceParallel"})
    with pytest.raises(PlanError, match=r"ColwiseParallel does not fit 'transformer.wte' \(a embedding\)"):
        use({"transformer.wte": "ColwiseParallel"})
    with pytest.raises(PlanError, match=r"'transformer.h.0.mlp.c_fc' splits as ColwiseParallel .*, not Rowwise"):
        use({"transformer.h.0.mlp.c_fc": "RowwiseParallel"})
    with pytest.raises(PlanError, match=r"'transformer.h.0.mlp.c_fc' splits only with 'transformer.h.0.mlp.c_proj'"):
        use({"transformer.h.0.mlp.c_fc": "ColwiseParallel"})
    # A norm's SequenceParallel asks for sequence parallelism; it splits no layer by itself.
    assert use({**mlp, "transformer.h.0.ln_2": "SequenceParallel"}) == use(mlp)
    with pytest.raises(PlanError, match=r"must be a JSON object of module name -> style"):
        use(["transformer.wte"])
    path.write_text("{")
    with pytest.raises(PlanError, match=r"is not JSON"):
        read_tp_plan(path)
    with pytest.raises(PlanError, match=r"cannot read the TP plan"):
        read_tp_plan(tmp_path / "missing.json")
