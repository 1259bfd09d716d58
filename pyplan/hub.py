"""Models named on a model hub: `hf:MODEL_TYPE[:key=value,...]` (Hugging Face transformers) and `timm:NAME`.

Both build from a configuration with random weights: nothing is downloaded, so a 70B configuration builds on the
meta device in a fraction of a second. transformers and timm are optional heavy packages, imported only when a
reference names them (`pip install 'pyplan[hf]'`, `pip install 'pyplan[timm]'`).

An `hf:` reference picks the model's head from transformers' own MODEL_FOR_*_MAPPING_NAMES tables (see `_HEADS`):
an encoder-decoder gets its sequence-to-sequence LM head, an encoder its masked-LM head, a decoder its causal-LM
head, a vision model its image-classification head, a speech model its speech-to-text (whisper) or CTC (wav2vec2)
head. Each head's output, with no labels passed, is its logits alone (use_cache=False and output_router_logits=False
make sure of it), so the loss is a cross-entropy over the logits. A key may be a sub-config's
(`hf:canary:encoder_config.hidden_size=64`) and a value a list (`hf:cvt:depth=[1,2,3]`); a speech model's features are
laid out as the model runs on them on the meta device.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import traceback
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

# A private torch API outside pyplan._torch: the fake tensors of a speech model's probe (_run_on_meta).
from torch._subclasses.fake_tensor import FakeTensorMode

from pyplan._torch import meta_build
from pyplan.errors import ModelLoadError
from pyplan.spec import ModelSpec, cross_entropy

__all__ = [
    "DEFAULT_AUDIO_SAMPLES",
    "DEFAULT_IMAGE_SIZE",
    "DEFAULT_SEQ_LEN",
    "Seq2SeqLogits",
    "hf_model",
    "parse_options",
    "timm_model",
]

# Inputs and targets come from fixed seeds (the caller seeds everything else); targets from a seed of their own.
_INPUT_SEED = 0
_TARGET_SEED = 1

# The example sequence length when a reference sets no seq_len: the config's max_position_embeddings if smaller.
DEFAULT_SEQ_LEN = 128
# The example image size when a vision config names none (the ImageNet size most of them default to).
DEFAULT_IMAGE_SIZE = 224
# The example audio of a speech model that takes raw audio (wav2vec2's `input_values`): one second at 16 kHz, the
# rate the wav2vec2 family is trained at; a model that takes features gets the frames of that second (10 ms each).
DEFAULT_AUDIO_SAMPLES = 16_000
_FRAMES_PER_SECOND = 100

# Config values pyplan plans with: no key/value cache (training; torch.export cannot return a DynamicCache) and the
# logits as the only output (a Mixture-of-Experts head would add its router logits and auxiliary loss). A reference
# that sets one otherwise is refused. `_PASSED` go to every config that has them (transformers drops a use_cache
# given to a config without the field, a vision model's), the others are transformers' defaults.
_FIXED: dict[str, bool] = {
    "use_cache": False,
    "output_router_logits": False,
    "output_hidden_states": False,
    "output_attentions": False,
    "return_dict": True,
}
_PASSED = ("use_cache", "output_router_logits")
# Config values that draw at random in every training step which layers run (LayerDrop) or which frames are masked
# (SpecAugment): no captured graph holds such a choice, and speech models (wav2vec2, speecht5) turn them on by
# default. Each that a config sets above 0 is passed as 0; a reference that sets one is refused.
_RANDOM_OFF = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "mask_time_prob", "mask_feature_prob")
# The last word of a config key that says it counts or sizes part of the model (n_layer, num_attention_heads,
# hidden_size, head_dim, vocab_size, num_local_experts, n_embd, max_position_embeddings, num_channels, num_labels; per
# stage, swin's depths and num_heads): an integer value below 1, or a list's element below 1, builds a model without
# that part (range(-2) is no layers at all) and is refused. The last word, not any: embd_pdrop=0 is a dropout,
# chunk_size_feed_forward=0 transformers' "no chunking". T5's d_model, d_ff and d_kv, and the routed experts per token,
# say it by name alone. A list of layers holds layer indices (llama4's moe_layers), no sizes.
_SIZE_WORDS = frozenset(
    {"layer", "layers", "head", "heads", "size", "dim", "vocab", "expert", "experts", "embd", "embeddings"}
    | {"positions", "channels", "labels", "depth", "depths", "dims"}
)
_SIZE_KEYS = frozenset(("d_model", "d_ff", "d_kv", "num_experts_per_tok"))
# Keys that transformers' PretrainedConfig takes as keyword arguments without a field of that name.
_CONFIG_KWARGS = ("attn_implementation", "experts_implementation")

Value = int | float | bool | str
# A value of an option: a scalar or a list (`depth=[1,1,2]`, lists nest).
Option = Value | list["Option"]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_stream(b: int, *, vocab: int, seq_len: int) -> torch.Tensor:
    """seq_len + 1 tokens per sample, so inputs and next-token targets come from one draw."""
    return torch.randint(vocab, (b, seq_len + 1), generator=_generator(_INPUT_SEED))


def _causal_inputs(b: int, *, vocab: int, seq_len: int) -> dict[str, torch.Tensor]:
    return {"input_ids": _token_stream(b, vocab=vocab, seq_len=seq_len)[:, :-1].contiguous()}


def _next_tokens(b: int, *, vocab: int, seq_len: int) -> torch.Tensor:
    return _token_stream(b, vocab=vocab, seq_len=seq_len)[:, 1:].contiguous()


def _masked_inputs(b: int, *, vocab: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Token ids and an int64 attention mask that pads each sample after a random length in [T/2, T]."""
    g = _generator(_INPUT_SEED)
    ids = torch.randint(vocab, (b, seq_len), generator=g)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (b,), generator=g)
    return {"input_ids": ids, "attention_mask": (torch.arange(seq_len)[None, :] < lengths[:, None]).long()}


