"""Exact memory: saved-for-backward bytes against hand counts and independent hooks; optimizer state bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from pyplan import linearize, model_state_bytes, profile, trace
from pyplan.profile.memory import saved_bytes
from tests.conftest import example


def _saved_by_training(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes a real forward keeps for backward: unique storages, parameters and buffers excluded."""
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    out.sum().backward()
    return sum(kept.values())


def test_linear_relu_chain_matches_the_hand_count() -> None:
    dims = [10, 32, 24, 16, 3]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    x = torch.randn(6, dims[0])
    chain = linearize(trace(model, x))
    per_block, inputs = saved_bytes(chain, x, (2, 6))
    # The first Linear keeps its input (for its weight gradient); each ReLU keeps its output, which the next
    # Linear reads and keeps too (the same storage, counted once); the last Linear's output is not kept.
    assert inputs.per_sample == 4 * dims[0] and inputs.fixed == 0
    hand = [0, 4 * 32, 0, 4 * 24, 0, 4 * 16, 0]
    assert [s.per_sample for s in per_block] == hand
    assert all(s.fixed == 0 for s in per_block)


@pytest.mark.parametrize("name", ["mlp", "resnet", "gpt"])
def test_training_saves_what_the_profiler_says(name: str) -> None:
    spec = example(name)
    model = spec.build()
    batch = 4
    chain = profile(linearize(trace(model, spec.example_inputs)), spec.example_inputs, measure=False)
    predicted = chain.input_saved_bytes(batch) + sum(b.saved_bytes(batch) for b in chain.blocks)
    assert predicted == _saved_by_training(model, spec.example_inputs(batch))


def test_profiling_leaves_the_model_untouched() -> None:
    spec = example("resnet")
    model = spec.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile(linearize(trace(model, spec.example_inputs)), spec.example_inputs, measure=False)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1)),
        ("sgd-momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("adam", lambda p: torch.optim.Adam(p, lr=1e-3)),
        ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3)),
    ],
)
def test_optimizer_state_bytes_equal_torch(name: str, make: object) -> None:
    spec = example("gpt")
    model = spec.build()
    params = list(model.parameters())
    opt = make(params)  # type: ignore[operator]
    model(*spec.example_inputs(2)).sum().backward()
    opt.step()
    chain = linearize(trace(model, spec.example_inputs))
    state = model_state_bytes(chain.param_numel, sum(b.param_tensors for b in chain.blocks), optimizer=name)
    assert state.optimizer_bytes == _state_bytes(opt)
    assert state.param_bytes == sum(p.numel() * p.element_size() for p in params)
    assert state.grad_bytes == sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def test_mixed_precision_adam_is_sixteen_bytes_per_parameter() -> None:
    # Autocast's convention (fp32 weights, gradients and Adam state): 4 + 4 + 8 bytes per parameter, the total of
    # ZeRO's 2 + 2 + 12 (Rajbhandari et al. 2020), plus Adam's step counters.
    s = model_state_bytes(1000, 3, optimizer="adam", precision="bf16-mixed")
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (4000, 4000, 8000 + 12)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        model_state_bytes(1, 1, optimizer="lion")


def test_bf16_master_is_megatrons_eighteen_bytes_per_parameter() -> None:
    # bf16 weights, fp32 gradients, fp32 master weight and Adam's two states: Megatron-LM's "bf16 param, fp32
    # grads", 18 bytes (6 + 12/d with its distributed optimizer), plus Adam's step counters.
    s = model_state_bytes(1000, 3, optimizer="adamw", precision="bf16-master")
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (2000, 4000, 12000 + 12)
    sgd = model_state_bytes(1000, 3, optimizer="sgd", precision="bf16-master")
    assert sgd.optimizer_bytes == 4000  # the master weight alone
