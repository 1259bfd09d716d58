"""The `pyplan` command line: exit 0 on success, 2 on bad input, 1 on an internal error."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import torch
from rich.console import Console
from rich.text import Text
from torch import nn

from pyplan import _core
from pyplan._files import check_writable, write_atomic
from pyplan._torch import find_dynamo_skips, meta_build, one_value_per_channel
from pyplan._version import __version__
from pyplan.api import memory_per_process, search
from pyplan.cli.calibrate import add_calibrate_parser
from pyplan.cli.hardware import add_hardware_parser
from pyplan.cli.limits import CaptureLimit
from pyplan.cli.show import add_show_parser
from pyplan.cli.zoo import add_zoo_parser
from pyplan.emit.configs import TORCHTITAN_VERSIONS, render_config
from pyplan.emit.planfile import PlanFile, read_plan_file, write_plan_file
from pyplan.emit.script import write_script
from pyplan.errors import PlanError, TraceError
from pyplan.graph.chain import Chain
from pyplan.graph.experts import expert_leaves, find_expert_layers
from pyplan.graph.linearize import linearize
from pyplan.graph.sequence_parallel import sequence_zone
from pyplan.graph.tensor_parallel import derive_tp_plan, read_tp_plan, vocab_parallel_loss
from pyplan.graph.trace import ExampleInputs, source_line, trace
from pyplan.hardware.cluster import Cluster
from pyplan.load import load_model
from pyplan.model_state import OPTIMIZERS, PRECISIONS
from pyplan.plan import ZERO_STAGES, Plan, Workload
from pyplan.profile import TimingOptions, default_batch_sizes, local_device, profile, sizes_from_two
from pyplan.profile.capture import is_local
from pyplan.report.console import make_console, spinner
from pyplan.report.html import write_html_report
from pyplan.report.inspect import (
    expert_parallel_data,
    inspect_data,
    render_expert_parallel,
    render_inspect,
    render_tensor_parallel,
    tensor_parallel_data,
)
from pyplan.report.pareto import parse_weights, write_pareto
from pyplan.report.plans import render_plans
from pyplan.solve.remat_search import OFFLOAD_MODES, REMAT_MODES
from pyplan.spec import default_loss
from pyplan.units import fmt_bytes, fmt_seconds

__all__ = ["main"]

_INSPECT_EXAMPLES = """examples:
  pyplan inspect examples/resnet.py
  pyplan inspect examples/gpt.py --batch-size 8 --json
  pyplan inspect zoo:gpt2-xl --analytic          # FLOPs and bytes on the meta device, no weights allocated
  pyplan inspect model.py:build_big --leaf MyAttention
"""


def _user_code(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """Around the work that runs the user's code (importing, building, tracing and profiling the model): under --json
    what it prints goes to stderr, so that stdout holds pyplan's JSON alone."""
    return contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext()


def _norm_named(exc: BaseException, model: torch.nn.Module) -> str:
    """The BatchNorm that raised `exc`, by its name in `model` and its class (read off the traceback's frames)."""
    names = {id(m): name for name, m in model.named_modules()}
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        module = frame.f_locals.get("self")
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and id(module) in names:
            return f"module '{names[id(module)]}' ({type(module).__name__})"
    return "a BatchNorm"


def _cannot_run_at(exc: BaseException, model: torch.nn.Module, batch_size: int) -> PlanError:
    """One line for a model that cannot train at --batch-size: the BatchNorm that sees one value per channel."""
    return PlanError(
        f"{_norm_named(exc, model)} sees one value per channel at --batch-size {batch_size}, and a BatchNorm in "
        "training mode needs more than one; inspect it with --batch-size 2 or more"
    )


def _profiled(
    chain: Chain, model: torch.nn.Module, example_inputs: ExampleInputs, args: argparse.Namespace, options: Any
) -> Chain:
    """`chain` profiled at a quarter, half and all of --batch-size (`default_batch_sizes`); from 2 samples where a
    BatchNorm cannot train on one."""
    measure = not args.analytic
    try:
        return profile(
            chain, example_inputs, measure=measure, options=options, batch_sizes=default_batch_sizes(args.batch_size)
        )
    except Exception as exc:
        if one_value_per_channel(exc) is None:
            raise
    try:
        sizes = sizes_from_two(default_batch_sizes(args.batch_size))
        return profile(chain, example_inputs, measure=measure, options=options, batch_sizes=sizes)
    except Exception as exc:
        cause = one_value_per_channel(exc)
        if cause is None:
            raise
        raise _cannot_run_at(cause, model, args.batch_size) from exc


