"""Run under torchrun (tests/runtime/_launch.py): train planned pipelines and compare with single-process
training.

For each configuration (model, layout, optimizer) every rank builds its share of the pipeline, trains 3 steps
and compares its parameters and, on the last stage, its losses with single-process training on the same global
batch (gradient accumulation over the same micro-batches, so batch norm sees the same micro-batches). First the
ranks share out what does not depend on the launch (`prepare`): each model's capture, which gives every layout its
cuts, tensor-parallel plan and remat blocks, and the single-process training of each distinct reference (model,
optimizer, global batch, precision); each is done once, by one rank, and gathered by all.
Training runs in float64: Adam divides each gradient by its own magnitude, so in float32 the rounding noise of a
different summation order (micro-batches, replicas, tied weights summed across stages) on a gradient that is
exactly zero in theory (the key bias of attention) becomes a full-size step; in float64 it stays at 1e-13.
Rank 0 writes one JSON record per configuration to the file `run_part` is given.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib.util
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from pyplan import cut_points, load_model, trace
from pyplan._torch import tree_map_only
from pyplan.graph.layergraph import LayerGraph
from pyplan.graph.linearize import operations
from pyplan.graph.tensor_parallel import derive_tp_plan
from pyplan.graph.trace import Call, call_at, input_tensors, output_tensors
from pyplan.plan import Layout, StageRemat
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
from pyplan.runtime.trainer import OptimizerSpec, build_trainer, replica_slice
from pyplan.solve.ilp import assign_stages, stage_dag_from_layergraph
from pyplan.solve.schedules import torch_rejection
from pyplan.spec import ModelSpec, default_loss

STEPS = 3
_TINY = "num_hidden_layers=2,hidden_size=64,num_attention_heads=4"
_TOKENS = "vocab_size=128,seq_len=16"
HF_MODELS = (
    (
        f"hf:gpt2:{_TINY},{_TOKENS},resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        f"hf:bert:{_TINY},intermediate_size=128,{_TOKENS},hidden_dropout_prob=0,attention_probs_dropout_prob=0",
        f"hf:llama:{_TINY},intermediate_size=128,num_key_value_heads=2,{_TOKENS}",
        f"hf:mixtral:{_TINY},intermediate_size=128,num_key_value_heads=2,num_local_experts=4,{_TOKENS}",
        f"hf:t5:{_TINY},d_ff=128,{_TOKENS},dropout_rate=0",
        f"hf:vit:{_TINY},intermediate_size=128,image_size=32,patch_size=8,num_labels=10,hidden_dropout_prob=0,"
        "attention_probs_dropout_prob=0",
        # The model's own loss: labels among the inputs ride through the pipeline to the last stage.
        f"hf:gpt2:{_TINY},{_TOKENS},resid_pdrop=0,embd_pdrop=0,attn_pdrop=0,labels=true",
        f"hf:t5:{_TINY},d_ff=128,{_TOKENS},dropout_rate=0,labels=true",
    )
    if importlib.util.find_spec("transformers") is not None
    else ()
)
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
BRANCHY = os.path.join(MODELS_DIR, "branchy.py")
# Plain-torch layers users write: an in-place ReLU right after a cut, an LSTM's tuple output, nn.TransformerEncoder.
PLAIN = tuple(
    f"{os.path.join(MODELS_DIR, 'plain.py')}:{name}" for name in ("relu_inplace", "lstm", "transformer_encoder")
)
# What real model code does (tests/models/real/): a padding mask into torch's encoder, tokens flattened between
# layers, a view valid only on a contiguous copy, a custom autograd Function, a model returning its own loss (and
# `(logits, None)` beside a file's loss), BatchNorm over 1x1 maps, a float mask no layer backpropagates into, experts
# sized by values read off the router, a Hugging Face model built with its cache on.
REAL = tuple(
    os.path.join(MODELS_DIR, "real", f"{name}.py")
    for name in ("padded_encoder", "flat_tokens", "stride_views", "scan_function", "own_loss", "own_loss_none",
                 "small_maps", "float_mask", "routed_by_value",
                 *(("hf_cache",) if importlib.util.find_spec("transformers") else ()))
)  # fmt: skip
TOL = 1e-9  # float64: the rounding noise of reordered sums is ~1e-12 here
TOL_MIXED = 1e-5  # bf16 autocast: the same ops in the same order, fp32 gradients summed in another order
TOL_FLOAT32 = 1e-5  # float32 throughout: rounding of reordered sums, SGD
OPTIMIZERS = {
    "sgd": OptimizerSpec(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3}),
}


@functools.cache
def _traced(spec_name: str, micro_batch: int) -> LayerGraph:
    """The model's captured graph, traced once per launch for the cuts and TP plans of all its configurations
    (torch.export takes seconds on a transformers model); the trainer traces its own copy."""
    spec = _spec(spec_name)
    return trace(spec.build(), spec.example_inputs, batch_size=micro_batch)


def even_cuts(spec_name: str, num_stages: int, micro_batch: int) -> tuple[int, ...]:
    points = cut_points(_traced(spec_name, micro_batch))
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    picks = [inner[round(k * len(inner) / num_stages)] for k in range(1, num_stages)]
    return (0, *picks, len(points.order))


def stage_remat(spec_name: str, cuts: tuple[int, ...], micro_batch: int, kinds: list[str]) -> tuple:
    """A remat plan per stage: each stage cut into 4 blocks at valid cuts, planned as `kinds[s]` says."""
    points = cut_points(_traced(spec_name, micro_batch))
    out = []
    for s, kind in enumerate(kinds):
        inner = [c.position for c in points.candidates if cuts[s] < c.position < cuts[s + 1]]
        picks = [inner[round(k * len(inner) / 4)] for k in range(1, 4)]
        positions = (cuts[s], *picks, cuts[s + 1])
        plan = {
            "periodic": periodic(0, 4, 2),
            "full": full_remat(0, 4),
            "nested": RematPlan((Checkpoint(RematPlan((Checkpoint(no_remat(0, 1)), Keep(1)))), Offload(2), Keep(3))),
            "selective": RematPlan((Selective(0), Selective(1), Checkpoint(no_remat(2, 3)), Selective(3))),
            "selective units": RematPlan((SelectiveCheckpoint(no_remat(0, 4)),)),
            "none": None,
        }[kind]
        out.append(None if plan is None else StageRemat(positions, plan))
    return tuple(out)


def dag_stages(spec_name: str, num_stages: int, m: int, micro_batch: int) -> dict[str, int]:
    """Every operation's stage, balancing the operation count (the CP-SAT stage model of pyplan/solve/ilp.py);
    computed by one rank in `prepare` and shared, since CP-SAT may pick another of several optimal assignments
    elsewhere."""
    graph = _traced(spec_name, micro_batch)
    dag = stage_dag_from_layergraph(graph, batch_size=micro_batch, time_s={n: 1.0 for n in operations(graph)})
    got = assign_stages(dag, num_stages=num_stages, num_microbatches=m, mem_limit_bytes=[math.inf] * num_stages)
    return dict(zip(dag.names, got.stage_of_node))


def configs(world: int) -> list[dict]:
    meshes = {2: [(1, 2), (2, 1)], 4: [(2, 2), (1, 4)]}[world]
    out = []
    for model in ("resnet-tiny", "gpt-tiny"):
        for k, (dp, pp) in enumerate(meshes):
            for schedule, v in (
                ("GPipe", 1),
                ("1F1B", 1),
                ("Interleaved1F1B", 2),
                ("LoopedBFS", 2),
                ("InterleavedZeroBubble", 2),
                ("ZBVZeroBubble", 2),
                ("DualPipeV", 2),
            ):
                m = max(4, 2 * pp)
                if torch_rejection(schedule, pp, m, v):
                    continue
                # On 4 ranks each multi-stage schedule runs once per mesh: resnet-tiny on the first, gpt-tiny on
                # the second (both run every schedule on 2 ranks).
                if world == 4 and v > 1 and k != ("resnet-tiny", "gpt-tiny").index(model):
                    continue
                # The optimizer steps each rank's own parameters after the schedule: AdamW beside the two plain
                # schedules, SGD (whose step follows from the gradients) beside every schedule.
                for opt in OPTIMIZERS if v == 1 else ("sgd",):
                    out.append(dict(model=model, dp=dp, pp=pp, schedule=schedule, v=v, m=m, b=2, optimizer=opt, zero=0))
    if world == 2:
        # Three stages (model chunks) a rank: six stages on two ranks, stage s on rank s mod 2.
        out.append(
            dict(model="gpt-tiny", dp=1, pp=2, schedule="Interleaved1F1B", v=3, m=4, b=2, optimizer="sgd", zero=0)
        )
        # bf16 autocast in every stage, weights and optimizer in fp32, against the same autocast in one process.
        out.append(
            dict(
                model="gpt-tiny",
                dp=1,
                pp=2,
                schedule="1F1B",
                v=1,
                m=4,
                b=2,
                optimizer="sgd",
                zero=0,
                precision="bf16-mixed",
            )
        )
        out.append(
            dict(
                model="resnet-tiny",
                dp=2,
                pp=1,
                schedule="GPipe",
                v=1,
                m=4,
                b=2,
                optimizer="sgd",
                zero=0,
                precision="bf16-mixed",
            )
        )
        # Rematerialization (checkpointed, nested, offloaded blocks) inside the stages: the same training.
        for model, dp, pp, schedule, kinds in (
            ("gpt-tiny", 1, 2, "1F1B", ["periodic", "nested"]),
            ("gpt-tiny", 1, 2, "GPipe", ["selective", "selective"]),
            ("resnet-tiny", 1, 2, "GPipe", ["nested", "full"]),
            ("resnet-tiny", 2, 1, "GPipe", ["full"]),
        ):
            out.append(
                dict(
                    model=model, dp=dp, pp=pp, schedule=schedule, v=1, m=4, b=2, optimizer="adamw", zero=0, remat=kinds
                )
            )
        # A model captured with torch.export (keyword inputs, branches on shapes, dtypes and None, a dict output):
        # each stage reads the batch size off its own input.
        for schedule, opt in (("1F1B", "adamw"), ("GPipe", "sgd")):
            out.append(dict(model=BRANCHY, dp=1, pp=2, schedule=schedule, v=1, m=4, b=2, optimizer=opt, zero=0))
        for model in (*PLAIN, *REAL):
            out.append(dict(model=model, dp=1, pp=2, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw", zero=0))
        # Hugging Face transformers models built from tiny configs, without dropout (its random masks differ between
        # a pipeline and one process): tied embeddings (gpt2), a mask input (bert), an encoder-decoder of two inputs
        # (t5), a mixture of experts (mixtral) and a vision transformer (vit). SGD where a parameter's gradient is
        # zero in theory (bert's attention key bias: AdamW turns its 1e-17 rounding noise into full steps), and
        # mixtral in float32 (its grouped expert kernel takes no float64; its eager experts loop over the experts
        # the router picked, a branch on values no capture follows).
        for model in HF_MODELS:
            kind = model.split(":")[1]
            opt = "sgd" if kind in ("bert", "mixtral") else "adamw"
            out.append(dict(model=model, dp=1, pp=2, schedule="1F1B", v=1, m=4, b=2, optimizer=opt, zero=0,
                            float32=kind == "mixtral"))  # fmt: skip
        # ZeRO-3 without pipeline stages: the model's own modules sharded unit by unit over 2 replicas, gradients
        # reduce-scattered every micro-batch (pyplan/runtime/sharded.py): tied embeddings (gpt-tiny), batch norm
        # (resnet-tiny), keyword inputs and a dict output (branchy), a transformers model.
        llama = [(m, "adamw") for m in HF_MODELS if m.startswith("hf:llama")]
        for model, opt in [("gpt-tiny", "adamw"), ("resnet-tiny", "sgd"), (BRANCHY, "adamw"), *llama]:
            out.append(dict(model=model, dp=2, pp=1, schedule="1F1B", v=1, m=4, b=2, optimizer=opt, zero=3))
        # ... and every layer checkpointed (a plan that recomputes every block).
        out.append(dict(model="gpt-tiny", dp=2, pp=1, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw", zero=3,
                        remat=["full"]))  # fmt: skip
        # ... and every layer checkpointed selectively (torchtitan's op policy on FSDP2 units).
        out.append(dict(model="gpt-tiny", dp=2, pp=1, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw", zero=3,
                        remat=["selective units"]))  # fmt: skip
        # Stages assigned operation by operation (Layout.stage_of_node), not contiguous in the traced order: the
        # branches of grouped-mlp-tiny share one block of the chain and are split between the stages.
        out.append(dict(model="grouped-mlp-tiny", dp=1, pp=2, schedule="1F1B", v=1, m=4, b=2, optimizer="sgd", zero=0,
                        dag=True))  # fmt: skip
    # Tensor parallelism (every layer pyplan splits, over the innermost mesh axis), alone and beside pipeline
    # stages and replicas: tied embeddings and a fused QKV (gpt-tiny), an exported Llama (grouped-query attention,
    # rotary, SwiGLU) and BERT.
    llama_bert = [m for m in HF_MODELS if m.split(":")[1] in ("llama", "bert") and "labels" not in m]
    # (tp 2 alone on llama and bert, with and without sequence parallelism, is tests/runtime/test_tensor_parallel.py's:
    # the same split, run by hand.)
    tp_runs = (
        [("gpt-tiny", 1, 1, "1F1B", "adamw")]
        if world == 2
        else [("gpt-tiny", 1, 2, "1F1B", "adamw"), ("gpt-tiny", 2, 1, "GPipe", "sgd"),
              *((m, 1, 2, "1F1B", "sgd") for m in llama_bert), *((m, 2, 1, "GPipe", "sgd") for m in llama_bert)]
    )  # fmt: skip
    # Each with and without sequence parallelism (the values between the split layers split by their tokens; with
    # replicas, under ZeRO-1 below); beside stages, gpt-tiny both ways, llama without and bert with.
    for model, dp, pp, schedule, opt in tp_runs:
        both = model == "gpt-tiny" or world == 2
        for sp in ((False, True) if both else (model.startswith("hf:bert"),)) if dp == 1 else (False,):
            out.append(dict(model=model, dp=dp, pp=pp, tp=2, sp=sp, schedule=schedule, v=1, m=4, b=2, optimizer=opt,
                            zero=0))  # fmt: skip
    if world == 2:  # ... and every block of the split model checkpointed
        out.append(dict(model="gpt-tiny", dp=1, pp=1, tp=2, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw",
                        zero=0, remat=["full"]))  # fmt: skip
    else:  # ... and ZeRO-1 over the replicas (Zero1Optimizer: each replica steps its share and broadcasts it)
        for model, opt in (("gpt-tiny", "adamw"), *((m, "adamw" if "llama" in m else "sgd") for m in llama_bert)):
            out.append(dict(model=model, dp=2, pp=1, tp=2, sp=True, schedule="1F1B", v=1, m=4, b=2, optimizer=opt,
                            zero=1))  # fmt: skip
        # ... and ZeRO-3 (FSDP2 over the dp axis, the traced model sharded piece by piece: TracedUnits), with and
        # without sequence parallelism, and every unit checkpointed.
        for model, opt, sp in (("gpt-tiny", "adamw", True), *((m, "adamw", False) for m in llama_bert if "llama" in m)):
            out.append(dict(model=model, dp=2, pp=1, tp=2, sp=sp, schedule="1F1B", v=1, m=4, b=2, optimizer=opt,
                            zero=3))  # fmt: skip
        out.append(dict(model="gpt-tiny", dp=2, pp=1, tp=2, schedule="1F1B", v=1, m=4, b=2, optimizer="adamw",
                        zero=3, remat=["full"]))  # fmt: skip
    if world == 4:
        # ZeRO-1/2 (ZeroRedundancyOptimizer beside DDP) and ZeRO-3 (FSDP2) over the dp axis of a 2 x 2 mesh.
        # Tied weights across stages are refused with ZeRO-3, so gpt-tiny (tied embeddings) runs ZeRO-1 only.
        for model, schedule, zero in (
            ("resnet-tiny", "GPipe", 1),
            ("resnet-tiny", "1F1B", 3),
            ("resnet-tiny", "GPipe", 3),
            ("gpt-tiny", "1F1B", 1),
        ):
            out.append(dict(model=model, dp=2, pp=2, schedule=schedule, v=1, m=4, b=2, optimizer="adamw", zero=zero))
        # The other rank placement: a stage's replicas on consecutive ranks.
        for model in ("resnet-tiny", "gpt-tiny"):
            for schedule, v in (("1F1B", 1), ("Interleaved1F1B", 2)):
                out.append(
                    dict(
                        model=model,
                        dp=2,
                        pp=2,
                        schedule=schedule,
                        v=v,
                        m=4,
                        b=2,
                        optimizer="sgd",
                        zero=0,
                        placement="dp-inner",
                    )
                )
    return out


def _double(call: Call) -> Call:
    return tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, call)


def _spec(name: str) -> ModelSpec:
    """A zoo model by name, or any model reference (hf:..., model.py)."""
    return load_model(name if ":" in name or name.endswith(".py") else f"zoo:{name}")


def _sliced(call: Call, sl: slice) -> Call:
    """The call's tensors sliced along the batch (dim 0)."""
    return tree_map_only(torch.Tensor, lambda t: t[sl], call)


