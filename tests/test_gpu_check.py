"""benchmarks/gpu_check.py's dry run: every GPU check's code path on the CPU with tiny models, one JSON per check."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import finite

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.distributed
def test_every_check_runs_on_the_cpu_and_writes_its_result(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--device", "cpu", "--budget-s", "400"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(results) == {"env", "calibrate", "gpu_tests", "profile", "accuracy", "llm"}, done.stdout + done.stderr
    failed = {k: v for k, v in results.items() if v["status"] != "ok"}
    assert not failed, json.dumps(failed, indent=1)[-4000:]
    assert done.returncode == 0, done.stdout[-3000:]
    assert results["env"]["pyplan"] and results["env"]["copy"]["bytes_per_s"] > 0
    assert len(results["env"]["head"]) == 6 and all(r["flops_per_s"] > 0 for r in results["env"]["head"])
    assert results["calibrate"]["calibration"]["gpu"]["peak_flops_per_s"]["fp32"] > 0
    assert results["gpu_tests"]["counts"]["skipped"] >= 1  # the gpu tests, collected and skipped without a GPU
    profile = results["profile"]
    assert [(m["model"], m["dtype"]) for m in profile["models"]] == [
        ("gpt-tiny", "float32"),
        ("resnet-tiny", "float32"),
        ("gpt-tiny", "bfloat16"),
    ]
    for model in profile["models"]:
        assert set(model["compare"]) == {"catalog", "local"}
        for compare in model["compare"].values():
            assert compare["whole_step"] > 0 and compare["blocks"]["weighted_median"] > 0
        # A cheap block may time at 0 once the timer's cost is taken off (seen on a loaded machine); the model not.
        assert all(b["measured_fwd_s"] >= 0 and b["measured_bwd_s"] >= 0 for b in model["blocks"])
        assert sum(b["measured_fwd_s"] + b["measured_bwd_s"] for b in model["blocks"]) > 0
    assert profile["inspect"]["rc"] == 0 and profile["inspect"]["fwd_time_s"] > 0
    # The one-device matrix (benchmarks/accuracy.py --matrices one-cpu: remat and micro-batch/GA choices, each
    # planned and run in a process of its own): every row and the summary filled and finite.
    report = results["accuracy"]["runs"]["vgg-tiny"]["report"]
    assert {(r["config"]["remat"], r["config"]["pp"]) for r in report["rows"]} == {("none", 1), ("full", 1)}
    for row in report["rows"]:
        assert finite(row), row
        assert row["predicted_s"] > 0 and row["measured_s"] > 0 and row["steps"] == 1
        assert row["predicted_bytes"] > 0 and row["measured_bytes"] > 0 and row["measured_activation_bytes"] > 0
        assert len(row["rank_bytes_error"]) == 1
    summary = report["summary"]
    assert summary["decisions"] and len(summary["targets"]) == 4
    assert all(finite(summary[k]) for k in ("time_median", "time_worst", "memory_median", "memory_worst"))
    # The language models planned for the catalog entry in 16-bit precisions, each plan trained as planned.
    llm = results["llm"]
    assert [(m["model"], m["precision"]) for m in llm["models"]] == [
        ("gpt-tiny", "bf16-master"),
        ("gpt-tiny", "bf16-mixed"),
    ]
    for model in llm["models"]:
        assert {(r["remat"], r["micro_batch_size"]) for r in model["rows"]} == {
            (remat, b) for remat in ("none", "full") for b in (4, 8)
        }
        for row in model["rows"]:
            assert row["status"] == "measured", row
            assert row["predicted_s"] > 0 and row["measured_s"] > 0 and row["predicted_bytes"] > 0
            assert all(math.isfinite(v) for v in row["losses"]), row
    # The table the script prints last names every check.
    assert all(check in done.stdout for check in results)
    # Priced again from the stored result (as after a change to the model, with no GPU): the same figures.
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
    try:
        spec.loader.exec_module(gpu_check)
    finally:
        del sys.modules["gpu_check"]
    rows = gpu_check.reprice(tmp_path / "profile.json", tmp_path / "calibrate.json")
    assert [r["roofline"] for r in rows] == ["catalog", "local"] * 3
    for r in rows:
        assert r["whole_step"] == pytest.approx(r["recorded"], rel=1e-9), r
