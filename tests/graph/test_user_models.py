"""Plain PyTorch models as users write them, through capture, profiling and planning: in-place activations,
recurrent layers, torch's own transformer encoder."""

from __future__ import annotations

import os

import pytest
import torch

from pyplan import linearize, load_model, search, trace
from pyplan.graph.split import piece
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.profile import profile

PLAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "plain.py")
MODELS = ("relu_inplace", "lstm", "transformer_encoder")


@pytest.mark.parametrize("name", MODELS)
def test_plans_for_a_catalog_gpu_and_profiles_on_this_machine(name: str) -> None:
    spec = load_model(f"{PLAIN}:{name}")
    build, inputs = spec.build, spec.example_inputs
    found = search(build(), inputs, Cluster.from_catalog("a100-80g", 2), Workload(global_batch=16), stage_dag=False)
    assert found.best.predicted.iteration_s > 0
    chain = profile(linearize(trace(build(), inputs, batch_size=2)), inputs, batch_sizes=(2, 4))
    assert all(b.saved_bytes is not None and b.saved_bytes.per_sample >= 0 for b in chain.blocks)
    # A block of one in-place ReLU can time at 0 once the timer's own cost is taken off: the whole model cannot.
    assert all(b.fwd_time_s is not None and b.fwd_time_s(4) >= 0 for b in chain.blocks)
    assert sum(b.fwd_time_s(4) for b in chain.blocks) > 0


def test_an_in_place_op_right_after_a_cut_works_on_a_copy_of_the_stage_input() -> None:
    """A stage's input is a leaf that needs grad; nn.ReLU(inplace=True) on it would raise in the forward."""
    spec = load_model(f"{PLAIN}:relu_inplace")
    model, inputs = spec.build(), spec.example_inputs
    chain = linearize(trace(model, inputs, batch_size=2), min_blocks=5)
    relu = next(k for k, b in enumerate(chain.blocks) if b.name == "1")  # the first ReLU is a block of its own
    stage = piece(chain, relu, len(chain))
    (x,) = inputs(3)
    h = model[0](x).detach().requires_grad_(True)
    out = stage(h)
    out.sum().backward()
    assert h.grad is not None and torch.allclose(out, model[1:](model[0](x)))
