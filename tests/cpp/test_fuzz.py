"""Seeded fuzzing of every binding of pyplan._core (as listed by bindings/*.cpp) with valid and invalid inputs.

Each call must return a result or raise ValueError: no crash, no other exception, no NaN anywhere, and no ∞ in a
plain number or in a result reported feasible. The inputs mix valid instances with huge, negative and zero ints
(up to 64 bits), NaN, ±∞, 1e308, denormals, and empty or mismatched arrays. Each binding runs in its own
subprocess that loads the extension alone (no torch), so a crash fails its test and names the call; the seeds are
fixed. In total about 7 s on two cores (25 s under the sanitizers).

Under AddressSanitizer and UndefinedBehaviorSanitizer (CMakeLists.txt's PYPLAN_SANITIZE, every report fatal), from
the repository root (libstdc++ is preloaded too, so that ASan finds the __cxa_throw it intercepts):

    pip install --no-build-isolation -e . -q -Ccmake.define.PYPLAN_SANITIZE=ON -Cbuild-dir=build/sanitize
    LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0 \\
        python -m pytest -q -p no:cacheprovider tests/cpp/test_fuzz.py tests/cpp/test_limits.py
    pip install --no-build-isolation -e . -q  # back to the release build

`python tests/cpp/test_fuzz.py [PATH_OF_THE_EXTENSION [BINDING ...]]` runs the fuzzing of every binding (or of
those named) in one process.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import math
import os
import random
import re
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEED = 20240611
CALLS = 5000  # per binding

INT_MAX = 2**31 - 1
# Near-cap sizes that are valid (2^20 micro-batches) build orders of millions of actions: only values beyond it.
INTS = (0, 1, 2, 3, 4, -1, -7, -(2**31), INT_MAX, 2**31, -(2**31) - 1, 2**40, -(2**63), 2**63 - 1, 2**20 + 1)
FLOATS = (
    0.0, -0.0, 1.0, 0.5, 1e-3, 1e-300, 5e-324, 1e9, 1.000001e9, 1e18, 1e100, 1e101, 1e200, 1e308,
    -1.0, -1e-300, -1e308, math.nan, math.inf, -math.inf,
)  # fmt: skip
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


# ---- inputs ---------------------------------------------------------------------------------------------------


class Gen:
    """Random inputs: mostly valid values, each replaced by an edge case with probability `p_bad`."""

    def __init__(self, rng: random.Random, p_bad: float) -> None:
        self.rng = rng
        self.p_bad = p_bad

    def bad(self) -> bool:
        return self.rng.random() < self.p_bad

    def int(self, lo: int, hi: int) -> int:
        return self.rng.choice(INTS) if self.bad() else self.rng.randint(lo, hi)

    def float(self, lo: float, hi: float) -> float:
        return self.rng.choice(FLOATS) if self.bad() else self.rng.uniform(lo, hi)

    def floats(self, n: int, lo: float, hi: float) -> list[float]:
        if self.bad():
            n = self.rng.choice((0, max(0, n - 1), n + 1))
        return [self.float(lo, hi) for _ in range(n)]

    def ints(self, n: int, lo: int, hi: int) -> list[int]:
        if self.bad():
            n = self.rng.choice((0, max(0, n - 1), n + 1))
        return [self.int(lo, hi) for _ in range(n)]

    def choice(self, options: tuple[Any, ...], wrong: Any = "Bogus") -> Any:
        return wrong if self.bad() else self.rng.choice(options)


Call = tuple[list[Any], dict[str, Any]]


def _cost(name: str) -> Callable[[Gen, ModuleType], Call]:
    def make(g: Gen, _core: ModuleType) -> Call:
        link = {"latency_s": g.float(0, 1e-3), "bw_bytes_per_s": g.float(1e6, 1e12)}
        if name == "p2p_time_s":
            return [g.float(0, 1e9)], link
        if name in ("ring_allreduce_time_s", "reduce_scatter_time_s", "all_gather_time_s"):
            return [g.float(0, 1e9), g.int(1, 64)], link
        if name == "hierarchical_allreduce_time_s":
            links = {f"{where}_{k}": g.float(*span) for where in ("intra", "inter")
                     for k, span in (("latency_s", (0, 1e-3)), ("bw_bytes_per_s", (1e6, 1e12)))}  # fmt: skip
            return [g.float(0, 1e9), g.int(1, 8), g.int(1, 8)], links
        if name == "zero_model_state_bytes":
            per = {k: g.float(0, 16) for k in ("param_bytes", "grad_bytes", "optim_bytes")}
            return [g.float(0, 1e10), g.int(1, 64), g.int(0, 3)], per
        if name == "pipeline_time_s":
            return [g.floats(g.rng.randint(1, 5), 0, 10), g.int(1, 16)], {}
        if name == "bubble_fraction":
            return [g.int(1, 8), g.int(1, 16), g.int(1, 4)], {}
        if name == "optimizer_step_time_s":
            return [g.float(0, 1e10), g.float(0, 1e10), g.float(1e9, 1e13)], {}
        raise KeyError(name)

    return make


def _held(g: Gen, _core: ModuleType) -> Call:
    return [g.int(1, 8), g.int(1, 8), g.int(0, 4)], {}


def _partition(g: Gen, _core: ModuleType) -> Call:
    n = g.rng.randint(1, 6)
    p = g.int(1, n)
    stages = p if 1 <= p <= 8 else 2
    m = g.int(1, 8)
    kwargs: dict[str, Any] = {
        "num_stages": p,
        "num_microbatches": m,
        "mem_limit_bytes": g.floats(stages, 1e6, 1e10) if g.rng.random() < 0.8 else [math.inf] * stages,
        "schedule": g.choice(("GPipe", "1F1B")),
        "objective": g.choice(("pipeline_time", "bottleneck")),
        "latency_s": g.float(0, 1e-4),
        "bw_bytes_per_s": g.float(1e8, 1e11) if g.rng.random() < 0.8 else math.inf,
    }
    if g.rng.random() < 0.4:
        kwargs["in_flight_per_stage"] = g.ints(stages, 1, m if 1 <= m <= 8 else 1)
    if g.rng.random() < 0.4:
        kwargs["input_buffer_cuts"] = g.ints(stages, 0, 8)
    if g.rng.random() < 0.4:
        kwargs["output_buffer_cuts"] = g.ints(stages, 0, 9)
    arrays = [g.floats(n, 0, 1e-2), g.floats(n, 0, 2e-2), g.floats(n, 0, 1e8), g.floats(n, 0, 1e9),
              g.floats(n + 1, 0, 1e7)]  # fmt: skip
    return arrays, kwargs


def _placement(g: Gen, _core: ModuleType) -> Call:
    return [g.choice(SCHEDULES), g.int(1, 6), g.int(1, 3)], {}


def _warmup(g: Gen, _core: ModuleType) -> Call:
    stages = g.int(1, 6)
    return [g.choice(SCHEDULES), g.int(1, 12), stages, g.int(0, max(0, min(stages, 6) - 1))], {}


def _shape(g: Gen, _core: ModuleType) -> Call:
    return [g.choice(SCHEDULES), g.int(1, 4), g.int(1, 8), g.int(1, 2)], {}


def _simulate(g: Gen, core: ModuleType) -> Call:
    """A valid order of a small schedule, then its times, placement and actions perturbed."""
    rng = g.rng
    for _ in range(100):
        schedule, p, m, v = rng.choice(SCHEDULES), rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 2)
        if not core.torch_rejection(schedule, p, m, v):
            break
    order = [list(rank) for rank in core.schedule_order(schedule, p, m, v)]
    stages = p * v
    for _ in range(rng.choice((0, 0, 1, 2))):  # drop, repeat or rewrite an action
        rank = rng.choice(order)
        if not rank:
            continue
        k = rng.randrange(len(rank))
        kind = rng.randrange(3)
        if kind == 0:
            rank.pop(k)
        elif kind == 1:
            rank.insert(k, rank[k])
        else:
            rank[k] = (g.int(0, stages - 1), rng.choice(("F", "B", "I", "W", "X")), g.int(0, m - 1))
    backward = g.floats(stages, 1e-3, 2.0)
    weight = ([min(b, rng.uniform(0, 1.0)) if isinstance(b, float) and b >= 0 else 0.0 for b in backward]
              if rng.random() < 0.9 else g.floats(stages, 0, 1.0))  # fmt: skip
    return [
        order,
        g.ints(stages, 0, p - 1) if rng.random() < 0.2 else list(core.stage_placement(schedule, p, v)),
        g.floats(stages, 1e-3, 1.0),
        backward,
        weight,
        g.floats(stages - 1, 0, 0.1),
        g.floats(stages - 1, 0, 0.1),
        g.int(1, 8) if rng.random() < 0.2 else m,
    ], {}


def _search(g: Gen, core: ModuleType) -> Call:
    n = g.rng.randint(1, 4)
    arrays = [
        g.floats(n, 0, 4e-3), g.floats(n, 0, 1e-3), g.floats(n, 0, 8e-3), g.floats(n, 0, 2e-3),
        g.floats(n, 0, 1e7), g.floats(n, 0, 1e5), g.floats(n, 0, 2e6), g.floats(n + 1, 0, 2e5), g.floats(n + 1, 0, 1e4),
    ]  # fmt: skip
    rng = g.rng
    kwargs: dict[str, Any] = {
        "num_gpus": g.int(1, 8) if rng.random() < 0.95 else core.MAX_GPUS,
        "gpus_per_node": g.int(1, 4),
        "gpu_mem_bytes": g.float(1e8, 1e11),
        "mem_bw_bytes_per_s": g.float(1e11, 1e12),
        "intra_latency_s": g.float(0, 1e-5),
        "intra_bw_bytes_per_s": g.float(1e10, 1e11),
        "inter_latency_s": g.float(0, 1e-5),
        "inter_bw_bytes_per_s": g.float(1e9, 1e10),
        "price_per_gpu_s": g.float(0, 1e-3),
        "global_batch": g.int(1, 64),
        "param_bytes": g.float(0, 4),
        "grad_bytes": g.float(0, 4),
        "optim_bytes": g.float(0, 12),
        "allow_fewer_gpus": rng.random() < 0.3,
        "objective": g.choice(("time", "cost", "weighted"), "speed"),
        "weight": g.float(0, 256),
        "top_k": g.int(1, 5),
    }
    if rng.random() < 0.3:
        kwargs["micro_batch_sizes"] = g.ints(rng.randint(1, 3), 1, 16)
    if rng.random() < 0.3:
        kwargs["schedules"] = [g.choice(SCHEDULES[:4], "ZBVZeroBubble") for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        kwargs["zero_stages"] = g.ints(rng.randint(1, 3), 0, 3)
    if rng.random() < 0.2:
        kwargs["placements"] = [g.choice(("pp-inner", "dp-inner"), "diagonal")]
    if rng.random() < 0.3:
        kwargs["param_tensors"] = g.floats(n, 0, 12)
        kwargs["cut_tensors"] = g.floats(n + 1, 0, 3)
    if rng.random() < 0.3:
        kwargs["intra_collective"] = (g.float(0, 1e-5), g.float(1e9, 1e11))
        kwargs["inter_collective"] = (g.float(0, 1e-5), g.float(1e8, 1e10))
    if rng.random() < 0.3:
        keys = ("stage_forward_s", "stage_backward_s", "message_s", "step_s", "optimizer_tensor_s",
                "optimizer_element_s")  # fmt: skip
        kwargs["host"] = {k: g.float(0, 1e-3) for k in rng.sample(keys, rng.randint(1, len(keys)))}
        kwargs["host"]["sync_overlaps_backward"] = rng.random() < 0.5
    if rng.random() < 0.3:
        sizes = sorted(rng.sample((1.0, 2.0, 4.0, 8.0), rng.randint(2, 3)))
        kwargs["time_sizes"] = [g.float(1, 16) if g.bad() else b for b in sizes]
        kwargs["fwd_points_s"] = g.floats(n * len(sizes), 0, 4e-3)
        kwargs["bwd_points_s"] = g.floats(n * len(sizes), 0, 8e-3)
    return arrays, kwargs


def _remat_chain(g: Gen, core: ModuleType) -> list[Any]:
    """The ten chain arguments of remat and remat_min_peak: sizes as pyplan's replay counts them."""
    rng = g.rng
    n = rng.randint(1, 5) if rng.random() < 0.95 else g.int(1, 5)
    n = n if 1 <= n <= 8 else 0
    out = [rng.uniform(1, 8) for _ in range(n)]
    kept = [o + rng.uniform(0, 15) for o in out]
    grad = [rng.uniform(1, 6) for _ in range(n + 1)]
    values: list[Any] = []
    if rng.random() < 0.3 and n:  # block i's output as one value live to a later cut, saved by none or by i
        values = [(i, out[i], min(n, i + 1 + rng.randint(0, 2)), [] if rng.random() < 0.5 else [i])
                  for i in range(n)]  # fmt: skip
        if g.bad():
            k = rng.randrange(n)
            values[k] = (g.int(0, n - 1), g.float(0, 8), g.int(1, n), [g.int(0, n - 1)])
    return [
        g.floats(n, 1, 9), g.floats(n, 1, 18), [g.float(k, k) for k in kept], [g.float(o, o) for o in out],
        [k + rng.uniform(0, 5) for k in kept], [o + rng.uniform(0, 5) for o in out],
        [kept[i] + grad[i] + grad[i + 1] + rng.uniform(0, 5) for i in range(n)], g.floats(n + 1, 1, 6),
        values, [True] * n if rng.random() < 0.7 else [rng.random() < 0.8 for _ in range(n)],
    ]  # fmt: skip


