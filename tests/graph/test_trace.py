"""Tracing: node fields, bytes per sample, leaves, and clear errors for untraceable models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import TraceError, trace
from pyplan.graph.trace import inputs_at
from tests.conftest import example


class DataDependent(nn.Module):
    """Python control flow on a tensor value: fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), DataDependent())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def test_nodes_carry_op_target_module_shapes_and_bytes() -> None:
    spec = example("gpt")
    graph = trace(spec.build(), spec.example_inputs, batch_size=4)
    assert graph.batch_size == 4
    qkv = graph.node("layers_0_attn_qkv")
    assert (qkv.op, qkv.target, qkv.module_path) == ("call_module", "layers.0.attn.qkv", "layers.0.attn.qkv")
    (out,) = qkv.outputs
    assert out.shape == (4, 64, 384) and out.dtype == "float32"
    assert out.bytes.per_sample == 64 * 384 * 4 and out.bytes.fixed == 0
    # The causal mask is a buffer: static, with batch-independent bytes.
    causal = [n for n in graph.nodes if n.op == "get_attr" and n.target.endswith("causal")]
    assert causal and all(n.static for n in causal)
    assert causal[0].outputs[0].bytes.per_sample == 0 and causal[0].outputs[0].bytes.fixed == 64 * 64
    # Shape reads are not tensors: they can never cross a pipeline cut.
    size_reads = [n for n in graph.nodes if n.op == "call_function" and n.target == "getattr"]
    assert size_reads and not any(n.is_tensor for n in size_reads)
    # Every edge has the bytes of its producer.
    edges = graph.edges()
    assert all(b.per_sample == graph.node(src).bytes.per_sample for src, _, b in edges)


def test_untraceable_model_names_module_and_operation() -> None:
    with pytest.raises(TraceError) as info:
        trace(Net(), torch.randn(2, 4))
    msg = str(info.value)
    assert "\n" not in msg
    assert "'inner.1' (DataDependent)" in msg
    assert "if x.sum() > 0" in msg
    assert "leaf_modules=['DataDependent']" in msg


@pytest.mark.parametrize("leaf", [DataDependent, "DataDependent", "inner.1"])
def test_marking_a_leaf_makes_it_traceable(leaf: type | str) -> None:
    graph = trace(Net(), torch.randn(2, 4), leaf_modules=[leaf])
    leaf_nodes = [n for n in graph.nodes if n.op == "call_module" and n.target == "inner.1"]
    assert len(leaf_nodes) == 1


def test_example_inputs_that_raise_give_a_clear_error() -> None:
    def broken(batch_size: int) -> tuple[torch.Tensor, ...]:
        raise RuntimeError("no data here")

    with pytest.raises(TraceError, match=r"example_inputs\(2\) raised RuntimeError: no data here"):
        trace(nn.Linear(2, 2), broken)


def test_inputs_that_do_not_fit_the_model_give_a_clear_error() -> None:
    with pytest.raises(TraceError, match="check that example_inputs"):
        trace(nn.Linear(3, 2), torch.randn(2, 5))


def test_inputs_at_slices_and_repeats_a_fixed_batch() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(inputs_at(x, 2)[0], x[:2])
    assert inputs_at(x, 2)[0].untyped_storage().nbytes() == 2 * 2 * 4
    assert torch.equal(inputs_at(x, 5)[0], torch.cat([x, x])[:5])


def test_meta_model_traces_without_weights() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
    graph = trace(model, torch.randn(2, 4096))
    assert len([n for n in graph.nodes if n.op == "call_module"]) == 8
