"""`pyplan show`: a plan.json as data (stages, memory per GPU, time breakdown, cost) and as rich tables.

The tables fit the console without cutting a figure: where the stages do not fit in one table they are shown as two
(times, memory), and the memory bars are drawn shorter. A plan of one stage shows no schedule, placement or bubble.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from pyplan.emit.planfile import PlanFile
from pyplan.hardware.cluster import Cluster
from pyplan.plan import Plan, Prediction, StagePlan
from pyplan.solve.schedules import stage_placement
from pyplan.units import fmt_bytes, fmt_seconds

__all__ = [
    "NO_PRICE",
    "STAGES_CAPTION",
    "STAGE_COLUMNS",
    "boundary_send_s",
    "cost_rows",
    "fmt_fraction",
    "fmt_money",
    "render_show",
    "show_data",
    "stage_rows",
    "state_convention",
    "summary_rows",
    "text_bar",
    "time_rows",
]

_EIGHTHS = " ▏▎▍▌▋▊▉"


def boundary_send_s(stages: Sequence[StagePlan]) -> list[float]:
    """Seconds to send a micro-batch's activation (or its gradient) across each stage boundary.

    The planner counts a stage's `time_s` as `forward_s + backward_s` plus the sends over both its boundaries
    (the same time each way), so with d_0 = d_S = 0 the boundary sends follow from
    `time_s[s] − forward_s[s] − backward_s[s] = d_s + d_{s+1}`, stage by stage. Rounding can leave a few
    attoseconds below zero: those are 0.
    """
    sends: list[float] = []
    before = 0.0
    for stage in stages[:-1]:
        d = max(stage.time_s - stage.forward_s - stage.backward_s - before, 0.0)
        sends.append(d)
        before = d
    return sends


def text_bar(used: float, capacity: float, width: int = 20) -> str:
    """A bar of `used` against `capacity` in `width` cells, to an eighth of a cell: `████████▍░░░░░░░░░░░`."""
    cells = min(max(used / capacity, 0.0), 1.0) * width if capacity > 0 else 0.0
    full = int(cells)
    eighth = int((cells - full) * 8)
    partial = _EIGHTHS[eighth].strip() if full < width else ""
    return ("█" * full + partial).ljust(width, "░")


def fmt_fraction(x: float) -> str:
    """A share as a percentage; a tiny non-zero share reads `<0.1%`."""
    return "<0.1%" if 0 < x < 0.0005 else f"{x:.1%}"


def fmt_money(amount: float | None, currency: str) -> str:
    return "-" if amount is None or not currency else f"{amount:.4g} {currency}"


def _stage_ranks(plan: Plan) -> list[int]:
    lay = plan.layout
    return stage_placement(lay.schedule, lay.pp, lay.stages_per_rank)


def _memory_per_gpu(cluster: Cluster) -> float:
    """A GPU's memory; for `local` on a CPU, the machine's memory shared by the processes on it (as planned)."""
    gpu = cluster.gpu
    if not gpu.memory_bytes:
        return 0.0
    if gpu.device_type == "cpu":
        return gpu.memory_bytes / cluster.gpus_per_node
    return float(gpu.memory_bytes)


def show_data(document: PlanFile) -> dict[str, Any]:
    """The JSON document `pyplan show --json` prints.

    Memory is per GPU of one pipeline (every data-parallel replica holds the same) against the GPU's whole
    memory (for `local` on a CPU, its share of the machine's). The time breakdown splits one iteration,
    `iteration_s = compute_s + recompute_s + tp_comm_s + bubble_s + exposed_comm_s + optimizer_s`: compute (with
    recompute, the busiest stage's recomputation and exposed offload transfers, and tp_comm_s, its tensor-parallel
    collectives) and bubble are the pipeline's
    makespan shared out by the predicted bubble fraction (the bubble includes waiting for sends), exposed
    communication is the gradient sync not hidden behind the backward, optimizer the step of the GPU with the
    most state.
    """
    plan, cluster, workload = document.plan, document.cluster, document.workload
    lay = plan.layout
    capacity = _memory_per_gpu(cluster)
    ranks = _stage_ranks(plan)
    sends = boundary_send_s(plan.stages)
    stages = _stages_data(plan, ranks)
    memory = _memory_data(plan, ranks, capacity)
    per_param = workload.bytes_per_param()
    return {
        "model": document.model,
        "cluster": _cluster_data(cluster, capacity),
        "workload": workload.to_json(),
        "bytes_per_param": {
            "param": per_param.param_bytes,
            "grad": per_param.grad_bytes,
            "optimizer": per_param.optimizer_bytes,
        },
        "layout": {
            **lay.to_json(),
            "num_gpus": lay.num_gpus,
            "num_stages": lay.num_stages,
            "global_batch": lay.global_batch,
        },
        "stages": stages,
        "boundary_send_s": sends,
        "memory": memory,
        "time": _time_data(plan.predicted),
        "cost": _cost_data(document),
    }


def _stages_data(plan: Plan, ranks: Sequence[int]) -> list[dict[str, Any]]:
    """One entry per stage: its rank, blocks, times per micro-batch, rematerialization plan and memory."""
    lay = plan.layout
    return [
        {
            "stage": s,
            "rank": ranks[s],
            "first_block": st.first_block,
            "last_block": st.last_block,
            "blocks": st.last_block - st.first_block + 1,
            "cut_positions": [lay.cut_positions[s], lay.cut_positions[s + 1]],
            "forward_s": st.forward_s,
            "backward_s": st.backward_s,
            "send_s": max(st.time_s - st.forward_s - st.backward_s, 0.0),
            "time_s": st.time_s,
            "in_flight": st.in_flight,
            "recompute_s": st.recompute_s + st.transfer_s,
            "tp_comm_s": st.tp_comm_s,
            "remat": lay.remat[s].plan.describe() if lay.remat and lay.remat[s] is not None else None,
            "state_bytes": st.state_bytes,
            "activation_bytes": st.activation_bytes,
            "buffer_bytes": st.buffer_bytes,
            "unmade_grad_bytes": st.unmade_grad_bytes,
            "optimizer_step_bytes": st.optimizer_step_bytes,
            "memory_bytes": st.memory_bytes,
        }
        for s, st in enumerate(plan.stages)
    ]


def _memory_data(plan: Plan, ranks: Sequence[int], capacity: float) -> list[dict[str, Any]]:
    """One entry per pipeline rank: the stages it holds and their memory against the GPU's `capacity`."""
    memory: list[dict[str, Any]] = []
    for r in range(plan.layout.pp):
        held = [s for s in range(len(plan.stages)) if ranks[s] == r]
        used = sum(plan.stages[s].memory_bytes for s in held)
        memory.append(
            {
                "rank": r,
                "stages": held,
                "state_bytes": sum(plan.stages[s].state_bytes for s in held),
                "activation_bytes": sum(plan.stages[s].activation_bytes for s in held),
                "used_bytes": used,
                "capacity_bytes": capacity,
                "fraction": used / capacity if capacity else None,
            }
        )
    return memory


def _cluster_data(cluster: Cluster, capacity: float) -> dict[str, Any]:
    """The GPU, how many and how they sit in nodes, the memory per GPU and the price of the first node group."""
    group = cluster.groups[0]
    return {
        "gpu": cluster.gpu.name,
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "memory_bytes": capacity,
        "price_per_gpu_hour": group.price_per_gpu_hour,
        "currency": group.currency,
    }


def _time_data(pred: Prediction) -> dict[str, Any]:
    """One iteration's time split into its parts (see `show_data`), with the pipeline's figures behind them."""
    return {
        "iteration_s": pred.iteration_s,
        "compute_s": pred.pipeline_s * (1.0 - pred.bubble_fraction) - pred.recompute_s - pred.tp_comm_s,
        "recompute_s": pred.recompute_s,
        "tp_comm_s": pred.tp_comm_s,
        "bubble_s": pred.pipeline_s * pred.bubble_fraction,
        "exposed_comm_s": pred.exposed_comm_s,
        "optimizer_s": pred.optimizer_s,
        "pipeline_s": pred.pipeline_s,
        "bubble_fraction": pred.bubble_fraction,
        "samples_per_s": pred.samples_per_s,
        "peak_memory_bytes": pred.peak_memory_bytes,
    }


def _cost_data(document: PlanFile) -> dict[str, Any]:
    """The cost per iteration, per million samples and per epoch; the amounts are None for an unpriced plan."""
    plan, workload = document.plan, document.workload
    lay, pred = plan.layout, plan.predicted
    priced = bool(pred.currency)
    iterations = math.ceil(workload.dataset_samples / workload.global_batch) if workload.dataset_samples else None
    return {
        "currency": pred.currency or None,
        "price_per_gpu_hour": document.cluster.groups[0].price_per_gpu_hour,
        "gpus": lay.num_gpus,
        "per_iteration": pred.cost_per_iteration if priced else None,
        "per_million_samples": pred.cost_per_iteration * 1e6 / lay.global_batch if priced else None,
        "iterations_per_epoch": iterations,
        "per_epoch": pred.cost_per_epoch if priced else None,
    }


def _bar_text(used: float, capacity: float, width: int = 20) -> Text:
    if not capacity:
        return Text(f"{fmt_bytes(used)} (capacity unknown)")
    share = used / capacity
    colour = "green" if share < 0.7 else "yellow" if share <= 0.9 else "red"
    return Text.assemble(
        (text_bar(used, capacity, width), colour),
        f" {fmt_bytes(used)} / {fmt_bytes(capacity)} ({fmt_fraction(share)})",
    )


def state_convention(data: dict[str, Any]) -> str:
    """The bytes-per-parameter convention behind the memory figures, in one line."""
    b, w, lay = data["bytes_per_param"], data["workload"], data["layout"]
    return (
        f"model state at {b['param']}+{b['grad']}+{b['optimizer']} bytes/param (weights+gradients+optimizer; "
        f"{w['precision']}, {w['optimizer']}), ZeRO stage {lay['zero_stage']} over dp={lay['dp']}"
    )


STAGE_COLUMNS = (
    "stage",
    "rank",
    "blocks",
    "#",
    "forward",
    "backward",
    "recompute",
    "sends",
    "in flight",
    "state",
    "act",
    "memory",
)


def tp_text(lay: dict[str, Any]) -> str:
    """'tp T x ' (with '+ SP' for sequence parallelism) for a layout with tensor parallelism, else ''."""
    if lay.get("tp", 1) == 1:
        return ""
    return f"tp {lay['tp']}{' + SP' if lay.get('sequence_parallel') else ''} x "


def ep_text(lay: dict[str, Any]) -> str:
    """' (ep E)' for a layout whose dp replicas split each mixture-of-experts layer's experts E ways, else ''."""
    return f" (ep {lay['ep']})" if lay.get("ep", 1) > 1 else ""


def summary_rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    """What the plan is, as (name, value) lines: model, GPUs, layout, batch, schedule, and the expert parallelism
    where the plan has it."""
    lay, cl, w = data["layout"], data["cluster"], data["workload"]
    training = f"ZeRO stage {lay['zero_stage']}, {w['precision']} {w['optimizer']}"
    dp = f"dp {lay['dp']}{ep_text(lay)}"
    if lay["pp"] > 1:
        layout = (
            f"{dp} x {tp_text(lay)}pp {lay['pp']}, {lay['stages_per_rank']} stage(s) per rank, "
            f"placement {lay['placement']}"
        )
        last = ("schedule", f"{lay['schedule']}, {training}")
    else:
        layout, last = f"{dp} x {tp_text(lay)}pp 1: one stage, no pipeline", ("training", training)
    return [
        ("model", data["model"]),
        ("GPUs", f"{lay['num_gpus']} of {cl['gpus']} x {cl['gpu']} ({cl['gpus_per_node']} per node)"),
        ("layout", layout),
        (
            "batch",
            f"{lay['num_microbatches']} micro-batches of {lay['micro_batch_size']} per replica "
            f"(global batch {lay['global_batch']})",
        ),
        last,
        *(
            [("experts", f"each mixture-of-experts layer's experts split over {lay['ep']} of the dp replicas")]
            if lay.get("ep", 1) > 1
            else []
        ),
    ]


def stage_rows(data: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per stage under STAGE_COLUMNS."""
    return [
        (
            str(x["stage"]),
            str(x["rank"]),
            f"{x['first_block']}..{x['last_block']}",
            str(x["blocks"]),
            fmt_seconds(x["forward_s"]),
            fmt_seconds(x["backward_s"]),
            fmt_seconds(x["recompute_s"]),
            fmt_seconds(x["send_s"]),
            str(x["in_flight"]),
            fmt_bytes(x["state_bytes"]),
            fmt_bytes(x["activation_bytes"]),
            fmt_bytes(x["memory_bytes"]),
        )
        for x in data["stages"]
    ]


def cost_rows(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(per what, cost) lines; none for an unpriced plan."""
    c = data["cost"]
    cur = c["currency"]
    if not cur:
        return []
    price = c["price_per_gpu_hour"]
    rows = [
        ("GPU-hour", fmt_money(price, cur)),
        (f"hour of the {c['gpus']} GPUs used", fmt_money(price * c["gpus"] if price is not None else None, cur)),
        ("iteration", fmt_money(c["per_iteration"], cur)),
        ("1M samples", fmt_money(c["per_million_samples"], cur)),
    ]
    if c["per_epoch"] is not None:
        rows.append((f"epoch ({c['iterations_per_epoch']} iterations)", fmt_money(c["per_epoch"], cur)))
    return rows


STAGES_CAPTION = (
    "times per micro-batch; blocks: the chain's blocks first..last; backward includes recompute (and exposed "
    "offload transfers); sends: both boundaries"
)
NO_PRICE = "no price: give --price-per-gpu-hour with --currency, or an --instance"


def _summary(data: dict[str, Any]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for row in summary_rows(data):
        table.add_row(*row)
    return table


def _width(table: Table, console: Console) -> int:
    """The columns the table takes with no cell wrapped."""
    return Measurement.get(console, console.options.update_width(10**4), table).maximum


def _stages_part(data: dict[str, Any], title: str, columns: Sequence[str], caption: str | None) -> Table:
    table = Table(title=title, caption=caption)
    for col in columns:
        table.add_column(col, justify="left" if col == "blocks" else "right", no_wrap=True)
    keep = [STAGE_COLUMNS.index(col) for col in columns]
    for row in stage_rows(data):
        table.add_row(*(row[i] for i in keep))
    return table


_MEMORY_COLUMNS = ("in flight", "state", "act", "memory")


def _stages_tables(data: dict[str, Any], console: Console) -> list[Table]:
    """The stages in one table, or where that is wider than the console, in two: times, then memory."""
    whole = _stages_part(data, "stages", STAGE_COLUMNS, STAGES_CAPTION)
    if _width(whole, console) <= console.width:
        return [whole]
    times = [c for c in STAGE_COLUMNS if c not in _MEMORY_COLUMNS]
    caption = STAGES_CAPTION.removeprefix("times per micro-batch; ")
    return [
        _stages_part(data, "stages: times per micro-batch", times, caption),
        _stages_part(data, "stages: memory", ("stage", *_MEMORY_COLUMNS), "in flight: micro-batches held at the peak"),
    ]


def _remat_table(data: dict[str, Any]) -> list[Table]:
    """The stages' rematerialization plans, when there are any (none: every activation kept)."""
    rows = [(str(x["stage"]), x["remat"]) for x in data["stages"] if x["remat"] is not None]
    if not rows:
        return []
    table = Table(title="rematerialization", caption="K: keep, C[...]: checkpoint, O: offload; stage's blocks from 0")
    table.add_column("stage", justify="right")
    table.add_column("plan")
    for row in rows:
        table.add_row(*row)
    return [table]


def _memory_table(data: dict[str, Any], console: Console) -> Table:
    """Memory per pipeline rank with a bar of 20 cells, or of 10 where 20 do not fit the console."""
    for bar in (20, 10):
        table = Table(title="memory per GPU (one pipeline; every replica the same)", caption=state_convention(data))
        for col in ("rank", "stages", "state", "act", "used / capacity"):
            table.add_column(col, justify="left" if col == "used / capacity" else "right", no_wrap=True)
        for x in data["memory"]:
            table.add_row(
                str(x["rank"]),
                ",".join(map(str, x["stages"])),
                fmt_bytes(x["state_bytes"]),
                fmt_bytes(x["activation_bytes"]),
                _bar_text(x["used_bytes"], x["capacity_bytes"], bar),
            )
        if _width(table, console) <= console.width:
            break
    return table


def time_rows(data: dict[str, Any]) -> list[tuple[str, float]]:
    """The parts of one iteration, in order, each with its seconds; they sum to the iteration time (no bubble
    without a pipeline)."""
    t = data["time"]
    piped = data["layout"]["pp"] > 1 or t["bubble_s"]
    return [
        ("compute", t["compute_s"]),
        ("recompute", t["recompute_s"]),
        *([("tensor-parallel communication", t["tp_comm_s"])] if t["tp_comm_s"] else []),
        *([("pipeline bubble", t["bubble_s"])] if piped else []),
        ("exposed communication", t["exposed_comm_s"]),
        ("optimizer", t["optimizer_s"]),
    ]


def _time_table(data: dict[str, Any]) -> Table:
    t = data["time"]
    bubble = "; bubble: idle ranks, waiting for sends included" if data["layout"]["pp"] > 1 else ""
    table = Table(title="time per iteration", caption=f"{t['samples_per_s']:.4g} samples/s{bubble}")
    for col in ("part", "time", "share", ""):
        table.add_column(col, justify="left" if col in ("part", "") else "right")
    total = t["iteration_s"]
    for name, seconds in time_rows(data):
        share = seconds / total if total > 0 else 0.0
        table.add_row(name, fmt_seconds(seconds), fmt_fraction(share), text_bar(seconds, total, width=20))
    table.add_section()
    table.add_row("iteration", fmt_seconds(total), "100%", "")
    return table


def _cost_table(data: dict[str, Any]) -> Table:
    table = Table(title="cost")
    table.add_column("per", justify="left")
    table.add_column("cost", justify="right")
    for row in cost_rows(data) or [("-", NO_PRICE)]:
        table.add_row(*row)
    return table


def _inert(value: Any) -> Any:
    """`value` with every string shown as written: rich markup escaped, control characters (terminal escapes)
    replaced by their code, so that a plan file can neither style nor move the terminal."""
    if isinstance(value, str):
        shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in value)
        return escape(shown)
    if isinstance(value, dict):
        return {k: _inert(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_inert(v) for v in value]
    return value


def render_show(data: dict[str, Any], console: Console) -> None:
    """Print the plan: a summary, the stages, memory per GPU, the time breakdown and the cost, fitted to the
    console's width. The plan file's strings are shown as written (`_inert`)."""
    data = _inert(data)
    console.print(
        Group(
            _summary(data),
            *_stages_tables(data, console),
            *_remat_table(data),
            _memory_table(data, console),
            _time_table(data),
            _cost_table(data),
        )
    )
