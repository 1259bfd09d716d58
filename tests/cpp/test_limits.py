"""Regressions of the core's integer and float edge cases (found by fuzzing under ASan/UBSan): each was a crash,
undefined behaviour, an unbounded allocation or an infinite result marked feasible, and is now a result or a
one-line ValueError naming the argument, its value and its range (cpp/include/pyplan/limits.h)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import pytest

from pyplan import _core

INT_MAX = 2**31 - 1
INT_MIN = -(2**31)

L = 3
CHAIN = {
    "fwd_alpha_s": [1e-3] * L,
    "fwd_beta_s": [1e-4] * L,
    "bwd_alpha_s": [2e-3] * L,
    "bwd_beta_s": [1e-4] * L,
    "act_per_sample_bytes": [1e6] * L,
    "act_fixed_bytes": [0.0] * L,
    "params": [1e6] * L,
    "cut_per_sample_bytes": [1e5] * (L + 1),
    "cut_fixed_bytes": [0.0] * (L + 1),
}
# Two A100-80GB GPUs in one node, mixed-precision Adam: what `pyplan plan --gpus 2 --gpu a100-80g` searches.
HARDWARE = {
    "num_gpus": 2,
    "gpus_per_node": 8,
    "gpu_mem_bytes": 80e9,
    "mem_bw_bytes_per_s": 2e12,
    "intra_latency_s": 1e-5,
    "intra_bw_bytes_per_s": 3e11,
    "inter_latency_s": 1e-5,
    "inter_bw_bytes_per_s": 2.5e10,
    "param_bytes": 2.0,
    "grad_bytes": 2.0,
    "optim_bytes": 12.0,
}


def _in_subprocess(code: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Runs `code` with `core` bound to this pyplan._core, loaded alone (no torch): a crash fails the test, not
    the test run."""
    prelude = (
        "import importlib.machinery, importlib.util\n"
        f"_loader = importlib.machinery.ExtensionFileLoader('pyplan._core', {_core.__file__!r})\n"
        "core = importlib.util.module_from_spec(importlib.util.spec_from_loader('pyplan._core', _loader))\n"
        "_loader.exec_module(core)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=timeout_s, check=False
    )


# 1. `pyplan plan examples/mlp.py --gpus 2 --gpu a100-80g --global-batch 2147483647` died with SIGFPE: the loop
# over micro-batch sizes b <= B/d overflowed int and took `% 0`.


def test_a_global_batch_of_int_max_is_searched() -> None:
    got = _in_subprocess(
        f"r = core.search(*{list(CHAIN.values())!r}, **{HARDWARE!r}, global_batch={INT_MAX})\n"
        "print(r.feasible, r.num_candidates, r.reason)\n"
    )
    assert got.returncode == 0, got.stderr[-2000:]
    # B is prime: b = 1 (m = B, left out: more stages x micro-batches than a schedule order holds) or b = B.
    assert got.stdout.startswith("False 1 no plan fits: the best candidate (dp=1, pp=2, b=2147483647, m=1")
    assert "2 candidates with more than 1048576 stages x micro-batches left out" in got.stdout


def test_micro_batch_sizes_are_the_divisors_found_in_square_root_time() -> None:
    start = time.perf_counter()
    result = _core.search(*CHAIN.values(), **{**HARDWARE, "num_gpus": 1}, global_batch=2**30, schedules=["GPipe"])
    assert time.perf_counter() - start < 10.0
    # b = 2^k for k = 10..30 (m = 2^(30-k) <= 2^20); the 10 sizes below that are left out.
    assert result.num_candidates == 21
    assert not result.feasible and "10 candidates with more than 1048576" in result.reason


# 2. Signed overflow: partition's buffer counts beyond INT_MAX, the in-flight counts with INT_MIN, the remat
# table's width near INT_MAX slots.


