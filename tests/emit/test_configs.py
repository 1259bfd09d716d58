"""`pyplan emit --format`: a plan as torchtitan's, DeepSpeed's and Megatron's configuration, with a note for each
part of the plan the tool cannot express."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from pyplan.cli.main import main
from pyplan.emit.configs import render_config
from pyplan.emit.planfile import read_plan_file


def _planned(tmp_path: Path, *pins: str) -> Path:
    out = tmp_path / "plan.json"
    argv = ["plan", "zoo:gpt-tiny", "--gpus", "8", "--gpu", "a100-80g", "--global-batch", "64", "--json"]
    assert main([*argv, "--precision", "bf16-mixed", *pins, "--out", str(out)]) == 0
    return out


def test_a_pipeline_with_selective_checkpointing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = read_plan_file(
        _planned(tmp_path, "--pp", "2", "--zero", "0", "--ga", "4", "--schedule", "1F1B", "--remat", "selective")
    )
    capsys.readouterr()
    lay = doc.plan.layout
    assert (lay.pp, lay.zero_stage, lay.num_microbatches) == (2, 0, 4)
    text, notes = render_config(doc, "torchtitan")
    toml = tomllib.loads(text)
    par, train = toml["parallelism"], toml["training"]
    assert par["pipeline_parallel_degree"] == 2 and par["data_parallel_replicate_degree"] == lay.dp
    assert par["data_parallel_shard_degree"] == 1 and par["pipeline_parallel_schedule"] == lay.schedule
    assert par["pipeline_parallel_microbatch_size"] == lay.micro_batch_size
    assert len(par["pipeline_parallel_split_points"]) == 1
    assert par["pipeline_parallel_split_points"][0].startswith("transformer.h.")
    # torchtitan's local batch is a replica's share; the pipeline splits it into GA micro-batches.
    assert train["local_batch_size"] == lay.micro_batch_size * 4 and train["global_batch_size"] == 64
    assert train["mixed_precision_param"] == "bfloat16"
    assert toml["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not [n for n in notes if "ZeRO" in n]

    text, notes = render_config(doc, "deepspeed")
    ds = json.loads(text)
    assert ds == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 0},
        "bf16": {"enabled": True},
    }
    assert any("PipelineModule(layers, num_stages=2)" in n for n in notes)
    assert any("DeepSpeed's bf16 keeps bf16 weights beside fp32 master weights" in n for n in notes)

    text, notes = render_config(doc, "megatron")
    assert "--pipeline-model-parallel-size 2" in text and "--global-batch-size 64" in text and "--bf16" in text
    assert "--recompute-granularity selective" in text
    assert any("Megatron-LM's bf16 keeps bf16 weights" in n for n in notes)
    assert any("attention core" in n for n in notes)


def test_zero3_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _planned(tmp_path, "--pp", "1", "--dp", "8", "--zero", "3", "--remat", "full")
    capsys.readouterr()
    out = tmp_path / "titan.toml"
    assert main(["emit", str(plan), "--format", "torchtitan", "-o", str(out)]) == 0
    assert "note:" not in capsys.readouterr().err
    par = tomllib.loads(out.read_text())["parallelism"]
    assert par["data_parallel_shard_degree"] == 8 and par["pipeline_parallel_degree"] == 1
    assert tomllib.loads(out.read_text())["activation_checkpoint"]["mode"] == "full"
    assert main(["emit", str(plan), "--format", "megatron"]) == 0
    captured = capsys.readouterr()
    assert "--use-torch-fsdp2" in captured.out and "--recompute-granularity full" in captured.out
    assert "note: ZeRO-3 is Megatron's --use-torch-fsdp2" in captured.err


def test_bf16_master_is_the_tools_bf16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed's and Megatron-LM's bf16 are bf16 weights beside fp32 master weights; torchtitan has none (a note)."""
    out = tmp_path / "plan.json"
    argv = ["plan", "zoo:gpt-tiny", "--gpus", "8", "--gpu", "a100-80g", "--global-batch", "64", "--json"]
    assert main([*argv, "--precision", "bf16-master-bf16-grads", "--zero", "1", "--out", str(out)]) == 0
    doc = read_plan_file(out)
    assert doc.workload.precision == "bf16-master-bf16-grads" and doc.plan.layout.zero_stage == 1
    text, notes = render_config(doc, "deepspeed")
    assert json.loads(text)["bf16"] == {"enabled": True} and not any("master" in n for n in notes)
    text, notes = render_config(doc, "megatron")
    assert "--bf16" in text and not any("master" in n for n in notes)
    text, notes = render_config(doc, "torchtitan")
    assert tomllib.loads(text)["training"]["mixed_precision_param"] == "bfloat16"
    assert any("torchtitan keeps fp32 weights" in n for n in notes)
    # What its runtime does not train is one line, exit 2.
    capsys.readouterr()
    assert main([*argv, "--precision", "bf16-master", "--zero", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bf16-master runs under ZeRO 0 or 1" in err


_META_ONLY = """
import torch
from torch import nn


def model():
    # A model too big for the host: building it anywhere but on the meta device fails.
    if torch.empty(0).device.type != "meta":
        raise RuntimeError("built with real weights")
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])


def example_inputs(batch_size):
    return (torch.randn(batch_size, 64),)
"""


def test_split_points_from_a_model_built_on_meta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The split points come from the model traced on the meta device: no weights are built, whatever its size."""
    model = tmp_path / "big.py"
    model.write_text(_META_ONLY)
    out = tmp_path / "plan.json"
    argv = ["plan", str(model), "--gpus", "4", "--gpu", "a100-80g", "--global-batch", "16", "--json"]
    assert main([*argv, "--pp", "2", "--dp", "2", "--zero", "0", "--out", str(out)]) == 0
    capsys.readouterr()
    doc = read_plan_file(out)
    text, _ = render_config(doc, "torchtitan")
    (split,) = tomllib.loads(text)["parallelism"]["pipeline_parallel_split_points"]
    assert split in {str(k) for k in range(1, 8)}
