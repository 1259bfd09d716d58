"""The zoo: published parameter counts, fx tracing, real forwards of the small models, masks, errors."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from pyplan import zoo
from pyplan.errors import ModelLoadError
from pyplan.spec import ModelSpec, default_loss, default_target
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
