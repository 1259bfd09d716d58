"""Recording a graph's shapes on meta tensors: the memo of repeated calls and the skipping of repeated blocks give
the records that running every op gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import fx, nn

from pyplan import trace
from pyplan._torch import meta_build
from pyplan.graph import record
from pyplan.graph.linearize import linearize
from pyplan.graph.sequence_parallel import ShapeOps, rewrite, sequence_zone
from pyplan.graph.tensor_parallel import derive_tp_plan, local_module
from pyplan.graph.trace import Examples, graph_of, inputs_at
from pyplan.load import load_model


class _Mixed(nn.Module):
    """Identical layers beside layers that differ only in what shapes their output: a convolution's stride (not
    in its parameters' shapes), a transpose before a view, a different slice."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(5))
        self.halving = nn.ModuleList(nn.Conv2d(4, 4, 3, stride=2, padding=1) for _ in range(5))
        self.norms = nn.ModuleList(nn.LayerNorm(4) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, halving, norm) in enumerate(zip(self.convs, self.halving, self.norms)):
            x = conv(x)[..., ::2, ::2] + halving(x)  # the same input: the stride alone makes the output smaller
            x = nn.functional.interpolate(x, scale_factor=2.0)
            b, c, h, w = x.shape
            t = norm(x.permute(0, 2, 3, 1)).transpose(1, 2).contiguous().view(b, w, h, c)
            x = t.permute(0, 3, 2, 1)[:, :, : h - (i % 2)]
        return x.flatten(1)


class _Stack(nn.Module):
    """Identical layers, then one that differs in a stride, then the identical layers again on a smaller input."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(4))
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.more = nn.ModuleList(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        x = self.down(x)
        for layer in self.more:
            x = x + layer(x)
        return self.head(x.flatten(1))


class _Counted(dict):
    """The recorder's memo, counting its lookups that found a call and those that did not."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = self.misses = 0

    def get(self, key: object, default: object = None) -> object:
        found = super().get(key, default)
        if found is default:
            self.misses += 1
        else:
            self.hits += 1
        return found


