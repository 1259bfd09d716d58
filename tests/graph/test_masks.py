"""Attention masks that depend on no input become what eager Hugging Face passes: is_causal=True, or no mask."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyplan import load_model, trace
from pyplan.graph.masks import SDPA_TARGETS, sdpa_arguments

HF = importlib.util.find_spec("transformers") is not None
_TINY = "num_hidden_layers=1,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,intermediate_size=128"


def _calls(model: nn.Module, example) -> list[dict]:
    graph = trace(model, example, batch_size=2)
    nodes = [n for n in graph.module.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]
    return [sdpa_arguments(n.args, dict(n.kwargs)) for n in nodes]


class _MaskedAttention(nn.Module):
    """Attention with a mask of its own: a registered causal buffer, or a learned bias that is zero at first."""

    def __init__(self, learned: bool, window: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 24)
        t = 6
        allowed = torch.ones(t, t, dtype=torch.bool).tril()
        if window is not None:
            allowed &= ~torch.ones(t, t, dtype=torch.bool).tril(-window)
        self.register_buffer("allowed", allowed)
        self.bias = nn.Parameter(torch.zeros(t, t)) if learned else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if t < 2:  # a branch on a shape: torch.fx cannot follow it, so the model is captured with torch.export
            return x
        q, k, v = self.proj(x).view(b, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = self.bias if self.bias is not None else self.allowed[:t, :t]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, 8)


def _inputs(b: int) -> tuple[torch.Tensor]:
    return (torch.randn(b, 6, 8),)


def test_a_constant_causal_mask_becomes_is_causal_and_computes_the_same() -> None:
    torch.manual_seed(0)
    model = _MaskedAttention(learned=False)
    (call,) = _calls(model, _inputs)
    assert call["attn_mask"] is None and call["is_causal"] is True
    graph = trace(model, _inputs, batch_size=2)
    (x,) = _inputs(3)
    torch.testing.assert_close(graph.module(x), model(x))


def test_a_sliding_window_and_a_learned_bias_keep_their_masks() -> None:
    (window,) = _calls(_MaskedAttention(learned=False, window=3), _inputs)
    assert window["attn_mask"] is not None and not window["is_causal"]
    (learned,) = _calls(_MaskedAttention(learned=True), _inputs)  # zero today, trained tomorrow
    assert learned["attn_mask"] is not None


@pytest.mark.skipif(not HF, reason="needs transformers")
def test_hugging_face_masks_as_the_models_pass_them_eagerly() -> None:
    def refs(spec: str) -> list[dict]:
        model_spec = load_model(spec)
        with torch.device("meta"):
            model = model_spec.build()
        return _calls(model, model_spec.example_inputs)

    (llama,) = refs(f"hf:llama:{_TINY},vocab_size=128,seq_len=16")
    assert llama["attn_mask"] is None and llama["is_causal"] is True
    (mistral,) = refs(f"hf:mistral:{_TINY},vocab_size=128,seq_len=16,sliding_window=8")
    assert mistral["attn_mask"] is not None  # a window shorter than the sequence: a real mask
    (bert,) = refs("hf:bert:num_hidden_layers=1,hidden_size=64,num_attention_heads=4,vocab_size=128,seq_len=16")
    assert bert["attn_mask"] is not None  # built from the attention_mask input: padding is data