def _inspect(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise PlanError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.tp is not None and not 2 <= args.tp <= 1024:
        raise PlanError(f"--tp takes a degree from 2 to 1024, got {args.tp}")
    if args.ep is not None and args.ep < 1:
        raise PlanError(f"--ep takes a degree of 1 or more (ranks that split each layer's experts), got {args.ep}")
    for flag, value, least in (
        ("--threads", args.threads, 1),
        ("--repeats", args.repeats, 1),
        ("--warmup", args.warmup, 0),
        ("--min-blocks", args.min_blocks, 1),
        ("--max-blocks", args.max_blocks, args.min_blocks),
    ):
        if value < least:
            raise PlanError(f"{flag} must be at least {least}, got {value}")
    for flag, value in (("--repeats", args.repeats), ("--warmup", args.warmup), ("--threads", args.threads)):
        if value > 10_000:
            raise PlanError(f"{flag} must be at most 10,000 (each block runs that many times), got {value}")
    if args.corun < 0:
        raise PlanError(f"--corun must be 0 or more, got {args.corun}")
    options = TimingOptions(warmup=args.warmup, repeats=args.repeats, threads=args.threads, corun=args.corun)
    limit = CaptureLimit.from_env(args.model)
    with _user_code(args):
        with limit.importing():
            spec = load_model(args.model)
        spec = limit.spec(spec)
        if args.analytic:
            with meta_build():
                model = spec.build()
        else:
            model = spec.build()
        with spinner(f"inspecting {args.model}") as say:
            say("tracing")
            try:
                # With --ep, the capture a plan with expert parallelism cuts: each layer's experts kept whole.
                leaves = [*args.leaf, *expert_leaves(model)] if args.ep is not None else args.leaf
                with limit.tracing():
                    graph = trace(model, spec.example_inputs, leaf_modules=leaves, batch_size=args.batch_size)
            except PlanError as exc:
                cause = one_value_per_channel(exc)
                if cause is None:
                    raise
                raise _cannot_run_at(cause, model, args.batch_size) from exc
            chain = linearize(graph, min_blocks=args.min_blocks, max_blocks=args.max_blocks)
            experts = None if args.ep is None else expert_parallel_data(find_expert_layers(graph), args.ep, spec.name)
            say("profiling")
            chain = _profiled(chain, model, spec.example_inputs, args, options)
    data = inspect_data(
        chain,
        model=spec.name,
        batch_size=args.batch_size,
        device=str(local_device()),
        threads=args.threads,
        optimizer=args.optimizer,
        precision=args.precision,
    )
    if args.tp is not None:
        with _user_code(args):
            plan = derive_tp_plan(graph)
            vocab = vocab_parallel_loss(graph, plan, args.tp, spec.loss)
            zone = sequence_zone(graph, plan, args.tp)
        data["tensor_parallel"] = tensor_parallel_data(plan, zone, args.tp, vocab)
    if experts is not None:
        data["expert_parallel"] = experts
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        console = make_console()
        render_inspect(data, console)
        if args.tp is not None:
            render_tensor_parallel(data["tensor_parallel"], console)
        if experts is not None:
            render_expert_parallel(experts, console)
    return 0


_PLAN_EXAMPLES = """examples:
  pyplan plan examples/gpt.py --gpus 4 --gpu local --global-batch 32       # processes on this machine
  pyplan plan zoo:gpt2-xl --gpus 64 --gpu a100-80g --gpus-per-node 8 --global-batch 512 --precision bf16-mixed
  pyplan plan zoo:resnet50 --gpus 16 --instance p4d.24xlarge --objective cost --out plan.json
  pyplan plan model.py --cluster cluster.toml --objective weighted --weight 4096 --json
"""


def _precision(given: str | None, cluster: Cluster) -> tuple[str, str]:
    """The precision `pyplan plan` plans with, and what the header says of a default: bf16-mixed where every GPU of
    the cluster is a catalog GPU with a bf16 peak (how such GPUs train: torchtitan's and Megatron-LM's default), else
    fp32 (this machine's processes, a GPU without bf16)."""
    if given is not None:
        return given, ""
    gpus = [g.gpu for g in cluster.groups]
    if any(g.name == "local" for g in gpus):
        return "fp32", ""
    without = [g.name for g in gpus if not g.peak_flops_per_s.get("bf16")]
    if without:
        return "fp32", f" (default: {without[0]} has no bf16)"
    return "bf16-mixed", f" (default on {gpus[0].name})"


def _cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        if args.gpu or args.instance or args.gpus_per_node or args.gpus is not None:
            raise PlanError("--cluster describes the whole cluster; drop --gpus, --gpu, --instance and --gpus-per-node")
        return Cluster.from_file(args.cluster)
    if args.gpus is None or not 1 <= args.gpus <= _core.MAX_GPUS:
        raise PlanError(f"--gpus must be a number of GPUs from 1 to {_core.MAX_GPUS:,}, got {args.gpus}")
    return Cluster.from_catalog(
        gpu=args.gpu if args.gpu or args.instance else "local",
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        instance=args.instance,
        price_per_gpu_hour=args.price_per_gpu_hour,
        currency=args.currency,
    )


# How many plans the search that gives the answer ranks: the best is the best of the plans it refines, so it
# depends on this number alone, never on how many rows or pictures are asked for.
ANSWER_TOP_K = 5


def _pins(args: argparse.Namespace) -> dict[str, tuple[Any, ...]]:
    """The search's restrictions from the pin options given (none: an empty dict)."""
    given = {
        "data_parallel": args.dp,
        "pipeline_ranks": args.pp,
        "micro_batch_sizes": args.micro_batch,
        "num_microbatches": args.ga,
        "schedules": args.schedule,
        "zero_stages": args.zero,
    }
    for flag, value in (("--dp", args.dp), ("--pp", args.pp), ("--micro-batch", args.micro_batch), ("--ga", args.ga)):
        if value is not None and value < 1:
            raise PlanError(f"{flag} takes a whole number of at least 1, got {value}")
    if args.dp is not None and args.pp is not None and args.gpus is not None and args.dp * args.pp > args.gpus:
        raise PlanError(f"--dp {args.dp} x --pp {args.pp} needs {args.dp * args.pp} GPUs; --gpus offers {args.gpus}")
    pins = {k: (v,) for k, v in given.items() if v is not None}
    if args.chunks is not None:
        pins["stages_per_rank"] = _whole_numbers(
            args.chunks, "--chunks takes stages per pipeline rank separated by commas (1: GPipe, 1F1B; 2 or more: "
            "the interleaved schedules)")  # fmt: skip
    if args.cuts is not None:
        pins["stage_cuts"] = _whole_numbers(
            args.cuts, "--cuts takes block numbers separated by commas (the blocks where stages 2, 3, ... start, as "
            "`pyplan inspect` numbers them)")  # fmt: skip
    return pins


def _whole_numbers(text: str, what: str) -> tuple[int, ...]:
    """`text`'s comma-separated whole numbers; PlanError saying `what` the flag takes otherwise."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"{what}, got '{text}'") from None


def _tensor_parallel(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    """The search's tensor-parallel options from --tp and --tp-plan: without --tp, every degree (auto) on a catalog
    GPU, none on this machine's (`local`, whose profile is measured, not split)."""
    g = cluster.gpus_per_node
    text = args.tp.strip() if args.tp is not None else ("1" if is_local(cluster.gpu) else "auto")
    if text == "auto":
        degrees: tuple[int, ...] = tuple(t for t in range(1, min(8, g) + 1) if g % t == 0)
    else:
        try:
            degrees = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise PlanError(
                f"--tp takes auto, a degree or degrees separated by commas (e.g. 1,2,4), got '{text}'"
            ) from None
        if any(t < 1 for t in degrees):
            raise PlanError(f"--tp takes degrees of at least 1, got '{text}'")
    found: dict[str, Any] = {"tensor_parallel": degrees, "sequence_parallel": args.sp == "on"}
    if args.tp_plan is not None:
        if degrees == (1,):
            raise PlanError(
                "--tp-plan says how layers split under tensor parallelism: plan on a catalog GPU (--gpu NAME) with "
                "--tp auto or --tp DEGREE"
            )
        found["tp_plan"] = read_tp_plan(args.tp_plan)
    return found


# The largest expert-parallel degree `--ep auto` tries.
MAX_AUTO_EP = 64


def _expert_counts(model: nn.Module) -> list[int]:
    """The routed experts of each mixture-of-experts layer of `model` (pyplan/graph/experts.py `expert_leaves`): the
    first dimension of its stacked parameters, or the length of its list of experts."""
    counts = []
    for path in expert_leaves(model):
        module = model.get_submodule(path)
        stacked = [p.shape[0] for p in module.parameters(recurse=False) if p.dim() == 3]
        lists = [len(c) for c in module.children() if isinstance(c, nn.ModuleList)]
        counts.extend((stacked or lists)[:1])
    return counts


def _expert_parallel(args: argparse.Namespace, cluster: Cluster, model: nn.Module) -> tuple[int, ...]:
    """The expert-parallel degrees from --ep: without it, every degree (auto) for a model with mixture-of-experts
    layers on a catalog GPU, else none; auto is 1 and every E up to MAX_AUTO_EP that divides every layer's experts
    and the GPUs."""
    counts = _expert_counts(model)
    text = args.ep.strip() if args.ep is not None else ("auto" if counts and not is_local(cluster.gpu) else "1")
    if text == "auto":
        return (
            1,
            *(e for e in range(2, MAX_AUTO_EP + 1) if counts and all(n % e == 0 for n in (*counts, cluster.gpus))),
        )
    try:
        degrees = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise PlanError(
            f"--ep takes auto, a degree or degrees separated by commas (e.g. 1,2,4), got '{text}'"
        ) from None
    if any(e < 1 for e in degrees):
        raise PlanError(f"--ep takes degrees of at least 1, got '{text}'")
    return degrees


def _tp_line(searched: Sequence[int], left_out: Sequence[tuple[int, str]]) -> str:
    """The header's line on tensor parallelism: the degrees searched, each left out with why."""
    line = f"tensor parallelism searched at {', '.join(map(str, searched))} (--tp 1: none)"
    if left_out:
        line += "; left out: " + "; ".join(f"{t}, as {why}" for t, why in left_out)
    return line


def _ep_line(searched: Sequence[int], left_out: Sequence[tuple[int, str]]) -> str:
    """The header's line on expert parallelism: the degrees searched, each left out with why."""
    line = f"expert parallelism searched at {', '.join(map(str, searched)) or 'no degree'} (--ep 1: none)"
    if left_out:
        line += "; left out: " + "; ".join(f"{e}, as {why}" for e, why in left_out)
    return line


def _versus_best(pinned: Plan, best: Plan) -> str:
    """One line: how far the pinned plan is from the best plan without pins, in the objective's terms."""
    lay = best.layout
    what = (
        f"dp={lay.dp} {f'ep={lay.ep} ' if lay.ep > 1 else ''}{f'tp={lay.tp} ' if lay.tp > 1 else ''}pp={lay.pp} "
        f"{f'chunks={lay.stages_per_rank} ' if lay.stages_per_rank > 2 else ''}b={lay.micro_batch_size} "
        f"GA={lay.num_microbatches} {lay.schedule} "
        f"ZeRO-{lay.zero_stage}"
    )
    a, b = pinned.predicted.iteration_s, best.predicted.iteration_s
    if _key_of(pinned) == _key_of(best):
        return f"the pinned plan is also the best without pins ({what})"
    gap = f"{(a / b - 1) * 100:+.1f} % iteration time" if b > 0 else "-"
    return f"without the pins the best plan is {what}: {fmt_seconds(b)} per iteration; the pinned plan {gap}"


def _key_of(p: Plan) -> tuple[Any, ...]:
    lay = p.layout
    return (lay.dp, lay.tp, lay.ep, lay.pp, lay.stages_per_rank, lay.micro_batch_size, lay.num_microbatches,
            lay.schedule, lay.zero_stage, lay.placement)  # fmt: skip


def _portable(ref: str) -> str:
    """`ref` as the plan file and the emitted script keep it: a model file by its absolute path, so that they run
    from any directory; zoo:, hf: and timm: references as they are."""
    if ref.startswith(("zoo:", "hf:", "timm:")):
        return ref
    path, colon, func = ref.partition(":") if ref.count(":") == 1 and not os.path.exists(ref) else (ref, "", "")
    return os.path.abspath(path) + colon + func


def _plan(args: argparse.Namespace) -> int:
    """`pyplan plan`: check the outputs, search once for the answer (and again for more rows or pictures, and
    without the pins), write what was asked, print the table or JSON."""
    if args.top < 1:
        raise PlanError(f"--top must be at least 1, got {args.top}")
    if args.offload != "none" and args.remat != "auto":
        raise PlanError("--offload plans offloading within --remat auto's plans: add --remat auto")

    for output in (args.out, args.emit, args.pareto, args.report):
        if output:
            check_writable(output)  # before the search, not after it
    cluster = _cluster(args)
    if args.pareto and any(g.price_per_gpu_hour is None for g in cluster.groups):
        raise PlanError(
            "--pareto draws time against cost, and the cluster has no price: give --price-per-gpu-hour with "
            "--currency, or an --instance"
        )
    precision, chosen = _precision(args.precision, cluster)
    workload = Workload(
        global_batch=args.global_batch,
        optimizer=args.optimizer,
        precision=precision,
        dataset_samples=args.dataset_size,
    )
    limit = CaptureLimit.from_env(args.model)
    with _user_code(args):
        with limit.importing():
            spec = load_model(args.model)
        spec = limit.spec(spec)
        if cluster.gpu.name != "local":
            with meta_build():
                model = spec.build()
        else:
            model = spec.build()
    options: dict[str, Any] = dict(
        objective=args.objective,
        weight=args.weight,
        allow_fewer_gpus=not args.all_gpus,
        memory_fraction=args.memory_fraction,
        leaf_modules=args.leaf,
        remat=args.remat,
        offload=args.offload,
        # The loss the emitted script trains with (pyplan.runtime: the model's own, else mean squared error).
        loss=spec.loss or default_loss,
        target=spec.target,
    )
    pins = _pins(args)
    options.update(_tensor_parallel(args, cluster))
    options["expert_parallel"] = _expert_parallel(args, cluster, model)
    # The answer comes from one search whatever is shown: the best of the plans refined from the core's first
    # candidates. More rows (--top) or the pictures refine more candidates, in a second search on the same profile.
    with _user_code(args), spinner(f"planning {args.model}") as shown, limit.searching(shown) as say:

        def searched(**extra: Any) -> Any:
            return search(model, spec.example_inputs, cluster, workload, **options, progress=say, **extra)

        try:
            result = searched(**pins, top_k=ANSWER_TOP_K)
        except TraceError as exc:
            if cluster.gpu.name == "local" or _value_read_on_meta(exc) is None:
                raise
            model = _built_for_values(spec, model, exc)  # `searched` calls the model built last
            result = searched(**pins, top_k=ANSWER_TOP_K)
        shown_k = max(args.top, 200) if args.pareto or args.report else args.top
        more = searched(**pins, top_k=shown_k, chain=result.chain) if shown_k > ANSWER_TOP_K else result
        # With pins, the best plan without them, for how far the pinned one is from it (the profile is reused).
        unpinned = searched(top_k=ANSWER_TOP_K, chain=result.chain) if pins else None
        rows = [result.best, *(p for p in (more.best, *more.alternatives) if _key_of(p) != _key_of(result.best))]
    # The capture the plan indexes, as the search made it (a mixture of experts' layers each kept whole).
    leaves = result.chain.graph.leaf_modules
    document = PlanFile(
        model=_portable(args.model), workload=workload, cluster=cluster, plan=result.best, leaf_modules=leaves
    )
    with _user_code(args):  # the training script and the HTML report load the model again
        written = _write_outputs(args, document, more)
    if args.json:
        data = {"model": args.model, "workload": workload.to_json(), "cluster": cluster.to_json(), **result.to_json()}
        data["alternatives"] = [p.to_json() for p in rows[1 : args.top]]
        if unpinned is not None:
            data["pins"] = {k: list(v) for k, v in pins.items()}
            data["without_pins"] = unpinned.best.to_json()
        print(json.dumps(data, indent=2))
    else:
        title = (
            f"{spec.name} on {cluster.gpus} x {cluster.gpu.name}, global batch {workload.global_batch}, "
            f"{precision}{chosen} ({result.profiled_on}; {result.evaluated} of {result.candidates} configurations "
            "evaluated)"
        )
        memory = memory_per_process(cluster) * args.memory_fraction
        console = make_console()
        tp_searched = result.tensor_parallel != (1,) or bool(result.tp_left_out)
        if tp_searched:
            console.print(_tp_line(result.tensor_parallel, result.tp_left_out), highlight=False)
        ep_searched = result.expert_parallel != (1,) or bool(result.ep_left_out)
        if ep_searched:
            console.print(_ep_line(result.expert_parallel, result.ep_left_out), highlight=False)
        render_plans(rows[: args.top], console, title=title, memory_bytes=memory, tp_searched=tp_searched,
                     ep_searched=ep_searched)  # fmt: skip
        if unpinned is not None:
            make_console().print(_versus_best(result.best, unpinned.best))
    for path in written:  # on stderr beside --json, whose stdout is the JSON alone
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


# The largest model whose weights `pyplan plan` builds on the host where its forward needs tensor values that a
# model on the meta device does not have (2 GiB: 500M fp32 parameters).
VALUES_BUILD_BYTES = 2 * 2**30


def _value_read_on_meta(exc: BaseException) -> str | None:
    """Where a capture on the meta device stopped because the forward read a tensor's values (`.item()`,
    `.tolist()`, an op whose output size depends on values): the model's source line, or "" where unknown; None if
    it did not stop for that."""
    found: str | None = None
    seen: BaseException | None = exc
    while seen is not None:
        # torch.fx's interpreter appends the model's own source lines ("Original traceback:") to the error.
        text = "\n".join([str(seen), *getattr(seen, "__notes__", [])])
        if "cannot be called on meta tensors" in text or ("nonzero" in text and "meta" in text.lower()):
            found = found or ""
            source = source_line(text.split("Original traceback:", 1)[1]) if "Original traceback:" in text else None
            if source is not None:
                path, number, code = source
                found = f"`{code}` at {os.path.basename(path)}:{number}" if code else f"{path}:{number}"
        seen = seen.__cause__ or seen.__context__
    return found


def _built_for_values(spec: Any, meta_model: nn.Module, exc: TraceError) -> nn.Module:
    """The model built with weights on the host, for a forward that reads tensor values (a mixture of experts'
    token counts per expert), which is planned on fake tensors and, where values are read, real ones; one line
    where its weights are too large to build here."""
    weights = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    where = _value_read_on_meta(exc)
    if weights > VALUES_BUILD_BYTES:
        raise PlanError(
            f"the model reads tensor values in its forward{f' ({where})' if where else ''}, which a model without "
            f"weights (the meta device) does not have, and its {fmt_bytes(weights)} of weights are more than pyplan "
            f"builds on this host ({fmt_bytes(VALUES_BUILD_BYTES)}): plan a smaller configuration of it"
        ) from None
    return spec.build()


def _write_outputs(args: argparse.Namespace, document: PlanFile, shown: Any) -> list[str]:
    """The files `pyplan plan` was asked for: plan.json, the training script, the Pareto picture and the HTML report
    (their pictures over the plans `shown`); returns their paths."""
    written: list[str] = []
    if args.out:
        write_plan_file(args.out, document)
        written.append(args.out)
    if args.emit:
        write_script(args.emit, document)
        written.append(args.emit)
    if args.pareto or args.report:
        weights = parse_weights(args.pareto_weights)
        if args.pareto:
            write_pareto(shown, args.pareto, weights=weights)
            written.append(args.pareto)
        if args.report:
            write_html_report(document, args.report, search=shown, weights=weights)
            written.append(args.report)
    return written


def _emit(args: argparse.Namespace) -> int:
    document = read_plan_file(args.plan_file)
    if args.format == "script":
        write_script(args.out, document)
        make_console().print(f"wrote {args.out}; run it with torchrun (see its docstring)")
        return 0

    # The configuration is checked against the model, loaded and traced again: what its code prints goes to stderr,
    # so that the configuration written to stdout is the tool's alone.
    with contextlib.redirect_stdout(sys.stderr):
        text, notes = render_config(document, args.format, torchtitan_version=args.torchtitan_version)
    if args.out == "train.py":  # the default belongs to the script
        print(text, end="")
    else:
        write_atomic(args.out, text)
        print(f"wrote {args.out}")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


class _UsageError(Exception):
    """A command line argparse refuses: `parser` is the (sub)command's parser, the message argparse's."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors `main` prints as one line (the usage block only under --debug); the
    subcommands' parsers are of this class too (add_subparsers makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _parser() -> argparse.ArgumentParser:
    """The `pyplan` command line: a subcommand each, the others' parsers added by their modules."""
    parser = _Parser(
        prog="pyplan", description="Plan distributed PyTorch training: how to split a model over GPUs, with numbers."
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"pyplan {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_inspect_parser(sub)
    _add_plan_parser(sub)
    _add_emit_parser(sub)
    add_hardware_parser(sub)
    add_show_parser(sub)
    add_calibrate_parser(sub)
    add_zoo_parser(sub)
    return parser


def _add_inspect_parser(sub: Any) -> None:
    """`pyplan inspect`."""
    p = sub.add_parser(
        "inspect",
        help="trace, linearize and profile a model; print its blocks",
        description="Trace a model with torch.fx, group it into blocks between pipeline cut points, and print "
        "each block's parameters, FLOPs, bytes saved for backward, bytes across its cut, and measured time.",
        epilog=_INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model.py, model.py:function, zoo:NAME, hf:MODEL_TYPE[:key=value,...] or timm:NAME")
    p.add_argument("--batch-size", type=int, default=8, help="batch the figures are given at (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON (keys in the README) instead of a table")
    p.add_argument("--analytic", action="store_true", help="build on the meta device: FLOPs and bytes, no timing")
    p.add_argument(
        "--leaf",
        action="append",
        default=[],
        metavar="NAME",
        help="module class or qualified name to keep whole when tracing (repeatable)",
    )
    p.add_argument(
        "--min-blocks",
        type=int,
        default=16,
        help="refine the module hierarchy until the chain has this many blocks (default 16)",
    )
    p.add_argument("--max-blocks", type=int, default=128, help="but never more than this (default 128)")
    p.add_argument(
        "--tp",
        type=int,
        metavar="T",
        help="also show how tensor parallelism T splits the model: each module's style, the ones left whole and "
        "why, and whether sequence parallelism applies",
    )
    p.add_argument(
        "--ep",
        type=int,
        metavar="E",
        help="also show how expert parallelism E splits each mixture-of-experts layer's routed experts over E ranks: "
        "router, top-k, parameters per expert, shared experts, and why a layer does not split",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default="adamw",
        help="optimizer whose state bytes are shown (default adamw)",
    )
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp32",
        help="fp32, or mixed precision with fp32 master weights (default fp32)",
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads while timing (default 1)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per block (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per block, median kept (default 5)")
    p.add_argument(
        "--corun",
        type=int,
        default=0,
        help="CPU: processes running the same blocks beside the timed one, as the other ranks of a run on this "
        "machine do (default 0; `pyplan plan --gpu local` uses one per other rank)",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=_inspect)


def _add_plan_parser(sub: Any) -> None:
    """`pyplan plan`."""
    p = sub.add_parser(
        "plan",
        help="find the fastest (or cheapest) way to train a model on a cluster",
        description="Search every data-parallel x pipeline split, micro-batch size, gradient-accumulation count, "
        "schedule and ZeRO stage that fits, and print the best plans with predicted time, memory and cost.",
        epilog=_PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model.py, model.py:function, zoo:NAME, hf:MODEL_TYPE[:key=value,...] or timm:NAME")
    p.add_argument("--gpus", type=int, help="GPUs offered (plans may use fewer unless --all-gpus)")
    p.add_argument("--gpu", help="catalog GPU name (pyplan hardware list), or 'local' for processes on this machine")
    p.add_argument("--instance", help="catalog cloud instance: sets the GPU, GPUs per node and the price")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the instance's, else up to 8)")
    p.add_argument("--cluster", help="a cluster file (JSON or TOML) instead of --gpu/--gpus")
    p.add_argument("--price-per-gpu-hour", type=float, help="price of one GPU-hour (with --currency)")
    p.add_argument("--currency", help="ISO currency code of --price-per-gpu-hour, e.g. USD")
    p.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step (default 32)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw", help="default adamw")
    p.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        help="default: bf16-mixed on catalog GPUs that compute in bf16 (A100, H100, ...), else fp32",
    )
    p.add_argument("--dataset-size", type=int, help="samples per epoch, for the cost per epoch")
    p.add_argument("--objective", default="time", help="time, cost, or weighted (cost + weight x time)")
    p.add_argument("--weight", type=float, default=0.0, help="w of the weighted objective (e.g. 256, 4096, 65536)")
    p.add_argument("--top", type=int, default=5, help="how many plans to show (default 5)")
    p.add_argument("--all-gpus", action="store_true", help="only plans that use every GPU offered")
    p.add_argument(
        "--memory-fraction", type=float, default=0.9, help="share of each GPU's memory to plan for (default 0.9)"
    )
    p.add_argument("--leaf", action="append", default=[], metavar="NAME", help="module to keep whole when tracing")
    p.add_argument(
        "--remat",
        choices=REMAT_MODES,
        default="none",
        help="recompute activations: auto (optimal per stage, also finds plans that only fit with it), full, "
        "selective (torchtitan's op policy: keep matmul and attention outputs), periodic (checkpoint_sequential), "
        "none (default)",
    )
    p.add_argument(
        "--offload", choices=OFFLOAD_MODES, default="none", help="with --remat auto: offload activations to host"
    )
    pins = p.add_argument_group("pins (what-if: the best plan with these, and how far it is from the best)")
    pins.add_argument("--dp", type=int, metavar="D", help="data-parallel replicas")
    pins.add_argument("--pp", type=int, metavar="P", help="pipeline ranks")
    pins.add_argument("--micro-batch", type=int, metavar="B", help="micro-batch size")
    pins.add_argument("--ga", type=int, metavar="M", help="gradient-accumulation steps (micro-batches per step)")
    pins.add_argument("--schedule", choices=("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"), help="pipeline schedule")
    pins.add_argument(
        "--chunks",
        metavar="V[,V...]",
        help="stages (model chunks) per pipeline rank: 1 (GPipe, 1F1B) or 2 or more (the interleaved schedules, "
        "Megatron's virtual stages); default 1,2,3,4",
    )
    pins.add_argument("--zero", type=int, choices=ZERO_STAGES, help="ZeRO stage")
    p.add_argument(
        "--tp",
        default=None,
        metavar="auto|T[,T...]",
        help="tensor parallelism inside a node: auto (every degree up to 8 that divides the GPUs per node; the "
        "default on a catalog GPU), degrees to try, or 1 (none; the default with --gpu local); the split follows "
        "the model's graph (Megatron's column/row pattern)",
    )
    p.add_argument(
        "--tp-plan",
        metavar="FILE",
        help="JSON of module name -> ColwiseParallel | RowwiseParallel | SequenceParallel: split only these (they "
        "must follow the model's pattern); sequence parallelism only if a norm is named SequenceParallel",
    )
    p.add_argument(
        "--sp",
        choices=("on", "off"),
        default="on",
        help="sequence parallelism beside --tp: the values between the split layers split by their tokens where "
        "the model allows it (on, default), or whole on every rank (off)",
    )
    p.add_argument(
        "--ep",
        default=None,
        metavar="auto|E[,E...]",
        help="expert parallelism: each mixture-of-experts layer's routed experts split over E data-parallel replicas "
        "(dp a multiple of E, tp 1, ZeRO 0): auto (every E up to 64 dividing every layer's experts and the GPUs; "
        "the default for a model with such layers on a catalog GPU), degrees to try, or 1 (none; the default "
        "otherwise)",
    )
    pins.add_argument(
        "--cuts",
        metavar="I,J,...",
        help="the partition: the blocks where stages 2, 3, ... start (numbered as `pyplan inspect` lists them)",
    )
    p.add_argument("--out", help="write the best plan to this plan.json")
    p.add_argument("--emit", metavar="TRAIN_PY", help="write a torchrun training script for the best plan")
    p.add_argument("--pareto", metavar="FILE", help="draw predicted time against cost of the plans (.png or .svg)")
    p.add_argument(
        "--pareto-weights",
        default="0,2^8,2^12,2^16",
        metavar="W,...",
        help="mark the best plan under cost + w x time for each w (--pareto, --report; default 0,2^8,2^12,2^16)",
    )
    p.add_argument("--report", metavar="FILE", help="write a self-contained HTML report: tables and pictures")
    p.add_argument("--json", action="store_true", help="print {plan, alternatives, pareto} as JSON")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=_plan)


def _add_emit_parser(sub: Any) -> None:
    """`pyplan emit`."""
    p = sub.add_parser(
        "emit",
        help="write a torchrun training script from a plan.json",
        description="Write a readable training script that builds the planned pipeline with "
        "torch.distributed.pipelining and DDP/FSDP2; run it as `torchrun --nproc-per-node G train.py`.",
        epilog="examples:\n  pyplan emit plan.json -o train.py\n  torchrun --nproc-per-node 4 train.py --steps 3\n"
        "  pyplan emit plan.json --format torchtitan -o parallelism.toml\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan_file", help="plan.json written by `pyplan plan --out`")
    p.add_argument("-o", "--out", default="train.py", help="file to write (default train.py; with --format, stdout)")
    p.add_argument(
        "--format",
        choices=("script", "torchtitan", "deepspeed", "megatron"),
        default="script",
        help="script (default): a torchrun training script; torchtitan (flags, or TOML for 0.2), deepspeed "
        "(JSON, 0.19), megatron (Megatron-LM main's flags): the plan as that tool's configuration; what the tool "
        "cannot express is refused in one line",
    )
    p.add_argument(
        "--torchtitan-version",
        choices=TORCHTITAN_VERSIONS,
        default=TORCHTITAN_VERSIONS[0],
        help="with --format torchtitan: 0.3 (default, the newest release: flags after --module/--config) or 0.2 "
        "(0.2.0-0.2.2: a TOML job file)",
    )
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=_emit)


# The largest whole number an option takes: the C++ core counts in 32-bit ints.
MAX_OPTION_INT = 2**31 - 1


def _check_sizes(args: argparse.Namespace) -> None:
    """Every whole-number option within what the core counts in, before anything runs."""
    for name, value in vars(args).items():
        if name == "gpus":
            continue  # checked against the core's GPU limit, with its own message (_cluster)
        for x in value if isinstance(value, list | tuple) else (value,):
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > MAX_OPTION_INT:
                flag = "--" + name.replace("_", "-")
                raise PlanError(f"{flag} {x} is too large: at most {MAX_OPTION_INT:,}")


class _TorchMuted:
    """A text stream that drops what torch's own modules print to it (torch.export prints the partial graph of a
    model it cannot capture to stderr) and passes the rest on to `stream`. The writer is the first caller outside
    rich, whose spinner on a terminal passes what is printed meanwhile on through its own frames."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("rich."):
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "")
        if caller == "torch" or caller.startswith("torch."):
            return len(text)
        return int(self._stream.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """torch's own log lines, warnings and prints to stderr off while a command runs: torch.export logs a warning
    and prints a graph dump before pyplan's one-line error on a model it cannot capture (a branch on a tensor's
    values); --debug keeps them. The loggers torch has configured (each with its own handler) are raised to
    CRITICAL, and restored."""
    manager = logging.Logger.manager
    loggers = [logging.getLogger("torch")] + [
        x for name, x in manager.loggerDict.items() if name.startswith("torch.") and isinstance(x, logging.Logger)
    ]
    levels = [x.level for x in loggers]
    for x in loggers:
        x.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(_TorchMuted(sys.stderr)):
            warnings.filterwarnings("ignore", module=r"torch(\.|$)")
            yield
    finally:
        for x, level in zip(loggers, levels):
            x.setLevel(level)


def one_command_collector() -> None:
    """Python's garbage collector as a process that runs one command wants it: the objects the imports made (torch's
    modules and functions, hundreds of thousands, never garbage) frozen out of its scans, and a full collection
    after ten times the collections of the middle generation that Python waits for by default. Planning makes fx
    graphs by the thousand nodes, and each full collection scanned everything: on `pyplan plan zoo:gpt2-xl --gpus
    16 --gpu a100-80g --precision bf16-mixed` 0.7 s of the 5.7 s of CPU went to 7 full collections, 0.1 s with
    this. Only for the `pyplan` process itself (not for `main` called in a process that lives on).

    When the process exits, what the command made is frozen as well (an exit handler, run before the interpreter
    ends): the collections the interpreter runs as it ends then scan none of it, where they would free nothing that
    an ending process needs freed. On that command they took 0.4 s of CPU after the answer was printed.

    The `pyplan` entry (_pyplan_start.py) turns the collector off while it imports, since what the imports make
    lives to the end (0.2-0.3 s of CPU in collections), and this turns it on again. Before the freeze, the functions
    torch marks for torch.compile to skip are found among the objects: planning calls them as they are, without
    importing torch._dynamo (pyplan._torch's `_DynamoSkips`)."""
    find_dynamo_skips()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old * 10)
    gc.enable()
    atexit.register(gc.freeze)


def main(argv: Sequence[str] | None = None) -> int:
    err = Console(stderr=True, highlight=False, emoji=False)
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(given)
    except _UsageError as exc:
        if "--debug" in given:
            exc.parser.print_usage(sys.stderr)
        hint = f"{exc} (`{exc.parser.prog} --help` lists the options)"
        err.print(Text.assemble(("error: ", "red"), hint), soft_wrap=True)
        return 2
    try:
        _check_sizes(args)
        with contextlib.nullcontext() if args.debug else _quiet_torch():
            return int(args.func(args))
    except PlanError as exc:
        if args.debug:
            traceback.print_exc()
        err.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err.print(Text("interrupted", "red"))
        return 130
    except Exception as exc:
        if args.debug:
            traceback.print_exc()
        msg = f"{type(exc).__name__}: {exc} (rerun with --debug for the traceback)"
        err.print(Text.assemble(("internal error: ", "red"), msg), soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
