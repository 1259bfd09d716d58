"""A plan as torchtitan's configuration: the flags of torchtitan 0.3 (newest), or a TOML job file of its 0.2 line.

Sources read (field names and meanings): torchtitan 0.3.0 torchtitan/config/configs.py (ParallelismConfig,
TrainingConfig; `expert_parallel_degree`, whose ranks come from dp_shard, cp and tp), config/manager.py
(ConfigManager: `--module`/`--config`, then `--section.field` flags parsed by tyro),
distributed/activation_checkpoint.py (the `activation-checkpoint:none|full|selective` subcommands),
distributed/pipeline_parallel.py (module_fqns_per_model_part, `get_schedule_class`), models/llama3/parallelize.py
(FSDP2 for every data-parallel layout, its MixedPrecisionPolicy for bf16), models/common/decoder.py (tok_embeddings,
layers.N, norm, lm_head); torchtitan 0.2.2 torchtitan/config/job_config.py (the TOML sections,
`expert_parallel_degree`), distributed/parallel_dims.py (efsdp = dp_shard x cp x tp / (etp x ep)), models/llama3/
infra/parallelize.py (DDP only alone: "DDP has not supported > 1D parallelism"; sequence parallelism always with
TP), distributed/utils.py `maybe_enable_amp` (autocast only under DDP or one device), models/llama3/model/model.py
(tok_embeddings, layers.N, norm, output).
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyplan.emit.configs import Notes, PlanShape

__all__ = ["VERSIONS", "render"]

# The release each version option names.
VERSIONS = {"0.3": "torchtitan 0.3.0", "0.2": "torchtitan 0.2.x (0.2.0-0.2.2)"}


def render(shape: PlanShape, version: str) -> tuple[str, Notes]:
    """The plan as torchtitan `version`'s configuration ("0.3": flags after `--module llama3 --config NAME`;
    "0.2": a TOML job file), and the notes; what it cannot express is refused."""
    dec = shape.built_decoder("torchtitan", ("llama",))
    lay, workload = shape.layout, shape.doc.workload
    notes: Notes = []

    # Data parallelism: torchtitan shards with FSDP2 (data_parallel_shard_degree) or replicates
    # (data_parallel_replicate_degree); it has no ZeRO-1.
    if lay.dp > 1 and lay.zero_stage == 1:
        raise shape.cannot(
            "ZeRO-1 (optimizer state sharded, every gradient kept; torchtitan replicates or shards with FSDP)",
            "--zero 0 or --zero 3",
        )
    replicate, shard = (1, lay.dp) if lay.zero_stage == 3 else (lay.dp, 1)
    if version == "0.2" and replicate > 1 and (lay.pp > 1 or lay.tp > 1):
        raise shape.cannot(
            "ZeRO-0 beside pipeline or tensor parallelism (torchtitan 0.2's DDP runs alone)",
            "--dp 1, or --pp 1 --zero 3" if lay.pp > 1 else "--zero 3",
        )
    if version == "0.3" and replicate > 1:
        notes.append(
            "torchtitan 0.3 replicates with FSDP2 over a mesh whose shard dimension is 1 (HSDP), not DDP: the same "
            "whole state on every replica and the same gradient all-reduce"
        )

    # Precision: torchtitan's mixed precision is bf16 compute over fp32 weights (fully_shard's MixedPrecisionPolicy,
    # or in 0.2 autocast under DDP and on one device); it has neither fp16 nor fp32 master weights beside bf16 ones.
    if workload.precision == "fp16-mixed":
        raise shape.cannot("fp16 mixed precision (its mixed precision is bf16)", "--precision bf16-mixed")
    if workload.precision in ("bf16-master", "bf16-master-bf16-grads"):
        raise shape.cannot(
            f"{workload.precision} (bf16 weights beside fp32 master weights; torchtitan computes in bf16 over fp32 "
            "weights)",
            "--precision bf16-mixed",
        )
    bf16 = workload.precision == "bf16-mixed"
    if version == "0.2" and bf16 and shard == 1 and (lay.pp > 1 or lay.tp > 1):
        raise shape.cannot(
            "bf16 beside pipeline or tensor parallelism without FSDP (torchtitan 0.2 then turns mixed precision off)",
            "--precision fp32",
        )

    # Tensor parallelism: torchtitan splits Llama with its own plan; the plan's must be that plan.
    if lay.tp > 1:
        _check_tp(shape, version)
    if lay.ep > 1:
        notes += _check_ep(shape, shard)

    # The batch: torchtitan's local batch is one replica's share per optimizer step and gradient-accumulation step;
    # under a pipeline it is split into micro-batches, else torchtitan accumulates global / (local x dp) steps.
    local = lay.micro_batch_size * (lay.num_microbatches if lay.pp > 1 else 1)
    head = "lm_head" if version == "0.3" else "output"
    parts = [[_name(u, head) for u in units] for units in shape.stages] if lay.pp > 1 else []
    if lay.pp > 1:
        _check_stages(shape)

    kind = shape.remat_kind()
    if "offload" in shape.layer_remat:
        raise shape.cannot("activations offloaded to the host (torchtitan has no offloading)", "--offload none")
    if kind == "mixed":
        raise shape.cannot(
            "a plan that recomputes some layers and keeps others (torchtitan recomputes every layer alike)",
            "--remat full, --remat selective or --remat none",
        )
    notes += shape.remat_notes("torchtitan")

    if version == "0.3":
        return _flags(shape, dec.n_layers, replicate, shard, local, parts, kind), notes
    return _toml(shape, dec.n_layers, replicate, shard, local, parts, kind), notes


def _name(unit: str, head: str) -> str:
    """A unit in torchtitan's Llama names."""
    if unit.startswith("L"):
        return f"layers.{unit[1:]}"
    return {"E": "tok_embeddings", "N": "norm", "H": head}[unit]


