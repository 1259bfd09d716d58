"""`--format torchtitan`: torchtitan 0.3's arguments read by torchtitan's own ConfigManager (tyro and its rules) into
its own config sections, then into its ParallelDims, schedule lookup and stage placement; the 0.2 line's TOML
against that release's JobConfig (its own parser when 0.2 is installed)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import pytest

from pyplan.emit.configs import render_config
from tests.emit.test_configs_plans import Plans, plans, refusal

__all__ = ["plans"]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchtitan's imports warn about optional packages
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    from torchtitan.config import ConfigManager
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping


@dataclass(kw_only=True, slots=True)
class Sections:
    """The sections of torchtitan 0.3's Trainer.Config the emitted arguments set (the whole Trainer.Config needs the
    model registry, whose Llama imports triton); `hf_assets_path` is what ConfigManager checks after parsing."""

    hf_assets_path: str = "."
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)


def sections() -> Sections:
    """The config_registry function ConfigManager calls for `--module <this module> --config sections`."""
    return Sections()


def parse_03(text: str) -> Any:
    """The arguments of the emitted bash array, parsed by torchtitan 0.3's ConfigManager."""
    body = re.search(r"PYPLAN_TORCHTITAN_ARGS=\((.*?)\n\)", text, re.S)
    assert body is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ConfigManager().parse_args(["--module", __name__, "--config", "sections", *shlex.split(body.group(1))])


