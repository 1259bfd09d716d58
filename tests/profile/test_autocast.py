"""CUDA autocast's policy on meta tensors (pyplan/profile/autocast.py), as the analytic profile of a mixed-precision
plan records a block's ops."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyplan._torch import OpRecorder
from pyplan.errors import PlanError
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import trace
from pyplan.profile.analytic import block_op_costs
from pyplan.profile.autocast import (
    _APPEND_DTYPE,
    COMPOSITE,
    FP32,
    FP32_SET_OPT_DTYPE,
    LOWER,
    PROMOTE,
    AutocastAbove,
    CudaAutocast,
)

MIXED_OPS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "models", "real", "mixed_ops.py")


class _PreNorm(nn.Module):
    """x + W2 gelu(W1 layer_norm(x)), the residual stream in fp32 under autocast."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def _recorded(module: nn.Module, x: torch.Tensor) -> tuple[list[tuple[str, str]], list[tuple[str, str]], torch.Tensor]:
    forward, backward = OpRecorder(), OpRecorder()
    casts = CudaAutocast(torch.bfloat16)
    with forward, casts:
        out = module(x)
    with backward, casts.backward():
        out.sum().backward()
    keep = lambda ops: [(name, dtype) for name, _, _, dtype, view, _ in ops if not view]  # noqa: E731
    return keep(forward.ops), keep(backward.ops), out


def test_the_policy_lists_are_apart() -> None:
    lists = (LOWER, FP32, FP32_SET_OPT_DTYPE, PROMOTE)
    assert all(not (a & b) for i, a in enumerate(lists) for b in lists[i + 1 :])


def _header_lists() -> dict[str, set[str]]:
    """The op names of each list of ATen's autocast_mode.h as installed with torch (AT_FORALL_...)."""
    path = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")
    if not os.path.exists(path):
        pytest.skip("torch's C++ headers are not installed")
    with open(path) as f:
        text = f.read()
    lists = {}
    for macro in ("LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "DIFFERENT_REDISPATCH_SIGNATURE", "PROMOTE"):
        body = re.search(rf"#define AT_FORALL_{macro}\(_\)(.*?)\n\n", text, re.S)
        assert body is not None, f"AT_FORALL_{macro} is gone from {path}"
        lists[macro] = set(re.findall(r"_\((?:ADD_NS\()?(\w+)", body.group(1)))
    return lists


def test_every_op_cuda_autocast_casts_is_in_a_list() -> None:
    """Each op of ATen's lists in the installed torch has its policy here (a new torch may add some)."""
    header = _header_lists()
    assert header["LOWER_PRECISION_FP"] | {"cudnn_convolution", "cudnn_convolution_transpose"} <= LOWER
    assert header["FP32"] <= FP32
    assert header["FP32_SET_OPT_DTYPE"] == FP32_SET_OPT_DTYPE
    assert header["DIFFERENT_REDISPATCH_SIGNATURE"] == {op.overloadpacket.__name__ for op in _APPEND_DTYPE}
    assert header["PROMOTE"] == PROMOTE


def test_the_composites_are_the_ops_the_dispatcher_decomposes() -> None:
    """COMPOSITE holds the ops of the lists with a CompositeImplicitAutograd kernel: those the dispatch mode never
    sees whole (autocast casts their inputs before they decompose)."""

    def decomposes(name: str) -> bool:
        packet = getattr(torch.ops.aten, name)
        names = [f"aten::{name}" + ("" if o == "default" else f".{o}") for o in packet.overloads()]
        # A few overloads are listed but unregistered (einsum.sublist).
        return any(
            torch._C._dispatch_has_kernel(n)
            and torch._C._dispatch_has_kernel_for_dispatch_key(n, "CompositeImplicitAutograd")
            for n in names
        )

    listed = LOWER | FP32 | FP32_SET_OPT_DTYPE | PROMOTE
    assert {name for name in listed if decomposes(name)} == COMPOSITE


def test_a_pre_norm_block_runs_as_under_cuda_autocast() -> None:
    """On CUDA, autocast runs layer_norm in fp32, the linears in bf16 on cast copies of their inputs and weights,
    GELU in bf16 (its input's dtype) and the residual add in fp32 (type promotion); the weights' gradients come
    back in fp32."""
    with torch.device("meta"):
        module = _PreNorm()
        x = torch.empty(8, 16, 64, requires_grad=True)
    forward, backward, out = _recorded(module, x)
    names = [name for name, _ in forward]
    assert ("native_layer_norm", "float32") in forward
    assert [dtype for name, dtype in forward if name == "addmm"] == ["bfloat16", "bfloat16"]
    assert ("gelu", "bfloat16") in forward
    assert forward[-1] == ("add", "float32") and out.dtype == torch.float32
    # Each linear casts its weight and bias, the first its fp32 input too (GELU's output is bf16 already): five
    # casts, each made once.
    assert names.count("_to_copy") == 5
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in module.parameters())
    assert x.grad is not None and x.grad.dtype == torch.float32
    # The backward's products in bf16 on the casts the forward made (no new cast of a weight or an input).
    assert {dtype for name, dtype in backward if name == "mm"} == {"bfloat16"}
    # The backward casts each forward cast's gradient back (five) and the residual's fp32 gradient to the bf16 of
    # the product it reaches (one), as under autocast; it computes the bias gradients in bf16 (no autocast there).
    assert sum(name == "_to_copy" for name, _ in backward) == 6
    assert {dtype for name, dtype in backward if name == "sum"} == {"float32", "bfloat16"}


