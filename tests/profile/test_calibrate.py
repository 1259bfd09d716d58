"""`pyplan calibrate`: the α-β, per-op and optimizer fits on synthetic data, the calibration file and what the
catalog, the roofline and the search read from it (host costs included), and one quick calibration end to end with
the 2-process gloo link and host-cost measurements."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from pyplan.api import search
from pyplan.cli.calibrate import add_calibrate_parser
from pyplan.errors import PlanError
from pyplan.hardware.catalog import (
    get_gpu,
    get_link,
    local_calibration_path,
    local_efficiency,
    local_gpu,
)
from pyplan.hardware.cluster import Cluster
from pyplan.plan import Workload
from pyplan.profile.analytic import Efficiency, OpCost, OpEfficiency, Roofline
from pyplan.profile.calibrate import (
    AlphaBeta,
    Calibration,
    LinkMeasurement,
    MatmulPeak,
    OpSample,
    class_efficiency,
    fit_alpha_beta,
    fit_op,
    op_efficiency,
    write_calibration,
)
from pyplan.profile.host import HostCosts, OptimizerCost, fit_optimizer_cost, local_host_costs

LAUNCH = 5e-6


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pyplan cache directory, so no real calibration file is read or overwritten."""
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    return tmp_path


# --- α-β fit ----------------------------------------------------------------------------------------------


def test_alpha_beta_fit_recovers_exact_latency_and_bandwidth() -> None:
    sizes = [4 * 8**k for k in range(8)]
    fit = fit_alpha_beta(sizes, [30e-6 + n / 2.5e9 for n in sizes])
    assert fit.latency_s == pytest.approx(30e-6, rel=1e-9)
    assert fit.bw_bytes_per_s == pytest.approx(2.5e9, rel=1e-9)
    assert fit.time_s(1e6) == pytest.approx(30e-6 + 1e6 / 2.5e9)


def test_alpha_beta_fit_weighs_small_messages_as_much_as_large_ones() -> None:
    # 5 % multiplicative noise: the latency of 4-byte messages and the bandwidth of 16 MB ones both survive.
    rng = random.Random(0)
    sizes = [4 * 4**k for k in range(12)]
    times = [(20e-6 + n / 1e9) * (1 + rng.uniform(-0.05, 0.05)) for n in sizes]
    fit = fit_alpha_beta(sizes, times)
    assert fit.latency_s == pytest.approx(20e-6, rel=0.1)
    assert fit.bw_bytes_per_s == pytest.approx(1e9, rel=0.1)


def test_alpha_beta_fit_without_latency_goes_through_the_origin() -> None:
    sizes = [1e3, 1e4, 1e5]
    fit = fit_alpha_beta(sizes, [n / 1e9 * (0.9 if n == 1e3 else 1.0) for n in sizes])
    assert fit.latency_s == 0.0 and fit.bw_bytes_per_s == pytest.approx(1e9, rel=0.05)


def test_alpha_beta_fit_rejects_what_it_cannot_fit() -> None:
    with pytest.raises(PlanError, match="two or more distinct sizes"):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])
    with pytest.raises(PlanError, match="positive times"):
        fit_alpha_beta([8, 16], [1e-5, 0.0])
    with pytest.raises(PlanError, match="do not grow with size"):
        fit_alpha_beta([8, 1e6], [1e-3, 1e-4])


# --- Efficiencies -----------------------------------------------------------------------------------------


def sample(op: str, cls: str, roofline_s: float, time_s: float, *, large: bool = True, n_ops: int = 1) -> OpSample:
    return OpSample(f"{op} program", cls, op, large, n_ops, roofline_s, time_s)