def _seq2seq_inputs(b: int, *, vocab: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Encoder and decoder token ids, seq_len of each, and the encoder's attention mask (all ones: as a tokenizer
    gives it; LongT5 and SwitchTransformers make none of their own under a capture)."""
    g = _generator(_INPUT_SEED)
    ids = torch.randint(vocab, (b, seq_len), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(b, seq_len, dtype=torch.int64),
        "decoder_input_ids": torch.randint(vocab, (b, seq_len), generator=g),
    }


def _audio(b: int, *, name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A speech model's audio input `name`: random samples or features of `shape` after the batch."""
    return {name: torch.randn(b, *shape, generator=_generator(_INPUT_SEED))}


def _speech_seq2seq_inputs(
    b: int, *, name: str, shape: tuple[int, ...], vocab: int, seq_len: int
) -> dict[str, torch.Tensor]:
    """The encoder's audio input `name` and seq_len decoder token ids."""
    g = _generator(_INPUT_SEED)
    audio = torch.randn(b, *shape, generator=g)
    return {name: audio, "decoder_input_ids": torch.randint(vocab, (b, seq_len), generator=g)}


def _random_tokens(b: int, *, vocab: int, seq_len: int) -> torch.Tensor:
    return torch.randint(vocab, (b, seq_len), generator=_generator(_TARGET_SEED))


def _pixels(b: int, *, channels: int, height: int, width: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(b, channels, height, width, generator=_generator(_INPUT_SEED))}


def _images(b: int, *, channels: int, height: int, width: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, channels, height, width, generator=_generator(_INPUT_SEED)),)


def _with_labels(
    inputs: Callable[[int], dict[str, torch.Tensor]], target: Callable[[int], torch.Tensor], causal: bool, b: int
) -> dict[str, torch.Tensor]:
    """`inputs(b)` with `labels`: the target, or for a causal LM (which shifts them itself) the input ids."""
    batch = inputs(b)
    return {**batch, "labels": batch["input_ids"].clone() if causal else target(b)}


def _labels(b: int, *, classes: int) -> torch.Tensor:
    return torch.randint(classes, (b,), generator=_generator(_TARGET_SEED))


class Seq2SeqLogits(nn.Module):
    """An encoder-decoder LM that returns its logits alone.

    transformers' Seq2SeqLMOutput always carries the encoder's last hidden state beside the logits, whatever the
    config says, and pyplan's loss takes one tensor; the wrapped model's names gain the prefix `model.`. The
    encoder's input is token ids (t5, bart), or audio features or samples for a speech model (whisper)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        input_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        given = {
            "input_ids": input_ids,
            "input_features": input_features,
            "input_values": input_values,
            "attention_mask": attention_mask,
        }
        encoder = {k: v for k, v in given.items() if v is not None}
        out = self.model(**encoder, decoder_input_ids=decoder_input_ids, labels=labels)
        return out.logits if labels is None else (out.loss, out.logits)


@dataclass(frozen=True)
class _Head:
    """A kind of model head an `hf:` reference builds: the transformers table that lists the model types that have
    it, the Auto class that builds it, and its batch."""

    task: str
    table: str
    auto_class: str


# In this order: an encoder-decoder (bart) is listed as a causal and a masked LM too, an encoder (bert) as a causal
# LM (its decoder variant), perceiver as a masked LM and an image classifier, and whisper as a causal LM (its decoder
# alone, for assisted generation) beside its speech-to-text model, so the first table that lists a model type names
# its head. A multimodal LLM listed as a sequence-to-sequence LM and a speech model (voxtral) keeps the former.
_HEADS = (
    _Head("sequence-to-sequence LM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    _Head("masked LM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    _Head("image classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    _Head("speech-to-text", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    _Head("CTC speech recognition", "MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    _Head("causal LM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
)


def _split_top(ref: str, text: str) -> list[str]:
    """`text` split at its commas outside brackets (`a=1,b=[1,2]` -> `a=1`, `b=[1,2]`)."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            item = text[start:].split(",", 1)[0]
            raise ModelLoadError(f"'{item}' in '{ref}' closes a bracket it never opened; write a list as key=[a,b,c]")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth > 0:
        raise ModelLoadError(f"'{text[start:]}' in '{ref}' leaves a bracket open; write a list as key=[a,b,c]")
    parts.append(text[start:])
    return parts


def _parse_value(ref: str, text: str) -> Option:
    """A scalar parsed as int, float, bool (true/false) or str, in that order of preference; `[a,b,...]` a list of
    such values (or of lists)."""
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        items = [s.strip() for s in _split_top(ref, inner)] if inner else []
        if not all(items):
            raise ModelLoadError(f"'{text}' in '{ref}' has an empty element; write a list as key=[a,b,c]")
        return [_parse_value(ref, item) for item in items]
    if "[" in text or "]" in text:
        raise ModelLoadError(f"'{text}' in '{ref}' is neither a value nor a list; write a list as key=[a,b,c]")
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(ref: str, options: str) -> dict[str, tuple[str, Option]]:
    """The `key=value,...` of a reference: each key's text and its value parsed as int, float, bool (true/false)
    or str, in that order of preference, or as a list `[a,b,...]` of such values (its commas separate no options).
    A key may name a sub-config's key: `encoder_config.hidden_size`."""
    parsed: dict[str, tuple[str, Option]] = {}
    for item in filter(None, (s.strip() for s in _split_top(ref, options))):
        key, eq, text = (s.strip() for s in item.partition("="))
        if not eq or not key or not text:
            raise ModelLoadError(f"'{item}' in '{ref}' is not key=value; write hf:MODEL_TYPE:key=value,key=value")
        if key in parsed:
            raise ModelLoadError(f"'{ref}' sets {key} twice; give each key once")
        parsed[key] = text, _parse_value(ref, text)
    return parsed


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _import_transformers(ref: str) -> types.ModuleType:
    try:
        import transformers  # optional heavy package: imported only for an hf: reference
    except ImportError as exc:
        if exc.name == "transformers":
            raise ModelLoadError(f"{ref} needs transformers: pip install 'pyplan[hf]'") from None
        raise ModelLoadError(f"importing transformers for {ref} failed with {type(exc).__name__}: {exc}") from exc
    return transformers


