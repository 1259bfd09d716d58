"""The MoE cost model (pyplan/profile/experts.py) against hand-derived closed forms for a DeepSeek-V3 and a Mixtral
8x7B layer, the published parameter totals of both models, and brute force over routings.

Shapes. DeepSeek-V3 (arXiv:2412.19437 §4.2; deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json at 9b4e9788):
hidden 7168, 61 layers of which the first 3 dense (intermediate 18432), 256 routed experts of intermediate 2048,
top-8, 1 shared expert of the same size, vocabulary 129280, untied embeddings, MLA with q_lora_rank 1536,
kv_lora_rank 512, 128 heads, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; the gate has a 256-element
selection bias at dim 7168 (inference/model.py, `Gate`). Mixtral 8x7B (arXiv:2401.04088 Table 1): dim 4096,
32 layers, head_dim 128, 32 heads, 8 KV heads, hidden_dim 14336, vocabulary 32000, 8 experts, top-2; both are SwiGLU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from pyplan.errors import PlanError
from pyplan.hardware.catalog import Link, get_link
from pyplan.plan import Workload
from pyplan.profile.experts import (
    ExpertShape,
    all_to_all_bytes,
    all_to_all_time_s,
    expert_cost,
    expert_state,
    ffn_params,
    router_params,
    token_bytes,
)

NVLINK4 = get_link("nvlink4")
IB_NDR = get_link("ib-ndr")

DEEPSEEK_V3 = ExpertShape(
    num_experts=256,
    top_k=8,
    hidden=7168,
    expert_params=ffn_params(7168, 2048, gated=True),
    shared_params=ffn_params(7168, 2048, gated=True),
    router_params=router_params(7168, 256),
)
MIXTRAL = ExpertShape(
    num_experts=8,
    top_k=2,
    hidden=4096,
    expert_params=ffn_params(4096, 14336, gated=True),
    router_params=router_params(4096, 8),
)


def test_links_are_the_catalogs() -> None:
    # The closed forms below are written with these figures: NVLink 4 450 GB/s a direction and 2 us, InfiniBand NDR
    # 50 GB/s and 3 us (pyplan/hardware/data/links.toml).
    assert NVLINK4.collective == (2e-6, 450e9)
    assert IB_NDR.collective == (3e-6, 50e9)


def test_deepseek_v3_layer() -> None:
    # One expert: gate, up and down matrices, 3 · 7168 · 2048 = 44,040,192; the router 7168 · 256 = 1,835,008.
    assert DEEPSEEK_V3.expert_params == 44_040_192
    assert DEEPSEEK_V3.router_params == 1_835_008
    # Forward FLOPs per token: 2 · (8 · 44,040,192 + 44,040,192 + 1,835,008) = 2 · 398,196,736 = 796,393,472.
    assert DEEPSEEK_V3.forward_flops_per_token == 796_393_472

    # E = 64 over 8 nodes of 8 H100s, T = 4096 tokens a rank (one 4096-token sequence), bf16 tokens.
    cost = expert_cost(
        DEEPSEEK_V3,
        degree=64,
        tokens=4096,
        dtype_bytes=2,
        ranks_per_node=8,
        nodes=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR,
        imbalance=1.0,
    )
    assert cost.local_experts == 4
    # The group routes 64 · 4096 · 8 pairs, 8192 an expert; a rank's 4 experts compute 32,768 = T · k of them.
    assert cost.expert_tokens == 32_768
    assert cost.tokens_per_local_expert == 8192
    # Routed: 32,768 · 2 · 44,040,192 = 2,886,218,022,912; router and shared on the rank's own 4096 tokens:
    # 4096 · 2 · (44,040,192 + 1,835,008) = 375,809,638,400; backward twice the sum.
    assert cost.routed_forward_flops == 2_886_218_022_912
    assert cost.dense_forward_flops == 375_809_638_400
    assert cost.backward_flops == 2 * (2_886_218_022_912 + 375_809_638_400)
    # Per all-to-all and rank: 4096 · 8 · 7168 · 2 B · 63/64 = 462,422,016 bytes, 7,340,032 to each of 63 peers.
    assert cost.all_to_all_bytes == 462_422_016
    # 7 peers over NVLink: 7 · (2e-6 + 7,340,032 / 450e9) = 1.28178e-4 s; 56 over InfiniBand:
    # 56 · (3e-6 + 7,340,032 / 50e9) = 8.388836e-3 s; the slower one sets the time.
    assert cost.all_to_all_s == pytest.approx(8.38883584e-3, rel=1e-12)
    assert cost.forward_comm_s == cost.backward_comm_s == pytest.approx(2 * 8.38883584e-3, rel=1e-12)


def test_mixtral_layer() -> None:
    # One expert: 3 · 4096 · 14336 = 176,160,768; the router 4096 · 8 = 32,768.
    assert MIXTRAL.expert_params == 176_160_768
    assert MIXTRAL.router_params == 32_768
    # Forward FLOPs per token: 2 · (2 · 176,160,768 + 32,768) = 704,708,608; backward twice that.
    assert MIXTRAL.forward_flops_per_token == 704_708_608

    inside = expert_cost(
        MIXTRAL,
        degree=8,
        tokens=4096,
        dtype_bytes=2,
        ranks_per_node=8,
        nodes=1,
        intra_link=NVLINK4,
        inter_link=IB_NDR,
        imbalance=1.0,
    )
    assert inside.local_experts == 1
    assert inside.expert_tokens == inside.tokens_per_local_expert == 8192
    assert inside.routed_forward_flops == 8192 * 2 * 176_160_768
    assert inside.backward_flops == 2 * inside.forward_flops
    # 4096 · 2 · 4096 · 2 B · 7/8 = 58,720,256 bytes, 8,388,608 to each of 7 peers, all over NVLink:
    # 7 · (2e-6 + 8,388,608 / 450e9) = 1.444895e-4 s.
    assert inside.all_to_all_bytes == 58_720_256
    assert inside.all_to_all_s == pytest.approx(1.444894577777778e-4, rel=1e-12)

    # The same group one rank a node: 7 · (3e-6 + 8,388,608 / 50e9) = 1.195405e-3 s over InfiniBand.
    across = expert_cost(
        MIXTRAL,
        degree=8,
        tokens=4096,
        dtype_bytes=2,
        ranks_per_node=1,
        nodes=8,
        intra_link=NVLINK4,
        inter_link=IB_NDR,
    )
    assert across.all_to_all_s == pytest.approx(1.19540512e-3, rel=1e-12)
    assert across.expert_tokens == inside.expert_tokens


def _deepseek_v3_params() -> tuple[int, int, int]:
    """(total, active, input embedding) parameters of DeepSeek-V3's main model (the MTP module left out, as the
    671B is: README.md, "671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module")."""
    hidden, heads = 7168, 128
    mla = (
        hidden * 1536  # wq_a
        + 1536  # q_norm
        + 1536 * heads * (128 + 64)  # wq_b
        + hidden * (512 + 64)  # wkv_a
        + 512  # kv_norm
        + 512 * heads * (128 + 128)  # wkv_b
        + heads * 128 * hidden  # wo
    )
    norms = 2 * hidden
    gate_bias = 256  # added to the scores to select experts: a parameter, no matrix product
    dense_layer = mla + norms + ffn_params(hidden, 18432, gated=True)
    moe_total = mla + norms + DEEPSEEK_V3.total_params + gate_bias
    moe_active = mla + norms + DEEPSEEK_V3.active_params + gate_bias
    embedding = 129280 * hidden
    rest = 2 * embedding + hidden  # embedding, output head, final norm
    return 3 * dense_layer + 58 * moe_total + rest, 3 * dense_layer + 58 * moe_active + rest, embedding


def test_deepseek_v3_totals() -> None:
    total, active, embedding = _deepseek_v3_params()
    # Published (README.md at 9b4e9788; arXiv:2412.19437 abstract): 671B total, 37B activated for each token, both
    # rounded to a billion, so within 0.5e9 of the count.
    assert total == 671_026_419_200
    assert abs(total - 671e9) <= 0.5e9
    # 37,552,297,472 with every weight the token touches; the input embedding (926,679,040) is a lookup, not a matrix
    # product: without it 36,625,618,432, within the rounding of 37B, which the count with it (0.55e9 over) is not.
    # DeepSeek's activated count leaves the lookup out (or truncates); the tolerance is the rounding either way.
    assert active == 37_552_297_472
    assert embedding == 926_679_040
    assert abs(active - embedding - 37e9) <= 0.5e9


def test_mixtral_totals() -> None:
    hidden, kv = 4096, 8 * 128
    attention = 2 * hidden * hidden + 2 * hidden * kv  # q and o, k and v (grouped-query)
    common = attention + 2 * hidden  # and the two norms
    rest = 2 * 32000 * hidden + hidden  # embedding, output head, final norm
    total = 32 * (common + MIXTRAL.total_params) + rest
    active = 32 * (common + MIXTRAL.active_params) + rest
    assert (total, active) == (46_702_792_704, 12_879_925_248)
    # Mistral AI's release post: 46.7B total, 12.9B used per token (rounded to 0.1e9: within 0.05e9); the paper
    # (arXiv:2401.04088 §1): 47B and 13B (within 0.5e9). Mixtral's count includes both embeddings.
    assert abs(total - 46.7e9) <= 0.05e9 and abs(active - 12.9e9) <= 0.05e9
    assert abs(total - 47e9) <= 0.5e9 and abs(active - 13e9) <= 0.5e9


def test_state_divides_the_experts_only() -> None:
    # bf16-master AdamW, 2 + 4 + 12 bytes a parameter (DESIGN.md, Megatron's --bf16): a rank of E = 64 holds 4 experts,
    # 4 · 44,040,192 = 176,160,768 elements, 3,170,893,824 bytes; the router and shared expert 45,875,200 elements,
    # 825,753,600 bytes, on every rank.
    master = Workload(global_batch=1, precision="bf16-master")
    state = expert_state(DEEPSEEK_V3, 64, master)
    assert (state.expert_params, state.dense_params) == (176_160_768, 45_875_200)
    assert (state.expert_bytes, state.dense_bytes) == (3_170_893_824, 825_753_600)
    assert state.total_bytes == 3_170_893_824 + 825_753_600
    # ZeRO-1 over the 8 ranks holding the same experts shards the 12 optimizer bytes only:
    # 6 · 176,160,768 + 12 · 176,160,768 / 8 = 1,321,205,760.
    assert expert_state(DEEPSEEK_V3, 64, master, expert_dp=8, zero_stage=1).expert_bytes == 1_321_205_760
    # bf16-mixed AdamW keeps 4 + 4 + 8 bytes; the whole layer on one rank at E = 1.
    mixed = expert_state(MIXTRAL, 1, Workload(global_batch=1, precision="bf16-mixed"))
    assert mixed.expert_bytes == 8 * 176_160_768 * 16
    assert mixed.dense_bytes == 32_768 * 16


# --- Brute force --------------------------------------------------------------------------------------------------


def _enumerate(num_experts: int, top_k: int, ranks_per_node: int, nodes: int, tokens: int) -> dict[str, float]:
    """Every routing of `tokens` tokens on each rank, each token to a set of `top_k` experts, all equally likely:
    the mean over routings of what rank 0 computes and sends (pairs, to its own node and to others), and the mean of
    the busiest rank's load."""
    degree = ranks_per_node * nodes
    local = num_experts // degree
    choices = list(itertools.combinations(range(num_experts), top_k))
    load = intra = inter = busiest = 0.0
    routings = 0
    for routing in itertools.product(choices, repeat=degree * tokens):
        loads = [0] * degree
        for index, experts in enumerate(routing):
            source = index // tokens
            for expert in experts:
                target = expert // local
                loads[target] += 1
                if source == 0 and target != 0:
                    if target // ranks_per_node == 0:
                        intra += 1
                    else:
                        inter += 1
        load += loads[0]
        busiest += max(loads)
        routings += 1
    return {
        "load": load / routings,
        "intra": intra / routings,
        "inter": inter / routings,
        "busiest": busiest / routings,
    }


