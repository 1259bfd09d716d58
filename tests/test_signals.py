"""Signals: a killed `pyplan zoo` leaves no process behind, and Ctrl-C during a CP-SAT solve ends the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYPLAN = Path(sys.executable).with_name("pyplan")  # the console script, as users run it
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _processes() -> dict[int, tuple[int, str]]:
    """Every process: pid -> (parent pid, state letter)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            out[int(name)] = (int(ppid), state)
    return out


def _descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    procs = _processes()
    found = {root}
    while True:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        if not more:
            return found
        found |= more


def _alive(pids: set[int]) -> set[int]:
    procs = _processes()
    return {pid for pid in pids if pid in procs and procs[pid][1] != "Z"}


# Two small models, then enough work that the sweep is still planning well after their records are written (each
# large model takes seconds to profile and plan): by then both workers are past their start and planning.
SMALL = ("mlp-tiny", "vgg-tiny")
SWEEP = ["zoo", *SMALL, "gpt2-small", "bert-base", "resnet50", "vgg16", "--gpus", "8,16", "--gpu", "a100-80g"]


def _models(out: Path) -> set[str]:
    """The models with a record in the sweep's CSV."""
    lines = out.read_text().splitlines()[1:] if out.exists() else []
    return {line.split(",")[0] for line in lines}


def _default_sigint() -> None:
    """In the child before exec: SIGINT as an interactive shell leaves it, even where the test runner ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_killed_sweep_leaves_no_process_and_closes_the_pipes(tmp_path: Path, signum: signal.Signals) -> None:
    out = tmp_path / "results.csv"
    argv = [str(PYPLAN), *SWEEP, "--jobs", "2", "--no-cache", "--out", str(out)]
    # Ctrl-C at a terminal signals the whole foreground process group: the test gives the command a group of its own.
    interrupt = signum == signal.SIGINT
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        start_new_session=interrupt,
        preexec_fn=_default_sigint if interrupt else None,
    )
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while not _models(out) >= set(SMALL):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, f"no records of {SMALL} within 180 s"
            time.sleep(0.1)
        tree = _descendants(proc.pid)
        # The command, the resource tracker and the two workers (spawned: children of the command).
        assert len(tree) >= 4, tree
        killed = time.monotonic()
        if interrupt:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=5)  # returns once every holder of the caller's pipes has ended
        while _alive(tree) and time.monotonic() < killed + 5:
            time.sleep(0.05)
        assert not _alive(tree), f"alive {time.monotonic() - killed:.1f} s after {signum.name}: {_alive(tree)}"
    finally:
        for pid in _alive(tree | _descendants(proc.pid)) - {proc.pid}:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()  # type: ignore[union-attr]
    if interrupt:
        assert proc.returncode == 130
        # (The resource tracker may add a warning after it: it unlinks a semaphore that tqdm made in a stopped worker.)
        assert "interrupted" in err.decode().splitlines() and "Traceback" not in err.decode(), err.decode()[-3000:]
    else:
        assert proc.returncode == -signum
    assert len(_models(out)) < 6  # stopped before the end


# Runs `pyplan plan ARGS` with its first CP-SAT solve made long: it first searches for a 12-mark Golomb ruler (a
# minute of CP-SAT's time, which proves the shortest only after hours), and says "solving" on stderr as it begins
# and "searched" once that search has returned.
# The solver's parameters (and so its handling of SIGINT) are pyplan's.
SLOW_SOLVES = r"""
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever disposition the test runner left us
from ortools.sat.python import cp_model
from pyplan.cli.main import main
from pyplan.solve import ilp


def golomb(marks):
    model = cp_model.CpModel()
    top = marks * marks
    x = [model.new_int_var(0, top, f"x{i}") for i in range(marks)]
    model.add(x[0] == 0)
    model.add_all_different([x[j] - x[i] for i in range(marks) for j in range(i + 1, marks)])
    for i in range(marks - 1):
        model.add(x[i] < x[i + 1])
    model.minimize(x[-1])
    return model


first = [True]