def _check_tp(shape: PlanShape, version: str) -> None:
    """torchtitan's Llama split (its llama3 `apply_tp` / sharding.py): every layer's attention and feed-forward, the
    embedding (vocabulary-parallel) and the output; 0.2 always with sequence parallelism."""
    dec = shape.decoder
    assert dec is not None
    lay = shape.layout
    if version == "0.2" and not lay.sequence_parallel:
        raise shape.cannot(
            "tensor parallelism without sequence parallelism (torchtitan 0.2 always splits the norms' tokens)",
            "--sp on",
        )
    expected = dec.tp_plan()
    if lay.tp_plan != expected:
        differ = sorted(set(expected.items()) ^ set(lay.tp_plan.items()))
        first = differ[0][0]
        how = f"splits {first} as {lay.tp_plan[first]}" if first in lay.tp_plan else f"leaves {first} whole"
        raise shape.cannot(
            f"a tensor-parallel plan other than its own Llama split (this plan {how})", "--tp 1, or no --tp-plan"
        )


def _check_ep(shape: PlanShape, shard: int) -> Notes:
    """torchtitan takes the expert-parallel ranks from the FSDP-sharded data-parallel dimension (with tensor
    parallelism's): 0.3's ParallelismConfig.expert_parallel_degree, "EP borrows ranks from FSDP and TP: efsdp =
    dp_shard * cp * tp / ep", and 0.2.2's ParallelDims, efsdp = dp_shard * cp * tp / (etp * ep); replicated
    replicas (dp_replicate, pyplan's ZeRO 0 and 1) lend none. Its llama3 has no mixture-of-experts layers."""
    lay = shape.layout
    if (shard * lay.tp) % lay.ep:
        raise shape.cannot(
            f"expert parallelism {lay.ep} over replicated data parallelism (torchtitan takes the expert-parallel ranks "
            f"from the FSDP-sharded dimension: data_parallel_shard_degree {shard} x tensor_parallel_degree {lay.tp} "
            f"must be a multiple of {lay.ep})",
            "--ep 1",
        )
    return [
        f"torchtitan's llama3 has no mixture-of-experts layers: expert_parallel_degree {lay.ep} splits experts only "
        "in its MoE models (deepseek_v3, qwen3, gpt_oss), which pyplan does not map"
    ]


def _check_stages(shape: PlanShape) -> None:
    """torchtitan's stages are whole modules, each stage's modules consecutive."""
    if shape.inside:
        raise shape.cannot(
            f"a stage that starts inside {shape.unit_name(shape.inside)} (torchtitan splits the model at modules)",
            "--cuts at the blocks where layers start (pyplan inspect numbers the blocks)",
        )


