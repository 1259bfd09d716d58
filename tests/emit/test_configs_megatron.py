"""`--format megatron`: the arguments checked against Megatron-LM's own rules, as read in its `main` branch
(megatron/training/arguments.py, core/transformer/pipeline_parallel_layer_layout.py and core/recompute.py at
d98e8a64ddf3, pyplan/emit/megatron.py's COMMIT). Megatron-LM is not a package that installs here (its training code
needs Python 3.12 and triton), so this file restates what its parser and `validate_args` do with these flags: the
names and their values, the combinations it refuses, the data-parallel size and micro-batches it derives, and the
layers each pipeline rank builds from the layout."""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass

import pytest

from pyplan.emit.configs import plan_shape, render_config
from pyplan.emit.megatron import COMMIT
from pyplan.emit.planfile import PlanFile
from tests.emit.test_configs_plans import Plans, plans, refusal

__all__ = ["plans"]


def _parser() -> argparse.ArgumentParser:
    """The flags pyplan writes, as arguments.py declares them (a store_true flag, or its value's type and choices)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in (
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--expert-model-parallel-size",
        "--num-layers",
    ):
        p.add_argument(flag, type=int, default=1 if "size" in flag else None)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--pipeline-model-parallel-layout", type=str)
    p.add_argument("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"])
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int)
    for flag in (
        "--sequence-parallel",
        "--untie-embeddings-and-output-weights",
        "--use-distributed-optimizer",
        "--use-torch-fsdp2",
        "--bf16",
        "--fp16",
        "--grad-reduce-in-bf16",
    ):
        p.add_argument(flag, action="store_true")
    # Stored as gradient_accumulation_fusion=False; on by default.
    p.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    return p


@dataclass
class Megatron:
    """What Megatron derives from the arguments: the data-parallel size, micro-batches per step, the virtual
    pipeline size and each (pipeline rank, virtual stage)'s layer count, whether gradients are reduced in fp32, and
    the experts' data-parallel size (the ranks holding the same experts)."""

    args: argparse.Namespace
    dp: int
    microbatches: int
    vpp: int
    layers: list[list[int]]
    grads_in_fp32: bool
    expert_dp: int = 1


def _layout(text: str) -> list[list[str]]:
    """PipelineParallelLayerLayout.parse_str_to_list: cosmetic commas dropped, (...)*n and x*n unrolled, "|"
    between stages."""
    text = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return [list(stage) for stage in text.split("|")]


