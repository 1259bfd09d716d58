"""`pyplan calibrate`: measure this machine's device and local link, write the calibration file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pyplan._files import check_writable
from pyplan.hardware.catalog import local_calibration_path
from pyplan.profile.calibrate import CalibrationOptions, calibrate, render_calibration, write_calibration
from pyplan.report.console import make_console, spinner

__all__ = ["add_calibrate_parser", "calibrate_command"]

_EXAMPLES = """examples:
  pyplan calibrate                       # about a minute; writes the local calibration file
  pyplan calibrate --quick               # about 15 s on a 2-core CPU, smaller sizes and fewer repeats
  pyplan calibrate --threads 2 --json    # CPU processes of 2 threads each; print the data
  pyplan hardware show local             # the figures the catalog now gives the `local` GPU and link

On a CPU with one thread, times are the thread's CPU time, so other processes' load does not inflate them.
"""


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `calibrate` to the `pyplan` subcommands; returns its parser."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure this machine's device and local link; the `local` GPU and link use the figures",
        description="Measure, on the local device (CUDA if present, else the CPU with a fixed thread count): "
        "matmul FLOP/s per dtype, memory bandwidth, the launch cost of an op, the achieved efficiency of "
        "representative ops per op class, and point-to-point and all-reduce latency and bandwidth between two "
        "local processes (gloo on CPU, NCCL between two GPUs). Writes the calibration file that the catalog's "
        "`local` GPU and link, and the analytic roofline, read.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", metavar="FILE", help=f"write here instead of {local_calibration_path()}")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process (default 1)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (about 15 s)")
    parser.add_argument("--no-link", action="store_true", help="skip the two-process link measurement")
    parser.add_argument("--json", action="store_true", help="print the calibration file's data instead of tables")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.set_defaults(func=calibrate_command)
    return parser


def calibrate_command(args: argparse.Namespace) -> int:
    """`pyplan calibrate`: measure, write the file, print what was measured."""
    if args.out:
        # Before measuring, as `pyplan plan` checks its outputs: an --out in a missing directory is refused, not
        # created (only the default file's directory, pyplan's cache, is made when missing).
        check_writable(args.out)
    options = CalibrationOptions(threads=args.threads, quick=args.quick, link=not args.no_link)
    with spinner("calibrating this machine") as say:
        say("measuring")
        result = calibrate(options)
    path = write_calibration(result, args.out)
    if args.json:
        print(json.dumps({"path": str(path), **result.to_json()}, indent=2))
    else:
        render_calibration(result, path, make_console())
    for line in result.unstable():
        print(line, file=sys.stderr)
    return 0