def test_fp32_ops_given_a_dtype_run_as_asked() -> None:
    with torch.device("meta"):
        x = torch.empty(4, 8, dtype=torch.bfloat16)
    with CudaAutocast(torch.bfloat16):
        assert torch.softmax(x, -1).dtype == torch.float32  # AT_FORALL_FP32_SET_OPT_DTYPE
        assert torch.sum(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.exp(x).dtype == torch.float32
        assert torch.relu(x).dtype == torch.bfloat16  # not in a list: its input's dtype
        assert torch.addcmul(x, x, x.float()).dtype == torch.float32  # promote


def test_mixed_precision_blocks_are_priced_on_the_ops_autocast_runs() -> None:
    """block_op_costs with autocast: 16-bit products, fp32 norms and residuals, and the casts between; without it
    and with a compute dtype, the same block on bf16 weights computes every op in bf16."""
    example = lambda b: (torch.randn(b, 16, 64),)  # noqa: E731
    chain = linearize(trace(_PreNorm(), example, batch_size=2), min_blocks=1)
    mixed = [op for fwd, _ in block_op_costs(chain, example, 4, compute_dtype="bfloat16", autocast=True) for op in fwd]
    weights = [op for fwd, _ in block_op_costs(chain, example, 4, compute_dtype="bfloat16") for op in fwd]
    assert {op.dtype for op in mixed if op.op_class == "matmul"} == {"bfloat16"}
    assert {op.dtype for op in mixed if op.name == "native_layer_norm"} == {"float32"}
    assert any(op.name == "_to_copy" for op in mixed)
    assert {op.dtype for op in weights if not op.is_view and op.name != "_to_copy"} == {"bfloat16"}


def test_zero3_alone_is_priced_as_fsdp2s_policy_computes() -> None:
    """Under bf16-mixed every layout computes under autocast but ZeRO-3's one-stage FSDP, whose FSDP2 policy computes
    in 16-bit weights (and casts the logits to fp32 for a loss of your own): a search of ZeRO-3 alone profiles that,
    any other the autocast emulation (its fp32 norms and residuals and its casts take longer)."""
    import pyplan
    from pyplan.api import chain_for
    from pyplan.hardware import Cluster
    from pyplan.plan import Workload

    spec = pyplan.load_model("zoo:gpt-tiny")
    cluster, workload = Cluster.from_catalog("h100-sxm", 2), Workload(global_batch=8, precision="bf16-mixed")
    with torch.device("meta"):
        model = spec.build()
    under, _ = chain_for(model, spec.example_inputs, cluster, workload, autocast=True)
    policy, _ = chain_for(model, spec.example_inputs, cluster, workload, autocast=False)
    assert sum(b.fwd_time_s(4) for b in under.blocks) > sum(b.fwd_time_s(4) for b in policy.blocks)
    kw = dict(loss=spec.loss, target=spec.target, top_k=1, stage_dag=False)
    zero3 = pyplan.search(model, spec.example_inputs, cluster, workload, zero_stages=(3,), **kw)
    every = pyplan.search(model, spec.example_inputs, cluster, workload, **kw)
    body = lambda chain: sum(b.fwd_time_s(4) for b in chain.blocks[:-1])  # noqa: E731  (the loss joins the last)
    assert body(zero3.chain) == body(policy) and body(every.chain) == body(under)
    assert body(policy) < body(under)
    # pyplan's cross-entropy takes the bf16 logits under either (FSDP2's policy casts them to fp32 for other losses).
    assert zero3.chain.loss.saved_bytes(4) == every.chain.loss.saved_bytes(4)


def test_autocast_above_autograd_saves_the_16_bit_copies() -> None:
    """`AutocastAbove` casts before autograd sees an op, as autocast's dispatch key does: the pre-norm block saves
    its fp32 input for the norm (with two fp32 numbers a row), and 16-bit copies for the products: the norm's
    output and each weight (cast once however often it is read), the up-projection's output for the GELU and
    the GELU's output for the down-projection; the residual sum comes out fp32. These are the bytes a
    mixed-precision step holds (under `CudaAutocast`, below autograd, it would save the fp32 originals)."""
    from pyplan._torch import storage_key
    from pyplan.profile.autocast import AutocastAbove

    rows, width = 8, 64
    block = _PreNorm(width).to("meta")
    x = torch.empty(rows, width, device="meta", requires_grad=True)
    saved: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[storage_key(t)] = (t.untyped_storage().nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), AutocastAbove(torch.bfloat16) as casts:
        out = block(x)
        again = casts._cast(block.up.weight, torch.bfloat16)
    assert out.dtype == torch.float32
    assert again is casts._cast(block.up.weight, torch.bfloat16)  # the weight's copy, cached
    products = {storage_key(p) for p in (block.up.weight, block.down.weight)}
    assert not products & saved.keys()  # the products keep no fp32 weight (the norm keeps its own, no new bytes)
    params = {storage_key(p) for p in block.parameters()}
    by_dtype: dict[torch.dtype, int] = {}
    for key, (nbytes, dtype) in saved.items():
        if key not in params:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    weights = 2 * (4 * width * width) * 2  # two bf16 copies of 4·w² elements
    activations = (rows * width + 2 * rows * 4 * width) * 2  # norm output, up output, GELU output, in bf16
    assert by_dtype == {torch.float32: (rows * width + 2 * rows) * 4, torch.bfloat16: weights + activations}


def _forward(module: nn.Module, *inputs: torch.Tensor) -> tuple[list[tuple[str, str]], torch.Tensor]:
    """The kernels (name, dtype) of `module`'s forward under the emulation, and its output, after a backward."""
    recorder, casts = OpRecorder(), CudaAutocast(torch.bfloat16)
    with recorder, casts:
        out = module(*inputs)
    with casts.backward():
        out.float().sum().backward()
    return [(name, dtype) for name, _, _, dtype, view, _ in recorder.ops if not view], out


def _dtypes(ops: list[tuple[str, str]], name: str) -> set[str]:
    return {dtype for op, dtype in ops if op == name}


def test_convolutions_given_16_bit_maps_cast_their_weights_and_biases() -> None:
    """conv1d/2d/3d and conv_transpose check their bias's dtype against their input's before they decompose: autocast
    casts input, weight and bias first, so a convolution with a bias after another's bf16 output runs in bf16."""
    with torch.device("meta"):
        net = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),  # in no list: bf16 in, bf16 out
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ConvTranspose2d(4, 4, 2, stride=2),
            nn.Flatten(2),
            nn.Conv1d(4, 4, 3, padding=1),
            nn.Unflatten(2, (8, 8)),
            nn.Unflatten(1, (1, 4)),
            nn.Conv3d(1, 2, 3, padding=1),
        )
        x = torch.empty(2, 3, 4, 4)
    ops, out = _forward(net, x)
    assert _dtypes(ops, "convolution") == {"bfloat16"} and out.dtype == torch.bfloat16
    assert _dtypes(ops, "native_batch_norm") | _dtypes(ops, "_native_batch_norm_legit") == {"bfloat16"}
    # The first casts its input, weight and bias; each other its weight and bias.
    assert [name for name, _ in ops].count("_to_copy") == 3 + 2 * 4
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())


