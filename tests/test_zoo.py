"""The zoo: published parameter counts, fx tracing, real forwards of the small models, masks, errors, `zoo list`."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from pyplan import linearize, trace, zoo
from pyplan.cli.zoo import add_zoo_parser
from pyplan.errors import ModelLoadError
from pyplan.spec import ModelSpec, default_loss, default_target
from pyplan.zoo.amoeba import AMOEBANET_CONFIGS, AmoebaNet, AmoebaNetConfig
from pyplan.zoo.transformer import GPT, Bert, BertConfig, GPTConfig, Llama, LlamaConfig

REQUIRED = [
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "vgg16", "vgg16-bn", "mobilenet-v2",
    "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "llama-7b-style",
    "mlp-tiny", "resnet-tiny", "gpt-tiny", "vgg-tiny",
]  # fmt: skip
TRANSFORMERS = ["gpt-tiny", "gpt2-small", "bert-base", "bert-large", "llama-1b-style", "llama-7b-style"]
# Output shape at batch 2 of the models small enough to run for real in a test.
REAL_FORWARD = {
    "mlp-tiny": (2, 10),
    "resnet-tiny": (2, 10),
    "vgg-tiny": (2, 10),
    "gpt-tiny": (2, 32, 256),
    "resnet18": (2, 1000),
}


def n_params(module: nn.Module) -> int:
    """Parameters counted once each, as `parameters()` deduplicates tied weights."""
    return sum(p.numel() for p in module.parameters())


def meta_build(spec: ModelSpec) -> nn.Module:
    with torch.device("meta"):
        return spec.build()


def meta_inputs(spec: ModelSpec, b: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.to("meta") for t in spec.example_inputs(b))


def test_names_are_sorted_and_include_the_required_models() -> None:
    names = zoo.names()
    assert names == sorted(set(names))
    assert set(REQUIRED) <= set(names)
    assert all(zoo.get(name).name == name for name in names)


@pytest.mark.parametrize("name", [n for n in zoo.names() if zoo.get(n).published_params is not None])
def test_parameter_count_equals_the_published_count(name: str) -> None:
    spec = zoo.get(name)
    model = meta_build(spec)
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == spec.published_params, spec.source


@pytest.mark.parametrize("name", [n for n in zoo.names() if n.endswith("-mnist")])
def test_mnist_models_are_the_cifar10_models_with_a_one_channel_stem(name: str) -> None:
    cifar = zoo.get(name.removesuffix("-mnist") + "-cifar10")
    stem = next(m for m in meta_build(zoo.get(name)).modules() if isinstance(m, nn.Conv2d))
    out_channels, in_channels, kh, kw = stem.weight.shape
    assert in_channels == 1
    assert cifar.published_params is not None
    assert n_params(meta_build(zoo.get(name))) == cifar.published_params - 2 * out_channels * kh * kw


@pytest.mark.parametrize("name", zoo.names())
def test_traces_with_fx_and_the_traced_graph_runs_on_meta(name: str) -> None:
    spec = zoo.get(name)
    model = meta_build(spec)
    graph = fx.symbolic_trace(model)
    out = graph(*meta_inputs(spec, 2))
    target = spec.target(2).to("meta") if spec.target is not None else default_target(out)
    loss = (spec.loss or default_loss)(out, target)
    assert out.shape[0] == 2
    assert loss.shape == ()


def _layer_of(node: fx.Node) -> str | None:
    """The repeated layer (`transformer.h.3`, `layers.3`, `encoder.layer.3`) a node was traced in, if any."""
    for path in node.meta.get("nn_module_stack", {}):
        if re.search(r"(^|\.)(h|layers|layer)\.\d+$", path):
            return path
    return None


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_only_tensors_cross_layer_boundaries(name: str) -> None:
    # A shape-derived Python value used in two layers would stay live across the cut between them, and a
    # pipeline stage can only receive tensors.
    spec = zoo.get(name)
    graph = fx.symbolic_trace(meta_build(spec))
    ShapeProp(graph).propagate(*meta_inputs(spec, 1))
    crossings = [
        (arg.name, node.name)
        for node in graph.graph.nodes
        for arg in node.all_input_nodes
        if arg.op != "get_attr" and "tensor_meta" not in arg.meta and _layer_of(arg) != _layer_of(node)
    ]
    assert crossings == []
    assert any(_layer_of(node) is not None for node in graph.graph.nodes)


@pytest.mark.parametrize(("name", "shape"), REAL_FORWARD.items())
def test_real_forward_and_backward_on_cpu(name: str, shape: tuple[int, ...]) -> None:
    spec = zoo.get(name)
    assert spec.loss is not None and spec.target is not None
    model = spec.build()
    out, target = model(*spec.example_inputs(2)), spec.target(2)
    assert out.shape == shape
    assert target.shape == shape[:-1] and int(target.max()) < shape[-1]
    loss = spec.loss(out, target)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["resnet18", "gpt-tiny", "bert-base", "mlp-tiny"])
def test_example_inputs_and_targets_are_seeded(name: str) -> None:
    spec = zoo.get(name)
    first, second = spec.example_inputs(3), spec.example_inputs(3)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(t.shape[0] == 3 for t in first)
    if spec.target is not None:
        assert torch.equal(spec.target(3), spec.target(3))


def test_language_model_targets_are_the_next_tokens() -> None:
    spec = zoo.get("gpt2-small")
    assert spec.target is not None
    (ids,), target = spec.example_inputs(2), spec.target(2)
    assert ids.dtype == target.dtype == torch.int64
    assert ids.shape == target.shape == (2, 1024)
    assert torch.equal(ids[:, 1:], target[:, :-1])


def test_gpt2_head_is_tied_to_the_token_embedding() -> None:
    model = meta_build(zoo.get("gpt2-small"))
    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_bert_inputs_carry_a_padding_mask() -> None:
    ids, mask = zoo.get("bert-base").example_inputs(4)
    assert ids.shape == mask.shape == (4, 512)
    assert mask.dtype == torch.int64
    assert bool((mask[:, 0] == 1).all()) and bool((mask == 0).any())


def test_bert_ignores_padded_tokens() -> None:
    model = Bert(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=16)).eval()  # fmt: skip
    ids = torch.randint(50, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[:, 10:] = 0
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    torch.testing.assert_close(model(ids, mask), model(changed, mask))
    assert not torch.allclose(model(ids, torch.ones_like(mask)), model(changed, torch.ones_like(mask)))


@pytest.mark.parametrize(
    "model",
    [
        GPT(GPTConfig(vocab_size=50, n_ctx=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)),
        Llama(
            LlamaConfig(
                dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16
            )
        ),
    ],
    ids=["gpt", "llama-gqa"],
)
def test_decoders_are_causal(model: nn.Module) -> None:
    ids = torch.randint(50, (2, 16))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    before, after = model(ids), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_unknown_name_suggests_the_closest_names() -> None:
    with pytest.raises(ModelLoadError, match=r"did you mean: gpt2-small\b") as info:
        zoo.get("gpt2-smal")
    message = str(info.value)
    assert "'gpt2-smal'" in message and "\n" not in message
    with pytest.raises(ModelLoadError, match="unknown zoo model 'no-such-thing-at-all'"):
        zoo.get("no-such-thing-at-all")


# --- AmoebaNet-D-like ---


def amoebanet_params(num_layers: int, d: int, classes: int) -> int:
    """Parameters of pyplan's AmoebaNet-D-like (L, D) network, for L/3 = n >= 2 normal cells per stack.

    Per operation on C channels: separable kxk 2(k²C + C² + 2C) (depthwise, pointwise, BN, twice); 1x7-7x1
    14C² + 2C; pools and identities 0; preprocessing of an input of C' channels C'C + 2C (1x1 conv and BN, or a
    factorized reduction's two C' x C/2 convs and BN). A normal cell's operations (separable 3x3 twice, 5x5,
    7x7, 1x7-7x1) total 22C² + 202C; a reduction cell's (separable 3x3, 5x5, 7x7, 1x7-7x1) 20C² + 180C. A
    normal cell outputs 4C channels, a reduction cell 3C. Cells and their (older input, newer input) channels:
      stem conv 3x3, 3 -> D/4, BN                             27D/4 + D/2
      stem reduction cells at D/4 (D/4, D/4) and D/2 (D/4, 3D/4)  55D²/8 + 138D
      stack k = 0, 1, 2 at C = 2^k·D: n cells of 22C² + 202C; preprocessing 4C per cell and
        C·(older + newer): first cell (3C/4 + 3C/2), second (3C/2 + 4C), the others (4C + 4C)
      reduction cells at 2D (4D, 4D) and 4D (8D, 8D)            480D² + 1104D
      classifier Linear(16D, K)                               16D·K + K
    Summed: (630n + 3189/8)·D² + (1442n + 4997/4)·D + 16D·K + K.
    """
    n = num_layers // 3
    assert n >= 2 and d % 4 == 0
    return (5040 * n + 3189) * d * d // 8 + (5768 * n + 4997) * d // 4 + 16 * d * classes + classes


SMALL_AMOEBANET = AmoebaNetConfig(num_layers=6, filters=8, num_classes=10)


@pytest.mark.parametrize(
    "cfg",
    [*AMOEBANET_CONFIGS.values(), SMALL_AMOEBANET, AmoebaNetConfig(num_layers=12, filters=12, num_classes=7)],
    ids=[*AMOEBANET_CONFIGS, "small", "12-12"],
)
def test_amoebanet_parameter_count_equals_the_formula(cfg: AmoebaNetConfig) -> None:
    with torch.device("meta"):
        model = AmoebaNet(cfg)
    assert n_params(model) == amoebanet_params(cfg.num_layers, cfg.filters, cfg.num_classes)


@pytest.mark.parametrize("name", list(AMOEBANET_CONFIGS))
def test_amoebanet_zoo_entries_state_their_configuration_and_count(name: str) -> None:
    spec, cfg = zoo.get(name), AMOEBANET_CONFIGS[name]
    assert spec.published_params is None
    assert f"({cfg.num_layers}, {cfg.filters})" in spec.source
    assert f"{amoebanet_params(cfg.num_layers, cfg.filters, 1000):,} parameters" in spec.source
    assert [t.shape for t in spec.example_inputs(2)] == [(2, 3, 224, 224)]


def test_amoebanet_runs_forward_and_backward_on_cpu_and_its_trace_matches() -> None:
    # One normal cell per stack at 4 channels: 16x16 becomes 1x1 by the last stack, the fewest convolutions.
    model = AmoebaNet(AmoebaNetConfig(num_layers=3, filters=4, num_classes=10))
    x, target = torch.randn(2, 3, 16, 16), torch.tensor([1, 7])
    out = model(x)
    assert out.shape == (2, 10)
    nn.functional.cross_entropy(out, target).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    graph = fx.symbolic_trace(model.eval())
    torch.testing.assert_close(graph(x), model(x))


def test_amoebanet_cells_are_blocks_with_both_previous_outputs_across_each_cut() -> None:
    with torch.device("meta"):
        model = AmoebaNet(SMALL_AMOEBANET)
    chain = linearize(trace(model, (torch.randn(2, 3, 32, 32),)), min_blocks=8)
    names = [b.name for b in chain.blocks]
    cells = [i for i, name in enumerate(names) if name.startswith("cells.")]
    assert [names[i] for i in cells] == [f"cells.{i}" for i in range(len(model.cells))]
    # The cut after cell i (but the last) carries the outputs of cells i-1 and i: the skip tensor crosses a cell.
    assert [len(chain.cuts[i + 1].live) for i in cells[:-1]] == [2] * (len(cells) - 1)
    assert len(chain.cuts[cells[-1] + 1].live) == 1


# --- pyplan zoo list ---


def run_zoo(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pyplan")
    add_zoo_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["zoo", *argv])
    return int(args.func(args))


def test_zoo_list_prints_counts_and_input_shapes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps tables at the terminal width
    assert run_zoo("list") == 0
    out = capsys.readouterr().out
    for name in zoo.names():
        assert name in out
    assert "1,557,611,200" in out and "(B,3,224,224)" in out and "(B,512) int64, (B,512) int64" in out


def test_zoo_list_json_counts_on_meta_not_from_the_published_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_zoo("list", "gpt2-small", "amoebanet-d-18", "--json") == 0
    gpt2, amoeba = json.loads(capsys.readouterr().out)
    assert gpt2["name"] == "gpt2-small"
    assert gpt2["params"] == gpt2["published_params"] == 124_439_808
    assert gpt2["inputs"] == [{"shape": ["B", 1024], "dtype": "int64"}]
    assert amoeba["published_params"] is None
    assert amoeba["params"] == amoebanet_params(18, 208, 1000)
    assert set(amoeba) == {"name", "params", "published_params", "inputs", "source"}


def test_zoo_list_of_an_unknown_name_suggests_close_names() -> None:
    with pytest.raises(ModelLoadError, match="did you mean: gpt2-xl"):
        run_zoo("list", "gpt2-xxl")
