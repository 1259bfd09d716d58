"""Run under torchrun on 4 ranks (tests/runtime/_launch.py): mixtures of experts trained with expert parallelism,
compared with one process.

Each configuration (model, dp x pp mesh, expert-parallel degree, schedule, optimizer) builds every rank's share of
the plan, trains 3 steps in float64 and compares, with single-process training on the same global batch (gradient
accumulation over the same micro-batches): the losses on the last stage, and every parameter and gradient this rank
holds (an expert's against the same expert of the whole model). Rank 0 writes one JSON record per configuration to
the file `run_part` is given.
"""

from __future__ import annotations

import copy
import faulthandler
import functools
import importlib.util
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pyplan import cut_points, load_model, trace
from pyplan._torch import tree_map_only
from pyplan.graph.experts import expert_leaves
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.trace import Call, call_at, input_tensors, output_tensors
from pyplan.plan import Layout
from pyplan.runtime.experts import expert_slices
from pyplan.runtime.trainer import OptimizerSpec, build_trainer, replica_slice
from pyplan.spec import ModelSpec, default_loss

STEPS = 3
TOL = 1e-10  # float64: the rounding noise of reordered sums is ~1e-15 here
# bf16 autocast over float32 weights: a smoke check, not an equality. The losses come out equal, but one process
# computes every expert on every token (the test models are dense) where a rank computes its experts on the tokens
# it received, so a weight gradient's bf16 matmul sums other rows (zeros beside them) in another blocking: 1 ulp of
# bf16 is 4e-3, and after 3 steps a zero-initialized bias differs by 2.2e-2 of its own size. A wrong dispatch or
# scale shows as O(1).
TOL_MIXED = 0.1
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real")
MIXTRAL = os.path.join(MODELS_DIR, "moe_mixtral_style.py")
DEEPSEEK = os.path.join(MODELS_DIR, "moe_deepseek_style.py")
# Hugging Face's Mixtral with its eager experts (a loop over the experts the router picked, in float64; its grouped_mm
# kernel takes no float64), kept whole by the capture.
HF_MIXTRAL = (
    "hf:mixtral:num_hidden_layers=2,hidden_size=64,num_attention_heads=4,intermediate_size=128,num_key_value_heads=2,"
    "num_local_experts=4,vocab_size=128,seq_len=16,experts_implementation=eager"
)
HAS_HF = importlib.util.find_spec("transformers") is not None
OPTIMIZERS = {
    "sgd": OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3}),
}


def configs() -> list[dict]:
    out = []
    for model in (MIXTRAL, DEEPSEEK):
        # Experts over the 2 replicas of each of 2 pipeline stages.
        out.append(dict(model=model, dp=2, pp=2, ep=2, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw"))
        # Experts over 2 of 4 replicas: each expert held by 2 ranks, its gradients summed over them.
        out.append(dict(model=model, dp=4, pp=1, ep=2, schedule="GPipe", v=1, m=2, b=2, optimizer="sgd"))
    # Every replica its own experts, the gradient clipped (expert gradients count once per expert in the norm).
    out.append(dict(model=DEEPSEEK, dp=4, pp=1, ep=4, schedule="1F1B", v=1, m=2, b=2, optimizer="adamw", clip=0.5))
    # Two stages per rank, a stage's replicas on consecutive ranks.
    out.append(dict(model=MIXTRAL, dp=2, pp=2, ep=2, schedule="Interleaved1F1B", v=2, m=4, b=2, optimizer="sgd",
                    placement="dp-inner"))  # fmt: skip
    # bf16 autocast over float32 weights (the tokens cross ranks in bf16 where autocast made them so).
    out.append(dict(model=MIXTRAL, dp=4, pp=1, ep=2, schedule="1F1B", v=1, m=2, b=2, optimizer="sgd",
                    precision="bf16-mixed"))  # fmt: skip
    if HAS_HF:
        out.append(dict(model=HF_MIXTRAL, dp=2, pp=2, ep=2, schedule="1F1B", v=1, m=4, b=2, optimizer="sgd"))
    return out


@functools.cache
def _spec(name: str) -> ModelSpec:
    return load_model(name)


@functools.cache
def _traced(name: str, micro_batch: int) -> LayerGraph:
    """The capture a plan with expert parallelism cuts: each layer's experts kept whole."""
    model = _spec(name).build()
    return trace(model, _spec(name).example_inputs, leaf_modules=expert_leaves(model), batch_size=micro_batch)


def even_cuts(name: str, num_stages: int, micro_batch: int) -> tuple[int, ...]:
    points = cut_points(_traced(name, micro_batch))
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    picks = [inner[round(k * len(inner) / num_stages)] for k in range(1, num_stages)]
    return (0, *picks, len(points.order))


def _double(call: Call) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, call)


def _sliced(call: Call, sl: slice) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t[sl], call)