class SlowSolver(cp_model.CpSolver):
    def solve(self, model, solution_callback=None):
        if first:
            first.clear()
            print("solving", file=sys.stderr, flush=True)
            limit = self.parameters.max_time_in_seconds
            self.parameters.max_time_in_seconds = 60.0
            super().solve(golomb(12))
            print("searched", file=sys.stderr, flush=True)
            self.parameters.max_time_in_seconds = limit
        return super().solve(model, solution_callback)


made = ilp._solver


def slow(time_limit_s, num_workers):
    solver = SlowSolver()
    solver.parameters = made(time_limit_s, num_workers).parameters
    return solver


ilp._solver = slow
sys.exit(main(sys.argv[1:]))
"""

# grouped-mlp-tiny on 2 GPUs, all of them, with an odd global batch: a 2-stage pipeline whose chain is too coarse,
# so the search assigns its operations to stages with CP-SAT (README, "pyplan plan").
DAG_PLAN = ["plan", "zoo:grouped-mlp-tiny", "--gpus", "2", "--all-gpus", "--gpu", "a100-80g", "--global-batch", "7"]


def test_ctrl_c_during_a_solve_ends_pyplan_plan() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SOLVES, *DAG_PLAN, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline()]
        while lines[-1] not in ("", "solving\n"):
            lines.append(proc.stderr.readline())
        assert lines[-1] == "solving\n", "".join(lines)[-3000:]
        time.sleep(0.5)  # inside the search
        asked = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # The search was stopped, and had returned before the command said so and ended (a search left running aborts
    # the interpreter at exit); no plan was printed.
    assert (proc.returncode, err.strip().splitlines()[-2:]) == (130, ["searched", "interrupted"]), err[-3000:]
    assert took < 10
    assert out == ""


# Each solve path of pyplan.solve.ilp (a stage assignment, the least overflow of one that does not fit, a remat
# schedule) under a SIGINT handler of the caller's, each followed by a SIGINT: the caller's handler must get it
# (CP-SAT's own handler leaves SIGINT at its default action, which would end the process instead).
SOLVES_THEN_SIGINT = r"""
import math, os, signal
from pyplan.errors import InfeasibleError
from pyplan.solve.ilp import RematDag, StageDag, assign_stages, remat_schedule
from pyplan.solve.remat import RematChain

caught = []
signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
dag = StageDag.from_chain([1.0] * 3, [1.0] * 3, [1.0, 90.0, 1.0], [10.0] * 3, [5.0] * 4)
assign_stages(dag, num_stages=3, num_microbatches=8, mem_limit_bytes=[math.inf] * 3)
os.kill(os.getpid(), signal.SIGINT)
try:
    assign_stages(dag, num_stages=3, num_microbatches=8, mem_limit_bytes=[500.0] * 3, schedule="GPipe")
except InfeasibleError:
    os.kill(os.getpid(), signal.SIGINT)
chain = RematChain(
    fwd_s=(9.0, 4.0, 2.0, 1.0, 2.0),
    bwd_s=(5.0, 6.0, 6.0, 18.0, 7.0),
    kept_bytes=(20.0, 21.0, 30.0, 20.0, 18.0),
    out_bytes=(9.0, 11.0, 20.0, 17.0, 9.0),
    fwd_peak_bytes=(23.0, 30.0, 37.0, 22.0, 27.0),
    fwd_nosave_peak_bytes=(17.0, 12.0, 25.0, 17.0, 15.0),
    bwd_peak_bytes=(45.0, 48.0, 46.0, 37.0, 42.0),
    grad_bytes=(3.0, 13.0, 5.0, 5.0, 11.0, 4.0),
)
remat_schedule(RematDag.from_chain(chain), budget_bytes=86.0)
os.kill(os.getpid(), signal.SIGINT)
print(len(caught))
"""


def test_every_solve_gives_sigint_back_to_its_handler() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SOLVES_THEN_SIGINT], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert (done.returncode, done.stdout) == (0, "3\n"), done.stderr[-3000:]
