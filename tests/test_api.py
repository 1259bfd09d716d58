"""pyplan.plan / search on catalog clusters, plan.json round trips, and the errors of bad input."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest
import torch

from pyplan import InfeasibleError, PlanError, load_model
from pyplan.api import chain_for, search
from pyplan.cli.main import main
from pyplan.emit.planfile import PlanFile, read_plan_file, write_plan_file
from pyplan.hardware import Cluster
from pyplan.plan import Layout, Plan, Workload
from pyplan.planner import TIE
from pyplan.runtime.units import gathered_bytes, remat_kind
from pyplan.solve.state import stage_state_bytes
from pyplan.units import fmt_bytes
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def gpt_tiny() -> tuple:
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 16, gpus_per_node=8, price_per_gpu_hour=2.0, currency="USD")
    workload = Workload(global_batch=32)
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload)
    return spec, model, cluster, workload, chain


def test_search_returns_consistent_plans(gpt_tiny: tuple) -> None:
    spec, model, cluster, workload, chain = gpt_tiny
    result = search(model, spec.example_inputs, cluster, workload, chain=chain, top_k=4)
    plans = [result.best, *result.alternatives]
    assert len(plans) == 4
    for p in plans:
        assert p.layout.global_batch == workload.global_batch
        assert p.layout.num_gpus <= cluster.gpus
        assert len(p.stages) == p.layout.num_stages == len(p.layout.cut_positions) - 1
        assert p.predicted.iteration_s > 0 and p.predicted.currency == "USD"
        assert p.predicted.samples_per_s == pytest.approx(32 / p.predicted.iteration_s)
        assert p.predicted.peak_memory_bytes <= cluster.gpu.memory_bytes * 0.9
    times = [p.predicted.iteration_s for p in plans]
    # Increasing, but for ties (within TIE of each other: gpt-tiny is the host's pace at these micro-batches),
    # which go to fewer GPUs.
    assert all(later >= earlier / (1 + TIE) for earlier, later in itertools.pairwise(times))
    # The frontier is sorted by time, and its cheapest point is no costlier than the fastest plan.
    frontier = [(p.predicted.iteration_s, p.predicted.cost_per_iteration) for p in result.pareto]
    assert frontier == sorted(frontier)
    assert frontier[-1][1] <= result.best.predicted.cost_per_iteration


def test_pins_restrict_the_search_to_what_they_name(gpt_tiny: tuple) -> None:
    """Pinned dp, pp, GA (and micro-batch, schedule, ZeRO stage): every plan has them, and the best pinned plan is
    the best of the unpinned search's plans that have them (the same figures), never faster than the best."""
    spec, model, cluster, workload, chain = gpt_tiny
    everything = search(model, spec.example_inputs, cluster, workload, chain=chain, top_k=1000)  # every one
    plans = [everything.best, *everything.alternatives]
    for pins in (
        dict(data_parallel=(4,)),
        dict(pipeline_ranks=(2,), num_microbatches=(4,)),
        dict(data_parallel=(2,), pipeline_ranks=(4,), micro_batch_sizes=(2,), schedules=("1F1B",), zero_stages=(1,)),
    ):
        found = search(model, spec.example_inputs, cluster, workload, chain=chain, top_k=3, **pins)
        wanted = {
            "dp": pins.get("data_parallel"),
            "pp": pins.get("pipeline_ranks"),
            "num_microbatches": pins.get("num_microbatches"),
            "micro_batch_size": pins.get("micro_batch_sizes"),
            "schedule": pins.get("schedules"),
            "zero_stage": pins.get("zero_stages"),
        }

        def matches(p: Plan, wanted: dict = wanted) -> bool:
            return all(v is None or getattr(p.layout, k) in v for k, v in wanted.items())

        assert all(matches(p) for p in (found.best, *found.alternatives)), pins
        same = min((p for p in plans if matches(p)), key=lambda p: p.predicted.iteration_s)
        assert found.best.predicted.iteration_s == pytest.approx(same.predicted.iteration_s, rel=TIE), pins
    # A pinned partition: stages start at blocks 4 and 9, whatever the search would choose.
    positions = (0, chain.cuts[4].position, chain.cuts[9].position, chain.cuts[-1].position)
    found = search(model, spec.example_inputs, cluster, workload, chain=chain, top_k=3, stage_cuts=(4, 9))
    assert all(p.layout.cut_positions == positions for p in (found.best, *found.alternatives))
    assert found.best.predicted.iteration_s >= everything.best.predicted.iteration_s
    for cuts, message in (((9, 4), "stage_cuts must rise"), ((4, 99), "go past the model's"), ((0,), "at least 1")):
        with pytest.raises(PlanError, match=message):
            search(model, spec.example_inputs, cluster, workload, chain=chain, stage_cuts=cuts)
        assert found.best.predicted.iteration_s >= everything.best.predicted.iteration_s
    with pytest.raises(PlanError, match="pipeline_ranks takes whole numbers"):
        search(model, spec.example_inputs, cluster, workload, chain=chain, pipeline_ranks=(0,))
    with pytest.raises(PlanError, match="no data-parallel degree of the pinned 5"):
        search(model, spec.example_inputs, cluster, workload, chain=chain, data_parallel=(5,), allow_fewer_gpus=False)


