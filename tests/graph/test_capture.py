"""Capture with torch.export where torch.fx cannot trace: keyword inputs, branches on shapes, dtypes and None, dict
and dataclass outputs; blocks per layer, pieces at any batch size, plans for the local machine and a catalog GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from pyplan import linearize, load_model, search, trace
from pyplan.errors import TraceError
from pyplan.graph.split import pieces, run_pieces
from pyplan.graph.trace import call_at, input_tensors, inputs_at, output_tensors
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from tests.conftest import ROOT, write_local_calibration

BRANCHY = os.path.join(ROOT, "tests", "models", "branchy.py")


def test_a_model_fx_cannot_trace_is_exported_with_a_block_per_layer() -> None:
    spec = load_model(BRANCHY)
    model = spec.build()
    graph = trace(model, spec.example_inputs, batch_size=2)
    assert not any(n.op == "call_module" for n in graph.nodes)  # torch.export's graph: modules inlined
    chain = linearize(graph)
    names = [b.name for b in chain.blocks]
    assert names[0] == "embed" and names[-1] == "head"
    # A cut between every two layers, where only the hidden state and the mask (tensors) are live.
    for k in (1, 2):
        first = names.index(f"layers.{k}.norm")
        assert set(chain.cuts[first].live) <= {"attention_mask", f"add_{2 * k - 1}"}
    assert all(chain.graph.node(v).is_tensor for c in chain.cuts for v in c.live)
    # Traced at 2 samples, the pieces run at 5: each reads the batch size off its own input.
    a, k = call_at(spec.example_inputs, 5)
    want = output_tensors(model(*a, **k))
    got = run_pieces(pieces(chain), *inputs_at(spec.example_inputs, 5))
    assert torch.equal(got, want)


@dataclass
class _Out:
    logits: torch.Tensor
    aux: torch.Tensor | None = None


def test_input_and_output_forms() -> None:
    x, m = torch.ones(2, 3), torch.zeros(2, 3)
    assert call_at(lambda b: (x, m), 2) == ((x, m), {})
    assert call_at(lambda b: {"x": x, "mask": m}, 2) == ((), {"x": x, "mask": m})
    assert call_at(lambda b: ((x,), {"mask": m}), 2) == ((x,), {"mask": m})
    assert call_at(lambda b: x, 2) == ((x,), {})
    assert input_tensors(((x,), {"mask": m, "flag": True})) == (x, m)
    with pytest.raises(TraceError, match="return a tuple of tensors, a dict of keyword arguments, or"):
        call_at(lambda b: 3, 2)
    assert output_tensors({"logits": x}) is x
    assert output_tensors(((x, m), {"y": x})) == (x, m, x)
    torch.export.register_dataclass(_Out)
    assert output_tensors(_Out(x)) is x


def test_plans_for_this_machine_and_for_a_catalog_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_local_calibration(tmp_path)
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    spec = load_model(BRANCHY)
    options = dict(loss=spec.loss, target=spec.target, stage_dag=False)
    local = search(spec.build(), spec.example_inputs, Cluster.from_catalog("local", 2), Workload(global_batch=8),
                   micro_batch_sizes=[2, 4], **options)  # fmt: skip
    assert local.best.predicted.iteration_s > 0 and local.profiled_on == "measured on this machine"
    with torch.device("meta"):
        meta = spec.build()
    # Pinned to two pipeline ranks: a model this small is the host's pace on one GPU, which more GPUs do not beat.
    catalog = search(meta, spec.example_inputs, Cluster.from_catalog("a100-80g", 4), Workload(global_batch=64),
                     pipeline_ranks=(2,), **options)  # fmt: skip
    assert catalog.best.predicted.iteration_s > 0 and "a100" in catalog.profiled_on
    assert catalog.best.layout.pp == 2 and len(catalog.best.stages) == 2


class _Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on values
            return x
        return -x


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 64)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.gate(self.big(x) * mask)


def test_a_branch_on_values_names_the_module_and_line_and_no_leaf_for_keyword_inputs() -> None:
    """With keyword inputs torch.fx is never tried, so a leaf would not help: the hint is torch.where / torch.cond."""
    with pytest.raises(TraceError) as info:
        trace(_Gated(), lambda b: {"x": torch.randn(b, 64), "mask": torch.ones(b, 64)})
    msg = str(info.value)
    assert "\n" not in msg and "module 'gate' (_Gate)" in msg and "if x.sum() > 0" in msg
    assert "torch.where or torch.cond" in msg and "leaf" not in msg


class _GateWhere(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x.sum() > 0, x, -x)  # the workaround the error names


def test_the_named_workaround_captures_the_same_function() -> None:
    gated = _Gated()
    gated.gate = _GateWhere()
    inputs = {"x": torch.randn(8, 64), "mask": torch.ones(8, 64)}
    chain = linearize(trace(gated, lambda b: {k: v[:b] for k, v in inputs.items()}))
    got = run_pieces(pieces(chain), *inputs.values())
    reference = _Gated()
    reference.load_state_dict(gated.state_dict())
    assert torch.equal(got, reference(**inputs))
