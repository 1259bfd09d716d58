"""What real model code does, captured and cut: torch's encoder with a padding mask, flattened tokens, views valid
only on a contiguous copy, custom autograd Functions and loss-returning forwards (tests/models/real/). Pipelines of
them train like one process in tests/runtime/test_transparency.py."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from torch import nn

from pyplan import linearize, load_model, trace
from pyplan._torch import one_value_per_channel
from pyplan.api import chain_for
from pyplan.errors import PlanError, TraceError
from pyplan.graph.functions import is_kept_whole
from pyplan.graph.linearize import cut_points
from pyplan.graph.split import batch_carrier, pieces, run_pieces
from pyplan.graph.trace import call_at, input_tensors, output_tensors
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.spec import default_loss

REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real")


def _spec(name: str):
    return load_model(os.path.join(REAL, f"{name}.py"))


def _pieces_match(name: str, batch: int = 3) -> tuple[list[torch.fx.GraphModule], nn.Module]:
    """The model cut into one piece per block, run in float64 at another batch size than traced: forward and
    gradients equal the model's."""
    spec = _spec(name)
    torch.manual_seed(0)
    model = spec.build().double()
    chain = linearize(trace(model, spec.example_inputs, batch_size=2))
    mods = pieces(chain)
    call = call_at(spec.example_inputs, batch)
    inputs = tuple(t.double() if t.is_floating_point() else t for t in input_tensors(call))
    args, kwargs = call
    args = tuple(t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args)
    kwargs = {k: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for k, t in kwargs.items()}
    want = output_tensors(model(*args, **kwargs))
    want = want[0] if isinstance(want, tuple) else want
    want.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = run_pieces(mods, *inputs)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.square().sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=1e-10, atol=1e-12, msg=k)
    return mods, model


def test_torch_encoder_with_a_padding_mask_splits_between_its_layers() -> None:
    spec = _spec("padded_encoder")
    chain = linearize(trace(spec.build(), spec.example_inputs, batch_size=2))
    layers = [b.name for b in chain.blocks if b.name.startswith("enc.layers.")]
    assert {name.split(".")[2] for name in layers} == {str(i) for i in range(6)}
    _pieces_match("padded_encoder")


def test_flattened_tokens_carry_the_batch_size_across_cuts() -> None:
    spec = _spec("flat_tokens")
    graph = trace(spec.build(), spec.example_inputs, batch_size=2)
    chain = linearize(graph)
    carriers = [batch_carrier(graph, cut.live) for cut in chain.cuts[1:-1]]
    # Some cuts carry only the tokens (batch x 6 rows): the batch is their first size over 6.
    assert any(c is not None and c[1:] == (0, 6) for c in carriers)
    assert all(c is not None for c in carriers)
    _pieces_match("flat_tokens")


