"""Every model type of transformers' LM, image and speech tables, shrunk to a tiny config, through pyplan; a table.

Run: `python benchmarks/hf_types.py` (needs transformers; hours on 2 cores for the ~320 types: results go to a
JSON-lines file as they come, `--resume` skips the types done, `--types gpt2,llama` runs a subset). Each type of the
tables below becomes an `hf:TYPE:key=value,...` reference whose values come from the config class's defaults
through `SHRINK` (2 layers, hidden 64, 4 heads, feed-forward 128, vocabulary 128, 32-pixel images, no dropout,
16 tokens), and goes through:
  (0) eager: the model built by transformers from that config trains one step (forward, loss, backward) on this
      CPU in float64, else float32, on the inputs pyplan's hub builds; a type that fails here, whose config or model
      transformers does not build, or that stays over MAX_PARAMS (sizes SHRINK does not reach), is excluded from
      the denominator with its reason; one that pyplan's hub refuses (inputs it does not know) is a failure at
      "load";
  (1) `pyplan inspect REF --json --batch-size 2 --warmup 1 --repeats 1`: at least 4 blocks;
  (2) `pyplan plan REF --gpus 2 --gpu local --global-batch 8 --json` (a quick calibration first where this machine
      has none);
  (3) a 2-stage pipeline (1F1B, 4 micro-batches of 2, SGD) trained under torchrun with 2 processes, its losses at
      steps 0 and 1 against one process (float64 to 1e-9, float32 to 1e-5): benchmarks/_hf_types_child.py;
  (4) `pyplan plan REF --gpus 8 --gpu a100-80g --global-batch 16 --precision bf16-mixed --json`.
Steps (0), (1), (2) and (4) run in worker processes of a few types each (the CLI in-process, as a user runs it), each
step under a limit of CPU seconds; step (3) launches torchrun for many types at once and reruns the rest after a
crash. `--spread` takes the tables in turn, so that a run stopped early covers each.
Target: every step passes for >= 95 % of the types that train eagerly on this CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import itertools
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, machine, new_table, target_line

__all__ = ["TABLES", "eager_check", "reference", "shrink", "sweep_types", "table_of"]

# transformers' tables (transformers.models.auto.modeling_auto), short name -> table name, in the order pyplan's hub
# picks a head by (an encoder-decoder is listed as a causal and masked LM too).
TABLES = {
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
}

Value = int | float | bool | str
Option = Value | list[Any]  # a value of an hf: reference: a scalar or a list (cvt's drop_path_rate=[0,0,0])

# How a config is shrunk: (pattern over a key of the config, its tiny value), the first pattern a key matches
# decides. A value applies to a key whose default is a number, and only where it is smaller than the default (a size
# never grows: a model whose default has 2 heads keeps 2); a float default takes it as a float. A list of numbers
# that a randomness key holds (cvt's drop_path_rate per stage) becomes zeros. Each sub-config of a composite config
# (canary's encoder_config and decoder_config) is shrunk by the same rules, its keys prefixed with its own
# (`encoder_config.hidden_size`). Where the layer count shrinks, a list with one entry per layer is cut to the new
# count if the config does not derive it from the count (reformer's attn_layers) or derives it wrongly (zamba's).
_KV_HEADS = "kv"  # marker: 2 where the default has fewer key/value heads than heads (grouped queries), else the heads
_RANDOM = r"drop|_pdrop$|^mask_(time|feature)_prob$"
_LAYERS = (
    r"^(num_(hidden_|encoder_|decoder_)?layers|n_layers?|(encoder|decoder|speech_encoder)_layers"
    r"|(encoder|decoder)_num_hidden_layers)$"
)
SHRINK: tuple[tuple[str, Value], ...] = (
    # Randomness a pipeline and one process draw differently: dropout, drop path, layer drop, SpecAugment masks.
    (_RANDOM, 0.0),
    (_LAYERS, 2),
    (r"^(num_(attention_)?heads|n_heads?|(encoder|decoder)_attention_heads|(encoder|decoder)_num_attention_heads)$", 4),
    (r"^(num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num)$", _KV_HEADS),
    (r"^(head_dim|d_kv|d_head|attention_head_dim|attention_head_size|kv_channels|qk_nope_head_dim|v_head_dim)$", 16),
    (r"^(qk_rope_head_dim|rotary_dim)$", 8),
    (r"^(kv_lora_rank|q_lora_rank)$", 32),
    (r"^(hidden_size|d_model|n_embd|embed_dim|emb_dim|dim|embedding_size|word_embed_proj_dim|hidden_size_global)$", 64),
    (r"intermediate_size|ffn_dim$|ffn_hidden_size$|^(d_ff|n_inner|dim_ff)$", 128),
    (r"^(num_local_experts|num_experts|n_routed_experts|moe_num_experts|zero_expert_num)$", 4),
    (r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_k)$", 2),
    (r"^(n_group|topk_group)$", 1),
    (r"^vocab_size$", 128),
    # gemma3n's per-layer embeddings, luke's entities, blt's hashed byte groups.
    (r"^(vocab_size_per_layer_input|entity_vocab_size|encoder_hash_byte_group_vocab)$", 128),
    (r"^image_size$", 32),
    (r"^patch_size$", 8),
)
# Special tokens of text, which random inputs may hold: where one is past the tiny vocabulary, it moves into it.
_TEXT_TOKENS = re.compile(r"^(pad|bos|eos|unk|sep|cls|mask|decoder_start|forced_bos|forced_eos)_token_id$")
# Any other token id (an image or audio marker, which random inputs must not hold): past the tiny vocabulary, the
# vocabulary keeps its default size.
_TOKEN_IDS = re.compile(r"_token_id$|_token_index$")
SEQ_LEN = 16
# Per-type values over SHRINK's (a sub-config's key dotted), each with why; None keeps the default.
EXCEPTIONS: dict[str, dict[str, Option | None]] = {
    # Heads per stage, [3, 6, 12, 24], divide no stage's width (64 x 2^stage): these do; and its relative position bias
    # is built for full 7x7 windows, which the last of 4 stages (/32) has only at 224 pixels.
    "donut-swin": {"num_heads": [2, 4, 8, 16], "image_size": None},
    "swinv2": {"num_heads": [2, 4, 8, 16]},
    # The same heads as donut-swin, and its windows of 7 need its image size.
    "swin": {"num_heads": [2, 4, 8, 16], "image_size": None},
    # Its last stages downsample 32 pixels to nothing: the default image size (256, 224).
    "mobilevitv2": {"image_size": None},
    "levit": {"image_size": None, "patch_size": None},
    # attention_types, runs of layer kinds ([[["global", "local"], 12]]: 24 layers), must cover every layer.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # The last num_kv_shared_layers layers (default 15) reuse the caches of earlier ones: the second of 2 (hf: takes
    # no count of layers below 1).
    "gemma3n_text": {"num_kv_shared_layers": 1},
    "gemma3n": {"text_config.num_kv_shared_layers": 1},
    # The router's top-k defaults to None, with which the model cannot run; DeepSeek-V2's published configs set 6.
    "deepseek_v2": {"num_experts_per_tok": 2},
    # heads x head_dim must equal expand (2) x hidden.
    "mamba2": {"num_heads": 8},
    # Its layer count is len(attn_layers), no key of its own; its axial position embeddings must sum to the hidden size
    # and, in training, their shape multiply to the sequence length (16).
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4]},
    # Their vocabularies default to None, with which no CTC head builds.
    "wav2vec2-bert": {"vocab_size": 128},
    "wav2vec2-conformer": {"vocab_size": 128},
    # Sizes one sub-config must repeat from another: the adaptor's width is the text width / 4, adapters take the
    # width of their encoder and give the text's, the diarization head's audio width is its encoder's, and the
    # codec's upsampling is grouped by its width.
    "fun_asr_nano": {"adaptor_config.intermediate_size": 16},
    "dots3_note": {
        "vision_config.adapter_in_dim": 64,
        "vision_config.adapter_out_dim": 64,
        "audio_config.adapter_input_size": 64,
        "audio_config.adapter_out_dim": 64,
    },
    "nemo_speechlm": {"audio_config.diarization_config.head_config.audio_hidden_size": 64},
    "kyutai_speech_to_text": {"codec_config.upsample_groups": 64},
}
# Types whose training forward draws random numbers that no config turns off: a pipeline draws them per micro-batch
# and stage, one process for the whole batch, so their losses differ by the noise (the reason says which).
SAMPLES_IN_TRAINING = {
    "phimoe": "samples its experts in training (Gumbel noise in sparsemixer, modeling_phimoe.py), which a pipeline "
    "draws per micro-batch",
}
# A model larger than this at its smallest reference (sizes SHRINK does not reach) is not built here.
MAX_PARAMS = 70_000_000

STEPS = ("eager", "inspect", "plan_local", "pipeline", "plan_a100")
MIN_BLOCKS = 4
TARGET_PCT = 95.0


def table_of(model_type: str) -> str:
    """The short name of the first table (in TABLES' order) that lists `model_type`."""
    from transformers.models.auto import modeling_auto  # optional heavy package

    return next(short for short, name in TABLES.items() if model_type in getattr(modeling_auto, name))


def sweep_types() -> list[str]:
    """Every model type of the tables, sorted."""
    from transformers.models.auto import modeling_auto  # optional heavy package

    return sorted(set().union(*(getattr(modeling_auto, name) for name in TABLES.values())))


def spread(model_types: Sequence[str]) -> list[str]:
    """`model_types` ordered by taking the tables (in TABLES' order, each alphabetical) in turn."""
    by_table: dict[str, list[str]] = {}
    for t in sorted(model_types):
        by_table.setdefault(table_of(t), []).append(t)
    columns = [by_table.get(short, []) for short in TABLES]
    return [t for row in itertools.zip_longest(*columns) for t in row if t is not None]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rule(key: str) -> Value | None:
    return next((value for pattern, value in SHRINK if re.search(pattern, key)), None)


def shrink(config_class: type) -> dict[str, Option]:
    """The overrides that make `config_class`'s defaults tiny: SHRINK applied key by key at the top level and in each
    sub-config (dotted keys), the special tokens moved into the tiny vocabulary (or the vocabulary kept), lists of
    one entry per layer cut, then the type's EXCEPTIONS."""
    out = _shrunk(config_class())
    for key, value in EXCEPTIONS.get(getattr(config_class, "model_type", ""), {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _shrunk(config: Any) -> dict[str, Option]:
    """shrink() of one config without the EXCEPTIONS: its own keys, then its sub-configs' with their prefix."""
    from transformers import PreTrainedConfig  # optional heavy package

    config_class = type(config)
    fields = _fields(config_class)
    defaults = {k: v for k, v in config.to_dict().items() if k in fields}
    heads = next((v for k, v in defaults.items() if _rule(k) == 4 and _number(v)), None)
    out: dict[str, Option] = {}
    for key, default in defaults.items():
        value = _rule(key)
        if value is None:
            continue
        if isinstance(default, list | tuple) and re.search(_RANDOM, key) and any(map(_number, default)):
            if any(default):
                out[key] = [0.0] * len(default)
            continue
        if not _number(default):
            continue
        if value == _KV_HEADS:
            value = 2 if heads is not None and default < heads else 4
        assert not isinstance(value, str)
        if value < default:
            out[key] = float(value) if isinstance(default, float) else int(value)
    vocab = out.get("vocab_size")
    if vocab is not None:
        ids = {k: v for k, v in defaults.items() if _TOKEN_IDS.search(k)}
        moved = _moved_tokens(ids, int(vocab))
        if moved is None:
            del out["vocab_size"]
        else:
            out.update(moved)
    out.update(_per_layer_cuts(config_class, defaults, out))
    for key in _sub_config_keys(config_class):
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig):
            out.update({f"{key}.{k}": v for k, v in _shrunk(sub).items()})
    return out


def _per_layer_cuts(config_class: type, defaults: dict[str, Any], out: dict[str, Option]) -> dict[str, Option]:
    """The lists of `defaults` with one entry per layer (as long as a layer count that `out` shrinks), cut to the new
    count: those the class defaults to (reformer's attn_layers), and those it derives from the layer count (layer
    types) where the shrunk config does not build from its own derivation (zamba's needs 3 layers or more)."""
    counts = {defaults[k]: v for k, v in out.items() if re.search(_LAYERS, k) and isinstance(v, int)}
    lists = {k: v for k, v in defaults.items() if isinstance(v, list | tuple) and v and len(v) in counts}
    if not lists:
        return {}
    given = dataclasses.fields(config_class) if dataclasses.is_dataclass(config_class) else ()
    explicit = {f.name for f in given if f.default is not None and f.default is not dataclasses.MISSING}
    explicit |= {f.name for f in given if f.default_factory is not dataclasses.MISSING}
    chosen = {k for k in lists if k in explicit}
    derived = set(lists) - chosen
    if derived:
        try:
            config_class(**{k: v for k, v in out.items() if "." not in k})
        except Exception:
            chosen |= derived
    return {k: [_smaller(k, v) for v in lists[k][: counts[len(lists[k])]]] for k in sorted(chosen)}


def _smaller(key: str, value: Any) -> Any:
    """`value`, an entry of a list cut per layer, shrunk by the SHRINK rule of its key where it is a number (gemma3n's
    intermediate_size per layer)."""
    rule = _rule(key)
    if not _number(value) or not _number(rule) or rule >= value:
        return value
    return float(rule) if isinstance(value, float) else int(rule)


def _sub_config_keys(config_class: type) -> list[str]:
    """The keys of `config_class`'s sub-configs (transformers' sub_configs_defaults, else sub_configs)."""
    keys = list(getattr(config_class, "sub_configs_defaults", None) or {})
    return keys + [k for k in getattr(config_class, "sub_configs", None) or {} if k not in keys]


def _fields(config_class: type) -> set[str]:
    """The keys `config_class` takes: its dataclass fields, or its constructor's parameters (its to_dict also holds
    values derived from them, such as swin's num_layers, which are no keys)."""
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(inspect.signature(config_class.__init__).parameters)


def _moved_tokens(ids: dict[str, Any], vocab: int) -> dict[str, int] | None:
    """New values for the text tokens at or past `vocab` (distinct ids as distinct as before, counted down from the
    top of the vocabulary), or None when another token id or a list of ids is past it."""
    taken = {v for v in ids.values() if isinstance(v, int) and v < vocab}
    new: dict[int, int] = {}
    moved: dict[str, int] = {}
    for key, value in sorted(ids.items()):
        if value is None or (isinstance(value, int) and value < vocab):
            continue
        if isinstance(value, list):
            if any(isinstance(v, int) and v >= vocab for v in value):
                return None
            continue
        if not isinstance(value, int) or not _TEXT_TOKENS.match(key):
            return None
        if value not in new:
            new[value] = max(set(range(vocab)) - taken - set(new.values()))
        moved[key] = new[value]
    return moved


def reference(model_type: str) -> str:
    """The `hf:` reference of `model_type`'s tiny config (seq_len for the text models)."""
    import transformers  # optional heavy package

    options = shrink(transformers.CONFIG_MAPPING[model_type])
    if table_of(model_type) not in ("image", "speech-seq2seq", "ctc"):
        options["seq_len"] = SEQ_LEN
    return f"hf:{model_type}:" + ",".join(f"{k}={_text(v)}" for k, v in options.items())


def _text(value: Option) -> str:
    if isinstance(value, list | tuple):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


class _StepTimeout(BaseException):
    """A step past its time limit: a BaseException, so that the CLI's handler of every Exception lets it through."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _StepTimeout in this (main) thread after `seconds` of this process's CPU time (when control next
    returns to Python): CPU time, so that a machine shared with other work does not fail a step."""

    def expire(signum: int, frame: Any) -> None:
        raise _StepTimeout(f"over {seconds:.0f} CPU seconds")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _cast(call: Any, dtype: Any) -> Any:
    """`call` with its floating-point tensors in `dtype`."""
    import torch

    from pyplan._torch import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, call)


def eager_check(spec: Any) -> str:
    """The dtype ("float64", else "float32") in which `spec`'s model trains one step in plain torch on this CPU:
    forward on spec.example_inputs(2), the spec's loss, backward, a finite loss and a gradient; raises the float32
    failure when neither does."""
    import torch

    from pyplan.graph.trace import call_at, output_tensors
    from pyplan.spec import default_loss

    failure: BaseException | None = None
    for name in ("float64", "float32"):
        dtype = getattr(torch, name)
        try:
            torch.manual_seed(0)
            model = spec.build().to(dtype).train()
            args, kwargs = _cast(call_at(spec.example_inputs, 2), dtype)
            target = spec.target(2) if spec.target is not None else None
            loss = (spec.loss or default_loss)(output_tensors(model(*args, **kwargs)), target)
            loss.backward()
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss.item()}")
            if not any(p.grad is not None for p in model.parameters()):
                raise RuntimeError("backward gave no parameter a gradient")
            return name
        except Exception as exc:
            failure = exc
    assert failure is not None
    raise failure


