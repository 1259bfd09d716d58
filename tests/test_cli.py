"""The command line: `pyplan inspect` output, JSON keys, exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyplan.cli.main import main
from tests.conftest import EXAMPLES

REQUIRED_TOP = {"model", "batch_size", "params", "flops_fwd", "flops_bwd", "activation_bytes", "blocks"}
REQUIRED_BLOCK = {
    "name",
    "params",
    "flops_fwd",
    "activation_bytes_per_sample",
    "cut_bytes_per_sample",
    "fwd_alpha",
    "fwd_beta",
    "bwd_alpha",
    "bwd_beta",
}


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_inspect_json_on_every_example(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "inspect",
            os.path.join(EXAMPLES, f"{name}.py"),
            "--batch-size",
            "4",
            "--json",
            "--warmup",
            "0",
            "--repeats",
            "1",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data.keys() >= REQUIRED_TOP
    assert data["blocks"] and all(b.keys() >= REQUIRED_BLOCK for b in data["blocks"])
    assert data["params"] == sum(b["params"] for b in data["blocks"]) > 0
    assert all(b["fwd_alpha"] is not None for b in data["blocks"])


def test_inspect_times_beside_a_companion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", os.path.join(EXAMPLES, "mlp.py"), "--corun", "1", "--repeats", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # A block without parameters (a ReLU) may time at 0 once the timer's cost is taken off on a loaded machine;
    # never below, and the Linears never at 0.
    assert data["blocks"] and all(b["fwd_time_s"] >= 0 and b["bwd_time_s"] >= 0 for b in data["blocks"])
    assert all(b["fwd_time_s"] > 0 and b["bwd_time_s"] > 0 for b in data["blocks"] if b["params"])


def test_inspect_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", os.path.join(EXAMPLES, "mlp.py"), "--analytic"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "mlp.py" in out


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "does not exist" in err and "\n" not in err
    assert main(["inspect", os.path.join(EXAMPLES, "mlp.py"), "--batch-size", "0"]) == 2
    capsys.readouterr()
    assert main(["inspect", os.path.join(EXAMPLES, "mlp.py"), "--corun", "-1"]) == 2
    assert "--corun must be 0 or more" in capsys.readouterr().err
    # A model that cannot train on one sample (BatchNorm over a 1x1 map): planned with micro-batches of 2 or more.
    capsys.readouterr()
    assert main(["plan", "zoo:vgg11-mnist", "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert all(p["micro_batch_size"] >= 2 for p in [found["plan"], *found["alternatives"]])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "zoo:mlp-tiny", "--threads", "0"], "--threads must be at least 1, got 0"),
        (["inspect", "zoo:mlp-tiny", "--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["inspect", "zoo:mlp-tiny", "--warmup", "-1"], "--warmup must be at least 0, got -1"),
        (["inspect", "zoo:mlp-tiny", "--min-blocks", "0"], "--min-blocks must be at least 1, got 0"),
        (["inspect", "zoo:mlp-tiny", "--min-blocks", "8", "--max-blocks", "4"], "--max-blocks must be at least 8"),
        (["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--top", "0"], "--top must be at least 1"),
        (["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--offload", "auto"], "add --remat auto"),
        (["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "9" * 20], "is too large"),
        (["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--dp", "3000000000"], "--dp 3000000000 is too"),
        (["inspect", "zoo:mlp-tiny", "--threads", "9" * 20], "--threads 99999999999999999999 is too large"),
        (["inspect", "zoo:mlp-tiny", "--repeats", "100000"], "--repeats must be at most 10,000"),
        (["zoo", "mlp-tiny", "--gpus", "9" * 20], "--gpus takes at most 1,048,576 GPUs"),
    ],
)
def test_options_out_of_range_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_console_script_help(capsys: pytest.CaptureFixture[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "pyplan.cli", "nonsense"], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid choice: 'nonsense'" in done.stderr
    with pytest.raises(SystemExit) as exited:
        main(["inspect", "--help"])
    assert exited.value.code == 0 and "examples:" in capsys.readouterr().out


def test_unwritable_outputs_unreadable_plans_and_misspelt_leaves_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = ["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8"]
    not_utf8, deep = tmp_path / "latin1.json", tmp_path / "deep.json"
    not_utf8.write_bytes(b'\xff\xfe{"model": 1}')
    deep.write_text("[" * 200_000 + "]" * 200_000)
    for argv, message in [
        ([*plan, "--out", str(tmp_path / "missing" / "plan.json")], "no such file or directory"),
        ([*plan, "--out", str(tmp_path)], "it is a directory"),
        (["show", str(not_utf8)], "is not UTF-8 text"),
        (["show", str(deep)], "nests its JSON too deeply"),
        (
            [*plan, "--leaf", "Linaer"],
            "leaf module 'Linaer' names no module of the model (by class or by path); close: Linear",
        ),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, err
    assert not any(tmp_path.glob(".*.tmp"))


def test_version_and_written_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip().startswith("pyplan ")
    out = tmp_path / "plan.json"
    argv = ["plan", "zoo:mlp-tiny", "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8", "--out", str(out)]
    assert main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # as open() makes it, not mkstemp's 0600
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.err and json.loads(captured.out)


REAL = os.path.join(os.path.dirname(__file__), "models", "real")


def test_inspect_profiles_a_batch_norm_over_1x1_maps_at_two_samples_or_more(capsys: pytest.CaptureFixture[str]) -> None:
    small_maps = os.path.join(REAL, "small_maps.py")
    quick = ["--warmup", "0", "--repeats", "1"]
    assert main(["inspect", small_maps, "--batch-size", "4", "--json", *quick]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch_size"] == 4 and all(b["fwd_time_s"] is not None for b in data["blocks"])
    # At one sample the last BatchNorm cannot run: one line naming it and the fix, for --analytic too.
    for extra in ([], ["--analytic"]):
        assert main(["inspect", small_maps, "--batch-size", "1", *extra, *quick]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: module '8' (BatchNorm2d) sees one value per channel at --batch-size 1")
        assert err.endswith("inspect it with --batch-size 2 or more") and "\n" not in err


def test_json_and_configs_on_stdout_stay_parsable_when_the_model_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    own_loss = os.path.join(REAL, "own_loss.py")  # prints "number of parameters: ..." when built
    assert main(["inspect", own_loss, "--analytic", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model"] == "own_loss.py" and "number of parameters" in captured.err
    out = tmp_path / "plan.json"
    plan = ["plan", own_loss, "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8", "--pp", "2", "--out", str(out)]
    assert main([*plan, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["plan"]["pp"] == 2 and "number of parameters" in captured.err
    # A pipeline's configuration traces the model again for its split points, its print on stderr: DeepSpeed's
    # configuration cannot hold pipeline stages, so nothing reaches stdout but the refusal's one line on stderr.
    assert main(["emit", str(out), "--format", "deepspeed"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot express" in captured.err.strip().splitlines()[-1]
    one = tmp_path / "one.json"
    assert main([*plan[:-4], "--pp", "1", "--out", str(one)]) == 0
    capsys.readouterr()
    assert main(["emit", str(one), "--format", "deepspeed"]) == 0
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 8


def test_plan_defaults_to_bf16_mixed_on_catalog_gpus_that_have_it(capsys: pytest.CaptureFixture[str]) -> None:
    mlp = os.path.join(EXAMPLES, "mlp.py")
    common = ["--global-batch", "8", "--top", "1"]
    for gpu, want, said in (
        ("a100-80g", "bf16-mixed", "bf16-mixed (default on a100-80g-sxm)"),
        ("v100-16g", "fp32", "fp32 (default: v100-16g has no bf16)"),
    ):
        assert main(["plan", mlp, "--gpus", "2", "--gpu", gpu, *common, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["workload"]["precision"] == want
        assert main(["plan", mlp, "--gpus", "2", "--gpu", gpu, *common]) == 0
        assert said in " ".join(capsys.readouterr().out.split())
    # Said by the user: taken as said, and the title adds nothing.
    assert main(["plan", mlp, "--gpus", "2", "--gpu", "a100-80g", *common, "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["precision"] == "fp32"