def _flags(
    shape: PlanShape, n_layers: int, replicate: int, shard: int, local: int, parts: list[list[str]], kind: str
) -> str:
    """torchtitan 0.3's command-line overrides, one a line, after a comment header."""
    lay = shape.layout
    flags: list[tuple[str, str | None]] = [
        ("--parallelism.data_parallel_replicate_degree", str(replicate)),
        ("--parallelism.data_parallel_shard_degree", str(shard)),
        ("--parallelism.tensor_parallel_degree", str(lay.tp)),
    ]
    if lay.ep > 1:
        flags.append(("--parallelism.expert_parallel_degree", str(lay.ep)))
    if lay.tp > 1:
        flags.append(
            (
                "--parallelism.enable_sequence_parallel"
                if lay.sequence_parallel
                else "--parallelism.no-enable-sequence-parallel",
                None,
            )
        )
    flags.append(("--parallelism.pipeline_parallel_degree", str(lay.pp)))
    if lay.pp > 1:
        flags += [
            ("--parallelism.pipeline_parallel_schedule", lay.schedule),
            ("--parallelism.pipeline_parallel_microbatch_size", str(lay.micro_batch_size)),
            # A list of lists: one argument per stage, its modules joined by commas (ConfigManager's list[str] rule).
            ("--parallelism.module_fqns_per_model_part", " ".join(",".join(p) for p in parts)),
            # CUDA graphs refuse pipeline parallelism (Trainer.Config._validate_cuda_graphs).
            ("--training.disable_cuda_graphs", None),
        ]
    flags += [
        ("--training.local_batch_size", str(local)),
        ("--training.global_batch_size", str(shape.doc.workload.global_batch)),
        ("--training.mixed_precision_param", "bfloat16" if shape.doc.workload.precision == "bf16-mixed" else "float32"),
    ]
    lines = [
        f"# {VERSIONS['0.3']} arguments from pyplan's plan of {shape.model_name},",
        f"# after `--module llama3 --config NAME` (a Llama of {n_layers} layers). Launch with {shape.gpus} GPUs:",
        f"#   source THIS_FILE; torchrun --nproc-per-node {shape.gpus} -m torchtitan.train --module llama3 "
        '--config NAME "${PYPLAN_TORCHTITAN_ARGS[@]}"',
        "PYPLAN_TORCHTITAN_ARGS=(",
    ]
    for flag, value in flags:
        if value is None:
            lines.append(f"  {flag}")
        elif flag.endswith("module_fqns_per_model_part"):
            lines.append(f"  {flag} {value}")
        else:
            lines.append(f"  {flag} {shlex.quote(value)}")
    # The activation-checkpointing policy is a tyro subcommand; it comes last.
    lines += [f"  activation-checkpoint:{kind}", ")"]
    return "\n".join(lines) + "\n"


def _toml(
    shape: PlanShape, n_layers: int, replicate: int, shard: int, local: int, parts: list[list[str]], kind: str
) -> str:
    """torchtitan 0.2's TOML job file (`--job.config_file`)."""
    lay = shape.layout
    lines = [
        f"# {VERSIONS['0.2']} job configuration from pyplan's plan of {shape.model_name}, for [model] name = "
        f'"llama3" with a flavor of {n_layers} layers.',
        f"# Launch with {shape.gpus} GPUs: torchrun --nproc-per-node {shape.gpus} -m torchtitan.train "
        "--job.config_file THIS_FILE",
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f"tensor_parallel_degree = {lay.tp}",
        *([f"expert_parallel_degree = {lay.ep}"] if lay.ep > 1 else []),
        f"pipeline_parallel_degree = {lay.pp}",
    ]
    if lay.pp > 1:
        lines += [
            f'pipeline_parallel_schedule = "{lay.schedule}"',
            f"pipeline_parallel_microbatch_size = {lay.micro_batch_size}",
            f"module_fqns_per_model_part = {json.dumps(parts)}",
        ]
    lines += [
        "",
        "[training]",
        f"local_batch_size = {local}",
        f"global_batch_size = {shape.doc.workload.global_batch}",
        f'mixed_precision_param = "{"bfloat16" if shape.doc.workload.precision == "bf16-mixed" else "float32"}"',
        "",
        "[activation_checkpoint]",
        f'mode = "{kind}"',
    ]
    if kind == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"
