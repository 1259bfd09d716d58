"""The `pyplan` command line: exit 0 on success, 2 on bad input, 1 on an internal error."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.text import Text

from pyplan.errors import PlanError
from pyplan.profile.memory import OPTIMIZERS, PRECISIONS

__all__ = ["main"]

_INSPECT_EXAMPLES = """examples:
  pyplan inspect examples/resnet.py
  pyplan inspect examples/gpt.py --batch-size 8 --json
  pyplan inspect zoo:gpt2-xl --analytic          # FLOPs and bytes on the meta device, no weights allocated
  pyplan inspect model.py:build_big --leaf MyAttention
"""


def _inspect(args: argparse.Namespace) -> int:
    from pyplan.graph.linearize import linearize
    from pyplan.graph.trace import trace
    from pyplan.load import load_model
    from pyplan.profile import TimingOptions, local_device, profile
    from pyplan.report.inspect import inspect_data, render_inspect

    if args.batch_size < 1:
        raise PlanError(f"--batch-size must be at least 1, got {args.batch_size}")
    spec = load_model(args.model)
    if args.analytic:
        with torch.device("meta"):
            model = spec.build()
    else:
        model = spec.build()
    graph = trace(model, spec.example_inputs, leaf_modules=args.leaf, batch_size=args.batch_size)
    chain = linearize(graph, min_blocks=args.min_blocks, max_blocks=args.max_blocks)
    options = TimingOptions(warmup=args.warmup, repeats=args.repeats, threads=args.threads)
    chain = profile(chain, spec.example_inputs, measure=not args.analytic, options=options)
    data = inspect_data(
        chain,
        model=spec.name,
        batch_size=args.batch_size,
        device=str(local_device()),
        threads=args.threads,
        optimizer=args.optimizer,
        precision=args.precision,
    )
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render_inspect(data, Console())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyplan", description="Plan distributed PyTorch training: how to split a model over GPUs, with numbers."
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "inspect",
        help="trace, linearize and profile a model; print its blocks",
        description="Trace a model with torch.fx, group it into blocks between pipeline cut points, and print "
        "each block's parameters, FLOPs, bytes saved for backward, bytes across its cut, and measured time.",
        epilog=_INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="model.py, model.py:function, or zoo:NAME")
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
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=_inspect)

    from pyplan.hardware.cli import add_hardware_parser

    add_hardware_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    err = Console(stderr=True, highlight=False)
    try:
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
