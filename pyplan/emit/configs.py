"""`pyplan emit --format torchtitan|deepspeed|megatron`: a plan as another tool's configuration.

Each writer returns the configuration text and the notes: one line for each part of the plan the tool cannot
express as pyplan planned it, and what the text says instead. What each maps:

  torchtitan  a TOML fragment ([parallelism], [training], [activation_checkpoint]): ZeRO-3 as FSDP
              (data_parallel_shard_degree), ZeRO-0 as DDP (data_parallel_replicate_degree), the pipeline degree,
              schedule, micro-batch size and split points (the module each stage starts at), the local and global
              batch (gradient accumulation), bf16 mixed precision, no/full/selective checkpointing.
  deepspeed   a JSON config: batch, micro-batch and gradient-accumulation steps, the ZeRO stage, bf16; pipeline
              stages are set in code (PipelineModule), not in the config.
  megatron    pretrain_gpt.py flags: pipeline size, micro and global batch, the distributed optimizer for ZeRO-1,
              bf16, recomputation, virtual pipeline stages for interleaved schedules.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import torch

from pyplan.emit.planfile import PlanFile
from pyplan.errors import PlanError
from pyplan.graph.linearize import cut_points
from pyplan.graph.trace import trace
from pyplan.load import load_model
from pyplan.plan import Layout
from pyplan.remat_plan import Checkpoint, Keep, Selective, SelectiveCheckpoint

__all__ = ["FORMATS", "render_config", "stage_starts"]

Notes = list[str]
# The precisions each tool's bf16 setting stands for: DeepSpeed's and Megatron-LM's bf16 are bf16 weights beside fp32
# master weights (bf16-master); pyplan's bf16-mixed (autocast over fp32 weights) is written as the same setting.
_BF16 = ("bf16-mixed", "bf16-master", "bf16-master-bf16-grads")
# What to say where the plan's bf16-mixed is written as a tool's bf16 (bf16 weights beside fp32 master weights).
_BF16_MIXED_NOTE = (
    "{tool}'s bf16 keeps bf16 weights beside fp32 master weights, not autocast over fp32 weights as this plan "
    "(bf16-mixed) counts: its model state differs from the plan's; plan with --precision bf16-master to match it"
)


def _remat_kind(layout: Layout) -> str:
    """ "none", "full" (every block of every stage checkpointed, but a stage's last), "selective" (every gaining
    block selective, or units checkpointed selectively) or "mixed" (a plan per block that no tool expresses)."""
    items = [it for r in layout.remat if r is not None for it in r.plan.items]
    if not items or all(isinstance(it, Keep) for it in items):
        return "none"
    if all(isinstance(it, Selective | SelectiveCheckpoint | Keep) for it in items):
        return "selective"
    if all(isinstance(it, Keep) or (type(it) is Checkpoint) for it in items):
        return "full"
    return "mixed"


def _torchtitan(doc: PlanFile, starts: Sequence[str]) -> tuple[str, Notes]:
    lay, notes = doc.plan.layout, []
    shard, replicate = (lay.dp, 1) if lay.zero_stage == 3 else (1, lay.dp)
    if lay.zero_stage == 1:
        notes.append(
            "ZeRO-1 (sharded optimizer state) has no torchtitan setting: written as DDP "
            "(data_parallel_replicate_degree), which keeps the whole optimizer state on every replica"
        )
    local = lay.micro_batch_size * (lay.num_microbatches if lay.pp > 1 else 1)
    lines = [
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f"tensor_parallel_degree = {lay.tp}",
        f"pipeline_parallel_degree = {lay.pp}",
    ]
    if lay.pp > 1:
        lines += [
            f'pipeline_parallel_schedule = "{lay.schedule}"',
            f"pipeline_parallel_microbatch_size = {lay.micro_batch_size}",
            "pipeline_parallel_split_points = [" + ", ".join(json.dumps(s) for s in starts) + "]",
        ]
    if lay.tp > 1:
        sp = "with" if lay.sequence_parallel else "without"
        notes.append(
            f"torchtitan splits its own models with its own TP plan (sequence parallelism included); pyplan's: "
            f"{_styles(lay)}, {sp} sequence parallelism"
        )
    kind = _remat_kind(lay)
    if kind == "mixed":
        notes.append(
            "the plan recomputes some blocks and not others: torchtitan checkpoints whole layers, written as full"
        )
    mode = {"none": "none", "full": "full", "selective": "selective", "mixed": "full"}[kind]
    lines += [
        "",
        "[training]",
        f"local_batch_size = {local}",
        f"global_batch_size = {doc.workload.global_batch}",
        f'mixed_precision_param = "{"bfloat16" if doc.workload.precision in _BF16 else "float32"}"',
        "",
        "[activation_checkpoint]",
        f'mode = "{mode}"',
    ]
    if mode == "selective":
        lines.append('selective_ac_option = "op"')
    if doc.workload.precision == "fp16-mixed":
        notes.append("fp16 mixed precision has no torchtitan setting: written as float32 parameters")
    if doc.workload.precision in ("bf16-master", "bf16-master-bf16-grads"):
        notes.append(
            "torchtitan keeps fp32 weights and computes in bf16, not bf16 weights beside fp32 master weights: "
            "written as its bf16 mixed precision, which holds 4 + 4 + 8 bytes a parameter"
        )
    return "\n".join(lines) + "\n", notes


def _styles(lay: Layout) -> str:
    """The layout's TP plan in a line: how many modules of each style."""
    counts = {s: sum(1 for v in lay.tp_plan.values() if v == s) for s in sorted(set(lay.tp_plan.values()))}
    return ", ".join(f"{n} {s}" for s, n in counts.items())