def cli_commands(ref: str) -> dict[str, list[str]]:
    """The `pyplan` command lines of steps (1), (2) and (4)."""
    return {
        # One timed run a block: the step checks capture and blocks, not times (and halves the sweep).
        "inspect": ["inspect", ref, "--json", "--batch-size", "2", "--warmup", "1", "--repeats", "1"],
        "plan_local": ["plan", ref, "--gpus", "2", "--gpu", "local", "--global-batch", "8", "--json"],
        "plan_a100": ["plan", ref, "--gpus", "8", "--gpu", "a100-80g", "--global-batch", "16", "--precision",
                      "bf16-mixed", "--json"],
    }  # fmt: skip


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`pyplan ARGV` run in this process: its exit status, stdout and stderr."""
    from pyplan.cli.main import main as pyplan_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = pyplan_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def _cli_error(stderr: str) -> str:
    """The one line the CLI printed for its error."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith(("error:", "internal error:"))]
    return (said or lines or ["(no message)"])[-1]


STEP_LIMIT_S = {"eager": 120.0, "inspect": 150.0, "plan_local": 200.0, "plan_a100": 150.0}  # CPU seconds


def measure(model_type: str) -> dict[str, Any]:
    """Steps (0), (1), (2) and (4) for one type, in this process: its record."""
    import torch

    from pyplan import ModelLoadError, load_model

    record: dict[str, Any] = {"type": model_type, "step": "cpu", "table": table_of(model_type)}
    started = time.perf_counter()
    try:
        record["ref"] = reference(model_type)
        spec = load_model(record["ref"])
    except ModelLoadError as exc:
        if "pyplan" in str(exc):  # pyplan's hub refuses the type (inputs it does not know): pyplan's failure
            return {
                **record,
                "load": {"ok": False, "why": _first_line(exc)},
                "s": round(time.perf_counter() - started, 2),
            }
        return {**record, "excluded": _first_line(exc), "s": round(time.perf_counter() - started, 2)}
    except Exception as exc:
        return {**record, "excluded": _first_line(exc), "s": round(time.perf_counter() - started, 2)}
    try:
        with torch.device("meta"):
            record["params"] = sum(p.numel() for p in spec.build().parameters())
        if record["params"] > MAX_PARAMS:
            raise ValueError(
                f"{record['params'] / 1e6:,.0f}M parameters at the smallest hf: reference (sizes the shrink does "
                "not reach)"
            )
        with _time_limit(STEP_LIMIT_S["eager"]):
            record["dtype"] = eager_check(spec)
    except (Exception, _StepTimeout) as exc:
        return {**record, "excluded": _first_line(exc), "s": round(time.perf_counter() - started, 2)}
    for step, argv in cli_commands(record["ref"]).items():
        t0 = time.perf_counter()
        try:
            with _time_limit(STEP_LIMIT_S[step]):
                rc, out, err = _cli(argv)
        except _StepTimeout as exc:
            record[step] = {"ok": False, "why": str(exc)}
            continue
        result: dict[str, Any] = {"ok": rc == 0, "why": "" if rc == 0 else _cli_error(err)}
        if rc == 0 and step == "inspect":
            blocks = len(json.loads(out)["blocks"])
            result.update(blocks=blocks, ok=blocks >= MIN_BLOCKS, why="" if blocks >= MIN_BLOCKS else
                          f"{blocks} blocks < {MIN_BLOCKS}")  # fmt: skip
        elif rc == 0:
            lay = json.loads(out)["plan"]
            result["plan"] = f"dp{lay['dp']} pp{lay['pp']} b{lay['micro_batch_size']}x{lay['num_microbatches']}"
        record[step] = {**result, "s": round(time.perf_counter() - t0, 2)}
    return {**record, "s": round(time.perf_counter() - started, 2)}


