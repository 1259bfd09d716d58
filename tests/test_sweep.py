"""Batch planning: `pyplan zoo NAMES --gpus ...` and `pyplan.plan_many` give what `pyplan plan` gives per pair,
write their records as they go, and resume an interrupted sweep to the same file."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pyplan
from pyplan import Cluster, Workload, zoo
from pyplan.cli.main import main
from pyplan.profile.cache import ProfileCache
from pyplan.sweep import COLUMN_NAMES, ResultsFile
from tests.conftest import ROOT

# The three smallest zoo models, on two clusters.
MODELS = ("mlp-tiny", "vgg-tiny", "gpt-tiny")
SIZES = (8, 64)
SWEEP = [*MODELS, "--gpus", ",".join(map(str, SIZES)), "--gpu", "a100-80g", "--global-batch", "16", "--jobs", "1"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> str:
    """The CSV of a sweep that ran through."""
    out = tmp_path_factory.mktemp("sweep") / "results.csv"
    assert main(["zoo", *SWEEP, "--out", str(out), "--cache-dir", str(cache_dir)]) == 0
    return out.read_text()


def rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(text.splitlines()))


def test_each_row_is_what_pyplan_plan_gives(reference: str, capsys: pytest.CaptureFixture[str]) -> None:
    table = rows(reference)
    assert [(r["model"], r["gpus"]) for r in table] == [(m, str(n)) for m in MODELS for n in SIZES]
    assert tuple(table[0]) == COLUMN_NAMES
    capsys.readouterr()
    for r in table:
        assert r["status"] == "ok" and r["cluster"] == f"{r['gpus']} x a100-80g-sxm"
        argv = ["plan", f"zoo:{r['model']}", "--gpus", r["gpus"], "--gpu", "a100-80g", "--global-batch", "16"]
        assert main([*argv, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)["plan"]
        for key in ("dp", "pp", "micro_batch_size", "num_microbatches", "schedule", "zero_stage", "placement"):
            assert r[key] == str(plan[key]), key
        for key in ("iteration_s", "samples_per_s", "peak_memory_bytes", "bubble_fraction"):
            assert float(r[key]) == plan["predicted"][key], key
        assert r["gpus_used"] == str(plan["dp"] * plan["pp"])
        assert r["num_microbatches"] == str(16 // (plan["dp"] * plan["micro_batch_size"]))


def test_a_killed_sweep_resumes_to_the_same_file(tmp_path: Path, reference: str) -> None:
    out = tmp_path / "results.csv"
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "pyplan.cli", "zoo", *SWEEP, "--out", str(out), "--no-cache"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        # Killed once the first model's rows are in: the later models are still being profiled (no cache).
        while not (out.exists() and len(out.read_text().splitlines()) > 1) and time.monotonic() < deadline:
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    partial = out.read_text()
    assert 1 < len(partial.splitlines()) < 1 + len(MODELS) * len(SIZES)
    assert partial.startswith(reference.splitlines()[0] + "\n")
    # As if the kill had come in the middle of writing a line.
    out.write_text(partial + reference.splitlines()[-1][:25])
    assert ResultsFile(out).read() and len(ResultsFile(out).read()) == len(partial.splitlines()) - 1

    assert main(["zoo", *SWEEP, "--out", str(out), "--no-cache", "--resume"]) == 0
    assert out.read_text() == reference


def test_resume_of_a_finished_sweep_plans_nothing(
    tmp_path: Path, reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "results.csv"
    out.write_text(reference)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned a pair that was in the file")

    monkeypatch.setattr("pyplan.sweep.chain_for", refuse)
    assert main(["zoo", *SWEEP, "--out", str(out), "--no-cache", "--resume"]) == 0
    assert out.read_text() == reference


def test_an_existing_out_is_never_replaced_without_resume(
    tmp_path: Path, reference: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun to a finished sweep's file without --resume is refused before anything is planned or written."""
    out = tmp_path / "results.csv"
    out.write_text(reference)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned before refusing")

    monkeypatch.setattr("pyplan.sweep.chain_for", refuse)
    assert main(["zoo", *SWEEP, "--out", str(out), "--no-cache"]) == 2
    assert "holds the results of an earlier sweep: --resume continues it" in capsys.readouterr().err
    assert out.read_text() == reference


