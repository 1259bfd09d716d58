"""A plan as a DeepSpeed 0.19 configuration (the JSON `deepspeed.initialize(config=...)` reads).

Sources read: DeepSpeed 0.19.8 deepspeed/runtime/config.py (`DeepSpeedConfig`: train_batch_size = micro-batch x
gradient-accumulation steps x the data-parallel world size, `torch_autocast`, `data_types.grad_accum_dtype`),
runtime/engine.py (`_do_optimizer_sanity_check`: bf16 weights with fp32 gradient accumulation need ZeRO 1 and
run the BF16 optimizer's fp32 master weights, bf16 gradients beside them need ZeRO 1 too; a GradScaler for fp16
autocast without ZeRO), runtime/tensor_parallel/config.py and module_inject/autotp_config.py (AutoTP training:
`tensor_parallel.autotp_size`, `partition_config.layer_specs` of parameter-name patterns split by column or row,
`vocab_parallel_lm_head`), module_inject/auto_tp.py (a vocabulary-parallel output head shares its shard with the
embedding tied to it); deepspeed/moe/layer.py at commit 639460ab3299 (`MoE(hidden_size, expert, num_experts,
ep_size=1, ...)`: the expert-parallel size is an argument of the model's MoE layer). Pipeline stages are built in
code (`deepspeed.pipe.PipelineModule`), which layers recompute is chosen in code
(`deepspeed.checkpointing.checkpoint`) and so is the expert-parallel size: the configuration holds none of them.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from pyplan.remat_plan import Keep

if TYPE_CHECKING:
    from pyplan.emit.configs import Notes, PlanShape

__all__ = ["VERSION", "render"]

VERSION = "DeepSpeed 0.19"


def render(shape: PlanShape) -> tuple[str, Notes]:
    """The plan as a DeepSpeed 0.19 JSON configuration, and the notes; what it cannot express is refused."""
    lay, workload = shape.layout, shape.doc.workload
    notes: Notes = []
    if lay.pp * lay.stages_per_rank > 1:
        raise shape.cannot(
            "pipeline stages (DeepSpeed builds them in code, deepspeed.pipe.PipelineModule, not from its "
            "configuration)",
            "--pp 1",
        )
    if lay.ep > 1:
        raise shape.cannot(
            f"expert parallelism {lay.ep} (DeepSpeed sets the expert-parallel size in the model's code, "
            "deepspeed.moe.layer.MoE(ep_size=...), not in its configuration)",
            "--ep 1",
        )
    if any(r is not None and any(not isinstance(it, Keep) for it in r.plan.items) for r in lay.remat):
        raise shape.cannot(
            "recomputation or offloading (the model's code chooses what DeepSpeed recomputes, "
            "deepspeed.checkpointing.checkpoint; its configuration does not)",
            "--remat none",
        )
    config: dict[str, Any] = {
        "_comment": f"{VERSION} configuration from pyplan's plan of {shape.model_name}; launch with {shape.gpus} GPUs",
        # DeepSpeed checks train_batch_size == micro-batch x gradient-accumulation steps x data-parallel size.
        "train_batch_size": workload.global_batch,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": lay.num_microbatches,
        "zero_optimization": {"stage": lay.zero_stage},
    }
    config.update(_precision(shape))
    if lay.tp > 1:
        config["tensor_parallel"] = _tensor_parallel(shape)
    return json.dumps(config, indent=2) + "\n", notes


def _precision(shape: PlanShape) -> dict[str, Any]:
    """Autocast over fp32 weights for the mixed precisions (`torch_autocast`); bf16 weights beside fp32 master
    weights for the master precisions, their gradients accumulated in fp32 or bf16 (`data_types`), which DeepSpeed
    runs under ZeRO 1 only (ZeRO 0 keeps no master weights, or refuses the mix)."""
    precision, lay = shape.doc.workload.precision, shape.layout
    if precision == "fp32":
        return {}
    if precision in ("bf16-mixed", "fp16-mixed"):
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16" if precision == "bf16-mixed" else "float16"}}
    if lay.zero_stage != 1:
        raise shape.cannot(
            f"{precision} without ZeRO-1 (DeepSpeed keeps fp32 master weights beside bf16 ones in its ZeRO-1 "
            "optimizer only)",
            "--zero 1, or --precision bf16-mixed",
        )
    grads = "fp32" if precision == "bf16-master" else "bf16"
    return {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": grads}}


def _tensor_parallel(shape: PlanShape) -> dict[str, Any]:
    """AutoTP with the plan's own split: each split Linear by its parameter name, column or row; the output head
    over the vocabulary (with the embedding tied to it)."""
    lay = shape.layout
    if lay.sequence_parallel:
        raise shape.cannot(
            "sequence parallelism (DeepSpeed's AutoTP splits no norm's tokens)",
            "--sp off",
        )
    heads = {h for h in shape.embeddings.values() if h}
    if shape.decoder is not None:
        heads.add(shape.decoder.head)
    columns, rows, head = [], [], ""
    for name, style in sorted(lay.tp_plan.items()):
        if name in shape.embeddings:
            tied = shape.embeddings[name]
            if not tied or lay.tp_plan.get(tied) != "ColwiseParallel":
                raise shape.cannot(
                    f"splitting the embedding {name} (DeepSpeed's AutoTP splits an embedding over the vocabulary only "
                    "with the output layer tied to it)",
                    f"--tp-plan FILE leaving {name} whole, or --tp 1",
                )
            continue
        if name in heads and style == "ColwiseParallel":
            head = name
            continue
        pattern = "^" + re.escape(name + ".weight") + "$"
        (columns if style == "ColwiseParallel" else rows).append(pattern)
    specs = []
    if columns:
        specs.append({"patterns": columns, "partition_type": "column"})
    if rows:
        specs.append({"patterns": rows, "partition_type": "row"})
    config: dict[str, Any] = {
        "autotp_size": lay.tp,
        "partition_config": {"use_default_specs": False, "layer_specs": specs},
        "vocab_parallel_lm_head": bool(head),
    }
    if head:
        config["partition_config"]["lm_head_patterns"] = [head.rsplit(".", 1)[-1]]
    return config
