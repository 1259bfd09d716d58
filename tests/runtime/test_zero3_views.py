"""ZeRO-3 units whose outputs are views (a biased nn.Linear over 3-d input) train like one process, in-place ops
after them included, and FSDP2 warns of no view (pyplan/runtime/sharded.py, `_own_outputs`).

FSDP2 hooks a unit's backward on its outputs; an in-place op on an output that is a view moves its gradient off the
hooked node. Each model here returns views from its units: `Stack` runs `ReLU(inplace=True)` on the view a layer's
Linear unit returns (its backward would read the unit's freed parameters), `Flat` is one unit whose loss scales the
logits in place (nothing would reduce-scatter its gradients: off by 100 %), and tests/models/branchy.py does no
in-place op (FSDP2 warned all the same). The file is also a part of the tests' 2-rank torchrun launch
(tests/runtime/conftest.py): every rank trains one step of each model at dp = 2 in float64 and compares its gradients
and parameters with one process's.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pyplan import cut_points, load_model, trace
from pyplan._torch import tree_map_only
from pyplan.graph.trace import Call, call_at, input_tensors, output_tensors
from pyplan.plan import Layout, StageRemat
from pyplan.remat_plan import full_remat
from pyplan.runtime.sharded import ShardedTrainer
from pyplan.runtime.tensor_parallel import full_value
from pyplan.runtime.trainer import OptimizerSpec, build_trainer, replica_slice
from pyplan.spec import ModelSpec
from tests.runtime.conftest import Launches

# The parts of the launches that tests/runtime/conftest.py makes, which the tests here read: (ranks, script).
LAUNCH_PARTS = ((2, "test_zero3_views"),)
BRANCHY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "branchy.py")
VOCAB, SEQ, DIM = 32, 6, 16
TOL = 1e-12  # float64: reordered sums differ by ~1e-16


class Layer(nn.Module):
    """A residual MLP whose nn.Sequential makes each Linear a unit of its own (`shard_units`)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(inplace=True), nn.Linear(2 * DIM, DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Flat(nn.Module):
    """No layer stack: the root is the only unit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _ids(b: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(0)),)


def _target(b: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _tempered_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.div_(2.0).flatten(0, 1), target.flatten())


def _double(call: Call) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, call)


def configs() -> list[tuple[str, ModelSpec, bool]]:
    """(name, model, every unit checkpointed)."""
    stack = ModelSpec("stack", Stack, _ids, _loss, _target)
    return [
        ("relu_inplace", stack, False),
        ("relu_inplace checkpointed", stack, True),
        ("tempered_loss", ModelSpec("flat", Flat, _ids, _tempered_loss, _target), False),
        ("branchy", load_model(BRANCHY), False),
    ]


def run(spec: ModelSpec, checkpointed: bool) -> dict[str, Any]:
    """One step of ZeRO-3 at dp = 2 (2 micro-batches of 2 per replica) against one process on the global batch: the
    worst relative error of the gradients and the parameters, and FSDP2's warnings of view outputs."""
    b, m = 2, 2
    points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=b))
    n = len(points.order)
    middle = next(c.position for c in points.candidates if 0 < c.position < n)
    layout = Layout(dp=2, pp=1, micro_batch_size=b, num_microbatches=m, schedule="1F1B", zero_stage=3,
                    cut_positions=(0, n),
                    remat=(StageRemat((0, middle, n), full_remat(0, 2)),) if checkpointed else ())  # fmt: skip
    torch.manual_seed(0)
    model = spec.build().double()
    reference = copy.deepcopy(model)
    make = OptimizerSpec(torch.optim.SGD, {"lr": 0.1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build_trainer(
            spec, model, layout, make, example_inputs=lambda k: _double(call_at(spec.example_inputs, k))
        )
        assert isinstance(trainer, ShardedTrainer)
        batch = layout.global_batch
        ids, target = _double(call_at(spec.example_inputs, batch)), spec.target(batch)
        mine = replica_slice(layout, trainer.dp_rank)
        trainer.step(tuple(t[mine] for t in input_tensors(ids)), target[mine])
    views = sorted({str(w.message).split(".")[0] for w in caught if "returned a view tensor" in str(w.message)})
    ref_opt = make(reference.parameters())
    for k in range(batch // b):
        args, kwargs = tree_map_only(torch.Tensor, lambda t, k=k: t[k * b : (k + 1) * b], ids)
        loss = spec.loss(output_tensors(reference(*args, **kwargs)), target[k * b : (k + 1) * b])
        (loss / (batch // b)).backward()
    want = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}
    ref_opt.step()
    got = {name: full_value(p.grad) for name, p in trainer.model.named_parameters()}
    trained = trainer.parameters()

    def worst(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
        return max(((a - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for a, w in pairs.values())

    return {
        "grads": worst({k: (got[k], want[k]) for k in want}),
        "params": worst({k: (trained[k], p.detach()) for k, p in reference.named_parameters()}),
        "views": views,
    }


def run_part(out: str) -> None:
    """Every model, in the launch's process group (tests/runtime/_launch.py)."""
    results = {}
    for name, spec, checkpointed in configs():
        try:
            results[name] = run(spec, checkpointed)
        except RuntimeError as exc:  # both ranks fail in the same backward: record it and go on
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def launched(launches: Launches) -> dict[str, Any]:
    return launches.part(2, "test_zero3_views").results()


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name, _, _ in configs()])
def test_units_returning_views_train_like_one_process(launched: dict[str, Any], name: str) -> None:
    got = launched[name]
    assert "error" not in got, got["error"]
    assert got["grads"] <= TOL and got["params"] <= TOL, got
    assert got["views"] == [], got["views"]
