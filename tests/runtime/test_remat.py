"""Remat plans run by torch: the same gradients as the traced model, and the memory the plan's model predicts."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from pyplan import Chain, LayerGraph, linearize, piece, trace, zoo
from pyplan.graph.trace import ExampleInputs, inputs_at
from pyplan.profile import LiveMemory, remat_chain
from pyplan.remat_plan import (
    Checkpoint,
    Keep,
    Offload,
    RematPlan,
    Selective,
    SelectiveCheckpoint,
    full_remat,
    no_remat,
    periodic,
)
from pyplan.runtime import apply_remat
from pyplan.solve.remat import min_budget, replay, solve
from pyplan.solve.remat_search import segmented, selective, selective_gains
from pyplan.spec import ModelSpec
from pyplan.zoo.transformer import GPT, GPTConfig

SMALL = ["mlp-tiny", "resnet-tiny", "vgg-tiny", "gpt-tiny"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Two cores shared with other jobs: torch's default of one thread per core makes tiny kernels spin and wait.
    # Module-scoped, so that module-scoped fixtures compute with the same thread count (and reduction order).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _plans(n: int) -> dict[str, RematPlan]:
    """Plans over n >= 5 blocks: the baselines, nesting two and three deep, and offloading at both levels."""
    rest, from_3 = no_remat(4, n).items, no_remat(3, n).items
    innermost = Checkpoint(no_remat(0, 2))  # C[K0 K1], under two more checkpoints in "nested3"
    return {
        "no_remat": no_remat(0, n),
        "full_remat": full_remat(0, n),
        "periodic(2)": periodic(0, n, 2),
        "periodic(3)": periodic(0, n, 3),
        "nested": RematPlan((Checkpoint(RematPlan((Keep(0), Checkpoint(no_remat(1, 3)), Keep(3)))), *rest)),
        "nested3": RematPlan((Checkpoint(RematPlan((Checkpoint(RematPlan((innermost, Keep(2)))),))), *from_3)),
        "offload": RematPlan((Offload(0), Checkpoint(RematPlan((Offload(1), Keep(2)))), Offload(3), *rest)),
        "selective": RematPlan((*(Selective(i) for i in range(n - 1)), Keep(n - 1))),
        "selective+checkpoint": RematPlan((Selective(0), Checkpoint(no_remat(1, 3)), Selective(3), *rest)),
        "selective units": RematPlan((SelectiveCheckpoint(no_remat(0, 2)), SelectiveCheckpoint(no_remat(2, 4)), *rest)),
    }


def _gradients(module: nn.Module, spec: ModelSpec, batch: int) -> dict[str, torch.Tensor]:
    for p in module.parameters():
        p.grad = None
    assert spec.loss is not None and spec.target is not None
    spec.loss(module(*spec.example_inputs(batch)), spec.target(batch)).backward()
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


# --- (a) gradients: bitwise those of the traced model ---


@pytest.fixture(scope="module", params=SMALL)
def small(request: pytest.FixtureRequest) -> tuple[ModelSpec, Chain, dict[str, torch.Tensor]]:
    spec = zoo.get(request.param)
    torch.manual_seed(0)
    chain = linearize(trace(spec.build(), spec.example_inputs))
    return spec, chain, _gradients(chain.graph.module, spec, 2)


@pytest.mark.parametrize("plan", list(_plans(5)))
def test_gradients_equal_the_traced_model(small: tuple[ModelSpec, Chain, dict[str, torch.Tensor]], plan: str) -> None:
    spec, chain, expected = small
    got = _gradients(apply_remat(chain, _plans(len(chain))[plan]), spec, 2)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_dropout_is_replayed_by_the_recomputation() -> None:
    # checkpoint keeps the RNG state of the first forward (preserve_rng_state=True) and restores it to recompute.
    cfg = GPTConfig(vocab_size=64, n_ctx=16, n_layer=2, n_head=2, n_embd=32, dropout=0.3)
    x = torch.randint(64, (2, 16))
    torch.manual_seed(0)
    chain = linearize(trace(GPT(cfg), x))

    def grads(module: nn.Module, seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        for p in chain.graph.module.parameters():
            p.grad = None
        module(x).sum().backward()
        return [p.grad.clone() for p in chain.graph.module.parameters() if p.grad is not None]

    plain = grads(chain.graph.module, 1)
    assert not all(torch.equal(a, b) for a, b in zip(plain, grads(chain.graph.module, 2)))  # dropout is on
    for plan in (full_remat(0, len(chain)), _plans(len(chain))["nested3"]):
        assert all(torch.equal(a, b) for a, b in zip(plain, grads(apply_remat(chain, plan), 1)))


def test_batchnorm_counts_a_checkpointed_batch_twice() -> None:
    # Not in the plan's model: the recomputation runs BatchNorm's forward again, in training mode.
    spec = zoo.get("resnet-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    module = apply_remat(chain, periodic(0, len(chain), 2))
    _gradients(module, spec, 2)
    counts = {name: int(b) for name, b in module.named_buffers() if name.endswith("num_batches_tracked")}
    assert counts["bn1.num_batches_tracked"] == 2  # in the checkpointed first half
    assert counts["layer3.0.bn2.num_batches_tracked"] == 1  # in the last half, kept


def test_parameters_keep_their_names_and_storage() -> None:
    spec = zoo.get("gpt-tiny")
    model = spec.build()
    chain = linearize(trace(model, spec.example_inputs))
    module = apply_remat(chain, periodic(0, len(chain), 3))
    assert list(module.state_dict()) == list(model.state_dict())
    named = dict(model.named_parameters())
    assert all(p is named[name] for name, p in module.named_parameters())
    module.load_state_dict(model.state_dict())
    module.double()
    out = module(*spec.example_inputs(2))
    assert out.dtype == torch.float64 and model.lm_head.weight.dtype == torch.float64


def test_a_stage_runs_its_block_range() -> None:
    spec = zoo.get("gpt-tiny")
    chain = linearize(trace(spec.build(), spec.example_inputs))
    start, stop = 3, 11
    values = inputs_at(spec.example_inputs, 2)
    with torch.no_grad():
        for i in range(start):
            out = piece(chain, i, i + 1)(*values)
            values = out if isinstance(out, tuple) else (out,)

    def run(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        leaves = [v.detach().requires_grad_(v.is_floating_point()) for v in values]
        outs = module(*leaves)
        sum(o.sum() for o in outs if o.requires_grad).backward()
        return list(outs), [v.grad for v in leaves if v.requires_grad]

    expected = run(piece(chain, start, stop))
    got_module = apply_remat(chain, periodic(start, stop, 3))
    got = run(got_module)
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], expected[0] + expected[1]))
    names = [[name for name, _ in m.named_parameters()] for m in (got_module, piece(chain, start, stop))]
    assert names[0] == names[1]


# --- (b) memory: the live peak of a training step against the plan's model ---


class _WithLoss(nn.Module):
    """The model and its loss as one module, so that the chain's last block outputs the loss (a scalar)."""

    def __init__(self, model: nn.Module, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x), target)


