"""A plan as Megatron-LM's training arguments (pretrain_gpt.py), as its current `main` branch parses them.

Source read: NVIDIA/Megatron-LM main at d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22):
megatron/training/arguments.py (`parse_args`, `validate_args`: the data-parallel size is the world size over
tp x pp; the global batch over micro-batch x dp gives the micro-batches; `--pipeline-model-parallel-layout` sets
the virtual pipeline size; `--use-torch-fsdp2` refuses pipeline parallelism, the distributed optimizer, gradient
accumulation fusion and tied embeddings; `--bf16` accumulates and reduces gradients in fp32 unless
`--grad-reduce-in-bf16`), megatron/core/transformer/pipeline_parallel_layer_layout.py (the layout string: "E"
embedding, "t" a decoder layer, "L" the loss with the final norm and output layer, "|" between stages, listed in
the order stage = virtual rank x pp + pipeline rank), megatron/core/recompute.py (`--recompute-method uniform` with
`--recompute-num-layers 1` checkpoints every layer; `block` with k the first k layers of each model chunk),
megatron/core/pipeline_parallel/schedules.py (the interleaved schedule runs micro-batches in groups of pp and
refuses a last group smaller than pp); for expert parallelism arguments.py (`--expert-model-parallel-size` needs
`--num-experts`, a multiple of it; `--use-torch-fsdp2` refuses it) and megatron/core/parallel_state.py
(`initialize_model_parallel`: the experts' grid, expert tp x ep x pp x expert dp, covers the world the dense grid
does, so ep divides dp x cp where the experts' tensor parallelism is the rest's).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyplan.emit.configs import Notes, PlanShape

__all__ = ["COMMIT", "layout_string", "render"]

COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def render(shape: PlanShape) -> tuple[str, Notes]:
    """The plan as Megatron-LM's pretrain_gpt.py flags, and the notes; what it cannot express is refused."""
    dec = shape.built_decoder("Megatron-LM", ("llama", "gpt2"))
    lay, workload = shape.layout, shape.doc.workload
    notes: Notes = []
    flags = [
        f"--tensor-model-parallel-size {lay.tp}",
        *(["--sequence-parallel"] if lay.sequence_parallel else []),
        f"--pipeline-model-parallel-size {lay.pp}",
        f"--num-layers {dec.n_layers}",
        f"--micro-batch-size {lay.micro_batch_size}",
        f"--global-batch-size {workload.global_batch}",
    ]
    if not dec.tied:
        flags.append("--untie-embeddings-and-output-weights")

    if lay.tp > 1:
        _check_tp(shape, notes)
    if lay.ep > 1:
        # The experts' grid is carved out of the data-parallel ranks (parallel_state.py): ep x expert-dp = dp x cp
        # with the experts' tensor parallelism that of the rest (the default). FSDP2 refuses it.
        if lay.zero_stage == 3 and lay.dp > 1:
            raise shape.cannot(
                f"expert parallelism {lay.ep} beside ZeRO-3 (Megatron's --use-torch-fsdp2 refuses expert parallelism)",
                "--zero 0 or --zero 1",
            )
        flags.append(f"--expert-model-parallel-size {lay.ep}")
        notes.append(
            f"Megatron splits the experts only with --num-experts among the model's flags (a multiple of {lay.ep}), "
            "with the layers' MoE flags (--moe-router-topk, --moe-ffn-hidden-size, ...)"
        )
    if lay.pp > 1:
        flags.append(f"--pipeline-model-parallel-layout {shlex.quote(layout_string(shape))}")
        _check_schedule(shape)

    # Data parallelism: plain DDP (ZeRO-0), the distributed optimizer (ZeRO-1: optimizer state and master weights
    # sharded, every gradient kept), torch FSDP2 (ZeRO-3).
    if lay.zero_stage == 1 and lay.dp > 1:
        flags.append("--use-distributed-optimizer")
    elif lay.zero_stage == 3 and lay.dp > 1:
        if dec.tied:
            raise shape.cannot(
                "ZeRO-3 for a model whose output layer shares the embedding's weight (Megatron's --use-torch-fsdp2 "
                "requires --untie-embeddings-and-output-weights)",
                "--zero 1",
            )
        flags += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--ckpt-format torch_dist"]

    # Precision: Megatron's --bf16 keeps bf16 weights beside fp32 master weights in the optimizer, its gradients in
    # fp32 unless --grad-reduce-in-bf16; it has no autocast over fp32 weights, and its --fp16 is fp16 weights.
    if workload.precision in ("bf16-mixed", "fp16-mixed"):
        raise shape.cannot(
            f"{workload.precision} (autocast over fp32 weights; Megatron's --bf16 keeps bf16 weights beside fp32 "
            "master weights)",
            "--precision bf16-master",
        )
    if workload.precision == "bf16-master":
        flags.append("--bf16")
    elif workload.precision == "bf16-master-bf16-grads":
        flags += ["--bf16", "--grad-reduce-in-bf16"]

    flags += _recompute(shape, notes)
    lines = [
        f"# Megatron-LM (main, arguments.py at {COMMIT[:12]}) arguments of pretrain_gpt.py from pyplan's plan of "
        f"{shape.model_name}.",
        f"# Add the model's own ({_model_flags(dec.family)}, its sizes) and launch with {shape.gpus} GPUs:",
        f"#   source THIS_FILE; torchrun --nproc-per-node {shape.gpus} pretrain_gpt.py "
        '"${PYPLAN_MEGATRON_ARGS[@]}" MODEL_ARGS',
        "PYPLAN_MEGATRON_ARGS=(",
        *(f"  {line}" for line in flags),
        ")",
    ]
    return "\n".join(lines) + "\n", notes


