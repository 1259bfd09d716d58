"""MetaMemo: an op called again on meta arguments of the same layouts gets new tensors of the layouts its meta kernel
gave, without running it; views, in-place ops and anything off meta run as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyplan._torch import MetaMemo, storage_key


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that reach the kernels beneath it (entered first, so beneath the memo)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _layouts(out: object) -> list[tuple]:
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) for t in leaves if isinstance(t, torch.Tensor)]


def _calls(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> list[object]:
    return [
        torch.ops.aten.native_layer_norm.default(x, [8], w, b, 1e-5),  # three outputs, a Python meta kernel
        torch.ops.aten.gelu.default(x),
        torch.ops.aten.addmm.default(b, x.flatten(0, 1), w.expand(8, 8)),
        torch.ops.aten.native_dropout.default(x, 0.1, True),
        torch.ops.aten.add.Tensor(x, 1),
        torch.ops.aten.add.Tensor(x.to(torch.int64), 1.5),  # promotes to float: the scalar's type is in the key
        torch.ops.aten._to_copy.default(x, dtype=torch.bfloat16),
        torch.ops.aten.sum.dim_IntList(x.transpose(0, 1), [0]),
    ]


def test_a_repeated_call_gets_the_layouts_of_the_first_without_running_the_kernel() -> None:
    x, w, b = (torch.empty(*s, device="meta") for s in ((3, 4, 8), (8,), (8,)))
    want = [_layouts(out) for out in _calls(x, w, b)]
    count = _Count()
    with count, MetaMemo():
        first = [_layouts(out) for out in _calls(x, w, b)]
        ran_once = len(count.ops)
        again = _calls(x, w, b)
    assert first == want and [_layouts(out) for out in again] == want
    # The second round ran only what makes no new tensor (the views and in-place ops feeding the calls: flatten,
    # expand, transpose) and what was given another layout (none), besides the factories a hit makes.
    kernels_again = [op for op in count.ops[ran_once:] if op != "empty_strided"]
    assert "native_layer_norm" not in kernels_again and "gelu" not in kernels_again and "addmm" not in kernels_again
    inputs = {storage_key(t) for t in (x, w, b)}
    for out in again:
        leaves = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
        assert all(t.is_meta and storage_key(t) not in inputs for t in leaves)
        assert len({storage_key(t) for t in leaves}) == len(leaves)


def test_views_in_place_ops_and_real_tensors_run_as_they_are() -> None:
    x = torch.empty(3, 4, device="meta")
    with MetaMemo():
        for _ in range(2):
            v = x.t()
            assert v._base is x and storage_key(v) == storage_key(x)
            y = torch.empty(3, 4, device="meta")
            assert y.add_(1) is y
        real = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(F.gelu(real), F.gelu(torch.arange(6.0).reshape(2, 3)))
        assert torch.equal(real * 2, torch.arange(0.0, 12.0, 2.0).reshape(2, 3))


def test_autograd_through_memoized_ops_on_meta_matches_without_the_memo() -> None:
    def grads() -> list[tuple]:
        w = torch.empty(8, 8, device="meta", requires_grad=True)
        x = torch.empty(4, 8, device="meta", requires_grad=True)
        out = F.layer_norm(F.gelu(x @ w), [8]).sum()
        out.backward()
        return _layouts((x.grad, w.grad))

    want = grads()
    with MetaMemo():
        assert grads() == want and grads() == want