def test_progress_names_each_step(gpt_tiny: tuple) -> None:
    spec, model, cluster, workload, _ = gpt_tiny
    steps: list[str] = []
    search(model, spec.example_inputs, cluster, workload, progress=steps.append)
    assert steps[:3] == ["tracing and profiling", "searching", "refining"]


def test_cost_objective_prefers_fewer_gpus(gpt_tiny: tuple) -> None:
    spec, model, cluster, workload, chain = gpt_tiny
    fast = search(model, spec.example_inputs, cluster, workload, chain=chain).best
    cheap = search(model, spec.example_inputs, cluster, workload, chain=chain, objective="cost").best
    assert cheap.predicted.cost_per_iteration <= fast.predicted.cost_per_iteration
    assert cheap.predicted.iteration_s >= fast.predicted.iteration_s


def test_plan_file_round_trip(gpt_tiny: tuple, tmp_path: Path) -> None:
    spec, model, cluster, workload, chain = gpt_tiny
    best = search(model, spec.example_inputs, cluster, workload, chain=chain).best
    path = tmp_path / "plan.json"
    write_plan_file(path, PlanFile("zoo:gpt-tiny", workload, cluster, best))
    back = read_plan_file(path)
    assert back.plan == best and back.workload == workload and back.model == "zoo:gpt-tiny"
    assert Plan.from_json(json.loads(json.dumps(best.to_json()))) == best


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema_version=99), "unknown schema_version 99"),
        (lambda d: d.pop("workload"), "missing field 'workload'"),
        (lambda d: d["plan"].update(dp=0), "must be positive"),
        (lambda d: d["plan"].update(speed=1), "unknown field 'speed'"),
        (lambda d: d["workload"].update(global_batch=0), "global batch must be a positive"),
        (lambda d: d["plan"]["predicted"].update(iteration_s=float("inf")), "'plan.predicted.iteration_s' is inf"),
        (lambda d: d["plan"]["stages"][0].update(memory_bytes=float("nan")), r"'plan.stages\[0\].memory_bytes' is nan"),
    ],
)
def test_malformed_plan_files(gpt_tiny: tuple, tmp_path: Path, edit: object, message: str) -> None:
    spec, model, cluster, workload, chain = gpt_tiny
    best = search(model, spec.example_inputs, cluster, workload, chain=chain).best
    data = PlanFile("zoo:gpt-tiny", workload, cluster, best).to_json()
    edit(data)  # type: ignore[operator]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        read_plan_file(path)
    path.write_text("{not json")
    with pytest.raises(PlanError, match="is not JSON"):
        read_plan_file(path)


def test_bad_search_input(gpt_tiny: tuple) -> None:
    spec, model, cluster, workload, chain = gpt_tiny
    with pytest.raises(PlanError, match="unknown objective 'fastest'"):
        search(model, spec.example_inputs, cluster, workload, chain=chain, objective="fastest")
    with pytest.raises(PlanError, match="global batch"):
        search(model, spec.example_inputs, cluster, Workload(global_batch=6), chain=chain, micro_batch_sizes=[4])


def test_a_model_that_fits_nowhere_says_what_it_needs() -> None:
    spec = load_model("zoo:llama-7b-style")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("t4", 1)
    with pytest.raises(InfeasibleError, match=r"no plan fits: .* needs .*GiB.* the GPU has"):
        search(model, spec.example_inputs, cluster, Workload(global_batch=1))


