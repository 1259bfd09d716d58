"""`pyplan show`: print a plan.json as tables or JSON; draw its pipeline timeline; write an HTML report."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyplan.emit.planfile import read_plan_file
from pyplan.report.console import make_console
from pyplan.report.gantt import write_gantt
from pyplan.report.html import write_html_report
from pyplan.report.show import render_show, show_data

__all__ = ["add_show_parser", "show"]

_SHOW_EXAMPLES = """examples:
  pyplan show plan.json                        # stages, memory per GPU, time breakdown, cost
  pyplan show plan.json --json                 # the same as data
  pyplan show plan.json --gantt schedule.png   # the simulated pipeline timeline (.png or .svg)
  pyplan show plan.json --report report.html   # one self-contained page: tables and pictures

Memory is per GPU of one pipeline against the GPU's whole memory (the planner keeps a margin, see
`pyplan plan --memory-fraction`). The timeline is re-simulated from the plan's per-stage forward, backward and
boundary-send times, so its pipeline time is the plan's prediction. Pictures need matplotlib:
pip install 'pyplan[plot]'.
"""


def show(args: argparse.Namespace) -> int:
    """Run `pyplan show`."""
    document = read_plan_file(args.plan_file)
    data = show_data(document)
    written = []
    if args.gantt:
        write_gantt(document.plan, args.gantt)
        written.append(args.gantt)
    if args.report:
        write_html_report(document, args.report)
        written.append(args.report)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render_show(data, make_console())
    for path in written:  # on stderr beside --json, whose stdout is the JSON alone (as `pyplan plan`)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def add_show_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `show` to the `pyplan` subcommands; returns its parser."""
    p = subparsers.add_parser(
        "show",
        help="print a plan.json: stages, memory per GPU, time breakdown, cost; draw its pipeline",
        description="Print a plan written by `pyplan plan --out`: its stages with their blocks, the memory of each "
        "GPU against its capacity, where an iteration's time goes (compute, pipeline bubble, exposed "
        "communication, optimizer) and what it costs; optionally draw the simulated pipeline timeline or write "
        "an HTML report.",
        epilog=_SHOW_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan_file", help="plan.json written by `pyplan plan --out`")
    p.add_argument("--json", action="store_true", help="print the plan's figures as JSON instead of tables")
    p.add_argument("--gantt", metavar="FILE", help="draw the simulated pipeline timeline to FILE (.png or .svg)")
    p.add_argument("--report", metavar="FILE", help="write a self-contained HTML report to FILE")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=show)
    return p