def _remat(g: Gen, core: ModuleType) -> Call:
    arrays = _remat_chain(g, core)
    rng = g.rng
    kwargs: dict[str, Any] = {
        "budget_bytes": g.float(10, 200),
        "slots": rng.choice((1, 7, 100, 500, core.MAX_REMAT_SLOTS)) if not g.bad() else rng.choice(INTS),
        "offload_bw_bytes_per_s": rng.choice((0.0, rng.uniform(0.5, 4.0))) if not g.bad() else rng.choice(FLOATS),
        "max_depth": g.int(-1, 3),
        "in_flight": g.int(1, 3),
        "checkpoint_s": g.float(0, 2),
    }
    if rng.random() < 0.3:
        kwargs["checkpoint_block_s"] = g.floats(len(arrays[0]), 0, 3)
    return arrays, kwargs


def _remat_min_peak(g: Gen, core: ModuleType) -> Call:
    return _remat_chain(g, core), {"offload": g.rng.random() < 0.5, "max_depth": g.int(-1, 3)}


FUZZERS: dict[str, Callable[[Gen, ModuleType], Call]] = {
    **{name: _cost(name) for name in (
        "p2p_time_s", "ring_allreduce_time_s", "reduce_scatter_time_s", "all_gather_time_s",
        "hierarchical_allreduce_time_s", "zero_model_state_bytes", "pipeline_time_s", "bubble_fraction",
        "optimizer_step_time_s")},
    "held_input_cuts": _held,
    "partition": _partition,
    "stage_placement": _placement,
    "warmup_send_held": _warmup,
    "torch_rejection": _shape,
    "schedule_order": _shape,
    "lower_order": _shape,
    "receive_buffers": _shape,
    "in_flight_peaks": _shape,
    "simulate": _simulate,
    "search": _search,
    "remat": _remat,
    "remat_min_peak": _remat_min_peak,
}  # fmt: skip