def _relative(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def run(cfg: dict) -> dict:
    spec = _spec(cfg["model"])
    layout = Layout(
        dp=cfg["dp"],
        pp=cfg["pp"],
        ep=cfg["ep"],
        micro_batch_size=cfg["b"],
        num_microbatches=cfg["m"],
        schedule=cfg["schedule"],
        stages_per_rank=cfg["v"],
        placement=cfg.get("placement", "pp-inner"),
        cut_positions=even_cuts(cfg["model"], cfg["pp"] * cfg["v"], cfg["b"]),
    )
    mixed = "precision" in cfg
    cast = (lambda c: c) if mixed else _double  # autocast casts float32 ops only: mixed runs stay in float32
    torch.manual_seed(0)
    model = spec.build() if mixed else spec.build().double()
    reference = copy.deepcopy(model)
    make = OPTIMIZERS[cfg["optimizer"]]
    examples = lambda n: cast(call_at(spec.example_inputs, n))  # noqa: E731
    trainer = build_trainer(spec, model, layout, make, example_inputs=examples, precision=cfg.get("precision", "fp32"))
    B, b = layout.global_batch, layout.micro_batch_size
    call, target = cast(call_at(spec.example_inputs, B)), spec.target(B) if spec.target is not None else None
    inputs = input_tensors(call)
    loss_fn = spec.loss or default_loss
    ref_opt = make(reference.parameters())
    mine = replica_slice(layout, trainer.dp_rank)
    worst_loss, worst_norm = 0.0, 0.0
    for _ in range(STEPS):
        ref_opt.zero_grad()
        step_losses = []
        for k in range(B // b):
            args, kwargs = _sliced(call, slice(k * b, (k + 1) * b))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                out = output_tensors(reference(*args, **kwargs))
            loss = loss_fn(out, target[k * b : (k + 1) * b] if target is not None else None)
            (loss / (B // b)).backward()
            step_losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg["clip"]) if "clip" in cfg else None
        ref_opt.step()
        got = trainer.step(tuple(t[mine] for t in inputs), target[mine] if target is not None else None,
                           max_norm=cfg.get("clip"))  # fmt: skip
        if trainer.has_last:
            first = mine.start // b
            want = torch.stack(step_losses[first : first + layout.num_microbatches])
            worst_loss = max(worst_loss, _relative(torch.stack(got), want, 1e-12))
        if norm is not None:
            worst_norm = max(worst_norm, abs(trainer.grad_norm - norm.item()) / norm.item())
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    global_max = max(p.grad.abs().max().item() for p in ref_params.values() if p.grad is not None)
    worst, worst_name, experts = {"param": 0.0, "grad": 0.0}, {"param": "", "grad": ""}, 0
    for mod in trainer.modules:
        inner = mod.module if isinstance(mod, DistributedDataParallel) else mod
        slices = expert_slices(inner.piece)
        for name, p in inner.piece.named_parameters():
            whole, rows = slices.get(name, (name, None))
            experts += name in slices
            ref = ref_params[whole]
            pairs = {"param": (p.detach(), ref.detach()), "grad": (p.grad, ref.grad)}
            for kind, (got_t, want_t) in pairs.items():
                if got_t is None or want_t is None:
                    continue
                want_t = want_t[rows] if rows is not None else want_t
                # Gradients relative to the largest of the model's: some are zero in theory (a key bias).
                err = _relative(got_t, want_t, 1e-12 if kind == "param" else 1e-6 * global_max)
                if err > worst[kind]:
                    worst[kind], worst_name[kind] = err, name
    tol = TOL_MIXED if mixed else TOL
    bad = [f"{k} {worst_name[k]} differs by {worst[k]:.2e}" for k in worst if worst[k] > tol]
    if worst_loss > tol:
        bad.append(f"a loss differs by {worst_loss:.2e}")
    if worst_norm > tol:
        bad.append(f"the clipped gradient's norm differs by {worst_norm:.2e}")
    return {**cfg, "ok": not bad, "why": "; ".join(bad), "worst_param": worst["param"], "worst_grad": worst["grad"],
            "worst_loss": worst_loss, "worst_norm": worst_norm, "expert_params": experts}  # fmt: skip


def run_part(path: str) -> None:
    """Every configuration, in the launch's process group (tests/runtime/_launch.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs():
        faulthandler.dump_traceback_later(float(os.environ.get("PYPLAN_HANG_S", "180")), exit=True)
        if rank == 0:
            print("config", json.dumps(cfg), flush=True)
        started = time.perf_counter()
        try:
            res = {**run(cfg), "seconds": round(time.perf_counter() - started, 2)}
        except Exception as exc:
            # The other ranks may be blocked in a collective: record and stop the launch.
            res = {**cfg, "ok": False, "why": f"rank {rank}: {type(exc).__name__}: {exc}"}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            with open(f"{path}.rank{rank}.error", "w") as f:
                json.dump([*results, res], f)
            os._exit(1)
        gathered: list[dict | None] = [None] * world
        dist.all_gather_object(gathered, res)
        rows = [g for g in gathered if g is not None]
        bad = [g for g in rows if not g["ok"]]
        worst = {k: max(g[k] for g in rows) for k in ("worst_param", "worst_grad", "worst_loss", "worst_norm")}
        held = sum(g["expert_params"] for g in rows)  # a rank whose stages hold no MoE layer holds none
        results.append({**(bad[0] if bad else rows[0]), **worst, "expert_params": held})
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
