"""What the emitted script reports for tools: --metrics JSON lines, TensorBoard scalars, MFU, and --help."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pyplan import load_model
from pyplan.emit.planfile import PlanFile
from pyplan.emit.script import write_script
from pyplan.graph.trace import input_tensors
from pyplan.hardware import Cluster
from pyplan.hardware.catalog import GPU
from pyplan.runtime.optim import lr_factor
from tests.emit.test_script import B, _document, _torchrun

# A plan made for this kind of device (a CPU), so a CPU run is on the plan's device and MFU is measured against it.
HOST = GPU(name="host", memory_bytes=2**34, hbm_bw_bytes_per_s=1e10, peak_flops_per_s={"fp32": 1e10}, device_type="cpu")
KEYS = ["step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "mfu", "peak_memory_bytes"]


def _on(gpu: GPU) -> PlanFile:
    return dataclasses.replace(_document(), cluster=Cluster.from_catalog(gpu, 2))


def _script(tmp_path: Path, document: PlanFile) -> Any:
    """The emitted script imported as a module (its `main` not run)."""
    path = tmp_path / "train.py"
    write_script(path, document)
    spec = importlib.util.spec_from_file_location("emitted_metrics", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_describes_every_option(tmp_path: Path) -> None:
    parser = _script(tmp_path, _document()).build_parser()
    options = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert len(options) >= 14
    assert all(a.help and len(a.help) > 20 for a in options), [a.dest for a in options if not a.help]
    text = " ".join(parser.format_help().split())
    assert "Each step rank 0 prints the replicas' mean loss, the learning rate" in text
    assert "--metrics FILE write one JSON object a line per step" in text
    assert "mfu is null on a device other than the plan's (a CPU run of a GPU's plan" in text
    assert "--tensorboard DIR" in text and "pip install tensorboard" in text


class Writer:
    """Stands in for torch.utils.tensorboard's SummaryWriter: the scalars it was given."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


def _figures(step: int, **changes: Any) -> dict[str, Any]:
    figures = dict(zip(KEYS, [step, 2.5, 1e-3, 0.75, 0.04, 12000.0, 0.41, 3 * 2**20]))
    return {**figures, **changes}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_are_json_lines_flushed_each_step_and_continued_on_resume(tmp_path: Path) -> None:
    script = _script(tmp_path, _document())
    path = tmp_path / "out" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text('{"step": 0, "loss": 9.0}\n')  # another run's: a run from step 0 starts afresh
    writer = Writer()
    metrics = script.Metrics(str(path), writer, 0)
    for step in range(4):
        metrics.record(_figures(step, mfu=None if step == 3 else 0.41, loss=math.nan if step == 3 else 2.5))
        assert [line["step"] for line in _lines(path)] == list(range(step + 1))  # readable before the run ends
    metrics.close()
    lines = _lines(path)
    assert lines[0] == _figures(0) and list(lines[0]) == KEYS
    assert lines[3]["mfu"] is None and lines[3]["loss"] is None  # strict JSON: NaN is null
    assert "NaN" not in path.read_text()
    # TensorBoard gets every figure but the step (its x axis) and unknown ones, the diverged loss as it is.
    assert ("grad_norm", 0.75, 1) in writer.scalars and writer.closed
    assert not any(tag == "mfu" and step == 3 for tag, _, step in writer.scalars)
    assert any(tag == "loss" and step == 3 and math.isnan(value) for tag, value, step in writer.scalars)
    assert {tag for tag, _, _ in writer.scalars} == set(KEYS) - {"step"}

    # Resumed from a checkpoint of step 2 after a run that went on to step 3 and was cut mid-line: the lines of
    # steps 0 and 1 are kept, the rest dropped, and the file goes on from step 2.
    with path.open("a") as f:
        f.write('{"step": 4, "lo')
    metrics = script.Metrics(str(path), None, 2)
    metrics.record(_figures(2, loss=1.5))
    assert [(line["step"], line["loss"]) for line in _lines(path)] == [(0, 2.5), (1, 2.5), (2, 1.5)]
    metrics.close()
    assert not (tmp_path / "out" / "metrics.jsonl.partial").exists()


