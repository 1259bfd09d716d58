"""pyplan: plan distributed PyTorch training (DP x PP x GA x micro-batch x schedule) with predictions.

The package in layers, each importing only from its own and those below (tests/test_layers.py holds it):
data at the bottom (`graph`, `hardware`, `zoo`, `load`, `plan`), the solvers (`solve`), the runtime that runs a plan
(`runtime`), measuring (`profile`: profiling and calibration, which times the runtime itself), output (`emit`,
`report`), `api` and `sweep`, which compose them, and on top `cli`, every command.
"""

from __future__ import annotations

try:
    from pyplan import _core  # noqa: F401 (the compiled core: where it is missing, say why in one line)
except ImportError:
    import importlib.util
    import sys
    from pathlib import Path

    if importlib.util.find_spec("pyplan._core") is not None:
        raise
    # Run from a checkout after `pip install .`, the checkout's pyplan/ sources come first on the import path and
    # hide the installed package, which alone holds the compiled core.
    _here = Path(__file__).resolve().parent
    _installed = [
        Path(entry or ".").resolve() / "pyplan"
        for entry in sys.path
        if Path(entry or ".").resolve() != _here.parent and any(Path(entry or ".", "pyplan").glob("_core.*"))
    ]
    if _installed:
        raise ImportError(
            f"pyplan was imported from the source tree {_here}, which has no compiled core, instead of the installed "
            f"{_installed[0]}: run from another folder, or install this checkout with `pip install -e .`"
        ) from None
    raise ImportError(
        f"pyplan's compiled core (_core) is missing from {_here}: install pyplan with `pip install .`"
    ) from None
from pyplan._version import __version__
from pyplan.api import plan, search
from pyplan.errors import InfeasibleError, ModelLoadError, PlanError, TraceError
from pyplan.graph.chain import Block, Chain, Cut
from pyplan.graph.layergraph import Affine, GraphNode, LayerGraph, TensorInfo
from pyplan.graph.linearize import cut_points, linearize
from pyplan.graph.split import piece, pieces, run_pieces
from pyplan.graph.trace import trace
from pyplan.hardware import Cluster
from pyplan.load import load_model
from pyplan.plan import Layout, Plan, PlanSearch, Prediction, StagePlan, Workload
from pyplan.profile import TimingOptions, model_state_bytes, profile
from pyplan.spec import ModelSpec, cross_entropy
from pyplan.sweep import plan_many

__all__ = [
    "Affine",
    "Block",
    "Chain",
    "Cluster",
    "Cut",
    "GraphNode",
    "InfeasibleError",
    "LayerGraph",
    "Layout",
    "ModelLoadError",
    "ModelSpec",
    "Plan",
    "PlanError",
    "PlanSearch",
    "Prediction",
    "StagePlan",
    "TensorInfo",
    "TimingOptions",
    "TraceError",
    "Workload",
    "__version__",
    "cross_entropy",
    "cut_points",
    "linearize",
    "load_model",
    "model_state_bytes",
    "piece",
    "pieces",
    "plan",
    "plan_many",
    "profile",
    "run_pieces",
    "search",
    "trace",
]