def test_a_plan_that_overflows_with_its_working_memory_says_what_admits_it(gpt_tiny: tuple) -> None:
    """One configuration pinned, and each GPU planned for a little less than its replayed peak: the search's count of
    the saved activations admits it and the stages' working memory does not. The message names what it needs and
    the memory fraction that admits it, and that fraction does."""
    spec, model, cluster, workload, chain = gpt_tiny
    pins = dict(data_parallel=[2], pipeline_ranks=[2], num_microbatches=[4], micro_batch_sizes=[4], zero_stages=[0],
                schedules=["1F1B"], placements=["pp-inner"], stage_dag=False)  # fmt: skip
    fits = search(model, spec.example_inputs, cluster, workload, chain=chain, memory_fraction=1.0, **pins).best
    need, whole = fits.predicted.peak_memory_bytes, float(cluster.gpu.memory_bytes)
    short = need * 0.999 / whole
    with pytest.raises(InfeasibleError) as info:
        search(model, spec.example_inputs, cluster, workload, chain=chain, memory_fraction=short, **pins)
    message = str(info.value)
    assert message.startswith(f"no plan fits in the {fmt_bytes(whole * short)} planned for on each {cluster.gpu.name}")
    assert f"(dp=2 pp=2 b=4 GA=4 ZeRO-0) needs {fmt_bytes(need)}" in message
    admits = math.ceil(need / whole * 100) / 100
    assert message.endswith(f"--memory-fraction {admits:.2f} admits it")
    again = search(model, spec.example_inputs, cluster, workload, chain=chain, memory_fraction=admits, **pins).best
    assert again.predicted.peak_memory_bytes == pytest.approx(need)