def _head_of(ref: str, model_type: str, transformers: types.ModuleType) -> tuple[_Head, str]:
    """The head an `hf:` reference builds for `model_type`, and the name of its transformers class."""
    from transformers.models.auto import configuration_auto, modeling_auto  # optional heavy package (as above)

    known = configuration_auto.CONFIG_MAPPING_NAMES
    if model_type not in known:
        close = difflib.get_close_matches(model_type, list(known), n=5)
        hint = f"close matches: {', '.join(close)}" if close else "see transformers' CONFIG_MAPPING_NAMES"
        raise ModelLoadError(
            f"unknown model type '{model_type}' in '{ref}' (transformers {transformers.__version__}); {hint}"
        )
    for head in _HEADS:
        table = getattr(modeling_auto, head.table)
        if model_type in table:
            # Some entries name several classes (deit: the plain head, then one with a distillation token); the
            # first is the plain head, the one the Auto class builds from a config that names no architecture.
            names = table[model_type]
            return head, names if isinstance(names, str) else names[0]
    tasks = ", ".join(h.task for h in _HEADS)
    raise ModelLoadError(
        f"model type '{model_type}' in '{ref}' has none of the heads pyplan builds ({tasks}) in transformers "
        f"{transformers.__version__}; pick a model type that has one"
    )


@dataclass(frozen=True)
class _FieldType:
    """What a config field's annotation admits: scalar types, containers (list, tuple) and their elements' scalar
    types (None: any element, as in a bare `list`). Not `resolved` when the annotation is no type (a property's):
    then transformers' own validation decides."""

    scalars: frozenset[type] = frozenset()
    containers: frozenset[type] = frozenset()
    elements: frozenset[type] | None = frozenset()
    resolved: bool = True


def _field_type(annotation: Any) -> _FieldType:
    """What `annotation` admits (a dict or config field admits no scalar and no list)."""
    if annotation in (int, float, bool, str, type(None)):
        return _FieldType(scalars=frozenset({annotation}))
    if annotation in (list, tuple):
        return _FieldType(containers=frozenset({annotation}), elements=None)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return _FieldType(scalars=frozenset(type(a) for a in typing.get_args(annotation)))
    if origin in (typing.Union, types.UnionType):
        parts = [_field_type(a) for a in typing.get_args(annotation)]
        if not all(p.resolved for p in parts):
            return _FieldType(resolved=False)
        elements = [p.elements for p in parts if p.containers]
        return _FieldType(
            scalars=frozenset().union(*(p.scalars for p in parts)),
            containers=frozenset().union(*(p.containers for p in parts)),
            elements=None if any(e is None for e in elements) else frozenset().union(*elements),
        )
    if origin in (list, tuple, collections.abc.Sequence):
        inner = [_field_type(a) for a in typing.get_args(annotation) if a is not Ellipsis]
        scalar = bool(inner) and all(p.resolved and not p.containers for p in inner)
        return _FieldType(
            containers=frozenset({origin} if origin in (list, tuple) else {list, tuple}),
            elements=frozenset().union(*(p.scalars for p in inner)) if scalar else None,
        )
    if origin is not None or isinstance(annotation, type):
        return _FieldType()
    return _FieldType(resolved=False)


def _takes(admits: _FieldType) -> str:
    """What a field takes, in words: `int`, `a list of float`, `int or a list of int`."""
    names = sorted(t.__name__ for t in admits.scalars if t is not type(None))
    if admits.containers:
        inner = " or ".join(sorted(t.__name__ for t in admits.elements or ()))
        names.append(f"a list of {inner}" if inner else "a list")
    return " or ".join(names) or "no scalar"


def _config_keys(config_class: type) -> dict[str, Any]:
    """Every key a config class takes, with its field's annotation (None for a property or an alias's target
    without one)."""
    if dataclasses.is_dataclass(config_class):
        fields = {f.name: f.type for f in dataclasses.fields(config_class)}
    else:
        fields = {name: p.annotation for name, p in inspect.signature(config_class.__init__).parameters.items()}
    keys: dict[str, Any] = {k: v for k, v in fields.items() if not k.startswith("_")}
    for alias, target in getattr(config_class, "attribute_map", {}).items():
        keys.setdefault(alias, fields.get(target))
    for klass in config_class.__mro__:
        for name, attr in vars(klass).items():
            if isinstance(attr, property) and attr.fset is not None and not name.startswith("_"):
                keys.setdefault(name, None)
    keys.update(dict.fromkeys(_CONFIG_KWARGS))
    return keys