@pytest.mark.parametrize(
    ("num_experts", "top_k", "ranks_per_node", "nodes", "tokens"),
    [(4, 2, 2, 1, 2), (4, 2, 1, 2, 2), (4, 1, 2, 2, 2), (6, 2, 3, 1, 1)],
)
def test_every_routing(num_experts: int, top_k: int, ranks_per_node: int, nodes: int, tokens: int) -> None:
    """The expected pairs a rank computes and sends, over every routing of a tiny case, equal the closed forms."""
    degree = ranks_per_node * nodes
    hidden, dtype_bytes = 3, 2
    shape = ExpertShape(num_experts=num_experts, top_k=top_k, hidden=hidden, expert_params=5)
    intra_link = Link(name="intra", latency_s=1e-6, bw_bytes_per_s=100.0)
    inter_link = Link(name="inter", latency_s=5e-6, bw_bytes_per_s=10.0)
    cost = expert_cost(
        shape,
        degree=degree,
        tokens=tokens,
        dtype_bytes=dtype_bytes,
        ranks_per_node=ranks_per_node,
        nodes=nodes,
        intra_link=intra_link,
        inter_link=inter_link,
        imbalance=1.0,
    )
    mean = _enumerate(num_experts, top_k, ranks_per_node, nodes, tokens)
    pair_bytes = hidden * dtype_bytes
    assert mean["load"] == pytest.approx(cost.expert_tokens, rel=1e-12)
    assert mean["load"] * 2 * shape.expert_params == pytest.approx(cost.routed_forward_flops, rel=1e-12)
    assert (mean["intra"] + mean["inter"]) * pair_bytes == pytest.approx(cost.all_to_all_bytes, rel=1e-12)
    # The split the time takes: (g − 1)/(E − 1) of the bytes inside the node, (E − g)/(E − 1) across.
    assert mean["intra"] * pair_bytes == pytest.approx(cost.all_to_all_bytes * (ranks_per_node - 1) / (degree - 1))
    assert mean["inter"] * pair_bytes == pytest.approx(cost.all_to_all_bytes * (degree - ranks_per_node) / (degree - 1))
    inside = (ranks_per_node - 1) * 1e-6 + mean["intra"] * pair_bytes / 100.0
    across = (degree - ranks_per_node) * 5e-6 + mean["inter"] * pair_bytes / 10.0
    assert cost.all_to_all_s == pytest.approx(max(inside, across), rel=1e-12)
    # The imbalance factor is the busiest rank's expected load over the mean; given it, the cost is the busiest
    # rank's expected work.
    imbalance = mean["busiest"] / mean["load"]
    assert imbalance > 1
    busiest = expert_cost(
        shape,
        degree=degree,
        tokens=tokens,
        dtype_bytes=dtype_bytes,
        ranks_per_node=ranks_per_node,
        nodes=nodes,
        intra_link=intra_link,
        inter_link=inter_link,
        imbalance=imbalance,
    )
    assert busiest.expert_tokens == pytest.approx(mean["busiest"], rel=1e-12)