def worker(model_types: Sequence[str], out_path: str) -> None:
    """measure() each type in turn, one JSON line appended to `out_path` per type."""
    import torch
    import transformers  # optional heavy package

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    for model_type in model_types:
        record = measure(model_type)
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """The records of `path` merged per type: its CPU steps and its pipeline step, a later line replacing an earlier
    (a CPU record also drops the pipeline record before it)."""
    merged: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return merged
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        entry = merged.get(rec["type"], {})
        if rec["step"] == "pipeline":
            merged[rec["type"]] = {**entry, "pipeline": {k: v for k, v in rec.items() if k not in ("type", "step")}}
        else:  # a type measured again: its new record replaces the old one, pipeline included
            merged[rec["type"]] = {k: v for k, v in rec.items() if k != "step"}
    return merged


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_cpu_steps(
    model_types: list[str], out: Path, logs: Path, *, jobs: int, chunk: int, say: Callable[[str], None]
) -> None:
    """Steps (0), (1), (2), (4) of `model_types` in worker processes of `chunk` types, `jobs` at a time; a worker
    that dies or passes its time limit gets its type in progress recorded as crashed, and the rest requeued."""
    queue = list(model_types)
    running: dict[subprocess.Popen[bytes], tuple[list[str], float, Path]] = {}
    limit = 3 * sum(STEP_LIMIT_S.values()) + 60  # wall seconds without progress: CPU limits on a busy machine
    launched = 0
    try:
        while queue or running:
            while queue and len(running) < jobs:
                part, queue = queue[:chunk], queue[chunk:]
                log = logs / f"worker-{launched}.log"
                launched += 1
                with open(log, "wb") as f:
                    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(out), *part],
                                            stdout=f, stderr=subprocess.STDOUT)  # fmt: skip
                running[proc] = (part, time.monotonic(), log)
            time.sleep(1.0)
            done = set(read_records(out))
            for proc, (part, since, log) in list(running.items()):
                left = [t for t in part if t not in done]
                if left and len(left) < len(running[proc][0]):
                    running[proc] = (left, time.monotonic(), log)  # progress: the clock restarts
                    part, since = left, time.monotonic()
                if proc.poll() is None and time.monotonic() - since > limit:
                    proc.kill()
                if proc.poll() is None:
                    continue
                del running[proc]
                if left:
                    with open(out, "a") as f:
                        why = f"worker exited with {proc.returncode} during this type: {_last_line(log)}"
                        f.write(json.dumps({"type": left[0], "step": "cpu", "table": table_of(left[0]), "crashed": why})
                                + "\n")  # fmt: skip
                    queue = left[1:] + queue
                say(f"{len(done) + (1 if left else 0)} types measured")
    finally:
        for proc in running:  # stopped early (SIGTERM): the workers stop too
            proc.kill()