@contextlib.contextmanager
def _every_op_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside: the recorder runs every op, none taken from its memo, no block skipped."""
    with monkeypatch.context() as m:
        m.setattr(record._Recorder, "_key", lambda self, n, args, kwargs: None)
        m.setattr(record._Blocks, "of", staticmethod(lambda gm, like, targets: None))
        yield


def _records(graph: object) -> list[tuple[object, ...]]:
    return [(n.name, n.outputs, n.is_tensor) for n in graph.nodes]  # type: ignore[attr-defined]


def _run(recorder: record._Recorder, examples: object, batch_size: int) -> None:
    with torch.no_grad():
        recorder.run(*(t.to("meta") for t in inputs_at(examples, batch_size)))  # type: ignore[arg-type]


@pytest.mark.parametrize("keywords", [False, True], ids=["fx", "export"])
def test_recording_repeated_ops_on_meta_gives_what_running_each_gives(
    keywords: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    examples = (lambda b: {"x": torch.randn(b, 4, 16, 16)}) if keywords else (lambda b: (torch.randn(b, 4, 16, 16),))
    with torch.device("meta"):
        model = _Mixed()
    graph = trace(model, examples, batch_size=2)
    with _every_op_run(monkeypatch):
        plain = graph_of(graph.module, examples, 2)
    assert _records(graph) == _records(plain)
    recorder = record._Recorder(graph.module, record._Targets(graph.module), None)
    recorder._results = memo = _Counted()
    _run(recorder, examples, 2)
    assert memo.hits and memo.misses


def test_a_chain_s_repeated_blocks_are_recorded_once_with_the_same_records() -> None:
    examples = lambda b: (torch.randn(b, 4, 16, 16),)  # noqa: E731
    with torch.device("meta"):
        model = _Stack()
    graph = trace(model, examples, batch_size=2)
    chain = linearize(graph, depth=2)
    assert _records(graph_of(graph.module, examples, 2, like=chain)) == _records(graph)
    blocks = record._Blocks.of(graph.module, chain, record._Targets(graph.module))
    assert blocks is not None
    groups = {chain.blocks[k].name: chain.blocks[g].name for k, g in enumerate(blocks.group) if g is not None}
    # the layers are alike op for op (more.2 flattens its output as well)
    alike = {name for name, first in groups.items() if first == "layers.0"}
    assert alike == {"layers.0", "layers.1", "layers.2", "layers.3", "more.0", "more.1"}
    ran: list[str] = []
    recorder = record._Recorder(graph.module, record._Targets(graph.module), blocks)
    original = recorder._key

    def key(n: fx.Node, args: tuple, kwargs: dict) -> object:
        ran.append(n.name)
        return original(n, args, kwargs)

    recorder._key = key  # type: ignore[method-assign]
    _run(recorder, examples, 2)
    ops = {name: k for k, block in enumerate(chain.blocks) for name in block.nodes}
    # more.0 starts from a smaller input than layers.0 did, and runs; more.1 repeats it
    run = {chain.blocks[ops[name]].name for name in ran if name in ops}
    assert run == {"layers.0", "down", "more.0", "more.2", "head"}


def test_a_capture_s_layers_are_recorded_once_by_the_modules_that_made_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a graph has a chain, its operations are grouped by module (at the depth of _Stack's convolutions and
    ReLUs, where there are 16 groups or more; a residual add joins the ReLU before it): each repeated group is
    recorded as the first one was, and the records are those of every op run."""
    examples = lambda b: (torch.randn(b, 4, 16, 16),)  # noqa: E731
    with torch.device("meta"):
        model = _Stack()
    graph = trace(model, examples, batch_size=2)
    gm = graph.module
    spans = record._module_spans(gm, record.static_nodes(gm))
    assert spans[:3] == [
        (("layers_0_0",), ("x",)),
        (("layers_0_1", "add"), ("x", "layers_0_0")),  # the values live at its start: the residual and the conv's
        (("layers_1_0",), ("add",)),
    ]
    blocks = record._Blocks.of(gm, None, record._Targets(gm))
    assert blocks is not None and len(blocks.group) > len(set(blocks.group))
    with _every_op_run(monkeypatch):
        plain = graph_of(gm, examples, 2)
    assert _records(plain) == _records(graph)


def test_a_ranks_rewritten_layers_are_recorded_once_with_the_same_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank's graph of a GPT at tensor parallelism 2 with sequence parallelism: its layers call closures (the
    scatters and gathers) that name their own nodes, and repeat all the same."""
    spec = load_model("zoo:gpt-tiny")
    with meta_build():
        model = spec.build()
    examples = Examples(spec.example_inputs)
    chain = linearize(trace(model, examples, batch_size=2))
    plan = derive_tp_plan(chain.graph)
    zone = sequence_zone(chain.graph, plan, 2)
    assert zone
    gm = local_module(chain.graph, plan, 2)
    rewrite(gm, zone, ShapeOps(2), layers=True)
    blocks = record._Blocks.of(gm, chain, record._Targets(gm))
    assert blocks is not None
    groups = [g for g in blocks.group if g is not None]
    assert len(groups) > len(set(groups))  # some layers repeat others op for op
    # Each layer's MLP repeats the first layer's, though its first Linear reads a gathered value and runs its
    # forward inside a context of its own (a class made over nn.Linear, with hooks).
    mlps = [k for k, block in enumerate(chain.blocks) if block.name.endswith(".mlp")]
    assert len(mlps) > 1 and {blocks.group[k] for k in mlps} == {mlps[0]}
    recorded = graph_of(gm, examples, 2, like=chain)
    with _every_op_run(monkeypatch):
        plain = graph_of(gm, examples, 2)
    assert _records(plain) == _records(recorded)