def test_buffer_counts_beyond_int_max_are_held() -> None:
    # Stage 0 holds 2^31 output-cut tensors of 1 byte (INT_MAX micro-batches' gradients and a kept send): 2^31
    # bytes, over its 1e9 limit. Counted in int, m + 1 wrapped to INT_MIN and the stage needed -2^31 bytes: "fit".
    got = _core.partition(
        [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0, 0.0],
        num_stages=2, num_microbatches=INT_MAX, mem_limit_bytes=[1e9, 1e10], output_buffer_cuts=[2**31, 0],
    )  # fmt: skip
    assert not got.feasible
    assert got.overflow.stage == 0 and got.overflow.need_bytes == 2.0**31


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _core.held_input_cuts(5, INT_MIN, 1), "in_flight must be in [1, 5], got -2147483648"),
        (lambda: _core.receive_buffers("GPipe", 2, INT_MAX, 1), "must be in [1, 1048576], got 2 x 1 x 2147483647"),
        (lambda: _core.partition([1.0], [1.0], [0.0], [0.0], [0.0, 0.0], num_stages=1, num_microbatches=1,
                                 mem_limit_bytes=[1.0], input_buffer_cuts=[-(2**63)]),
         "input_buffer_cuts[0] must be in [0, 1000000000000000000], got -9223372036854775808"),
        (lambda: _core.held_input_cuts(INT_MAX, 0, 1), "in_flight must be in [1, 2147483647], got 0"),
        (lambda: _core.held_input_cuts(4, 2, INT_MIN), "stage must be >= 0, got -2147483648"),
        (lambda: _core.warmup_send_held("1F1B", INT_MAX, INT_MAX, INT_MIN), "stage must be in [0, 2147483646]"),
        (lambda: _core.stage_placement("GPipe", INT_MAX, INT_MAX), "num_ranks x stages_per_rank must be in [1, "),
        (lambda: _core.schedule_order("GPipe", 2, INT_MAX, 1), "must be in [1, 1048576], got 2 x 1 x 2147483647"),
        (lambda: _core.partition([1.0], [1.0], [0.0], [0.0], [0.0, 0.0], num_stages=2**40, num_microbatches=1,
                                 mem_limit_bytes=[1.0]), "num_stages must be in [1, 2147483647], got 1099511627776"),
        (lambda: _core.search(*CHAIN.values(), **{**HARDWARE, "num_gpus": 2**31}, global_batch=8),
         "num_gpus must be in [1, 1048576], got 2147483648"),
    ],
)  # fmt: skip
def test_ints_beyond_their_range_are_value_errors(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        call()  # type: ignore[operator]
    assert "\n" not in str(info.value)


# 3. Block times of 1e308 made the search return an infinite time with feasible = True.


def test_huge_block_times_are_rejected() -> None:
    huge = {**CHAIN, "fwd_beta_s": [1e308] * L}
    with pytest.raises(ValueError, match=re.escape("fwd_beta_s[0] must be in [0, 1e+09], got 1e+308")):
        _core.search(*huge.values(), **HARDWARE, global_batch=8)
    with pytest.raises(ValueError, match=re.escape("fwd_time_s[0] must be in [0, 1e+100], got 1e+308")):
        _core.partition([1e308] * 2, [1.0] * 2, [0.0] * 2, [0.0] * 2, [0.0] * 3, num_stages=1,
                        num_microbatches=INT_MAX, mem_limit_bytes=[math.inf])  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("stage_time_s[1] must be in [0, 1e+100], got inf")):
        _core.pipeline_time_s([1.0, math.inf], 4)
    with pytest.raises(ValueError, match=re.escape("link bw_bytes_per_s must be in [0.001, inf], got 1e-300")):
        _core.p2p_time_s(1e10, latency_s=0.0, bw_bytes_per_s=1e-300)


def test_the_largest_accepted_inputs_give_finite_results() -> None:
    top = {k: [_core.MAX_SECONDS if k.endswith("_s") else _core.MAX_BYTES] * len(v) for k, v in CHAIN.items()}
    result = _core.search(
        *top.values(), **{**HARDWARE, "gpu_mem_bytes": math.inf, "inter_bw_bytes_per_s": _core.MIN_BW_BYTES_PER_S,
                          "price_per_gpu_s": _core.MAX_PRICE_PER_S, "num_gpus": 4, "gpus_per_node": 2,
                          "param_bytes": _core.MAX_BYTES},
        global_batch=2**20, objective="weighted", weight=_core.MAX_PRICE_PER_S, micro_batch_sizes=[2**16, 2**18],
    )  # fmt: skip
    assert result.feasible
    for c in [*result.top, *result.pareto]:
        assert all(math.isfinite(x) for x in (c.iteration_s, c.cost_per_iteration, c.objective, c.peak_memory_bytes))
        assert all(math.isfinite(x) for x in (*c.stage_time_s, *c.stage_sync_s, *c.rank_memory_bytes))


