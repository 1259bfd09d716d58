"""CPU and wall-clock seconds of whole `pyplan plan` commands, tensor parallelism in the space, from an empty cache.

Run: `python benchmarks/plan_speed.py` (`--only NAME` for one case, `--repeat N` runs each, the median judged;
3 by default). Each case is the command a user types (the `pyplan` console script), run in a child process (its
imports, trace, profiles at every tensor-parallel degree, searches, refinement and output included) with
`PYPLAN_CACHE_DIR` a new empty directory, so that nothing is profiled ahead, and pyplan's modules compiled to
bytecode first, as an installed package has them. CPU seconds are the child's user + system time; wall seconds
beside them, as a shared machine stretches the one and not the other.

Targets: a Llama-style 70B model on 4,096 H100s at most 10 s of CPU; GPT-2 XL on 16 A100-80GB at most 5 s; and end
to end at least 20x less CPU than Galvatron's search on its own problem (benchmarks/GALVATRON.md: its GPT family's
Llama-2-7B profiles, sequence 2048, bf16, 8 GPUs at global batch 64 and 16 at 128, 158.4 and 317.9 s of CPU in the
run recorded there; not run again here), planned by pyplan from the model itself (zoo:llama-7b-style, the same
shapes) on A100-80GB. Results and their history: benchmarks/PLAN_SPEED.md.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rich.console import Console

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, machine, new_table, target_line, verdict

# Galvatron's search, CPU seconds, from the run benchmarks/GALVATRON.md records (2026-11-26, 8 and 16 GPUs).
GALVATRON_CPU_S = {8: 158.4, 16: 317.9}
# How many times less CPU than Galvatron's search a whole pyplan command must take.
GALVATRON_RATIO = 20.0


@dataclass(frozen=True)
class Case:
    """One command: its name, its `pyplan plan` arguments, and its ceiling in CPU seconds with what it is."""

    name: str
    args: tuple[str, ...]
    limit_cpu_s: float
    target: str


def _llama7b(gpus: int) -> Case:
    limit = GALVATRON_CPU_S[gpus] / GALVATRON_RATIO
    return Case(
        f"galvatron-{gpus}",
        ("zoo:llama-7b-style", "--gpus", str(gpus), "--gpu", "a100-80g", "--global-batch", str(8 * gpus)),
        limit,
        f"<= {limit:.1f} s ({GALVATRON_RATIO:.0f}x less than Galvatron's {GALVATRON_CPU_S[gpus]} s)",
    )


CASES = (
    Case(
        "llama-70b-4096",
        ("zoo:llama-70b-style", "--gpus", "4096", "--gpu", "h100", "--global-batch", "2048"),
        10.0,
        "<= 10 s",
    ),
    Case("gpt2-xl-16", ("zoo:gpt2-xl", "--gpus", "16", "--gpu", "a100-80g", "--global-batch", "64"), 5.0, "<= 5 s"),
    _llama7b(8),
    _llama7b(16),
)
# What every case adds: mixed precision, the answer as JSON (no table drawn). Tensor parallelism is in the space by
# default on a catalog GPU (--tp auto).
COMMON = ("--precision", "bf16-mixed", "--json")


@dataclass(frozen=True)
class Run:
    """What one case took."""

    cpu_s: float
    wall_s: float
    ok: bool
    error: str


def _bytecode() -> None:
    """pyplan's modules compiled to bytecode, as `pip install` leaves a package: a checkout installed with `-e` under
    PYTHONDONTWRITEBYTECODE (this machine sets it) would compile its 100-odd modules anew in every run, 0.6-0.8 s of
    CPU that no installed pyplan spends."""
    for name in ("pyplan", "_pyplan_start"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            raise SystemExit(f"{name} is not importable here: install pyplan into this environment")
        for where in spec.submodule_search_locations or ():
            compileall.compile_dir(where, quiet=1)
        if spec.origin and spec.origin.endswith(".py") and not spec.submodule_search_locations:
            compileall.compile_file(spec.origin, quiet=1)


def _command() -> list[str]:
    """The `pyplan` command as a user runs it: the console script beside this interpreter (its entry turns the
    garbage collector off while torch imports, which `python -m pyplan.cli` cannot: the package imports first)."""
    script = os.path.join(os.path.dirname(sys.executable), "pyplan")
    if not os.path.exists(script):
        raise SystemExit(f"no pyplan command beside {sys.executable}: install pyplan into this environment")
    return [sys.executable, script]


def run(case: Case) -> Run:
    """`pyplan plan` for `case` in a child process with an empty profile cache."""
    with tempfile.TemporaryDirectory(prefix="pyplan-cache-") as cache:
        env = {**os.environ, "PYPLAN_CACHE_DIR": cache}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        cmd = [*_command(), "plan", *case.args, *COMMON]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    error = done.stderr.strip().splitlines()[-1] if done.returncode and done.stderr.strip() else ""
    return Run(cpu, wall, done.returncode == 0, error)


def main() -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--only", choices=[c.name for c in CASES], help="run this case alone")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs per case; the median is judged (default 3: CPU seconds on a "
        "shared machine vary by 10 percent from run to run)",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes a positive count")
    cases = [c for c in CASES if args.only in (None, c.name)]
    _bytecode()
    console = Console()
    table = new_table(
        f"pyplan plan, tensor parallelism in the space, empty profile cache, median of {args.repeat} ({machine()})",
        ["case", "CPU s", "CPU s, runs", "wall s", "target (CPU)", "result"],
        left={"case", "CPU s, runs", "target (CPU)", "result"},
    )
    lines = []
    for case in cases:
        console.print(f"{case.name}: pyplan plan {' '.join(case.args + COMMON)}")
        runs = [run(case) for _ in range(args.repeat)]
        failed = next((r for r in runs if not r.ok), None)
        cpu, wall = statistics.median(r.cpu_s for r in runs), statistics.median(r.wall_s for r in runs)
        met = failed is None and cpu <= case.limit_cpu_s
        status = verdict(met) if failed is None else f"failed: {failed.error}"
        every = ", ".join(f"{r.cpu_s:.1f}" for r in runs)
        table.add_row(case.name, f"{cpu:.1f}", every, f"{wall:.1f}", case.target, status)
        lines.append(target_line(f"{case.name} {case.target} of CPU", met, f"median {cpu:.1f} s"))
    console.print(table)
    for line in lines:
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
