"""Analytic roofline time: op classes, FLOPs and bytes per op, and block times against a hand count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import linearize, trace
from pyplan.profile.analytic import Efficiency, Roofline, block_op_costs, block_times_analytic, op_class

DEVICE = Roofline(
    {"fp32": 10e12, "bf16": 100e12},
    1e12,
    Efficiency(
        compute=dict.fromkeys(("matmul", "attention", "norm", "elementwise"), 1.0),
        memory=dict.fromkeys(("matmul", "attention", "norm", "elementwise"), 1.0),
        launch_s=0.0,
    ),
)


def test_op_classes() -> None:
    assert op_class("addmm") == op_class("convolution") == op_class("convolution_backward") == "matmul"
    assert op_class("_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_class("native_layer_norm_backward") == "norm"
    assert op_class("gelu") == "elementwise"


def test_linear_block_time_is_its_roofline() -> None:
    model = nn.Sequential(nn.Linear(1024, 4096))
    x = torch.randn(8, 1024)
    chain = linearize(trace(model, x))
    ((fwd_ops, _),) = block_op_costs(chain, x, 8)
    (addmm,) = [op for op in fwd_ops if op.name == "addmm"]
    assert addmm.flops == 2 * 8 * 1024 * 4096
    # Reads x, W and the bias, writes the output; float32.
    assert addmm.bytes == 4 * (8 * 1024 + 1024 * 4096 + 4096 + 8 * 4096)
    ((fwd, _),) = block_times_analytic(chain, x, DEVICE, (8, 16))
    expected = max(addmm.flops / 10e12, addmm.bytes / 1e12)
    assert fwd(8) == pytest.approx(expected, rel=1e-9)


def test_mixed_precision_uses_the_bf16_peak_and_half_the_bytes() -> None:
    model = nn.Sequential(nn.Linear(4096, 4096))
    x = torch.randn(64, 4096)
    chain = linearize(trace(model, x))
    ((fp32, _),) = block_op_costs(chain, x, 64)
    ((bf16, _),) = block_op_costs(chain, x, 64, compute_dtype="bfloat16")
    mm32 = next(op for op in fp32 if op.name == "addmm")
    mm16 = next(op for op in bf16 if op.name == "addmm")
    assert mm16.dtype == "bfloat16" and mm16.bytes == mm32.bytes / 2 and mm16.flops == mm32.flops
    assert DEVICE.op_time_s(mm16) < DEVICE.op_time_s(mm32)


def test_views_cost_nothing() -> None:
    chain = linearize(trace(nn.Flatten(), torch.randn(2, 3, 4)))
    ((fwd, _),) = block_op_costs(chain, torch.randn(2, 3, 4), 2)
    assert fwd and all(op.is_view and DEVICE.op_time_s(op) == 0.0 for op in fwd)
