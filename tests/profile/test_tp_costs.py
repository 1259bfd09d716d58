"""A transformer layer as one tensor-parallel rank runs it, against Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"), Table 2's "tensor parallel" row, sbh·(10 + 24/t) without
the s² terms (fused attention), and its "tensor + sequence parallel" row, sbh·34/t exactly (the Linears' gathered
inputs saved as each rank's slice, as Megatron-LM saves them); the matmul FLOPs divided by t; the collectives
against their closed forms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pyplan
from pyplan import _core
from pyplan.api import chain_for
from pyplan.graph.layergraph import Affine
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.tensor_parallel import derive_tp_plan
from pyplan.hardware import Cluster, Link
from pyplan.plan import Workload
from pyplan.profile.capture import chain_at_degree
from pyplan.profile.tensor_parallel import TpCollectives, collective_bytes, collective_times
from pyplan.zoo.transformer import GPT, GPTConfig, Llama, LlamaConfig


def _setup(build, seq: int, vocab: int, *, sequence_parallel: bool = False):
    spec = pyplan.ModelSpec(name="m", build=build, example_inputs=lambda b: (torch.randint(0, vocab, (b, seq)),))
    with torch.device("meta"):
        model = spec.build()
    cluster, workload = Cluster.from_catalog("a100-80g", 8), Workload(global_batch=8, precision="bf16-mixed")
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    plan = derive_tp_plan(chain.graph)

    def at(t: int) -> pyplan.Chain:
        zone = sequence_zone(chain.graph, plan, t) if sequence_parallel and t > 1 else None
        assert zone is None or zone, zone.reason
        return chain_at_degree(chain, plan, t, spec.example_inputs, cluster, workload, zone)

    return at, chain, plan, cluster


def _layer(chain: pyplan.Chain, prefix: str) -> tuple[float, float, float, float, float]:
    blocks = [b for b in chain.blocks if b.name.startswith(prefix)]
    return (
        sum(b.saved_bytes.per_sample for b in blocks),
        sum(b.flops_fwd.per_sample for b in blocks),
        sum(b.flops_bwd.per_sample for b in blocks),
        sum(b.fwd_time_s.per_sample for b in blocks),
        sum(b.param_numel for b in blocks),
    )


@pytest.mark.parametrize("seq", [1024, 4096])
def test_a_gpt_layer_on_one_rank_saves_what_korthikanti_counts_for_tensor_parallelism(seq: int) -> None:
    """Whole on every rank: the two LayerNorms' inputs, the QKV and MLP inputs (4 tensors of s·h) and the two
    dropout masks; split: Q, K, V, the attention output, the 4h GELU input and output (12 tensors), and the
    kernel's log-sum-exp. In fp32, the profile's tensors: 4·4·sh + 12·4·sh/t + 2·sh + 4·a·s/t + the LayerNorms'
    statistics 2·2·4·s, which is Table 2's sbh(10 + 24/t) at 2 bytes. FLOPs: (24·s·h² + 4·s²·h)/t forward,
    (48·s·h² + 10·s²·h)/t backward."""
    h, a = 1024, 16
    at, _, _, _ = _setup(lambda: GPT(GPTConfig(n_layer=2, n_head=a, n_embd=h, n_ctx=seq, vocab_size=512)), seq, 512)
    params_1 = _layer(at(1), "transformer.h.0")[4]
    for t in (1, 2, 4, 8):
        saved, fwd, bwd, _, params = _layer(at(t), "transformer.h.0")
        assert saved == 4 * 4 * seq * h + 12 * 4 * seq * h / t + 2 * seq * h + 4 * a * seq / t + 2 * 2 * 4 * seq
        assert fwd == (24 * seq * h * h + 4 * seq * seq * h) / t
        assert bwd == (48 * seq * h * h + 10 * seq * seq * h) / t
        # of 12h² + 13h, whole on every rank: the row Linears' biases (2h) and the LayerNorms (4h)
        assert params == (params_1 - 6 * h) / t + 6 * h


@pytest.mark.parametrize("seq", [1024, 4096])
def test_with_sequence_parallelism_a_gpt_layer_keeps_what_korthikanti_counts(seq: int) -> None:
    """The second layer (the first one's input comes from the embeddings, whole): the LayerNorms' inputs and
    statistics and the dropout masks are split too, and so are the inputs of the QKV and the MLP's first Linear,
    saved as each rank's slice and gathered again in backward, as Megatron-LM does: Korthikanti's sbh·34/t at
    2 bytes, 66·sh/t in the profile's fp32 with 1-byte masks, besides the kernel's log-sum-exp and the LayerNorms'
    statistics. The FLOPs do not move."""
    h, a = 1024, 16
    at, _, _, _ = _setup(
        lambda: GPT(GPTConfig(n_layer=2, n_head=a, n_embd=h, n_ctx=seq, vocab_size=512)), seq, 512,
        sequence_parallel=True,
    )  # fmt: skip
    sh = seq * h
    for t in (1, 2, 4, 8):
        saved, fwd, bwd, _, _ = _layer(at(t), "transformer.h.1")
        assert saved == 66 * sh / t + 4 * a * seq / t + 16 * seq / t
        assert fwd == (24 * seq * h * h + 4 * seq * seq * h) / t
        assert bwd == (48 * seq * h * h + 10 * seq * seq * h) / t


def test_sequence_parallelism_trades_each_all_reduce_for_a_reduce_scatter_and_an_all_gather() -> None:
    """Per layer of the zone: each row output reduce-scattered forward and gathered backward, each region input
    gathered forward and reduce-scattered backward, S = s·h each: the bytes on the link of the all-reduces they
    replace (an all-reduce moves twice an all-gather's), plus one all-gather per region input in backward, which
    gathers it again for the weight gradients (saved as each rank's slice). Before the zone, the first layer's
    attention input is whole (its gradient all-reduced, nothing gathered again) and the residual stream is sliced
    into it (its gradient gathered)."""
    seq, h, t = 1024, 1024, 4
    _, chain, plan, cluster = _setup(
        lambda: GPT(GPTConfig(n_layer=2, n_head=16, n_embd=h, n_ctx=seq, vocab_size=512)), seq, 512
    )
    zone = sequence_zone(chain.graph, plan, t)
    plain, sp = collective_bytes(chain, plan, t), collective_bytes(chain, plan, t, zone)
    second = [i for i, b in enumerate(chain.blocks) if b.name.startswith("transformer.h.1")]
    s = 4 * seq * h  # fp32
    assert sum(sp[i].fwd_reduce_scatter.per_sample for i in second) == 2 * s
    assert sum(sp[i].bwd_all_gather.per_sample for i in second) == 2 * s + 2 * s  # row outputs, inputs again
    assert sum(sp[i].fwd_all_gather.per_sample for i in second) == 2 * s
    assert sum(sp[i].bwd_reduce_scatter.per_sample for i in second) == 2 * s
    assert sum(sp[i].fwd_all_reduce.per_sample + sp[i].bwd_all_reduce.per_sample for i in second) == 0
    first = [i for i, b in enumerate(chain.blocks) if b.name.startswith("transformer.h.0")]
    assert sum(sp[i].bwd_all_reduce.per_sample for i in first) == s
    # two row outputs, the sliced stream, the MLP's input again
    assert sum(sp[i].bwd_all_gather.per_sample for i in first) == 4 * s
    bw = cluster.groups[0].intra_link.collective[1]
    sp_times, plain_times = collective_times(sp, t, 0.0, bw), collective_times(plain, t, 0.0, bw)
    again = _core.all_gather_time_s(2 * s * 2, t, latency_s=0.0, bw_bytes_per_s=bw)  # two inputs at b = 2
    assert sum((sp_times[i][0] + sp_times[i][1])(2) for i in second) == pytest.approx(
        sum((plain_times[i][0] + plain_times[i][1])(2) for i in second) + again, rel=1e-12
    )


def test_a_llama_layer_splits_linearly_in_the_degree() -> None:
    """Rotary embeddings, SwiGLU, 8 KV heads of 32: everything a rank saves is a whole part plus a part split t
    ways, so three degrees lie on one line in 1/t; the FLOPs are all matmuls, divided by t."""
    seq, h, heads, kv_heads, f = 1024, 1024, 32, 8, 2816
    cfg = LlamaConfig(dim=h, n_layers=2, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=f, vocab_size=512,
                      max_seq_len=seq)  # fmt: skip
    at, _, _, _ = _setup(lambda: Llama(cfg), seq, 512)
    layers = {t: _layer(at(t), "layers.0") for t in (1, 2, 4, 8)}
    whole = 2 * layers[2][0] - layers[1][0]  # saved(t) = whole + split / t
    split = layers[1][0] - whole
    assert split > 0 and whole > 0
    for t in (4, 8):
        assert layers[t][0] == pytest.approx(whole + split / t, rel=1e-12)
        assert layers[t][1] == layers[1][1] / t and layers[t][2] == layers[1][2] / t


def test_the_collectives_are_the_regions_all_reduces_on_the_link_inside_a_node() -> None:
    """Per layer: forward, an all-reduce of each row Linear's output (attention, MLP); backward, one of each
    region's input gradient; each 2(t−1)(lat + S/(t·bw)) for S = s·h bytes at 16 bits, added to the block's
    time (the same profile over a link that costs nothing is the computation alone)."""
    seq, h, t = 1024, 1024, 4
    at, chain, plan, cluster = _setup(
        lambda: GPT(GPTConfig(n_layer=2, n_head=16, n_embd=h, n_ctx=seq, vocab_size=512)), seq, 512
    )
    traffic = collective_bytes(chain, plan, t)
    layer = [i for i, b in enumerate(chain.blocks) if b.name.startswith("transformer.h.0")]
    assert sum(traffic[i].fwd_all_reduce.per_sample for i in layer) == 2 * 4 * seq * h  # traced in fp32
    assert sum(traffic[i].bwd_all_reduce.per_sample for i in layer) == 2 * 4 * seq * h
    last = next(i for i, b in enumerate(chain.blocks) if "lm_head" in b.nodes)
    assert traffic[last].fwd_all_gather.per_sample == 4 * seq * 512  # the logits
    assert all(c == TpCollectives(Affine(), Affine(), Affine()) for c in collective_bytes(chain, plan, 1))

    lat, bw = cluster.groups[0].intra_link.collective
    times = collective_times(traffic, t, lat, bw, scale=0.5)
    for i in layer:
        size = traffic[i].fwd_all_reduce
        if size.per_sample:
            want = _core.ring_allreduce_time_s(0.5 * size(3), t, latency_s=lat, bw_bytes_per_s=bw)
            assert times[i][0](3) == pytest.approx(want, rel=1e-12)
    group = cluster.groups[0]
    free = replace(group, intra_link=Link(name="free", latency_s=0.0, bw_bytes_per_s=1e30))
    workload = Workload(global_batch=8, precision="bf16-mixed")
    inputs = lambda b: (torch.randint(0, 512, (b, seq)),)  # noqa: E731
    alone = chain_at_degree(chain, plan, t, inputs, replace(cluster, groups=(free,)), workload)
    priced = at(t)
    for i, (a, p) in enumerate(zip(alone.blocks, priced.blocks, strict=True)):
        assert p.fwd_time_s(3) == pytest.approx(a.fwd_time_s(3) + times[i][0](3), rel=1e-9, abs=1e-15)
        assert p.bwd_time_s(3) == pytest.approx(a.bwd_time_s(3) + times[i][1](3), rel=1e-9, abs=1e-15)


def test_hugging_face_gpt2s_conv1d_layers_gain_what_sequence_parallelism_saves_a_gpt() -> None:
    """GPT-2 as transformers writes it (Conv1D: `addmm` on the tokens flattened, viewed back): with sequence
    parallelism its second layer keeps 1/t of what the zone splits, as the GPT above: the two LayerNorms' inputs
    (4·sh each in fp32) and statistics (2·4·s each), the two residual dropouts' masks (sh each), and the two
    gathered inputs of the QKV and the MLP's first Conv1D (4·sh each, viewed flattened), saved as each rank's
    slice: (18·sh + 16·s)·(1 − 1/t) less than tensor parallelism alone; and its collectives move the bytes of the
    all-reduces they replace (a reduce-scatter and an all-gather each way per region, S = s·h), and gather each
    region's input again in backward."""
    seq, h, a = 256, 256, 4
    ref = f"hf:gpt2:n_layer=2,n_embd={h},n_head={a},vocab_size=512,seq_len={seq},bos_token_id=0,eos_token_id=0"
    spec = pyplan.load_model(ref)
    at_tp, chain, plan, _ = _setup(spec.build, seq, 512)
    at_sp, _, _, _ = _setup(spec.build, seq, 512, sequence_parallel=True)
    sh = seq * h
    for t in (2, 4):
        tp, sp = _layer(at_tp(t), "transformer.h.1"), _layer(at_sp(t), "transformer.h.1")
        assert tp[0] - sp[0] == (10 * sh + 16 * seq + 2 * 4 * sh) * (1 - 1 / t)
        assert (tp[1], tp[2]) == (sp[1], sp[2])
    zone = sequence_zone(chain.graph, plan, 4)
    traffic = collective_bytes(chain, plan, 4, zone)
    second = [i for i, b in enumerate(chain.blocks) if b.name.startswith("transformer.h.1")]
    for kind in ("fwd_reduce_scatter", "fwd_all_gather", "bwd_reduce_scatter"):
        assert sum(getattr(traffic[i], kind).per_sample for i in second) == 2 * 4 * sh, kind
    assert sum(traffic[i].bwd_all_gather.per_sample for i in second) == 2 * 2 * 4 * sh  # row outputs, inputs again
    assert sum(traffic[i].fwd_all_reduce.per_sample + traffic[i].bwd_all_reduce.per_sample for i in second) == 0
