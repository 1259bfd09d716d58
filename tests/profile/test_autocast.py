"""CUDA autocast's policy on meta tensors (pyplan/profile/autocast.py), as the analytic profile of a mixed-precision
plan records a block's ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyplan._torch import OpRecorder
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import trace
from pyplan.profile.analytic import block_op_costs
from pyplan.profile.autocast import FP32, LOWER, PROMOTE, CudaAutocast


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
    keep = lambda ops: [(name, dtype) for name, _, _, dtype, view in ops if not view]  # noqa: E731
    return keep(forward.ops), keep(backward.ops), out


def test_the_policy_lists_are_apart() -> None:
    assert not (LOWER & FP32) and not (LOWER & PROMOTE) and not (FP32 & PROMOTE)


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