# ---- checks ---------------------------------------------------------------------------------------------------


def _numbers(value: Any, depth: int = 0) -> Iterator[tuple[str, float]]:
    """Every float reachable from a result: lists, tuples, dicts and the read-only fields of the core's classes."""
    if isinstance(value, float):
        yield "", value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _numbers(item, depth)
    elif isinstance(value, dict):
        for key, item in value.items():
            for where, x in _numbers(item, depth):
                yield f"{key}{where}", x
    elif type(value).__module__ == "pyplan._core" and depth < 3:
        for name in dir(value):
            if not name.startswith("_") and not callable(item := getattr(value, name)):
                for where, x in _numbers(item, depth + 1):
                    yield f".{name}{where}", x


def check(result: Any) -> None:
    """No NaN anywhere; no ∞ in a plain number or in a result reported feasible."""
    repr(result)
    feasible = getattr(result, "feasible", True)
    for where, x in _numbers(result):
        assert not math.isnan(x), f"NaN at {where or 'the result'}"
        assert not (feasible and math.isinf(x)), f"{x} at {where or 'the result'} (feasible: {feasible})"


def fuzz(core: ModuleType, name: str, calls: int = CALLS) -> dict[str, int]:
    """`calls` seeded calls of one binding; each is written to stderr before it runs (a crash leaves it last)."""
    rng = random.Random(SEED ^ zlib.crc32(name.encode()))
    function = getattr(core, name)
    outcome = {"result": 0, "ValueError": 0}
    for k in range(calls):
        g = Gen(rng, p_bad=(0.0, 0.05, 0.2, 0.5)[k % 4])
        args, kwargs = FUZZERS[name](g, core)
        print(f"{name}(*{args!r}, **{kwargs!r})", file=sys.stderr, flush=True)
        try:
            result = function(*args, **kwargs)
        except ValueError as error:
            message = str(error)
            assert message and "\n" not in message, f"not one line: {message!r}"
            outcome["ValueError"] += 1
            continue
        check(result)
        outcome["result"] += 1
    return outcome


