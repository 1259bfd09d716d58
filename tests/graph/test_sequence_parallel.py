"""The saved-tensor hooks of sequence parallelism (pyplan/graph/sequence_parallel.py's `Gathered`): a gathered input
is saved as the slice it was gathered from and gathered again in backward, once for every Linear that saved it, as
Megatron-LM's sequence-parallel Linear does; training is unchanged."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pyplan._torch import storage_key
from pyplan.graph.sequence_parallel import Gathered

T = 4  # the degree the stand-in gather repeats the slice by


def _layer(gathered: Gathered, x: torch.Tensor, weights: list[torch.Tensor], saving: bool) -> torch.Tensor:
    """Q, K and V on the slice x gathered once (three readers), each inside `saving()` when asked."""
    outs = []
    for w in weights:
        g = gathered(x, 1, len(weights))
        if saving:
            with gathered.saving():
                outs.append(F.linear(g, w))
        else:
            outs.append(F.linear(g, w))
    return sum(o.square().sum() for o in outs)


def _setup() -> tuple[list[str], Gathered, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    calls: list[str] = []

    def make(x: torch.Tensor, dim: int) -> torch.Tensor:
        calls.append("backward" if not torch.is_grad_enabled() else "forward")
        return x.repeat(*(T if i == dim else 1 for i in range(x.dim())))

    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    return calls, Gathered(make), x, weights


def test_a_gathered_input_is_saved_as_its_slice_and_gathered_again_once_in_backward() -> None:
    calls, gathered, x, weights = _setup()
    want = torch.autograd.grad(_layer(gathered, x, weights, saving=False), [x, *weights])
    calls.clear()
    made: list[torch.Tensor] = []
    make = gathered.make
    gathered.make = lambda t, dim: made.append(out := make(t, dim)) or out  # type: ignore[method-assign]
    seen: list[torch.Tensor] = []
    piece = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        loss = _layer(gathered, piece, weights, saving=True)
    assert calls == ["forward"]  # one gather for Q, K and V
    # The hooks outside see the slice (three times, once per Linear) and every other tensor, never the gathered one.
    keys = [storage_key(t) for t in seen]
    assert keys.count(storage_key(piece)) == 3 and storage_key(made[0]) not in keys
    assert {storage_key(w) for w in weights} <= set(keys)
    got = torch.autograd.grad(loss, [piece, *weights])
    assert calls == ["forward", "backward"]  # once again for the three Linears' weight gradients
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_gathered_value_is_freed_once_its_readers_have_read_it() -> None:
    _, gathered, x, weights = _setup()
    made: list[weakref.ref[torch.Tensor]] = []
    make = gathered.make
    gathered.make = lambda t, dim: made.append(weakref.ref(out := make(t, dim))) or out  # type: ignore[method-assign]
    loss = _layer(gathered, x, weights, saving=True)
    assert len(made) == 1 and made[0]() is None  # autograd keeps the slice only
    loss.backward()
    regathered = [s.regathered for s in gathered._sources.values()]
    assert all(r.value is None and r.count == 0 for r in regathered)  # released after the last unpack


def test_inside_a_checkpoint_training_is_unchanged() -> None:
    _, gathered, x, weights = _setup()
    want = torch.autograd.grad(_layer(gathered, x, weights, saving=False), [x, *weights])
    loss = checkpoint(lambda y: _layer(gathered, y, weights, saving=True), x, use_reentrant=False)
    got = torch.autograd.grad(loss, [x, *weights])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_under_autocast_the_16_bit_copy_is_saved_as_the_slice_cast_and_gathered_again_in_16_bits() -> None:
    calls, gathered, x, weights = _setup()
    x, weights = x.float().detach().requires_grad_(), [w.float().detach().requires_grad_() for w in weights]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(_layer(gathered, x, weights, saving=False), [x, *weights])
    calls.clear()
    seen: list[torch.Tensor] = []
    count = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t)
    with torch.autocast("cpu", dtype=torch.bfloat16), count:
        loss = _layer(gathered, x, weights, saving=True)
    # Q, K and V each saved autocast's copy of the whole input; the hooks outside see one 16-bit slice instead.
    inputs = [t for t in seen if t.dtype == torch.bfloat16 and t.shape[-1] == 8 and t.shape[0] != 5]
    assert len(inputs) == 3 and len({storage_key(t) for t in inputs}) == 1 and inputs[0].shape == x.shape
    got = torch.autograd.grad(loss, [x, *weights])
    assert calls == ["forward", "backward"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
