"""Run under torchrun (tests/runtime/_launch.py, 4 ranks): tensor-parallel training of captured models against one
process.

The world is a (dp, tp) = (2, 2) mesh. First each tp pair (ranks 0-1, ranks 2-3) trains its models of PAIRS at
tp = 2 on the whole batch; then all four ranks train gpt-tiny at dp 2 x tp 2 (each replica half the batch, its
gradients averaged over the dp group). Every configuration is one step, float64, dropout off: forward, backward,
gradient clipping, AdamW, compared with the same model (same seed) trained whole in one process on the whole
batch: the loss, every parameter's gradient (gathered with full_tensor), the gradient norm and every parameter
after the step. At tp alone the split module is also cut into two pipeline pieces, which must hold the model's
parameters and train the same gradients. Before all that, `dropout_agrees` checks the random state the split
gives the ranks. With sequence parallelism, GPT-2 (Hugging Face's and gpt-tiny) also measure the bytes autograd
saves for one layer of the zone (`_measured_layer`), which must be what the profile of the rank counts for it
(`_profiled_layer`): the Linears' gathered inputs saved as each rank's slice. Rank 0 writes one JSON record per
configuration and rank to the file `run_part` is given.
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from pyplan._torch import storage_key, tensor_leaves, tree_map_only
from pyplan.graph.chain import Chain
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.linearize import cut_points, linearize
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.split import pieces, run_pieces
from pyplan.graph.tensor_parallel import derive_tp_plan
from pyplan.graph.trace import Call, Examples, call_at, input_tensors, output_tensors, trace
from pyplan.load import load_model
from pyplan.plan import Layout, Workload
from pyplan.profile.memory import saved_bytes
from pyplan.profile.tensor_parallel import local_chain
from pyplan.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from pyplan.runtime.optim import optimizer_factory
from pyplan.runtime.tensor_parallel import (
    VocabParallelLoss,
    Zero1Optimizer,
    _SeqCollectives,
    apply_tensor_parallel,
    full_gradients,
    full_parameters,
    full_value,
    grad_norm_weight,
    sync_gradients,
)
from pyplan.runtime.trainer import build_trainer, replica_slice
from pyplan.solve.state import stage_state_bytes
from pyplan.spec import cross_entropy, default_loss
from pyplan.zoo.small import GPT_TINY
from pyplan.zoo.transformer import GPT as GPT2

GPT = "zoo:gpt-tiny"
LLAMA = "hf:llama:hidden_size=64,intermediate_size=96,num_hidden_layers=2,num_attention_heads=4," \
        "num_key_value_heads=2,vocab_size=100,seq_len=8"  # fmt: skip
BERT = "hf:bert:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,vocab_size=100," \
       "seq_len=8,hidden_dropout_prob=0,attention_probs_dropout_prob=0"  # fmt: skip
# Tied token embedding and output layer, which torch.export reads under one name.
LLAMA_TIED = f"{LLAMA},tie_word_embeddings=True"
# Hugging Face GPT-2: Conv1D layers (weights laid out (in, out)), tied embeddings, ids reshaped before the lookup.
HF_GPT2 = "hf:gpt2:n_layer=2,n_embd=64,n_head=4,vocab_size=100,seq_len=8,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0," \
          "bos_token_id=0,eos_token_id=0"  # fmt: skip
# Nemotron: a squared-ReLU MLP without a gate, LayerNorm1P, rotary on half of each head.
NEMOTRON = "hf:nemotron:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,head_dim=16," \
           "num_key_value_heads=2,vocab_size=100,seq_len=8"  # fmt: skip
# Qwen3: an RMSNorm over each head's query and key, inside the attention's region.
QWEN3 = "hf:qwen3:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,head_dim=16," \
        "num_key_value_heads=2,vocab_size=100,seq_len=8"  # fmt: skip
# Persimmon: a fused QKV viewed per head and picked by index (select), a LayerNorm over each head's query and key.
PERSIMMON = "hf:persimmon:hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4," \
            "vocab_size=100,seq_len=8"  # fmt: skip
# Each tp pair's models: about the same work on both.
PAIRS = ((LLAMA, LLAMA_TIED, NEMOTRON, PERSIMMON), (BERT, GPT, HF_GPT2, QWEN3))
BATCH = 4
MAX_NORM = 0.05  # below every model's gradient norm here: the clipping scales
LR = 1e-3
# Below this norm a reference tensor counts as zero and the error is absolute: the key projection's bias, whose
# gradient is 0 in theory (softmax ignores a shift) and which only rounding noise moves.
ZERO = 1e-6


def _double(call: Call) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, call)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = torch.linalg.vector_norm(b).item()
    return torch.linalg.vector_norm(a - b).item() / (scale if scale >= ZERO else 1.0)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    if set(got) - set(want):
        raise AssertionError(f"names the model does not have: {sorted(set(got) - set(want))[:3]}")
    return max((_error(got[name], want[name]), name) for name in got)


def _step(
    module: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    call: Call,
    target: torch.Tensor,
    after_backward: Callable[[], None] = lambda: None,
) -> tuple[float, dict[str, torch.Tensor], float]:
    """Forward, backward, `after_backward`, the gradients gathered by name, clipping, one AdamW step: the loss, the
    gradients and their norm before clipping."""
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    args, kwargs = call
    loss = loss_fn(output_tensors(module(*args, **kwargs)), target)
    loss.backward()
    after_backward()
    grads = full_gradients(module)
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM)
    opt.step()
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return loss.item(), grads, norm.item()


def _by_every_name(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`values` (by a parameter's first name) under every name of the parameter (tied weights have several)."""
    first = {id(p): name for name, p in module.named_parameters()}
    return {name: values[first[id(p)]] for name, p in module.named_parameters(remove_duplicate=False)}


