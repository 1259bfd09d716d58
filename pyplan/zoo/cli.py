"""`pyplan zoo list`: the zoo's models with parameter counts (built on the meta device) and input shapes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from pyplan import zoo
from pyplan.report.units import fmt_count

__all__ = ["add_zoo_parser", "list_data", "zoo_list"]

_ZOO_EXAMPLES = """examples:
  pyplan zoo list                          # every model: parameters and input shapes
  pyplan zoo list gpt2-xl llama-70b-style  # only these
  pyplan zoo list --json

Use a zoo model anywhere a model file goes, as zoo:NAME:
  pyplan inspect zoo:gpt2-xl --analytic
"""

_LIST_EXAMPLES = """examples:
  pyplan zoo list
  pyplan zoo list resnet50 resnet50-cifar10 --json

Parameters are counted on a model built on the meta device (no weights allocated), tied weights once.
"published" is the count of the architecture the model reproduces, which the test suite checks it against
("equal" when the model has exactly that count; "-" where none exists: MNIST variants, AmoebaNet-D-like).
Input shapes are per batch, B the batch size; inputs are float32 unless a dtype is shown.
"""


def add_zoo_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `zoo list` to the `pyplan` subcommands; returns the `zoo` parser, to which more modes can be added."""
    parser = subparsers.add_parser(
        "zoo",
        help="list the built-in models (use them as zoo:NAME)",
        description="The model zoo: reference architectures in plain torch with random weights, no downloads. "
        "Any command that takes a model file takes zoo:NAME.",
        epilog=_ZOO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="zoo_command", required=True, metavar="{list}")
    p = sub.add_parser(
        "list",
        help="print the zoo's models, parameter counts and input shapes",
        description="Print every zoo model (or the NAMES given) with its parameter count, the published count it "
        "is tested against, and the shapes of its example inputs.",
        epilog=_LIST_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="only these models (default: all)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=zoo_list)
    return parser


# --- Data (pure) ------------------------------------------------------------------------------------------


def _entry(name: str) -> dict[str, Any]:
    spec = zoo.get(name)
    with torch.device("meta"):
        model = spec.build()
    inputs = spec.example_inputs(1)
    return {
        "name": spec.name,
        "params": sum(p.numel() for p in model.parameters()),
        "published_params": spec.published_params,
        "inputs": [{"shape": ["B", *t.shape[1:]], "dtype": str(t.dtype).removeprefix("torch.")} for t in inputs],
        "source": spec.source,
    }


def list_data(names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The zoo as JSON-ready entries: name, params (counted on meta), published_params, inputs
    (shape with "B" for the batch dimension, dtype) and source; only `names` when given, in that order."""
    return [_entry(name) for name in (names or zoo.names())]


# --- Rendering --------------------------------------------------------------------------------------------


def _published(e: dict[str, Any]) -> str:
    published = e["published_params"]
    if published is None:
        return "-"
    return "equal" if published == e["params"] else f"{published:,}"


def _shapes(inputs: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"({','.join(str(d) for d in i['shape'])})" + ("" if i["dtype"] == "float32" else f" {i['dtype']}")
        for i in inputs
    )


def _table(entries: list[dict[str, Any]]) -> Table:
    table = Table(title="Model zoo", caption="parameters counted on the meta device; use a model as zoo:NAME")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("parameters", justify="right", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    table.add_column("published", justify="right", no_wrap=True)
    table.add_column("inputs (B = batch)")
    for e in entries:
        table.add_row(e["name"], f"{e['params']:,}", fmt_count(e["params"]), _published(e), _shapes(e["inputs"]))
    return table


def zoo_list(args: argparse.Namespace) -> int:
    """`pyplan zoo list`: print the zoo."""
    entries = list_data(args.names)
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        Console().print(_table(entries))
    return 0