PIPELINE_LAUNCH = 40  # models per torchrun launch
ROUND = 40  # types whose CPU steps, then pipelines, run before the next types


def run_pipelines(jobs: list[dict[str, str]], out: Path, logs: Path, *, say: Callable[[str], None]) -> None:
    """Step (3) of `jobs` ({"type", "ref", "dtype"}) in torchrun launches of 2 processes; after a launch that
    crashed, the model in progress gets a record (if it wrote none) and the rest run in a new launch."""
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hf_types_child.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    queue = list(jobs)
    launched = 0
    while queue:
        part = queue[:PIPELINE_LAUNCH]
        spec_file = logs / f"pipeline-{launched}.json"
        spec_file.write_text(json.dumps(part))
        log = logs / f"pipeline-{launched}.log"
        launched += 1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", child,
               str(spec_file), str(out)]  # fmt: skip
        with open(log, "wb") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=root).returncode
        done = {t for t, r in read_records(out).items() if "pipeline" in r}
        left = [j for j in part if j["type"] not in done]
        if left and rc != 0:
            with open(out, "a") as f:
                why = f"the launch ended ({rc}) during this model: {_hang_or_last(log)}"
                f.write(json.dumps({"type": left[0]["type"], "step": "pipeline", "ok": False, "why": why}) + "\n")
            left = left[1:]
        elif left:
            raise RuntimeError(f"torchrun exited 0 without records for {[j['type'] for j in left]}; see {log}")
        queue = left + queue[len(part) :]
        say(f"pipelines: {len(jobs) - len(queue)} of {len(jobs)}")