def test_json_records_and_the_summary(
    tmp_path: Path, reference: str, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    assert main(["zoo", *SWEEP, "--out", str(out), "--cache-dir", str(cache_dir), "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed == json.loads(out.read_text())
    assert [str(r["iteration_s"]) for r in printed] == [r["iteration_s"] for r in rows(reference)]
    assert f"profiles: {len(MODELS)} from the cache" in captured.err

    assert main(["zoo", *SWEEP, "--cache-dir", str(cache_dir)]) == 0
    table = capsys.readouterr().out
    assert "Best plan per pair" in table and all(m in table for m in MODELS)


def test_pairs_without_a_plan_say_why(tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 6,922 parameters with AdamW state (16 bytes each, 55 kB a GPU under ZeRO-3) do not fit in 10 kB.
    cluster = tmp_path / "tiny.json"
    gpu = {"name": "tiny", "memory_bytes": 10_000, "hbm_bw_bytes_per_s": 1e12, "peak_flops_per_s": {"fp32": 1e13}}
    cluster.write_text(json.dumps({"gpu": gpu, "gpus": 2}))
    small = Cluster.from_file(cluster)
    records = pyplan.plan_many(["mlp-tiny"], [small], Workload(global_batch=16))
    (record,) = records
    assert record["status"] == "infeasible" and record["dp"] is None
    assert record["message"].startswith("no plan fits") and "\n" not in record["message"]


def test_bad_input_exits_2_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "gpt2-xxl", "--gpus", "8"]) == 2
    assert "did you mean: gpt2-xl" in capsys.readouterr().err
    assert main(["zoo", "gpt-tiny", "--gpus", "8", "--gpu", "z100"]) == 2
    assert "unknown GPU 'z100'" in capsys.readouterr().err
    assert main(["zoo", "gpt-tiny", "--gpus", "8,x"]) == 2
    assert main(["zoo", "gpt-tiny"]) == 2
    assert main(["zoo", "--gpus", "8"]) == 2
    assert main(["zoo", "gpt-tiny", "--gpus", "8", "--resume"]) == 2
    assert main(["zoo", "gpt-tiny", "--gpus", "8", "--out", str(tmp_path / "r.txt")]) == 2
    assert main(["zoo", "list", "gpt-tiny", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 6 and "zoo list` takes names and --json only" in err


def test_zoo_list_still_lists(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["zoo", "list", "gpt-tiny", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["name"] == "gpt-tiny" and entry["params"] == 118_528


def test_parquet_needs_pyarrow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert main(["zoo", "gpt-tiny", "--gpus", "8", "--out", str(tmp_path / "r.parquet")]) == 2
        assert "pip install pyarrow" in capsys.readouterr().err
    else:
        assert main(["zoo", "mlp-tiny", "--gpus", "8", "--jobs", "1", "--out", str(tmp_path / "r.parquet")]) == 0
        (record,) = ResultsFile(tmp_path / "r.parquet").read()
        assert record["model"] == "mlp-tiny" and record["status"] == "ok"


def test_plan_many_in_worker_processes(cache_dir: Path, reference: str) -> None:
    """Zoo names and (module, inputs) pairs, a workload per model, two processes; the same records as the CLI's."""
    spec = zoo.get("gpt-tiny")
    with torch.device("meta"):
        module = spec.build()
    clusters = [Cluster.from_catalog("a100-80g", n) for n in SIZES]
    # bf16-mixed: the CLI's default on A100s, which the reference sweep took.
    workloads = {
        "mlp-tiny": Workload(global_batch=16, precision="bf16-mixed"),
        "vgg-tiny": Workload(16, precision="bf16-mixed"),
        "GPT": Workload(global_batch=8, precision="bf16-mixed"),
    }
    records = pyplan.plan_many(
        ["mlp-tiny", "zoo:vgg-tiny", (module, spec.example_inputs)],
        clusters,
        workloads,
        jobs=2,
        cache=ProfileCache(cache_dir),
    )
    assert [(r["model"], r["gpus"], r["global_batch"]) for r in records] == [
        (m, n, 8 if m == "GPT" else 16) for m in ("mlp-tiny", "vgg-tiny", "GPT") for n in SIZES
    ]
    expected = rows(reference)
    for got, want in zip(records[:4], expected[:4]):
        assert {k: "" if v is None else str(v) for k, v in got.items()} == want


def test_plan_many_as_a_data_frame() -> None:
    pytest.importorskip("pandas")
    frame = pyplan.plan_many(["mlp-tiny"], {"eight": Cluster.from_catalog("a100-80g", 8)}, Workload(16), as_frame=True)
    assert list(frame.columns) == list(COLUMN_NAMES) and frame.loc[0, "cluster"] == "eight"


def test_internal_errors_exit_1_and_are_tried_again(
    tmp_path: Path, reference: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "results.csv"
    with monkeypatch.context() as patch:
        patch.setattr("pyplan.sweep.search", lambda *args, **kwargs: 1 / 0)
        assert main(["zoo", *SWEEP, "--out", str(out), "--cache-dir", str(cache_dir)]) == 1
    failed = rows(out.read_text())
    assert {(r["status"], r["message"]) for r in failed} == {("failed", "ZeroDivisionError: division by zero")}
    assert main(["zoo", *SWEEP, "--out", str(out), "--cache-dir", str(cache_dir), "--resume"]) == 0
    assert out.read_text() == reference


def test_resume_refuses_another_sweep(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume keeps the records of the same sweep only: another one's file is refused in one line naming what
    differs (models, a cluster's figures, the workload, the options), before anything is planned or written; the
    sweep is read from the file beside the records, else from the records themselves."""
    out = tmp_path / "results.csv"
    one = ["--gpus", "8", "--gpu", "a100-80g", "--global-batch", "16", "--jobs", "1", "--out", str(out)]
    assert main(["zoo", "mlp-tiny", *one, "--cache-dir", str(cache_dir)]) == 0
    written = out.read_text()
    sidecar = tmp_path / "results.csv.sweep.json"
    assert json.loads(sidecar.read_text())["sweep"]["models"] == {"mlp-tiny": "zoo:mlp-tiny"}
    capsys.readouterr()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned before refusing")

    monkeypatch.setattr("pyplan.sweep.chain_for", refuse)
    cases = {
        ("vgg-tiny",): "(models: mlp-tiny only in the file; vgg-tiny only in this command)",
        ("mlp-tiny", "--global-batch", "32"): "(workload of 'mlp-tiny' global_batch: 16 in the file, 32 in this",
        # The same label, "8 x a100-80g-sxm", for 8 GPUs on 2 nodes of 4.
        ("mlp-tiny", "--gpus-per-node", "4"): "(cluster '8 x a100-80g-sxm' groups[0].nodes: 1 in the file, 2 in",
        ("mlp-tiny", "--memory-fraction", "0.5"): "(memory_fraction: 0.9 in the file, 0.5 in this command)",
    }
    for argv, message in cases.items():
        assert main(["zoo", *argv[:1], *one, *argv[1:], "--no-cache", "--resume"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --resume: {out} holds another sweep") or f"--resume: {out} holds" in err
        assert message in err and len(err.splitlines()) == 1, err
        assert err.endswith("rerun the command that wrote it, or choose another --out")
        assert out.read_text() == written

    # A file written without the sweep beside it (an older pyplan): its records are checked one by one.
    sidecar.unlink()
    for argv, message in {
        ("vgg-tiny",): "(models: mlp-tiny only in the file)",
        ("mlp-tiny", "--gpus-per-node", "4"): "(gpus_per_node of mlp-tiny on '8 x a100-80g-sxm': 8 in the file, 4 in",
        ("mlp-tiny", "--global-batch", "32"): "(global_batch of mlp-tiny on '8 x a100-80g-sxm': 16 in the file, 32 in",
    }.items():
        assert main(["zoo", *argv[:1], *one, *argv[1:], "--no-cache", "--resume"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert out.read_text() == written
    sidecar.write_text("{")
    assert main(["zoo", "mlp-tiny", *one, "--no-cache", "--resume"]) == 2
    assert f"{sidecar} (the sweep that wrote {out}) cannot be read; delete it" in capsys.readouterr().err

    # The same sweep resumes: nothing left to plan, the same file, and the sweep written beside it again.
    sidecar.unlink()
    assert main(["zoo", "mlp-tiny", *one, "--no-cache", "--resume"]) == 0
    assert out.read_text() == written and json.loads(sidecar.read_text())["format"] == 1


def test_bad_outputs_and_empty_lists_exit_2_before_planning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out in a missing directory is refused (never made), as `pyplan plan --out` refuses it; a --gpus, --gpu or
    --instance that names nothing plans nothing and says so; a --cache-dir that cannot hold the cache is refused
    rather than silently off."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned before refusing")

    monkeypatch.setattr("pyplan.sweep.chain_for", refuse)
    a_file = tmp_path / "profiles.txt"
    a_file.write_text("not a directory")
    base = ["zoo", "mlp-tiny", "--jobs", "1", "--no-cache"]
    cases = {
        ("--gpus", "8", "--out", str(tmp_path / "missing" / "r.csv")): "no such file or directory",
        ("--gpus", ","): "--gpus ',' names no cluster size; give sizes in GPUs, e.g. --gpus 8,16,64",
        ("--gpus", "8", "--gpu", ","): "--gpu ',' names nothing; give catalog names, e.g. --gpu a100-80g",
        ("--gpus", "8", "--instance", " , "): "--instance ' , ' names nothing",
    }
    for argv, message in cases.items():
        assert main([*base, *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "missing").exists()

    with_cache = ["zoo", "mlp-tiny", "--jobs", "1", "--gpus", "8", "--cache-dir"]
    for directory, message in (
        (a_file, f"--cache-dir {a_file}: it is a file, not a directory; give a directory (made if missing)"),
        (a_file / "sub", f"--cache-dir {a_file / 'sub'}: '{a_file}' is a file, so the directory cannot be made"),
    ):
        assert main([*with_cache, str(directory)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