def test_a_pipeline_lands_in_parallel_dims_and_the_schedule(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """Two stages: the degrees in ParallelDims, the split in torchtitan 0.3's names (lm_head), the schedule
    torch's lookup finds, local batch = the replica's micro-batches, full recomputation with its notes."""
    doc = plans.doc("pipeline")
    capsys.readouterr()
    lay = doc.plan.layout
    text, notes = render_config(doc, "torchtitan")
    assert text.startswith("# torchtitan 0.3.0 arguments") and "--nproc-per-node 2" in text
    cfg = parse_03(text)
    par, train = cfg.parallelism, cfg.training
    dims = ParallelDims.from_config(par, world_size=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (1, 1, 1, 2) and not dims.fsdp_enabled
    assert get_schedule_class(par.pipeline_parallel_schedule).__name__ == "Schedule1F1B"
    assert par.module_fqns_per_model_part == [
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"],
        ["layers.4", "layers.5", "layers.6", "layers.7", "norm", "lm_head"],
    ]
    assert par.pipeline_parallel_microbatch_size == lay.micro_batch_size == 4
    # torchtitan splits the local batch into micro-batches and accumulates global / (local x dp) steps: here 1.
    assert train.local_batch_size == 16 and train.global_batch_size == 16 and train.disable_cuda_graphs
    assert train.mixed_precision_param == "float32"
    assert type(cfg.activation_checkpoint) is FullAC.Config
    assert notes == [
        "torchtitan recomputes every layer, also layers.3, which end a stage and whose activations the plan keeps "
        "there: one more layer's forward per micro-batch, and less memory",
        "torchtitan recomputes layers only: it keeps the activations of norm, which the plan recomputes (their "
        "inputs per micro-batch in flight)",
    ]


def test_interleaved_stages_sit_on_the_ranks_the_plan_puts_them(
    plans: Plans, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four stages on two ranks: torchtitan places stage s on rank s mod 2, as torch's schedule and the plan do."""
    doc = plans.doc("interleaved")
    capsys.readouterr()
    cfg = parse_03(render_config(doc, "torchtitan")[0])
    par = cfg.parallelism
    assert issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleMulti)
    parts = par.module_fqns_per_model_part
    assert [p[-1] for p in parts] == ["layers.1", "layers.3", "layers.5", "lm_head"]
    assert [
        _get_pp_rank_to_stage_indices_mapping(r, 2, par.pipeline_parallel_schedule, len(parts)) for r in (0, 1)
    ] == [
        (0, 2),
        (1, 3),
    ]
    assert cfg.activation_checkpoint is None  # activation-checkpoint:none
    assert (
        cfg.training.local_batch_size == 16
        and cfg.training.local_batch_size % par.pipeline_parallel_microbatch_size == 0
    )


def test_three_interleaved_stages_a_rank(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """Six stages on two ranks: torchtitan places stage s on rank s mod 2, three a rank, as the plan does."""
    doc = plans.doc("interleaved3")
    capsys.readouterr()
    par = parse_03(render_config(doc, "torchtitan")[0]).parallelism
    parts = par.module_fqns_per_model_part
    assert [p[-1] for p in parts] == ["layers.0", "layers.1", "layers.3", "layers.4", "layers.6", "lm_head"]
    assert [
        _get_pp_rank_to_stage_indices_mapping(r, 2, par.pipeline_parallel_schedule, len(parts)) for r in (0, 1)
    ] == [(0, 2, 4), (1, 3, 5)]


def test_fsdp_with_tensor_parallelism_and_selective_checkpointing(
    plans: Plans, capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-3 is FSDP over dp with bf16 parameters, tp with sequence parallelism, gradient accumulation by the
    batch arithmetic; torchtitan's op policy where the plan checkpoints selectively."""
    doc = plans.doc("tensor")
    capsys.readouterr()
    lay = doc.plan.layout
    cfg = parse_03(render_config(doc, "torchtitan")[0])
    dims = ParallelDims.from_config(cfg.parallelism, world_size=4)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (1, 2, 2, 1) and dims.fsdp_enabled
    assert cfg.parallelism.enable_sequence_parallel is lay.sequence_parallel is True
    assert cfg.training.mixed_precision_param == "bfloat16"
    accumulation = cfg.training.global_batch_size // (cfg.training.local_batch_size * 2)
    assert (cfg.training.local_batch_size, accumulation) == (lay.micro_batch_size, lay.num_microbatches)
    without_sp = parse_03(render_config(plans.doc("tensor", sequence_parallel=False), "torchtitan")[0])
    assert without_sp.parallelism.enable_sequence_parallel is False

    selective = parse_03(render_config(plans.doc("selective"), "torchtitan")[0])
    assert type(selective.activation_checkpoint) is SelectiveAC.Config


def test_what_torchtitan_cannot_express(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-1, fp16, fp32 master weights, another TP plan, recomputing some layers and not others: one line each.
    ZeRO-0 replicas are FSDP2 with a shard dimension of 1 in 0.3 (a note)."""
    zero1 = plans.doc("replicas", precision="bf16-mixed")
    capsys.readouterr()
    assert refusal(lambda: render_config(zero1, "torchtitan")) == (
        "--format torchtitan cannot express ZeRO-1 (optimizer state sharded, every gradient kept; torchtitan "
        "replicates or shards with FSDP): plan with --zero 0 or --zero 3"
    )
    replicas = plans.doc("replicas", precision="bf16-mixed", zero_stage=0)
    cfg = parse_03(render_config(replicas, "torchtitan")[0])
    dims = ParallelDims.from_config(cfg.parallelism, world_size=4)
    assert (dims.dp_replicate, dims.dp_shard) == (4, 1) and not dims.fsdp_enabled
    assert any("replicates with FSDP2" in n for n in render_config(replicas, "torchtitan")[1])
    master = plans.doc("replicas", zero_stage=0)
    assert refusal(lambda: render_config(master, "torchtitan")).endswith("plan with --precision bf16-mixed")
    fp16 = plans.doc("tensor", precision="fp16-mixed")
    assert "fp16 mixed precision" in refusal(lambda: render_config(fp16, "torchtitan"))
    data = plans.json("tensor")
    plan = dict(data["plan"]["tp_plan"])
    del plan["output"]
    other = plans.doc("tensor", tp_plan=plan)
    assert refusal(lambda: render_config(other, "torchtitan")) == (
        "--format torchtitan cannot express a tensor-parallel plan other than its own Llama split (this plan leaves "
        "output whole): plan with --tp 1, or no --tp-plan"
    )
    # The first stage's remat plan keeps every block: layers 0-3 kept, layers 4-7 recomputed.
    remat = plans.json("pipeline")["plan"]["remat"]
    remat[0]["plan"] = [["keep", b] for b in range(len(remat[0]["positions"]) - 1)]
    mixed = plans.doc("pipeline", remat=remat)
    assert refusal(lambda: render_config(mixed, "torchtitan")) == (
        "--format torchtitan cannot express a plan that recomputes some layers and keeps others (torchtitan "
        "recomputes every layer alike): plan with --remat full, --remat selective or --remat none"
    )


# torchtitan 0.2.2 torchtitan/config/job_config.py: the fields of the sections the TOML sets.
JOB_CONFIG_02 = {
    "parallelism": {
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
        "fsdp_reshard_after_forward",
        "tensor_parallel_degree",
        "disable_loss_parallel",
        "enable_async_tensor_parallel",
        "pipeline_parallel_degree",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_degree",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    },
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "mixed_precision_reduce"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
}


def _toml_02(text: str, tmp_path: Any) -> dict[str, Any]:
    """The TOML as torchtitan 0.2 reads it: its own ConfigManager where 0.2 is installed, else tomllib and the
    fields of 0.2.2's JobConfig (0.2 rejects a field it does not know: 'Invalid field names')."""
    values = tomllib.loads(text)
    for section, keys in values.items():
        assert set(keys) <= JOB_CONFIG_02[section], (section, set(keys) - JOB_CONFIG_02[section])
    if importlib.metadata.version("torchtitan").startswith("0.2."):
        path = tmp_path / "job.toml"
        path.write_text(text)
        job = ConfigManager().parse_args(["--job.config_file", str(path)])
        return {s: {f.name: getattr(getattr(job, s), f.name) for f in fields(getattr(job, s))} for s in values}
    return values


def test_the_02_line_toml(plans: Plans, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """0.2: module_fqns_per_model_part with `output`, DDP only alone, bf16 only under FSDP or DDP alone, sequence
    parallelism always with TP."""
    doc = plans.doc("pipeline")
    capsys.readouterr()
    job = _toml_02(render_config(doc, "torchtitan", torchtitan_version="0.2")[0], tmp_path)
    assert job["parallelism"]["module_fqns_per_model_part"][1][-2:] == ["norm", "output"]
    assert job["parallelism"]["pipeline_parallel_schedule"] == "1F1B" and job["activation_checkpoint"]["mode"] == "full"
    selective = _toml_02(render_config(plans.doc("selective"), "torchtitan", torchtitan_version="0.2")[0], tmp_path)
    assert selective["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    tensor = _toml_02(render_config(plans.doc("tensor"), "torchtitan", torchtitan_version="0.2")[0], tmp_path)
    assert (
        tensor["parallelism"]["data_parallel_shard_degree"] == 2
        and tensor["parallelism"]["tensor_parallel_degree"] == 2
    )

    ddp_tp = plans.doc("tensor", zero_stage=0, precision="fp32")
    assert refusal(lambda: render_config(ddp_tp, "torchtitan", torchtitan_version="0.2")) == (
        "--format torchtitan cannot express ZeRO-0 beside pipeline or tensor parallelism (torchtitan 0.2's DDP runs "
        "alone): plan with --zero 3"
    )
    bf16_pp = plans.doc("pipeline", precision="bf16-mixed")
    assert refusal(lambda: render_config(bf16_pp, "torchtitan", torchtitan_version="0.2")).endswith(
        "(torchtitan 0.2 then turns mixed precision off): plan with --precision fp32"
    )
    no_sp = plans.doc("tensor", sequence_parallel=False)
    assert refusal(lambda: render_config(no_sp, "torchtitan", torchtitan_version="0.2")).endswith("plan with --sp on")


def test_expert_parallelism_borrows_the_sharded_ranks(
    plans: Plans, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """expert_parallel_degree over FSDP-sharded replicas, as torchtitan's ParallelDims takes it (0.3 flags, 0.2
    TOML); over replicated ones (ZeRO 0, which pyplan's expert parallelism runs with) torchtitan has no ranks to
    borrow: one line."""
    sharded = plans.doc("replicas", precision="bf16-mixed", zero_stage=3, ep=2)
    capsys.readouterr()
    text, notes = render_config(sharded, "torchtitan")
    cfg = parse_03(text)
    dims = ParallelDims.from_config(cfg.parallelism, world_size=4)
    assert cfg.parallelism.expert_parallel_degree == 2 and (dims.dp_shard, dims.ep) == (4, 2) and dims.ep_enabled
    assert notes[-1].startswith("torchtitan's llama3 has no mixture-of-experts layers: expert_parallel_degree 2")
    job = _toml_02(render_config(sharded, "torchtitan", torchtitan_version="0.2")[0], tmp_path)
    assert job["parallelism"]["expert_parallel_degree"] == 2
    assert "expert_parallel_degree" not in render_config(plans.doc("tensor"), "torchtitan")[0]
    replicated = plans.doc("replicas", precision="bf16-mixed", zero_stage=0, ep=2)
    assert refusal(lambda: render_config(replicated, "torchtitan")) == (
        "--format torchtitan cannot express expert parallelism 2 over replicated data parallelism (torchtitan takes "
        "the expert-parallel ranks from the FSDP-sharded dimension: data_parallel_shard_degree 1 x "
        "tensor_parallel_degree 1 must be a multiple of 2): plan with --ep 1"
    )