def _hang_or_last(log: Path) -> str:
    text = log.read_text(errors="replace")
    if "Timeout (" in text:
        return "no progress within the time limit (a hang; faulthandler's stacks in the log)"
    return _last_line(log)


@dataclass(frozen=True)
class Row:
    """One type's outcome: each step's pass (True), failure (False) or not run (None), and the first reason."""

    model_type: str
    table: str
    params: int | None
    steps: dict[str, bool | None]
    reason: str
    failed_step: str  # the step whose reason is given ("" when every step passed)
    ref: str

    @property
    def excluded(self) -> bool:
        return self.steps["eager"] is False

    @property
    def passed(self) -> bool:
        return all(self.steps.values())

    @property
    def pending(self) -> bool:
        """Not excluded, no step failed, a step yet to run (the pipelines of a round still running)."""
        return not self.failed_step and not self.passed


def row_of(rec: dict[str, Any]) -> Row:
    """The Row of one type's merged record."""
    steps: dict[str, bool | None] = dict.fromkeys(STEPS)
    reason, failed = "", ""
    if "excluded" in rec:
        steps["eager"], reason, failed = False, rec["excluded"], "eager"
    elif "load" in rec:
        reason, failed = rec["load"]["why"], "load"
    elif "crashed" in rec:
        steps["eager"], reason, failed = True, rec["crashed"], "crashed"
    else:
        steps["eager"] = "dtype" in rec or None
        for step in STEPS[1:]:
            got = rec.get(step)
            steps[step] = None if got is None else bool(got["ok"])
            if got is not None and not got["ok"] and not reason:
                reason, failed = got["why"], step
                if step == "pipeline" and rec["type"] in SAMPLES_IN_TRAINING:
                    reason = f"{SAMPLES_IN_TRAINING[rec['type']]}: {reason}"
    return Row(rec["type"], rec.get("table", "?"), rec.get("params"), steps, reason, failed, rec.get("ref", ""))


