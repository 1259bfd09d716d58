"""A Hugging Face model built as users write it: `LlamaForCausalLM(config)` with the config's defaults (`use_cache`
on, so its output holds a `DynamicCache`) called with `{"input_ids": ...}`."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ = 128, 16


def model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def example_inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, SEQ))}