def test_random_routing_at_training_size() -> None:
    """DeepSeek-V3's routing (256 experts, top-8) over E = 8 ranks of 2048 tokens, drawn uniformly at random: the
    mean load and bytes match the closed forms, and the busiest rank carries about 1 % over the mean, the sampling
    noise alone (pyplan.profile.experts.DEFAULT_IMBALANCE's comment)."""
    rng = np.random.default_rng(0)
    degree, tokens, num_experts, top_k = 8, 2048, 256, 8
    local = num_experts // degree
    cost = expert_cost(
        DEEPSEEK_V3,
        degree=degree,
        tokens=tokens,
        dtype_bytes=2,
        ranks_per_node=degree,
        nodes=1,
        intra_link=NVLINK4,
        inter_link=IB_NDR,
    )
    loads, sent, busiest = [], [], []
    for _ in range(8):
        # Each token's top-8 of 256 uniform scores: 8 distinct experts, every set equally likely.
        scores = rng.random((degree * tokens, num_experts), dtype=np.float32)
        experts = np.argpartition(scores, -top_k, axis=1)[:, -top_k:]
        target = experts // local
        source = np.repeat(np.arange(degree), tokens)[:, None]
        per_rank = np.bincount(target.ravel(), minlength=degree)
        loads.append(per_rank.mean())
        sent.append(np.count_nonzero(target != source) / degree * DEEPSEEK_V3.hidden * 2)
        busiest.append(per_rank.max())
    assert np.mean(loads) == pytest.approx(cost.expert_tokens, rel=1e-12)  # every pair lands somewhere
    assert np.mean(sent) == pytest.approx(cost.all_to_all_bytes, rel=2e-3)
    noise = np.mean(busiest) / cost.expert_tokens
    assert 1.0 < noise < 1.03