def _deepspeed(doc: PlanFile, starts: Sequence[str]) -> tuple[str, Notes]:
    lay, notes = doc.plan.layout, []
    config: dict[str, object] = {
        "train_batch_size": doc.workload.global_batch,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": lay.num_microbatches,
        "zero_optimization": {"stage": lay.zero_stage},
    }
    if doc.workload.precision in _BF16:
        config["bf16"] = {"enabled": True}
    if doc.workload.precision == "bf16-mixed":
        notes.append(_BF16_MIXED_NOTE.format(tool="DeepSpeed"))
    elif doc.workload.precision == "fp16-mixed":
        config["fp16"] = {"enabled": True}
    if lay.tp > 1:
        notes.append(f"tensor parallelism {lay.tp} is not a DeepSpeed config setting (Megatron-DeepSpeed takes "
                     "--tensor-model-parallel-size)")  # fmt: skip
    if lay.pp > 1:
        notes.append(
            f"pipeline stages are set in code, not in the config: PipelineModule(layers, num_stages={lay.pp}) with "
            f"stages starting at {', '.join(starts)}; DeepSpeed runs its own 1F1B-like schedule, not {lay.schedule}"
        )
    if _remat_kind(lay) != "none":
        notes.append(
            "recomputation is applied in code (deepspeed.checkpointing.checkpoint around each layer), not by the config"
        )
    return json.dumps(config, indent=2) + "\n", notes


def _megatron(doc: PlanFile, starts: Sequence[str]) -> tuple[str, Notes]:
    lay, notes = doc.plan.layout, []
    flags = [
        f"--tensor-model-parallel-size {lay.tp}",
        *(["--sequence-parallel"] if lay.sequence_parallel else []),
        f"--pipeline-model-parallel-size {lay.pp}",
        f"--micro-batch-size {lay.micro_batch_size}",
        f"--global-batch-size {doc.workload.global_batch}",
    ]
    if lay.stages_per_rank > 1:
        notes.append(
            f"{lay.schedule} with {lay.stages_per_rank} stages per rank: Megatron interleaves with "
            "--num-layers-per-virtual-pipeline-stage, which needs the model's layer count per stage"
        )
    if lay.pp > 1 and lay.schedule == "GPipe":
        notes.append("Megatron runs 1F1B for pipelines; GPipe has no flag")
    if lay.zero_stage == 1:
        flags.append("--use-distributed-optimizer")
    elif lay.zero_stage == 3:
        flags.append("--use-torch-fsdp2")
        notes.append("ZeRO-3 is Megatron's --use-torch-fsdp2 (recent Megatron-LM); older versions have no ZeRO-3")
    if doc.workload.precision in _BF16:
        flags.append("--bf16")
    if doc.workload.precision == "bf16-mixed":
        notes.append(_BF16_MIXED_NOTE.format(tool="Megatron-LM"))
    elif doc.workload.precision == "fp16-mixed":
        flags.append("--fp16")
    kind = _remat_kind(lay)
    if kind == "selective":
        flags.append("--recompute-granularity selective")
        notes.append("Megatron's selective recomputation recomputes the attention core, not torchtitan's op policy")
    elif kind in ("full", "mixed"):
        flags += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
        if kind == "mixed":
            notes.append("the plan recomputes some blocks and not others: written as full recomputation")
    return " \\\n".join(flags) + "\n", notes


FORMATS: dict[str, Callable[[PlanFile, Sequence[str]], tuple[str, Notes]]] = {
    "torchtitan": _torchtitan,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
}


def stage_starts(doc: PlanFile) -> tuple[list[str], Notes]:
    """The module each pipeline stage after the first starts at (torchtitan's split points), from the model traced
    as the runtime traces it; where a stage starts inside a module, that module and a note."""
    lay = doc.plan.layout
    if lay.pp == 1 and lay.stages_per_rank == 1:
        return [], []
    spec = load_model(doc.model)
    # On the meta device: the split points need the graph's module paths, not weights (a 70B model would not fit
    # the host).
    with torch.device("meta"):
        model = spec.build()
    graph = trace(model, spec.example_inputs, batch_size=lay.micro_batch_size, leaf_modules=doc.leaf_modules)
    points = cut_points(graph)
    nodes = {n.name: n for n in graph.nodes}
    starts, notes = [], []
    for position in lay.cut_positions[1:-1]:
        first = nodes[points.order[position]].module_path
        before = nodes[points.order[position - 1]].module_path if position > 0 else ""
        module = _layer_of(first)
        starts.append(module)
        if before == module or before.startswith(module + "."):
            notes.append(f"a stage starts inside {module}: tools that split at modules start it at {module}")
    return starts, notes


def _layer_of(path: str) -> str:
    """The outermost numbered module on `path` ("layers.4.attention.wq" -> "layers.4"), else the path itself."""
    parts = path.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return path


def render_config(doc: PlanFile, fmt: str) -> tuple[str, Notes]:
    """The plan in another tool's configuration format, and the notes on what it cannot express."""
    if fmt not in FORMATS:
        raise PlanError(f"unknown format '{fmt}'; choose one of {', '.join(FORMATS)} (or leave it out for train.py)")
    starts, notes = stage_starts(doc)
    text, more = FORMATS[fmt](doc, starts)
    return text, [*notes, *more]