def load(path: str) -> ModuleType:
    """The extension at `path` as pyplan._core, without importing the pyplan package (and torch)."""
    loader = importlib.machinery.ExtensionFileLoader("pyplan._core", path)
    spec = importlib.util.spec_from_loader("pyplan._core", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def bound_names() -> set[str]:
    """The functions bindings/*.cpp define on the module."""
    names: set[str] = set()
    for path in glob.glob(os.path.join(ROOT, "bindings", "*.cpp")):
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r'm\.def\(\s*"(\w+)"', f.read()))
    return names


# ---- tests ----------------------------------------------------------------------------------------------------


def _extension_path() -> str:
    from pyplan import _core

    return _core.__file__


def test_every_binding_is_fuzzed() -> None:
    assert bound_names() == set(FUZZERS)


def _run_fuzz(name: str) -> None:
    got = subprocess.run(
        [sys.executable, __file__, _extension_path(), name],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    last = got.stderr.strip().splitlines()[-3:]
    assert got.returncode == 0, f"{name}: exit {got.returncode}; last lines:\n" + "\n".join(last)
    counts = dict(re.findall(r"(\w+)=(\d+)", got.stdout))
    # Both outcomes occur: the valid calls reach the solver, the invalid ones its checks.
    assert int(counts["result"]) > 0 and int(counts["ValueError"]) > 0, got.stdout


@pytest.mark.parametrize("name", sorted(FUZZERS))
def test_binding_survives_fuzzing(name: str) -> None:
    _run_fuzz(name)


if __name__ == "__main__":
    core = load(sys.argv[1] if len(sys.argv) > 1 else _extension_path())
    for binding in sys.argv[2:] or sorted(FUZZERS):
        counts = fuzz(core, binding)
        print(binding, " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
