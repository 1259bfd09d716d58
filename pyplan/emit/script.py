"""The training script `pyplan emit` writes: readable, runnable with torchrun, the plan embedded in it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from pyplan._files import write_atomic
from pyplan.emit.planfile import PlanFile

__all__ = ["render_script", "write_script"]

_TEMPLATE = '''\
"""Training script emitted by pyplan from the plan below: {summary}.

Run it with one process per GPU:
    torchrun --nnodes {nodes} --nproc-per-node {per_node} {name} [--plan plan.json] [--steps N] [--data FILE:FUNC]
        [--checkpoint DIR] [--clip-grad-norm X] [--metrics FILE] [--tensorboard DIR]

Each step rank 0 prints the replicas' mean loss, the learning rate, the gradient's norm (before clipping), the
slowest rank's step time, samples/s (tokens/s for a model of token ids), the model FLOPs utilization (MFU) and the
largest peak memory of any rank, time and memory beside the plan's prediction; at the end, the median step after the
warm-up against the prediction. On a device other than the plan's (a CPU for a GPU's plan, another GPU) the run
checks that the plan trains: no time is set against the plan's and no MFU is shown. Memory is what the plan counts:
on a GPU the most the CUDA allocator held; on a CPU the live tensor bytes of a steady step (the second), counted by
pyplan's LiveMemory from the first step on, with the rank's parameters and batch: the two counted steps run slower
and are left out of the median.

MFU is the model FLOPs of a step (forward and backward of the global batch, matrix products and convolutions as
torch's FlopCounterMode counts them, recomputation left out) over the step time x the GPUs x the plan GPU's peak
FLOP/s at the plan's precision, as PaLM (Chowdhery et al. 2022) and torchtitan define it.

`python {name} --help` describes every option.
"""

import argparse
import contextlib
import glob
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from datetime import timedelta

# Run from a checkout of pyplan (the README's tour runs from its root), this folder's pyplan/ sources, which lack the
# compiled core that `pip install .` put beside the installed package, would hide that package: leave it off the path.
HERE = os.path.dirname(os.path.realpath(__file__))
if os.path.isdir(os.path.join(HERE, "pyplan")) and not glob.glob(os.path.join(HERE, "pyplan", "_core.*")):
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != HERE]

import torch
import torch.distributed as dist

from pyplan._files import check_writable
from pyplan.emit.planfile import plan_file_from_json, read_plan_file
from pyplan.errors import PlanError
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import input_tensors, inputs_at, trace
from pyplan.load import load_model
from pyplan.model_state import COMPUTE_DTYPES
from pyplan.profile.flops import block_flops
from pyplan.profile.live import LiveMemory
from pyplan.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from pyplan.runtime.heartbeat import Heartbeat, WaitLimit
from pyplan.runtime.optim import LR_DECAYS, lr_factor
from pyplan.runtime.trainer import build_trainer, optimizer_factory, replica_slice

PLAN = json.loads(r"""
{plan_json}
""")


def reduce(figures, op, device):
    """`figures` reduced over every rank with `op` (on the device NCCL needs), back on the CPU."""
    out = figures.to(device)
    dist.all_reduce(out, op=op)
    return out.cpu()


class CpuMemory:
    """A CPU rank's memory as the plan counts it: the live tensor bytes of its first two steps (LiveMemory), the
    peak of the second, which holds what the first left (optimizer state, buffers, gradients), plus what was made
    before them: the rank's parameters and, on the first stage, the replica's batch."""

    def __init__(self, trainer):
        params = {{id(p): p for m in trainer.modules for p in m.parameters()}}.values()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # ZeRO-3: this rank's shards
        self.before = sum(t.numel() * t.element_size() for t in local)
        self.live = LiveMemory().__enter__()
        self.marks = []
        self.peak = 0.0

    @property
    def counting(self):
        return self.live is not None

    def after_step(self, batch_bytes, last):
        """The peak so far (of the second step once it has run); the count ends after the second or last step."""
        self.marks.append(self.live.mark())
        since = self.live.peak_bytes_since(*self.marks[-2:]) if len(self.marks) == 2 else self.live.peak_bytes
        self.peak = float(self.before + batch_bytes + since)
        if len(self.marks) == 2 or last:
            self.live.__exit__(None, None, None)
            self.live = None


def memory_pair(measured, planned):
    """Measured and planned bytes in one unit: GiB, or MiB when both are below a GiB."""
    unit, scale = ("GiB", 2**30) if max(measured, planned) >= 2**30 else ("MiB", 2**20)
    return f"{{measured / scale:.2f}} {{unit}} (plan {{planned / scale:.2f}})"


def other_device(gpu, device):
    """This run's device by name where it is not the kind of GPU the plan was made for (another device type,
    architecture or memory size), else None: only on the plan's device are its predicted times a yardstick."""
    if device.type == "cpu":
        return None if gpu.device_type == "cpu" else "CPU"
    props = torch.cuda.get_device_properties(device)
    arch = props.gcnArchName.split(":")[0] if torch.version.hip else f"sm{{props.major}}{{props.minor}}"
    same = (
        gpu.device_type == "cuda"
        and gpu.arch in (None, arch)
        and (not gpu.memory_bytes or abs(props.total_memory / gpu.memory_bytes - 1) < 0.1)
    )
    return None if same else props.name