def _untied(model: nn.Module) -> nn.Module:
    """Each shared parameter replaced by copies: a tied weight's gradient waits, summed in autograd's buffer,
    from the backward of its last use to that of its first; that is parameter-gradient memory, which the plan's
    model leaves to the model state (one such gradient: 64 KiB in gpt-tiny)."""
    seen: set[int] = set()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) in seen:
                setattr(module, name, nn.Parameter(p.detach().clone()))
            seen.add(id(p))
    return model


# Where layer-level blocks start, per model: (linearize depth whose block names to cut at, those names).
_LAYERS = {
    "resnet-tiny": (3, ("model.layer1.0", "model.layer2.0", "model.layer3.0", "model.avgpool")),
    "gpt-tiny": (4, ("model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f", "model.lm_head")),
}


def _layer_chain(graph: LayerGraph, name: str) -> Chain:
    depth, starts = _LAYERS[name]
    finer = linearize(graph, depth=depth)
    return linearize(graph, positions=[c.position for b, c in zip(finer.blocks, finer.cuts) if b.name in starts])


def _with_loss(name: str) -> tuple[nn.Module, ExampleInputs]:
    spec = zoo.get(name)
    assert spec.loss is not None and spec.target is not None
    torch.manual_seed(0)
    return _WithLoss(_untied(spec.build()), spec.loss), lambda b: (*spec.example_inputs(b), spec.target(b))