# --- Inputs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CapturedLayer:
    """A stand-in for the capture side's ExpertLayer: its fields, of which the cost model reads six."""

    path: str
    num_experts: int
    top_k: int
    hidden: int
    expert_params: int
    shared_params: int
    router_params: int
    gated: bool


def test_shape_of_a_captured_layer() -> None:
    layer = _CapturedLayer("layers.3.mlp", 256, 8, 7168, 44_040_192, 44_040_192, 1_835_008, gated=True)
    assert ExpertShape.of(layer) == DEEPSEEK_V3


def test_plain_ffn_and_biases() -> None:
    assert ffn_params(8, 32, gated=False) == 2 * 8 * 32
    assert ffn_params(8, 32, gated=False, bias=True) == 2 * 8 * 32 + 32 + 8
    assert ffn_params(8, 32, gated=True, bias=True) == 3 * 8 * 32 + 2 * 32 + 8
    assert router_params(8, 4, bias=True) == 8 * 4 + 4
    assert token_bytes("bf16-mixed") == 2 and token_bytes("fp32") == 4


def test_one_rank_sends_nothing() -> None:
    cost = expert_cost(
        MIXTRAL,
        degree=1,
        tokens=100,
        dtype_bytes=2,
        ranks_per_node=1,
        nodes=1,
        intra_link=NVLINK4,
        inter_link=IB_NDR,
    )
    assert (cost.all_to_all_bytes, cost.all_to_all_s, cost.local_experts) == (0, 0, 8)
    assert cost.expert_tokens == 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"degree": 3, "ranks_per_node": 3, "nodes": 1}, "must divide the layer's 8 experts"),
        ({"degree": 8, "ranks_per_node": 4, "nodes": 1}, "cannot be 4 ranks a node on 1 nodes"),
        ({"degree": 0, "ranks_per_node": 1, "nodes": 1}, "positive integer"),
        ({"degree": 2, "ranks_per_node": 2, "nodes": 1, "imbalance": 0.9}, "at least 1"),
        ({"degree": 2, "ranks_per_node": 2, "nodes": 1, "tokens": -1}, "tokens >= 0"),
    ],
)
def test_bad_inputs(kwargs: dict[str, float], message: str) -> None:
    args = {"tokens": 16, "dtype_bytes": 2, "intra_link": NVLINK4, "inter_link": IB_NDR, **kwargs}
    with pytest.raises(PlanError, match=message):
        expert_cost(MIXTRAL, **args)


def test_bad_shapes() -> None:
    with pytest.raises(PlanError, match="top-k 9"):
        ExpertShape(num_experts=8, top_k=9, hidden=4, expert_params=1)
    with pytest.raises(PlanError, match="cannot be negative"):
        ExpertShape(num_experts=8, top_k=2, hidden=4, expert_params=1, router_params=-1)
    with pytest.raises(PlanError, match="must divide"):
        expert_state(MIXTRAL, 3, Workload(global_batch=1))
    with pytest.raises(PlanError, match="cannot send"):
        all_to_all_time_s(-1.0, ranks_per_node=2, nodes=1, intra_link=NVLINK4, inter_link=IB_NDR)
    assert all_to_all_bytes(10, 2, 4, 2, 1) == 0