class _Pooled(nn.Module):
    """A layer pools over the batch, then the batch size read at the top is used again: no cut between."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        pooled = self.a(x).mean(0)
        return self.b(pooled).expand(batch, 4) * scale


def test_a_cut_where_no_value_grows_with_the_batch_is_never_offered() -> None:
    model = _Pooled()
    graph = trace(model, lambda b: ((torch.randn(b, 4),), {"scale": torch.ones(b, 1)}), batch_size=2)
    points = cut_points(graph)
    reasons = [points.invalid.get(c.position, "") for c in points.cuts]
    # Between the pooling and the expand only the pooled (batch-free) value and the scale... which grows with the
    # batch: every cut keeps a carrier here; without `scale`, the cut after the mean is refused.
    assert all("batch size" not in r for r in reasons)
    bare = trace(_PooledBare(), lambda b: (torch.randn(b, 4),), batch_size=2)
    bare_points = cut_points(bare)
    refused = [c for c, why in bare_points.invalid.items() if "batch size" in why]
    assert refused, bare_points.invalid
    for c in refused:
        assert batch_carrier(bare, bare_points.cuts[c].live) is None


class _PooledBare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] >= 1)
        batch = x.shape[0]
        if x.shape[1] > 1:  # a branch on a size: torch.export captures it, not torch.fx
            x = x * 2
        pooled = self.b(self.a(x).mean(0))
        return pooled.expand(batch, 4)


def test_a_view_of_a_contiguous_copy_runs_on_other_strides() -> None:
    spec = _spec("stride_views")
    gm = trace(spec.build(), spec.example_inputs, batch_size=2).module
    ops = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.view.default not in ops  # captured by torch.export, views as reshapes
    _pieces_match("stride_views")


def test_a_custom_autograd_function_is_one_op_with_its_own_backward() -> None:
    spec = _spec("scan_function")
    gm = trace(spec.build(), spec.example_inputs, batch_size=2).module
    assert sum(is_kept_whole(n) for n in gm.graph.nodes) == 4  # one per layer
    _pieces_match("scan_function")
    # Its forward (in-place writes into views of its output) is not differentiable by autograd: capturing its ops
    # instead of the Function would fail in the backward.
    from tests.models.real.scan_function import Scan

    a, x = torch.rand(2, 5, 3, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="inplace"):
        ctx = types.SimpleNamespace(save_for_backward=lambda *saved: None)
        Scan.forward(ctx, a.requires_grad_(), x.requires_grad_()).sum().backward()


def test_a_model_that_returns_its_loss_second_is_trained_on_it() -> None:
    spec = _spec("own_loss")
    graph = trace(spec.build(), spec.example_inputs, batch_size=2)
    assert graph.returns_loss
    logits, loss = torch.randn(2, 3), torch.tensor(1.5)
    assert default_loss((logits, loss), None) is loss


def test_a_none_beside_the_logits_is_dropped_from_the_output() -> None:
    spec = _spec("own_loss_none")
    gm = trace(spec.build(), spec.example_inputs, batch_size=2).module
    assert [n.target for n in gm.graph.nodes if n.op == "placeholder"] == ["idx"]
    assert not linearize(trace(spec.build(), spec.example_inputs, batch_size=2)).graph.returns_loss
    _pieces_match("own_loss_none")


def test_a_float_mask_no_layer_backpropagates_into_is_profiled() -> None:
    # The mask crosses every cut as a float a stage receives, and no gradient comes back for it: the memory
    # profile's backward of each block starts from the outputs that get one.
    spec = _spec("float_mask")
    with torch.device("meta"):
        model = spec.build()
    cluster = Cluster.from_catalog("a100-80g", 2)
    chain, _ = chain_for(model, spec.example_inputs, cluster, Workload(global_batch=8))
    assert chain.memory is not None and len(chain.blocks) >= 4


class _Lambdas(nn.Module):
    """A scale made with torch.normal(mean, std, size), which ignores `with torch.device("meta")` (DiffLlama)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.normal(0.0, 0.1, size=(8,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lam = torch.exp(torch.sum(self.scale * self.scale, dim=-1, dtype=torch.float32)).to(x.dtype)
        return self.fc(x) * lam


def test_a_model_built_on_meta_with_a_tensor_made_elsewhere_is_profiled_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Lambdas(), _Lambdas())
    assert model[0].scale.device.type == "cpu"  # torch's quirk this guards against
    cluster = Cluster.from_catalog("a100-80g", 2)
    chain, _ = chain_for(model, lambda b: (torch.randn(b, 8),), cluster, Workload(global_batch=4))
    assert all(p.is_meta for p in model.parameters()) and chain.blocks[0].flops_fwd is not None


def test_a_batch_norm_over_one_value_per_channel_is_recognized_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, weight, bias = torch.empty(1, 4, 1, 1), torch.ones(4), torch.zeros(4)
        with pytest.raises(ZeroDivisionError) as caught:  # torch's decomposition divides by n - 1
            torch.ops.aten.native_batch_norm(x, weight, bias, torch.zeros(4), torch.ones(4), True, 0.1, 1e-5)
    assert one_value_per_channel(caught.value) is caught.value
    assert one_value_per_channel(ZeroDivisionError("elsewhere")) is None


def test_an_exported_batch_norm_over_1x1_maps_is_profiled_from_two_samples() -> None:
    spec = _spec("small_maps")
    with torch.device("meta"):
        model = spec.build()
    # Keyword inputs: torch.export captures it and calls the aten op, whose fake run divides by zero at one sample.
    examples = lambda b: ((), {"input": spec.example_inputs(b)[0]})  # noqa: E731
    cluster = Cluster.from_catalog("a100-80g", 2)
    chain, _ = chain_for(model, examples, cluster, Workload(global_batch=8))
    assert chain.min_micro_batch == 2


class _KeywordsInKwargs(nn.Module):
    """A forward that takes its mask through `**kwargs` (FNet's takes no attention_mask; many take extra inputs so)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * kwargs["mask"][..., None]
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h.sum(1)


def test_keyword_inputs_that_reach_the_forwards_kwargs_are_captured() -> None:
    examples = lambda b: {"ids": torch.randint(20, (b, 5)), "mask": torch.ones(b, 5)}  # noqa: E731
    torch.manual_seed(0)
    model = _KeywordsInKwargs().double()
    chain = linearize(trace(model, examples, batch_size=2))
    assert [n.target for n in chain.graph.module.graph.nodes if n.op == "placeholder"] == ["ids", "mask"]
    inputs = examples(3)
    inputs["mask"] = torch.rand(3, 5, dtype=torch.float64)
    got = run_pieces(pieces(chain), inputs["ids"], inputs["mask"])
    torch.testing.assert_close(got, model(**inputs), rtol=1e-12, atol=1e-12)


class _ScaledAfterDropout(nn.Module):
    """A layer that starts with dropout and scales what it returns in place (Flaubert's `tensor *= mask`): dropout
    with p = 0 returns its input itself, so the in-place op writes into a stage's received input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(nn.functional.dropout(h, 0.0, self.training).mul_(scale)))


class _InPlaceStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_ScaledAfterDropout() for _ in range(3))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, scale)
        return h