def test_class_efficiency_is_roofline_over_time_less_launches_of_large_programs() -> None:
    samples = [
        sample("mm", "matmul", 1e-3, 2e-3 + 2 * LAUNCH, n_ops=2),
        sample("addmm", "matmul", 3e-3, 6e-3 + LAUNCH),
        sample("addmm", "matmul", 1e-6, 1e-3, large=False),  # small programs set latencies, not the class
        sample("relu", "elementwise", 1e-3, 1.25e-3 + LAUNCH),
        sample("gelu", "elementwise", 1e-9, 1.05 * LAUNCH),  # all launch: no information
    ]
    found = class_efficiency(samples, LAUNCH)
    assert found["matmul"] == pytest.approx(0.5)
    assert found["elementwise"] == pytest.approx(0.8)
    assert set(found) == {"matmul", "elementwise"}


def test_op_fit_separates_a_fixed_cost_from_the_rate() -> None:
    # Hockney: t = latency + roofline / efficiency, at a small and a large size.
    small = OpSample("conv small", "matmul", "convolution", False, 1, 1e-4, 30e-6 + 1e-4 / 0.8)
    large = OpSample("conv large", "matmul", "convolution", True, 1, 1e-2, 30e-6 + 1e-2 / 0.8)
    fit = fit_op([small, large], LAUNCH)
    assert fit.efficiency == pytest.approx(0.8) and fit.latency_s == pytest.approx(30e-6)


def test_op_fit_keeps_the_launch_when_a_small_program_beats_the_roofline() -> None:
    # Operands in cache: the small program runs faster than the memory roof allows. The large one sets the rate.
    small = OpSample("relu small", "elementwise", "relu", False, 1, 10e-6, 6e-6)
    large = OpSample("relu large", "elementwise", "relu", True, 1, 1e-3, 1.25e-3)
    fit = fit_op([small, large], LAUNCH)
    assert fit.latency_s == LAUNCH
    assert fit.efficiency == pytest.approx(0.8, rel=0.01)


def test_op_efficiency_fits_every_op_run_alone() -> None:
    samples = [
        OpSample("a", "elementwise", "add", False, 1, 1e-5, 2e-5),
        OpSample("b", "elementwise", "add", True, 1, 1e-3, 1.1e-3),
        OpSample("c", "elementwise", None, True, 3, 1e-3, 2e-3),
    ]
    assert list(op_efficiency(samples, LAUNCH)) == ["add"]


# --- The calibration file ---------------------------------------------------------------------------------


def synthetic(device: str) -> Calibration:
    link = LinkMeasurement(
        backend="gloo",
        sizes_bytes=(4, 4096),
        p2p_time_s=(1e-4, 1.1e-4),
        allreduce_time_s=(2e-4, 2.2e-4),
        p2p=AlphaBeta(latency_s=1e-4, bw_bytes_per_s=2e9),
        allreduce=AlphaBeta(latency_s=2e-4, bw_bytes_per_s=1e9),
    )
    efficiency = Efficiency(
        compute={"matmul": 0.9, "attention": 0.6, "norm": 0.5, "elementwise": 0.4},
        memory={"matmul": 0.9, "attention": 0.6, "norm": 0.5, "elementwise": 0.4},
        launch_s=LAUNCH,
        op={"relu": OpEfficiency(efficiency=1.0, latency_s=LAUNCH)},
    )
    return Calibration(
        device=device,
        device_type="cpu",
        threads=1,
        peaks=(MatmulPeak("fp32", 1e11, 512), MatmulPeak("bf16", 1e9, 256)),
        copy_bw_bytes_per_s=1.8e10,
        add_bw_bytes_per_s=2e10,
        launch_s=LAUNCH,
        samples=(OpSample("relu x", "elementwise", "relu", True, 1, 1e-3, 1e-3),),
        efficiency=efficiency,
        link=link,
        elapsed_s=1.0,
        host=HOST,
    )


HOST = HostCosts(
    stage_forward_s=1e-4,
    stage_backward_s=2e-4,
    message_s=5e-5,
    step_s=5e-4,
    optimizer={"adamw": OptimizerCost(3e-5, 1e-9)},
    sync_overlaps_backward=False,
    source="synthetic",
)