def _kind(value: Option) -> str:
    kinds = {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list"}
    return kinds[type(value)]


def _is_size(key: str) -> bool:
    """Whether a config key names a count or size of part of the model (`_SIZE_WORDS`)."""
    return key in _SIZE_KEYS or key.lower().rsplit("_", 1)[-1] in _SIZE_WORDS


def _flat(value: Any) -> list[Value]:
    """The scalars of a value, a list's (or tuple's) at every depth."""
    return [v for item in value for v in _flat(item)] if isinstance(value, list | tuple) else [value]


def _sizes(key: str, value: Any) -> list[Value]:
    """The counts or sizes in the value of a size key (`_is_size`): its scalars, none for a list of layers (layer
    indices: llama4's moe_layers)."""
    return [] if isinstance(value, list | tuple) and key.endswith(("_layer", "_layers")) else _flat(value)


@dataclass(frozen=True)
class _SubConfig:
    """A sub-config of a composite config (canary's encoder_config): its class, and the keys its default is built
    from, which a reference's keys for it update (the default's model_type and the composite's own defaults for it:
    canary's encoder has 32 layers, where ParakeetEncoderConfig says 24)."""

    config_class: type
    base: dict[str, Any]


def _sub_configs(config_class: type) -> dict[str, _SubConfig]:
    """The sub-configs of `config_class` by key: those of its `sub_configs_defaults` (transformers 5), then those of
    its `sub_configs` (dbrx's attn_config: built from the sub-config class's defaults)."""
    from transformers import PreTrainedConfig  # optional heavy package, imported by an hf: reference already

    subs: dict[str, _SubConfig] = {}
    for key, spec in (getattr(config_class, "sub_configs_defaults", None) or {}).items():
        fixed = isinstance(spec.config_class, type) and issubclass(spec.config_class, PreTrainedConfig)
        klass = spec.config_class if fixed else spec.get_config_class(spec.model_type)
        subs[key] = _SubConfig(klass, {"model_type": spec.model_type, **spec.init_kwargs})
    for key, klass in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(klass, type) and issubclass(klass, PreTrainedConfig):
            subs.setdefault(key, _SubConfig(klass, {}))
    return subs


def _field_default(config_class: type, key: str) -> Any:
    """The default of a config class's field `key` (None where it has none)."""
    if dataclasses.is_dataclass(config_class):
        field = next((f for f in dataclasses.fields(config_class) if f.name == key), None)
        if field is not None and field.default is not dataclasses.MISSING:
            return field.default
    return None


def _shaped(value: Option, like: Any) -> Any:
    """`value` with its lists tuples where `like` (an element of the field's default) holds tuples (moonshine's
    sliding_windows, a tuple of tuples)."""
    if not isinstance(value, list):
        return value
    inner = like[0] if isinstance(like, list | tuple) and like else None
    items = [_shaped(v, inner) for v in value]
    return tuple(items) if isinstance(like, tuple) else items


def _as_scalar(value: Option, text: str, scalars: frozenset[type]) -> Value | None:
    """`value` as a field of `scalars` takes it: itself, an int as a float, any value as its text where the field
    takes a string; None where the field does not take it."""
    if isinstance(value, list):
        return None
    if type(value) in scalars:
        return value
    if type(value) is int and float in scalars:
        return float(value)
    return text if str in scalars else None


def _checked(ref: str, name: str, owner: str, text: str, value: Option, admits: _FieldType, default: Any) -> Option:
    """`value` as the field `owner` (`Class.key`) takes it (`_as_scalar`), a list's elements likewise, the list a
    tuple where the field takes no list or defaults to a tuple. A value the field does not take is an error."""
    if not admits.resolved:
        return value
    if not isinstance(value, list):
        scalar = _as_scalar(value, text, admits.scalars)
        if scalar is None:
            raise ModelLoadError(f"{name}={text} in '{ref}' is {_kind(value)}, but {owner} takes {_takes(admits)}")
        return scalar
    if not admits.containers:
        raise ModelLoadError(f"{name}={text} in '{ref}' is a list, but {owner} takes {_takes(admits)}")
    items: list[Option] = list(value)
    if admits.elements is not None:
        texts = [s.strip() for s in _split_top(ref, text[1:-1])]
        for i, (item_text, item) in enumerate(zip(texts, value)):
            scalar = _as_scalar(item, item_text, admits.elements)
            if scalar is None:
                raise ModelLoadError(
                    f"{name}={text} in '{ref}' has {_kind(item)} element ({item_text}), but {owner} takes "
                    f"{_takes(admits)}"
                )
            items[i] = scalar
    if tuple in admits.containers and (list not in admits.containers or isinstance(default, tuple)):
        return tuple(_shaped(item, default[0] if default else None) for item in items)  # type: ignore[return-value]
    return items


def _config_overrides(
    ref: str, config_class: type, options: dict[str, tuple[str, Option]], prefix: str = ""
) -> dict[str, Any]:
    """The overrides as keyword arguments of the config class: each key checked against the class, an alias
    (gpt2's hidden_size) renamed to its field (n_embd) so the defaults derived from it follow (t5's decoder depth
    from num_layers), each value checked against the field's type, and a count or size (`_is_size`) against 1 (each
    element of a list). A dotted key (`encoder_config.hidden_size`) is a sub-config's, checked against its class in
    the same way: its overrides come back as a dict under the sub-config's key. `prefix` is the keys' path."""
    keys = _config_keys(config_class)
    subs = _sub_configs(config_class)
    aliases: dict[str, str] = getattr(config_class, "attribute_map", {})
    overrides: dict[str, Any] = {}
    nested: dict[str, dict[str, tuple[str, Option]]] = {}
    for key, (text, value) in options.items():
        head, dot, rest = key.partition(".")
        name = prefix + key
        if head not in keys:
            close = difflib.get_close_matches(head, list(keys), n=5, cutoff=0.5)
            named = ", ".join(prefix + k for k in close)
            hint = f"close keys: {named}" if close else f"see {config_class.__name__}'s fields"
            where = f"{name} in '{ref}'" if prefix else f"in '{ref}'"
            raise ModelLoadError(f"{config_class.__name__} has no key '{head}' ({where}); {hint}")
        if dot:
            if head not in subs:
                known = ", ".join(prefix + k for k in subs) or "none"
                raise ModelLoadError(
                    f"{prefix}{head} of {config_class.__name__} is no sub-config, so '{ref}' cannot set {name}; "
                    f"its sub-configs: {known}"
                )
            nested.setdefault(head, {})[rest] = (text, value)
            continue
        if head in subs:
            raise ModelLoadError(
                f"{name}={text} in '{ref}' sets a sub-config ({subs[head].config_class.__name__}); set its keys "
                f"instead: {name}.KEY=VALUE"
            )
        owner = f"{config_class.__name__}.{key}"
        value = _checked(ref, name, owner, text, value, _field_type(keys[key]), _field_default(config_class, key))
        if key in _FIXED and value != _FIXED[key]:
            raise ModelLoadError(
                f"'{ref}' sets {name}={text}; pyplan plans training on the logits alone with {key}={_FIXED[key]}: "
                f"leave {name} out"
            )
        if key in _RANDOM_OFF and value != 0:
            raise ModelLoadError(
                f"'{ref}' sets {name}={text}; pyplan plans a graph that runs every layer on every frame, with "
                f"{key}=0: leave {name} out"
            )
        if _is_size(key) and any(type(v) is int and v < 1 for v in _sizes(key, value)):
            each = isinstance(value, list | tuple)
            raise ModelLoadError(
                f"{name}={text} in '{ref}' must be at least 1: {'each element' if each else 'it'} counts or sizes "
                f"part of the model; give {'positive ints' if each else 'a positive int'}"
            )
        field = aliases.get(key, key)
        if field in overrides:
            raise ModelLoadError(f"'{ref}' sets {prefix}{field} twice (as {name} and as {prefix}{field}); give it once")
        overrides[field] = value
    for head, sub_options in nested.items():
        overrides[head] = _config_overrides(ref, subs[head].config_class, sub_options, f"{prefix}{head}.")
    return overrides


def _config_kwargs(config_class: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` as the keyword arguments of `config_class`: a sub-config's overrides (a dict) as the dict it is
    built from, its default's keys (`_SubConfig.base`) updated with them."""
    subs = _sub_configs(config_class)
    return {
        key: {**subs[key].base, **_config_kwargs(subs[key].config_class, value)} if isinstance(value, dict) else value
        for key, value in overrides.items()
    }


def _forced(config: Any, *, top: bool = True) -> dict[str, Any]:
    """The values pyplan sets in a built config, whatever its defaults, as overrides: LayerDrop and SpecAugment off
    (`_RANDOM_OFF`), at every level; in each sub-config also `_PASSED` (the top level gets them before it is built)."""
    from transformers import PreTrainedConfig  # optional heavy package, imported by an hf: reference already

    forced: dict[str, Any] = {k: 0.0 for k in _RANDOM_OFF if getattr(config, k, None) not in (None, 0)}
    if not top:
        keys = _config_keys(type(config))
        forced.update({k: _FIXED[k] for k in _PASSED if k in keys and getattr(config, k, _FIXED[k]) != _FIXED[k]})
    for key in _sub_configs(type(config)):
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig) and (inner := _forced(sub, top=False)):
            forced[key] = inner
    return forced


def _merged(overrides: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`overrides` updated with `more`, sub-config by sub-config."""
    out = dict(overrides)
    for key, value in more.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def _text_config(config: Any) -> Any:
    """The config of the model's text (`get_text_config()`), its decoder's where it has several (musicgen: a T5 text
    encoder and a decoder of audio tokens)."""
    try:
        return config.get_text_config()
    except ValueError:
        return config.get_text_config(decoder=True)


def _max_positions(config: Any) -> tuple[str, int] | None:
    """The config's limit on the token positions, and its key: max_position_embeddings, or a speech model's decoder's
    max_target_positions (whisper)."""
    text = _text_config(config)
    for key in ("max_position_embeddings", "max_target_positions"):
        limit = getattr(text, key, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return key, limit
    return None


def _seq_len(ref: str, config: Any, given: tuple[str, Value] | None) -> int:
    """seq_len= if given (at most the config's max_position_embeddings), else min(max_position_embeddings, 128),
    or 128 for a config with no such limit (t5's relative positions)."""
    found = _max_positions(config)
    if given is None:
        return min(found[1], DEFAULT_SEQ_LEN) if found else DEFAULT_SEQ_LEN
    text, value = given
    if type(value) is not int or value < 1:
        raise ModelLoadError(f"seq_len={text} in '{ref}' is not a positive int; write e.g. seq_len=512")
    if found is not None and value > found[1]:
        key, limit = found
        raise ModelLoadError(
            f"seq_len={value} in '{ref}' exceeds the config's {key}={limit}; set {key}={value} too, or a shorter "
            "seq_len"
        )
    return value


def _whisper_features(config: Any) -> tuple[int, int]:
    """Whisper's log-mel features, (num_mel_bins, frames): its encoder takes exactly 2 x max_source_positions frames
    (30 s of audio; its second convolution halves them)."""
    return config.num_mel_bins, 2 * config.max_source_positions


def _speech_to_text_features(config: Any) -> tuple[int, int]:
    """Speech2Text's filter-bank features, (frames, features): one second of 10 ms frames."""
    return _FRAMES_PER_SECOND, config.input_feat_per_channel * config.input_channels


def _granite_speech5_features(config: Any) -> tuple[int, int]:
    """Granite Speech 5's features, (frames, features): its feature extractor appends each mel frame's deltas (x2)
    and stacks frames in pairs (x2), so one second is 50 frames of 4 x num_mel_bins."""
    return _FRAMES_PER_SECOND // 2, 4 * config.encoder_config.num_mel_bins


# The audio features (`input_features`) of the speech models whose layout the config alone does not give, by model
# type; another speech model's features are one second of frames of a feature count its config names, laid out as a
# run on the meta device finds (`_feature_layout`).
_FEATURES: dict[str, Callable[[Any], tuple[int, int]]] = {
    "whisper": _whisper_features,
    "speech_to_text": _speech_to_text_features,
    "granite_speech5_ctc": _granite_speech5_features,
}
# The config keys that count a speech model's features per frame (log-mel bins, filter banks, a feature projection's
# input), tried in this order: at the config's top level, then in its sub-configs of an encoder or audio.
_FEATURE_KEYS = (
    "num_mel_bins",
    "feature_size",
    "input_feat_size",
    "feature_projection_input_dim",
    "input_feat_per_channel",
    "input_dim",
)


def _feature_counts(config: Any) -> list[int]:
    """The distinct feature counts `config` names (`_FEATURE_KEYS`): at its top level, then in its sub-configs whose
    key names an encoder or audio (canary's encoder_config, an audio_config)."""
    from transformers import PreTrainedConfig  # optional heavy package, imported by an hf: reference already

    levels = [config] + [
        sub
        for key, sub in vars(config).items()
        if isinstance(sub, PreTrainedConfig) and ("encoder" in key or "audio" in key)
    ]
    counts: list[int] = []
    for level in levels:
        for key in _FEATURE_KEYS:
            count = getattr(level, key, None)
            if type(count) is int and count > 0 and count not in counts:
                counts.append(count)
    return counts


def _feature_layout(ref: str, model_class: type, config: Any, run: Callable[[tuple[int, int]], Any]) -> tuple[int, int]:
    """The shape (after the batch) of a speech model's `input_features`, one second of 10 ms frames: (frames,
    features) or (features, frames), for each feature count the config names (`_feature_counts`), the first that
    `run` (the model on meta tensors of one sample) runs on."""
    counts = _feature_counts(config)
    if not counts:
        raise ModelLoadError(
            f"pyplan finds no feature count for the input_features of '{ref}' ({model_class.__name__}): none of "
            f"{', '.join(_FEATURE_KEYS)} in its config or its encoder's or audio config; set one"
        )
    tried: list[str] = []
    for count in counts:
        for shape in dict.fromkeys(((_FRAMES_PER_SECOND, count), (count, _FRAMES_PER_SECOND))):
            try:
                run(shape)
            except ModelLoadError:  # the model does not build: no layout would run
                raise
            except Exception as exc:
                tried.append(f"(1, {shape[0]}, {shape[1]}): {type(exc).__name__}: {_first_line(exc)}")
            else:
                return shape
    raise ModelLoadError(
        f"pyplan finds no layout of the input_features of '{ref}' that {model_class.__name__} runs on (one second "
        f"of {_FRAMES_PER_SECOND} frames, on the meta device): {'; '.join(tried)}"
    )


def _audio_input(
    ref: str, model_type: str, config: Any, model_class: type, run: Callable[[tuple[int, int]], Any]
) -> tuple[str, tuple[int, ...]]:
    """The name and shape (after the batch) of a speech model's audio input: raw samples (`input_values`,
    DEFAULT_AUDIO_SAMPLES of them) or features (`input_features`, laid out as `_FEATURES` says, else as
    `_feature_layout` finds with `run`)."""
    name = getattr(model_class, "main_input_name", "")
    if name == "input_values":
        return name, (DEFAULT_AUDIO_SAMPLES,)
    if name == "input_features" and model_type in _FEATURES:
        return name, _FEATURES[model_type](config)
    if name == "input_features":
        return name, _feature_layout(ref, model_class, config, run)
    raise ModelLoadError(
        f"pyplan does not know the audio input of '{ref}' ({model_class.__name__} takes {name or 'no named input'}); "
        "it builds speech models that take raw audio (input_values: wav2vec2, hubert), features (input_features: "
        "whisper, parakeet) or token ids (input_ids: pop2piano)"
    )


def _meta_model(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` on the meta device, in eval mode."""
    with meta_build():
        return build().eval()


def _run_on_meta(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """`model` (built on the meta device) run on `inputs` as fake meta tensors: nothing computed. Fake, not plain meta:
    transformers checks values outside a trace (a causal mask without a cache looks for packed sequences), and takes
    a fake tensor for a trace. torch logs each op that fails on fake tensors: a layout that does not run says so
    in its error alone."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return model(**{k: mode.from_tensor(v.to("meta")) for k, v in inputs.items()})
    finally:
        fake_log.setLevel(level)


def _frames(ref: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """The frames of a CTC model's logits (batch, frames, vocabulary) for `inputs` (of one sample), the model on the
    meta device: for raw audio from the lengths of its convolutional feature encoder (the wav2vec2 family's
    `_get_feat_extract_output_lengths`, as its own CTC loss counts them), else from a run on meta tensors."""
    ((name, audio),) = inputs.items()
    try:
        lengths = getattr(model, "_get_feat_extract_output_lengths", None)
        if lengths is not None and name == "input_values":
            return int(lengths(torch.tensor([audio.shape[-1]])).item())
        return int(_run_on_meta(model, inputs).logits.shape[1])
    except Exception as exc:
        raise ModelLoadError(
            f"'{ref}' does not run on its example audio ({name} {tuple(audio.shape)}): {type(exc).__name__}: "
            f"{_first_line(exc)}"
        ) from exc


def _text_speech_model(
    ref: str, model_class: type, run: Callable[[bool, dict[str, torch.Tensor]], Any], tokens: dict[str, int]
) -> bool:
    """Whether a speech model whose main input is token ids (pop2piano) is built as a sequence-to-sequence LM (its
    forward takes decoder_input_ids) or else a causal LM: `run(wrapped, inputs)` must run on the inputs of that kind
    (one sample), or the model is refused."""
    takes = [k for k in inspect.signature(model_class.forward).parameters if k not in ("self", "kwargs")]
    seq2seq = "decoder_input_ids" in takes
    inputs = (_seq2seq_inputs if seq2seq else _causal_inputs)(1, **tokens)
    try:
        run(seq2seq, inputs)
    except ModelLoadError:
        raise
    except Exception as exc:
        kind = "a sequence-to-sequence LM" if seq2seq else "a causal LM"
        raise ModelLoadError(
            f"pyplan does not know the inputs of '{ref}': {model_class.__name__} takes {', '.join(takes[:6])}, ... and "
            f"does not run on those of {kind} ({', '.join(inputs)}): {type(exc).__name__}: {_first_line(exc)}"
        ) from exc
    return seq2seq


def _image_shape(config: Any) -> tuple[int, int, int]:
    """(channels, height, width) of the config's images (a composite config's vision_config)."""
    vision = getattr(config, "vision_config", None) or config
    size = getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIZE
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return getattr(vision, "num_channels", 3), height, width


def _call_repr(model_type: str, kwargs: dict[str, Any]) -> str:
    return ", ".join([repr(model_type), *(f"{k}={v!r}" for k, v in kwargs.items())])


def _model_class(ref: str, transformers: types.ModuleType, name: str) -> type:
    """transformers' class `name`, imported now so that a failure shows at load (transformers imports its models
    lazily, and imports torchvision with them wherever torchvision is installed, even a build that cannot load)."""
    try:
        return getattr(transformers, name)
    except Exception as exc:
        failure = _torchvision_failure(exc)
        if failure is not None:
            raise ModelLoadError(
                f"transformers cannot import {name} for '{ref}': it imports torchvision, which {failure}; uninstall "
                "torchvision (transformers builds models without it) or install the build that matches torch"
            ) from exc
        root = _causes(exc)[-1]
        raise ModelLoadError(
            f"transformers cannot import {name} for '{ref}': {type(root).__name__}: {_first_line(root)}"
        ) from exc


def _check_pad_token(ref: str, config: Any) -> None:
    """A padding token within the vocabulary (its embedding's padding_idx): a reference that shrinks vocab_size below
    the config's default token ids (whisper's 50256) names them too."""
    text = _text_config(config)
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ModelLoadError(
            f"the config of '{ref}' pads with token {pad}, outside its vocab_size={vocab}; set pad_token_id= (and "
            "bos_token_id=, eos_token_id=, decoder_start_token_id= where the config has them) below vocab_size"
        )


def _config(ref: str, transformers: types.ModuleType, model_type: str, kwargs: dict[str, Any]) -> Any:
    """`transformers.AutoConfig.for_model(model_type, **kwargs)`, its refusal one line."""
    try:
        # A copy: a config may update a sub-config's dict in place (moshi's depth_decoder_config).
        return transformers.AutoConfig.for_model(model_type, **copy.deepcopy(kwargs))
    except Exception as exc:
        # transformers' strict dataclasses: "Validation error for field 'x':\n    TypeError: ..."
        reason = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"transformers rejects the config of '{ref}': {reason}") from exc


def hf_model(ref: str) -> ModelSpec:
    """The ModelSpec of `hf:MODEL_TYPE[:key=value,...]`: `transformers.AutoConfig.for_model(MODEL_TYPE, **overrides)`
    with use_cache=False, its head built by the Auto class `_HEADS` names, random weights.

    A key may name a sub-config's key (`encoder_config.hidden_size=64`: the sub-config is built from its default's
    keys updated with them) and a value may be a list (`depth=[1,1,2]`). `labels=true` (not a config key) passes labels
    among the inputs, so that the model computes its own loss (its first output; the spec then has no loss or target
    of its own). `seq_len=N` (not a config key) sets the example sequence length; the default is
    min(the config's max_position_embeddings, 128), or 128 for a config without one. A causal LM takes
    `{"input_ids"}` and next tokens as its target; a masked LM `{"input_ids", "attention_mask"}` (int64) and random
    tokens; a sequence-to-sequence LM `{"input_ids", "attention_mask", "decoder_input_ids"}` (seq_len each) and
    random tokens at the decoder's positions; an image classifier `{"pixel_values"}` at the config's image size and
    channels and random class labels; a speech-to-text model its audio (`_audio_input`) and `decoder_input_ids`, and
    random tokens at the decoder's positions (one whose main input is token ids, pop2piano, the inputs of a
    sequence-to-sequence or causal LM); a CTC model its audio, and one random label per frame of its logits. The loss
    is the mean cross-entropy of the logits (for a CTC model a per-frame cross-entropy, not a CTC loss: the model runs
    the same, only the loss itself differs). LayerDrop and SpecAugment are off (`_RANDOM_OFF`), in every sub-config
    too."""
    model_type, _, text = ref.removeprefix("hf:").partition(":")
    if not model_type:
        raise ModelLoadError(f"'{ref}' names no model type; write hf:MODEL_TYPE[:key=value,...], e.g. hf:llama")
    options = parse_options(ref, text)
    seq_len_option = options.pop("seq_len", None)
    labels_option = options.pop("labels", None)
    if labels_option is not None and type(labels_option[1]) is not bool:
        raise ModelLoadError(f"labels={labels_option[0]} in '{ref}' is not true or false")
    with_labels = labels_option is not None and labels_option[1] is True
    transformers = _import_transformers(ref)
    head, class_name = _head_of(ref, model_type, transformers)
    config_class = transformers.CONFIG_MAPPING[model_type]
    overrides = _config_overrides(ref, config_class, options)
    keys = _config_keys(config_class)
    overrides.update({k: _FIXED[k] for k in _PASSED if k in keys})
    config = _config(ref, transformers, model_type, _config_kwargs(config_class, overrides))
    forced = _forced(config)
    if forced:
        overrides = _merged(overrides, forced)
        config = _config(ref, transformers, model_type, _config_kwargs(config_class, overrides))
    kwargs = _config_kwargs(config_class, overrides)
    # The class the Auto class builds where its table names several (deit): it picks by the config's architectures.
    config.architectures = [class_name]
    auto_class = getattr(transformers, head.auto_class)
    model_class = _model_class(ref, transformers, class_name)
    if model_class.__name__ == "SpeechEncoderDecoderModel":
        raise ModelLoadError(
            f"'{ref}' builds SpeechEncoderDecoderModel, which joins a speech encoder and a text decoder named by their "
            "own configs (SpeechEncoderDecoderConfig.from_encoder_decoder_configs), which pyplan does not build; "
            "write a model file that builds it, or plan a speech model of one type (hf:whisper, hf:speech_to_text)"
        )
    wrap = head.auto_class in ("AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq")
    causal = head.auto_class == "AutoModelForCausalLM"

    _check_pad_token(ref, config)

    def make() -> nn.Module:
        try:
            # A copy: the config is shared by every build, and a model may set attributes on its own.
            return auto_class.from_config(copy.deepcopy(config))
        except Exception as exc:
            raise ModelLoadError(
                f"transformers cannot build {model_class.__name__} for '{ref}': "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc

    meta_model = functools.cache(partial(_meta_model, make))

    def run(wrapped: bool, inputs: dict[str, torch.Tensor]) -> Any:
        """The model (wrapped in Seq2SeqLogits) on the meta device, run on meta copies of `inputs`."""
        return _run_on_meta(Seq2SeqLogits(meta_model()) if wrapped else meta_model(), inputs)

    example_inputs: Callable[[int], Any]
    target: Callable[[int], torch.Tensor]
    if head.auto_class == "AutoModelForImageClassification":
        if seq_len_option is not None:
            raise ModelLoadError(f"seq_len applies to text models, not to '{ref}'; set image_size= instead")
        channels, height, width = _image_shape(config)
        example_inputs = partial(_pixels, channels=channels, height=height, width=width)
        target = partial(_labels, classes=config.num_labels)
    elif head.auto_class == "AutoModelForCTC":
        if seq_len_option is not None:
            raise ModelLoadError(f"seq_len applies to text models, not to '{ref}' (a CTC model's input is audio)")
        if with_labels:
            # Its own loss is a CTC loss, infinite on one random label per frame (a repeated label needs a blank).
            raise ModelLoadError(f"labels=true does not apply to the CTC model of '{ref}'; leave labels out")
        features = partial(_audio, 1, name="input_features")
        name, shape = _audio_input(
            ref, model_type, config, model_class, lambda shape: run(False, features(shape=shape))
        )
        example_inputs = partial(_audio, name=name, shape=shape)
        vocab = _text_config(config).vocab_size
        target = partial(_random_tokens, vocab=vocab, seq_len=_frames(ref, meta_model(), example_inputs(1)))
    elif head.auto_class == "AutoModelForSpeechSeq2Seq":
        tokens = {"vocab": _text_config(config).vocab_size, "seq_len": _seq_len(ref, config, seq_len_option)}
        if getattr(model_class, "main_input_name", "") == "input_ids":
            wrap = _text_speech_model(ref, model_class, run, tokens)
            causal = not wrap
            example_inputs = partial(_seq2seq_inputs if wrap else _causal_inputs, **tokens)
            target = partial(_random_tokens if wrap else _next_tokens, **tokens)
        else:
            features = partial(_speech_seq2seq_inputs, 1, name="input_features", **tokens)
            name, shape = _audio_input(ref, model_type, config, model_class, lambda s: run(True, features(shape=s)))
            example_inputs = partial(_speech_seq2seq_inputs, name=name, shape=shape, **tokens)
            target = partial(_random_tokens, **tokens)
    else:
        tokens = {"vocab": _text_config(config).vocab_size, "seq_len": _seq_len(ref, config, seq_len_option)}
        inputs_of = {"AutoModelForSeq2SeqLM": _seq2seq_inputs, "AutoModelForMaskedLM": _masked_inputs}
        example_inputs = partial(inputs_of.get(head.auto_class, _causal_inputs), **tokens)
        target = partial(_next_tokens if causal else _random_tokens, **tokens)
    if with_labels:
        # The model computes its own loss from labels among its inputs (its first output); pyplan.spec.default_loss
        # takes it. A causal LM shifts its labels itself: they are its input ids.
        example_inputs = partial(_with_labels, example_inputs, target, causal)

    def build() -> nn.Module:
        model = make()
        return Seq2SeqLogits(model) if wrap else model

    return ModelSpec(
        name=ref,
        build=build,
        example_inputs=example_inputs,
        loss=None if with_labels else cross_entropy,
        target=None if with_labels else target,
        source=(
            f"Hugging Face transformers {transformers.__version__} {type(config).__name__} from "
            f"AutoConfig.for_model({_call_repr(model_type, kwargs)}); {model_class.__name__} from "
            f"{head.auto_class}.from_config, random weights"
        ),
    )


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and the exceptions it was raised from or during, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _torchvision_failure(exc: BaseException) -> str | None:
    """How torchvision failed, when `exc` (an import of timm or of a transformers model) failed because of it."""
    for cause in _causes(exc):
        if isinstance(cause, ModuleNotFoundError) and cause.name == "torchvision":
            return "is not installed"
        if any(f"{os.sep}torchvision{os.sep}" in f.filename for f in traceback.extract_tb(cause.__traceback__)):
            return f"does not import beside torch {torch.__version__} ({type(cause).__name__}: {_first_line(cause)})"
    return None


def _import_timm(ref: str) -> types.ModuleType:
    try:
        import timm  # optional heavy package: imported only for a timm: reference
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "timm":
            raise ModelLoadError(f"{ref} needs timm: pip install 'pyplan[timm]'") from None
        failure = _torchvision_failure(exc)
        if failure is None:
            raise ModelLoadError(f"importing timm for {ref} failed with {type(exc).__name__}: {exc}") from exc
        raise ModelLoadError(_needs_torchvision(ref, failure)) from exc
    return timm


def _needs_torchvision(ref: str, failure: str) -> str:
    # timm/layers/create_norm.py and norm_act.py import torchvision.ops.misc.FrozenBatchNorm2d at module level, and
    # `import timm` imports timm.layers: no part of timm imports without torchvision.
    return (
        f"{ref} needs timm, and timm imports torchvision, which {failure}; on a machine whose torchvision build "
        "matches its torch, pip install 'pyplan[timm]'"
    )


def timm_model(ref: str) -> ModelSpec:
    """The ModelSpec of `timm:NAME`: `timm.create_model(NAME, pretrained=False)` (random weights), its input
    the size of the model's pretrained_cfg (3x224x224 for most), random class labels as its target, and the mean
    cross-entropy of the logits as its loss."""
    name = ref.removeprefix("timm:")
    if not name or ":" in name:
        raise ModelLoadError(f"'{ref}' is not timm:NAME; write a timm model name, e.g. timm:resnet50")
    timm = _import_timm(ref)
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5)
        hint = f"close matches: {', '.join(close)}" if close else "see timm.list_models()"
        raise ModelLoadError(f"unknown timm model '{name}' (timm {timm.__version__}); {hint}")

    def build() -> nn.Module:
        return timm.create_model(name, pretrained=False)

    with meta_build():
        probe = build()
    channels, height, width = probe.pretrained_cfg["input_size"]
    return ModelSpec(
        name=ref,
        build=build,
        example_inputs=partial(_images, channels=channels, height=height, width=width),
        loss=cross_entropy,
        target=partial(_labels, classes=probe.num_classes),
        source=f"timm {timm.__version__} create_model({name!r}, pretrained=False), random weights",
    )