def _weighted_norm(module: torch.nn.Module, tp_mesh: DeviceMesh) -> float:
    """The gradient norm summed over the tp ranks' local shards, each square weighted by grad_norm_weight."""
    total = torch.zeros((), dtype=torch.float64)
    for p in module.parameters():
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        total += grad_norm_weight(p.grad) * torch.linalg.vector_norm(local).square()
    dist.all_reduce(total, group=tp_mesh.get_group())
    return total.sqrt().item()


def _pieces_error(
    graph: LayerGraph, loss_fn: Callable[..., torch.Tensor], call: Call, target: torch.Tensor, want: dict
) -> tuple[float, str]:
    """The worst gradient error of the tensor-parallel module cut into two pieces and run in sequence (gradients
    left at zero afterwards)."""
    points = cut_points(graph)
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    halves = pieces(linearize(graph, positions=[inner[len(inner) // 2]]))
    held = {name: p for h in halves for name, p in h.named_parameters()}
    plain = [name for name, p in held.items() if not isinstance(p, DTensor)]
    if plain or not set(held) <= set(want) or {id(p) for p in held.values()} != set(map(id, graph.module.parameters())):
        raise AssertionError(f"the pieces hold {sorted(held)}, plain tensors {plain}")
    loss_fn(output_tensors(run_pieces(halves, *input_tensors(call))), target).backward()
    sync_gradients(graph.module)
    worst = _worst(full_gradients(graph.module), want)
    graph.module.zero_grad(set_to_none=True)
    return worst


# The layer whose saved bytes are measured: the second, wholly inside the zone.
LAYER = "transformer.h.1"


def _layer_blocks(chain: Chain) -> set[int]:
    return {i for i, b in enumerate(chain.blocks) if b.name.startswith(LAYER)}


def _profiled_layer(graph: LayerGraph, degree: int, examples: Examples) -> tuple[Chain, float]:
    """The captured model's chain, and the bytes the profile of a rank at `degree` with sequence parallelism counts
    saved for LAYER's blocks at BATCH samples (each storage charged to the block that produced it)."""
    chain = linearize(graph)
    plan = derive_tp_plan(graph)
    local = local_chain(chain, plan, degree, examples, sequence_zone(graph, plan, degree))
    per_block, _ = saved_bytes(local, examples, (BATCH, 2 * BATCH))
    return chain, sum(per_block[i](BATCH) for i in _layer_blocks(chain))


def _measured_layer(
    graph: LayerGraph, chain: Chain, loss_fn: Callable[..., torch.Tensor], call: Call, target: torch.Tensor
) -> float:
    """The bytes autograd saves for LAYER's blocks in a training step of the tensor-parallel module, cut into the
    profile's blocks and run in sequence: a saved-tensor hook around the forward counts each storage once (a
    DTensor's local one; parameters and buffers left out), charged to the block whose piece made it, as the
    profile charges it."""
    mods = pieces(linearize(graph, positions=[c.position for c in chain.cuts[1:-1]], order=chain.order))
    gm = graph.module
    exclude = {storage_key(_local_tensor(t)) for t in [*gm.parameters(), *gm.buffers()]}
    producer: dict[int, int] = {}
    saved: dict[int, tuple[int, int]] = {}
    held: list[torch.Tensor] = []  # every storage seen, kept alive so that no identity is reused
    current = -1

    def pack(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            own = _local_tensor(t)
        held.append(own)
        key = storage_key(own)
        if key not in exclude and key not in saved:
            saved[key] = (own.untyped_storage().nbytes(), producer.get(key, current))
        return t

    def made(values: Any, by: int) -> None:
        for t in tensor_leaves(values):
            own = _local_tensor(t.detach())
            held.append(own)
            producer.setdefault(storage_key(own), by)

    args: tuple[Any, ...] = input_tensors(call)
    made(args, -1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for current, mod in enumerate(mods):
            out = mod(*args)
            args = out if isinstance(out, tuple) else (out,)
            made(args, current)
    loss_fn(output_tensors(out), target).backward()
    gm.zero_grad(set_to_none=True)
    layer = _layer_blocks(chain)
    return sum(nbytes for nbytes, by in saved.values() if by in layer)


def run(ref: str, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None, sp: bool) -> dict[str, Any]:
    spec = load_model(ref)
    loss_fn = spec.loss or default_loss
    assert spec.target is not None
    dp = dp_mesh.size() if dp_mesh is not None else 1
    mine = slice(dp_mesh.get_local_rank() * BATCH // dp, (dp_mesh.get_local_rank() + 1) * BATCH // dp) if dp_mesh \
        else slice(0, BATCH)  # fmt: skip
    torch.manual_seed(0)
    model = spec.build().double()
    reference = copy.deepcopy(model)
    call, target = _double(call_at(spec.example_inputs, BATCH)), spec.target(BATCH)

    # One process, the whole batch.
    ref_loss, ref_grads, ref_norm = _step(reference, loss_fn, call, target)
    want_grads = _by_every_name(reference, ref_grads)
    want_params = _by_every_name(reference, full_parameters(reference))

    examples = Examples(lambda b: _double(call_at(spec.example_inputs, b)))
    graph = trace(model, examples, batch_size=2)
    plan = derive_tp_plan(graph)
    measured = sp and dp == 1 and ref in (GPT, HF_GPT2)
    chain, layer_profiled = _profiled_layer(graph, tp_mesh.size(), examples) if measured else (None, None)
    apply_tensor_parallel(graph, plan, tp_mesh, sequence_parallel=sp)
    gm = graph.module
    plain = [name for name, p in gm.named_parameters() if not isinstance(p, DTensor)]
    unique = len(list(reference.parameters()))
    if plain or len(list(gm.parameters())) != unique:
        return {"ok": False, "why": f"plain parameters {plain[:3]}, {len(list(gm.parameters()))} != {unique}"}

    group = dp_mesh.get_group() if dp_mesh is not None else None
    mine_call = tree_map_only(torch.Tensor, lambda t: t[mine], call)
    # Cut into two pipeline pieces after the split: the pieces hold the DTensors under the model's names and
    # train the same gradients.
    pieces_err, pieces_name = _pieces_error(graph, loss_fn, call, target, want_grads) if dp == 1 else (0.0, "")
    layer_saved = _measured_layer(graph, chain, loss_fn, call, target) if chain is not None else None
    weighted: list[float] = []

    def finish() -> None:
        sync_gradients(gm, dp_group=group)
        weighted.append(_weighted_norm(gm, tp_mesh))

    # Under sequence parallelism the row Linears' outputs are each rank's tokens: the shapes they make, by module,
    # or, where a row's output is its tokens flattened (GPT-2's Conv1D: a partial-sum DTensor), the shapes its
    # reduce-scatter makes once the output is viewed back.
    rows = [m for m, style in plan.styles(tp_mesh.size()).items() if style == "RowwiseParallel"]
    made: dict[str, tuple[int, ...]] = {}

    def seen(module: str, out: torch.Tensor) -> None:
        if not isinstance(out, DTensor):
            made.setdefault(module, tuple(out.shape))

    def scatter(self: _SeqCollectives, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = plain_scatter(self, x, dim)
        made.setdefault(f"scatter {len(made)}", tuple(out.shape))
        return out

    hooks = [gm.get_submodule(m).register_forward_hook(lambda _m, _i, out, m=m: seen(m, out)) for m in rows]
    plain_scatter, _SeqCollectives.scatter = _SeqCollectives.scatter, scatter  # type: ignore[method-assign]
    try:
        loss, grads, norm = _step(gm, loss_fn, mine_call, target[mine], finish)
    finally:
        _SeqCollectives.scatter = plain_scatter  # type: ignore[method-assign]
    for h in hooks:
        h.remove()
    if group is not None:
        box = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(box, group=group)
        loss = box.item() / dp
    grad_err, grad_name = _worst(grads, want_grads)
    param_err, param_name = _worst(full_parameters(gm), want_params)
    split = sorted({str(p.placements) for p in gm.parameters()})
    return {
        "ok": True,
        "loss_err": abs(loss - ref_loss) / abs(ref_loss),
        "grad_err": grad_err,
        "grad_worst": grad_name,
        "param_err": param_err,
        "param_worst": param_name,
        "pieces_err": pieces_err,
        "pieces_worst": pieces_name,
        "norm": norm,
        "weighted_norm": weighted[0],
        "ref_norm": ref_norm,
        "placements": split,
        "styles": len(plan.styles(tp_mesh.size())),
        "row_tokens": sorted({math.prod(shape[:-1]) for shape in made.values()}),
        "tokens": math.prod(input_tensors(mine_call)[0].shape),
        "layer_saved": layer_saved,
        "layer_profiled": layer_profiled,
    }


def dropout_agrees(tp_mesh: DeviceMesh) -> dict[str, Any]:
    """gpt-tiny with dropout, every rank seeded differently before the split: after apply_tensor_parallel (which
    gives the ranks one random state) the replicated hidden state before the output layer is equal on the ranks of
    the tp axis; re-seeded differently, it differs (dropout is on). The logits cannot tell: the output layer's
    all-gather makes them equal on every rank either way (wrong, if the ranks' hidden states differ)."""
    spec = load_model(GPT)
    torch.manual_seed(0)
    model = GPT2(dataclasses.replace(GPT_TINY, dropout=0.1)).double()
    graph = trace(model, Examples(spec.example_inputs), batch_size=2)
    torch.manual_seed(dist.get_rank())
    apply_tensor_parallel(graph, derive_tp_plan(graph), tp_mesh)
    (ids,), _ = call_at(spec.example_inputs, 2)
    hidden: list[torch.Tensor] = []
    graph.module.get_submodule("transformer.ln_f").register_forward_hook(lambda m, i, out: hidden.append(out))
    agree = []
    for reseed in (False, True):
        if reseed:
            torch.manual_seed(100 + dist.get_rank())
        with torch.no_grad():
            graph.module(ids)
        every = [torch.empty_like(hidden[-1]) for _ in range(tp_mesh.size())]
        dist.all_gather(every, hidden[-1], group=tp_mesh.get_group())
        agree.append(all(torch.equal(every[0], x) for x in every))
    return {"ok": True, "synced_agree": agree[0], "reseeded_agree": agree[1]}


def zero1_state(mesh: DeviceMesh) -> dict[str, Any]:
    """gpt-tiny split over the tp axis, ZeRO-1 over the dp axis (Zero1Optimizer, AdamW): after a step, the bytes of
    optimizer state this rank holds (its share's local tensors), the plan's count for the fullest replica (the
    stage's local shapes), and whether the replicas hold equal parameters (the owners' broadcasts)."""
    spec = load_model(GPT)
    torch.manual_seed(0)
    graph = trace(spec.build(), Examples(spec.example_inputs), batch_size=2)
    apply_tensor_parallel(graph, derive_tp_plan(graph), mesh["tp"], sequence_parallel=True)
    gm = graph.module
    params = list(gm.parameters())
    optimizer = Zero1Optimizer(params, optimizer_factory("adamw", LR), mesh["dp"].get_group())
    (ids,), _ = call_at(spec.example_inputs, 2)
    torch.manual_seed(1 + mesh["dp"].get_local_rank())  # other samples on each replica
    ids = torch.randint(0, GPT_TINY.vocab_size, ids.shape)
    default_loss(output_tensors(gm(ids)), None).backward()
    sync_gradients(gm, dp_group=mesh["dp"].get_group())
    optimizer.step()
    held = sum(_local_tensor(v).untyped_storage().nbytes() for st in optimizer.optim.state.values()
               for v in st.values() if torch.is_tensor(v))  # fmt: skip
    shapes = [tuple(_local_tensor(p).shape) for p in params]
    workload = Workload(global_batch=8, optimizer="adamw")
    per = workload.bytes_per_param()
    planned = stage_state_bytes(shapes, workload, 2, 1) - (per.param_bytes + per.grad_bytes) * sum(
        math.prod(x) for x in shapes
    )
    mine = torch.cat([_local_tensor(p).detach().flatten() for p in params])
    every = [torch.empty_like(mine) for _ in range(mesh["dp"].size())]
    dist.all_gather(every, mine, group=mesh["dp"].get_group())
    agree = all(torch.equal(every[0], x) for x in every)
    return {"ok": True, "held": held, "planned": planned, "replicas_agree": agree}


def vocab_loss_agrees(tp_mesh: DeviceMesh) -> dict[str, Any]:
    """VocabParallelLoss on each rank's slice of (N, V) logits (V split in rank order, some targets -100 and some
    in each rank's slice) against pyplan.spec.cross_entropy on the whole logits in one process: the loss, and each
    rank's slice of the gradient."""
    torch.manual_seed(3)
    logits = torch.randn(2, 7, 12, dtype=torch.float64)
    target = torch.randint(0, 12, (2, 7))
    target[0, :2] = -100
    whole = logits.clone().requires_grad_()
    want = cross_entropy(whole, target)
    want.backward()
    v, rank = 12 // tp_mesh.size(), tp_mesh.get_local_rank()
    mine = logits[..., rank * v : (rank + 1) * v].clone().requires_grad_()
    got = VocabParallelLoss(tp_mesh)(mine, target)
    got.backward()
    assert mine.grad is not None and whole.grad is not None
    return {
        "ok": True,
        "loss_err": abs(got.item() - want.item()) / abs(want.item()),
        "grad_err": _error(mine.grad, whole.grad[..., rank * v : (rank + 1) * v]),
    }


def zero3_state(mesh: DeviceMesh, folder: str) -> dict[str, Any]:
    """gpt-tiny at dp 2 x tp 2 under ZeRO-3 (FSDP2 over the traced model's pieces, through build_trainer), AdamW
    with the gradient clipped, one step: the model-state bytes this rank holds (its shards of parameters, gradients
    and optimizer state) and the plan's count for that layout from the rank's tp-local shapes; then a checkpoint of
    it resumed under the same layout and under ZeRO-1: whether each holds the parameters saved (a fused QKV's
    strided shards gathered and split in two steps, `full_value`, `local_value`)."""
    spec = load_model(GPT)
    end = len(cut_points(trace(spec.build(), Examples(spec.example_inputs), batch_size=2)).order)
    plan = derive_tp_plan(trace(spec.build(), Examples(spec.example_inputs), batch_size=2)).styles(2)

    def trainer(zero: int) -> Any:
        layout = Layout(dp=2, pp=1, tp=2, tp_plan=plan, micro_batch_size=2, num_microbatches=2, schedule="1F1B",
                        cut_positions=(0, end), zero_stage=zero)  # fmt: skip
        torch.manual_seed(0)
        return build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", LR))

    first = trainer(3)
    call, target = call_at(spec.example_inputs, 8), spec.target(8)
    mine = replica_slice(first.layout, first.dp_rank)
    first.step(tuple(t[mine] for t in input_tensors(call)), target[mine], max_norm=MAX_NORM)
    params = list(first.model.parameters())
    state = [v for st in first.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    # Each storage once: FSDP2 reduce-scatters a unit's gradients into one buffer, the shards views of it.
    storages = {
        _local_tensor(t).untyped_storage().data_ptr(): _local_tensor(t).untyped_storage().nbytes()
        for t in [*params, *(p.grad for p in params), *state]
    }
    held = sum(storages.values())
    shapes = []
    for p in params:  # the tp-local shape: the dims the tp axis splits divided by its size
        shape = list(p.shape)
        if hasattr(p.placements[1], "dim"):
            shape[p.placements[1].dim] //= 2
        shapes.append(tuple(shape))
    planned = stage_state_bytes(shapes, Workload(global_batch=8, optimizer="adamw"), 2, 3)
    saved = first.parameters()
    save_checkpoint(first, 1, folder, keep=1)
    resumed = {}
    for zero in (3, 1):
        again = trainer(zero)
        load_checkpoint(again, latest_checkpoint(folder))
        got = again.parameters()
        resumed[zero] = max(_error(got[n], saved[n]) for n in saved)
    return {"ok": True, "held": held, "planned": planned, "resumed": resumed}


def master_state(mesh: DeviceMesh) -> dict[str, Any]:
    """gpt-tiny at dp 2 x tp 2 with sequence parallelism in bf16-master under ZeRO-1 (through build_trainer),
    AdamW with the gradient clipped, one step: the model-state bytes this rank holds (bf16 weights, fp32 gradients,
    its share's fp32 master weights and AdamW states, local shards) and the plan's count from the tp-local shapes;
    the largest relative error of a gradient against one process's bf16 arithmetic (a bf16 copy of the model on
    each replica's micro-batches, logits in fp32 for the loss, gradients summed in fp32); whether the replicas hold
    equal weights after the step."""
    spec = load_model(GPT)
    end = len(cut_points(trace(spec.build(), Examples(spec.example_inputs), batch_size=2)).order)
    plan = derive_tp_plan(trace(spec.build(), Examples(spec.example_inputs), batch_size=2)).styles(2)
    layout = Layout(dp=2, pp=1, tp=2, tp_plan=plan, micro_batch_size=2, num_microbatches=2, schedule="1F1B",
                    cut_positions=(0, end), zero_stage=1, sequence_parallel=True)  # fmt: skip
    torch.manual_seed(0)
    trainer = build_trainer(spec, spec.build(), layout, optimizer_factory("adamw", LR), precision="bf16-master")
    call, target = call_at(spec.example_inputs, 8), spec.target(8)
    mine = replica_slice(layout, trainer.dp_rank)
    trainer.step(tuple(t[mine] for t in input_tensors(call)), target[mine])
    optimizer = trainer.optimizer
    params = list({id(p): p for m in trainer.modules for p in m.parameters()}.values())
    tensors = [*params, *(g for _, g in optimizer.gradients())]
    tensors += [v for st in optimizer.master_state.values() for v in st.values() if torch.is_tensor(v)]
    held = sum(
        {_local_tensor(t).untyped_storage().data_ptr(): _local_tensor(t).untyped_storage().nbytes() for t in tensors}
        .values()
    )  # fmt: skip
    shapes = []
    for p in params:  # the tp-local shape
        shape = list(p.shape)
        if hasattr(p.placements[0], "dim"):
            shape[p.placements[0].dim] //= 2
        shapes.append(tuple(shape))
    planned = stage_state_bytes(shapes, Workload(global_batch=8, precision="bf16-master"), 2, 1)
    # One process: the bf16 model's gradients, summed in fp32, the mean over the replicas' micro-batches.
    torch.manual_seed(0)
    reference = spec.build().to(torch.bfloat16)
    named = dict(reference.named_parameters(remove_duplicate=False))
    expected = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in named.items()}
    inputs = input_tensors(call)
    for k in range(4):
        part = slice(2 * k, 2 * k + 2)
        reference.zero_grad()
        (spec.loss(reference(*(t[part] for t in inputs)).float(), target[part]) / 4).backward()
        for n, p in named.items():
            expected[n] += p.grad.float()
    by_name = {n: p for m in trainer.modules for n, p in m.piece.named_parameters()}
    grads = {n: full_value(optimizer.main_grad(p)) for n, p in by_name.items()}
    grad_err = max(_error(grads[n], expected[n]) for n in grads)
    mine_now = torch.cat([_local_tensor(p).detach().float().flatten() for p in params])
    every = [torch.empty_like(mine_now) for _ in range(mesh["dp"].size())]
    dist.all_gather(every, mine_now, group=mesh["dp"].get_group())
    agree = all(torch.equal(every[0], x) for x in every)
    dtypes = sorted({str(_local_tensor(p).dtype) for p in params})
    return {"ok": True, "held": held, "planned": planned, "grad_err": grad_err, "replicas_agree": agree,
            "dtypes": dtypes}  # fmt: skip


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run_part(path: str) -> None:
    """Every configuration, in the launch's process group (tests/runtime/_launch.py)."""
    faulthandler.dump_traceback_later(float(os.environ.get("PYPLAN_HANG_S", "120")), exit=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    # (Nemotron, Qwen3 and Persimmon with sequence parallelism only: their MLP and norms are what is new there.)
    once = {NEMOTRON: (True,), QWEN3: (True,), PERSIMMON: (True,)}
    configs = [(ref, 1, sp) for ref in PAIRS[mesh["dp"].get_local_rank() % len(PAIRS)]
               for sp in once.get(ref, (False, True))]  # fmt: skip
    if world == 4:
        configs += [(GPT, 2, False), (GPT, 2, True)]
    results = [{"model": "dropout", "dp": 1, "tp": 2, "rank": rank, **dropout_agrees(mesh["tp"])}]
    results.append({"model": "vocab_loss", "dp": 1, "tp": 2, "rank": rank, **vocab_loss_agrees(mesh["tp"])})
    if world == 4:
        results.append({"model": "zero1", "dp": 2, "tp": 2, "rank": rank, **zero1_state(mesh)})
        results.append({"model": "master", "dp": 2, "tp": 2, "rank": rank, **master_state(mesh)})
        folder = os.path.join(os.path.dirname(os.path.abspath(path)), "zero3-checkpoint")
        results.append({"model": "zero3", "dp": 2, "tp": 2, "rank": rank, **zero3_state(mesh, folder)})
    for ref, dp, sp in configs:
        try:
            res = run(ref, mesh["tp"], mesh["dp"] if dp > 1 else None, sp)
        except Exception as exc:
            res = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        results.append({"model": ref, "dp": dp, "tp": 2, "sp": sp, "rank": rank, **res})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        with open(path, "w") as f:
            json.dump([r for rs in gathered for r in rs], f)