def test_the_catalog_and_the_roofline_read_the_calibration_file(cache: Path) -> None:
    path = write_calibration(synthetic(local_gpu().description))
    assert path == local_calibration_path() == cache / "local.json"
    assert [p.name for p in cache.iterdir()] == ["local.json"]  # the temporary file was renamed, not left

    gpu = get_gpu("local")
    assert gpu.calibrated and gpu.cpu_threads == 1
    assert dict(gpu.peak_flops_per_s) == {"fp32": 1e11, "bf16": 1e9}
    assert gpu.hbm_bw_bytes_per_s == 2e10
    link = get_link("local")
    assert (link.latency_s, link.bw_bytes_per_s) == (1e-4, 2e9) and "gloo" in link.source
    # A 2-rank ring all-reduce is 2α + G/BW: the all-reduce fit (2e-4 s, 1e9 B/s) gives α = 1e-4 per step.
    assert link.collective == (1e-4, 1e9)
    assert local_host_costs() == HOST

    roof = Roofline.from_gpu(gpu)
    assert roof.efficiency.compute["matmul"] == 0.9 and roof.efficiency.launch_s == LAUNCH
    relu = OpCost("relu", "elementwise", 0.0, 2e6, "float32")
    gelu = OpCost("gelu", "elementwise", 0.0, 2e6, "float32")
    assert roof.op_time_s(relu) == pytest.approx(2e6 / 2e10 + LAUNCH)  # the op's own fit
    assert roof.op_time_s(gelu) == pytest.approx(2e6 / (2e10 * 0.4) + LAUNCH)  # its class
    empty = OpCost("empty", "elementwise", 0.0, 2e6, "float32")
    assert roof.op_time_s(empty) == LAUNCH  # an allocation moves no data


def test_a_file_for_another_device_gives_no_efficiencies(cache: Path) -> None:
    write_calibration(synthetic("some other machine"))
    assert local_efficiency() is None and local_host_costs() is None and not local_gpu().calibrated
    with pytest.raises(PlanError, match="run `pyplan calibrate`"):
        Roofline.from_gpu(local_gpu())


def test_a_catalog_gpu_gets_default_efficiencies(cache: Path) -> None:
    write_calibration(synthetic(local_gpu().description))
    roof = Roofline.from_gpu(get_gpu("a100-80g"))
    assert roof.efficiency == Efficiency() and roof.peak("bfloat16") == get_gpu("a100-80g").peak_flops("bf16")


def test_efficiency_json_round_trip_and_errors() -> None:
    eff = synthetic("x").efficiency
    assert Efficiency.from_json(json.loads(json.dumps(eff.to_json()))) == eff
    assert Efficiency.from_json({"compute": {"matmul": 0.5}}).compute["norm"] == Efficiency().compute["norm"]
    with pytest.raises(PlanError, match="'compute' must map op classes"):
        Efficiency.from_json({"compute": {"conv": 0.5}})
    with pytest.raises(PlanError, match=r"'memory\.norm' must be a positive number"):
        Efficiency.from_json({"memory": {"norm": 0}})
    with pytest.raises(PlanError, match="'op' must map aten op names"):
        Efficiency.from_json({"op": {"relu": 1.0}})


# --- Host costs ---------------------------------------------------------------------------------------------
def test_optimizer_fit_is_exact_on_two_points() -> None:
    a, c = 3e-5, 1.2e-9
    cost = fit_optimizer_cost((64, 16, 64 * a + 64 * 16 * c), (4, 1 << 18, 4 * a + 4 * (1 << 18) * c))
    assert cost.tensor_s == pytest.approx(a, rel=1e-9) and cost.element_s == pytest.approx(c, rel=1e-9)
    assert cost.time_s(10, 1000) == pytest.approx(10 * a + 1000 * c)
    with pytest.raises(ValueError, match="differ in shape"):
        fit_optimizer_cost((4, 16, 1.0), (4, 16, 2.0))