# 4. The remat table grew as 1/budget (a 1-byte budget allocated 1.6 GB, smaller ones bad_alloc), and any budget
# above 0 was solved.


def _remat_args(out0: float) -> list:
    """Six blocks of 1 GB; block 0's output (`out0` bytes) is read last by block 2 and saved by no block, so block
    2's forward frees it: a table in slots of budget/500 bytes reached out0·500/budget slots past the budget."""
    n = 6
    gb = 1e9
    values = [(0, out0, 2, []), *((i, gb, i + 1, [i, i + 1] if i + 1 < n else [i]) for i in range(1, n))]
    arrays = [
        [1.0] * n, [2.0] * n, [gb] * n, [out0, *[gb] * (n - 1)], [gb] * n, [gb] * n, [3 * gb] * n, [0.0] * (n + 1),
        values, [True] * n,
    ]  # fmt: skip
    return arrays


def test_a_budget_below_the_least_any_plan_needs_is_answered_at_once() -> None:
    arrays = _remat_args(1e9)
    least = _core.remat_min_peak(*arrays)
    start = time.perf_counter()
    for budget in (1.0, 1e-300, 5e-324, least * (1 - 1e-9)):
        got = _core.remat(*arrays, budget_bytes=budget)
        assert not got.feasible and got.min_budget_bytes == least
        assert got.reason.endswith(f"the least any plan needs is {least / 2**30:.3g} GiB")
    assert time.perf_counter() - start < 1.0


def test_the_remat_table_width_is_capped() -> None:
    # A value far larger than the budget is freed (an inconsistent chain: block 0 keeps 1 GB of its 1e18-byte
    # output): the width stays at MAX_REMAT_SLOTS instead of 1e18·500/budget = 1e11 slots (rows of 400 GB), and
    # the plan found fits.
    arrays = _remat_args(1e18)
    least = _core.remat_min_peak(*arrays)
    start = time.perf_counter()
    got = _core.remat(*arrays, budget_bytes=least * 1.5)
    assert time.perf_counter() - start < 2.0
    assert got.feasible and got.peak_bound_bytes <= least * 1.5
    assert all(math.isfinite(x) for x in (got.time_s, got.peak_bound_bytes, got.after_forward_bytes))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": _core.MAX_REMAT_SLOTS + 1}, f"slots must be in [1, {_core.MAX_REMAT_SLOTS}], got "),
        ({"slots": INT_MAX}, f"slots must be in [1, {_core.MAX_REMAT_SLOTS}], got 2147483647"),
        ({"slots": 0}, f"slots must be in [1, {_core.MAX_REMAT_SLOTS}], got 0"),
        ({"budget_bytes": math.inf}, "budget_bytes must be in (0, 1e+18], got inf"),
        ({"budget_bytes": 0.0}, "budget_bytes must be in (0, 1e+18], got 0"),
        ({"max_depth": -2}, "max_depth must be -1 (unbounded) or >= 0, got -2"),
        ({"in_flight": 0}, "in_flight must be >= 1, got 0"),
        ({"offload_bw_bytes_per_s": math.nan}, "offload_bw_bytes_per_s must be in 0 (no offloading) or [0.001"),
    ],
)
def test_remat_options_beyond_their_range_are_value_errors(change: dict, message: str) -> None:
    arrays = _remat_args(1e9)
    with pytest.raises(ValueError, match=re.escape(message)):
        _core.remat(*arrays, **{"budget_bytes": 1e10, **change})


def test_a_depth_beyond_the_chain_is_unbounded() -> None:
    arrays = _remat_args(1e9)
    least = _core.remat_min_peak(*arrays)
    assert _core.remat_min_peak(*arrays, max_depth=INT_MAX) == least
    deep = _core.remat(*arrays, budget_bytes=least, max_depth=INT_MAX)
    assert deep.time_s == _core.remat(*arrays, budget_bytes=least, max_depth=5).time_s
