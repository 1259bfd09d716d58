"""pyplan: plan distributed PyTorch training (DP x PP x GA x micro-batch x schedule) with predictions.

The package in layers, each importing only from its own and those below (tests/test_layers.py holds it):
data at the bottom (`graph`, `hardware`, `zoo`, `load`, `plan`), the solvers (`solve`), the runtime that runs a plan
(`runtime`), measuring (`profile`: profiling and calibration, which times the runtime itself), output (`emit`,
`report`), `api` and `sweep`, which compose them, and on top `cli`, every command.
"""

from __future__ import annotations

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
