"""Hub references: `hf:MODEL_TYPE[:key=value,...]` built from transformers configs, `timm:NAME`, and their errors."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
import torch

from pyplan import ModelLoadError, hub, load_model
from pyplan.hub import Seq2SeqLogits, parse_options

TINY = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4"
TOKENS = "vocab_size=128,seq_len=16"
# A tiny speech encoder and decoder of a composite config, set by nested keys.
ENCODER = ",".join(f"encoder_config.{kv}" for kv in f"{TINY},intermediate_size=128,num_mel_bins=16".split(","))
DECODER = ",".join(
    f"decoder_config.{kv}" for kv in f"{TINY},intermediate_size=128,num_key_value_heads=4,head_dim=16".split(",")
)
# Tiny configs of each family: 2 layers, hidden 64, vocab 128, 16 tokens (vit: 32x32 images of 8x8 patches).
REFS = {
    "gpt2": f"hf:gpt2:{TINY},{TOKENS}",
    "bert": f"hf:bert:{TINY},intermediate_size=128,{TOKENS}",
    "llama": f"hf:llama:{TINY},intermediate_size=128,num_key_value_heads=2,{TOKENS}",
    "mixtral": f"hf:mixtral:{TINY},intermediate_size=128,num_key_value_heads=2,num_local_experts=4,{TOKENS}",
    "t5": f"hf:t5:{TINY},d_ff=128,{TOKENS}",
    "vit": f"hf:vit:{TINY},intermediate_size=128,image_size=32,patch_size=8,num_labels=10",
}
# More heads, built and run here (tests/test_hub_plans.py captures and plans REFS alone).
MORE_REFS = {
    # Its table names two classes: the plain head first, then one with a distillation token.
    "deit": f"hf:deit:{TINY},intermediate_size=128,image_size=32,patch_size=8,num_labels=10",
    # 16 mel bins, 64 frames (twice max_source_positions); token ids within the vocabulary.
    "whisper": (
        "hf:whisper:encoder_layers=2,decoder_layers=2,d_model=64,encoder_attention_heads=4,decoder_attention_heads=4,"
        "encoder_ffn_dim=128,decoder_ffn_dim=128,num_mel_bins=16,max_source_positions=32,pad_token_id=0,"
        f"bos_token_id=1,eos_token_id=2,decoder_start_token_id=3,{TOKENS}"
    ),
    "speech_to_text": (
        "hf:speech_to_text:encoder_layers=2,decoder_layers=2,d_model=64,encoder_attention_heads=4,"
        f"decoder_attention_heads=4,encoder_ffn_dim=128,decoder_ffn_dim=128,{TOKENS}"
    ),
    # One second of 16 kHz audio: 49 frames of logits.
    "wav2vec2": f"hf:wav2vec2:{TINY},intermediate_size=128,vocab_size=32",
    # Nested configs: 100 frames of 16 log-mel features, laid out as a run on the meta device finds (frames first);
    # parakeet's encoder subsamples 8x (13 frames of logits).
    "parakeet_ctc": f"hf:parakeet_ctc:{ENCODER},vocab_size=32,pad_token_id=31",
    # canary's vocabulary is its decoder's too: both set.
    "canary": f"hf:canary:{ENCODER},{DECODER},decoder_config.vocab_size=128,{TOKENS}",
    # A speech model whose input is token ids: a sequence-to-sequence LM's inputs.
    "pop2piano": f"hf:pop2piano:num_layers=2,num_decoder_layers=2,d_model=64,d_kv=16,d_ff=128,num_heads=4,{TOKENS}",
}
# What example_inputs(b) holds for each family: name -> (shape after the batch, dtype).
IDS = ((16,), torch.int64)
INPUTS = {
    "gpt2": {"input_ids": IDS},
    "bert": {"input_ids": IDS, "attention_mask": IDS},
    "llama": {"input_ids": IDS},
    "mixtral": {"input_ids": IDS},
    "t5": {"input_ids": IDS, "attention_mask": IDS, "decoder_input_ids": IDS},
    "vit": {"pixel_values": ((3, 32, 32), torch.float32)},
    "deit": {"pixel_values": ((3, 32, 32), torch.float32)},
    "whisper": {"input_features": ((16, 64), torch.float32), "decoder_input_ids": IDS},
    "speech_to_text": {"input_features": ((100, 80), torch.float32), "decoder_input_ids": IDS},
    "wav2vec2": {"input_values": ((16_000,), torch.float32)},
    "parakeet_ctc": {"input_features": ((100, 16), torch.float32)},
    "canary": {"input_features": ((100, 16), torch.float32), "decoder_input_ids": IDS},
    "pop2piano": {"input_ids": IDS, "attention_mask": IDS, "decoder_input_ids": IDS},
}
# What target(b) holds after the batch: the decoder's tokens, the CTC logits' frames (per-frame labels).
TARGETS = {
    "whisper": (16,),
    "speech_to_text": (16,),
    "wav2vec2": (49,),
    "parakeet_ctc": (13,),
    "canary": (16,),
    "pop2piano": (16,),
}
HEADS = {
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForMaskedLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "t5": "T5ForConditionalGeneration",
    "vit": "ViTForImageClassification",
    "deit": "DeiTForImageClassification",
    "whisper": "WhisperForConditionalGeneration",  # not WhisperForCausalLM, its decoder alone
    "speech_to_text": "Speech2TextForConditionalGeneration",
    "wav2vec2": "Wav2Vec2ForCTC",
    "parakeet_ctc": "ParakeetForCTC",
    "canary": "CanaryForConditionalGeneration",
    "pop2piano": "Pop2PianoForConditionalGeneration",
}


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    return pytest.importorskip("transformers")


def _head(model: torch.nn.Module) -> torch.nn.Module:
    return model.model if isinstance(model, Seq2SeqLogits) else model


@pytest.mark.parametrize("family", [*REFS, *MORE_REFS])
def test_builds_runs_and_has_a_finite_loss(transformers: ModuleType, family: str) -> None:
    ref = {**REFS, **MORE_REFS}[family]
    spec = load_model(ref)
    assert spec.name == ref and spec.published_params is None
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
    if family in TARGETS:
        assert target.shape == (2, *TARGETS[family]) and target.shape == logits.shape[:-1]
    loss = spec.loss(logits, target)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_tables_naming_several_classes_build_the_first(transformers: ModuleType) -> None:
    from transformers.models.auto import modeling_auto

    from pyplan.hub import _HEADS, _head_of

    several = {
        (head.table, model_type): names
        for head in _HEADS
        for model_type, names in getattr(modeling_auto, head.table).items()
        if not isinstance(names, str)
    }
    assert ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "deit") in several
    for (table, model_type), names in several.items():
        head, name = _head_of(f"hf:{model_type}", model_type, transformers)
        assert name == names[0] or head.table != table, (model_type, name)
    with torch.device("meta"):
        levit = load_model("hf:levit").build()
    assert type(levit).__name__ == "LevitForImageClassification"


def test_speech_models_capture_with_every_layer_and_frame(transformers: ModuleType) -> None:
    from pyplan import trace

    spec = load_model(MORE_REFS["wav2vec2"])
    assert "layerdrop=0.0, mask_time_prob=0.0" in spec.source  # the wav2vec2 family's defaults are 0.1 and 0.05
    model = spec.build()
    assert model.config.layerdrop == 0 and model.config.mask_time_prob == 0
    graph = trace(model, spec.example_inputs, batch_size=2)
    assert any(n.module_path.startswith("wav2vec2.encoder.layers.1.") for n in graph.nodes)  # no layer dropped
    with torch.device("meta"):
        speecht5 = load_model("hf:speecht5:encoder_layers=2,decoder_layers=2").build()
    assert speecht5.model.config.encoder_layerdrop == speecht5.model.config.decoder_layerdrop == 0


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


def test_lists_split_no_options_and_nest() -> None:
    parsed = parse_options("hf:x", "a=[1, 2.5, true, x],b=[[g,l],1],c=[],d=2")
    assert {k: v for k, (_, v) in parsed.items()} == {"a": [1, 2.5, True, "x"], "b": [["g", "l"], 1], "c": [], "d": 2}


def test_list_values_take_the_fields_types(transformers: ModuleType) -> None:
    # Per stage: the last of cvt's 3 stages gets 3 blocks (transformers indexes its drop-path rates by stage, so the
    # depths must exceed the stage), no drop path anywhere (its default is [0, 0, 0.1]), the projections as strings.
    spec = load_model("hf:cvt:depth=[1,2,3],drop_path_rate=[0,0,0],qkv_projection_method=[dw_bn,avg,dw_bn]")
    with torch.device("meta"):
        cvt = spec.build()
    assert cvt.config.depth == (1, 2, 3)  # a tuple, as the config's default
    assert cvt.config.drop_path_rate == (0.0, 0.0, 0.0) and {type(r) for r in cvt.config.drop_path_rate} == {float}
    assert cvt.config.qkv_projection_method == ("dw_bn", "avg", "dw_bn")
    assert [len(stage.layers) for stage in cvt.cvt.encoder.stages] == [1, 2, 3]
    # Nested lists: gpt_neo's runs of layer kinds, one of each kind for its 2 layers.
    neo = load_model("hf:gpt_neo:num_layers=2,hidden_size=64,num_heads=4,attention_types=[[[global,local],1]]")
    with torch.device("meta"):
        model = neo.build()
    assert model.config.attention_layers == ["global", "local"]


def test_nested_keys_update_the_sub_configs_default(transformers: ModuleType) -> None:
    with torch.device("meta"):
        canary = load_model(MORE_REFS["canary"]).build()
        parakeet = load_model(MORE_REFS["parakeet_ctc"]).build()
    config = canary.model.config
    encoder, decoder = config.encoder_config, config.decoder_config
    assert (encoder.hidden_size, encoder.num_hidden_layers, encoder.num_mel_bins) == (64, 2, 16)
    assert (decoder.hidden_size, decoder.num_hidden_layers, decoder.vocab_size, config.vocab_size) == (64, 2, 128, 128)
    # canary's own default for its encoder stays (ParakeetEncoderConfig's default scales its input).
    assert type(encoder).__name__ == "ParakeetEncoderConfig" and encoder.scale_input is False
    # use_cache=False and LayerDrop off in every sub-config: canary's decoder caches by default, parakeet's encoder
    # drops layers at 0.1.
    assert decoder.use_cache is False and parakeet.config.encoder_config.layerdrop == 0


def test_the_layout_of_features_is_the_one_the_model_runs_on(
    transformers: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without its entry in _FEATURES, whisper's layout, (features, frames), is found by the run on the meta device as
    # parakeet's and canary's (frames, features) are (MORE_REFS): 100 frames where max_source_positions is 50.
    monkeypatch.delitem(hub._FEATURES, "whisper")
    spec = load_model(MORE_REFS["whisper"].replace("max_source_positions=32", "max_source_positions=50"))
    inputs = spec.example_inputs(1)
    assert inputs["input_features"].shape == (1, 16, 100)
    model = spec.build().eval()
    with torch.no_grad():
        model(**inputs)
        with pytest.raises(ValueError, match="Whisper expects the mel input features to be of length 100"):
            model(**{**inputs, "input_features": inputs["input_features"].transpose(1, 2)})


def test_features_of_no_layout_or_count_give_one_line(
    transformers: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = MORE_REFS["parakeet_ctc"]
    monkeypatch.setattr(hub, "_feature_counts", lambda config: [7])
    with pytest.raises(ModelLoadError) as info:
        load_model(ref)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(
        f"pyplan finds no layout of the input_features of '{ref}' that ParakeetForCTC"
    )
    assert "(1, 100, 7): RuntimeError: " in msg and "; (1, 7, 100): RuntimeError: " in msg
    monkeypatch.setattr(hub, "_feature_counts", lambda config: [])
    with pytest.raises(ModelLoadError, match=r"^pyplan finds no feature count for the input_features of .*; set one$"):
        load_model(ref)


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
        ("hf:wav2vec2:layerdrop=0.1", r"sets layerdrop=0.1; pyplan plans a graph that runs every layer .* out$"),
        ("hf:wav2vec2:seq_len=16", r"^seq_len applies to text models, not to 'hf:wav2vec2:seq_len=16'"),
        ("hf:wav2vec2:labels=true", r"^labels=true does not apply to the CTC model of 'hf:wav2vec2:labels=true'"),
        ("hf:whisper:seq_len=449", r"^seq_len=449 .* exceeds the config's max_target_positions=448"),
        ("hf:whisper:vocab_size=128", r"^the config of .* pads with token 50256, outside its vocab_size=128; set pad"),
        # Speech models pyplan does not build.
        ("hf:speech-encoder-decoder", r"^'hf:speech-encoder-decoder' builds SpeechEncoderDecoderModel, which joins a"),
        (
            "hf:dia:encoder_config.num_hidden_layers=1,decoder_config.num_hidden_layers=1",
            r"^pyplan does not know the inputs of .*: DiaForConditionalGeneration takes input_ids, .* and does not run "
            r"on those of a sequence-to-sequence LM \(input_ids, attention_mask, decoder_input_ids\): RuntimeError: ",
        ),
        # Nested keys: each checked against its sub-config's class.
        (
            "hf:canary:encoder_config.hiden_size=64",
            r"^ParakeetEncoderConfig has no key 'hiden_size' \(encoder_config.hiden_size in .*\); close keys: "
            r"encoder_config.hidden_size",
        ),
        (
            "hf:t5gemma2:encoder.text_config.hiden_size=64",
            r"has no key 'hiden_size' \(encoder.text_config.hiden_size in",
        ),
        (
            "hf:canary:encoder_confg.hidden_size=64",
            r"^CanaryConfig has no key 'encoder_confg' .*close keys: encoder_config",
        ),
        (
            "hf:canary:vocab_size.x=1",
            r"^vocab_size of CanaryConfig is no sub-config, so .* cannot set vocab_size.x; its sub-configs: "
            r"encoder_config, decoder_config$",
        ),
        (
            "hf:canary:encoder_config=3",
            r"sets a sub-config \(ParakeetEncoderConfig\); set its keys instead: encoder_config",
        ),
        (
            "hf:canary:encoder_config.num_hidden_layers=2.5",
            r"^encoder_config.num_hidden_layers=2.5 in .* is a float, but "
            r"ParakeetEncoderConfig.num_hidden_layers takes int$",
        ),
        ("hf:canary:encoder_config.num_attention_heads=0", r"^encoder_config.num_attention_heads=0 in .* at least 1"),
        ("hf:canary:decoder_config.use_cache=true", r"sets decoder_config.use_cache=true; .* leave decoder_config"),
        ("hf:canary:encoder_config.layerdrop=0.1", r"sets encoder_config.layerdrop=0.1; .* leave encoder_config"),
        # canary's vocabulary is its decoder's too: set both.
        ("hf:canary:vocab_size=128", r"^transformers rejects .*: ValueError: The decoder config vocabulary size"),
        # Lists: brackets balanced, elements of the field's type, sizes at least 1.
        ("hf:cvt:depth=[1,2", r"^'depth=\[1,2' in .* leaves a bracket open; write a list as key=\[a,b,c\]$"),
        ("hf:cvt:depth=1,2]", r"^'2\]' in .* closes a bracket it never opened; write a list as key=\[a,b,c\]$"),
        ("hf:cvt:depth=[1,,3]", r"^'\[1,,3\]' in .* has an empty element"),
        ("hf:cvt:depth=[1,2,3]x", r"^'\[1,2,3\]x' in .* is neither a value nor a list"),
        (
            "hf:cvt:depth=[1,a,3]",
            r"^depth=\[1,a,3\] in .* has a string element \(a\), but CvtConfig.depth takes a list of int$",
        ),
        (
            "hf:cvt:drop_path_rate=[0,[0],0]",
            r"has a list element \(\[0\]\), but CvtConfig.drop_path_rate takes a list of",
        ),
        ("hf:cvt:depth=[1,0,3]", r"^depth=\[1,0,3\] in .* must be at least 1: each element counts or sizes part of"),
        ("hf:cvt:depth=3", r"^depth=3 in .* is an int, but CvtConfig.depth takes a list of int$"),
        ("hf:llama:num_hidden_layers=[1,2]", r"is a list, but LlamaConfig.num_hidden_layers takes int$"),
        ("hf:", r"names no model type"),
        # Counts and sizes below 1: a model without layers, heads or a vocabulary is never planned.
        ("hf:gpt2:n_layer=-2", r"^n_layer=-2 in 'hf:gpt2:n_layer=-2' must be at least 1: it counts or sizes part"),
        ("hf:llama:num_attention_heads=0", r"^num_attention_heads=0 in .* must be at least 1"),
        ("hf:llama:hidden_size=-64", r"^hidden_size=-64 in .* must be at least 1"),
        ("hf:gpt2:vocab_size=0", r"^vocab_size=0 in .* must be at least 1"),
        ("hf:mixtral:num_local_experts=0", r"^num_local_experts=0 in .* must be at least 1"),
        ("hf:llama:head_dim=-1", r"^head_dim=-1 in .* must be at least 1"),
        ("hf:t5:d_model=0", r"^d_model=0 in .* must be at least 1"),
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
