"""Every GPU check of pyplan in one command: one JSON result file per check, a table at the end.

Run: `python benchmarks/gpu_check.py OUT_DIR` on a machine with one CUDA GPU (about 7 minutes on an H100 or H200,
never more than `--budget-s`, 470 s by default). `--device cpu` runs the same code paths on the CPU with tiny
models, as tests/test_gpu_check.py does, so the script cannot break before it ever reaches a GPU.

Each check runs in a process group of its own (killed with its children at its time limit) and writes
OUT_DIR/<check>.json with at least {"check", "status" ("ok", "failed", "timeout", "error"), "elapsed_s"}; a check
that dies or runs out of time still leaves its file, with what it had finished. In order:

  env        torch, CUDA, the device; two ceilings measured as METHOD says: a large bf16 (fp32 on the CPU) matrix
             product's FLOP/s on random data and a device-to-device copy's bytes/s (read + written); and a language
             model head's three products at GPT-2's odd vocabulary and padded to a multiple of 64.
  calibrate  `pyplan calibrate --no-link --quick` on the device (one GPU has no link to measure) into a private
             cache directory, then the full calibration in the time left, kept when it finishes; the files are
             embedded in the result, and the later checks plan with the one kept as the `local` GPU.
  gpu_tests  `pytest -m gpu`: every test marked gpu, with each test's outcome.
  profile    per model, the chain `pyplan inspect` builds (trace, linearize, profile: each block's forward and
             backward timed alone with CUDA events, median of `repeats`), the whole traced model's forward and
             backward timed as one call, and the same chain priced by the analytic roofline, once for the catalog
             entry of this GPU (h100-sxm, h100-pcie or h200 by the device's name) and once for the calibrated
             `local` entry: per block and for the whole step, analytic over measured, with the FLOPs-weighted
             median and the worst block (the one farthest from 1 in ratio). Then `pyplan inspect --json` itself on
             the first model, as a user runs it.
  accuracy   `benchmarks/accuracy.py --matrices one-cuda` (remat none/full and micro-batch/GA choices on one GPU)
             with the calibration above, one model per process, a short protocol (one launch, no waiting for a
             quiet machine: a GPU host's other cores do not stretch the GPU's steps); its rows and summary.
  llm        language models in 16-bit precisions (LLM_CASES: the Llama-style 1B in bf16-master, gpt2-small in
             bf16-mixed) planned for the GPU's catalog entry, as `pyplan plan --gpu h200 --precision ...` plans
             them, and each plan trained as planned on the device: predicted against measured step time and peak
             memory, and one step under torch.profiler (kernels launched, the GPU's busy time beside the wall time).

The profile's models: gpt2-small and resnet50 in fp32, and the 1B Llama-style model built in bf16 (its weights and
activations bf16, no autocast: the analytic model prices its ops in their own dtype). On the CPU: gpt-tiny and
resnet-tiny in fp32, gpt-tiny in bf16; the llm check runs gpt-tiny in both precisions.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, write_json

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("env", "calibrate", "gpu_tests", "profile", "accuracy", "llm")
# Each check's own limit, in seconds; the run as a whole stays within --budget-s.
LIMITS_S = {"env": 60, "calibrate": 100, "gpu_tests": 120, "profile": 150, "accuracy": 250, "llm": 200}
DEFAULT_BUDGET_S = 470.0
# The models the profile and accuracy checks run (--models); None: all of them.
ONLY: set[str] | None = None


def _chosen(models: Any) -> list[Any]:
    """The entries of `models` (names, or cases with a `model`) that --models asks for, in order."""
    return [m for m in models if ONLY is None or getattr(m, "model", m) in ONLY]


@dataclass(frozen=True)
class ProfileCase:
    """A zoo model profiled at `batch_sizes` (compared at the largest) in `dtype`."""

    model: str
    dtype: str
    batch_sizes: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype}"


PROFILE_CASES = {
    "cuda": (
        ProfileCase("gpt2-small", "float32", (4, 8)),
        ProfileCase("resnet50", "float32", (32, 64)),
        ProfileCase("llama-1b-style", "bfloat16", (1, 2)),
    ),
    "cpu": (
        ProfileCase("gpt-tiny", "float32", (4, 8)),
        ProfileCase("resnet-tiny", "float32", (4, 8)),
        ProfileCase("gpt-tiny", "bfloat16", (4, 8)),
    ),
}
# The one-device accuracy matrix per device: its name in benchmarks/accuracy.py and the models run (all of the
# matrix on a GPU; one small model on the CPU).
# Each model's share of the check's time is in proportion to its weight.
ACCURACY = {
    "cuda": ("one-cuda", {"gpt2-small": 2.0, "resnet50": 2.0, "vgg16-cifar10": 1.0}),
    "cpu": ("one-cpu", {"vgg-tiny": 1.0}),
}
ACCURACY_PROTOCOL = {
    "cuda": ["--steps", "4", "--warmup", "3", "--quiet-blocks", "1", "--max-rounds", "1"],
    "cpu": ["--steps", "1", "--warmup", "1", "--quiet-blocks", "1", "--max-rounds", "1"],
}
# The catalog entry of this GPU, by a substring of torch's device name.
CATALOG = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80g-sxm"))


# --- helpers ------------------------------------------------------------------------------------------------------


def _write(path: Path, data: dict[str, Any]) -> None:
    """Write a check's result file atomically, so a check killed mid-write leaves the previous version."""
    write_json(path, data, indent=1, default=str)


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))[-4000:]


