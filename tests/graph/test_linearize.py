"""Linearization: live sets carry skip tensors and masks, and the pieces reproduce the model exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import TraceError, cut_points, linearize, pieces, run_pieces, trace
from tests.conftest import example


class LongSkip(nn.Module):
    """A skip tensor that spans four layers, and a second model input used only at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.mid = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        skip = self.a(x)
        return self.b(self.mid(skip) + skip) * scale


def _inputs(spec_name: str, b: int) -> tuple[torch.Tensor, ...]:
    return example(spec_name).example_inputs(b)


def test_skip_tensor_is_live_across_every_cut_it_spans() -> None:
    model = LongSkip()
    graph = trace(model, (torch.randn(3, 8), torch.randn(3, 1)))
    points = cut_points(graph)
    skip_def = points.order.index("a")
    add_use = points.order.index("add")
    for c in range(skip_def + 1, add_use + 1):
        assert "a" in points.cuts[c].live, c
        assert "scale" in points.cuts[c].live, c
    assert "a" not in points.cuts[add_use + 1].live
    # A cut's bytes are the sum of its live values' bytes.
    cut = points.cuts[add_use]
    assert cut.bytes.per_sample == sum(graph.node(v).bytes.per_sample for v in cut.live)


def test_residual_network_keeps_skips_at_every_cut() -> None:
    spec = example("resnet")
    graph = trace(spec.build(), spec.example_inputs, batch_size=2)
    points = cut_points(graph)
    # Every `add` of a residual block reads the block input; it must be live from its definition to the add.
    for name in points.order:
        node = graph.node(name)
        if node.target != "add":
            continue
        for src in node.inputs:
            start = points.position[src] + 1
            stop = points.position[name]
            assert all(src in points.cuts[c].live for c in range(max(start, 0), stop + 1))


def _assert_pieces_reproduce(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    model.eval()
    graph = trace(model, inputs)
    points = cut_points(graph)
    expected = model(*inputs)
    candidates = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    assert candidates
    # Every single cut, and all cuts at once.
    for c in [*([c] for c in candidates), candidates]:
        chain = linearize(graph, positions=c)
        got = run_pieces(pieces(chain), *inputs)
        assert torch.equal(got, expected), c
    return len(candidates)


def test_pieces_reproduce_a_sequential_model() -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert _assert_pieces_reproduce(model, (torch.randn(4, 6),)) == 4


def test_pieces_reproduce_a_residual_cnn() -> None:
    spec = example("resnet")
    assert _assert_pieces_reproduce(spec.build(), spec.example_inputs(2)) > 20


def test_pieces_reproduce_a_transformer_with_attention_mask() -> None:
    spec = example("gpt")
    inputs = spec.example_inputs(2)
    assert not inputs[1].all(), "the example mask should hide some positions"
    assert _assert_pieces_reproduce(spec.build(), inputs) > 20
    chain = linearize(trace(spec.build(), spec.example_inputs))
    # The padding mask rides across every cut between the embedding and the last attention.
    inner = [c for c in chain.cuts[1:-1] if c.position < chain.order.index("layers_3_attn_proj")]
    assert inner and all("keep" in c.live for c in inner)


def test_pieces_reproduce_a_model_with_a_long_skip_and_two_inputs() -> None:
    _assert_pieces_reproduce(LongSkip(), (torch.randn(3, 8), torch.randn(3, 1)))


def test_default_blocks_follow_the_module_hierarchy() -> None:
    spec = example("gpt")
    chain = linearize(trace(spec.build(), spec.example_inputs), min_blocks=8)
    names = ["tok", "pos", "layers.0", "layers.1", "layers.2", "layers.3", "ln", "head"]
    assert [b.name for b in chain.blocks] == names
    # Tied weights are counted once, in the first block that uses them.
    assert chain.param_numel == sum(p.numel() for p in spec.build().parameters())
    assert chain.blocks[-1].param_numel == 0 and "head.weight" in chain.blocks[-1].param_names


class Deep(nn.Module):
    """An embedding, 40 layers in one Sequential, a head: 3 blocks at the first level, 42 at the second."""

    def __init__(self, layers: int = 40) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)])
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(x)))


def test_a_level_with_too_many_blocks_is_taken_a_few_layers_at_a_time() -> None:
    """Too few blocks at one level (3 < min_blocks) and too many at the next (42 > max_blocks): the layers are
    grouped, k of them a block counted from the first, k the least that fits (3 for 20 blocks: 14 groups and the
    embedding and head), not kept as one block; the grouped blocks are named by their first and last layer."""
    graph = trace(Deep(), (torch.randn(3, 8),))
    assert len(linearize(graph, max_blocks=64).blocks) == 42
    chain = linearize(graph, max_blocks=20)
    names = [b.name for b in chain.blocks]
    assert names[0] == "embed" and names[-1] == "head" and len(names) == 16
    assert names[1:4] == ["layers.0..layers.2", "layers.3..layers.5", "layers.6..layers.8"]
    assert names[-2] == "layers.39"  # the last layer alone: 40 = 13 x 3 + 1
    assert linearize(graph, max_blocks=22).blocks[1].name == "layers.0..layers.1"  # 20 pairs + 2
    assert len(linearize(graph, max_blocks=2).blocks) == 3  # no grouping fits: the coarser level


def test_cut_where_a_non_tensor_is_live_is_refused() -> None:
    spec = example("gpt")
    graph = trace(spec.build(), spec.example_inputs)
    points = cut_points(graph)
    assert points.invalid, "shape reads inside attention make some cuts invalid"
    bad = next(iter(points.invalid))
    with pytest.raises(TraceError, match=f"cannot cut before position {bad}: value '"):
        linearize(graph, positions=[bad])


@pytest.mark.parametrize(("name", "published"), [("resnet50", 25_557_032), ("gpt2-small", 124_439_808)])
def test_chain_counts_the_published_parameters(name: str, published: int) -> None:
    from pyplan import load_model

    spec = load_model(f"zoo:{name}")
    with torch.device("meta"):
        model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=1))
    assert chain.param_numel == published
