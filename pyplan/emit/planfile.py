"""plan.json: a versioned document with the model reference, workload, cluster and plan; atomic writes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyplan._files import write_atomic
from pyplan.errors import PlanError
from pyplan.hardware.cluster import Cluster
from pyplan.plan import SCHEMA_VERSION, Plan, Workload

__all__ = ["PlanFile", "plan_file_from_json", "read_plan_file", "write_plan_file"]


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
    write_atomic(path, json.dumps(document.to_json(), indent=2) + "\n")


def read_plan_file(path: str | Path) -> PlanFile:
    """Load and validate plan.json; a malformed file gets a one-line error naming the field."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"plan file '{path}' does not exist") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"plan file '{path}' is not JSON: {exc}") from None
    return plan_file_from_json(data, f"plan file '{path}'")


def plan_file_from_json(data: Any, where: str = "plan") -> PlanFile:
    """Validate a plan document; errors name `where` and the field."""
    path = where
    if not isinstance(data, dict):
        raise PlanError(f"{path}: expected an object at the top level")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanError(f"{path}: unknown schema_version {version!r}; this pyplan reads {SCHEMA_VERSION}")
    for key in ("model", "workload", "cluster", "plan"):
        if key not in data:
            raise PlanError(f"{path}: missing field '{key}'")
    try:
        return PlanFile(
            model=str(data["model"]),
            workload=Workload.from_json(data["workload"]),
            cluster=Cluster.from_json(data["cluster"]),
            plan=Plan.from_json(data["plan"]),
            leaf_modules=tuple(data.get("leaf_modules", ())),
        )
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: malformed ({type(exc).__name__}: {exc})") from None
