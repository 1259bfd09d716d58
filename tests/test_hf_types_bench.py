"""benchmarks/hf_types.py on a small scale: the shrink table on a few config classes, and steps (0), (1), (2) and (4)
of one type (gpt2) in this process, so that the sweep over transformers' model types cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import write_local_calibration

transformers = pytest.importorskip("transformers")

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_types.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pyplan_hf_types_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_gpt2_shrinks_to_two_layers_hidden_64_and_its_tokens_move_into_the_vocabulary(bench: ModuleType) -> None:
    got = bench.shrink(transformers.GPT2Config)
    assert {k: got[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size")} == {
        "n_layer": 2,
        "n_embd": 64,
        "n_head": 4,
        "vocab_size": 128,
    }
    assert got["resid_pdrop"] == got["embd_pdrop"] == got["attn_pdrop"] == 0.0
    assert got["bos_token_id"] == got["eos_token_id"] == 127  # both were 50256: still one token
    assert "n_positions" not in got  # a size that is no layer, width or vocabulary stays


def test_grouped_queries_keep_fewer_key_value_heads_and_images_shrink(bench: ModuleType) -> None:
    mistral = bench.shrink(transformers.MistralConfig)
    assert (mistral["num_attention_heads"], mistral["num_key_value_heads"], mistral["head_dim"]) == (4, 2, 16)
    vit = bench.shrink(transformers.ViTConfig)
    assert (vit["image_size"], vit["patch_size"], vit["hidden_size"]) == (32, 8, 64)
    bert = bench.shrink(transformers.BertConfig)  # dropout 0.1 by default (ViT's is 0 already)
    assert bert["hidden_dropout_prob"] == bert["attention_probs_dropout_prob"] == 0.0


def test_exceptions_override_and_keep_defaults(bench: ModuleType) -> None:
    assert bench.shrink(transformers.Mamba2Config)["num_heads"] == 8
    assert bench.shrink(transformers.Swinv2Config)["num_heads"] == [2, 4, 8, 16]
    assert "image_size" not in bench.shrink(transformers.DonutSwinConfig)


def test_error_classes_group_what_varies_between_types(bench: ModuleType) -> None:
    a = "transformers rejects the config of 'hf:a:x=1': ValueError: 3 heads for 64"
    b = "transformers rejects the config of 'hf:b:y=2': ValueError: 5 heads for 128"
    assert bench.error_class(a) == bench.error_class(b)


def test_gpt2_passes_inspect_and_both_plans_in_process(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_local_calibration(tmp_path)
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    record = bench.measure("gpt2")
    assert record["table"] == "causal-lm" and record["dtype"] == "float64", record
    assert record["params"] < 1_000_000
    for step in ("inspect", "plan_local", "plan_a100"):
        assert record[step]["ok"], (step, record[step])
    assert record["inspect"]["blocks"] >= bench.MIN_BLOCKS
    row = bench.row_of(record)
    assert row.steps["pipeline"] is None and not row.excluded and row.reason == ""