def layout_of(cfg: dict) -> Layout:
    """The configuration's layout: its cuts, tensor-parallel plan and remat blocks read off the model's capture."""
    stage_of_node = dag_stages(cfg["model"], cfg["pp"], cfg["m"], cfg["b"]) if cfg.get("dag") else {}
    if stage_of_node:
        counts = [list(stage_of_node.values()).count(s) for s in range(cfg["pp"])]
        cuts = tuple(sum(counts[:k]) for k in range(cfg["pp"] + 1))
    else:
        cuts = even_cuts(cfg["model"], cfg["pp"] * cfg["v"], cfg["b"])
    tp = cfg.get("tp", 1)
    tp_plan = derive_tp_plan(_traced(cfg["model"], cfg["b"])).styles(tp) if tp > 1 else {}
    return Layout(
        dp=cfg["dp"],
        pp=cfg["pp"],
        tp=tp,
        tp_plan=tp_plan,
        sequence_parallel=cfg.get("sp", False),
        micro_batch_size=cfg["b"],
        num_microbatches=cfg["m"],
        schedule=cfg["schedule"],
        stages_per_rank=cfg["v"],
        zero_stage=cfg["zero"],
        placement=cfg.get("placement", "pp-inner"),
        cut_positions=cuts,
        remat=stage_remat(cfg["model"], cuts, cfg["b"], cfg["remat"]) if "remat" in cfg else (),
        stage_of_node=stage_of_node,
    )