def test_json_round_trip_and_errors() -> None:
    assert HostCosts.from_json(json.loads(json.dumps(HOST.to_json())), "x") == HOST
    assert HOST.for_search("adamw")["optimizer_tensor_s"] == 3e-5
    assert HOST.for_search("sgd")["optimizer_tensor_s"] == 0.0  # not measured: not charged
    with pytest.raises(PlanError, match="x: unknown key 'launch_s'"):
        HostCosts.from_json({"launch_s": 1.0}, "x")
    with pytest.raises(PlanError, match="x: malformed"):
        HostCosts.from_json({"optimizer": {"sgd": {"tensor_s": 1.0}}}, "x")
    with pytest.raises(PlanError, match="'step_s' must be a finite number >= 0"):
        HostCosts(step_s=-1.0)
    with pytest.raises(PlanError, match="x: must be an object"):
        HostCosts.from_json([1], "x")


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_the_search_charges_the_host_costs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same profile planned without and with host costs: every stage's F and B grow by the per-micro-batch
    costs and its messages, the step by step_s and the optimizer's per-tensor cost, and the all-reduce no longer
    overlaps the backward."""
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    bare = replace(synthetic(local_gpu().description), host=None)
    write_calibration(bare)
    model, inputs = _Mlp(), lambda b: (torch.randn(b, 64),)
    cluster, work = Cluster.from_catalog("local", 2), Workload(global_batch=8)
    options = {"schedules": ["GPipe"], "zero_stages": [0], "micro_batch_sizes": [2], "top_k": 10}
    first = search(model, inputs, cluster, work, **options)
    write_calibration(synthetic(local_gpu().description))
    second = search(model, inputs, cluster, work, chain=first.chain, **options)

    def by_mesh(found: object) -> dict[tuple[int, int], object]:
        plans = (found.best, *found.alternatives)  # type: ignore[attr-defined]
        return {(p.layout.dp, p.layout.pp): p for p in plans}

    before, after = by_mesh(first), by_mesh(second)
    tensors = {1: 2 * 6}  # 6 Linear layers, weight and bias each
    for mesh in ((2, 1), (1, 2)):
        b, a = before[mesh], after[mesh]
        assert a.layout.cut_positions == b.layout.cut_positions
        last = len(a.stages) - 1
        for s, (x, y) in enumerate(zip(b.stages, a.stages)):
            messages = (s > 0) + (s < last)  # one tensor crosses each cut of this chain
            assert y.forward_s == pytest.approx(x.forward_s + HOST.stage_forward_s + messages * HOST.message_s)
            assert y.backward_s == pytest.approx(x.backward_s + HOST.stage_backward_s + messages * HOST.message_s)
        assert a.predicted.host_step_s == HOST.step_s
        assert a.predicted.iteration_s == pytest.approx(
            a.predicted.pipeline_s + a.predicted.exposed_comm_s + a.predicted.optimizer_s + HOST.step_s
        )
    # dp 2: the whole model's all-reduce is paid after the backward (2 ring steps of the collective link).
    dp = after[(2, 1)]
    grad_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert dp.predicted.exposed_comm_s == pytest.approx(2 * (1e-4 + grad_bytes / 2 / 1e9))
    adamw = OptimizerCost(3e-5, 1e-9)
    assert dp.predicted.optimizer_s >= adamw.time_s(tensors[1], sum(p.numel() for p in model.parameters()))


# --- End to end -------------------------------------------------------------------------------------------


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pyplan")
    add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calibrate", *argv])
    return int(args.func(args))


@pytest.mark.distributed
def test_quick_calibration_end_to_end(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pyplan calibrate --quick --json`: the device figures, and gloo between 2 spawned processes."""
    assert run("--quick", "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((cache / "local.json").read_text())
    assert printed["path"] == str(cache / "local.json") and printed["gpu"] == written["gpu"]

    gpu = get_gpu("local")
    assert gpu.calibrated and {"fp32", "bf16", "fp16"} <= set(gpu.peak_flops_per_s)
    assert 1e8 < gpu.peak_flops("fp32") < 1e15 and 1e8 < gpu.hbm_bw_bytes_per_s < 1e13
    link = get_link("local")
    assert link.calibrated and 0 < link.latency_s < 0.1 and link.bw_bytes_per_s > 1e7
    assert written["measured"]["link"]["backend"] == "gloo"
    allreduce = written["measured"]["link"]["allreduce"]
    assert allreduce["latency_s"] >= 0 and allreduce["bw_bytes_per_s"] > 0

    eff = Roofline.from_gpu(gpu).efficiency
    assert 0 < eff.launch_s < 1e-3
    assert {"addmm", "convolution", "native_layer_norm", "relu"} <= set(eff.op)
    assert all(0 < e.efficiency < 10 and e.latency_s >= eff.launch_s for e in eff.op.values())

    # The figures' spread over the rounds and the link's passes, beside them.
    spread = written["measured"]["spread"]
    assert {"peak fp32", "copy bandwidth", "add bandwidth", "launch per op"} <= set(spread)
    assert set(written["measured"]["link"]["spread"]) == {
        "send latency", "send bandwidth", "all-reduce latency", "all-reduce bandwidth"}  # fmt: skip
    assert all(v >= 0 for v in (*spread.values(), *written["measured"]["link"]["spread"].values()))

    # The runtime's host costs, measured with pyplan's runtime on 2 gloo processes (a 2-core VM: ~0.1 and
    # ~0.2 ms per micro-batch, ~50 us per message, ~0.5 ms per step, AdamW ~35 us per tensor).
    host = local_host_costs()
    assert host is not None and not host.sync_overlaps_backward
    # The forward chunk's extra is timed directly; the backward's is a difference of two step times, which a loaded
    # 2-core host can bring to 0.
    assert 0 < host.stage_forward_s < 0.01 and 0 <= host.stage_backward_s < 0.01
    assert 0 < host.message_s < 0.01 and 0 < host.step_s < 0.05
    assert set(host.optimizer) == {"sgd", "sgd-momentum", "adam", "adamw"}
    assert host.optimizer["adamw"].tensor_s > host.optimizer["sgd"].tensor_s > 0


def test_bad_threads_is_a_plan_error(cache: Path) -> None:
    with pytest.raises(PlanError, match="--threads must be at least 1"):
        run("--threads", "0")


def test_spread_and_the_warning_for_a_figure_that_moved() -> None:
    from pyplan.profile.calibrate import UNSTABLE, Calibration, LinkMeasurement, spread

    assert spread([1.0]) == 0.0 and spread([0.0, 0.0]) == 0.0
    assert spread([1.0, 1.1, 1.3]) == pytest.approx(0.3 / 1.1)
    # The example of an unstable quick calibration: send latency 82 us in one pass, 2.27 ms in the other.
    fit = AlphaBeta(latency_s=1e-4, bw_bytes_per_s=1e9)
    link = LinkMeasurement("gloo", (1, 2), (1.0, 2.0), (1.0, 2.0), fit, fit, spread={
        "send latency": spread([82e-6, 2.27e-3]), "send bandwidth": 0.05})  # fmt: skip
    cal = Calibration("cpu", "cpu", 1, (), 1.0, 1.0, 1e-6, (), Efficiency(), link, 1.0,
                      spread={"peak fp32": 0.1, "copy bandwidth": UNSTABLE + 0.01})  # fmt: skip
    lines = cal.unstable()
    assert [line.split(" moved")[0] for line in lines] == ["warning: copy bandwidth", "warning: send latency"]
    assert "calibrate again when it is quiet" in lines[1]
    assert cal.to_json()["measured"]["spread"] == {"peak fp32": 0.1, "copy bandwidth": UNSTABLE + 0.01}