def megatron(text: str) -> Megatron:
    """The emitted arguments parsed and validated as Megatron-LM main does (validate_args' checks of these flags)."""
    body = re.search(r"PYPLAN_MEGATRON_ARGS=\((.*?)\n\)", text, re.S)
    world = re.search(r"--nproc-per-node (\d+)", text)
    assert body is not None and world is not None
    a = _parser().parse_args(shlex.split(body.group(1)))
    world_size = int(world.group(1))
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    assert world_size % (tp * pp) == 0, "world size is not divisible by total_model_size"
    dp = world_size // (tp * pp)
    # The micro-batch calculator: the global batch over micro-batch x dp.
    assert a.global_batch_size % (a.micro_batch_size * dp) == 0
    microbatches = a.global_batch_size // (a.micro_batch_size * dp)
    if a.use_torch_fsdp2:
        assert pp == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism"
        assert not a.use_distributed_optimizer, "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"
        assert not a.gradient_accumulation_fusion, (
            "--use-torch-fsdp2 is not supported with gradient accumulation fusion"
        )
        assert a.ckpt_format in ("torch_dist", "torch_dcp"), "--use-torch-fsdp2 requires --ckpt-format torch_dist"
        assert a.untie_embeddings_and_output_weights, "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"
        assert not a.fp16
    vpp, layers = 1, [[a.num_layers]]
    if a.pipeline_model_parallel_layout is not None:
        stages = _layout(a.pipeline_model_parallel_layout)
        assert len(stages) % pp == 0
        vpp = len(stages) // pp
        flat = [c for s in stages for c in s]
        # validate_layer_layout: embedding first, loss last, each once, every decoder layer placed.
        assert flat[0] == "E" and flat[-1] == "L" and flat.count("E") == flat.count("L") == 1
        assert flat.count("t") == a.num_layers
        # Stage vpp_rank x pp + pp_rank is pipeline rank pp_rank's virtual stage vpp_rank.
        layers = [[stages[v * pp + r].count("t") for v in range(vpp)] for r in range(pp)]
        if vpp > 1:
            # schedules.py: micro-batches in groups of pp, no last group smaller than pp.
            assert microbatches >= pp and not 0 < microbatches % pp < pp
    elif pp > 1:
        assert a.num_layers % pp == 0, "Number of layers should be divisible by the pipeline-model-parallel size"
        layers = [[a.num_layers // pp] for _ in range(pp)]
    if a.recompute_granularity == "selective":
        assert a.recompute_method is None and a.recompute_num_layers is None
    elif a.recompute_granularity == "full":
        assert a.recompute_method is not None and a.recompute_num_layers is not None
    if a.sequence_parallel:
        assert tp > 1
    grads_in_fp32 = a.bf16 and not a.grad_reduce_in_bf16
    # parallel_state.initialize_model_parallel: the experts' grid, expert tp (= tp) x ep x pp x expert dp, covers
    # the world; validate_args: FSDP2 refuses expert parallelism.
    ep = a.expert_model_parallel_size
    assert world_size % (tp * ep * pp) == 0, "world_size is not divisible by expert_tensor_model_pipeline_parallel size"
    if ep > 1:
        assert not a.use_torch_fsdp2, "--use-torch-fsdp2 is not supported with expert parallelism"
    return Megatron(a, dp, microbatches, vpp, layers, grads_in_fp32, world_size // (tp * ep * pp))


def _stage_layers(doc: PlanFile) -> list[int]:
    return [sum(u.startswith("L") for u in units) for units in plan_shape(doc, "megatron").stages]


def test_a_pipeline_with_its_boundaries_and_recomputation(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """The layout puts the plan's layers on each rank; micro-batches = GA; bf16 weights with fp32 gradients;
    every layer recomputed, the notes saying where Megatron differs."""
    doc = plans.doc("pipeline", precision="bf16-master")
    capsys.readouterr()
    lay = doc.plan.layout
    text, notes = render_config(doc, "megatron")
    assert f"arguments.py at {COMMIT[:12]}" in text
    m = megatron(text)
    assert (m.dp, m.microbatches, m.vpp) == (1, lay.num_microbatches, 1)
    assert m.args.pipeline_model_parallel_layout == "Etttt|ttttL"
    assert [r[0] for r in m.layers] == _stage_layers(doc) == [4, 4]
    assert m.args.bf16 and m.grads_in_fp32 and m.args.untie_embeddings_and_output_weights
    recompute = (m.args.recompute_granularity, m.args.recompute_method, m.args.recompute_num_layers)
    assert recompute == ("full", "uniform", 1)
    assert [n.split(":")[0] for n in notes] == [
        "Megatron recomputes every layer, also layers.3, which end a stage and whose activations the plan keeps there",
        "Megatron recomputes layers only",
    ]

    # Layers 0-1 and 4-5 recomputed, each stage's other layers kept: the block method, k = 2.
    remat = plans.json("pipeline")["plan"]["remat"]
    first = [["keep", 0], *[["checkpoint", [["keep", b]]] for b in range(1, 13)]]
    remat[0]["plan"] = first + [["keep", b] for b in range(13, len(remat[0]["positions"]) - 1)]
    remat[1]["plan"] = [["checkpoint", [["keep", b]]] for b in range(12)]
    remat[1]["plan"] += [["keep", b] for b in range(12, len(remat[1]["positions"]) - 1)]
    block = megatron(render_config(plans.doc("pipeline", remat=remat), "megatron")[0])
    assert (block.args.recompute_method, block.args.recompute_num_layers) == ("block", 2)


def test_interleaved_stages_and_the_micro_batch_groups(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """Four stages on two ranks: virtual pipeline size 2, rank r holding stages r and r + 2 as the plan does; a
    micro-batch count that is not a multiple of pp is refused."""
    doc = plans.doc("interleaved")
    capsys.readouterr()
    m = megatron(render_config(doc, "megatron")[0])
    assert m.args.pipeline_model_parallel_layout == "Ett|tt|tt|ttL" and m.vpp == 2
    stages = _stage_layers(doc)
    assert m.layers == [[stages[0], stages[2]], [stages[1], stages[3]]] == [[2, 2], [2, 2]]
    odd = plans.doc("interleaved", num_microbatches=3, global_batch=12)
    assert refusal(lambda: render_config(odd, "megatron")) == (
        "--format megatron cannot express 3 micro-batches on the interleaved schedule (Megatron runs them in groups "
        "of pp = 2): plan with --ga 4"
    )
    gpipe = plans.doc("pipeline", schedule="GPipe")
    assert refusal(lambda: render_config(gpipe, "megatron")).endswith("plan with --schedule 1F1B")


def test_three_interleaved_stages_a_rank(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """Six stages on two ranks, of one or two layers each: virtual pipeline size 3 from the layout, rank r holding
    stages r, r + 2 and r + 4 as the plan does."""
    doc = plans.doc("interleaved3")
    capsys.readouterr()
    assert doc.plan.layout.stages_per_rank == 3
    m = megatron(render_config(doc, "megatron")[0])
    assert m.args.pipeline_model_parallel_layout == "Et|t|tt|t|tt|tL" and m.vpp == 3
    stages = _stage_layers(doc)
    assert m.layers == [[stages[0], stages[2], stages[4]], [stages[1], stages[3], stages[5]]] == [[1, 2, 2], [1, 1, 1]]


def test_data_and_tensor_parallelism(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """ZeRO-3 is torch FSDP2 with what validate_args requires beside it; ZeRO-1 the distributed optimizer; tp with
    sequence parallelism; bf16 gradients with --grad-reduce-in-bf16."""
    fsdp = plans.doc("tensor", precision="fp32")
    capsys.readouterr()
    m = megatron(render_config(fsdp, "megatron")[0])
    assert (m.dp, m.args.tensor_model_parallel_size, m.args.sequence_parallel) == (2, 2, True)
    assert m.args.use_torch_fsdp2 and m.microbatches == fsdp.plan.layout.num_microbatches

    zero1 = megatron(render_config(plans.doc("replicas"), "megatron")[0])
    assert zero1.dp == 4 and zero1.args.use_distributed_optimizer and zero1.grads_in_fp32
    bf16_grads = megatron(render_config(plans.doc("replicas", precision="bf16-master-bf16-grads"), "megatron")[0])
    assert bf16_grads.args.bf16 and not bf16_grads.grads_in_fp32

    plan = dict(plans.json("tensor")["plan"]["tp_plan"])
    del plan["output"]
    _, notes = render_config(plans.doc("tensor", precision="fp32", tp_plan=plan), "megatron")
    assert notes == [
        "Megatron splits output over the vocabulary, which the plan keeps whole on every tensor-parallel rank: less "
        "memory than the plan counts"
    ]
    del plan["layers.3.attention.wo"]
    assert refusal(lambda: render_config(plans.doc("tensor", precision="fp32", tp_plan=plan), "megatron")) == (
        "--format megatron cannot express a tensor-parallel plan other than its own (this plan leaves "
        "layers.3.attention.wo whole): plan with --tp 1, or no --tp-plan"
    )


def test_gpt2_and_what_megatron_cannot_express(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 is Megatron's default GPT (tied embeddings: no FSDP2); autocast precisions and selective
    recomputation as pyplan prices it are refused in one line."""
    gpt = plans.doc("gpt", precision="fp32")
    capsys.readouterr()
    text, _ = render_config(gpt, "megatron")
    assert "--position-embedding-type learned_absolute" in text
    m = megatron(text)
    assert m.dp == 2 and not m.args.untie_embeddings_and_output_weights
    tied = plans.doc("gpt", precision="fp32", zero_stage=3)
    assert refusal(lambda: render_config(tied, "megatron")).endswith("plan with --zero 1")
    expected = [
        (
            plans.doc("gpt"),
            "--format megatron cannot express bf16-mixed (autocast over fp32 weights; Megatron's --bf16 keeps bf16 "
            "weights beside fp32 master weights): plan with --precision bf16-master",
        ),
        (
            plans.doc("selective", precision="fp32"),
            "--format megatron cannot express selective recomputation as the plan prices it (torchtitan's op policy; "
            "Megatron recomputes named submodules): plan with --remat full or --remat none",
        ),
    ]
    for doc, message in expected:
        assert refusal(lambda doc=doc: render_config(doc, "megatron")) == message


def test_expert_parallelism_out_of_the_data_parallel_ranks(plans: Plans, capsys: pytest.CaptureFixture[str]) -> None:
    """--expert-model-parallel-size E: the experts' grid carved out of the dp ranks (E x expert dp = dp), beside
    DDP or the distributed optimizer; the model's own flags must name its experts; FSDP2 refuses it."""
    doc = plans.doc("replicas", ep=2)
    capsys.readouterr()
    text, notes = render_config(doc, "megatron")
    m = megatron(text)
    assert (m.dp, m.args.expert_model_parallel_size, m.expert_dp) == (4, 2, 2) and m.args.use_distributed_optimizer
    assert notes == [
        "Megatron splits the experts only with --num-experts among the model's flags (a multiple of 2), with the "
        "layers' MoE flags (--moe-router-topk, --moe-ffn-hidden-size, ...)"
    ]
    assert "--expert-model-parallel-size" not in render_config(plans.doc("replicas"), "megatron")[0]
    assert refusal(lambda: render_config(plans.doc("tensor", precision="fp32", ep=2), "megatron")) == (
        "--format megatron cannot express expert parallelism 2 beside ZeRO-3 (Megatron's --use-torch-fsdp2 refuses "
        "expert parallelism): plan with --zero 0 or --zero 1"
    )
