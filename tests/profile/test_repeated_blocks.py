"""Blocks that repeat an earlier block are profiled once: the same FLOPs, op costs and bytes as profiling each one,
for the model and for one tensor-parallel rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pyplan import Cluster, Workload, linearize, trace, zoo
from pyplan._torch import run_without_compute, storage_key
from pyplan.api import chain_for
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.tensor_parallel import derive_tp_plan
from pyplan.graph.trace import Examples, inputs_at
from pyplan.profile import memory, remat
from pyplan.profile.capture import chain_at_degree
from pyplan.profile.memory import saved_bytes
from pyplan.profile.pieces import RepeatedBlocks, block_inputs, block_modules, leaf_inputs
from pyplan.profile.tensor_parallel import local_chain

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


def _tp_setup() -> tuple[Any, Any, Any, Any]:
    model, inputs = meta("gpt-tiny")
    workload = Workload(global_batch=8, precision="bf16-mixed")
    chain, _ = chain_for(model, inputs, A100, workload)
    plan = derive_tp_plan(chain.graph)
    zone = sequence_zone(chain.graph, plan, 2)
    assert zone, zone.reason
    return chain, plan, zone, (inputs, workload)


def test_one_ranks_layers_repeat_and_are_profiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks of a tensor-parallel rank (closures over the nodes they scatter and gather, hooks on the split
    layers) repeat as the model's do: each distinct one is measured once per pass, and the rank's chain is the one
    profiling every block gives."""
    chain, plan, zone, (inputs, workload) = _tp_setup()
    measured: list[int] = []
    measure_block = remat._measure_block

    def counted(*args: Any, **kwargs: Any) -> Any:
        measured.append(1)
        return measure_block(*args, **kwargs)

    monkeypatch.setattr(remat, "_measure_block", counted)
    reused = chain_at_degree(chain, plan, 2, inputs, A100, workload, zone)
    once = len(measured)
    monkeypatch.setattr(RepeatedBlocks, "key", lambda self, index, args: None)
    measured.clear()
    each = chain_at_degree(chain, plan, 2, inputs, A100, workload, zone)
    # Two sizes: every block twice when each is measured; the second layer's blocks (six, as the first layer's)
    # mostly not, but at the ends of the layer stack, whose live values run further.
    assert len(measured) == 2 * len(chain.blocks) and once <= len(measured) - 2 * 4
    assert reused == each


def test_a_repeated_blocks_outputs_are_made_as_running_it_makes_them() -> None:
    """block_inputs runs each distinct block once; a repeat's outputs have the shapes, strides and storage sharing
    of running it (a value passed on is the input itself; the model's residual stream a new storage)."""
    model, inputs = meta("gpt-tiny")
    chain = linearize(trace(model, inputs, batch_size=2))
    table = RepeatedBlocks.of(chain)
    calls: list[int] = []
    for i, m in enumerate(table.mods):
        m.register_forward_hook(lambda mod, args, out, i=i: calls.append(i))

    def cuts(convert: Any, repeated: RepeatedBlocks | None) -> list[list[Any]]:
        args = block_inputs(table.mods, [convert(t) for t in inputs_at(inputs, 2)], repeated)
        # Each cut's values: shape, stride, dtype and the first value of the chain sharing its storage.
        first: dict[int, tuple[int, int]] = {}
        return [
            [
                (tuple(t.shape), t.stride(), t.dtype, first.setdefault(storage_key(t), (c, k)))
                for k, t in enumerate(a)
                if isinstance(t, torch.Tensor)
            ]
            for c, a in enumerate(args)
        ]

    mirrored = run_without_compute(chain.graph.module, lambda convert: cuts(convert, table))
    ran = len(calls)
    assert mirrored == run_without_compute(chain.graph.module, lambda convert: cuts(convert, None))
    assert ran < len(table.mods) - 1


@pytest.mark.parametrize(("name", "degree"), [("gpt-tiny", 1), ("gpt-tiny", 2), ("resnet-tiny", 1)])
def test_saved_bytes_from_the_distinct_blocks_are_the_whole_models(
    name: str, degree: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes saved for backward, from the blocks run as pieces (each distinct one once, its repeats replayed), are
    those of the whole model's run, for the model and for one tensor-parallel rank."""
    model, inputs = meta(name)
    chain = linearize(trace(model, inputs, batch_size=4))
    if degree > 1:
        plan = derive_tp_plan(chain.graph)
        chain = local_chain(chain, plan, degree, Examples(inputs), sequence_zone(chain.graph, plan, degree) or None)
    whole = saved_bytes(chain, inputs, (2, 4))

    def refused(*args: Any) -> None:
        raise AssertionError("the whole model was run")

    monkeypatch.setattr(memory.SavedRecorder, "run", refused)
    assert saved_bytes(chain, inputs, (2, 4), blocks=RepeatedBlocks.of(chain)) == whole


def test_blocks_holding_constants_that_are_neither_tensors_nor_modules_are_compared_by_value() -> None:
    # A higher-order op's graph reads constants such as a TreeSpec (transformers' vmapped mask functions).
    def block(spec: Any) -> torch.fx.GraphModule:
        root = torch.nn.Module()
        root.spec = spec
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.get_attr("spec")
        graph.output(graph.call_function(torch.relu, (x,)))
        return torch.fx.GraphModule(root, graph)

    spec = torch.utils._pytree.tree_flatten(((1, 2), {"a": 3}))[1]
    other = torch.utils._pytree.tree_flatten([1, 2])[1]
    mods = [block(spec), block(spec), block(other)]
    repeated = RepeatedBlocks(mods, torch.nn.Linear(1, 1, device="meta"))  # a model on meta: compared
    x = torch.empty(2, 3, device="meta")
    keys = [repeated.key(i, [x]) for i in range(3)]
    assert keys[0] is not None and keys[0] == keys[1] != keys[2]
