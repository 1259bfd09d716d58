"""The emitted training script runs under torchrun and trains what one process trains."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pyplan import cut_points, load_model, trace
from pyplan.emit.planfile import PlanFile, plan_file_from_json, write_plan_file
from pyplan.emit.script import render_script, write_script
from pyplan.hardware import Cluster
from pyplan.plan import Layout, Plan, Prediction, StagePlan, Workload
from pyplan.runtime.optim import lr_factor

STEPS, LR, B, MICRO, CLIP = 4, 0.05, 8, 2, 1.0


def _document(optimizer: str = "sgd", layout: Layout | None = None, model: str = "zoo:gpt-tiny") -> PlanFile:
    """gpt-tiny (or `model`, a model file of it) on 2 ranks: by default a pipeline of 2 stages, or `layout`."""
    spec = load_model("zoo:gpt-tiny")
    points = cut_points(trace(spec.build(), spec.example_inputs, batch_size=MICRO))
    inner = [c.position for c in points.candidates if 0 < c.position < len(points.order)]
    layout = layout or Layout(
        dp=1,
        pp=2,
        micro_batch_size=MICRO,
        num_microbatches=B // MICRO,
        schedule="1F1B",
        cut_positions=(0, inner[len(inner) // 2], len(points.order)),
    )
    # The runtime needs only the layout; the stages and predictions are what a search would report.
    stages = tuple(StagePlan(0, 0, 0.0, 0.0, 0.0, 0.0, 1) for _ in range(layout.num_stages))
    predicted = Prediction(0.02, B / 0.02, 4e6, 0.0, 0.0, 0.0, 0.0, 0.0, "")
    return PlanFile(
        model,
        Workload(global_batch=B, optimizer=optimizer),
        Cluster.from_catalog("t4", 2),
        Plan(layout, stages, predicted),
    )


def test_script_embeds_the_plan_and_is_valid_python(tmp_path: Path) -> None:
    document = _document()
    text = render_script(document)
    compile(text, "train.py", "exec")
    assert "torchrun --nnodes 1 --nproc-per-node 2 train.py" in text
    embedded = text.split('PLAN = json.loads(r"""')[1].split('""")')[0]
    import json

    assert plan_file_from_json(json.loads(embedded)).plan == document.plan
    path = tmp_path / "train.py"
    write_script(path, document)
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]  # no temporary file left behind


# gpt-tiny in a model file whose example inputs and target are torch's random numbers, as a model file's often are:
# each step's synthetic batch is another.
RANDOM_GPT = """
import torch

from pyplan.load import load_model
from pyplan.zoo.small import GPT_TINY

ZOO = load_model("zoo:gpt-tiny")
model, loss = ZOO.build, ZOO.loss


def example_inputs(b):
    return (torch.randint(GPT_TINY.vocab_size, (b, GPT_TINY.n_ctx)),)


def target(b):
    return torch.randint(GPT_TINY.vocab_size, (b, GPT_TINY.n_ctx))
