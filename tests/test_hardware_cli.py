"""`pyplan hardware list | show`, called through a parser built the way pyplan/cli/main.py builds its own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pyplan.cli.hardware import add_hardware_parser
from pyplan.cli.main import main
from pyplan.errors import PlanError

TABLE_III_NAMES = [
    "gn6i.xlarge",
    "gn6i.2xlarge",
    "gn7i.2xlarge",
    "gn7i.4xlarge",
    "vgn7i-vws.xlarge",
    "vgn7i-vws.2xlarge",
    "vgn7i-vws.3xlarge",
    "sgn7i.xlarge",
    "sgn7i.2xlarge",
    "sgn7i.4xlarge",
    "gn6v.2xlarge",
    "gn7e.4xlarge",
]


@pytest.fixture(autouse=True)
def _wide_terminal_and_empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables at the terminal width
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pyplan")
    add_hardware_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["hardware", *argv])
    return int(args.func(args))


def test_list_prints_every_part_of_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("list") == 0
    out = capsys.readouterr().out
    for name in ("a100-80g-sxm", "mi300x", "nvlink3", "eth-400g", "gn7e.4xlarge", "Standard_ND96asr_v4"):
        assert name in out
    assert "34.742 CNY" in out and "98.32 USD" in out and "1/12 x a10" in out


def test_list_json_by_kind_and_provider(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("list", "--provider", "alicloud", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["instances"]
    assert [i["name"] for i in data["instances"]] == TABLE_III_NAMES
    assert {i["currency"] for i in data["instances"]} == {"CNY"}
    assert run("list", "--kind", "gpus", "--json") == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert {"name", "memory_bytes", "hbm_bw_bytes_per_s", "peak_flops_per_s", "source"} <= set(gpus[0])


def test_list_errors() -> None:
    with pytest.raises(PlanError, match="--provider selects instances"):
        run("list", "--kind", "gpus", "--provider", "aws")
    with pytest.raises(PlanError, match="unknown provider 'ibm'"):
        run("list", "--provider", "ibm")


def test_show_gpu_instance_and_link(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("show", "A100-80GB", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu"]["name"] == "a100-80g-sxm" and data["gpu"]["peak_flops_per_s"]["bf16"] == 312e12
    assert {"p4de.24xlarge", "gn7e.4xlarge", "Standard_ND96amsr_A100_v4"} <= set(data["instances"])

    assert run("show", "gn7e.4xlarge") == 0
    out = capsys.readouterr().out
    assert "Huang et al., Table III" in out and "34.742 CNY per hour" in out and "GPU a100-80g-sxm" in out

    assert run("show", "nvlink4") == 0
    assert "450 GB/s per GPU, one direction" in capsys.readouterr().out


def test_show_local_says_it_is_not_calibrated(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("show", "local") == 0
    out = capsys.readouterr().out
    assert "GPU local" in out and "link local" in out
    assert "unknown until `pyplan calibrate`" in out


def test_show_unknown_name_lists_the_closest() -> None:
    with pytest.raises(PlanError, match=r"^unknown hardware name 'h100-sx'; closest: h100-sxm"):
        run("show", "h100-sx")


@pytest.mark.parametrize("argv", [["--help"], ["list", "--help"], ["show", "--help"]])
def test_help_has_examples(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(*argv)
    assert exc.value.code == 0
    assert "examples:\n  pyplan hardware" in capsys.readouterr().out


def test_calibrate_out_in_a_missing_directory_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pyplan calibrate --out` checks its file as `pyplan plan --out` does: a missing directory is one line and exit
    2 before anything is measured, and is not made."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured before refusing")

    monkeypatch.setattr("pyplan.cli.calibrate.calibrate", refuse)
    out = tmp_path / "missing" / "local.json"
    assert main(["calibrate", "--quick", "--no-link", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write '{out}': no such file or directory" in err and len(err.strip().splitlines()) == 1
    assert not out.parent.exists()
