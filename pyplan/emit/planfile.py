"""plan.json: a versioned document with the model reference, workload, cluster and plan; atomic writes."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyplan import _core
from pyplan._files import write_atomic
from pyplan.errors import PlanError
from pyplan.hardware.cluster import Cluster
from pyplan.model_state import MASTER_PRECISIONS
from pyplan.plan import SCHEMA_VERSION, Layout, Plan, Workload, master_refusal

__all__ = ["PlanFile", "plan_file_from_json", "read_plan_file", "write_plan_file"]

_FIELDS = {"schema_version", "model", "leaf_modules", "workload", "cluster", "plan"}
# The whole numbers of a plan document, by section: JSON's true and false, and numbers with a fraction, are refused
# there (Python takes True for 1 and 2.0 for 2, so the layout's own checks would let them through).
_WHOLE_NUMBERS = {
    "workload": ("global_batch", "dataset_samples"),
    "plan": ("dp", "pp", "micro_batch_size", "num_microbatches", "zero_stage", "stages_per_rank", "tp"),
}


@dataclass(frozen=True)
class PlanFile:
    """What plan.json holds: enough to rebuild the model, check the cluster and run the plan."""

    model: str
    workload: Workload
    cluster: Cluster
    plan: Plan
    leaf_modules: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "leaf_modules": list(self.leaf_modules),
            "workload": self.workload.to_json(),
            "cluster": self.cluster.to_json(),
            "plan": self.plan.to_json(),
        }


def write_plan_file(path: str | Path, document: PlanFile) -> None:
    """Write plan.json atomically; a value that is not finite is refused (JSON has no Infinity or NaN)."""
    try:
        text = json.dumps(document.to_json(), indent=2, allow_nan=False)
    except ValueError as exc:
        raise PlanError(f"the plan holds a value that is not finite ({exc}); it cannot be written as JSON") from None
    write_atomic(path, text + "\n")


def read_plan_file(path: str | Path) -> PlanFile:
    """Load and validate plan.json; a malformed file gets a one-line error naming the field."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"plan file '{path}' does not exist") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan file '{path}' is not JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise PlanError(f"plan file '{path}' is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise PlanError(f"plan file '{path}' nests its JSON too deeply to be a plan") from None
    except OSError as exc:
        raise PlanError(f"plan file '{path}' cannot be read: {exc.strerror or exc}") from None
    return plan_file_from_json(data, f"plan file '{path}'")


def _all_finite(value: Any, where: str, at: str = "") -> None:
    """Refuse a number that is not finite (JSON's Infinity and NaN, or 1e999) anywhere in the document."""
    if isinstance(value, float) and not math.isfinite(value):
        raise PlanError(f"{where}: '{at}' is {value}; a plan holds finite numbers only")
    if isinstance(value, dict):
        for key, item in value.items():
            _all_finite(item, where, f"{at}.{key}" if at else str(key))
    elif isinstance(value, list):
        for k, item in enumerate(value):
            _all_finite(item, where, f"{at}[{k}]")


def plan_file_from_json(data: Any, where: str = "plan") -> PlanFile:
    """Validate a plan document; errors name `where` and the field."""
    path = where
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected an object at the top level")
    _all_finite(data, path)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(f"{path}: unknown schema_version {version!r}; this pyplan reads {SCHEMA_VERSION}")
    for key in ("model", "workload", "cluster", "plan"):
        if key not in data:
            raise PlanError(f"{path}: missing field '{key}'")
    unknown = sorted(map(str, set(data) - _FIELDS))
    if unknown:
        raise PlanError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    model = data["model"]
    if not isinstance(model, str) or not model or any(not c.isprintable() for c in model):
        raise PlanError(
            f"{path}: 'model' must be a model reference (model.py, model.py:function, zoo:NAME), got {model!r}"
        )
    leaves = data.get("leaf_modules", [])
    if not isinstance(leaves, list) or not all(isinstance(x, str) and x.isprintable() for x in leaves):
        raise PlanError(f"{path}: 'leaf_modules' must be a list of module names, got {leaves!r}")
    _check_whole_numbers(data, path)
    try:
        document = PlanFile(
            model=model,
            workload=Workload.from_json(data["workload"]),
            cluster=Cluster.from_json(data["cluster"]),
            plan=Plan.from_json(data["plan"]),
            leaf_modules=tuple(leaves),
        )
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
    _check_consistent(document, path)
    _check_runnable(document.plan.layout, document.workload, path)
    return document


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_whole_numbers(data: dict[str, Any], path: str) -> None:
    """The counts of the workload and the layout are whole numbers, as the planner writes them."""
    for section, names in _WHOLE_NUMBERS.items():
        fields = data[section]
        if not isinstance(fields, dict):
            continue  # the section's own reader names the problem
        for name in names:
            value = fields.get(name, 1)
            if name == "dataset_samples" and value is None:
                continue
            if not _whole(value):
                raise PlanError(
                    f"{path}: '{section}.{name}' must be a whole number, got {json.dumps(value)}; write it as the "
                    "planner does (e.g. 2), or plan again"
                )
    plan = data["plan"]
    cuts = plan.get("cut_positions") if isinstance(plan, dict) else None
    if isinstance(cuts, list) and not all(_whole(c) and c >= 0 for c in cuts):
        raise PlanError(
            f"{path}: 'plan.cut_positions' must be whole numbers of at least 0, got {json.dumps(cuts)}; plan again"
        )


