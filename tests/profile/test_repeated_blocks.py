"""Blocks that repeat an earlier block are profiled once: the same FLOPs and op costs as profiling each one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pyplan import Cluster, Workload, linearize, trace, zoo
from pyplan._torch import run_without_compute
from pyplan.api import chain_for
from pyplan.graph.trace import inputs_at
from pyplan.profile.pieces import RepeatedBlocks, block_inputs, block_modules, leaf_inputs

A100 = Cluster.from_catalog("a100-80g", 8)


def meta(name: str) -> tuple[torch.nn.Module, Any]:
    spec = zoo.get(name)
    with torch.device("meta"):
        return spec.build(), spec.example_inputs


@pytest.mark.parametrize(
    ("name", "precision"), [("gpt-tiny", "fp32"), ("gpt-tiny", "bf16-mixed"), ("resnet-tiny", "fp32")]
)
def test_profiles_equal_those_made_block_by_block(name: str, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = meta(name)
    workload = Workload(global_batch=8, precision=precision)
    reused, _ = chain_for(model, inputs, A100, workload)
    monkeypatch.setattr(RepeatedBlocks, "key", lambda self, index, args: None)
    each, _ = chain_for(model, inputs, A100, workload)
    assert reused == each


def test_the_layers_of_a_transformer_repeat_and_tied_weights_do_not() -> None:
    model, inputs = meta("gpt-tiny")
    chain = linearize(trace(model, inputs, batch_size=2))
    mods = block_modules(chain)
    repeated = RepeatedBlocks(mods, chain.graph.module)
    names = [b.name for b in chain.blocks]
    # The embedding and the head share the token embedding's weight.
    assert {names[i] for i in repeated.shared} == {"transformer.wte", "lm_head"}

    def keys(convert: Any) -> list[str | None]:
        args = block_inputs(mods, [convert(t) for t in inputs_at(inputs, 2)])
        return [repeated.key(i, leaf_inputs(a, first=i == 0)) for i, a in enumerate(args)]

    by_name = dict(zip(names, run_without_compute(chain.graph.module, keys)))
    layers = [k for n, k in by_name.items() if n.startswith("transformer.h.")]
    assert len(layers) >= 2 and len(set(layers)) < len(layers)
    assert by_name["lm_head"] is None


def test_real_models_are_not_compared() -> None:
    spec = zoo.get("gpt-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs, batch_size=2))
    assert not RepeatedBlocks(block_modules(chain), chain.graph.module).enabled
