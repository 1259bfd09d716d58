"""Overhead of pyplan's runtime against a hand-written torch.distributed.pipelining program; prints a table.

Run: `python benchmarks/runtime.py` (it launches itself under torchrun with 2 ranks, one thread each). Both
programs train the same split of the same model with the same schedule, micro-batches and optimizer; the
hand-written one builds `PipelineStage`s from the traced pieces directly, pyplan's goes through
`build_trainer` (stage wrappers, mesh, tied-weight groups). Target: under 5 %.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import new_table, target_line, write_json

MODELS = ("gpt-tiny", "resnet-tiny")
SCHEDULES = ("GPipe", "1F1B")
WARMUP, STEPS, MICRO, M = 3, 15, 4, 4


def _hand_step(rank: int, sched: Any, opt: Any, inputs: tuple, target: Any) -> None:
    opt.zero_grad()
    if rank == 0:
        sched.step(*inputs)
    else:
        sched.step(target=target, losses=[])
    opt.step()


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from pyplan import cut_points, load_model, trace
    from pyplan.plan import Layout
    from pyplan.runtime.stages import cut_model, stage_io
    from pyplan.runtime.trainer import OptimizerSpec, build_trainer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    rows = []
    for name in MODELS:
        spec = load_model(f"zoo:{name}")
        points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO))
        inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
        for schedule in SCHEDULES:
            layout = Layout(
                dp=1,
                pp=2,
                micro_batch_size=MICRO,
                num_microbatches=M,
                schedule=schedule,
                cut_positions=(0, inner[len(inner) // 2], len(points.order)),
            )
            B = MICRO * M
            inputs, target = spec.example_inputs(B), spec.target(B)

            torch.manual_seed(0)
            trainer = build_trainer(spec, spec.build(), layout, OptimizerSpec(torch.optim.SGD, {"lr": 1e-3}))

            # The hand-written program: the same pieces as PipelineStages, the schedule and SGD, nothing else.
            torch.manual_seed(0)
            _, stages = cut_model(spec.build(), spec.example_inputs, layout)
            module = stages[rank].piece
            stage_in, stage_out = stage_io(stages, spec.example_inputs(MICRO))[rank]
            stage = PipelineStage(
                module,
                rank,
                2,
                torch.device("cpu"),
                input_args=stage_in,
                output_args=tuple(t.contiguous() for t in stage_out),
            )
            sched = get_schedule_class(schedule)(stage, n_microbatches=M, loss_fn=spec.loss)
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            programs = {
                "pyplan_s": functools.partial(trainer.step, inputs, target),
                "hand_s": functools.partial(_hand_step, rank, sched, opt, inputs, target),
            }
            # Alternate the two programs step by step, so load from elsewhere on the machine hits both alike.
            times: dict[str, list[float]] = {k: [] for k in programs}
            for i in range(WARMUP + STEPS):
                for key, step in programs.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    dist.barrier()
                    if i >= WARMUP:
                        times[key].append(time.perf_counter() - t0)
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"model": name, "schedule": schedule, **medians})
    if rank == 0:
        write_json(out_path, rows)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--worker", out],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
        )
        with open(out) as f:
            rows = json.load(f)
    table = new_table(
        f"runtime overhead, 2 ranks x 1 thread, pp=2, {M} micro-batches of {MICRO}, median of {STEPS} steps",
        ("model", "schedule", "hand-written", "pyplan", "overhead"),
        left=("model", "schedule"),
    )
    worst = 0.0
    for r in rows:
        overhead = r["pyplan_s"] / r["hand_s"] - 1
        worst = max(worst, overhead)
        table.add_row(
            r["model"],
            r["schedule"],
            f"{r['hand_s'] * 1e3:.2f} ms",
            f"{r['pyplan_s'] * 1e3:.2f} ms",
            f"{overhead:+.1%}",
        )
    Console(width=120).print(table)
    met = worst < 0.05
    print(target_line("overhead < 5 %", met, f"worst {worst:+.1%}"))
    return 0 if met else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit(main())