def _model_flags(family: str) -> str:
    if family == "llama":
        return "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear"
    return "--position-embedding-type learned_absolute"


def layout_string(shape: PlanShape) -> str:
    """`--pipeline-model-parallel-layout`: each stage's units in the global stage order, "E" the embeddings, "t" a
    layer, "L" the final norm with the output layer (Megatron keeps them together)."""
    if shape.inside:
        raise shape.cannot(
            f"a stage that starts inside {shape.unit_name(shape.inside)} (Megatron splits the model at layers)",
            "--cuts at the blocks where layers start (pyplan inspect numbers the blocks)",
        )
    stages = []
    for units in shape.stages:
        if "H" in units and "N" not in units:
            raise shape.cannot(
                "a stage that starts at the output layer (Megatron keeps the final norm with it)",
                "--cuts at the blocks where layers start (pyplan inspect numbers the blocks)",
            )
        letters = "".join("E" if u == "E" else "t" if u.startswith("L") else "L" if u == "H" else "" for u in units)
        if "N" in units and "H" not in units:
            raise shape.cannot(
                "a stage that ends at the final norm (Megatron keeps it with the output layer)",
                "--cuts at the blocks where layers start (pyplan inspect numbers the blocks)",
            )
        stages.append(letters)
    return "|".join(stages)


def _check_tp(shape: PlanShape, notes: Notes) -> None:
    """Megatron splits every layer's attention and MLP (column then row), the embedding and the output layer
    (vocabulary-parallel)."""
    dec = shape.decoder
    assert dec is not None
    lay = shape.layout
    expected = dec.tp_plan()
    outer = {**dec.embedding_tp, **dec.head_tp}
    layer_plan = {k: v for k, v in lay.tp_plan.items() if k not in outer}
    layer_expected = {k: v for k, v in expected.items() if k not in outer}
    if layer_plan != layer_expected or any(lay.tp_plan.get(k, v) != v for k, v in outer.items()):
        differ = sorted(set(expected.items()) ^ set(lay.tp_plan.items()))
        first = differ[0][0]
        how = f"splits {first} as {lay.tp_plan[first]}" if first in lay.tp_plan else f"leaves {first} whole"
        raise shape.cannot(f"a tensor-parallel plan other than its own (this plan {how})", "--tp 1, or no --tp-plan")
    whole = [k for k in outer if k not in lay.tp_plan]
    if whole:
        notes.append(
            f"Megatron splits {', '.join(whole)} over the vocabulary, which the plan keeps whole on every "
            "tensor-parallel rank: less memory than the plan counts"
        )


