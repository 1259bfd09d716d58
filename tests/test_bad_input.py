"""Bad input is one line on stderr and exit 2: plans the runtime must not run, binary files, argparse's refusals and
torch.export's output on a model it cannot capture (--debug shows the rest)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pyplan.cli.main import main
from pyplan.emit.planfile import PlanFile, plan_file_from_json
from pyplan.emit.script import render_script
from pyplan.errors import PlanError
from pyplan.hardware import Cluster
from pyplan.plan import Layout, Plan, Prediction, StagePlan, Workload


def _plan_json() -> dict[str, Any]:
    """A plan the planner could write: 1 replica of a 2-stage 1F1B pipeline, 4 micro-batches of 2, on 4 T4s."""
    layout = Layout(dp=1, pp=2, micro_batch_size=2, num_microbatches=4, schedule="1F1B", cut_positions=(0, 10, 20))
    stages = tuple(StagePlan(0, 0, 0.0, 0.0, 0.0, 0.0, 1) for _ in range(2))
    predicted = Prediction(0.02, 400.0, 4e6, 0.0, 0.0, 0.0, 0.0, 0.0, "")
    cluster = Cluster.from_catalog("t4", 4)
    document = PlanFile("zoo:gpt-tiny", Workload(global_batch=8), cluster, Plan(layout, stages, predicted))
    return json.loads(json.dumps(document.to_json()))


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err, err
    return err


PLANS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "dp true": (lambda plan: plan.update(dp=True), "'plan.dp' must be a whole number, got true"),
    "pp 2.0": (lambda plan: plan.update(pp=2.0), "'plan.pp' must be a whole number, got 2.0"),
    "cut true": (lambda plan: plan.update(cut_positions=[False, 10, 20]), "'plan.cut_positions' must be whole"),
    "V schedule, one stage per rank": (
        lambda plan: plan.update(schedule="ZBVZeroBubble"),
        "ZBVZeroBubble runs exactly 2 stages per rank (got 1)",
    ),
    "interleaved, one rank": (
        lambda plan: plan.update(pp=1, stages_per_rank=2, dp=1),
        "Interleaved1F1B runs several stages on each of several pipeline ranks",
    ),
    "ZeRO-3 beside a pipeline": (
        lambda plan: plan.update(zero_stage=3, dp=2, num_microbatches=2),
        "ZeRO-3 runs in plans of one pipeline stage",
    ),
}


@pytest.mark.parametrize("case", sorted(PLANS))
def test_emit_refuses_a_plan_the_planner_never_makes(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    change, message = PLANS[case]
    data = _plan_json()
    if case == "interleaved, one rank":
        data["plan"]["schedule"] = "Interleaved1F1B"
    change(data["plan"])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(data))
    out = tmp_path / "train.py"
    assert main(["emit", str(plan_file), "-o", str(out)]) == 2
    assert message in _one_line(capsys)
    assert not out.exists()
    # The emitted script reads a --plan file with the same reader (read_plan_file), so it refuses it alike.
    with pytest.raises(PlanError, match="plan file"):
        plan_file_from_json(data, "plan file 'plan.json'")


def test_the_script_validates_its_plan_as_emit_does() -> None:
    text = render_script(plan_file_from_json(_plan_json()))
    assert "read_plan_file(args.plan) if args.plan else plan_file_from_json(PLAN" in text


def test_a_plan_the_planner_makes_is_emitted(tmp_path: Path) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(_plan_json()))
    assert main(["emit", str(plan_file), "-o", str(tmp_path / "train.py")]) == 0


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_binary_or_deeply_nested_cluster_file_is_one_line(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binary = tmp_path / f"binary{suffix}"
    binary.write_bytes(bytes(range(256)) * 8)
    assert main(["plan", "zoo:mlp-tiny", "--cluster", str(binary)]) == 2
    assert "not UTF-8 text" in _one_line(capsys)
    nested = tmp_path / f"nested{suffix}"
    nested.write_text(("a = " if suffix == ".toml" else "") + "[" * 100_000)
    assert main(["plan", "zoo:mlp-tiny", "--cluster", str(nested)]) == 2
    assert "nests its tables too deeply" in _one_line(capsys)


def test_a_zero_head_reference_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert main(["inspect", "hf:gpt2:n_head=0", "--analytic"]) == 2
    assert "n_head=0" in _one_line(capsys)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "m.py", "--precision", "fp64"], "argument --precision: invalid choice: 'fp64' (choose from"),
        (["plan", "m.py", "--gpus", "x"], "argument --gpus: invalid int value: 'x'"),
        (["inspect"], "the following arguments are required: model"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_argparse_refusals_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = _one_line(capsys)
    assert message in err and "--help` lists the options" in err
    assert main([*argv, "--debug"]) == 2
    assert "usage:" in capsys.readouterr().err  # --debug shows argparse's usage block


BRANCHY = """
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            return h * 2
        return h


def model():
    return Branchy()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_torch_export_output_on_a_data_dependent_branch_is_kept_for_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "branchy.py"
    path.write_text(BRANCHY)
    assert main(["inspect", str(path)]) == 2
    assert "branches on a tensor's values" in _one_line(capsys)
    assert main(["inspect", str(path), "--debug"]) == 2
    assert "def forward(" in capsys.readouterr().err  # torch's partial graph, shown under --debug


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"[" * 100_000], ids=["binary", "nested"])
def test_a_corrupt_profile_cache_entry_is_discarded_for_a_rebuild(tmp_path: Path, content: bytes) -> None:
    from pyplan.profile.cache import ProfileCache, ProfileKey

    cache = ProfileCache(tmp_path)
    key = ProfileKey(label="Model", data={"k": 1})
    cache.path(key).write_bytes(content)
    assert cache.load(key, None, None, min_blocks=1, max_blocks=2) is None  # type: ignore[arg-type]
    assert cache.stats.discarded == 1 and not cache.path(key).exists()  # the sweep's note names it; rebuilt
