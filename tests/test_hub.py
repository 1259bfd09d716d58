"""Hub references: `hf:MODEL_TYPE[:key=value,...]` built from transformers configs, `timm:NAME`, and their errors."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
import torch

from pyplan import ModelLoadError, load_model
from pyplan.hub import Seq2SeqLogits, parse_options

TINY = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4"
TOKENS = "vocab_size=128,seq_len=16"
# Tiny configs of each family: 2 layers, hidden 64, vocab 128, 16 tokens (vit: 32x32 images of 8x8 patches).
REFS = {
    "gpt2": f"hf:gpt2:{TINY},{TOKENS}",
    "bert": f"hf:bert:{TINY},intermediate_size=128,{TOKENS}",
    "llama": f"hf:llama:{TINY},intermediate_size=128,num_key_value_heads=2,{TOKENS}",
    "mixtral": f"hf:mixtral:{TINY},intermediate_size=128,num_key_value_heads=2,num_local_experts=4,{TOKENS}",
    "t5": f"hf:t5:{TINY},d_ff=128,{TOKENS}",
    "vit": f"hf:vit:{TINY},intermediate_size=128,image_size=32,patch_size=8,num_labels=10",
}
# What example_inputs(b) holds for each family: name -> (shape after the batch, dtype).
IDS = ((16,), torch.int64)
INPUTS = {
    "gpt2": {"input_ids": IDS},
    "bert": {"input_ids": IDS, "attention_mask": IDS},
    "llama": {"input_ids": IDS},
    "mixtral": {"input_ids": IDS},
    "t5": {"input_ids": IDS, "decoder_input_ids": IDS},
    "vit": {"pixel_values": ((3, 32, 32), torch.float32)},
}
HEADS = {
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForMaskedLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "t5": "T5ForConditionalGeneration",
    "vit": "ViTForImageClassification",
}


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    return pytest.importorskip("transformers")


def _head(model: torch.nn.Module) -> torch.nn.Module:
    return model.model if isinstance(model, Seq2SeqLogits) else model


@pytest.mark.parametrize("family", list(REFS))
def test_builds_runs_and_has_a_finite_loss(transformers: ModuleType, family: str) -> None:
    spec = load_model(REFS[family])
    assert spec.name == REFS[family] and spec.published_params is None
    assert spec.source.startswith(f"Hugging Face transformers {transformers.__version__} ")
    with torch.device("meta"):
        meta = spec.build()
    assert type(_head(meta)).__name__ == HEADS[family]
    assert all(p.is_meta for p in meta.parameters())
    model = spec.build()
    assert not any(p.is_meta for p in model.parameters())
    assert getattr(_head(model).config, "use_cache", False) is False
    for b in (2, 3):
        inputs = spec.example_inputs(b)
        assert {k: (tuple(v.shape), v.dtype) for k, v in inputs.items()} == {
            k: ((b, *shape), dtype) for k, (shape, dtype) in INPUTS[family].items()
        }
        assert all(torch.equal(v, w) for v, w in zip(inputs.values(), spec.example_inputs(b).values()))
    assert spec.loss is not None and spec.target is not None
    output = model(**spec.example_inputs(2))
    # The output pyplan captures is the logits alone: one field of the ModelOutput (the wrapper returns a tensor).
    logits = output if isinstance(output, torch.Tensor) else output.logits
    assert isinstance(output, torch.Tensor) or list(output.keys()) == ["logits"]
    target = spec.target(2)
    assert torch.equal(target, spec.target(2)) and target.dtype == torch.int64
    loss = spec.loss(logits, target)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_causal_target_is_the_next_token(transformers: ModuleType) -> None:
    spec = load_model(REFS["llama"])
    assert spec.target is not None
    assert torch.equal(spec.example_inputs(2)["input_ids"][:, 1:], spec.target(2)[:, :-1])


def test_seq_len_default_is_the_smaller_of_128_and_max_positions(transformers: ModuleType) -> None:
    short = load_model("hf:gpt2:num_hidden_layers=1,hidden_size=64,num_attention_heads=4,max_position_embeddings=32")
    assert short.example_inputs(1)["input_ids"].shape == (1, 32)
    long = load_model("hf:llama:num_hidden_layers=1,hidden_size=64,num_attention_heads=4")
    assert long.example_inputs(1)["input_ids"].shape == (1, 128)


def test_a_7b_config_builds_on_meta(transformers: ModuleType) -> None:
    spec = load_model("hf:llama:seq_len=2048")
    with torch.device("meta"):
        model = spec.build()
    assert 6.5e9 < sum(p.numel() for p in model.parameters()) < 7e9
    assert spec.example_inputs(1)["input_ids"].shape == (1, 2048)


def test_values_are_parsed_as_int_float_bool_or_str() -> None:
    parsed = parse_options("hf:x", "a=3,b=1e-5,c=true,d=False,e=gelu_new")
    assert {k: v for k, (_, v) in parsed.items()} == {"a": 3, "b": 1e-5, "c": True, "d": False, "e": "gelu_new"}


def test_an_int_is_taken_for_a_float_field(transformers: ModuleType) -> None:
    spec = load_model("hf:llama:num_hidden_layers=1,hidden_size=64,num_attention_heads=4,rms_norm_eps=1")
    assert "rms_norm_eps=1.0" in spec.source


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("hf:lama", r"^unknown model type 'lama' in 'hf:lama' \(transformers .*\); close matches: llama"),
        ("hf:llama:num_hiden_layers=2", r"^LlamaConfig has no key 'num_hiden_layers' .*close keys: num_hidden_layers"),
        ("hf:llama:num_hidden_layers=2.5", r"^num_hidden_layers=2.5 in .* is a float, but .* takes int$"),
        ("hf:llama:use_cache=true", r"sets use_cache=true; pyplan plans training .* leave use_cache out$"),
        ("hf:mixtral:output_router_logits=true", r"sets output_router_logits=true; .* leave output_router_logits out$"),
        ("hf:llama:hidden_size=65", r"^transformers rejects the config of .*: ValueError: The hidden size \(65\)"),
        ("hf:llama:num_hidden_layers", r"^'num_hidden_layers' in .* is not key=value"),
        ("hf:llama:seq_len=0", r"^seq_len=0 in .* is not a positive int"),
        ("hf:gpt2:seq_len=2048", r"^seq_len=2048 .* exceeds the config's max_position_embeddings=1024"),
        ("hf:vit:seq_len=16", r"^seq_len applies to text models"),
        ("hf:clip_text_model", r"^model type 'clip_text_model' .* has none of the heads pyplan builds"),
        ("hf:", r"names no model type"),
    ],
)
def test_bad_references_give_one_line(transformers: ModuleType, ref: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(ref)
    assert "\n" not in str(info.value)


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(ModelLoadError, match=r"^hf:llama needs transformers: pip install 'pyplan\[hf\]'$"):
        load_model("hf:llama")


def _timm_imports() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(_timm_imports(), reason="timm imports here")
def test_timm_without_torchvision_says_what_is_missing() -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model("timm:resnet18")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("timm:resnet18 needs timm") and "pip install 'pyplan[timm]'" in msg
    if importlib.util.find_spec("timm") is not None:  # installed, and its import of torchvision fails
        assert "timm imports torchvision, which " in msg and "whose torchvision build matches its torch" in msg


@pytest.mark.skipif(not _timm_imports(), reason="timm does not import here (it imports torchvision)")
def test_timm_model() -> None:
    spec = load_model("timm:test_vit")
    with torch.device("meta"):
        spec.build()
    (x,) = spec.example_inputs(2)
    assert spec.loss is not None and spec.target is not None
    loss = spec.loss(spec.build()(x), spec.target(2))
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_labels_make_the_model_compute_its_own_loss(transformers: ModuleType) -> None:
    from pyplan import linearize, trace
    from pyplan.graph.trace import call_at, output_tensors
    from pyplan.spec import default_loss

    spec = load_model(REFS["gpt2"] + ",labels=true")
    assert spec.loss is None and spec.target is None
    inputs = spec.example_inputs(2)
    assert torch.equal(inputs["labels"], inputs["input_ids"])  # a causal LM shifts its labels itself
    model = spec.build()
    assert trace(model, spec.example_inputs, batch_size=2).returns_loss
    plain = load_model(REFS["gpt2"])
    assert not linearize(trace(plain.build(), plain.example_inputs)).graph.returns_loss
    args, kwargs = call_at(spec.example_inputs, 2)
    out = model(*args, **kwargs)
    assert torch.equal(default_loss(output_tensors(out), None), out.loss)
    with pytest.raises(ModelLoadError, match=r"^labels=maybe in .* is not true or false$"):
        load_model(REFS["gpt2"] + ",labels=maybe")