def _check_schedule(shape: PlanShape) -> None:
    """Megatron runs 1F1B, and interleaved 1F1B over virtual stages (micro-batches in groups of pp)."""
    lay = shape.layout
    if lay.stages_per_rank == 1 and lay.schedule != "1F1B":
        raise shape.cannot(f"the {lay.schedule} schedule (Megatron runs 1F1B on one stage per rank)", "--schedule 1F1B")
    if lay.stages_per_rank > 1:
        if lay.schedule != "Interleaved1F1B":
            raise shape.cannot(
                f"the {lay.schedule} schedule (Megatron interleaves 1F1B over virtual stages)",
                "--schedule Interleaved1F1B",
            )
        if lay.num_microbatches % lay.pp:
            raise shape.cannot(
                f"{lay.num_microbatches} micro-batches on the interleaved schedule (Megatron runs them in groups of "
                f"pp = {lay.pp})",
                f"--ga {lay.num_microbatches + lay.pp - lay.num_microbatches % lay.pp}",
            )


def _recompute(shape: PlanShape, notes: Notes) -> list[str]:
    """The first k layers of every stage recomputed whole, the rest kept (`block`, k the same in every stage), or
    every layer recomputed (`uniform`, one layer a unit); Megatron's selective recomputation is another policy than
    the plan's."""
    kinds = set(shape.layer_remat) or {"keep"}
    if kinds == {"keep"}:
        if shape.recomputed_outside:
            notes += shape.remat_notes("Megatron")
        return []
    if "selective" in kinds:
        raise shape.cannot(
            "selective recomputation as the plan prices it (torchtitan's op policy; Megatron recomputes named "
            "submodules)",
            "--remat full or --remat none",
        )
    if not kinds <= {"full", "keep"}:
        raise shape.cannot(
            "a plan that mixes recomputation inside a layer, or offloads (Megatron recomputes whole layers)",
            "--remat full or --remat none",
        )
    # Per stage: its layer count and how many of its first layers the plan recomputes, counting the layers kept as
    # the last of their stage as kept.
    leading = []
    for units in shape.stages:
        layers = [int(u[1:]) for u in units if u.startswith("L")]
        flags = ["keep" if i in shape.kept_last else shape.layer_remat[i] for i in layers]
        k = next((j for j, f in enumerate(flags) if f != "full"), len(flags))
        if "full" in flags[k:]:
            raise shape.cannot(
                "a plan that recomputes layers after one it keeps in a stage (Megatron recomputes the first layers "
                "of each stage)",
                "--remat full or --remat none",
            )
        leading.append((k, len(flags)))
    partial = {k for k, n in leading if k < n}
    exact = None if len(partial) > 1 else (partial.pop() if partial else max(n for _, n in leading))
    if exact is not None and all(min(exact, n) == k for k, n in leading):
        notes += shape.remat_notes("Megatron", kept_last=False)
        if all(k == n for k, n in leading):
            return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {exact}"]
    if kinds == {"full"}:
        # Every layer recomputed but some kept as the last of their stage: Megatron recomputes those too.
        notes += shape.remat_notes("Megatron")
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    raise shape.cannot(
        "a plan that recomputes a different number of leading layers in each stage (Megatron's block method "
        f"recomputes the same k in every stage; here {', '.join(str(k) for k, _ in leading)})",
        "--remat full or --remat none",
    )