def _training_step_bytes(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    """Live peak of forward + backward, and bytes live after the forward, beyond inputs and parameter gradients."""
    for p in module.parameters():
        p.grad = None
    seed = torch.ones(())  # the loss's gradient: made before, like the resident output gradient of the model
    with LiveMemory() as mem:
        loss = module(*inputs)
        after_forward = mem.mark()
        loss.backward(seed)
        del loss
    mem.ignore(p.grad for p in module.parameters() if p.grad is not None)
    return mem.peak_bytes, mem.bytes_at(after_forward)


@pytest.fixture(scope="module", params=list(_LAYERS))
def layered(request: pytest.FixtureRequest) -> tuple[Chain, ExampleInputs]:
    model, example = _with_loss(request.param)
    chain = _layer_chain(trace(model, example, batch_size=4), request.param)
    assert len(chain) == 5
    return chain, example


@pytest.mark.parametrize(
    "plan",
    [
        "no_remat",
        "full_remat",
        "periodic(2)",
        "periodic(3)",
        "nested",
        "nested3",
        "selective",
        "selective+checkpoint",
        "selective units",
    ],
)
def test_training_peaks_as_predicted(layered: tuple[Chain, ExampleInputs], plan: str) -> None:
    chain, example = layered
    predicted = replay(remat_chain(chain, example, 4), _plans(len(chain))[plan])
    peak, after_forward = _training_step_bytes(apply_remat(chain, _plans(len(chain))[plan]), example(4))
    assert peak == pytest.approx(predicted.peak_bytes, rel=0.05)
    assert after_forward <= predicted.after_forward_bytes


def test_offloading_on_the_cpu_keeps_tensors_in_place(layered: tuple[Chain, ExampleInputs]) -> None:
    # save_on_cpu packs `tensor.cpu()`, the very tensor when it is on the CPU: an offloaded block costs what a
    # kept one does (save_on_cpu(pin_memory=True) would copy, the host being the device).
    chain, example = layered
    n = len(chain)
    offloaded = RematPlan((Offload(0), Checkpoint(no_remat(1, 3)), Offload(3), Keep(4)))
    kept = RematPlan((Keep(0), Checkpoint(no_remat(1, 3)), Keep(3), Keep(4)))
    assert n == 5
    assert _training_step_bytes(apply_remat(chain, offloaded), example(4)) == _training_step_bytes(
        apply_remat(chain, kept), example(4)
    )


def test_an_offload_inside_a_checkpoint_packs_in_the_first_pass(layered: tuple[Chain, ExampleInputs]) -> None:
    # save_on_cpu's hooks are the innermost, so they take what block 0 saves even while the checkpoint runs it
    # without saving: the host holds block 0's saved tensors from the first pass on (on the CPU: they stay).
    chain, example = layered
    offloaded = RematPlan((Checkpoint(RematPlan((Offload(0), Keep(1)))), *no_remat(2, 5).items))
    kept = RematPlan((Checkpoint(no_remat(0, 2)), *no_remat(2, 5).items))
    after = [_training_step_bytes(apply_remat(chain, p), example(4))[1] for p in (offloaded, kept)]
    assert after[0] > after[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("plan", ["offload", "no_remat"])
def test_offloading_on_cuda_frees_device_memory(plan: str) -> None:
    model, example = _with_loss("gpt-tiny")
    chain = _layer_chain(trace(model, example, batch_size=4), "gpt-tiny")
    chain.graph.module.cuda()
    predicted = replay(remat_chain(chain, example, 4, fake=False), _plans(len(chain))[plan])
    module = apply_remat(chain, _plans(len(chain))[plan])
    inputs = tuple(t.cuda() for t in example(4))
    for p in module.parameters():
        p.grad = None
    with LiveMemory(device="cuda") as mem:
        module(*inputs).backward(torch.ones((), device="cuda"))
    mem.ignore(p.grad for p in module.parameters() if p.grad is not None)
    # save_on_cpu brings each saved tensor back when its own backward needs it, never earlier than the model's
    # prefetch of the whole block: the model may only overestimate.
    assert mem.peak_bytes <= predicted.peak_bytes * 1.05


# --- blocks finer than layers (what the search plans on): predicted as measured, never under ---


@pytest.mark.parametrize("name", ["resnet-tiny", "gpt-tiny", "vgg-tiny", "mlp-tiny"])
def test_fine_chains_peak_as_predicted(name: str) -> None:
    """On the default chain every plan's measured peak is its prediction within 5 % and never above it (4 bytes
    of slack: the loss, which the caller holds to the end), the baselines and the plans the DP chooses at four
    budgets alike."""
    model, example = _with_loss(name)
    chain = linearize(trace(model, example, batch_size=4))
    figures = remat_chain(chain, example, 4)
    n = len(chain)
    least, top = min_budget(figures), replay(figures, no_remat(0, n)).peak_bytes
    chosen = [solve(figures, least + (top - least) * f, slots=300).plan for f in (0.1, 0.3, 0.5, 0.8)]
    chosen.append(selective(n, selective_gains(figures)))
    chosen.append(segmented(n, [(k, k + 3) for k in range(0, n - 3, 3)], selective=True))  # units of 3 blocks
    for plan in [no_remat(0, n), full_remat(0, n), *(periodic(0, n, k) for k in (2, 3, 4)), *chosen]:
        peak, _ = _training_step_bytes(apply_remat(chain, plan), example(4))
        predicted = replay(figures, plan).peak_bytes
        assert peak <= predicted + 4, plan.describe()
        assert peak == pytest.approx(predicted, rel=0.05), plan.describe()


@pytest.mark.parametrize("name", ["resnet-tiny", "gpt-tiny", "vgg-tiny"])
def test_peak_with_the_gradients_made_from_none(name: str) -> None:
    """A step whose parameter gradients start from none (zero_grad(set_to_none=True)): the measured peak with them
    counted is `peak_with_grads_bytes` at most, and at least that less one block's gradients (the replay counts a
    block's gradients at its own backward peak; autograd makes them somewhere in that backward)."""
    model, example = _with_loss(name)
    chain = linearize(trace(model, example, batch_size=4))
    figures = remat_chain(chain, example, 4)
    grads = [4.0 * b.param_numel for b in chain.blocks]
    n = len(chain)
    for plan in [no_remat(0, n), full_remat(0, n), periodic(0, n, 3)]:
        module = apply_remat(chain, plan)
        for p in module.parameters():
            p.grad = None
        inputs, seed = example(4), torch.ones(())  # made before, as the caller's
        with LiveMemory() as mem:
            loss = module(*inputs)
            loss.backward(seed)
            del loss
        predicted = replay(figures, plan, param_grad_bytes=grads)
        assert predicted.peak_bytes <= predicted.peak_with_grads_bytes <= predicted.peak_bytes + sum(grads)
        assert mem.peak_bytes <= predicted.peak_with_grads_bytes + 4, plan.describe()
        assert mem.peak_bytes >= predicted.peak_with_grads_bytes - max(grads) - 4, plan.describe()