def _check_runnable(layout: Layout, workload: Workload, path: str) -> None:
    """The layout is one the planner's search space holds (pyplan/planner.py, cpp/src/search.cpp's enumerate): a
    schedule torch builds for its ranks, micro-batches and stages per rank, ZeRO-3 only in plans of one stage, and
    16-bit weights beside fp32 master weights under ZeRO 0 or 1 and a schedule that accumulates through autograd."""
    v = layout.stages_per_rank
    if not _whole(v) or v < 1:
        raise PlanError(f"{path}: 'plan.stages_per_rank' must be at least 1, got {v!r}")
    if layout.cut_positions[0] != 0:
        raise PlanError(
            f"{path}: 'plan.cut_positions' must start at 0 (the first stage starts at the graph's start), got "
            f"{list(layout.cut_positions)}; plan again"
        )
    single = layout.schedule in ("GPipe", "1F1B")
    refused = _core.torch_rejection(layout.schedule, layout.pp, layout.num_microbatches, v)
    if refused:
        raise PlanError(f"{path}: torch cannot run this schedule: {refused}; plan again or change the schedule")
    if not single and (v < 2 or layout.pp < 2):
        raise PlanError(
            f"{path}: {layout.schedule} runs several stages on each of several pipeline ranks, the plan has "
            f"pp {layout.pp} with {v} stage(s) per rank; use GPipe or 1F1B, or plan again"
        )
    if layout.zero_stage == 3 and layout.num_stages > 1:
        raise PlanError(
            f"{path}: ZeRO-3 runs in plans of one pipeline stage (over several, torch's pipelining holds every "
            f"unsharded gradient to the step's end), the plan has pp {layout.pp} x {v} stage(s) per rank; use "
            "ZeRO-1, or pp 1"
        )
    refused = master_refusal(layout) if workload.precision in MASTER_PRECISIONS else ""
    if refused:
        raise PlanError(f"{path}: {workload.precision} {refused}")


def _check_consistent(document: PlanFile, path: str) -> None:
    """The layout trains the workload's global batch on GPUs the cluster has."""
    layout, workload = document.plan.layout, document.workload
    samples = layout.dp * layout.num_microbatches * layout.micro_batch_size
    if samples != workload.global_batch:
        raise PlanError(
            f"{path}: the layout trains dp {layout.dp} x {layout.num_microbatches} micro-batches x "
            f"{layout.micro_batch_size} = {samples} samples a step, the workload's global batch is "
            f"{workload.global_batch}; fix one of them or plan again"
        )
    if layout.num_gpus > document.cluster.gpus:
        tp = f" x tp {layout.tp}" if layout.tp > 1 else ""
        raise PlanError(
            f"{path}: the layout needs dp {layout.dp}{tp} x pp {layout.pp} = {layout.num_gpus} GPUs, the cluster has "
            f"{document.cluster.gpus}; plan again for this cluster"
        )
    if layout.tp > 1 and document.cluster.gpus_per_node % layout.tp:
        raise PlanError(
            f"{path}: tensor parallelism {layout.tp} must divide the cluster's {document.cluster.gpus_per_node} GPUs "
            "per node"
        )