def test_norms_run_in_their_policys_dtype() -> None:
    """On a bf16 activation: batch norm in bf16 (no list), group, layer and RMS norms in fp32 (AT_FORALL_FP32)."""
    with torch.device("meta"):
        lin, bn, gn, ln, rms = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8), nn.LayerNorm(8), nn.RMSNorm(8)
        x = torch.empty(4, 8)
    with CudaAutocast(torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16 and bn(h).dtype == torch.bfloat16
        assert gn(h).dtype == ln(h).dtype == rms(h).dtype == torch.float32
        assert F.group_norm(h, 2).dtype == torch.float32


def test_products_of_mixed_dtypes_run_in_16_bits() -> None:
    """addmm, bmm, baddbmm, einsum, matmul and an LSTM given bf16 and fp32 operands compute in bf16."""
    with torch.device("meta"):
        a, w, bias = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(8, 8), torch.empty(8)
        batch = torch.empty(2, 4, 8)
        lstm = nn.LSTM(8, 8, batch_first=True)
        cell = nn.GRUCell(8, 8)
    with CudaAutocast(torch.bfloat16):
        assert torch.addmm(bias, a, w).dtype == torch.bfloat16
        square = torch.bmm(batch, batch.transpose(1, 2).to(torch.bfloat16))
        assert square.dtype == torch.bfloat16
        assert torch.baddbmm(batch[:, :, :4], square, batch[:, :, :4]).dtype == torch.bfloat16
        assert torch.einsum("bij,jk->bik", batch, w).dtype == (a @ w).dtype == torch.bfloat16
        rows, _ = lstm(batch)
        assert rows.dtype == torch.bfloat16 and cell(rows[:, 0], rows[:, 1].float()).dtype == torch.bfloat16


def test_reductions_given_no_dtype_write_fp32_without_a_cast() -> None:
    """AT_FORALL_FP32_SET_OPT_DTYPE: a sum of bf16 reads bf16 and writes fp32 (its dtype set, no cast kernel);
    fp32_append_dtype: norm without a dtype runs as its overload with one."""
    with torch.device("meta"):
        x = torch.empty(4, 8, dtype=torch.bfloat16)
    recorder = OpRecorder()
    with recorder, CudaAutocast(torch.bfloat16):
        assert x.sum(-1).dtype == torch.cumsum(x, 0).dtype == torch.float32
        assert torch.linalg.vector_norm(x).dtype == torch.float32
        assert (
            torch.ops.aten.norm.Scalar(x).dtype == torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]).dtype == torch.float32
        )
        assert torch.ops.aten.norm.ScalarOpt_dtype(x, 2, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert [name for name, *_ in recorder.ops] == ["sum", "cumsum", "linalg_vector_norm", "norm", "norm", "norm"]


def test_promoting_ops_take_the_widest_dtype() -> None:
    """AT_FORALL_PROMOTE: scatter_add and index_put, which refuse mixed dtypes, run in fp32 beside an fp32 input;
    in bf16 when every input is bf16."""
    with torch.device("meta"):
        x, half = torch.empty(4, 8), torch.empty(4, 8, dtype=torch.bfloat16)
        index = torch.zeros(4, 8, dtype=torch.long)
    with CudaAutocast(torch.bfloat16):
        assert half.scatter_add(1, index, x).dtype == torch.float32
        assert x.index_put((index[:, 0],), half).dtype == torch.float32
        assert torch.atan2(half, half).dtype == torch.bfloat16
        assert torch.addcmul(half, half, half).dtype == torch.bfloat16


def test_binary_cross_entropy_is_refused_as_autocast_refuses_it() -> None:
    with torch.device("meta"):
        p, y = torch.empty(4), torch.empty(4)
    for mode in (CudaAutocast(torch.bfloat16), AutocastAbove(torch.bfloat16)):
        with mode, pytest.raises(PlanError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, y)
    with CudaAutocast(torch.bfloat16):
        assert F.binary_cross_entropy_with_logits(p.bfloat16(), y).dtype == torch.float32


def test_an_exported_graphs_dtype_asserts_pass_under_autocast() -> None:
    """torch.export asserts the fp32 a conversion saw at capture (`_assert_tensor_metadata`); under autocast the value
    is bf16: both emulations check the size and strides only, and the graph records and measures."""
    import pyplan
    from pyplan.profile.remat import block_memory

    spec = pyplan.load_model(f"{MIXED_OPS}:exported")
    with torch.device("meta"):
        model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=2), min_blocks=1)
    asserts = [n for n in chain.graph.module.graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    assert torch.float32 in {n.kwargs.get("dtype") for n in asserts}  # beside the token ids' int64
    ops = [
        op
        for fwd, _ in block_op_costs(chain, spec.example_inputs, 2, compute_dtype="bfloat16", autocast=True)
        for op in fwd
    ]
    assert {op.dtype for op in ops if op.name in ("addmm", "convolution")} == {"bfloat16"}
    memory, _ = block_memory(chain, spec.example_inputs, 2, autocast=torch.bfloat16)
    assert len(memory) == len(chain.blocks)
    # Without the emulation the dtype is checked; under it, the size still is.
    check = torch.ops.aten._assert_tensor_metadata.default
    with torch.device("meta"):
        x = torch.empty(2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        check(x, dtype=torch.float32)
    for mode in (CudaAutocast(torch.bfloat16), AutocastAbove(torch.bfloat16)):
        with mode:
            check(x, [2], dtype=torch.float32)
            with pytest.raises(RuntimeError, match="size"):
                check(x, [3], dtype=torch.float32)


def test_a_model_of_every_policy_records_and_measures() -> None:
    """tests/models/real/mixed_ops.py (convolutions with biases, norms, an embedding bag, products, reductions,
    promoting ops, an LSTM) through the analytic recording and the memory measurement of a bf16-mixed plan."""
    import pyplan
    from pyplan.profile.remat import block_memory

    spec = pyplan.load_model(MIXED_OPS)
    with torch.device("meta"):
        model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=2), min_blocks=1)
    ops = [
        op
        for fwd, bwd in block_op_costs(chain, spec.example_inputs, 2, compute_dtype="bfloat16", autocast=True)
        for op in (*fwd, *bwd)
    ]
    assert {op.dtype for op in ops if op.op_class == "matmul"} == {"bfloat16"}
    assert {op.dtype for op in ops if op.name in ("native_group_norm", "native_layer_norm", "_softmax")} == {"float32"}
    memory, _ = block_memory(chain, spec.example_inputs, 2, autocast=torch.bfloat16)
    assert len(memory) == len(chain.blocks)
