"""`pyplan emit --format`: what every format shares: the models the tools build and their units, the one-line
refusals, the CLI. The tools' own parsers read the files in test_configs_torchtitan.py, test_configs_megatron.py and
test_configs_deepspeed.py; the plans come from test_configs_plans.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from torch import nn

from pyplan.cli.main import main
from pyplan.emit.configs import find_decoder, plan_shape, render_config, stage_starts
from pyplan.emit.planfile import read_plan_file
from tests.emit.test_configs_plans import Plans, plans, refusal

__all__ = ["plans"]


def test_the_models_the_tools_build(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama under torchtitan's names and GPT-2 are found with their units; the split points are in those
    names; a model of neither family is refused in one line by the tools that build their own models."""
    doc = plans.doc("pipeline")
    capsys.readouterr()
    shape = plan_shape(doc, "torchtitan")
    dec = shape.decoder
    assert dec is not None and (dec.family, dec.stack, dec.n_layers, dec.tied) == ("llama", "layers", 8, False)
    assert shape.stages == (("E", "L0", "L1", "L2", "L3"), ("L4", "L5", "L6", "L7", "N", "H"))
    assert stage_starts(doc) == (["layers.4"], [])

    gpt = plan_shape(plans.doc("gpt"), "megatron")
    assert gpt.decoder is not None and gpt.decoder.family == "gpt2" and gpt.decoder.tied
    assert gpt.decoder.embeddings == ("transformer.wte", "transformer.wpe")
    message = refusal(lambda: render_config(plans.doc("gpt"), "torchtitan"))
    assert message.startswith("--format torchtitan cannot build zoo:gpt-tiny: torchtitan trains its own models")

    assert find_decoder(nn.Sequential(nn.Linear(4, 4))) is None


_MLP = """
import torch
from torch import nn


def model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])


def example_inputs(batch_size):
    return (torch.randn(batch_size, 64),)
"""


def test_a_model_no_tool_builds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan and Megatron-LM are told in one line that they cannot build it; DeepSpeed trains any model."""
    model = tmp_path / "mlp.py"
    model.write_text(_MLP)
    out = tmp_path / "plan.json"
    argv = ["plan", str(model), "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "16", "--json"]
    assert main([*argv, "--pp", "1", "--dp", "2", "--zero", "0", "--precision", "fp32", "--out", str(out)]) == 0
    capsys.readouterr()
    doc = read_plan_file(out)
    for fmt, tool in (("torchtitan", "torchtitan"), ("megatron", "Megatron-LM")):
        message = refusal(lambda fmt=fmt: render_config(doc, fmt))
        assert message.startswith(f"--format {fmt} cannot build {out.parent}/mlp.py: {tool} trains its own models")
    text, notes = render_config(doc, "deepspeed")
    assert json.loads(text)["zero_optimization"] == {"stage": 0} and not notes


def test_the_cli_writes_refuses_and_picks_the_version(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """emit --format writes the tool's file (stdout without -o) and its notes on stderr; a plan the tool cannot
    express is one line and exit 2; --torchtitan-version picks the release."""
    plan = plans.path("pipeline")
    capsys.readouterr()
    assert main(["emit", str(plan), "--format", "torchtitan", "--torchtitan-version", "0.2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# torchtitan 0.2.x") and tomllib.loads(out)["parallelism"]["pipeline_parallel_degree"] == 2
    assert "note: torchtitan recomputes every layer, also layers.3" in err
    target = plan.parent / "titan.sh"
    assert main(["emit", str(plan), "--format", "torchtitan", "-o", str(target)]) == 0
    assert target.read_text().startswith("# torchtitan 0.3.0 arguments")
    capsys.readouterr()
    assert main(["emit", str(plan), "--format", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --format deepspeed cannot express pipeline stages (DeepSpeed builds them in code, "
        "deepspeed.pipe.PipelineModule, not from its configuration): plan with --pp 1\n"
    )
    assert main(["emit", str(plan), "--format", "torchtitan", "--torchtitan-version", "0.1"]) == 2
    assert "invalid choice: '0.1'" in capsys.readouterr().err


def test_a_stage_inside_a_layer_is_refused(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """A cut inside layers.4 (after its attention_norm) is no module boundary: torchtitan and Megatron refuse it."""
    data = plans.json("interleaved")
    capsys.readouterr()
    cuts = data["plan"]["cut_positions"]
    # Move the second stage's start one operation later: into the layer it started.
    doc = plans.doc("interleaved", cut_positions=[cuts[0], cuts[1] + 1, *cuts[2:]])
    for fmt, tool, unit in (("torchtitan", "torchtitan", "modules"), ("megatron", "Megatron", "layers")):
        message = refusal(lambda fmt=fmt: render_config(doc, fmt))
        assert message == (
            f"--format {fmt} cannot express a stage that starts inside layers.2 ({tool} splits the model at {unit}): "
            "plan with --cuts at the blocks where layers start (pyplan inspect numbers the blocks)"
        )
