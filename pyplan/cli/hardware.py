"""`pyplan hardware list | show`: the catalog as rich tables or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from pyplan.errors import PlanError
from pyplan.hardware.catalog import GIB, GPU, Instance, Link, load_catalog, local_calibration_path
from pyplan.report.console import make_console
from pyplan.units import fmt_bandwidth, fmt_count, fmt_seconds

__all__ = ["add_hardware_parser", "hardware_list", "hardware_show", "list_data", "show_data"]

KINDS = ("gpus", "links", "instances")
_TABLE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")

_HARDWARE_EXAMPLES = """examples:
  pyplan hardware list                               # GPUs, links and cloud instances
  pyplan hardware list --kind instances --provider alicloud
  pyplan hardware show a100-80g                      # figures and their sources
  pyplan hardware show local                         # this machine's device, calibrated or not

The catalog is TOML inside the package (pyplan/hardware/data/); every figure names its source there.
"""

_LIST_EXAMPLES = """examples:
  pyplan hardware list
  pyplan hardware list --kind gpus
  pyplan hardware list --kind instances --provider aws
  pyplan hardware list --kind links --json

Memory is in GiB (2^30 bytes; vendors' "80 GB" HBM is 80 GiB). FLOP/s are dense peaks (no sparsity).
Link bandwidth is per GPU and per direction, as a ring all-reduce step sees it. Prices are on-demand per
instance-hour in the currency shown; pyplan never mixes currencies without exchange rates.
"""

_SHOW_EXAMPLES = """examples:
  pyplan hardware show h100                # aliases work; names are case-insensitive
  pyplan hardware show nvlink3
  pyplan hardware show gn7e.4xlarge --json
  pyplan hardware show local               # CPU or GPU of this machine; figures after `pyplan calibrate`
"""


def add_hardware_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `hardware list` and `hardware show` to the `pyplan` subcommands; returns the `hardware` parser."""
    parser = subparsers.add_parser(
        "hardware",
        help="list and show the catalog of GPUs, links and priced cloud instances",
        description="The hardware catalog pyplan plans with: GPUs (memory, bandwidth, peak FLOP/s per dtype), "
        "links (latency, bandwidth) and cloud instances with hourly prices, each with its source.",
        epilog=_HARDWARE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="hardware_command", required=True, metavar="{list,show}")

    p = sub.add_parser(
        "list",
        help="print the catalog as tables",
        description="Print the catalog's GPUs, links and cloud instances as tables (or JSON).",
        epilog=_LIST_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--kind", choices=KINDS, help="only this part of the catalog (default: all)")
    p.add_argument("--provider", help="only the instances of this provider (aws, gcp, azure, alicloud)")
    p.add_argument("--json", action="store_true", help="print JSON (the catalog types' to_json forms)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=hardware_list)

    p = sub.add_parser(
        "show",
        help="print one GPU, link or instance with its sources",
        description="Print every figure of one catalog entry and where it comes from. `local` is this machine.",
        epilog=_SHOW_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", help="a GPU, link or instance name or alias (case-insensitive), or `local`")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=hardware_show)
    return parser


# --- Data (pure) ------------------------------------------------------------------------------------------


def _select(kind: str | None, provider: str | None) -> dict[str, list[Any]]:
    if kind is not None and kind not in KINDS:
        raise PlanError(f"unknown kind '{kind}'; choose one of {', '.join(KINDS)}")
    if provider is not None:
        if kind not in (None, "instances"):
            raise PlanError(f"--provider selects instances; it cannot be used with --kind {kind}")
        kind = "instances"
    catalog = load_catalog()
    parts = {
        "gpus": lambda: list(catalog.gpus),
        "links": lambda: list(catalog.links),
        "instances": lambda: catalog.list_instances(provider),
    }
    return {k: get() for k, get in parts.items() if kind in (None, k)}


def list_data(kind: str | None = None, provider: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The catalog as JSON-ready lists under "gpus", "links", "instances" (only `kind` when given)."""
    return {k: [e.to_json() for e in entries] for k, entries in _select(kind, provider).items()}


def show_data(name: str) -> dict[str, Any]:
    """One entry as JSON-ready data: {"gpu": ..., "instances": [...]}, {"link": ...} or {"instance": ..., "gpu": ...};
    `local` gives both the GPU and the link of this machine."""
    catalog = load_catalog()
    data: dict[str, Any] = {}
    for entry in catalog.lookup(name):
        if isinstance(entry, GPU):
            data["gpu"] = entry.to_json()
            if entry.name != "local":
                data["instances"] = [i.name for i in catalog.list_instances(gpu=entry.name)]
        elif isinstance(entry, Link):
            data["link"] = entry.to_json()
        else:
            data["instance"] = entry.to_json()
            data.setdefault("gpu", catalog.gpu(entry.gpu).to_json())
    return data


# --- Rendering --------------------------------------------------------------------------------------------


def _gib(n: float | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.3g} GiB"


def _rate(n: float | None) -> str:
    return "unknown" if n is None else fmt_bandwidth(n)


def _flops(n: float | None, dtype: str = "") -> str:
    return "-" if n is None else f"{fmt_count(n)}{'OP/s' if dtype == 'int8' else 'FLOP/s'}"


def _gbit(n: float | None) -> str:
    return "-" if n is None else f"{n * 8 / 1e9:g} Gb/s"


def _gpu_table(gpus: list[GPU]) -> Table:
    table = Table(title="GPUs", caption="dense peak FLOP/s; memory in GiB; `pyplan hardware show NAME` for sources")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("memory", justify="right")
    table.add_column("mem. bandwidth", justify="right")
    for dtype in _TABLE_DTYPES:
        table.add_column(dtype, justify="right")
    table.add_column("TDP", justify="right")
    for gpu in gpus:
        table.add_row(
            gpu.name,
            _gib(gpu.memory_bytes),
            _rate(gpu.hbm_bw_bytes_per_s),
            *(_flops(gpu.peak_flops_per_s.get(d)) for d in _TABLE_DTYPES),
            "-" if gpu.tdp_w is None else f"{gpu.tdp_w:g} W",
        )
    return table


def _link_table(links: list[Link]) -> Table:
    table = Table(title="Links", caption="bandwidth per GPU, one direction; time = latency + bytes / bandwidth")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("bandwidth", justify="right")
    table.add_column("latency", justify="right")
    table.add_column("what")
    for link in links:
        table.add_row(link.name, _rate(link.bw_bytes_per_s), fmt_seconds(link.latency_s), link.description)
    return table


def _instance_table(instances: list[Instance]) -> Table:
    table = Table(title="Cloud instances", caption="on-demand price per instance-hour; per GPU-hour of a whole GPU")
    table.add_column("provider")
    table.add_column("name", no_wrap=True, style="bold")
    table.add_column("GPUs", no_wrap=True)
    table.add_column("GPU memory", justify="right")
    table.add_column("vCPUs", justify="right")
    table.add_column("network", justify="right")
    table.add_column("price/h", justify="right")
    table.add_column("per GPU-h", justify="right")
    table.add_column("region")
    for inst in instances:
        memory = (
            inst.gpu_memory_bytes if inst.gpu_memory_bytes is not None else load_catalog().gpu(inst.gpu).memory_bytes
        )
        table.add_row(
            inst.provider,
            inst.name,
            f"{inst.gpus_label} x {inst.gpu}",
            _gib(memory),
            "-" if inst.vcpus is None else str(inst.vcpus),
            inst.inter_link or _gbit(inst.network_bw_bytes_per_s),
            f"{inst.price_per_hour:g} {inst.currency}",
            str(inst.price_per_gpu_hour()),
            inst.region or "-",
        )
    return table


def _fields_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    return table


def _gpu_rows(gpu: GPU) -> list[tuple[str, str]]:
    unknown = "unknown until `pyplan calibrate`"
    rows = [("name", gpu.name)]
    if gpu.aliases:
        rows.append(("aliases", ", ".join(gpu.aliases)))
    rows += [
        ("description", gpu.description or "-"),
        ("device", gpu.device_type + (f", {gpu.cpu_threads} threads" if gpu.cpu_threads else "")),
        ("memory", "unknown" if gpu.memory_bytes is None else f"{_gib(gpu.memory_bytes)} ({gpu.memory_bytes:,} B)"),
        ("memory bandwidth", unknown if gpu.hbm_bw_bytes_per_s is None else _rate(gpu.hbm_bw_bytes_per_s)),
    ]
    if gpu.peak_flops_per_s:
        rows += [(f"peak {d} (dense)", _flops(f, d)) for d, f in gpu.peak_flops_per_s.items()]
    else:
        rows.append(("peak FLOP/s", unknown))
    if gpu.tdp_w is not None:
        rows.append(("TDP", f"{gpu.tdp_w:g} W"))
    rows.append(
        ("default links", f"{gpu.default_intra_link or '-'} in a node, {gpu.default_inter_link or '-'} between")
    )
    rows.append(("source", gpu.source))
    return rows


def _link_rows(link: Link) -> list[tuple[str, str]]:
    return [
        ("name", link.name),
        *([("aliases", ", ".join(link.aliases))] if link.aliases else []),
        ("description", link.description or "-"),
        (
            "bandwidth",
            "unknown until `pyplan calibrate`"
            if link.bw_bytes_per_s is None
            else _rate(link.bw_bytes_per_s) + " per GPU, one direction",
        ),
        ("latency", "unknown until `pyplan calibrate`" if link.latency_s is None else fmt_seconds(link.latency_s)),
        ("source", link.source),
    ]


def _instance_rows(inst: Instance) -> list[tuple[str, str]]:
    return [
        ("provider", inst.provider),
        ("name", inst.name),
        ("GPUs", f"{inst.gpus_label} x {inst.gpu}"),
        *([("GPU memory", _gib(inst.gpu_memory_bytes))] if inst.gpu_memory_bytes is not None else []),
        ("vCPUs", "-" if inst.vcpus is None else str(inst.vcpus)),
        ("network", _gbit(inst.network_bw_bytes_per_s)),
        *([("link to other instances", inst.inter_link)] if inst.inter_link else []),
        ("price", f"{inst.price_per_hour:g} {inst.currency} per hour"),
        ("per GPU-hour", f"{inst.price_per_gpu_hour()} (a whole GPU's worth)"),
        ("region", inst.region or "not stated"),
        ("source", inst.source),
    ]


def hardware_list(args: argparse.Namespace) -> int:
    """`pyplan hardware list`: print the catalog."""
    if args.json:
        print(json.dumps(list_data(args.kind, args.provider), indent=2))
        return 0
    selected = _select(args.kind, args.provider)
    console = make_console()
    if "gpus" in selected:
        console.print(_gpu_table(selected["gpus"]))
        console.print(
            f"local: this machine's device; `pyplan hardware show local` (calibration: {local_calibration_path()})"
        )
    if "links" in selected:
        console.print(_link_table(selected["links"]))
    if "instances" in selected:
        console.print(_instance_table(selected["instances"]))
    return 0


def hardware_show(args: argparse.Namespace) -> int:
    """`pyplan hardware show NAME`: print one entry with its sources."""
    if args.json:
        print(json.dumps(show_data(args.name), indent=2))
        return 0
    catalog = load_catalog()
    console = make_console()
    for entry in catalog.lookup(args.name):
        if isinstance(entry, Instance):
            console.print(_fields_table(f"instance {entry.name}", _instance_rows(entry)))
            entry = catalog.gpu(entry.gpu)
        if isinstance(entry, GPU):
            console.print(_fields_table(f"GPU {entry.name}", _gpu_rows(entry)))
            if entry.name != "local":
                users = [i.name for i in catalog.list_instances(gpu=entry.name)]
                console.print(f"instances with {entry.name}: {', '.join(users) if users else 'none in the catalog'}")
        else:
            console.print(_fields_table(f"link {entry.name}", _link_rows(entry)))
    return 0
