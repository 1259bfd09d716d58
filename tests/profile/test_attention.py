"""Attention priced as the target GPU runs it: torch's kernel choice, and per-layer saved bytes and FLOPs against
the closed forms of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2 and §4) with fused attention in place of the s²-sized terms."""

from __future__ import annotations

import pytest
import torch

import pyplan
from pyplan.api import chain_for
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.profile.attention import AttentionTarget, causal_fraction, select_backend
from pyplan.zoo.transformer import GPT, GPTConfig, Llama, LlamaConfig


def _backend(arch: str, dtype: str = "bfloat16", *, d: int = 64, mask: bool = False, causal: bool = True,
             q: int = 1024, k: int = 1024, dropout: float = 0.0, gqa: bool = False) -> str:  # fmt: skip
    return select_backend(
        AttentionTarget(arch),
        dtype=dtype,
        head_dims=(d, d, d),
        q_len=q,
        k_len=k,
        has_mask=mask,
        is_causal=causal,
        dropout=dropout,
        gqa=gqa,
    )


def test_the_kernel_is_the_one_torch_selects_on_the_target() -> None:
    assert _backend("sm80") == "flash"
    assert _backend("sm90", "float16", gqa=True) == "flash"  # flash runs grouped-query attention natively
    assert _backend("sm80", "float32") == "efficient"  # flash takes fp16/bf16 only
    assert _backend("sm80", mask=True) == "efficient"  # flash takes no mask
    assert _backend("sm80", q=16, k=1024) == "efficient"  # causal flash needs square attention
    assert _backend("sm90", d=320) == "efficient"  # flash: head size at most 256
    assert _backend("sm86", d=200) == "efficient"  # flash on sm86-89 trains head sizes (192, 224] not
    assert _backend("sm80", d=200) == "flash"
    assert _backend("sm70", "float16") == "efficient"  # V100: no flash
    assert _backend("sm70", "bfloat16") == "math"  # and no bf16 in the efficient kernel below sm80
    assert _backend("sm80", "float32", d=66) == "math"  # fp32 head sizes a multiple of 4 on sm80+
    assert _backend("gfx942") == "flash"
    assert _backend("gfx942", "float32", gqa=True) == "math"


def test_a_causal_kernel_computes_the_tiles_on_and_below_the_diagonal() -> None:
    assert causal_fraction(128, 128) == 1.0
    assert causal_fraction(4096, 4096) == pytest.approx(33 / 64)
    assert causal_fraction(16, 1024) == 1.0


def _layer(chain: pyplan.Chain, prefix: str) -> tuple[float, float, float]:
    blocks = [b for b in chain.blocks if b.name.startswith(prefix)]
    assert blocks, [b.name for b in chain.blocks]
    return (
        sum(b.saved_bytes.per_sample for b in blocks),
        sum(b.flops_fwd.per_sample for b in blocks),
        sum(b.flops_bwd.per_sample for b in blocks),
    )


def _chain(build, seq: int, vocab: int, gpu: str, precision: str) -> tuple[pyplan.Chain, str]:
    spec = pyplan.ModelSpec(name="m", build=build, example_inputs=lambda b: (torch.randint(0, vocab, (b, seq)),))
    with torch.device("meta"):
        model = spec.build()
    return chain_for(
        model, spec.example_inputs, Cluster.from_catalog(gpu, 8), Workload(global_batch=8, precision=precision)
    )


@pytest.mark.parametrize("seq", [1024, 4096, 8192])
@pytest.mark.parametrize(
    ("gpu", "precision", "kernel"), [("a100-80g", "bf16-mixed", "flash"), ("v100-32g", "fp32", "efficient")]
)
def test_a_gpt_layer_saves_what_korthikanti_counts_with_fused_attention(
    seq: int, gpu: str, precision: str, kernel: str
) -> None:
    """Table 2's 34·s·b·h bytes (fp16 tensors, one-byte dropout masks) without the 5·a·s²·b of the scores: here in
    fp32 (the profile's tensors; mixed precision scales them later), so 16 tensors of s·h at 4 bytes and two masks
    of 1, plus what the table leaves out: the kernel's log-sum-exp (4·a·s bytes) and each LayerNorm's mean and
    reciprocal deviation (2 x 4·s). FLOPs: 24·s·h² + 4·s²·h forward (Narayanan et al. 2021, eq. 2's terms), and
    a backward of twice the matmuls plus 2.5 times the attention (the fused backward recomputes the scores)."""
    h, a = 1024, 16
    cfg = GPTConfig(n_layer=2, n_head=a, n_embd=h, n_ctx=seq, vocab_size=512)
    chain, how = _chain(lambda: GPT(cfg), seq, 512, gpu, precision)
    assert how.endswith(f"attention {kernel}")
    saved, fwd, bwd = _layer(chain, "transformer.h.0")
    assert saved == 16 * 4 * seq * h + 2 * seq * h + 4 * a * seq + 2 * 2 * 4 * seq
    assert fwd == 24 * seq * h * h + 4 * seq * seq * h
    assert bwd == 48 * seq * h * h + 10 * seq * seq * h