def summary(times, warmup, start, planned_s, other, planned_on):
    """The run's last line: the median step after the warm-up, against the plan's time on the plan's device;
    elsewhere (`other`), what the run shows instead."""
    steady = sorted(times[warmup:])[len(times[warmup:]) // 2]
    median = f"median step {{steady * 1e3:.1f}} ms over steps {{start + warmup}}..{{start + len(times) - 1}}"
    if other is not None:
        return (
            f"{{median}} on {{other}}, not the plan's {{planned_on}}: this run checks that the plan trains; it does "
            "not measure the plan's time"
        )
    return f"{{median}}: {{(steady / planned_s - 1) * 100:+.1f}} % against the plan's {{planned_s * 1e3:.1f}} ms"


def throughput(tensors, global_batch, step_s):
    """Samples per second, or tokens per second where the model reads token ids (an integer (B, T) input): the
    rate and what it counts ("samples" or "tokens")."""
    tokens = [t for t in tensors if not t.is_floating_point() and t.dim() == 2]
    if tokens:
        return global_batch * tokens[0].shape[1] / step_s, "tokens"
    return global_batch / step_s, "samples"


def shown_rate(rate, what):
    return f"{{rate:,.0f}} tokens/s" if what == "tokens" else f"{{rate:,.1f}} samples/s"


# The catalog's peak for each compute dtype of a precision (pyplan.model_state.COMPUTE_DTYPES; None: fp32).
PEAK_DTYPES = {{None: "fp32", "bfloat16": "bf16", "float16": "fp16"}}


def peak_flops(gpu, precision, other):
    """One GPU's peak FLOP/s at the plan's precision, the yardstick of MFU; None on a device other than the plan's
    (`other`: the plan's peak says nothing of it) or where the catalog has no peak for the precision."""
    if other is not None:
        return None
    return gpu.peak_flops_per_s.get(PEAK_DTYPES[COMPUTE_DTYPES[precision]])


def model_flops(spec, model, layout, leaf_modules=()):
    """The model FLOPs of one optimizer step: forward and backward of every micro-batch of every replica, counted
    as pyplan counted them when it planned (torch's FlopCounterMode per block of the captured model, on fake
    tensors: nothing is computed); recomputation and the optimizer are left out, as MFU has it. The random number
    generator is left as it was, so that the rank counting draws what the others draw."""
    b = layout.micro_batch_size
    with torch.random.fork_rng(devices=[]):
        chain = linearize(trace(model, spec.example_inputs, leaf_modules=leaf_modules, batch_size=b))
        per_micro_batch = sum(fwd(b) + bwd(b) for fwd, bwd in block_flops(chain, spec.example_inputs))
    return per_micro_batch * layout.num_microbatches * layout.dp


def finite_or_none(value):
    """`value`, or None where it is not finite (a diverged loss): strict JSON has no NaN or Infinity."""
    return value if value is not None and math.isfinite(value) else None


def earlier_step(line, start):
    """Whether a line of a metrics file records a step before `start`; a line a crash cut short does not."""
    try:
        return json.loads(line)["step"] < start
    except (ValueError, KeyError, TypeError):
        return False


class Metrics:
    """Rank 0's record of each step for tools: one JSON object a line in `path` (--metrics), flushed every step,
    and the same scalars in TensorBoard through `writer` (--tensorboard). A run from step 0 starts the file afresh;
    a run resumed at step `start` keeps the lines of the steps before it (a run cut short after its last checkpoint
    wrote later ones) and continues the file, as `purge_step` does for TensorBoard's events."""

    def __init__(self, path, writer, start):
        self.writer = writer
        self.file = None
        if path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                kept = []
                if start and os.path.exists(path):
                    with open(path) as f:
                        kept = [line.rstrip("\\n") + "\\n" for line in f if earlier_step(line, start)]
                with open(f"{{path}}.partial", "w") as f:
                    f.writelines(kept)
                os.replace(f"{{path}}.partial", path)
                self.file = open(path, "a")
            except OSError as exc:
                raise PlanError(f"--metrics {{path}} cannot be written: {{exc.strerror or exc}}") from None

    def record(self, figures):
        """Write one step's `figures` (a dict with "step"); None (JSON null) where a figure is not known."""
        if self.file is not None:
            line = {{k: finite_or_none(v) if isinstance(v, float) else v for k, v in figures.items()}}
            self.file.write(json.dumps(line, allow_nan=False) + "\\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in figures.items():
                if key != "step" and value is not None:
                    self.writer.add_scalar(key, value, figures["step"])

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()


# Every rank builds the initial model from this seed, and draws each step's random numbers from it (seed_step).
SEED = 0


def seed_step(step, stream):
    """Seed torch's random numbers alike on every rank from (SEED, step, stream): stream 0 for the step's batch (the
    model's example inputs, or what a --data iterator draws with torch), 1 for the step itself (dropout). A run
    resumed at any step draws there what a run from step 0 drew."""
    torch.manual_seed(((SEED + 1) << 40) + 2 * step + stream)


def said(exc):
    """An exception in one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{{type(exc).__name__}}: {{lines[0][:200]}}" if lines else type(exc).__name__


def data_function(ref):
    """The function `--data FILE:FUNC` names; one line for a missing file or function, or a file that fails to
    import, before any process group is made."""
    path, colon, name = ref.rpartition(":")
    if not colon or not path or not name:
        raise PlanError(f"--data takes FILE:FUNC, a Python file and its function that returns the batches; got {{ref}}")
    if not os.path.isfile(path):
        raise PlanError(f"--data {{ref}}: there is no file {{path}}; give FILE:FUNC of an existing Python file")
    module_spec = importlib.util.spec_from_file_location("pyplan_user_data", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise PlanError(f"--data {{ref}}: importing {{path}} raised {{said(exc)}}; fix the file") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        functions = [k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        defined = sorted(functions)
        raise PlanError(
            f"--data {{ref}}: {{path}} defines no function '{{name}}' (it defines: {{', '.join(defined) or 'none'}}); "
            "give FILE:FUNC of the function that returns the batches"
        )
    return fn


def shown(shape, dtype):
    return f"{{tuple(shape)}} {{str(dtype).removeprefix('torch.')}}"


class Batches:
    """This rank's batch of each step: synthetic (the model's example inputs and target for the global batch), or
    the items of --data's iterator, checked against the plan. The batch of step k is drawn after seed_step(k, 0), so
    a resumed run draws what a run from step 0 drew; of --data's iterator, the items of the steps already trained
    are drawn (each after its step's seed) and dropped, unless its function takes `start`. An item that is not the
    plan's batch, or an iterator that fails or runs out, is one line naming the step (PlanError). With `waits` (a
    WaitLimit: --timeout), each wait for a batch, and for --data's function to return, counts against it."""

    def __init__(self, spec, layout, global_batch, dp_rank, start, steps, data=None, ref=None, waits=None):
        self.spec, self.global_batch, self.ref, self.steps, self.waits = spec, global_batch, ref, steps, waits
        self.mine = replica_slice(layout, dp_rank)
        self.items, self.shared = None, False
        if data is None:
            return
        # What the stages take: each sample's shape and dtype as example_inputs gives them at the micro-batch.
        with torch.random.fork_rng(devices=[]):
            b = layout.micro_batch_size
            self.inputs_like = [(t.shape[1:], t.dtype) for t in inputs_at(spec.example_inputs, b)]
            target = spec.target(b) if spec.target else None
            self.target_like = (target.shape[1:], target.dtype) if isinstance(target, torch.Tensor) else None
        params = inspect.signature(data).parameters
        kwargs = {{"start": start}} if "start" in params else {{}}
        self.shared = "replica" in params and "replicas" in params
        if self.shared:
            kwargs.update(replica=dp_rank, replicas=layout.dp)
        name = ref.rpartition(":")[2]
        try:
            with self.waiting(f"--data {{ref}}: {{name}}() did not return"):
                made = data(**kwargs)
        except Exception as exc:
            raise PlanError(f"--data {{ref}}: {{name}}() raised {{said(exc)}}; fix the function") from None
        try:
            with self.waiting(f"--data {{ref}}: {{name}}() did not return"):
                self.items = iter(made)
        except TypeError:
            raise PlanError(
                f"--data {{ref}}: {{name}}() returned {{type(made).__name__}}, not an iterator; return (or yield) the "
                "(inputs, target) batches"
            ) from None
        if "start" not in params:
            for step in range(start):  # the steps already trained
                seed_step(step, 0)
                self.next_item(step)

    def waiting(self, what):
        return self.waits.waiting(what) if self.waits is not None else contextlib.nullcontext()

    def next_item(self, step):
        try:
            with self.waiting(f"--data {{self.ref}} gave no batch for step {{step}}"):
                return next(self.items)
        except StopIteration:
            raise PlanError(
                f"--data {{self.ref}} ran out at step {{step}}: a run to --steps {{self.steps}} takes a batch a step; "
                "give a longer iterator or fewer --steps"
            ) from None
        except Exception as exc:
            raise PlanError(f"--data {{self.ref}}: its iterator raised {{said(exc)}} at step {{step}}") from None

    def take(self, step):
        """The batch of `step`: its tensors as given (a global batch, or this replica's share), the target, and the
        slice of them this rank trains on."""
        seed_step(step, 0)
        if self.items is None:
            with self.waiting(f"the model's example_inputs({{self.global_batch}}) gave no batch for step {{step}}"):
                inputs = self.spec.example_inputs(self.global_batch)
                target = self.spec.target(self.global_batch) if self.spec.target else None
            return input_tensors(inputs), target, self.mine
        return self.checked(self.next_item(step), step)

    def checked(self, item, step):
        gave = f"--data {{self.ref}} gave"
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise PlanError(f"{{gave}} a {{type(item).__name__}} at step {{step}}; give (inputs, target) pairs")
        inputs, target = item
        try:
            tensors = input_tensors(inputs)
        except PlanError:
            raise PlanError(
                f"{{gave}} inputs of type {{type(inputs).__name__}} at step {{step}}; give a tuple of tensors, a dict "
                "of keyword arguments or (args, kwargs), as example_inputs returns them"
            ) from None
        size = self.mine.stop - self.mine.start if self.shared else self.global_batch
        batch = f"a{{' replica' if self.shared else ''}} batch of {{size}} samples, each as example_inputs gives it"
        if len(tensors) != len(self.inputs_like):
            raise PlanError(
                f"{{gave}} {{len(tensors)}} input tensors at step {{step}}; the model takes {{len(self.inputs_like)}}, "
                "as example_inputs gives them"
            )
        for i, (t, (shape, dtype)) in enumerate(zip(tensors, self.inputs_like)):
            if (t.shape[1:], t.dtype) != (shape, dtype) or t.dim() == 0 or t.shape[0] != size:
                raise PlanError(
                    f"{{gave}} input {{i}} of {{shown(t.shape, t.dtype)}} at step {{step}}; the plan takes "
                    f"{{shown((size, *shape), dtype)}}: {{batch}}"
                )
        if self.target_like is not None:
            shape, dtype = self.target_like
            if not isinstance(target, torch.Tensor):
                raise PlanError(
                    f"{{gave}} a target of type {{type(target).__name__}} at step {{step}}; the loss takes a tensor of "
                    f"{{shown((size, *shape), dtype)}}"
                )
            if (target.shape[1:], target.dtype) != (shape, dtype) or target.dim() == 0 or target.shape[0] != size:
                raise PlanError(
                    f"{{gave}} a target of {{shown(target.shape, target.dtype)}} at step {{step}}; the loss takes "
                    f"{{shown((size, *shape), dtype)}}: {{batch}}"
                )
        return tensors, target, slice(None) if self.shared else self.mine


def agreed(draw, device):
    """draw(), whose PlanError, on any rank, is raised on every rank where `device` is given (the first failing
    rank's message): --data's iterators are the user's, and one replica's may fail alone, while the others would
    wait for it in the step's collectives."""
    problem = out = None
    try:
        out = draw()
    except PlanError as exc:
        if device is None:
            raise
        problem = str(exc)
    if device is not None and reduce(torch.tensor([float(problem is not None)]), dist.ReduceOp.MAX, device).item():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        raise PlanError(next(p for p in problems if p))
    return out


def stopped_before(step, folder):
    """What a run that stopped before `step` leaves: the latest checkpoint in `folder`, kept."""
    latest = latest_checkpoint(folder) if folder else None
    left = f"the latest checkpoint, {{latest}}, is kept" if latest else "no checkpoint was saved"
    return f"training stopped before step {{step}}; {{left}}"


def data_stalled(what, timeout):
    print(
        f"error: {{what}} within --timeout {{timeout:g}} s (the wait for a batch counts against it); ending the run",
        file=sys.stderr,
        flush=True,
    )


def stopped_answering(ranks, silent_s):
    which = f"rank {{ranks[0]}}" if len(ranks) == 1 else f"ranks {{', '.join(map(str, ranks))}}"
    print(
        f"error: {{which}} stopped answering (no heartbeat for {{silent_s:g}} s: stopped, killed or exited early); "
        "ending the run",
        file=sys.stderr,
        flush=True,
    )


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", metavar="FILE", help="use this plan file instead of the plan embedded here")
    parser.add_argument(
        "--steps", type=int, default=10, metavar="N",
        help="optimizer steps to train to, counting those of a resumed checkpoint (default 10)",
    )
    parser.add_argument(
        "--data", metavar="FILE:FUNC",
        help="`file.py:function` returning an iterator of (inputs, target) global batches of {global_batch} samples, "
        "inputs as example_inputs returns them: a tuple of tensors, a dict of keyword arguments, or (args, kwargs) "
        "(default: synthetic batches from the model's example_inputs); a function with parameters `replica` and "
        "`replicas` is called with them and gives only that data-parallel replica's share ({global_batch} / replicas "
        "samples), as a DistributedSampler would; on resuming, a function with a parameter `start` is called with the "
        "step to start from, and otherwise the batches of the steps already trained are drawn and dropped. Each item "
        "must hold the tensors, per-sample shapes and dtypes of example_inputs and target; the first is checked "
        "before step 0, and a bad item, an iterator that raises or one that runs out before --steps stops the run "
        "with one line naming the step. torch's random numbers are seeded for each step's batch and for the step "
        "(dropout) from the step's number, so a resumed run draws what an uninterrupted one draws",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument(
        "--warmup-steps", type=int, default=0, metavar="N",
        help="linear learning-rate warm-up over this many steps (default 0)",
    )
    parser.add_argument(
        "--decay", choices=LR_DECAYS, default="none",
        help="learning-rate decay after the warm-up, to 0.1 x --lr at the last step (default none)",
    )
    parser.add_argument(
        "--clip-grad-norm", type=float, metavar="X",
        help="clip the gradient of the whole model to this norm, as torch.nn.utils.clip_grad_norm_ does in one "
        "process (default: no clipping); the norm each step shows and records is the one before clipping",
    )
    parser.add_argument(
        "--checkpoint", metavar="DIR",
        help="folder for the training state (parameters, optimizer state, step; torch.distributed.checkpoint), "
        "saved as DIR/step-N at the end and every --checkpoint-every steps. If DIR holds one, the run resumes from "
        "the latest, also under another plan of the same model and optimizer (other dp, pp, micro-batches or ZeRO "
        "stage: the state is resharded); give --lr, --warmup-steps, --decay and --steps as before",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N",
        help="steps between checkpoints (default: only at the end)",
    )
    parser.add_argument(
        "--keep-checkpoints", type=int, default=2, metavar="K",
        help="how many of the latest checkpoints to keep (default 2)",
    )
    parser.add_argument(
        "--metrics", metavar="FILE",
        help="write one JSON object a line per step to FILE (rank 0, flushed each step): step (from 0, as the step "
        "line counts), loss (the replicas' mean), lr, grad_norm (before clipping), step_s (the slowest rank's), "
        "tokens_per_s (samples_per_s for a model without token ids), mfu (a fraction of the peak) and "
        "peak_memory_bytes (the largest of any rank, as the step line shows it). mfu is null on a device other than "
        "the plan's (a CPU run of a GPU's plan: the plan's peak says nothing of it) and where the catalog has no "
        "peak for the plan's precision; a figure that is not finite (a diverged loss) is null. A run from step 0 "
        "starts FILE afresh; a resumed run keeps the lines of the steps before it and continues FILE",
    )
    parser.add_argument(
        "--tensorboard", metavar="DIR",
        help="write the same figures as TensorBoard scalars to DIR (needs `pip install tensorboard`); a resumed "
        "run drops the events of the steps from the one it resumes at",
    )
    parser.add_argument(
        "--save-params", metavar="FILE",
        help="write this rank's parameters after training to FILE.rank<R>.pt (for checking against one process)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S",
        help="seconds after which a rank that stopped answering (stopped, killed, exited) ends the run, rank 0 "
        "saying which, and the longest a rank waits for a batch (--data's function or iterator, or the model's "
        "example_inputs), after which it ends the run saying what it waited for; also init_process_group's timeout "
        "(default 600)",
    )
    return parser


def train(args, data=None, waits=None):
    """Train as the plan says, from the latest checkpoint in --checkpoint if there is one; `data` is --data's
    function, `waits` the WaitLimit each wait for a batch counts against."""
    document = read_plan_file(args.plan) if args.plan else plan_file_from_json(PLAN, "embedded plan")
    layout, workload = document.plan.layout, document.workload
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    spec = load_model(document.model)
    rank0 = dist.get_rank() == 0
    torch.manual_seed(SEED)  # every rank builds the same initial model
    model = spec.build()
    other = other_device(document.cluster.gpu, device)
    gpu_peak = peak_flops(document.cluster.gpu, workload.precision, other)
    flops = None
    if gpu_peak is not None:  # MFU: rank 0 counts the model's FLOPs while the others wait, so no step times the wait
        flops = model_flops(spec, model, layout, document.leaf_modules) if rank0 else None
        dist.barrier()
    trainer = build_trainer(
        spec, model, layout, optimizer_factory(workload.optimizer, args.lr),
        device=device, leaf_modules=document.leaf_modules, precision=workload.precision,
    )
    start = 0
    resume = latest_checkpoint(args.checkpoint) if args.checkpoint else None
    if resume is not None:
        start = load_checkpoint(trainer, resume)
        if rank0:
            print(f"resumed from {{resume}} (step {{start}})", flush=True)
    # The batches, --data's first checked before any step: where one rank's fail, every rank stops alike.
    collective = device if data is not None else None
    batches = agreed(
        lambda: Batches(
            spec, layout, workload.global_batch, trainer.dp_rank, start, args.steps, data, args.data, waits
        ),
        collective,
    )
    batch = agreed(lambda: batches.take(start), collective) if start < args.steps else None
    schedule = torch.optim.lr_scheduler.LambdaLR(
        trainer.optimizer, lambda step: lr_factor(start + step, args.steps, args.warmup_steps, args.decay)
    )
    predicted = document.plan.predicted
    writer = None
    if args.tensorboard and rank0:
        from torch.utils.tensorboard import SummaryWriter  # checked in main: tensorboard is installed

        writer = SummaryWriter(args.tensorboard, purge_step=start or None)
    metrics = Metrics(args.metrics, writer, start) if rank0 else None
    planned_time = f"(plan {{predicted.iteration_s * 1e3:.1f}}) " if other is None else ""
    times = []
    memory = None if cuda else CpuMemory(trainer)
    warmup = 1 if cuda else min(2, args.steps - start)  # steps left out of the median
    for step in range(start, args.steps):
        if step > start:
            try:
                batch = agreed(lambda: batches.take(step), collective)
            except PlanError as exc:
                if metrics is not None:
                    metrics.close()
                raise PlanError(f"{{exc}}; {{stopped_before(step, args.checkpoint)}}") from None
        tensors, target, take = batch
        seed_step(step, 1)
        if cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        lr = trainer.optimizer.param_groups[0]["lr"]  # this step's, before the schedule moves on
        # An infinite norm clips nothing and still measures the gradient's norm for the step line and --metrics: a
        # pass over the gradients and one all-reduce of a number, as torchtitan pays every step.
        max_norm = args.clip_grad_norm if args.clip_grad_norm is not None else float("inf")
        losses = trainer.step(tuple(t[take] for t in tensors), target[take] if target is not None else None, max_norm)
        schedule.step()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - began
        if cuda:
            peak_bytes = float(torch.cuda.max_memory_allocated(device))
        else:
            if memory.counting:
                held = sum(t[take].numel() * t.element_size() for t in tensors) if trainer.has_first else 0
                memory.after_step(held, step == args.steps - 1)
            peak_bytes = memory.peak
        # Every rank's figures to rank 0, which alone reports: the replicas' mean loss (the last stages hold the
        # losses), the slowest rank's step and its peak memory.
        total = torch.stack(losses).sum().item() if losses else 0.0
        figures = torch.tensor([total, float(len(losses)), elapsed, peak_bytes], dtype=torch.float64)
        summed = reduce(figures, dist.ReduceOp.SUM, device)
        largest = reduce(figures, dist.ReduceOp.MAX, device)
        step_s, peak = largest[2].item(), largest[3].item()
        times.append(step_s)
        if rank0:
            loss = summed[0].item() / max(summed[1].item(), 1.0)
            rate, what = throughput(tensors, workload.global_batch, step_s)
            mfu = flops / (step_s * layout.num_gpus * gpu_peak) if flops is not None else None
            shown_mfu = f"MFU {{mfu * 100:.1f}}% " if mfu is not None else ""
            print(
                f"step {{step}} loss {{loss:.6f}} lr {{lr:.4g}} grad norm {{trainer.grad_norm:.4g}} "
                f"time {{step_s * 1e3:.1f}} ms {{planned_time}}{{shown_rate(rate, what)}} {{shown_mfu}}"
                f"peak memory {{memory_pair(peak, predicted.peak_memory_bytes)}}",
                flush=True,
            )
            metrics.record(
                {{
                    "step": step, "loss": loss, "lr": lr, "grad_norm": trainer.grad_norm, "step_s": step_s,
                    f"{{what}}_per_s": rate, "mfu": mfu, "peak_memory_bytes": int(peak),
                }}
            )
        done = step + 1
        if args.checkpoint and (done == args.steps or args.checkpoint_every and done % args.checkpoint_every == 0):
            save_checkpoint(trainer, done, args.checkpoint, args.keep_checkpoints)
    if rank0 and len(times) > warmup and predicted.iteration_s > 0:
        gpu = document.cluster.gpu.name
        print(summary(times, warmup, start, predicted.iteration_s, other, gpu), flush=True)
    if metrics is not None:
        metrics.close()
    if args.save_params:
        try:
            torch.save(trainer.parameters(), f"{{args.save_params}}.rank{{dist.get_rank()}}.pt")
        except OSError as exc:
            written = f"{{args.save_params}}.rank{{dist.get_rank()}}.pt"
            raise PlanError(f"--save-params cannot write {{written}}: {{exc.strerror or exc}}") from None
    dist.barrier()


def checked_options(args):
    """One line for options that cannot work, before any process group is made: every rank meets them alike.
    Returns --data's function (None without --data)."""
    if not 0 < args.timeout <= 1e9:
        raise PlanError(f"--timeout takes seconds in (0, 1e9], got {{args.timeout}}")
    if not 0 <= args.lr < float("inf"):
        raise PlanError(f"--lr takes a finite learning rate >= 0, got {{args.lr}}")
    if args.clip_grad_norm is not None and not 0 < args.clip_grad_norm < float("inf"):
        raise PlanError(f"--clip-grad-norm takes a positive norm, got {{args.clip_grad_norm}}")
    if args.checkpoint_every < 0 or args.keep_checkpoints < 1:
        raise PlanError("--checkpoint-every takes steps >= 0 and --keep-checkpoints a count >= 1")
    if args.save_params:
        try:
            check_writable(f"{{args.save_params}}.rank0.pt")
        except PlanError as exc:
            raise PlanError(f"--save-params {{exc}}") from None
    if args.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")  # whether TensorBoard is installed, before training
        except ImportError:
            raise PlanError("--tensorboard needs TensorBoard, which is not installed: pip install tensorboard")
    return data_function(args.data) if args.data else None


def main():
    args = build_parser().parse_args()
    code = 0
    heartbeat = None
    try:
        data = checked_options(args)
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            world = PLAN["plan"]["dp"] * PLAN["plan"]["pp"]
            raise PlanError(
                f"run this script under torchrun, one process per GPU of the plan: "
                f"torchrun --nproc-per-node {{world}} {{sys.argv[0]}}"
            )
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
        heartbeat = Heartbeat(args.timeout, stopped_answering) if dist.get_world_size() > 1 else None
        train(args, data, WaitLimit(args.timeout, data_stalled, heartbeat))
    except RuntimeError:
        # A collective failed (torch's distributed errors are RuntimeErrors): if a rank stopped answering, say which
        # instead of a traceback from every rank; any other error goes on as it is.
        stopped = heartbeat.stopped() if heartbeat is not None else []
        if not stopped:
            raise
        heartbeat.end(stopped, 4 * heartbeat.interval)
    except PlanError as exc:
        # Every rank meets the same bad input (plan, model, world size), so none waits for another. Rank 0 says
        # it and fails the launch; the others leave quietly, since torchrun stops every rank at the first failure
        # and could stop rank 0 before it has said why.
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {{exc}}", file=sys.stderr, flush=True)
            code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    # Meshes sometimes abort at exit after a clean shutdown on torch 2.13; leave at once.
    os._exit(code)


if __name__ == "__main__":
    main()
'''


def _docstring_text(text: str) -> str:
    """`text` as it may stand inside the script's docstring: quotes, backslashes and control characters escaped
    as in a JSON string, so that no value of the plan can end the docstring and be run as code."""
    return json.dumps(text)[1:-1]


def render_script(document: PlanFile, name: str = "train.py") -> str:
    """The text of the training script for `document`.

    Every value of the plan enters the script as data: strings in the docstring escaped (`_docstring_text`), the
    plan itself as JSON in a raw string literal, which JSON text cannot end (every quote inside a JSON string is
    escaped, and JSON has no three quotes in a row), and numbers formatted from ints."""
    layout, cluster = document.plan.layout, document.cluster
    tp = f" x tp {layout.tp}{' + SP' if layout.sequence_parallel else ''}" if layout.tp > 1 else ""
    ep = f" (experts split over ep {layout.ep})" if layout.ep > 1 else ""
    summary = _docstring_text(
        f"{document.model}, dp {layout.dp}{ep}{tp} x pp {layout.pp}, {layout.schedule}, micro-batch "
        f"{layout.micro_batch_size} x {layout.num_microbatches}, ZeRO-{layout.zero_stage}"
    )
    per_node = min(cluster.gpus_per_node, layout.num_gpus)
    nodes = -(-layout.num_gpus // per_node)
    plan_json = json.dumps(document.to_json(), indent=2, ensure_ascii=True, allow_nan=False)
    if '"""' in plan_json:  # cannot happen for JSON text; kept as the guard the literal relies on
        raise ValueError("the plan's JSON holds three quotes in a row")
    return _TEMPLATE.format(
        summary=summary,
        nodes=int(nodes),
        per_node=int(per_node),
        name=_docstring_text(shlex.quote(name)),
        global_batch=int(document.workload.global_batch),
        plan_json=plan_json,
    )


def write_script(path: str | Path, document: PlanFile) -> None:
    """Write the script atomically: an interrupted run never leaves half a script."""
    write_atomic(path, render_script(document, Path(path).name))
