"""Plans with tensor parallelism: the search over degrees is the best of each degree's search, ZeRO-3 beside it, a
degree that splits nothing is one line, and a tp layout reaches plan.json, `pyplan show`, the config emitters and
the training script."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import pyplan
from pyplan.api import search
from pyplan.cli.main import main
from pyplan.emit.planfile import read_plan_file
from pyplan.errors import PlanError
from pyplan.graph.tensor_parallel import derive_tp_plan, vocab_parallel_loss
from pyplan.hardware import Cluster
from pyplan.load import load_model
from pyplan.plan import Layout, Workload
from pyplan.planner import local_numel, rank_ties
from pyplan.profile.tensor_parallel import collective_bytes
from pyplan.report.gantt import timeline
from pyplan.runtime.units import gathered_bytes
from pyplan.spec import cross_entropy

CLUSTER = Cluster.from_catalog("a100-80g", 8)
WORKLOAD = Workload(global_batch=16, precision="bf16-mixed")


def _gpt():
    spec = load_model("zoo:gpt-tiny")
    with torch.device("meta"):
        return spec, spec.build()


def _objective(p: pyplan.Plan) -> tuple[float, int, float]:
    return (p.predicted.iteration_s, p.layout.num_gpus, p.predicted.peak_memory_bytes)


def test_the_search_over_degrees_is_the_best_of_each_degree() -> None:
    spec, model = _gpt()
    kw = dict(loss=spec.loss, target=spec.target, stage_dag=False, top_k=4)
    every = search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(1, 2, 4), **kw)
    alone = {
        t: search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(t,), chain=every.chain, **kw)
        for t in (1, 2, 4)
    }
    for t, found in alone.items():
        assert {p.layout.tp for p in (found.best, *found.alternatives)} == {t}
        if t > 1:
            assert found.best.layout.tp_plan and set(found.best.layout.tp_plan.values()) == {
                "ColwiseParallel",
                "RowwiseParallel",
            }
    # The ranking of `search`: by time, where times within TIE are ties, fewer GPUs then less memory first.
    merged = rank_ties(
        [p for f in alone.values() for p in (f.best, *f.alternatives)],
        lambda p: p.predicted.iteration_s,
        lambda p: (p.layout.num_gpus, p.predicted.peak_memory_bytes),
    )
    got = [every.best, *every.alternatives]
    assert [_objective(p) for p in got] == [_objective(p) for p in merged[: len(got)]]
    assert every.candidates == sum(f.candidates for f in alone.values())
    # Split layers hold less on each GPU: the same layout with tp 2 keeps the split weights' halves (all of
    # gpt-tiny's but its LayerNorms, row biases and position embedding).
    pins = dict(data_parallel=(4,), pipeline_ranks=(1,), zero_stages=(0,), **kw)
    one, two = (
        search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(t,), chain=every.chain, **pins).best
        for t in (1, 2)
    )
    assert (one.layout.num_gpus, two.layout.num_gpus) == (4, 8)
    assert 0.5 < two.stages[0].state_bytes / one.stages[0].state_bytes < 0.55


def test_zero3_beside_tp_shards_each_ranks_split_tensors() -> None:
    """FSDP + TP: ZeRO-3 is planned at tp 2 (one stage), each rank's model state is its tp-local tensors sharded
    over the replicas, and the units FSDP2 holds gathered are counted at their tp-local sizes: a layer's split
    weights and column biases halved, its norms and row biases whole."""
    spec, model = _gpt()
    kw = dict(loss=spec.loss, target=spec.target, stage_dag=False, top_k=1, data_parallel=(4,), zero_stages=(3,))
    one, two = (search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(t,), **kw).best for t in (1, 2))
    assert (two.layout.tp, two.layout.zero_stage, two.layout.pp, two.layout.dp) == (2, 3, 1, 4)
    assert 0.5 < two.stages[0].state_bytes / one.stages[0].state_bytes < 0.55
    styles = two.layout.tp_plan
    local = local_numel(model, styles, 2)
    layer = dict(model.transformer.h[0].named_parameters(prefix="transformer.h.0"))
    split = [n for n in layer if n.endswith(".weight") and n.rpartition(".")[0] in styles]
    split += [n for n in layer if n.endswith(".bias") and styles.get(n.rpartition(".")[0]) == "ColwiseParallel"]
    assert split and all(local(n) == layer[n].numel() / 2 for n in split)
    assert all(local(n) == p.numel() for n, p in layer.items() if n not in split)
    unit = sum(local(n) for n in layer)
    root = sum(local(n) for n, _ in model.named_parameters() if not n.startswith("transformer.h."))
    assert gathered_bytes(model, 2.0, 4.0, local) == (2 + 4) * root + (2 * 2 + 4) * unit


def test_beside_tp_the_replicas_average_their_gradients_after_the_backward() -> None:
    """DDP takes no DTensors: beside tensor parallelism the runtime all-reduces the replicas' gradients after the
    backward (ZeRO 0 and 1), so the plan exposes that time, where DDP at tp 1 hides it under the backward."""
    spec, model = _gpt()
    kw = dict(loss=spec.loss, target=spec.target, stage_dag=False, top_k=1, data_parallel=(4,), pipeline_ranks=(1,),
              zero_stages=(0,), micro_batch_sizes=(4,))  # fmt: skip
    one, two = (search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(t,), **kw).best for t in (1, 2))
    assert one.predicted.exposed_comm_s == 0 < two.predicted.exposed_comm_s


def test_the_loss_runs_on_each_ranks_slice_of_the_vocabulary() -> None:
    """gpt-tiny's loss is pyplan's cross-entropy over its logits: at tp 2 it runs on each rank's half of the
    vocabulary (torchtitan's loss_parallel), so the last stage keeps half the logits' softmax and the logits are
    never gathered; the same loss as another function (which pyplan cannot split) gathers them. The slice's loss is
    recorded as the runtime computes it (pyplan/runtime/tensor_parallel.py): in fp32, its softmax kept and turned
    into its gradient in place."""
    spec, model = _gpt()
    graph = pyplan.trace(spec.build(), spec.example_inputs, batch_size=2)
    plan = derive_tp_plan(graph)
    assert vocab_parallel_loss(graph, plan, 2, cross_entropy)
    assert not vocab_parallel_loss(graph, plan, 2, lambda out, target: cross_entropy(out, target))
    assert not vocab_parallel_loss(graph, plan, 3, cross_entropy)  # 3 does not divide the vocabulary
    pins = dict(data_parallel=(1,), pipeline_ranks=(1,), micro_batch_sizes=(8,), zero_stages=(0,))
    kw = dict(target=spec.target, stage_dag=False, top_k=1, tensor_parallel=(2,), sequence_parallel=False, **pins)
    b, vocab = 8, model.lm_head.out_features
    logits = b * spec.example_inputs(1)[0].shape[1] * vocab * 4  # fp32
    for workload, kept in ((replace(WORKLOAD, precision="fp32"), 2), (WORKLOAD, 3 / 2)):
        split, whole = (search(model, spec.example_inputs, CLUSTER, workload, loss=fn, **kw) for fn in
                        (cross_entropy, lambda out, target: cross_entropy(out, target)))  # fmt: skip
        # The whole loss (pyplan's fused cross-entropy, pyplan/cross_entropy.py) keeps the logits, which the stage
        # holds anyway, and in its backward makes their gradient in their dtype beside an fp32 copy of one chunk of
        # rows, here all of them: `kept` fp32 logits' worth; the slice keeps half the logits' softmax in fp32 and,
        # in bf16, its gradient cast (a quarter); both beside a few per-row tensors (a row of logits: 512 bytes).
        saved = whole.best.stages[0].activation_bytes - split.best.stages[0].activation_bytes
        slice_ = 1 / 2 + (1 / 4 if workload.precision != "fp32" else 0)
        assert (kept - slice_ - 0.3) * logits < saved < (kept - slice_ + 0.05) * logits, workload.precision
    # On the link: no all-gather of the logits, three all-reduces of one number per position instead.
    on, off = (collective_bytes(split.chain, plan, 2, vocab_parallel=v)[-1] for v in (True, False))
    tokens = spec.example_inputs(1)[0].shape[1]
    assert off.fwd_all_gather(b) - on.fwd_all_gather(b) == b * tokens * vocab * 4
    assert on.fwd_all_reduce(b) - off.fwd_all_reduce(b) == pytest.approx(3 * b * tokens * 4)


def test_a_degree_that_splits_nothing_is_one_line() -> None:
    spec = pyplan.ModelSpec(
        name="odd",
        build=lambda: nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 6)),
        example_inputs=lambda b: (torch.randn(b, 6),),
    )
    with torch.device("meta"):
        model = spec.build()
    with pytest.raises(PlanError, match=r"^tensor parallelism 2 splits no layer of the model: 2 does not divide 9"):
        search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(2,))
    with pytest.raises(PlanError, match=r"^tensor parallelism 3 must divide the 8 GPUs of a node"):
        search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(1, 3))
    with pytest.raises(PlanError, match=r"tensor_parallel takes whole numbers of at least 1"):
        search(model, spec.example_inputs, CLUSTER, WORKLOAD, tensor_parallel=(0,))
    with pytest.raises(PlanError, match=r"analytic profile; give --gpu NAME"):
        search(spec.build(), spec.example_inputs, Cluster.from_catalog("local", 2), Workload(global_batch=4),
               tensor_parallel=(2,))  # fmt: skip


def test_a_tp_layout_is_checked_and_read_back() -> None:
    base = dict(dp=1, pp=1, micro_batch_size=1, num_microbatches=1, schedule="1F1B", cut_positions=(0, 5))
    layout = Layout(**base, tp=2, tp_plan={"fc1": "ColwiseParallel", "fc2": "RowwiseParallel"})
    assert layout.num_gpus == 2
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    assert "tp" not in Layout(**base).to_json()  # a plan without tensor parallelism reads as before
    with pytest.raises(PlanError, match=r"a layout with tp 2 needs a tp_plan"):
        Layout(**base, tp=2)
    with pytest.raises(PlanError, match=r"tp_plan maps module names to ColwiseParallel"):
        Layout(**base, tp=2, tp_plan={"fc1": "Colwise"})
    with pytest.raises(PlanError, match=r"tp must be a positive whole number"):
        Layout(**base, tp=0)
    sp = Layout(**base, tp=2, tp_plan={"fc1": "ColwiseParallel", "fc2": "RowwiseParallel"}, sequence_parallel=True)
    assert Layout.from_json(json.loads(json.dumps(sp.to_json()))) == sp
    assert "sequence_parallel" not in layout.to_json()
    with pytest.raises(PlanError, match=r"sequence_parallel must be true or false, and false at tp 1"):
        Layout(**base, sequence_parallel=True)


def test_sequence_parallelism_saves_memory_at_the_same_bytes_on_the_link() -> None:
    """gpt-tiny at tp 2, one layout with and without sequence parallelism: each stage saves less (the values
    between the split layers hold half the tokens), its tensor-parallel collectives move the same bytes (each
    all-reduce a reduce-scatter and an all-gather), so the time barely moves; by default the search uses it."""
    spec, model = _gpt()
    pins = dict(data_parallel=(1,), pipeline_ranks=(1,), micro_batch_sizes=(4,), zero_stages=(0,))
    kw = dict(loss=spec.loss, target=spec.target, stage_dag=False, top_k=1, tensor_parallel=(2,), **pins)
    on = search(model, spec.example_inputs, CLUSTER, WORKLOAD, **kw).best
    off = search(model, spec.example_inputs, CLUSTER, WORKLOAD, sequence_parallel=False, **kw).best
    assert on.layout.sequence_parallel and not off.layout.sequence_parallel
    assert on.layout.tp_plan == off.layout.tp_plan
    assert on.stages[0].activation_bytes < off.stages[0].activation_bytes
    assert on.predicted.tp_comm_s == pytest.approx(off.predicted.tp_comm_s, rel=0.25)
    # A TP plan that names no norm SequenceParallel asks for none.
    plan = dict(off.layout.tp_plan)
    named = search(model, spec.example_inputs, CLUSTER, WORKLOAD, tp_plan=plan, **kw).best
    assert not named.layout.sequence_parallel
    norm = {"transformer.h.1.ln_1": "SequenceParallel"}
    assert search(
        model, spec.example_inputs, CLUSTER, WORKLOAD, tp_plan={**plan, **norm}, **kw
    ).best.layout.sequence_parallel


def _torchrun(script: Path, *args: str) -> list[float]:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.distributed
def test_an_emitted_tp_plan_trains_and_resumes_under_torchrun(tmp_path: Path) -> None:
    """gpt-tiny split over 2 processes: the script builds the tp mesh, splits the traced layers and trains; a run
    resumed from its checkpoint (the fused QKV's strided shards saved whole) takes the step it would have taken."""
    script = tmp_path / "train.py"
    argv = ["plan", "zoo:gpt-tiny", "--gpu", "a100-80g", "--gpus", "2", "--all-gpus", "--global-batch", "8",
            "--tp", "2", "--emit", str(script)]  # fmt: skip
    assert main(argv) == 0
    assert "dp 1 x tp 2 + SP x pp 1" in script.read_text()  # sequence parallelism by default
    common = ("--checkpoint", str(tmp_path / "ck"), "--clip-grad-norm", "1.0")
    losses = _torchrun(script, "--steps", "3", "--checkpoint-every", "2", "--keep-checkpoints", "2", *common)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[2] < losses[0]
    shutil.rmtree(tmp_path / "ck" / "step-3")
    resumed = _torchrun(script, "--steps", "3", *common)  # from step-2: the third step again
    assert resumed == pytest.approx(losses[2:], rel=1e-6)


def test_the_cli_plans_shows_and_emits_a_tp_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    argv = ["plan", "zoo:gpt-tiny", "--gpu", "a100-80g", "--gpus", "8", "--global-batch", "16",
            "--precision", "fp32", "--tp", "2", "--dp", "4", "--top", "1", "--out", str(plan)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "┃   tp ┃" in out and "│ 2+SP │" in out
    layout = json.loads(plan.read_text())["plan"]
    assert (layout["dp"], layout["tp"]) == (4, 2)
    assert main(["show", str(plan)]) == 0
    shown = capsys.readouterr().out
    assert "dp 4 x tp 2 + SP x pp 1" in shown and "tensor-parallel communication" in shown
    assert main([*argv, "--sp", "off", "--out", str(tmp_path / "off.json")]) == 0
    capsys.readouterr()
    assert "sequence_parallel" not in json.loads((tmp_path / "off.json").read_text())["plan"]
    assert main(["show", str(plan), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    stage = data["stages"][0]
    assert 0 < stage["tp_comm_s"] < stage["forward_s"] + stage["backward_s"]
    assert data["time"]["tp_comm_s"] == pytest.approx(layout["num_microbatches"] * stage["tp_comm_s"])
    shares = timeline(read_plan_file(str(plan)).plan).tp_comm_share  # the Gantt chart's marks
    assert shares == pytest.approx((stage["tp_comm_s"] / (stage["forward_s"] + stage["backward_s"]),))
    # Megatron-LM builds GPT-2 under its own names and splits it as the plan does (fp32: Megatron has no autocast
    # over fp32 weights, so bf16-mixed is refused); torchtitan builds only a Llama.
    assert main(["emit", str(plan), "--format", "megatron"]) == 0
    assert "  --tensor-model-parallel-size 2\n  --sequence-parallel\n" in capsys.readouterr().out
    assert main(["emit", str(plan), "--format", "torchtitan"]) == 2
    assert "--format torchtitan cannot build zoo:gpt-tiny" in capsys.readouterr().err
    assert main(["plan", "zoo:gpt-tiny", "--gpu", "a100-80g", "--gpus", "8", "--tp", "two"]) == 2
    assert "--tp takes auto, a degree or degrees" in capsys.readouterr().err
    (tmp_path / "tp.json").write_text('{"transformer.h.0.mlp.c_fc": "ColwiseParallel"}')
    argv = ["plan", "zoo:gpt-tiny", "--gpu", "a100-80g", "--gpus", "8", "--tp-plan", str(tmp_path / "tp.json")]
    # Tensor parallelism is searched by default on a catalog GPU: the file is read, and a Linear named without its
    # partner is one line.
    assert main(argv) == 2
    assert "'transformer.h.0.mlp.c_fc' splits only with 'transformer.h.0.mlp.c_proj'" in capsys.readouterr().err
    assert main([*argv, "--tp", "1"]) == 2
    assert "--tp-plan says how layers split under tensor parallelism" in capsys.readouterr().err
    # gpt-tiny's attention has 4 heads: 8 ranks cannot split it.
    (tmp_path / "tp.json").write_text('{"transformer.h.0.attn.c_attn": "ColwiseParallel", '
                                      '"transformer.h.0.attn.c_proj": "RowwiseParallel"}')  # fmt: skip
    assert main([*argv, "--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert "tensor parallelism 8 cannot split 'transformer.h.0.attn.c_attn': 8 does not divide 4" in err


def test_inspect_shows_how_a_degree_splits_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`pyplan inspect --tp T`: each split module's style, what stays whole and why, sequence parallelism, the
    loss on each rank's slice of the vocabulary."""
    assert main(["inspect", "zoo:gpt-tiny", "--analytic", "--tp", "8", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert (
        tp["styles"]["transformer.h.0.mlp.c_fc"] == "ColwiseParallel" and tp["styles"]["lm_head"] == "ColwiseParallel"
    )
    assert tp["whole"]["transformer.h.0.attn.c_attn"] == "8 does not divide 4 (heads or features)"
    assert tp["sequence_parallel"] and "transformer.ln_f.weight" in tp["partial_gradients"]
    assert tp["region_partial_gradients"] == []  # no norm inside a split region
    assert main(["inspect", "zoo:gpt-tiny", "--analytic", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism 2: 10 modules split" in out and "3 fused pieces, each split" in out
    assert "sequence parallelism: yes" in out
    assert "loss: on each rank's 1/2 of the vocabulary" in out
    assert tp["vocab_parallel_loss"]
    assert main(["inspect", "zoo:gpt-tiny", "--analytic", "--tp", "1"]) == 2
    assert "--tp takes a degree from 2 to 1024, got 1" in capsys.readouterr().err


def test_degrees_that_give_no_plan_are_left_out_with_why(capsys: pytest.CaptureFixture[str]) -> None:
    # A pipeline of 2 does not fit the one group of 4 GPUs that tensor parallelism 4 makes of 4: the other degrees
    # answer, and the header and the JSON say why 4 was left out.
    base = ["plan", "zoo:gpt-tiny", "--gpus", "4", "--gpu", "a100-80g", "--global-batch", "32", "--pp", "2"]
    assert main([*base, "--tp", "auto", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert tp["searched"] == [1, 2] and "pinned pipeline ranks (2)" in tp["left_out"]["4"]
    assert main([*base, "--tp", "4"]) == 2  # the only degree asked for: its own one line
    assert "pinned pipeline ranks (2)" in capsys.readouterr().err
    assert main([*base, "--tp", "auto"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism searched at 1, 2 (--tp 1: none); left out: 4, as no configuration" in out
    assert "┃ tp ┃" in out  # the column shows when tensor parallelism was searched, whatever the rows hold
    # A rank's (b, 1) slices, saved as views at one size and copies at another, fit no line through zero: planned.
    assert main(["plan", "zoo:mlp-tiny", "--gpus", "8", "--gpu", "a100-80g", "--global-batch", "16", "--tp", "auto",
                 "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["tensor_parallel"]["searched"] == [1, 2, 4, 8]
