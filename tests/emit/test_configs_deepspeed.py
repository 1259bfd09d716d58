"""`--format deepspeed`: the JSON read by DeepSpeed 0.19's own DeepSpeedConfig (its batch arithmetic over the
data-parallel world size, ZeRO, autocast, bf16 and the gradient-accumulation dtype, AutoTP's partition config), and
what it cannot express refused in one line."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from pyplan.emit.configs import render_config
from pyplan.emit.planfile import PlanFile
from tests.emit.test_configs_plans import Plans, plans, refusal

__all__ = ["plans"]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # DeepSpeed's import warns about the accelerator it finds
    import deepspeed.comm
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig


class _Mpu:
    """The model-parallel unit DeepSpeed asks for the data-parallel world size (its config's `world_size`)."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def deepspeed_config(doc: PlanFile, monkeypatch: pytest.MonkeyPatch) -> tuple[DeepSpeedConfig, dict[str, Any]]:
    """The emitted JSON as DeepSpeedConfig reads it on one rank of the plan's data-parallel group."""
    text, notes = render_config(doc, "deepspeed")
    assert not notes
    config = json.loads(text)
    # DeepSpeedConfig takes the world size from the mpu once torch.distributed answers get_rank.
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *args, **kwargs: 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DeepSpeedConfig(config, mpu=_Mpu(doc.plan.layout.dp)), config


def _optimizer(c: DeepSpeedConfig) -> str:
    """The optimizer wrapper DeepSpeedEngine._do_optimizer_sanity_check picks (deepspeed/runtime/engine.py 0.19.8)
    for a ZeRO stage and the weights' and gradient accumulation's dtypes."""
    model = (
        torch.bfloat16 if c.bfloat16_config.enabled else torch.float16 if c.float16_config.enabled else torch.float32
    )
    grads = model if c.grad_accum_dtype is None else {"fp32": torch.float32, "bf16": torch.bfloat16}[c.grad_accum_dtype]
    if c.zero_optimization_stage > 0:
        return (
            "bf16 (fp32 master weights)"
            if (model, grads, c.zero_optimization_stage)
            == (
                torch.bfloat16,
                torch.float32,
                1,
            )
            else "zero"
        )
    if model != grads:
        raise NotImplementedError(f"unsupported mix of {model=} and {grads=}")
    return "none" if model == torch.float32 else "ddp bf16 (no master weights)"


def test_batch_zero_and_precision(
    plans: Plans, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """train_batch_size = micro-batch x GA x dp as DeepSpeed checks it; ZeRO-1 with bf16 weights beside fp32 master
    weights and fp32 (or bf16) gradients; autocast for the mixed precisions."""
    doc = plans.doc("replicas")
    capsys.readouterr()
    lay = doc.plan.layout
    c, raw = deepspeed_config(doc, monkeypatch)
    assert raw["_comment"].startswith("DeepSpeed 0.19 configuration") and c.world_size == lay.dp == 4
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (
        16,
        lay.micro_batch_size,
        lay.num_microbatches,
    )
    assert c.zero_optimization_stage == 1 and _optimizer(c) == "bf16 (fp32 master weights)"
    bf16_grads, _ = deepspeed_config(plans.doc("replicas", precision="bf16-master-bf16-grads"), monkeypatch)
    assert bf16_grads.grad_accum_dtype == "bf16" and _optimizer(bf16_grads) == "zero"
    autocast, _ = deepspeed_config(plans.doc("gpt"), monkeypatch)
    assert autocast.torch_autocast_enabled and autocast.torch_autocast_dtype == torch.bfloat16
    assert autocast.zero_optimization_stage == 0 and _optimizer(autocast) == "none"
    fp16, _ = deepspeed_config(plans.doc("gpt", precision="fp16-mixed"), monkeypatch)
    assert fp16.torch_autocast_dtype == torch.float16 and not fp16.float16_config.enabled

    master0 = plans.doc("replicas", zero_stage=0)
    assert refusal(lambda: render_config(master0, "deepspeed")) == (
        "--format deepspeed cannot express bf16-master without ZeRO-1 (DeepSpeed keeps fp32 master weights beside "
        "bf16 ones in its ZeRO-1 optimizer only): plan with --zero 1, or --precision bf16-mixed"
    )


def test_autotp_with_the_plans_split(
    plans: Plans, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """AutoTP splits exactly the plan's Linears (column or row, by parameter name) and the output head over the
    vocabulary; sequence parallelism and an untied embedding split over the vocabulary are refused."""
    data = plans.json("tensor")
    capsys.readouterr()
    tp_plan = dict(data["plan"]["tp_plan"])
    del tp_plan["tok_embeddings"]
    doc = plans.doc("tensor", sequence_parallel=False, tp_plan=tp_plan)
    c, _ = deepspeed_config(doc, monkeypatch)
    assert c.zero_optimization_stage == 3 and c.world_size == 2 and c.train_batch_size == 16
    tp = c.tensor_parallel_config
    assert tp.autotp_size == 2 and tp.vocab_parallel_lm_head
    spec = tp.get_partition_config_object()
    assert spec.tp_size == 2 and not spec.use_default_specs and spec.lm_head_patterns == ["output"]
    for name, style in tp_plan.items():
        if name == "output":
            continue
        match = spec.find_matching_spec(f"{name}.weight")
        assert match is not None and match.partition_type.value == {"ColwiseParallel": "column"}.get(style, "row")
    assert spec.find_matching_spec("layers.0.attention_norm.weight") is None
    assert spec.find_matching_spec("layers.0.attention.wq.bias") is None

    with_sp = plans.doc("tensor")
    assert refusal(lambda: render_config(with_sp, "deepspeed")).endswith("plan with --sp off")
    untied = plans.doc("tensor", sequence_parallel=False)
    assert refusal(lambda: render_config(untied, "deepspeed")) == (
        "--format deepspeed cannot express splitting the embedding tok_embeddings (DeepSpeed's AutoTP splits an "
        "embedding over the vocabulary only with the output layer tied to it): plan with --tp-plan FILE leaving "
        "tok_embeddings whole, or --tp 1"
    )


def test_pipelines_and_recomputation_are_code_in_deepspeed(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """The configuration holds neither pipeline stages nor which layers recompute: refused, with the pins."""
    pipeline = plans.doc("pipeline")
    capsys.readouterr()
    assert refusal(lambda: render_config(pipeline, "deepspeed")).endswith("plan with --pp 1")
    selective = plans.doc("selective")
    assert refusal(lambda: render_config(selective, "deepspeed")) == (
        "--format deepspeed cannot express recomputation or offloading (the model's code chooses what DeepSpeed "
        "recomputes, deepspeed.checkpointing.checkpoint; its configuration does not): plan with --remat none"
    )


def test_expert_parallelism_is_code_in_deepspeed(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    doc = plans.doc("gpt", ep=2)
    capsys.readouterr()
    assert refusal(lambda: render_config(doc, "deepspeed")) == (
        "--format deepspeed cannot express expert parallelism 2 (DeepSpeed sets the expert-parallel size in the "
        "model's code, deepspeed.moe.layer.MoE(ep_size=...), not in its configuration): plan with --ep 1"
    )