def test_cli_pins(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "zoo:gpt-tiny", "--gpus", "4", "--gpu", "a100-80g", "--global-batch", "32"]
    assert main([*base, "--pp", "2", "--schedule", "1F1B", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["pp"] == 2 and data["plan"]["schedule"] == "1F1B"
    assert data["pins"] == {"pipeline_ranks": [2], "schedules": ["1F1B"]}
    assert data["without_pins"]["predicted"]["iteration_s"] <= data["plan"]["predicted"]["iteration_s"]
    assert main([*base, "--pp", "2"]) == 0
    assert "without the pins the best plan is" in capsys.readouterr().out
    assert main([*base, "--dp", "3", "--pp", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --dp 3 x --pp 2 needs 6 GPUs; --gpus offers 4"
    assert main([*base, "--ga", "0"]) == 2
    assert "--ga takes a whole number of at least 1" in capsys.readouterr().err
    assert main([*base, "--cuts", "4,9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pins"] == {"stage_cuts": [4, 9]} and data["plan"]["pp"] * data["plan"]["stages_per_rank"] == 3
    assert main([*base, "--cuts", "4;9"]) == 2
    assert "--cuts takes block numbers separated by commas" in capsys.readouterr().err


def test_the_answer_does_not_depend_on_what_is_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The chosen plan is the same with and without every output option, and with --remat auto where nothing
    needs recomputing."""
    base = ["plan", "zoo:gpt-tiny", "--gpus", "8", "--gpu", "a100-80g", "--global-batch", "32"]
    assert main([*base, "--pareto", str(tmp_path / "p.svg")]) == 2  # no price: refused before the search
    assert "the cluster has no price" in capsys.readouterr().err
    base += ["--price-per-gpu-hour", "2", "--currency", "USD"]

    def chosen(*extra: str) -> dict:
        assert main([*base, *extra]) == 0
        out = capsys.readouterr().out
        plan = read_plan_file(tmp_path / "plan.json").plan.to_json()
        if "--json" in extra:
            assert json.loads(out)["plan"] == plan
        return plan

    first = chosen("--out", str(tmp_path / "plan.json"))
    for extra in (
        ("--json",),
        ("--top", "12"),
        ("--top", "1"),
        ("--pareto", str(tmp_path / "p.svg")),  # --report ranks the same wider search
        ("--emit", str(tmp_path / "train.py")),
        ("--remat", "auto"),
    ):
        assert chosen("--out", str(tmp_path / "plan.json"), *extra) == first, extra


def test_cli_cluster_file_takes_no_gpu_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"gpu": "a100-80g", "gpus": 4}))
    argv = ["plan", "zoo:gpt-tiny", "--cluster", str(cluster), "--global-batch", "8", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["dp"] * plan["pp"] <= 4
    assert main([*argv, "--gpus", "2"]) == 2  # never silently ignored
    assert "--cluster describes the whole cluster; drop --gpus" in capsys.readouterr().err


def test_cli_plan_json_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "zoo:gpt-tiny",
            "--gpus",
            "4",
            "--gpu",
            "a100-80g",
            "--global-batch",
            "8",
            "--json",
            "--top",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert {"plan", "alternatives", "pareto"} <= data.keys()
    keys = {"dp", "pp", "micro_batch_size", "num_microbatches", "schedule", "zero_stage", "stages", "predicted"}
    assert keys <= data["plan"].keys()
    assert {"first_block", "last_block", "memory_bytes", "time_s"} <= data["plan"]["stages"][0].keys()
    assert {"iteration_s", "samples_per_s", "peak_memory_bytes", "bubble_fraction", "cost_per_iteration"} <= (
        data["plan"]["predicted"].keys()
    )
    assert read_plan_file(out).plan.to_json() == data["plan"]
    # A model file is kept by its absolute path, so the plan and its script run from any directory.
    relative = os.path.relpath(os.path.join(EXAMPLES, "mlp.py"))
    assert main(["plan", relative, "--gpus", "2", "--gpu", "a100-80g", "--global-batch", "8", "--out",
                 str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    assert read_plan_file(out).model == os.path.join(EXAMPLES, "mlp.py")
    for argv, text in [
        (["--gpus", "0", "--gpu", "a100-80g"], "--gpus must be a number of GPUs from 1"),
        (["--gpus", str(2**70), "--gpu", "a100-80g"], "--gpus must be a number of GPUs from 1 to 1,048,576"),
        (["--gpus", "2", "--gpu", "a100-80"], "closest"),
        (["--gpus", "2", "--gpu", "a100-80g", "--objective", "fastest"], "unknown objective"),
        (["--gpus", "2", "--gpu", "a100-80g", "--objective", "cost"], "no price"),
    ]:
        assert main(["plan", "zoo:gpt-tiny", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and text in err and "\n" not in err, err


def test_a_batchnorm_model_is_planned_from_two_samples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vgg11-mnist's BatchNorm sees one value per channel on one sample: profiled from 2, planned from 2, the
    least micro-batch kept by the profile cache; asking for micro-batches of 1 only is a one-line error."""
    from pyplan.profile.cache import ProfileCache

    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    spec = load_model("zoo:vgg11-mnist")
    with torch.device("meta"):
        model = spec.build()
    cluster, workload = Cluster.from_catalog("a100-80g", 2), Workload(global_batch=8)
    chain, _ = chain_for(model, spec.example_inputs, cluster, workload, cache=ProfileCache())
    assert chain.min_micro_batch == 2
    again, _ = chain_for(model, spec.example_inputs, cluster, workload, cache=ProfileCache())
    assert again.min_micro_batch == 2 and again.memory == chain.memory
    found = search(model, spec.example_inputs, cluster, workload, chain=chain, top_k=50)
    assert {p.layout.micro_batch_size for p in (found.best, *found.alternatives)} >= {2} and all(
        p.layout.micro_batch_size >= 2 for p in (found.best, *found.alternatives)
    )
    with pytest.raises(PlanError, match="micro-batches of 2 samples or more") as info:
        search(model, spec.example_inputs, cluster, workload, chain=chain, micro_batch_sizes=[1])
    assert "\n" not in str(info.value)


def test_predictions_within_a_tenth_of_a_percent_rank_by_memory() -> None:
    from pyplan.planner import rank_ties

    # (name, predicted seconds, memory): a, b and d are within 0.1 % of d, the fastest; c is not.
    items = [("a", 1.0, 30), ("b", 1.0005, 10), ("c", 1.002, 0), ("d", 0.9996, 20)]
    got = rank_ties(items, lambda it: it[1], lambda it: (it[2],))
    assert [it[0] for it in got] == ["b", "d", "a", "c"]
    # Equal memory: the faster first.
    same = [("x", 1.0004, 5), ("y", 1.0, 5)]
    assert [it[0] for it in rank_ties(same, lambda it: it[1], lambda it: (it[2],))] == ["y", "x"]


def test_zero2_is_not_offered_and_zero3_only_without_pipeline_stages() -> None:
    """ZeRO-2 would run as ZeRO-1: one line. ZeRO-3 plans have one stage and no block rematerialization (the runtime
    shards the model's own modules), and hold their gathered units beside the shards."""
    spec = load_model("zoo:gpt-tiny")
    cluster, workload = Cluster.from_catalog("a100-80g", 4), Workload(global_batch=8)
    with pytest.raises(PlanError, match="ZeRO-2 is not offered"):
        search(spec.build(), spec.example_inputs, cluster, workload, zero_stages=(0, 2))
    found = search(spec.build(), spec.example_inputs, cluster, workload, zero_stages=(3,), top_k=50, remat="auto")
    plans = (found.best, *found.alternatives, *found.pareto)
    sharded = [p for p in plans if p.layout.zero_stage == 3]
    assert sharded and all(p.layout.num_stages == 1 and p.layout.dp > 1 for p in sharded)
    assert all(remat_kind(p.layout) != "other" for p in sharded)
    model = spec.build()
    units = gathered_bytes(model, 4.0, 4.0)
    assert units > 0
    # Rows of every tensor on the fullest replica, and Adam's step counters (pyplan/solve/state.py).
    state = stage_state_bytes([tuple(p.shape) for p in model.parameters()], Workload(global_batch=8), 4, 3)
    four = [p for p in sharded if p.layout.dp == 4]
    assert four and all(p.stages[0].state_bytes == pytest.approx(state, rel=1e-6) for p in four)
    assert all(p.layout.schedule == "1F1B" for p in sharded)  # the runtime runs one micro-batch after the other
    # The gathered units are held while the micro-batches run: the pipeline's moment holds them beside the state.
    assert all(
        p.stages[0].memory_bytes
        >= p.stages[0].state_bytes
        + p.stages[0].activation_bytes
        + p.stages[0].buffer_bytes
        - p.stages[0].unmade_grad_bytes
        and p.stages[0].activation_bytes >= units
        for p in four
    )
    with pytest.raises(PlanError, match="ZeRO-2 is not offered"):
        Layout(dp=2, pp=1, micro_batch_size=1, num_microbatches=4, schedule="GPipe", cut_positions=(0, 3), zero_stage=2)


def test_bf16_master_plans_what_its_runtime_trains() -> None:
    """16-bit weights beside fp32 master weights: ZeRO 0 and 1 only, with tensor parallelism too; each stage holds
    2 + 4 bytes a parameter and the 12 of the master weight and AdamW's states, sharded by ZeRO-1 as the runtime
    shards them. What it cannot train is one line."""
    spec = load_model("zoo:gpt-tiny")
    model, cluster = spec.build(), Cluster.from_catalog("a100-80g", 4)
    workload = Workload(global_batch=8, precision="bf16-master")
    found = search(model, spec.example_inputs, cluster, workload, top_k=50)
    plans = (found.best, *found.alternatives, *found.pareto)
    assert {p.layout.zero_stage for p in plans} == {0, 1}
    shapes = [tuple(p.shape) for p in model.parameters()]
    whole = [p for p in plans if p.layout.pp == 1 and p.layout.dp > 1]
    assert whole and all(
        p.stages[0].state_bytes == pytest.approx(stage_state_bytes(shapes, workload, p.layout.dp, p.layout.zero_stage))
        for p in whole
    )
    assert stage_state_bytes(shapes, workload, 1, 0) == 18 * sum(map(math.prod, shapes)) + 4 * len(shapes)
    with pytest.raises(PlanError, match="bf16-master runs under ZeRO 0 or 1"):
        search(model, spec.example_inputs, cluster, workload, zero_stages=(3,))
    split = search(model, spec.example_inputs, cluster, workload, tensor_parallel=(2,), top_k=20)
    tp_plans = (split.best, *split.alternatives)
    assert all(p.layout.tp == 2 and p.layout.zero_stage in (0, 1) for p in tp_plans)


def test_a_precision_the_gpu_has_no_kernels_for_is_one_line() -> None:
    spec = load_model("zoo:mlp-tiny")
    with pytest.raises(PlanError, match=r"GPU 'v100-16g' has no bf16 peak.*--precision fp16-mixed or fp32"):
        search(spec.build(), spec.example_inputs, Cluster.from_catalog("v100-16g", 2),
               Workload(global_batch=8, precision="bf16-mixed"))  # fmt: skip