"""


def _relative_error(p: torch.Tensor, q: torch.Tensor) -> float:
    return ((p - q).abs().max() / q.abs().max()).item()


@pytest.mark.distributed
def test_emitted_script_trains_like_one_process(tmp_path: Path) -> None:
    """Four steps as a pipeline of 2 stages, checkpointed after the third; then the fourth again, resumed from that
    checkpoint under another plan (2 replicas, ZeRO-3), with a learning-rate schedule, momentum and gradient clipping
    throughout, on synthetic batches drawn from torch's random numbers: the resumed run ends where the run it
    resumed ended, and both hold the parameters of one process training 4 steps on each step's batch."""
    (tmp_path / "model.py").write_text(RANDOM_GPT)
    model = str(tmp_path / "model.py")
    document = _document("sgd-momentum", model=model)
    script = tmp_path / "train.py"
    write_script(script, document)
    sharded = tmp_path / "zero3.json"
    n = document.plan.layout.cut_positions[-1]
    layout = Layout(2, 1, MICRO, B // MICRO // 2, "1F1B", (0, n), 3)
    write_plan_file(sharded, _document("sgd-momentum", layout, model))
    whole, saved, checkpoints = tmp_path / "whole", tmp_path / "params", tmp_path / "ckpt"
    common = ["--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", "1", "--decay", "cosine"]
    common += ["--clip-grad-norm", str(CLIP), "--checkpoint", str(checkpoints)]
    first = _torchrun(script, 2, *common, "--checkpoint-every", str(STEPS - 1), "--save-params", str(whole))
    assert first.returncode == 0, first.stderr[-3000:]
    # Rank 0 alone reports, one line a step: loss, the gradient's norm, time and tokens/s (gpt-tiny reads token
    # ids), memory beside the plan's prediction; the plan is a T4's, so no time is set against the plan's.
    steps = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [str(k) for k in range(STEPS)]
    assert all("tokens/s" in line and re.search(r" [GM]iB \(plan ", line) for line in steps)
    assert not any("ms (plan " in line for line in steps)
    # The median leaves out the two steps whose live tensor bytes were counted (CPU).
    assert f"over steps 2..{STEPS - 1} on CPU, not the plan's t4: this run checks that the plan trains" in first.stdout
    assert "%" not in first.stdout
    figures = [line.split("peak memory ")[1].split()[:2] for line in steps]
    peaks = [float(x) * (2**30 if unit == "GiB" else 2**20) for x, unit in figures]
    params = sum(p.numel() * 4 for p in load_model("zoo:gpt-tiny").build().parameters())
    assert all(params / 2 < peak < 100 * params for peak in peaks), (peaks, params)
    norms = [float(line.split("grad norm ")[1].split()[0]) for line in steps]
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{STEPS - 1}", f"step-{STEPS}"]
    shutil.rmtree(checkpoints / f"step-{STEPS}")
    second = _torchrun(script, 2, *common, "--plan", str(sharded), "--save-params", str(saved))
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step-{STEPS - 1}'} (step {STEPS - 1})" in second.stdout
    steps = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == [str(STEPS - 1)]
    assert float(steps[0].split("grad norm ")[1].split()[0]) == pytest.approx(norms[-1], rel=1e-3)
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"step-{STEPS - 1}", f"step-{STEPS}"]
    uninterrupted = {**torch.load(f"{whole}.rank0.pt"), **torch.load(f"{whole}.rank1.pt")}
    resumed = {**torch.load(f"{saved}.rank0.pt"), **torch.load(f"{saved}.rank1.pt")}
    assert set(resumed) <= set(uninterrupted)  # every parameter (the pipeline's last stage holds the tied copy)
    worst = max(_relative_error(p, uninterrupted[name]) for name, p in resumed.items())
    assert worst < 1e-5, worst  # 6e-8, the plans' rounding; another batch at the last step: 5e-2

    # One process training on each step's batch: the model's example inputs and target drawn from the step's seed.
    emitted = _script_module(tmp_path / "module")
    spec = load_model(model)
    torch.manual_seed(0)
    reference = spec.build()
    opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    expected = []
    for step in range(STEPS):  # the learning rate warms up over 1 step, then decays (cosine), as the script's
        emitted.seed_step(step, 0)
        inputs, target = spec.example_inputs(B), spec.target(B)
        for group in opt.param_groups:
            group["lr"] = LR * lr_factor(step, STEPS, 1, "cosine")
        opt.zero_grad()
        for k in range(B // MICRO):
            sl = slice(k * MICRO, (k + 1) * MICRO)
            (spec.loss(reference(*(t[sl] for t in inputs)), target[sl]) / (B // MICRO)).backward()
        expected.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
        opt.step()
    assert min(expected) > CLIP  # every step clips
    assert norms == pytest.approx(expected, rel=1e-3)  # as printed, 4 digits
    ref = dict(reference.named_parameters(remove_duplicate=False))
    assert set(resumed) <= set(ref) and len(resumed) >= len(dict(reference.named_parameters()))
    for name, p in resumed.items():
        err = _relative_error(p, ref[name].detach())
        assert err < 1e-5, (name, err)


def _torchrun(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _start_torchrun(script: Path, nproc: int, *args: str) -> subprocess.Popen[str]:
    """`_torchrun` started, not waited for, its rendezvous on a free port (beside other launches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
         str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=script.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


# --data for gpt-tiny that loads one replica's share of a global batch of 8, and notes what it was asked for. The
# last rank's iterator runs out after 2 batches, the others' never.
SHARDS = """
import os
from pathlib import Path

from pyplan.load import load_model


def shards(replica, replicas):
    spec = load_model("zoo:gpt-tiny")
    share = 8 // replicas
    Path(__file__).with_name(f"loaded.{os.environ['RANK']}").write_text(f"{replica} {replicas} {share}")
    for _ in range(2 if os.environ["RANK"] == "3" else 1000):
        yield spec.example_inputs(share), spec.target(share)
"""


@pytest.mark.distributed
def test_plan_emit_then_torchrun(tmp_path: Path) -> None:
    from pyplan.cli.main import main
    from pyplan.runtime.checkpoint import _verify as verify

    script, plan = tmp_path / "train.py", tmp_path / "plan.json"
    argv = [
        "plan",
        "zoo:gpt-tiny",
        "--gpus",
        "4",
        "--all-gpus",
        "--gpu",
        "a100-80g",
        "--global-batch",
        "8",
        "--remat",
        "full",
        "--emit",
        str(script),
        "--out",
        str(plan),
    ]
    assert main(argv) == 0
    # Every stage checkpoints its blocks: the script runs them under torch.utils.checkpoint.
    assert all(r is not None for r in json.loads(plan.read_text())["plan"]["remat"])
    # Each replica loads only its share when --data's function takes `replica` and `replicas`. One rank's iterator
    # runs out at step 2: every rank stops there, rank 0 saying so in one line, and the checkpoints are kept.
    dp = json.loads(plan.read_text())["plan"]["dp"]
    (tmp_path / "shards.py").write_text(SHARDS)
    ckpt, shards = tmp_path / "ckpt", f"{tmp_path / 'shards.py'}:shards"
    done = _torchrun(script, 4, "--steps", "3", "--data", shards, "--checkpoint", str(ckpt), "--checkpoint-every", "1")
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --data {shards} ran out at step 2: a run to --steps 3 takes a batch a step; give a longer iterator "
        f"or fewer --steps; training stopped before step 2; the latest checkpoint, {ckpt / 'step-2'}, is kept"
    ], done.stderr[-3000:]
    # Exit status 2, and no rank's traceback (torchrun prints its own).
    assert re.search(r"exitcode\s*: 2 ", done.stderr) and 'train.py", line' not in done.stderr, done.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-1", "step-2"]
    verify(ckpt / "step-2")  # whole: every file as the 4 ranks hashed it
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    loaded = sorted({p.read_text() for p in tmp_path.glob("loaded.*")})  # the stages of a replica load alike
    assert loaded == sorted({f"{r} {dp} {8 // dp}" for r in range(dp)}), loaded

    # Bad input: every rank sees it, rank 0 says it in one line, the launch exits non-zero without hanging.
    document = json.loads(plan.read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**document, "model": "zoo:mlp-tiny"}))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(plan.read_text()[: len(plan.read_text()) // 2])
    # The three launches run at once, beside the expert-parallel plan below (each on a port of its own): most of a
    # launch that fails early is start-up, on 2 cores.
    bad = [
        (_start_torchrun(script, 2, "--steps", "1", *args), message)
        for args, message in [
            ((), "the plan needs 4 processes"),
            (("--plan", str(other)), "was the plan made for another model?"),
            (("--plan", str(corrupt)), "is not JSON"),
        ]
    ]

    # Expert parallelism: the search's plan at ep 2 for a mixture of experts, emitted and run on 2 ranks that each
    # hold half of every layer's experts, trains what one process trains.
    _expert_parallel_plan_trains_like_one_process(tmp_path / "moe", main)

    for proc, message in bad:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], stderr[-2000:]


MOE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "real", "moe_mixtral_style.py"
)


def _expert_parallel_plan_trains_like_one_process(folder: Path, main: Any) -> None:
    """`pyplan plan --ep 2` on this machine's 2 processes for the Mixtral-style model: plan.json carries ep and the
    capture it indexes (each layer's experts kept whole, its leaf_modules); the script trains 3 steps of SGD with
    momentum (Adam would magnify the rounding of gradients that are zero in theory, a key bias's), and every rank's
    parameters (its experts renumbered from 0 in each layer's list) equal one process's after the same steps on the
    same batches."""
    from pyplan.emit.planfile import read_plan_file
    from pyplan.runtime.trainer import optimizer_factory

    folder.mkdir()
    script, plan, saved = folder / "train.py", folder / "plan.json", folder / "params"
    argv = ["plan", MOE, "--gpus", "2", "--gpu", "local", "--global-batch", "8", "--ep", "2"]
    argv += ["--optimizer", "sgd-momentum"]
    assert main([*argv, "--emit", str(script), "--out", str(plan)]) == 0
    doc = read_plan_file(plan)
    lay = doc.plan.layout
    assert (lay.ep, lay.dp, lay.pp) == (2, 2, 1)
    assert doc.leaf_modules == ("layers.0.moe.experts", "layers.1.moe.experts")
    done = _torchrun(script, 2, "--steps", "3", "--lr", str(LR), "--save-params", str(saved))
    assert done.returncode == 0, done.stderr[-3000:]
    emitted = _script_module(folder / "module")
    spec = load_model(MOE)
    torch.manual_seed(0)
    reference = spec.build()
    opt = optimizer_factory(doc.workload.optimizer, LR)(reference.parameters())
    b, n = lay.micro_batch_size, doc.workload.global_batch // lay.micro_batch_size
    for step in range(3):
        emitted.seed_step(step, 0)
        inputs, target = spec.example_inputs(8), spec.target(8)
        opt.zero_grad()
        for k in range(n):
            sl = slice(k * b, (k + 1) * b)
            (spec.loss(reference(*(t[sl] for t in inputs)), target[sl]) / n).backward()
        opt.step()
    ref = dict(reference.named_parameters())
    held = 0
    for rank in range(2):
        for name, p in torch.load(f"{saved}.rank{rank}.pt").items():
            head, mark, tail = name.partition(".mlps.")
            if mark:  # rank r holds experts 4r..4r+3 of each layer, as 0..3
                number, _, rest = tail.partition(".")
                name, held = f"{head}.mlps.{int(number) + 4 * rank}.{rest}", held + 1
            assert _relative_error(p, ref[name].detach()) < 1e-5, name
    assert held == 2 * 2 * 4 * 3  # ranks x layers x experts a rank x (gate, up, down)


# Payloads that would end the docstring, a raw string or a line if pasted into the script unescaped.
INJECTIONS = (
    'x.py"""\nopen("INJECTED", "w")\n"""',
    "x.py'''\nopen('INJECTED', 'w')\n'''",
    'x\\"""; open("INJECTED", "w"); """',
    "x.py\\",
    '"""',
)


def _string_paths(value: object, path: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """The path of every string in a JSON document, keys that are strings included (as ('key', name))."""
    if isinstance(value, str):
        return [path]
    if isinstance(value, dict):
        out = [(*path, ("key", k)) for k in value]
        for k, v in value.items():
            out += _string_paths(v, (*path, k))
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _string_paths(v, (*path, i))]
    return []


def _replaced(doc: object, path: tuple[object, ...], new: str) -> object:
    data = json.loads(json.dumps(doc))
    node = data
    for step in path[:-1]:
        node = node[step]  # type: ignore[index]
    last = path[-1]
    if isinstance(last, tuple):  # a key
        node[new] = node.pop(last[1])  # type: ignore[union-attr]
    else:
        node[last] = new  # type: ignore[index]
    return data


def _code_shape(text: str) -> str:
    """The script's syntax tree with every string constant blanked: what it runs, whatever data it carries."""
    import ast

    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def test_no_string_of_the_plan_can_inject_code() -> None:
    """Every string of plan.json (values and keys), set to each payload: the plan is refused with a PlanError, or
    the script it emits runs exactly the template's code, the payload carried as data only."""
    from pyplan.errors import PlanError

    base = _document()
    clean = _code_shape(render_script(base))
    doc = base.to_json()
    doc["leaf_modules"] = ["Block"]
    doc["plan"]["stage_of_node"] = {}
    paths = _string_paths(doc)
    assert len(paths) > 20
    accepted = 0
    for path in paths:
        for payload in INJECTIONS:
            try:
                document = plan_file_from_json(_replaced(doc, path, payload))
            except PlanError:
                continue
            accepted += 1
            for name in ("train.py", payload):
                assert _code_shape(render_script(document, name)) == clean, (path, payload)
    assert accepted > 0  # some strings are free text (the GPU's description, the sources): still only data


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(model=["x.py"]), "'model' must be a model reference"),
        (lambda d: d.update(model="zoo:gpt-tiny\x1b[2J"), "'model' must be a model reference"),
        (lambda d: d.update(leaf_modules="Linear"), "'leaf_modules' must be a list of module names"),
        (lambda d: d["plan"].update(schedule="GPipe; import os"), "unknown schedule"),
        (lambda d: d["workload"].update(global_batch=B * 2), "samples a step, the workload's global batch is"),
    ],
)
def test_plan_fields_are_checked_before_use(change: Any, message: str) -> None:
    from pyplan.errors import PlanError

    doc = json.loads(json.dumps(_document().to_json()))
    change(doc)
    with pytest.raises(PlanError, match=message):
        plan_file_from_json(doc)


def test_a_layout_needing_more_gpus_than_the_cluster_has_is_refused() -> None:
    from pyplan.errors import PlanError

    doc = json.loads(json.dumps(_document().to_json()))
    doc["cluster"] = Cluster.from_catalog("t4", 1).to_json()
    with pytest.raises(PlanError, match="= 2 GPUs, the cluster has 1"):
        plan_file_from_json(doc)


def _script_module(tmp_path: Path) -> Any:
    """The emitted script imported as a module (its `main` not run)."""
    import importlib.util

    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "train.py"
    write_script(path, _document())
    spec = importlib.util.spec_from_file_location("emitted_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_on_another_device_checks_the_plan_trains_and_sets_no_time_against_it(tmp_path: Path) -> None:
    from pyplan.hardware.catalog import GPU

    script = _script_module(tmp_path)
    cpu = torch.device("cpu")
    assert script.other_device(Cluster.from_catalog("a100-80g", 2).gpu, cpu) == "CPU"
    local = GPU(name="local", memory_bytes=2**34, hbm_bw_bytes_per_s=None, device_type="cpu")
    assert script.other_device(local, cpu) is None
    times = [0.5, 0.4, 0.21, 0.23, 0.22]
    elsewhere = script.summary(times, 2, 0, 0.0076, "CPU", "a100-80g-sxm")
    assert elsewhere == (
        "median step 220.0 ms over steps 2..4 on CPU, not the plan's a100-80g-sxm: this run checks that the plan "
        "trains; it does not measure the plan's time"
    )
    assert script.summary(times, 2, 0, 0.2, None, "local") == (
        "median step 220.0 ms over steps 2..4: +10.0 % against the plan's 200.0 ms"
    )


def test_a_script_run_without_torchrun_says_how_to_run_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    write_script(script, _document())
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: run this script under torchrun") and "Traceback" not in done.stderr
    assert "torchrun --nproc-per-node" in done.stderr


@pytest.fixture
def shadowed(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder holding pyplan's sources without the compiled core (a checkout after `pip install .`), and the
    environment of a non-editable install: pyplan with its core in a site folder of its own, no editable finder
    (`python -S` reads no .pth file)."""
    import pyplan._core

    source = Path(pyplan.__file__).parent
    ignore = shutil.ignore_patterns("__pycache__", "_core.*")
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    shutil.copytree(source, checkout / "pyplan", ignore=ignore)
    shutil.copytree(source, site / "pyplan", ignore=ignore)
    shutil.copy(pyplan._core.__file__, site / "pyplan")
    packages = Path(torch.__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return checkout, {**env, "PYTHONPATH": os.pathsep.join([str(site), str(packages)])}


def test_a_source_tree_without_the_core_is_named_in_one_line(shadowed: tuple[Path, dict[str, str]]) -> None:
    checkout, env = shadowed
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import pyplan"], cwd=checkout, env=env, capture_output=True, text=True
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: pyplan was imported from the source tree {checkout / 'pyplan'}")
    assert "run from another folder, or install this checkout with `pip install -e .`" in last
    assert "circular" not in done.stderr


def test_the_script_runs_from_a_checkout_of_pyplan(shadowed: tuple[Path, dict[str, str]]) -> None:
    """The tour's torchrun runs from the repository root: the script imports the installed pyplan, not the
    checkout's sources beside it (here it gets as far as asking for torchrun)."""
    checkout, env = shadowed
    write_script(checkout / "train.py", _document())
    done = subprocess.run(
        [sys.executable, "-S", "train.py"], cwd=checkout, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith("error: run this script under torchrun")


# --data functions for gpt-tiny (global batch 8, token ids (b, 32) int64), good and bad.
DATA = """
import torch

from pyplan.load import load_model

SPEC = load_model("zoo:gpt-tiny")


def good():
    while True:
        yield SPEC.example_inputs(8), SPEC.target(8)


def drawn():  # torch's random numbers, as a loader that shuffles draws them
    while True:
        yield (torch.randint(256, (8, 32)),), torch.randint(256, (8, 32))


def two():
    yield from [(SPEC.example_inputs(8), SPEC.target(8))] * 2


def fails():
    raise FileNotFoundError("no shards in /data/train")


def fails_later():
    yield SPEC.example_inputs(8), SPEC.target(8)
    raise ValueError("corrupt record 1041")


def count():
    return 3


def inputs_only():
    while True:
        yield SPEC.example_inputs(8)


def text():
    while True:
        yield "some text", SPEC.target(8)


def short():
    while True:
        yield (SPEC.example_inputs(8)[0][:, :16],), SPEC.target(8)


def floats():
    while True:
        yield (SPEC.example_inputs(8)[0].float(),), SPEC.target(8)


def half_batches():
    while True:
        yield SPEC.example_inputs(4), SPEC.target(4)


def no_target():
    while True:
        yield SPEC.example_inputs(8), None
"""


def test_bad_data_and_options_are_one_line_before_training(tmp_path: Path) -> None:
    """--data's file, function and items, --lr and --save-params are checked before any step (the function and the
    options before any process group); an iterator that runs out or fails says at which step."""
    from pyplan.errors import PlanError

    script = _script_module(tmp_path)
    data = tmp_path / "data.py"
    data.write_text(DATA)
    (tmp_path / "broken.py").write_text("def good(\n")
    layout, spec = _document().plan.layout, load_model("zoo:gpt-tiny")

    def first(func: str, start: int = 0, steps: int = 4) -> Any:
        """The checked batch of step `start` from `func`, as the script takes it before training."""
        ref = f"{data}:{func}"
        return script.Batches(spec, layout, B, 0, start, steps, script.data_function(ref), ref).take(start)

    def refused(call: Any, message: str) -> None:
        with pytest.raises(PlanError) as error:
            call()
        assert str(error.value) == message

    batch = "a batch of 8 samples, each as example_inputs gives it"
    cases = {
        "fails": f"--data {data}:fails: fails() raised FileNotFoundError: no shards in /data/train; fix the function",
        "count": f"--data {data}:count: count() returned int, not an iterator; return (or yield) the (inputs, "
        "target) batches",
        "inputs_only": f"--data {data}:inputs_only gave a tuple at step 0; give (inputs, target) pairs",
        "text": f"--data {data}:text gave inputs of type str at step 0; give a tuple of tensors, a dict of keyword "
        "arguments or (args, kwargs), as example_inputs returns them",
        "short": f"--data {data}:short gave input 0 of (8, 16) int64 at step 0; the plan takes (8, 32) int64: {batch}",
        "floats": f"--data {data}:floats gave input 0 of (8, 32) float32 at step 0; the plan takes (8, 32) int64: "
        f"{batch}",
        "half_batches": f"--data {data}:half_batches gave input 0 of (4, 32) int64 at step 0; the plan takes (8, 32) "
        f"int64: {batch}",
        "no_target": f"--data {data}:no_target gave a target of type NoneType at step 0; the loss takes a tensor of "
        "(8, 32) int64",
    }
    for func, message in cases.items():
        refused(lambda func=func: first(func), message)
    ran_out = f"--data {data}:two ran out at step 2: a run to --steps 4 takes a batch a step; give a longer iterator "
    ran_out += "or fewer --steps"
    refused(lambda: first("two", start=3), ran_out)  # resumed at step 3: the steps already trained are drawn first
    batches = script.Batches(spec, layout, B, 0, 0, 4, script.data_function(f"{data}:two"), f"{data}:two")
    batches.take(0)
    batches.take(1)
    refused(lambda: batches.take(2), ran_out)
    batches = script.Batches(spec, layout, B, 0, 0, 4, script.data_function(f"{data}:fails_later"), "d.py:fails_later")
    batches.take(0)
    refused(
        lambda: batches.take(1),
        "--data d.py:fails_later: its iterator raised ValueError: corrupt record 1041 at step 1",
    )
    tensors, target, take = first("good")
    assert tensors[0].shape == (8, 32) and target.shape == (8, 32) and take == slice(0, 8)

    # A run resumed at step 2 draws the batches a run from step 0 draws there: synthetic ones, and --data's that
    # torch's random numbers make.
    (tmp_path / "model.py").write_text(RANDOM_GPT)
    drawn = f"{data}:drawn"
    for model, source, ref in (
        (load_model(str(tmp_path / "model.py")), None, None),
        (spec, script.data_function(drawn), drawn),
    ):
        whole, resumed = (script.Batches(model, layout, B, 0, start, 4, source, ref) for start in (0, 2))
        from_zero = [whole.take(step) for step in range(4)]
        assert not torch.equal(from_zero[2][0][0], from_zero[3][0][0])  # each step's batch is another
        for step in (2, 3):
            again = resumed.take(step)
            assert torch.equal(again[0][0], from_zero[step][0][0]) and torch.equal(again[1], from_zero[step][1])

    # The file and function, before any process group is made.
    refused(
        lambda: script.data_function("data.py"),
        "--data takes FILE:FUNC, a Python file and its function that returns the batches; got data.py",
    )
    refused(
        lambda: script.data_function(f"{tmp_path / 'none.py'}:good"),
        f"--data {tmp_path / 'none.py'}:good: "
        f"there is no file {tmp_path / 'none.py'}; give FILE:FUNC of an existing Python file",
    )
    refused(
        lambda: script.data_function(f"{data}:batches"),
        f"--data {data}:batches: {data} defines no function "
        "'batches' (it defines: count, drawn, fails, fails_later, floats, good, half_batches, inputs_only, "
        "no_target, short, text, two); give FILE:FUNC of the function that returns the batches",
    )
    broken = tmp_path / "broken.py"
    refused(
        lambda: script.data_function(f"{broken}:good"),
        f"--data {broken}:good: importing {broken} raised "
        "SyntaxError: '(' was never closed (broken.py, line 1); fix the file",
    )

    def options(*argv: str) -> Any:
        return script.checked_options(script.build_parser().parse_args(argv))

    refused(lambda: options("--lr", "nan"), "--lr takes a finite learning rate >= 0, got nan")
    refused(lambda: options("--lr", "-1"), "--lr takes a finite learning rate >= 0, got -1.0")
    missing = tmp_path / "missing" / "params"
    refused(
        lambda: options("--save-params", str(missing)),
        f"--save-params cannot write '{missing}.rank0.pt': no "
        f"such file or directory ('{missing.parent}'); give a file path in a writable directory",
    )
    assert options("--save-params", str(tmp_path / "params"), "--lr", "0") is None
