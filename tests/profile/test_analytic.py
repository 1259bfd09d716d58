"""Analytic roofline time: op classes, FLOPs and bytes per op, and block times against a hand count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import linearize, trace
from pyplan.profile.analytic import Efficiency, OpCost, Roofline, block_op_costs, block_times_analytic, op_class

DEVICE = Roofline(
    {"fp32": 10e12, "bf16": 100e12},
    1e12,
    Efficiency(
        compute=dict.fromkeys(("matmul", "attention", "norm", "elementwise"), 1.0),
        memory=dict.fromkeys(("matmul", "attention", "norm", "elementwise"), 1.0),
        launch_s=0.0,
        host_s=0.0,
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


def test_the_host_issues_ops_while_the_gpu_runs_them() -> None:
    """Each op waits to be issued (host_s apart, views too) and for the GPU to finish the one before: behind a
    long kernel the host gets ahead and short ones queue; a run of short ones waits on the host."""
    from dataclasses import replace

    device = replace(DEVICE, efficiency=replace(DEVICE.efficiency, host_s=10e-6))

    def kernel(seconds: float) -> OpCost:
        return OpCost("add", "elementwise", 0.0, seconds * 1e12, "float32")

    view = OpCost("view", "elementwise", 0.0, 0.0, "float32", is_view=True)
    # Issued at 10, 20, 30, 40 µs; the first runs 10-110, the next two queue (110-112, 112-114), the view delays
    # the last issue to 50, which still runs at once after the third: 114-116.
    assert device.sequence_time_s([kernel(100e-6), kernel(2e-6), kernel(2e-6), view, kernel(2e-6)]) == (
        pytest.approx(116e-6)
    )
    # Short kernels alone: the host's pace (ten issues, the last kernel 2 µs after it).
    assert device.sequence_time_s([kernel(2e-6)] * 10) == pytest.approx(102e-6)
    assert DEVICE.sequence_time_s([kernel(2e-6)] * 10) == pytest.approx(20e-6)  # no host floor: their sum


def test_a_blocks_time_has_the_hosts_floor_at_small_batches() -> None:
    """On a GPU with a host floor, a block costs at least the host's time to issue its ops, and at most that plus
    the GPU's work: at one sample the host's pace, at 512 the GPU's product. The curve goes through the evaluated
    sizes with each op's FLOPs and bytes at that size: a line through the recorded sizes (1, 2, 4), where the
    weight's bytes bound the product, would miss its FLOPs at 512 (25 µs for 430)."""
    from dataclasses import replace

    from pyplan.graph.layergraph import Piecewise

    model = nn.Sequential(nn.Linear(2048, 2048), nn.GELU())
    x = torch.randn(4, 2048)
    chain = linearize(trace(model, x))
    host = replace(DEVICE, efficiency=replace(DEVICE.efficiency, host_s=20e-6))
    ((floored, _), *_) = block_times_analytic(chain, x, host, (1, 2, 4))
    ((one, _), *_) = block_op_costs(chain, x, 1)  # the Linear's block
    ((many, _), *_) = block_op_costs(chain, x, 512)
    floor = len(one) * 20e-6
    gpu = [sum(DEVICE.op_time_s(op) for op in ops) for ops in (one, many)]
    assert isinstance(floored, Piecewise) and 512 in floored.sizes
    assert gpu[0] < floor <= floored(1) <= floor + gpu[0]
    assert gpu[1] > floor and gpu[1] <= floored(512) <= gpu[1] + floor


@pytest.mark.parametrize("name", ["gpt2-small", "llama-1b-style"])
def test_analytic_flops_are_the_flop_counters(name: str) -> None:
    """The FLOPs an analytic profile reads off its op recordings (fused, causal attention on an A100 under bf16
    autocast, where the kernel computes about half the tiles) are what FlopCounterMode counts on the math kernels,
    block by block, in both directions."""
    from pyplan import zoo
    from pyplan._torch import meta_build
    from pyplan.graph.trace import Examples
    from pyplan.hardware.catalog import get_gpu
    from pyplan.profile.analytic import analytic_blocks
    from pyplan.profile.attention import AttentionTarget, TargetKernels
    from pyplan.profile.flops import block_flops
    from pyplan.profile.pieces import RepeatedBlocks

    spec = zoo.get(name)
    with meta_build():
        model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=2))
    examples, table = Examples(spec.example_inputs), RepeatedBlocks.of(chain)
    gpu = get_gpu("a100-80g")
    with TargetKernels(AttentionTarget(gpu.arch, "bfloat16")) as kernels:
        counted = block_flops(chain, examples, (1, 4), blocks=table)
        got = analytic_blocks(chain, examples, DEVICE, (1, 2, 4), compute_dtype="bfloat16", autocast=True, blocks=table)
    assert kernels.chosen  # fused attention ran, its FLOPs scaled for the time
    assert len(got.flops) == len(counted) == len(chain)
    for (f, g), (cf, cg) in zip(got.flops, counted, strict=True):
        for b in (1, 3, 8):
            assert (f(b), g(b)) == (cf(b), cg(b))
