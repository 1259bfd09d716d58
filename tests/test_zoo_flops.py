"""Forward FLOPs of the zoo's GPT-2 models, as pyplan counts them, against Megatron-LM's closed form."""

from __future__ import annotations

import pytest
import torch

from pyplan import zoo
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import trace
from pyplan.profile.flops import block_flops
from pyplan.zoo.transformer import GPT2_CONFIGS


def megatron_forward_flops(b: int, s: int, layers: int, h: int, vocab: int) -> float:
    """Narayanan et al. 2021 (Megatron-LM), §5.1: a forward pass costs `24·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`.

    Matrix multiplications only, 2 FLOPs per multiply-add: per layer the q, k, v and output projections (8Bsh²),
    the 4x MLP (16Bsh²) and the attention scores and their product with the values (4Bs²h, causal mask not
    exploited), and once the logits (2BshV). Biases, norms, softmax and embeddings are left out.
    """
    return 24 * b * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))


@pytest.mark.parametrize("name", list(GPT2_CONFIGS))
def test_gpt2_forward_flops_match_megatron_closed_form(name: str) -> None:
    spec, cfg = zoo.get(name), GPT2_CONFIGS[name]
    with torch.device("meta"):
        model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=1))
    flops = block_flops(chain, spec.example_inputs, (1, 2))
    per_sample = sum(fwd.per_sample for fwd, _ in flops)
    fixed = sum(fwd.fixed for fwd, _ in flops)
    expected = megatron_forward_flops(1, cfg.n_ctx, cfg.n_layer, cfg.n_embd, cfg.vocab_size)
    assert per_sample == pytest.approx(expected, rel=0.02)
    assert abs(fixed) < 1e-6 * expected  # every FLOP scales with the batch
