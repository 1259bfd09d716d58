"""The accuracy benchmark end to end on a reduced matrix: plan, run under torchrun, measure, analyse, print."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import finite

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "accuracy.py"

# Fixed figures for the `local` GPU and link: the test checks the harness, not the figures (the benchmark itself
# runs `pyplan calibrate` first).
CALIBRATION = {
    "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "tests/test_accuracy.py"},
    "link": {"latency_s": 1.5e-4, "bw_bytes_per_s": 2e9, "source": "tests/test_accuracy.py"},
}


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pyplan_accuracy_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.distributed
def test_accuracy_harness_runs_two_configurations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acc = _benchmark()
    calibration = tmp_path / "local.json"
    calibration.write_text(json.dumps(CALIBRATION))
    wanted = {"vgg-tiny 2x1 1F1B b8x2 remat=none", "vgg-tiny 1x2 GPipe b8x4 remat=none"}
    rows, summary = acc.run(
        [acc.Case("vgg-tiny", 32, (8,))],
        remats=("none",),
        protocol=acc.Protocol(steps=1, warmup=0, quiet_blocks=1, max_rounds=1, wait_s=0.0, launches=1),
        calibration=str(calibration),
        keep=lambda c: c.label in wanted,
    )
    assert {r.config.label for r in rows} == wanted
    _check_report(acc, rows, summary, capsys)


def _check_report(acc: ModuleType, rows: list[Any], summary: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Every field of every row and of the summary filled and finite, and the report printed."""
    for row in rows:
        fields = dataclasses.asdict(row)
        assert finite(fields), fields
        assert row.predicted_s > 0 and row.measured_s > 0 and row.steps == 1
        assert row.predicted_bytes > 0 and row.measured_bytes > 0 and row.measured_activation_bytes > 0
        assert math.isfinite(row.time_error) and math.isfinite(row.memory_error)
        assert len(row.rank_bytes_error) == row.config.pp
        assert row.terms.describe(row.measured_s, row.time_error)
    assert len(summary.decisions) == 2 and 0 <= summary.right_rate <= 1
    assert all(math.isfinite(x) for x in (summary.time_median, summary.time_worst, summary.memory_worst))
    assert len(summary.targets) == 4

    acc.print_report(rows, summary, header="test")
    out = capsys.readouterr().out
    assert "vgg-tiny" in out and "target median |time error|" in out


def test_launches_merge_into_one_result_per_configuration_and_rank() -> None:
    """Steps of two launches one after the other (their median is the row's), medians averaged, memory the most."""
    acc = _benchmark()

    def result(steps: list[float], quiet: list[bool], wait: float, forward: float, peak: int) -> dict:
        stage = {f: 0.0 for f in acc._FIELDS} | {"forward_s": forward}
        return {
            "step_s": steps,
            "quiet": quiet,
            "optimizer_s": 1e-3,
            "outside_s": 2e-3,
            "wait_s": wait,
            "finish_s": 0.0,
            "stages": {"0": stage},
            "other_cores": [0.0] * (len(steps) // 2),
            "peak_bytes": peak,
            "param_bytes": 10,
            "grad_bytes": 10,
            "optimizer_state_bytes": 20,
        }

    first = [[result([0.030, 0.032], [True, True], 1e-3, 0.010, 100)]]
    second = [[result([0.040, 0.036], [True, False], 3e-3, 0.014, 100)]]
    (merged,) = acc.merge_launches([first, second])
    (rank,) = merged
    assert rank["step_s"] == [0.030, 0.032, 0.040, 0.036] and rank["quiet"] == [True, True, True, False]
    assert rank["other_cores"] == [0.0, 0.0]
    assert rank["wait_s"] == pytest.approx(2e-3) and rank["stages"]["0"]["forward_s"] == pytest.approx(0.012)
    assert rank["peak_bytes"] == 100 and rank["optimizer_s"] == pytest.approx(1e-3)
    assert acc.merge_launches([first]) == [[first[0][0]]]
    with pytest.raises(ValueError, match="no launch"):
        acc.merge_launches([])