def _precision(cfg: dict) -> tuple[bool, bool]:
    """(bf16 autocast, float32 weights): mixed-precision runs and float32 models keep their weights in float32."""
    mixed = cfg.get("precision", "fp32") != "fp32"
    return mixed, mixed or cfg.get("float32", False)


def reference_key(cfg: dict) -> tuple:
    """What one process's training depends on: configurations of the same key share their reference."""
    return (cfg["model"], cfg["optimizer"], cfg["dp"] * cfg["m"] * cfg["b"], cfg["b"], *_precision(cfg))


def train_reference(cfg: dict) -> dict:
    """One process training the model `STEPS` steps on the global batch, accumulating over the micro-batches: the
    batch (call and target), each step's micro-batch losses and the parameters after the last step."""
    spec = _spec(cfg["model"])
    mixed, single = _precision(cfg)
    torch.manual_seed(0)
    # Autocast casts float32 ops only: mixed-precision runs keep the model in float32.
    reference = spec.build() if single else spec.build().double()
    B, b = cfg["dp"] * cfg["m"] * cfg["b"], cfg["b"]
    call, target = call_at(spec.example_inputs, B), spec.target(B) if spec.target is not None else None
    call = call if single else _double(call)
    loss_fn = spec.loss or default_loss  # the model's own loss where it returns one
    ref_opt = OPTIMIZERS[cfg["optimizer"]](reference.parameters())
    ref_losses = []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        step_losses = []
        for k in range(B // b):
            sl = slice(k * b, (k + 1) * b)
            args, kwargs = _sliced(call, sl)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                out = output_tensors(reference(*args, **kwargs))
            loss = loss_fn(out, target[sl] if target is not None else None)
            (loss / (B // b)).backward()
            step_losses.append(loss.detach())
        ref_opt.step()
        ref_losses.append(step_losses)
    params = {k: p.detach() for k, p in reference.named_parameters(remove_duplicate=False)}
    return {"call": call, "target": target, "losses": ref_losses, "params": params}


def prepare(cfgs: list[dict], rank: int, world: int) -> tuple[list[Layout | str], list[dict | str]]:
    """Every configuration's layout and reference training, each model's capture and each distinct reference done
    once, by one rank (dealt out in turn), and gathered by all. What fails is kept as its error, said by the
    configuration it belongs to."""
    models = list(dict.fromkeys(cfg["model"] for cfg in cfgs))
    keys = list(dict.fromkeys(reference_key(cfg) for cfg in cfgs))
    jobs = [("layouts", m) for m in models] + [("reference", k) for k in keys]
    mine: dict[tuple, Layout | dict | str] = {}
    for n, (kind, what) in enumerate(jobs):
        if n % world != rank:
            continue
        for i, cfg in enumerate(cfgs):
            if (kind == "layouts" and cfg["model"] != what) or (kind == "reference" and reference_key(cfg) != what):
                continue
            try:
                mine[(kind, i)] = layout_of(cfg) if kind == "layouts" else train_reference(cfg)
            except Exception as exc:
                print(traceback.format_exc(), file=sys.stderr, flush=True)
                mine[(kind, i)] = f"rank {rank} preparing its {kind[:6]}: {type(exc).__name__}: {exc}"
            if kind == "reference":
                break  # configurations of one key share it
        _traced.cache_clear()
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    got = {k: v for g in gathered if g is not None for k, v in g.items()}
    first = {key: next(i for i, c in enumerate(cfgs) if reference_key(c) == key) for key in keys}
    layouts = [got[("layouts", i)] for i in range(len(cfgs))]
    references = [got[("reference", first[reference_key(cfg)])] for cfg in cfgs]
    return layouts, references


def run(cfg: dict, layout: Layout, ref: dict) -> dict:
    spec = _spec(cfg["model"])
    if layout.stage_of_node:
        stages = list(layout.stage_of_node.values())
        cfg = {**cfg, "contiguous": stages == sorted(stages)}
    mixed, single = _precision(cfg)
    torch.manual_seed(0)
    # Autocast casts float32 ops only: mixed-precision runs keep the model in float32.
    model = spec.build() if single else spec.build().double()
    cast = (lambda ts: ts) if single else _double
    initial = {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}
    trainer = build_trainer(
        spec,
        model,
        layout,
        OPTIMIZERS[cfg["optimizer"]],
        example_inputs=lambda n: cast(call_at(spec.example_inputs, n)),
        precision=cfg.get("precision", "fp32"),
    )

    b = layout.micro_batch_size
    # Copies: the configurations of one reference share its batch.
    inputs = tuple(t.clone() for t in input_tensors(ref["call"]))
    target = ref["target"].clone() if ref["target"] is not None else None
    tol = TOL_MIXED if mixed else (TOL_FLOAT32 if single else TOL)
    loss_error = ""
    mine = replica_slice(layout, trainer.dp_rank)
    for step, step_losses in enumerate(ref["losses"]):
        got = trainer.step(tuple(t[mine] for t in inputs), target[mine] if target is not None else None)
        if trainer.has_last and not loss_error:
            first = mine.start // b
            want = torch.stack(step_losses[first : first + layout.num_microbatches])
            err = ((torch.stack(got) - want).abs().max() / want.abs().max()).item()
            if err > tol:
                # Said once every step has run: the other ranks are still in the schedule's sends and receives.
                loss_error = f"step {step}: loss differs by {err:.2e} (relative)"
    if loss_error:
        return {**cfg, "ok": False, "why": loss_error}
    ref_params = ref["params"]
    worst, worst_name = 0.0, ""
    trained = trainer.parameters()
    if all(torch.equal(p, initial[name]) for name, p in trained.items()):
        return {**cfg, "ok": False, "why": "no parameter changed: the pipeline did not train"}
    for name, p in trained.items():
        ref = ref_params[name]
        err = ((p - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        if err > worst:
            worst, worst_name = err, name
    return {
        **cfg,
        "ok": worst <= tol,
        "worst": worst,
        "why": "" if worst <= tol else f"parameter {worst_name} differs by {worst:.2e} (relative)",
    }


def run_part(path: str) -> None:
    """Every configuration of this world size, in the launch's process group (tests/runtime/_launch.py)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    only = os.environ.get("PYPLAN_TRANSPARENCY_ONLY")
    cfgs = [cfg for cfg in configs(world) if not only or only in json.dumps(cfg)]
    hang_s = float(os.environ.get("PYPLAN_HANG_S", "120"))
    # A hang (a mismatched send/recv) prints every rank's stack instead of waiting forever: a limit per config, and
    # for the preparation, which runs a few configurations' worth of captures and reference trainings on each rank.
    faulthandler.dump_traceback_later(4 * hang_s, exit=True)
    layouts, references = prepare(cfgs, rank, world)
    results = []
    for cfg, layout, ref in zip(cfgs, layouts, references):
        faulthandler.dump_traceback_later(hang_s, exit=True)
        if rank == 0:
            print("config", json.dumps(cfg), flush=True)
        started = time.perf_counter()
        try:
            for prepared in (layout, ref):
                if isinstance(prepared, str):
                    raise RuntimeError(prepared)
            res = {**run(cfg, layout, ref), "seconds": round(time.perf_counter() - started, 2)}
        except Exception as exc:
            # The other ranks may be blocked in a send or receive of the pipeline: record and stop the launch.
            res = {**cfg, "ok": False, "why": f"rank {rank}: {type(exc).__name__}: {exc}"}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            with open(f"{path}.rank{rank}.error", "w") as f:
                json.dump([*results, res], f)
            os._exit(1)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        bad = [g for g in gathered if not g["ok"]]
        results.append(bad[0] if bad else gathered[0])
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