def _mark(value: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "-"}[value]


def summary(rows: Sequence[Row]) -> tuple[int, int, float]:
    """(types that train eagerly here, of them the types that pass every step, the percentage); types with a step
    still to run are left out."""
    trainable = [r for r in rows if not r.excluded and not r.pending]
    passed = sum(r.passed for r in trainable)
    return len(trainable), passed, 100.0 * passed / len(trainable) if trainable else 0.0


def error_class(reason: str) -> str:
    """A failure's reason with what varies between types taken out (references, class names' model prefixes,
    numbers), so that one cause groups its types."""
    text = re.sub(r"'hf:[^']*'", "REF", reason)
    text = re.sub(r"\bhf:\S+", "REF", text)
    text = re.sub(
        r"\b[A-Z][A-Za-z0-9]*?(For[A-Z]\w*|Config|Model|Attention|Layer|Block|Decoder|Encoder)\b", r"*\1", text
    )
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:160]


def repro(row: Row) -> str:
    """The command that reproduces a row's failure."""
    if row.failed_step in ("inspect", "plan_local", "plan_a100"):
        return "pyplan " + " ".join(_quoted(a) for a in cli_commands(row.ref)[row.failed_step])
    return f"python benchmarks/hf_types.py --types {row.model_type} --out /tmp/hf_types/{row.model_type}.jsonl"


