"""pyplan's cross-entropy: torch's values and gradients, fp32 arithmetic on 16-bit logits, and its memory."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from pyplan._torch import storage_key
from pyplan.cross_entropy import fused_cross_entropy
from pyplan.profile.live import LiveMemory
from pyplan.profile.loss import LossFn
from pyplan.spec import cross_entropy, upcasts_itself

ROWS, CLASSES = 37, 11


def _batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    logits = (3 * torch.randn(ROWS, CLASSES, dtype=torch.float64)).to(dtype).requires_grad_()
    target = torch.randint(0, CLASSES, (ROWS,))
    target[[3, 10, 36]] = -100  # left out, as F.cross_entropy's ignore_index
    return logits, target


def _reference(logits: torch.Tensor, target: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy of the same values in float64, and its gradient times `scale`."""
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x, target)
    (loss * scale).backward()
    assert x.grad is not None
    return loss.detach(), x.grad


@pytest.mark.parametrize("rows", [1, 3, 8, ROWS, 100])  # chunks of one row, some not dividing the rows, one
def test_float64_is_torch_to_rounding(rows: int) -> None:
    logits, target = _batch(torch.float64)
    loss = fused_cross_entropy(logits, target, chunk_elements=rows * CLASSES)
    (loss * 3.0).backward()
    expected, grad = _reference(logits, target, 3.0)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-13, atol=1e-13)
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, grad, rtol=1e-13, atol=1e-13)
    assert logits.grad[[3, 10, 36]].abs().max() == 0  # the rows left out get no gradient


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_are_computed_in_fp32(dtype: torch.dtype) -> None:
    """The loss of the 16-bit values is the fp32 loss (not a 16-bit log-softmax's); the gradient is the fp32
    gradient rounded once to the logits' dtype."""
    logits, target = _batch(dtype)
    loss = fused_cross_entropy(logits, target, chunk_elements=4 * CLASSES)
    loss.backward()
    expected, grad = _reference(logits, target, 1.0)
    assert loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) < 1e-6
    assert logits.grad is not None and logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad, grad.to(dtype), rtol=0, atol=float(torch.finfo(dtype).eps) / 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = F.cross_entropy(logits.detach(), target)  # torch's, in the logits' own dtype
    assert abs(loss.item() - expected.item()) < abs(plain.item() - expected.item())


def test_every_row_left_out_is_nan_as_in_torch() -> None:
    logits, target = _batch(torch.float32)
    target[:] = -100
    assert fused_cross_entropy(logits, target).isnan() and F.cross_entropy(logits, target).isnan()


def test_the_loss_of_a_language_model_is_over_every_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, CLASSES, dtype=torch.float64)
    target = torch.randint(0, CLASSES, (2, 5))
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    torch.testing.assert_close(cross_entropy(logits, target), expected, rtol=1e-13, atol=0)
    assert upcasts_itself(cross_entropy) and not upcasts_itself(F.cross_entropy)
    assert not upcasts_itself(lambda out, target: cross_entropy(out, target))


def test_bad_shapes_and_dtypes_are_one_line() -> None:
    logits, target = _batch(torch.float32)
    with pytest.raises(ValueError, match=r"logits \(N, C\) and targets \(N,\), not \[37, 11\] and \[36\]"):
        fused_cross_entropy(logits, target[1:])
    with pytest.raises(TypeError, match="floating logits and class indices"):
        fused_cross_entropy(logits, target.float())


def _memory(loss_fn: LossFn, dtype: torch.dtype, rows: int, classes: int) -> tuple[int, int]:
    """New bytes autograd saves in the loss's forward (the logits' own storage aside: their stage holds them) and
    the live peak of its backward, on meta tensors."""
    logits = torch.empty(rows, classes, dtype=dtype, device="meta", requires_grad=True)
    target = torch.zeros(rows, dtype=torch.long, device="meta")
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(logits, target)
    with LiveMemory() as live:
        loss.backward()
    saved.pop(storage_key(logits), None)
    return sum(saved.values()), live.peak_bytes


def test_memory_is_the_logits_gradient_and_one_fp32_chunk() -> None:
    """On Llama 3's vocabulary at 2,048 positions: nothing of the logits' size kept beyond them, a backward of
    their 16-bit gradient and one fp32 chunk, where casting them to fp32 for torch's loss keeps an fp32
    log-softmax and makes two fp32 gradients (six times the bf16 logits)."""
    rows, classes = 2048, 128_256
    chunk = (1 << 25) // classes * classes * 4
    logits = rows * classes * 2
    saved, peak = _memory(fused_cross_entropy, torch.bfloat16, rows, classes)
    assert saved < 20 * rows  # per row: the log-sum-exp, the target and whether it counts
    assert logits + chunk <= peak < logits + chunk + 100 * rows
    saved, peak = _memory(lambda x, t: F.cross_entropy(x.float(), t), torch.bfloat16, rows, classes)
    assert saved >= 2 * logits and saved + peak >= 6 * logits
