"""pyplan's imports follow its layers, read from the source (every import outside `if TYPE_CHECKING:`).

    base      errors, _files, _torch, _version, units, cross_entropy, spec, the C++ core
    data      graph, hardware (catalog, clusters), zoo (model definitions), load, hub, plan, model_state, remat_plan
    solve     the solvers, over data only
    runtime   what runs a plan under torchrun
    profile   measuring: profiling, calibration (which times the runtime itself)
    output    emit, report
    compose   api, planner, sweep: the one place that composes the layers below
    cli       every command; pyplan/__init__.py re-exports the library

A module imports from its own layer or below, and no modules import each other in a circle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pyplan"

LAYERS: list[set[str]] = [
    {"errors", "_files", "_torch", "_version", "_core", "units", "cross_entropy", "spec"},
    {"graph", "hardware", "zoo", "load", "hub", "plan", "model_state", "remat_plan"},
    {"solve"},
    {"runtime"},
    {"profile"},
    {"emit", "report"},
    {"api", "planner", "sweep"},
    {"cli", "__init__"},
]

def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every pyplan module's pyplan imports (module names; `from a import b` counts as `a.b` when that is a module),
    those under `if TYPE_CHECKING:` left out."""
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    known = set(files) | {"pyplan._core"}

    def resolve(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    out: dict[str, set[str]] = defaultdict(set)
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            out[module] |= {resolve(n) for n in names if n.startswith("pyplan.") or n == "pyplan"} - {module}
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    found = [i for i, names in enumerate(LAYERS) if name in names]
    assert found, f"{module} is in no layer: add it to LAYERS and to the docstring"
    return found[0]


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = {
        (module, target)
        for module, targets in _imports().items()
        for target in targets
        if target != "pyplan" and _layer(target) > _layer(module)
    }
    assert not upward, f"imports from a higher layer: {sorted(upward)}"


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = _imports()
    order: list[str] = []
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == "pyplan" or target.startswith("pyplan.cli"):
                continue  # the package's re-exports and the commands sit on top
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2
        order.append(module)

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