def _quoted(arg: str) -> str:
    return f"'{arg}'" if re.search(r"[^\w:=,./+-]", arg) else arg


def failure_classes(rows: Sequence[Row]) -> str:
    """Markdown: the failures of the trainable types grouped by error class (count, step, types, one repro), then
    the excluded types grouped the same way."""
    parts = []
    for title, chosen in (
        ("Failures (types that train eagerly on this CPU)", [r for r in rows if r.failed_step and not r.excluded]),
        ("Excluded (do not build or train eagerly in transformers on this CPU)", [r for r in rows if r.excluded]),
    ):
        groups: dict[tuple[str, str], list[Row]] = {}
        for r in chosen:
            groups.setdefault((r.failed_step, error_class(r.reason)), []).append(r)
        parts.append(f"## {title}: {len(chosen)}\n")
        for (step, _), members in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            first = members[0]
            names = ", ".join(r.model_type for r in members)
            parts.append(
                f"- **{len(members)}** at {step}: `{first.reason}`\n  types: {names}\n  repro: `{repro(first)}`\n"
            )
    return "\n".join(parts)


def render(rows: Sequence[Row], wall_s: float, cpu_s: float) -> list[str]:
    """Print the table; returns the summary lines (also printed)."""
    from rich.console import Console

    columns = ("type", "table", "params", "eager", "inspect", "plan local", "pp=2", "plan a100", "reason")
    table = new_table("transformers' model types, tiny configs, through pyplan", columns, left=columns,
                      overflow="fold")  # fmt: skip
    for r in sorted(rows, key=lambda r: (r.passed, r.excluded, r.model_type)):
        params = "-" if r.params is None else f"{r.params / 1e6:.2f}M"
        table.add_row(r.model_type, r.table, params, *(_mark(r.steps[s]) for s in STEPS), r.reason[:200])
    Console(width=200, emoji=False, highlight=False).print(table)
    lines = [
        summary_line(rows),
        f"{wall_s:.0f} s wall, {cpu_s:.0f} s CPU ({machine()})",
        target_line(
            f"every step for >= {TARGET_PCT:.0f} % of the eagerly trainable types",
            summary(rows)[2] >= TARGET_PCT,
            f"{summary(rows)[2]:.1f} %",
        ),
    ]
    for line in lines:
        print(line)
    return lines


def summary_line(rows: Sequence[Row]) -> str:
    """Counts: types, excluded, eagerly trainable, passing every step, passing each step."""
    trainable, passed, pct = summary(rows)
    counted = [r for r in rows if not r.excluded and not r.pending]
    per_step = ", ".join(f"{s} {sum(bool(r.steps[s]) for r in counted)}" for s in STEPS[1:])
    excluded, pending = sum(r.excluded for r in rows), sum(r.pending for r in rows)
    return (
        f"{len(rows)} types: {excluded} excluded (do not train eagerly here), {trainable} train eagerly"
        + (f" (and {pending} with a step still to run)" if pending else "")
        + f"; every step passes for {passed} ({pct:.1f} %); passes per step: {per_step}"
        + (
            f"; {refused} refused by pyplan's hub at load"
            if (refused := sum(r.failed_step == "load" for r in rows))
            else ""
        )
    )