@pytest.mark.parametrize("keywords", [False, True], ids=["fx", "export"])
def test_an_in_place_op_on_what_dropout_returned_works_on_a_received_input(keywords: bool) -> None:
    def examples(b: int):
        x, scale = torch.randn(b, 8), torch.rand(b, 8) + 0.5
        return {"x": x, "scale": scale} if keywords else (x, scale)

    torch.manual_seed(0)
    model = _InPlaceStack().double()
    chain = linearize(trace(model, examples, batch_size=2))
    assert len(chain.blocks) >= 4
    x, scale = (t.double() for t in input_tensors(call_at(examples, 3)))
    want = model(x.clone().requires_grad_(), scale)
    want.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    # Each piece gets its inputs as a stage receives them: leaves that need grad.
    args: tuple = (x, scale)
    outs = []
    for i, mod in enumerate(pieces(chain)):
        args = tuple(a.detach().requires_grad_(i > 0 and a.is_floating_point()) for a in args)
        out = mod(*args)
        outs.append((args, out))
        args = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(args[0], want, rtol=1e-12, atol=1e-12)
    grad: tuple = (2 * args[0],)
    for received, out in reversed(outs):
        roots = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        torch.autograd.backward(
            roots, [g for g, t in zip(grad, out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        )
        grad = tuple(
            a.grad if isinstance(a, torch.Tensor) and a.grad is not None else torch.zeros_like(a) for a in received
        )
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=1e-10, atol=1e-12, msg=k)


class _FillFunction(torch.autograd.Function):
    """A masked softmax written as a Function that fills with a scalar tensor it makes (SEW-D's XSoftmax)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = torch.softmax(x.masked_fill(~keep, torch.tensor(torch.finfo(x.dtype).min)), -1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None


class _FillLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        keep = h > 0
        h = h.masked_fill(~keep, torch.tensor(0.5))  # a scalar tensor made in the forward, on the CPU
        return h + _FillFunction.apply(self.fc(h), keep)


def test_a_model_on_meta_that_makes_scalar_tensors_in_its_forward_is_planned() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(_FillLayer() for _ in range(4)))
    cluster = Cluster.from_catalog("a100-80g", 2)
    examples = lambda b: {"input": torch.randn(b, 8)}  # noqa: E731  (keywords: captured by torch.export)
    chain, _ = chain_for(model, examples, cluster, Workload(global_batch=8))
    assert len(chain.blocks) >= 4 and chain.memory is not None


class _Product(torch.autograd.Function):
    """A batched x @ w by hand; `careful` casts in the backward as a Function that knows autocast does (the gradient
    arrives in the product's 16-bit dtype, the weight was saved in fp32). Batched: meta's mm checks no dtypes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, careful: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.careful = careful
        return torch.bmm(x, w.expand(x.shape[0], -1, -1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        ws = w.t().expand(x.shape[0], -1, -1)
        if ctx.careful:
            return torch.bmm(grad, ws.to(grad.dtype)), torch.bmm(x.transpose(1, 2), grad).sum(0).to(w.dtype), None
        return torch.bmm(grad, ws), torch.bmm(x.transpose(1, 2), grad).sum(0), None


class _ProductLayer(nn.Module):
    def __init__(self, careful: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.careful = careful

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_Product.apply(self.fc(h), self.w, self.careful))


@pytest.mark.parametrize("careful", [True, False], ids=["casts", "mixes-dtypes"])
def test_a_kept_whole_function_runs_under_the_autocast_emulation_as_cuda_runs_it(careful: bool) -> None:
    # Under CUDA autocast the product inside the Function's forward casts both operands (the Linear's bf16 output,
    # the fp32 weight) to bf16; its backward then gets a bf16 gradient beside the fp32 weight it saved.
    with torch.device("meta"):
        model = nn.Sequential(*(_ProductLayer(careful) for _ in range(4)))
    cluster = Cluster.from_catalog("a100-80g", 2)
    workload = Workload(global_batch=8, precision="bf16-mixed")
    examples = lambda b: (torch.randn(b, 4, 8),)  # noqa: E731
    if careful:
        chain, _ = chain_for(model, examples, cluster, workload)
        assert chain.memory is not None and len(chain.blocks) >= 4
    else:
        with pytest.raises(PlanError, match=r"^_Product\.backward at test_real_code\.py:\d+ does not run under "):
            chain_for(model, examples, cluster, workload)


class _FourierLayer(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT over sequence and features, after a product."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.fft.fftn(self.fc(h), dim=(1, 2)).real


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_an_fft_of_a_16_bit_product_is_refused_in_one_line_where_cuda_has_no_kernel(precision: str) -> None:
    # Under bf16 autocast the Linear's output is bf16, and torch's FFTs take no bf16 on CUDA: it fails on a GPU too.
    with torch.device("meta"):
        model = nn.Sequential(*(_FourierLayer() for _ in range(4)))
    cluster = Cluster.from_catalog("a100-80g", 2)
    examples = lambda b: (torch.randn(b, 4, 8),)  # noqa: E731
    workload = Workload(global_batch=8, precision=precision)
    if precision == "fp32":
        chain, _ = chain_for(model, examples, cluster, workload)
        assert chain.memory is not None and len(chain.blocks) >= 4
        return
    with pytest.raises(PlanError) as raised:
        chain_for(model, examples, cluster, workload)
    # A model on meta is captured by symbolic tracing: torch functions, no source lines (torch.export gives both).
    assert str(raised.value).startswith("torch.fft.fftn in module '0' (_FourierLayer) gets bfloat16 under autocast")
    assert str(raised.value).endswith("; plan it with --precision fp32")
    assert "\n" not in str(raised.value)


def test_checks_of_values_read_off_the_inputs_are_dropped_from_the_captured_graph() -> None:
    # In a module of its own: pytest rewrites the asserts of test files, and its rewrite reads the value in Python.
    spec = _spec("checked_lengths")
    examples = spec.example_inputs
    graph = trace(spec.build(), examples, batch_size=2)
    targets = {n.target for n in graph.module.graph.nodes}
    assert torch.ops.aten.item.default not in targets and torch.ops.aten._assert_scalar.default not in targets
    with torch.device("meta"):
        model = spec.build()
    chain, _ = chain_for(model, examples, Cluster.from_catalog("a100-80g", 2), Workload(global_batch=8))
    assert len(chain.blocks) >= 4


def test_a_forward_that_reads_values_is_planned_on_a_catalog_gpu_with_weights_built(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Experts sized by `.tolist()` of the router's choice: no value on the meta device, so the model is built with
    # weights (bf16-mixed: the index_add of bf16 expert outputs into zeros captured as float32, and fused attention
    # on real CPU tensors).
    from pyplan.cli.main import main

    path = os.path.join(REAL, "routed_by_value.py")
    argv = ["plan", path, "--gpus", "4", "--gpu", "a100-80g", "--global-batch", "8", "--precision", "bf16-mixed"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["dp"] >= 1
    monkeypatch.setattr(sys.modules["pyplan.cli.main"], "VALUES_BUILD_BYTES", 1)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the model reads tensor values in its forward (`sizes = hits.long().sum(0).tolist()`")
    assert "routed_by_value.py:" in err and err.endswith("plan a smaller configuration of it") and "\n" not in err


class _EntropyLayer(nn.Module):
    """A layer that adds its logits' entropy, as BLT's patcher computes it (torch.distributions checks its
    arguments' values unless told not to)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.fc(h)
        return h + torch.distributions.Categorical(logits=h).entropy()[..., None]


def test_a_distributions_argument_checks_are_not_captured() -> None:
    model = nn.Sequential(*(_EntropyLayer() for _ in range(4)))
    examples = lambda b: {"input": torch.randn(b, 3, 8)}  # noqa: E731  (keywords: captured by torch.export)
    assert torch.distributions.Distribution._validate_args
    chain = linearize(trace(model, examples, batch_size=2))
    assert len(chain.blocks) >= 4 and torch.distributions.Distribution._validate_args
    x = torch.randn(3, 3, 8)
    torch.testing.assert_close(run_pieces(pieces(chain), x), model(x))


class _MinReshapeLayer(nn.Module):
    """A reshape by `min(width, tokens·width)`, as Llama 4's experts reshape: true from one sample on, which torch's
    solver cannot prove for a named batch range."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.fc(h.reshape(-1, 8))
        return h + out.reshape(-1, min(8, out.numel())).reshape(h.shape)


def test_a_relation_over_the_batch_the_solver_cannot_prove_keeps_the_batch_symbolic() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(_MinReshapeLayer() for _ in range(4))).double()
    examples = lambda b: {"input": torch.randn(b, 3, 8, dtype=torch.float64)}  # noqa: E731  (torch.export)
    chain = linearize(trace(model, examples, batch_size=2))
    assert len(chain.blocks) >= 4
    for b in (1, 5):  # other batch sizes than the capture's
        x = torch.randn(b, 3, 8, dtype=torch.float64)
        torch.testing.assert_close(run_pieces(pieces(chain), x), model(x), rtol=1e-12, atol=1e-12)


def test_what_reads_values_on_meta_is_recognized() -> None:
    from pyplan.cli.main import _value_read_on_meta

    nonzero = NotImplementedError("The register_meta function for torch.nonzero() raises unimplemented by default")
    item = RuntimeError("Tensor.item() cannot be called on meta tensors")
    item.add_note('Original traceback:\n  File "/m/model.py", line 7, in forward\n    n = x.sum().item()')
    assert _value_read_on_meta(nonzero) == "" and _value_read_on_meta(RuntimeError("shapes differ")) is None
    assert _value_read_on_meta(item) == "`n = x.sum().item()` at model.py:7"


class _VmapLayer(nn.Module):
    """A layer that builds a per-sample scale with torch.vmap, as transformers builds some attention masks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scale = torch.vmap(lambda row: row.abs().mean())(h.flatten(1))
        return self.fc(h) * scale[:, None, None]


def test_a_forward_that_calls_vmap_is_refused_in_one_line() -> None:
    model = nn.Sequential(*(_VmapLayer() for _ in range(4)))
    examples = lambda b: {"input": torch.randn(b, 3, 8)}  # noqa: E731  (keywords: captured by torch.export)
    with pytest.raises(TraceError) as raised:
        trace(model, examples, batch_size=2)
    text = str(raised.value)
    assert text.startswith("cannot capture module '0' (_VmapLayer) at test_real_code.py:")
    assert "it calls torch.vmap" in text and "\n" not in text