@pytest.mark.parametrize("seq", [1024, 8192])
def test_a_llama_layer_with_grouped_query_attention_saves_nothing_quadratic(seq: int) -> None:
    """Llama (RMSNorm, rotary embeddings, SwiGLU, 8 KV heads of 32): FLOPs as the closed form of its matmuls,
    2·s·h·(h + 2·kv) + 2·s·h² + 6·s·h·f forward plus the attention's 4·s²·h; its saved bytes grow linearly in s
    (no s² term is left) and K and V are saved at the KV heads' width."""
    h, heads, kv_heads, f = 1024, 32, 8, 2816
    kv = h // heads * kv_heads
    cfg = LlamaConfig(dim=h, n_layers=2, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=f, vocab_size=512,
                      max_seq_len=seq)  # fmt: skip
    chain, how = _chain(lambda: Llama(cfg), seq, 512, "h100-sxm", "bf16-mixed")
    assert how.endswith("attention flash")
    saved, fwd, bwd = _layer(chain, "layers.0")
    assert fwd == 2 * seq * h * (h + 2 * kv) + 2 * seq * h * h + 6 * seq * h * f + 4 * seq * seq * h
    assert bwd == 2 * (fwd - 4 * seq * seq * h) + 10 * seq * seq * h
    short, _ = _chain(
        lambda: Llama(LlamaConfig(**{**cfg.__dict__, "max_seq_len": 512})), 512, 512, "h100-sxm", "bf16-mixed"
    )
    saved_short, _, _ = _layer(short, "layers.0")
    assert saved == pytest.approx(saved_short * seq / 512, rel=1e-3)


def test_the_meta_devices_math_path_is_what_a_cpu_target_keeps() -> None:
    """Planned for the CPU, attention stays what torch runs there: nothing is intercepted."""
    seq, h, a = 256, 128, 4
    cfg = GPTConfig(n_layer=1, n_head=a, n_embd=h, n_ctx=seq, vocab_size=64, dropout=0.0)
    spec = pyplan.ModelSpec(
        name="g", build=lambda: GPT(cfg), example_inputs=lambda b: (torch.randint(0, 64, (b, seq)),)
    )
    _, how = chain_for(spec.build(), spec.example_inputs, Cluster.from_catalog("local", 1), Workload(global_batch=4))
    assert "attention" not in how


def test_grouped_query_flops_repeat_the_key_value_heads() -> None:
    """Attention with 2 key/value heads for 8 query heads does the work of 8: counted so even by a formula that
    refuses such shapes, as torch's did before 2.13."""
    from torch.utils.flop_counter import FlopCounterMode

    from pyplan._torch import _REGISTRY, FLOP_FORMULAS, _op_flops

    q, kv = torch.empty(2, 8, 16, 4), torch.empty(2, 2, 16, 4)
    expected = 2 * (2 * 2 * 8 * 16 * 16 * 4)  # two products of (16 x 4) @ (4 x 16) per batch and head

    def strict(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out_val: object = None) -> int:
        assert key.shape[1] == query.shape[1], "query/key/value shapes are incompatible"
        return 2 * (2 * query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2] * query.shape[3])

    assert _op_flops(strict, "_scaled_dot_product_flash_attention", (q, kv, kv), {}, None) == expected
    flash = _REGISTRY[torch.ops.aten._scaled_dot_product_flash_attention]
    assert _op_flops(flash, "_scaled_dot_product_flash_attention", (q, kv, kv), {}, None) == expected
    with pytest.raises(AssertionError):
        _op_flops(strict, "mm", (q, kv, kv), {}, None)

    # Given shapes, as a shape-wrapped formula is.
    def strict_shapes(query: tuple, key: tuple, value: tuple, out_val: object = None) -> int:
        assert key[1] == query[1], "query/key/value shapes are incompatible"
        return 2 * (2 * query[0] * query[1] * query[2] * key[2] * query[3])

    assert _op_flops(strict_shapes, "_scaled_dot_product_flash_attention", (q.shape, kv.shape, kv.shape), {}, None) == (
        expected
    )
    # FlopCounterMode, as block_flops counts, with pyplan's formulas (forward and backward).
    q, kv = q.to("meta").requires_grad_(), kv.to("meta").requires_grad_()
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as forward:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, False, False)[0]
    assert forward.get_total_flops() == expected
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as backward:
        out.sum().backward()
    assert backward.get_total_flops() == 2.5 * expected