def _tail(text: str, n: int = 4000) -> str:
    return text[-n:]


class Result:
    """A check's result file, written again after every part so a timeout keeps what was done."""

    def __init__(self, out: Path, check: str) -> None:
        self.path = out / f"{check}.json"
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"check": check, "status": "running"}
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.start, 2)
        _write(self.path, self.data)

    def finish(self, status: str) -> None:
        self.data["status"] = status
        self.save()


def _run(cmd: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` in a process group of its own; at `timeout_s` kill it with its children. Returns rc, output, time."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
    )
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return {"rc": rc, "timed_out": rc is None, "output": out or "", "elapsed_s": round(time.perf_counter() - start, 2)}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], device: Any, *, warmup: int, repeats: int) -> float:
    """Median seconds of `fn` on `device`: CUDA events on a GPU, the wall clock around a synchronize on the CPU."""
    import torch

    times = []
    for rep in range(warmup + repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
        if rep >= warmup:
            times.append(seconds)
    return statistics.median(times)


# --- env ----------------------------------------------------------------------------------------------------------


def check_env(out: Path, device_name: str, deadline: float) -> str:
    import platform

    import torch

    res = Result(out, "env")
    device = torch.device(device_name)
    data = res.data
    data.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=device_name,
        cpus=os.cpu_count(),
    )
    try:
        import pyplan
        from pyplan import _core  # noqa: F401  (the compiled core imports)

        data["pyplan"] = getattr(pyplan, "__version__", "?")
    except Exception as exc:  # the install is what this check is for
        data["pyplan_error"] = _error(exc)
    try:
        import ortools

        data["ortools"] = ortools.__version__
    except ModuleNotFoundError:
        data["ortools"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        data.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_bytes=props.total_memory,
            driver=_driver(),
        )
    res.save()
    # The two ceilings: a large matrix product on random data and a device-to-device copy.
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    mm_s = _median_s(lambda: a @ b, device, warmup=3, repeats=10)
    data["matmul"] = {"n": n, "dtype": str(dtype), "s": mm_s, "flops_per_s": 2 * n**3 / mm_s}
    numel = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.randn(numel, device=device, generator=gen)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), device, warmup=3, repeats=10)
    data["copy"] = {"bytes": 2 * src.nbytes, "s": copy_s, "bytes_per_s": 2 * src.nbytes / copy_s}
    res.save()
    data["head"] = _head_products(device)
    data["host_per_op"] = _host_per_op(device)
    res.finish("ok" if "pyplan_error" not in data else "failed")
    return res.data["status"]


def _head_products(device: Any) -> list[dict[str, Any]]:
    """A language-model head's three matrix products (forward, input and weight gradients) in 16 bits, at GPT-2's
    vocabulary (50,257, odd: rows not 16-byte aligned) and padded to a multiple of 64 (50,304, as nanoGPT pads it):
    FLOP/s of each, median of 10 after 3 warm-ups, random data. On the CPU, in fp32 at a small size."""
    import torch

    tokens, width = (16384, 768) if device.type == "cuda" else (256, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for vocab in (50257, 50304) if device.type == "cuda" else (1001, 1024):
        x = torch.randn(tokens, width, device=device, dtype=dtype, generator=gen)
        w = torch.randn(vocab, width, device=device, dtype=dtype, generator=gen)
        g = torch.randn(tokens, vocab, device=device, dtype=dtype, generator=gen)
        flops = 2 * tokens * width * vocab
        products = (("forward", x, w.t()), ("input_grad", g, w), ("weight_grad", g.t(), x))
        for name, left, right in products:
            t = _median_s(functools.partial(torch.matmul, left, right), device, warmup=3, repeats=10)
            rows.append({"vocab": vocab, "product": name, "s": t, "flops_per_s": flops / t})
    return rows


def _host_per_op(device: Any) -> dict[str, float]:
    """The host's time to issue one aten op (the analytic model's `host_s`): wall time per op of a long run of
    tiny ops whose kernels take far less than their launch, forward (an elementwise op and a view each, under
    autograd, as a model's forward issues them) and backward (autograd's engine issuing them), synchronized once
    at the end. Median of 5 runs of 2,000 ops."""
    import torch

    def forward_and_backward() -> tuple[float, float]:
        x = torch.ones(16, device=device, requires_grad=True)
        y = x
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(1000):
            y = (y * 1.0001).view(16)  # a kernel and a view
        _sync(device)
        t1 = time.perf_counter()
        y.sum().backward()
        _sync(device)
        t2 = time.perf_counter()
        return (t1 - t0) / 2000, (t2 - t1) / 1000

    forward_and_backward()  # warm-up
    runs = [forward_and_backward() for _ in range(5)]
    return {
        "forward_s_per_op": statistics.median(f for f, _ in runs),
        "backward_s_per_op": statistics.median(b for _, b in runs),
    }


def _driver() -> str | None:
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


# --- calibrate ----------------------------------------------------------------------------------------------------


def check_calibrate(out: Path, device_name: str, deadline: float) -> str:
    """`pyplan calibrate --quick` first, which fits any budget, then the full calibration in the time left, kept
    when it finishes (the dry run stops after the quick one)."""
    res = Result(out, "calibrate")
    cache = Path(os.environ["PYPLAN_CACHE_DIR"])
    target = cache / "local.json"
    res.data["runs"] = []
    for quick in (True, False):
        if not quick and device_name == "cpu":
            break
        path = cache / ("quick.json" if quick else "full.json")
        cmd = [sys.executable, "-m", "pyplan.cli", "calibrate", "--no-link", "--out", str(path)]
        cmd += ["--quick"] if quick else []
        done = _run(cmd, deadline - time.time())
        run = {"command": " ".join(cmd[1:]), "rc": done["rc"], "elapsed_s": done["elapsed_s"]}
        if done["rc"] == 0 and path.exists():
            run["calibration"] = json.loads(path.read_text())
            path.replace(target)
        else:
            run["output"] = _tail(done["output"], 3000)
        res.data["runs"].append(run)
        res.save()
    kept = [r for r in res.data["runs"] if "calibration" in r]
    if kept:
        res.data["calibration"] = kept[-1]["calibration"]
        res.data["kept"] = kept[-1]["command"]
    res.finish("ok" if len(kept) == len(res.data["runs"]) else ("failed" if not kept else "partial"))
    return res.data["status"]


# --- gpu_tests ----------------------------------------------------------------------------------------------------


def check_gpu_tests(out: Path, device_name: str, deadline: float) -> str:
    import xml.etree.ElementTree as ET

    res = Result(out, "gpu_tests")
    with tempfile.TemporaryDirectory(prefix="pyplan-gpu-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        # Only the files that hold gpu tests are collected: the rest may import what a GPU host lacks (OR-Tools).
        # Whole paths: the script may run from any folder.
        files = sorted(str(p) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += files
        done = _run(cmd, deadline - time.time())
        tests = []
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    found = case.find(tag)
                    if found is not None:
                        outcome, message = tag, (found.get("message") or "")[:500]
                tests.append(
                    {
                        "test": f"{case.get('classname')}::{case.get('name')}",
                        "outcome": outcome,
                        "time_s": float(case.get("time") or 0),
                        "message": message,
                    }
                )
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
    res.data.update(rc=done["rc"], tests=tests, counts=counts, output=_tail(done["output"], 3000))
    # pytest exits 5 when no test is collected; on a machine without a GPU every gpu test skips.
    ok = done["rc"] in (0, 5) and counts["failure"] == counts["error"] == 0
    if device_name == "cuda":
        ok = ok and counts["passed"] > 0 and counts["skipped"] == 0
    res.finish("timeout" if done["timed_out"] else ("ok" if ok else "failed"))
    return res.data["status"]


# --- profile ------------------------------------------------------------------------------------------------------


def catalog_gpu(device_name: str) -> str:
    """The catalog entry of this GPU (h100-sxm for a CPU dry run, whose ratios mean nothing)."""
    import torch

    if device_name != "cuda":
        return "h100-sxm"
    name = torch.cuda.get_device_name(0)
    for key, entry in CATALOG:
        if key in name:
            return entry
    raise RuntimeError(f"no catalog entry for the GPU {name!r}: add it to CATALOG")


def _cast(example_inputs: Callable[[int], Any], dtype: Any) -> Callable[[int], Any]:
    """`example_inputs` with floating-point tensors in `dtype` (token ids stay integers)."""
    import torch

    def inputs(b: int) -> Any:
        got = example_inputs(b)
        return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in got)

    return inputs


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = sorted(zip(values, weights))
    total = sum(w for _, w in pairs)
    if total <= 0:
        return statistics.median(values)
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= total / 2:
            return v
    return pairs[-1][0]


def _ratios(analytic: Sequence[float], measured: Sequence[float], flops: Sequence[float]) -> dict[str, Any]:
    """analytic / measured per block: the FLOPs-weighted median, the worst (farthest from 1), and the total's."""
    ratios = [a / m if m > 0 else math.nan for a, m in zip(analytic, measured)]
    finite = [(r, w, i) for i, (r, w) in enumerate(zip(ratios, flops)) if math.isfinite(r) and r > 0]
    worst = max(finite, key=lambda x: abs(math.log(x[0]))) if finite else (math.nan, 0.0, -1)
    return {
        "weighted_median": _weighted_median([r for r, _, _ in finite], [w for _, w, _ in finite]) if finite else None,
        "worst": worst[0],
        "worst_block": worst[2],
        "total": sum(analytic) / sum(measured) if sum(measured) > 0 else None,
    }


def _whole_s(module: Any, inputs: Sequence[Any], device: Any, *, warmup: int, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of the whole traced model, one call and one autograd run each."""
    import torch

    from pyplan._torch import tensor_leaves

    fwd: list[float] = []
    bwd: list[float] = []
    for rep in range(warmup + repeats):
        holder: dict[str, Any] = {}

        def forward(holder: dict[str, Any] = holder) -> None:
            holder["out"] = module(*inputs)

        def backward(holder: dict[str, Any] = holder) -> None:
            roots = [t for t in tensor_leaves(holder["out"]) if t.requires_grad]
            torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])

        f = _median_s(forward, device, warmup=0, repeats=1)
        b = _median_s(backward, device, warmup=0, repeats=1)
        holder.clear()
        for p in module.parameters():
            p.grad = None
        if rep >= warmup:
            fwd.append(f)
            bwd.append(b)
    return statistics.median(fwd), statistics.median(bwd)


def profile_case(case: ProfileCase, device_name: str, rooflines: dict[str, Any]) -> dict[str, Any]:
    """The measured chain of one model on the device, its whole step, and the analytic times of the same chain."""
    import torch

    from pyplan import linearize, load_model, trace
    from pyplan.profile import TimingOptions, profile
    from pyplan.profile.analytic import block_op_costs

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the blocks are timed
    dtype = getattr(torch, case.dtype)
    spec = load_model(f"zoo:{case.model}")
    inputs = _cast(spec.example_inputs, dtype)
    torch.manual_seed(0)
    model = spec.build().to(dtype)  # on the CPU, as `pyplan inspect` builds it; profiling moves it to the device
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    graph = trace(model, inputs, batch_size=min(case.batch_sizes))
    chain = linearize(graph)
    timings["trace_s"] = time.perf_counter() - t0
    b = max(case.batch_sizes)
    # The analytic ops are recorded before the model moves to the device: fake inputs are made on the CPU.
    t0 = time.perf_counter()
    ops = block_op_costs(chain, inputs, b)
    timings["record_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    options = TimingOptions(warmup=3, repeats=10)
    chain = profile(chain, inputs, measure=True, batch_sizes=case.batch_sizes, device=device, options=options)
    timings["measure_s"] = time.perf_counter() - t0
    module = chain.graph.module
    batch = [t.to(device) for t in inputs(b)]
    t0 = time.perf_counter()
    whole_f, whole_b = _whole_s(module, batch, device, warmup=3, repeats=10)
    timings["whole_s"] = time.perf_counter() - t0
    blocks = []
    for blk, (f_ops, b_ops) in zip(chain.blocks, ops):
        row = {
            "name": blk.name,
            "flops_fwd": blk.flops_fwd(b),
            "flops_bwd": blk.flops_bwd(b),
            "measured_fwd_s": blk.fwd_time_s(b),
            "measured_bwd_s": blk.bwd_time_s(b),
        }
        for key, roof in rooflines.items():
            row[f"{key}_fwd_s"] = sum(roof.op_time_s(op) for op in f_ops)
            row[f"{key}_bwd_s"] = sum(roof.op_time_s(op) for op in b_ops)
        blocks.append(row)
    measured = [r["measured_fwd_s"] + r["measured_bwd_s"] for r in blocks]
    flops = [r["flops_fwd"] + r["flops_bwd"] for r in blocks]
    compare = {}
    for key in rooflines:
        analytic = [r[f"{key}_fwd_s"] + r[f"{key}_bwd_s"] for r in blocks]
        compare[key] = {
            "blocks": _ratios(analytic, measured, flops),
            "fwd": _ratios([r[f"{key}_fwd_s"] for r in blocks], [r["measured_fwd_s"] for r in blocks], flops),
            "bwd": _ratios([r[f"{key}_bwd_s"] for r in blocks], [r["measured_bwd_s"] for r in blocks], flops),
            "whole_step": sum(analytic) / (whole_f + whole_b),
        }
    del batch, module, chain, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": case.model,
        "dtype": case.dtype,
        "batch_size": b,
        "blocks": blocks,
        "whole_fwd_s": whole_f,
        "whole_bwd_s": whole_b,
        "blocks_sum_s": sum(measured),
        "flops": sum(flops),
        "achieved_flops_per_s": sum(flops) / (whole_f + whole_b),
        "compare": compare,
        "timings": timings,
    }


def reprice(profile_file: Path, calibration: Path | None) -> list[dict[str, Any]]:
    """The analytic side of a profile check's result again, with the model as it is now, on this machine: each
    model's chain traced again, its ops priced for the GPU's catalog entry (and for `calibration`, a calibration
    file of that GPU or a calibrate check's result), against the block and whole-step times measured then. One row
    per model and roofline: the whole step's, the forward's and the backward's ratio analytic / measured, the
    FLOPs-weighted block median, and the whole step's ratio the check recorded. No GPU needed."""
    import torch

    from pyplan import linearize, load_model, trace
    from pyplan.hardware import get_gpu
    from pyplan.profile.analytic import Efficiency, Roofline, block_op_costs

    data = json.loads(profile_file.read_text())
    rooflines = {"catalog": Roofline.from_gpu(get_gpu(data["catalog_gpu"]))}
    if calibration is not None:
        cal = json.loads(calibration.read_text())
        cal = cal.get("calibration", cal)
        eff = Efficiency.from_json(cal["efficiency"], str(calibration))
        rooflines["local"] = Roofline(cal["gpu"]["peak_flops_per_s"], cal["gpu"]["hbm_bw_bytes_per_s"], eff)
    cases = {(c.model, c.dtype): c for c in (*PROFILE_CASES["cuda"], *PROFILE_CASES["cpu"])}
    rows = []
    for m in data["models"]:
        case = cases[(m["model"], m["dtype"])]
        spec = load_model(f"zoo:{case.model}")
        dtype = getattr(torch, case.dtype)
        inputs = _cast(spec.example_inputs, dtype)
        chain = linearize(trace(spec.build().to(dtype), inputs, batch_size=min(case.batch_sizes)))
        if [b.name for b in chain.blocks] != [r["name"] for r in m["blocks"]]:
            raise RuntimeError(f"{case.label}: the chain's blocks are not those measured; the model has changed")
        ops = block_op_costs(chain, inputs, m["batch_size"])
        measured = [r["measured_fwd_s"] + r["measured_bwd_s"] for r in m["blocks"]]
        flops = [r["flops_fwd"] + r["flops_bwd"] for r in m["blocks"]]
        for key, roof in rooflines.items():
            fwd = [sum(roof.op_time_s(op) for op in f) for f, _ in ops]
            bwd = [sum(roof.op_time_s(op) for op in b) for _, b in ops]
            rows.append(
                {
                    "label": f"{case.label} b={m['batch_size']}",
                    "roofline": key,
                    "whole_step": (sum(fwd) + sum(bwd)) / (m["whole_fwd_s"] + m["whole_bwd_s"]),
                    "fwd": sum(fwd) / m["whole_fwd_s"],
                    "bwd": sum(bwd) / m["whole_bwd_s"],
                    "blocks_median": _ratios([f + b for f, b in zip(fwd, bwd)], measured, flops)["weighted_median"],
                    "recorded": m["compare"].get(key, {}).get("whole_step"),
                }
            )
    return rows


def check_profile(out: Path, device_name: str, deadline: float) -> str:
    from pyplan.hardware import get_gpu
    from pyplan.profile.analytic import Roofline

    res = Result(out, "profile")
    entry = catalog_gpu(device_name)
    rooflines = {"catalog": Roofline.from_gpu(get_gpu(entry))}
    try:
        rooflines["local"] = Roofline.from_gpu(get_gpu("local"))
    except Exception as exc:  # no calibration: the catalog comparison still stands
        res.data["local_error"] = _error(exc)
    res.data.update(catalog_gpu=entry, models=[], errors={})
    failed = False
    for case in _chosen(PROFILE_CASES[device_name]):
        try:
            res.data["models"].append(profile_case(case, device_name, rooflines))
        except Exception as exc:
            res.data["errors"][case.label] = _error(exc)
            failed = True
        res.save()
    # `pyplan inspect` as a user runs it, on the first model.
    first = (_chosen(PROFILE_CASES[device_name]) or PROFILE_CASES[device_name])[0]
    cmd = [sys.executable, "-m", "pyplan.cli", "inspect", f"zoo:{first.model}", "--json"]
    cmd += ["--batch-size", str(max(first.batch_sizes))]
    done = _run(cmd, deadline - time.time() - 5)
    inspect: dict[str, Any] = {"command": " ".join(cmd[1:]), "rc": done["rc"], "elapsed_s": done["elapsed_s"]}
    if done["rc"] == 0:
        data = json.loads(done["output"][done["output"].index("{") :])
        inspect.update(
            device=data["device"],
            fwd_time_s=data["fwd_time_s"],
            bwd_time_s=data["bwd_time_s"],
            blocks=[[b["name"], b["fwd_time_s"], b["bwd_time_s"]] for b in data["blocks"]],
        )
    else:
        inspect["output"] = _tail(done["output"], 2000)
        failed = True
    res.data["inspect"] = inspect
    res.finish("failed" if failed else "ok")
    return res.data["status"]


# --- accuracy -----------------------------------------------------------------------------------------------------


def check_accuracy(out: Path, device_name: str, deadline: float) -> str:
    res = Result(out, "accuracy")
    matrix, weights_of = ACCURACY[device_name]
    models = {m: weights_of[m] for m in _chosen(weights_of)}
    calibration = Path(os.environ["PYPLAN_CACHE_DIR"]) / "local.json"
    res.data.update(matrix=matrix, runs={})
    failed = False
    with tempfile.TemporaryDirectory(prefix="pyplan-gpu-accuracy-") as tmp:
        for k, model in enumerate(models):
            weights = list(models.values())[k:]
            report = Path(tmp) / f"{model}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "accuracy.py"), "--matrices", matrix, "--models", model]
            cmd += ["--launches", "1", "--attempts", "1", "--wait", "0", "--quiet-cores", "1000"]
            cmd += [*ACCURACY_PROTOCOL[device_name], "--json", str(report)]
            if calibration.exists():
                cmd += ["--calibration", str(calibration)]
            # This model's share of what is left, by weight among the models still to run.
            share = (deadline - time.time()) * weights[0] / sum(weights)
            done = _run(cmd, share)
            run: dict[str, Any] = {"rc": done["rc"], "timed_out": done["timed_out"], "elapsed_s": done["elapsed_s"]}
            if report.exists():
                run["report"] = json.loads(report.read_text())["matrices"].get(matrix)
            # accuracy.py exits 1 when a target is missed: that is a result, not a failure of the check.
            if done["rc"] not in (0, 1) or "report" not in run:
                run["output"] = _tail(done["output"], 4000)
                failed = True
            else:
                run["table"] = _tail(done["output"], 6000)
            res.data["runs"][model] = run
            res.save()
    res.finish("failed" if failed else "ok")
    return res.data["status"]


# --- llm ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlmCase:
    """A language model planned for this GPU's catalog entry (the analytic roofline a user's `--gpu h200` plans
    on) in `precision`, then trained as planned on the device: one plan per micro-batch size and remat policy."""

    model: str
    precision: str
    global_batch: int
    micro_batch_sizes: tuple[int, ...]
    remats: tuple[str, ...] = ("none", "full")

    @property
    def label(self) -> str:
        return f"{self.model} {self.precision}"


LLM_CASES = {
    "cuda": (
        LlmCase("llama-1b-style", "bf16-master", 4, (1, 2, 4)),
        LlmCase("gpt2-small", "bf16-mixed", 16, (4, 8, 16)),
    ),
    "cpu": (
        LlmCase("gpt-tiny", "bf16-master", 8, (4, 8)),
        LlmCase("gpt-tiny", "bf16-mixed", 8, (4, 8)),
    ),
}
LLM_PROTOCOL = {"cuda": (2, 5), "cpu": (1, 1)}  # warm-up and timed steps


def llm_plans(case: LlmCase, entry: str) -> list[dict[str, Any]]:
    """The catalog plan of `case` for each micro-batch size and remat policy on one GPU of `entry` (1F1B on one
    device: gradient accumulation), as `pyplan plan --gpu ENTRY --precision ...` would rank it first."""
    import torch

    from pyplan import load_model, search
    from pyplan.errors import InfeasibleError
    from pyplan.hardware import Cluster
    from pyplan.plan import Workload

    spec = load_model(f"zoo:{case.model}")
    with torch.device("meta"):
        model = spec.build()
    rows = []
    for remat in case.remats:
        for b in case.micro_batch_sizes:
            row: dict[str, Any] = {"micro_batch_size": b, "remat": remat}
            t0 = time.perf_counter()
            try:
                found = search(
                    model,
                    spec.example_inputs,
                    Cluster.from_catalog(entry, 1),
                    Workload(global_batch=case.global_batch, precision=case.precision),
                    schedules=("1F1B",),
                    zero_stages=(0,),
                    micro_batch_sizes=(b,),
                    remat=remat,
                    allow_fewer_gpus=False,
                    loss=spec.loss,
                    target=spec.target,
                )
            except InfeasibleError as exc:
                row.update(status="infeasible", reason=str(exc))
            else:
                p = found.best
                row.update(
                    status="planned",
                    plan=p.to_json(),
                    predicted_s=p.predicted.iteration_s,
                    predicted_bytes=p.predicted.peak_memory_bytes,
                    predicted_recompute_s=p.predicted.recompute_s,
                    predicted_optimizer_s=p.predicted.optimizer_s,
                    num_microbatches=p.layout.num_microbatches,
                )
            row["search_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
    return rows


def llm_measure(case: LlmCase, row: dict[str, Any], device_name: str, model: Any) -> None:
    """Train `row`'s plan on the device as the emitted script does (`build_trainer` with the plan's precision) from
    a copy of `model` (built on the host, as the emitted script builds it: its stages are cut on the host): the
    peak `max_memory_allocated` over a steady step, less what was allocated before, and the median step time (the
    wall clock around a synchronize) of the timed steps; into `row`."""
    import copy
    import gc

    import torch

    from pyplan import load_model
    from pyplan.plan import Plan
    from pyplan.runtime.trainer import build_trainer, optimizer_factory

    warmup, steps = LLM_PROTOCOL[device_name]
    device = torch.device(device_name, 0) if device_name == "cuda" else torch.device("cpu")
    spec = load_model(f"zoo:{case.model}")
    layout = Plan.from_json(row["plan"]).layout
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    trainer = build_trainer(
        spec, copy.deepcopy(model), layout, optimizer_factory("adamw", 1e-4), device=device, precision=case.precision
    )
    x = tuple(t.to(device) for t in spec.example_inputs(case.global_batch))
    y = spec.target(case.global_batch).to(device)
    times, losses = [], []
    for k in range(warmup + steps):
        if device.type == "cuda" and k == warmup - 1:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        out = trainer.step(x, y)
        _sync(device)
        if k == warmup - 1 and device.type == "cuda":
            row["measured_bytes"] = torch.cuda.max_memory_allocated(device) - before
        if k >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(sum(float(v) for v in out) / max(1, len(out))))
    row.update(
        measured_s=statistics.median(times),
        step_s=times,
        losses=losses,
        time_error=row["predicted_s"] / statistics.median(times) - 1,
    )
    if "measured_bytes" in row:
        row["memory_error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
    if device.type == "cuda":
        row["device"] = _device_busy(functools.partial(trainer.step, x, y), device)
    del trainer, x, y, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reprice_llm(llm_file: Path) -> list[dict[str, Any]]:
    """An llm check's result planned again with the model as it is now, on this machine (no GPU): per measured
    configuration, the new prediction beside the recorded one and what was measured."""
    data = json.loads(llm_file.read_text())
    cases = {(c.model, c.precision): c for c in (*LLM_CASES["cuda"], *LLM_CASES["cpu"])}
    rows = []
    for m in data["models"]:
        measured = [r for r in m["rows"] if r["status"] == "measured"]
        if not measured:
            continue
        case = replace(
            cases[(m["model"], m["precision"])],
            micro_batch_sizes=tuple(sorted({r["micro_batch_size"] for r in measured})),
            remats=tuple(dict.fromkeys(r["remat"] for r in measured)),
        )
        new = {(r["micro_batch_size"], r["remat"]): r for r in llm_plans(case, data["catalog_gpu"])}
        for r in measured:
            now = new[(r["micro_batch_size"], r["remat"])]
            rows.append(
                {
                    "label": f"{case.label} b={r['micro_batch_size']} remat {r['remat']}",
                    "time": now.get("predicted_s", math.nan) / r["measured_s"],
                    "time_recorded": r["predicted_s"] / r["measured_s"],
                    "memory": now.get("predicted_bytes", math.nan) / r["measured_bytes"],
                    "memory_recorded": r["predicted_bytes"] / r["measured_bytes"],
                }
            )
    return rows


def _device_busy(step: Callable[[], object], device: Any) -> dict[str, Any]:
    """One more step under torch.profiler: the kernels it launched and the GPU's busy time (their durations, one
    stream) beside the step's wall time. Busy time near the wall time: the GPU's work sets the step's time; far
    under it: the host, launching kernels, does."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        _sync(device)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy = sum(e.device_time_total for e in kernels) / 1e6
        return {"kernels": len(kernels), "busy_s": busy, "profiled_wall_s": wall}
    except Exception as exc:  # the profile is extra: its failure leaves the row measured
        return {"error": _error(exc)}


def check_llm(out: Path, device_name: str, deadline: float) -> str:
    """Each LLM_CASES model planned for the GPU's catalog entry and trained as planned: predicted against measured
    step time and peak memory, per configuration."""
    import torch
    import torch.distributed as dist

    from pyplan import load_model

    res = Result(out, "llm")
    entry = catalog_gpu(device_name)
    res.data.update(catalog_gpu=entry, models=[], errors={})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device_name == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device_name == "cuda" else "gloo", rank=0, world_size=1)
    failed = False
    try:
        for case in _chosen(LLM_CASES[device_name]):
            entry_rows: dict[str, Any] = {"model": case.model, "precision": case.precision, "rows": []}
            res.data["models"].append(entry_rows)
            try:
                entry_rows["rows"] = llm_plans(case, entry)
                res.save()
                # Built once (a 1B model's random init takes longer on the host than its steps on the GPU).
                torch.manual_seed(0)
                model = load_model(f"zoo:{case.model}").build()
                for row in entry_rows["rows"]:
                    if row["status"] != "planned" or time.time() > deadline - 20:
                        continue
                    try:
                        llm_measure(case, row, device_name, model)
                        row["status"] = "measured"
                    except Exception as exc:
                        row.update(status="failed", error=_error(exc))
                        failed = True
                    res.save()
            except Exception as exc:
                res.data["errors"][case.label] = _error(exc)
                failed = True
            res.save()
    finally:
        dist.destroy_process_group()
    res.finish("failed" if failed else "ok")
    return res.data["status"]


CHECK_FUNCTIONS: dict[str, Callable[[Path, str, float], str]] = {
    "env": check_env,
    "calibrate": check_calibrate,
    "gpu_tests": check_gpu_tests,
    "profile": check_profile,
    "accuracy": check_accuracy,
    "llm": check_llm,
}


# --- the driver ---------------------------------------------------------------------------------------------------


def _fmt(x: Any, spec: str = ".2f") -> str:
    return format(x, spec) if isinstance(x, int | float) and math.isfinite(x) else "-"


def summary_lines(out: Path) -> Iterator[str]:
    """A short table of what each check's file says."""
    for check in CHECKS:
        path = out / f"{check}.json"
        if not path.exists():
            yield f"{check:10} not run"
            continue
        d = json.loads(path.read_text())
        head = f"{check:10} {d['status']:8} {d.get('elapsed_s', 0):6.1f} s"
        if check == "env":
            mm, cp = d.get("matmul", {}), d.get("copy", {})
            yield (
                f"{head}  {d.get('gpu', d.get('device'))}, torch {d.get('torch')}, matmul "
                f"{_fmt(mm.get('flops_per_s', math.nan) / 1e12, '.0f')} TFLOP/s, copy "
                f"{_fmt(cp.get('bytes_per_s', math.nan) / 1e12, '.2f')} TB/s"
            )
            heads = " ".join(f"{r['vocab']}/{r['product']} {r['flops_per_s'] / 1e12:.0f}" for r in d.get("head", []))
            yield f"{'':10} head products TFLOP/s: {heads}"
        elif check == "calibrate":
            gpu = d.get("calibration", {}).get("gpu", {})
            peaks = {k: round(v / 1e12, 1) for k, v in gpu.get("peak_flops_per_s", {}).items()}
            bandwidth = _fmt(gpu.get("hbm_bw_bytes_per_s", math.nan) / 1e12)
            yield f"{head}  peaks TFLOP/s {peaks}, bandwidth {bandwidth} TB/s"
        elif check == "gpu_tests":
            yield f"{head}  {d.get('counts')}"
        elif check == "profile":
            yield f"{head}  catalog entry {d.get('catalog_gpu')}; errors: {sorted(d.get('errors', {}))}"
            for m in d.get("models", []):
                for key, c in m["compare"].items():
                    blk = c["blocks"]
                    yield (
                        f"{'':10} {m['model']} {m['dtype']} b={m['batch_size']} {key:8} whole step "
                        f"{_fmt(c['whole_step'])} (measured {_fmt((m['whole_fwd_s'] + m['whole_bwd_s']) * 1e3)} ms, "
                        f"blocks {_fmt(m['blocks_sum_s'] * 1e3)} ms), blocks median {_fmt(blk['weighted_median'])}, "
                        f"worst {_fmt(blk['worst'])}"
                    )
        elif check == "accuracy":
            for model, run in d.get("runs", {}).items():
                s = (run.get("report") or {}).get("summary") or {}
                yield (
                    f"{head}  {model}: time median {_fmt(s.get('time_median', math.nan) * 100, '.1f')} %, worst "
                    f"{_fmt(s.get('time_worst', math.nan) * 100, '.1f')} %, memory worst "
                    f"{_fmt(s.get('memory_worst', math.nan) * 100, '.1f')} %, rc {run.get('rc')}"
                )
        elif check == "llm":
            yield f"{head}  catalog entry {d.get('catalog_gpu')}; errors: {sorted(d.get('errors', {}))}"
            for m in d.get("models", []):
                for r in m["rows"]:
                    yield (
                        f"{'':10} {m['model']} {m['precision']} b={r['micro_batch_size']} remat {r['remat']:5} "
                        f"{r['status']:10} time {_fmt(r.get('predicted_s', math.nan) * 1e3, '.1f')} / "
                        f"{_fmt(r.get('measured_s', math.nan) * 1e3, '.1f')} ms, peak "
                        f"{_fmt(r.get('predicted_bytes', math.nan) / 1e9)} / "
                        f"{_fmt(r.get('measured_bytes', math.nan) / 1e9)} GB"
                    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("out", type=Path, help="folder for the result files (created)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry run, tiny models")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run's time limit")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument(
        "--calibration",
        type=Path,
        help="a calibration file of this device (or a calibrate check's result), instead of calibrating",
    )
    parser.add_argument("--models", nargs="+", help="only these models in the profile and accuracy checks")
    parser.add_argument(
        "--reprice",
        type=Path,
        metavar="RESULT_JSON",
        help="price a profile or llm check's result again with the model as it is now (no GPU; `out` is not written)",
    )
    parser.add_argument("--check", choices=CHECKS, help=argparse.SUPPRESS)  # one check, in its own process
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reprice is not None and json.loads(args.reprice.read_text()).get("check") == "llm":
        for r in reprice_llm(args.reprice):
            print(
                f"{r['label']:44} predicted / measured: time {_fmt(r['time'], '.3f')} (recorded "
                f"{_fmt(r['time_recorded'], '.3f')}), peak memory {_fmt(r['memory'], '.3f')} (recorded "
                f"{_fmt(r['memory_recorded'], '.3f')})"
            )
        return 0
    if args.reprice is not None:
        for r in reprice(args.reprice, args.calibration):
            print(
                f"{r['label']:30} {r['roofline']:8} whole step {_fmt(r['whole_step'])} (recorded "
                f"{_fmt(r['recorded'])}), forward {_fmt(r['fwd'])}, backward {_fmt(r['bwd'])}, blocks median "
                f"{_fmt(r['blocks_median'])}"
            )
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    global ONLY
    ONLY = set(args.models) if args.models else None
    if args.check:
        try:
            status = CHECK_FUNCTIONS[args.check](args.out, args.device, args.deadline)
        except Exception as exc:
            path = args.out / f"{args.check}.json"
            data = json.loads(path.read_text()) if path.exists() else {"check": args.check}
            data.update(status="error", error=_error(exc))
            _write(path, data)
            raise
        return 0 if status == "ok" else 1
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("torch sees no CUDA device; --device cpu runs the dry run")
    end = time.time() + args.budget_s
    statuses = {}
    with tempfile.TemporaryDirectory(prefix="pyplan-gpu-check-") as cache:
        env = {**os.environ, "PYPLAN_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
        if args.calibration is not None:
            data = json.loads(args.calibration.read_text())
            (Path(cache) / "local.json").write_text(json.dumps(data.get("calibration", data)))
        for check in args.checks:
            left = end - time.time()
            if left < 5:
                _write(args.out / f"{check}.json", {"check": check, "status": "timeout", "elapsed_s": 0.0})
                statuses[check] = "timeout"
                continue
            deadline = time.time() + min(LIMITS_S[check], left)
            cmd = [sys.executable, __file__, str(args.out), "--device", args.device, "--check", check]
            cmd += ["--deadline", str(deadline)] + (["--models", *args.models] if args.models else [])
            print(f"[gpu_check] {check}: up to {deadline - time.time():.0f} s", flush=True)
            # The check itself stops its children at the deadline; this margin lets it write what it has.
            done = _run(cmd, deadline - time.time() + 15, env)
            path = args.out / f"{check}.json"
            data = json.loads(path.read_text()) if path.exists() else {"check": check}
            if done["timed_out"] or data.get("status") == "running":
                data["status"] = "timeout" if done["timed_out"] else "error"
            if done["rc"] != 0:
                data["process_output"] = _tail(done["output"], 4000)
            _write(path, data)
            statuses[check] = data["status"]
            print(f"[gpu_check] {check}: {data['status']} in {done['elapsed_s']:.0f} s", flush=True)
    for line in summary_lines(args.out):
        print(line)
    return 0 if all(s == "ok" for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