def markdown(rows: Sequence[Row], lines: Sequence[str], command: str) -> str:
    """The section REAL_MODELS.md records: the command, the summary, the failures with reasons, the passing types."""
    out = [f"`{command}`, {time.strftime('%Y-%m-%d')}, {machine()}.\n", *(f"- {line}" for line in lines), ""]
    out += ["| type | table | params | failed at | reason |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.excluded, r.failed_step, r.model_type)):
        if r.failed_step:
            params = "-" if r.params is None else f"{r.params / 1e6:.2f}M"
            what = "excluded" if r.excluded else r.failed_step
            out.append(f"| {r.model_type} | {r.table} | {params} | {what} | {r.reason.replace('|', '/')[:300]} |")
    out += ["", "Every step passes: " + ", ".join(sorted(r.model_type for r in rows if r.passed)) + ".", ""]
    return "\n".join(out)


def _pipeline_jobs(records: dict[str, dict[str, Any]], types: Sequence[str]) -> list[dict[str, str]]:
    """Step (3)'s models: the types whose step (1) passed and that have no pipeline record yet."""
    return [
        {"type": t, "ref": records[t]["ref"], "dtype": records[t]["dtype"]}
        for t in types
        if t in records and records[t].get("inspect", {}).get("ok") and "pipeline" not in records[t]
    ]


def _write_failures(path: str, rows: Sequence[Row], lines: Sequence[str]) -> None:
    text = "\n".join(lines)
    Path(path).write_text(f"# hf_types: failure classes\n\n{text}\n\n{failure_classes(rows)}")


def _calibrated() -> bool:
    from pyplan.hardware.catalog import local_gpu, local_link

    return local_gpu().calibrated and local_link().calibrated


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--types", help="model types separated by commas (default: every type of the tables)")
    parser.add_argument("--out", default="/tmp/hf_types/results.jsonl", help="the JSON-lines results file")
    parser.add_argument("--resume", action="store_true", help="keep the results file and skip the steps it holds")
    parser.add_argument("--redo", help="with --resume: types to measure again (e.g. those a timeout failed)")
    parser.add_argument("--spread", action="store_true", help="take the tables in turn, so a partial run covers each")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time (default 2)")
    parser.add_argument("--chunk", type=int, default=8, help="types per worker process (default 8)")
    parser.add_argument("--no-pipeline", action="store_true", help="skip step (3)")
    parser.add_argument("--report", action="store_true", help="only print the table of the results file")
    parser.add_argument("--markdown", help="also write the results section (markdown) here")
    parser.add_argument("--failures", help="also write the failures grouped by error class (markdown) here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # so that workers are stopped
    wall0, out = time.perf_counter(), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = out.parent / "logs"
    logs.mkdir(exist_ok=True)
    types = args.types.split(",") if args.types else sweep_types()
    if not (args.resume or args.report) and out.exists():
        out.unlink()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - wall0:6.0f} s] {text}", flush=True)

    if not args.report:
        if not _calibrated():
            # The `local` GPU plans from a calibration: a quick one, in a directory of this run's own.
            os.environ["PYPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hf_types_cache_")
            say(f"calibrating this machine (pyplan calibrate --quick) into {os.environ['PYPLAN_CACHE_DIR']}")
            subprocess.run([sys.executable, "-m", "pyplan.cli", "calibrate", "--quick"], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
        done = read_records(out)
        redo = set(args.redo.split(",")) if args.redo else set()
        to_measure = [t for t in (spread(types) if args.spread else types) if t not in done or t in redo]
        say(f"{len(types)} types, {len(to_measure)} to measure")
        # In rounds, each round's pipelines after its CPU steps: a run stopped early holds every step of its rounds.
        for start in range(0, max(len(to_measure), 1), ROUND):
            run_cpu_steps(to_measure[start : start + ROUND], out, logs, jobs=args.jobs, chunk=args.chunk, say=say)
            if not args.no_pipeline:
                run_pipelines(_pipeline_jobs(read_records(out), types), out, logs, say=say)
            if args.failures:
                rows = [row_of(r) for t, r in read_records(out).items() if t in types]
                _write_failures(args.failures, rows, [summary_line(rows)])
    records = read_records(out)
    rows = [row_of(records[t]) for t in types if t in records]
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_s = sum(u.ru_utime + u.ru_stime for u in usage)
    lines = render(rows, time.perf_counter() - wall0, cpu_s)
    command = "python benchmarks/hf_types.py" + (f" --types {args.types}" if args.types else "")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, lines, command))
    if args.failures:
        _write_failures(args.failures, rows, lines)
    return 0 if summary(rows)[2] >= TARGET_PCT else 1


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[3:], sys.argv[2])
    else:
        sys.exit(main())