def test_an_unwritable_metrics_file_is_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path, _document())
    (tmp_path / "file").write_text("")
    with pytest.raises(script.PlanError, match=r"--metrics .*file/m.jsonl cannot be written"):
        script.Metrics(str(tmp_path / "file" / "m.jsonl"), None, 0)


def test_mfu_is_against_the_plans_gpu_at_its_precision_and_only_on_it(tmp_path: Path) -> None:
    script = _script(tmp_path, _document())
    t4 = Cluster.from_catalog("t4", 1).gpu
    assert script.peak_flops(t4, "fp16-mixed", None) == t4.peak_flops_per_s["fp16"]
    assert script.peak_flops(t4, "fp32", None) == t4.peak_flops_per_s["fp32"]
    assert script.peak_flops(t4, "fp16-mixed", "CPU") is None  # a CPU run of a T4's plan
    assert script.peak_flops(HOST, "bf16-mixed", None) is None  # no bf16 peak in the catalog
    assert script.peak_flops(HOST, "fp32", None) == 1e10


def test_model_flops_are_those_of_one_process_training_the_global_batch(tmp_path: Path) -> None:
    document = _document()
    script = _script(tmp_path, document)
    spec = load_model(document.model)
    model = spec.build()
    random = torch.get_rng_state()
    counted = script.model_flops(spec, model, document.plan.layout, document.leaf_modules)
    assert torch.equal(torch.get_rng_state(), random)  # rank 0 counts; every rank then draws the same numbers
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as mode:
        spec.loss(model(*spec.example_inputs(B)), spec.target(B)).backward()
    assert counted == pytest.approx(mode.get_total_flops(), rel=1e-9)
    assert counted > 6 * sum(p.numel() for p in model.parameters()) * B  # 6 N per token, and attention


def test_tensorboard_missing_is_one_line_before_training(tmp_path: Path) -> None:
    """Without TensorBoard (here hidden by a package that fails to import), the script says what to install and
    exits 2 before it asks for torchrun or trains."""
    script = tmp_path / "train.py"
    write_script(script, _document())
    hidden = tmp_path / "hide" / "tensorboard"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), "--tensorboard", str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr == "error: --tensorboard needs TensorBoard, which is not installed: pip install tensorboard\n"
    assert not (tmp_path / "tb").exists()


@pytest.mark.distributed
def test_a_run_on_the_plans_device_prints_and_records_lr_grad_norm_and_mfu(tmp_path: Path) -> None:
    """A 2-stage pipeline planned for this kind of device (a CPU): each step line shows lr, grad norm (no clipping
    asked) and MFU, and --metrics holds the same figures, one line a step."""
    document = _on(HOST)
    script = tmp_path / "train.py"
    write_script(script, document)
    metrics = tmp_path / "metrics.jsonl"
    steps, lr = 3, 0.05
    done = _torchrun(
        script, 2, "--steps", str(steps), "--lr", str(lr), "--warmup-steps", "2", "--metrics", str(metrics)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    lines = _lines(metrics)
    assert [line["step"] for line in lines] == list(range(steps)) and all(list(x) == KEYS for x in lines)
    spec = load_model(document.model)
    flops = _script(tmp_path, document).model_flops(spec, spec.build(), document.plan.layout, document.leaf_modules)
    tokens = input_tensors(spec.example_inputs(B))[0].numel()
    for step, (text, line) in enumerate(zip(printed, lines)):
        assert text.startswith(f"step {step} loss {line['loss']:.6f} lr {line['lr']:.4g} grad norm ")
        assert line["lr"] == pytest.approx(lr * lr_factor(step, steps, 2, "none"))
        assert f"grad norm {line['grad_norm']:.4g} " in text and line["grad_norm"] > 0
        assert line["mfu"] == pytest.approx(flops / (line["step_s"] * 2 * 1e10))
        assert f"{line['tokens_per_s']:,.0f} tokens/s MFU {line['mfu'] * 100:.1f}% peak memory " in text
        assert line["tokens_per_s"] == pytest.approx(tokens / line["step_s"])
        assert line["peak_memory_bytes"] > 0
