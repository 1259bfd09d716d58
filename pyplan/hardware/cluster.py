"""Clusters: groups of identical nodes, each with its GPU, links and price; built from the catalog or a user file."""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pyplan.errors import PlanError
from pyplan.hardware.catalog import (
    GPU,
    LOCAL,
    Instance,
    Link,
    Money,
    check_currency,
    convert,
    get_gpu,
    get_instance,
    get_link,
    list_links,
    total,
)

__all__ = ["Cluster", "NodeGroup"]

# Ranks are numbered group by group, node by node, GPU by GPU: with groups of 2x4 and 1x8 GPUs, ranks 0-3 are
# node 0, ranks 4-7 node 1 (both group 0) and ranks 8-15 node 2 (group 1). A tensor-parallel group must stay
# inside one node; the planner places pipeline stages on groups, so stages may run on different GPU types.

# Links for a GPU that names no defaults (a GPU defined inline in a cluster file).
_FALLBACK_INTRA = "pcie4"
_FALLBACK_INTER = "eth-25g"

_GROUP_KEYS = (
    "gpu",
    "gpus",
    "nodes",
    "gpus_per_node",
    "intra_link",
    "inter_link",
    "price_per_gpu_hour",
    "price_per_node_hour",
    "currency",
    "instance",
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, key: str, what: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise PlanError(f"{what}: '{key}' must be a positive integer, got {value!r}")
    return value


def _price(value: Any, key: str, what: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < math.inf:
        raise PlanError(f"{what}: '{key}' must be a finite non-negative number, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """`nodes` identical machines of `gpus_per_node` GPUs each, with the links inside and out of a node.

    `inter_link` is what each GPU of this group sees towards other nodes (per GPU, see data/links.toml).
    The price is per GPU-hour in `currency`; `instance` names the catalog instance it came from, if any.
    """

    gpu: GPU
    nodes: int
    gpus_per_node: int
    intra_link: Link
    inter_link: Link
    price_per_gpu_hour: float | None = None
    currency: str | None = None
    instance: str | None = None

    def __post_init__(self) -> None:
        _positive_int(self.nodes, "nodes", "node group")
        _positive_int(self.gpus_per_node, "gpus_per_node", "node group")
        _price(self.price_per_gpu_hour, "price_per_gpu_hour", "node group")
        if (self.price_per_gpu_hour is None) != (self.currency is None):
            raise PlanError(
                f"node group: a price needs its currency and a currency its price, got price "
                f"{self.price_per_gpu_hour!r} and currency {self.currency!r}"
            )
        if self.currency is not None:
            check_currency(self.currency, "node group: 'currency'")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def price_per_gpu_second(self) -> Money:
        if self.price_per_gpu_hour is None or self.currency is None:
            raise PlanError(
                f"the {self.gpu.name} nodes have no price: give a price per GPU-hour with its currency, or an instance"
            )
        return Money(self.price_per_gpu_hour / 3600, self.currency)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.to_json(),
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "intra_link": self.intra_link.to_json(),
            "inter_link": self.inter_link.to_json(),
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "currency": self.currency,
            "instance": self.instance,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> NodeGroup:
        return NodeGroup(
            gpu=GPU.from_json(data["gpu"]),
            nodes=data["nodes"],
            gpus_per_node=data["gpus_per_node"],
            intra_link=Link.from_json(data["intra_link"]),
            inter_link=Link.from_json(data["inter_link"]),
            price_per_gpu_hour=data.get("price_per_gpu_hour"),
            currency=data.get("currency"),
            instance=data.get("instance"),
        )


@dataclass(frozen=True)
class Cluster:
    """The GPUs a plan may use: one or more node groups (today's constructors make one)."""

    groups: tuple[NodeGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise PlanError("a cluster needs at least one node group")

    # --- Shape -----------------------------------------------------------------------------------------------

    @property
    def gpus(self) -> int:
        """Total GPUs (ranks)."""
        return sum(g.gpus for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def gpu(self) -> GPU:
        """The GPU type, for a cluster of one type; raises for a mixed cluster (use `gpu_of`)."""
        names = {g.gpu.name for g in self.groups}
        if len(names) > 1:
            raise PlanError(f"the cluster mixes GPU types ({', '.join(sorted(names))}); ask per rank")
        return self.groups[0].gpu

    @property
    def gpus_per_node(self) -> int:
        """GPUs per node, for a cluster whose nodes are all the same size."""
        sizes = {g.gpus_per_node for g in self.groups}
        if len(sizes) > 1:
            raise PlanError(f"the cluster's nodes differ in size ({', '.join(map(str, sorted(sizes)))} GPUs)")
        return self.groups[0].gpus_per_node

    def _locate(self, rank: int) -> tuple[int, int]:
        """(group index, global node index) of `rank`."""
        if not _is_int(rank) or not 0 <= rank < self.gpus:
            raise PlanError(f"rank {rank!r} is outside the cluster's {self.gpus} GPUs")
        node = 0
        for i, group in enumerate(self.groups):
            if rank < group.gpus:
                return i, node + rank // group.gpus_per_node
            rank -= group.gpus
            node += group.nodes
        raise AssertionError("unreachable: rank was checked against the total")

    def group_of(self, rank: int) -> NodeGroup:
        return self.groups[self._locate(rank)[0]]

    def gpu_of(self, rank: int) -> GPU:
        return self.group_of(rank).gpu

    def node_of(self, rank: int) -> int:
        return self._locate(rank)[1]

    def link_between(self, rank_a: int, rank_b: int) -> Link:
        """The link a transfer from rank_a to rank_b crosses: the node's own link inside a node; between nodes,
        the slower of the two groups' links to other nodes."""
        (ga, na), (gb, nb) = self._locate(rank_a), self._locate(rank_b)
        if rank_a == rank_b:
            raise PlanError(f"ranks {rank_a} and {rank_b} are the same GPU; there is no link between them")
        if na == nb:
            return self.groups[ga].intra_link
        a, b = self.groups[ga].inter_link, self.groups[gb].inter_link
        if a.bw_bytes_per_s is None or b.bw_bytes_per_s is None:
            return a if a.bw_bytes_per_s is None else b
        return a if a.bw_bytes_per_s <= b.bw_bytes_per_s else b

    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """Tensor-parallel degrees whose groups tile every node (divisors of the common node size)."""
        common = math.gcd(*(g.gpus_per_node for g in self.groups))
        return tuple(t for t in range(1, common + 1) if common % t == 0)

    def tensor_parallel_groups(self, degree: int) -> Cluster:
        """The cluster as a search over tensor-parallel groups sees it: each group of `degree` consecutive GPUs of a
        node (they split every layer) in place of one GPU, so gpus_per_node / degree of them per node, at `degree`
        times the price. A group's pipeline sends and data-parallel collectives are its GPUs' own, side by side on
        their own links (per GPU, as the catalog's figures are), so the links stay as they are."""
        if len(self.groups) != 1:
            raise PlanError("tensor parallelism is planned on a cluster of one node group")
        group = self.groups[0]
        if degree < 1 or group.gpus_per_node % degree:
            raise PlanError(
                f"tensor parallelism {degree} must divide the {group.gpus_per_node} GPUs of a node (its layers stay "
                "inside a node)"
            )
        price = None if group.price_per_gpu_hour is None else group.price_per_gpu_hour * degree
        return Cluster((replace(group, gpus_per_node=group.gpus_per_node // degree, price_per_gpu_hour=price),))

    # --- Price -----------------------------------------------------------------------------------------------

    def price_per_gpu_second(self, group: int | None = None) -> Money:
        """Price of one GPU for one second. A cluster whose groups differ in price must name the group."""
        if group is not None:
            return self.groups[group].price_per_gpu_second()
        prices = {(g.price_per_gpu_hour, g.currency) for g in self.groups}
        if len(prices) > 1:
            raise PlanError("the cluster's node groups differ in price; ask per group")
        return self.groups[0].price_per_gpu_second()

    def price_per_second(self, *, currency: str | None = None, rates: Mapping[str, float] | None = None) -> Money:
        """Price of the whole cluster per second; groups priced in different currencies need `currency` and
        explicit exchange `rates` (see catalog.convert)."""
        prices = [g.price_per_gpu_second().scaled(g.gpus) for g in self.groups]
        if currency is not None:
            prices = [convert(p, currency, rates) for p in prices]
        return total(prices)

    # --- JSON ------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"groups": [g.to_json() for g in self.groups]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Cluster:
        return Cluster(tuple(NodeGroup.from_json(g) for g in data["groups"]))

    # --- Constructors ----------------------------------------------------------------------------------------

    @staticmethod
    def from_catalog(
        gpu: str | GPU | None = None,
        gpus: int | None = None,
        *,
        gpus_per_node: int | None = None,
        nodes: int | None = None,
        intra_link: str | Link | None = None,
        inter_link: str | Link | None = None,
        price_per_gpu_hour: float | None = None,
        price_per_node_hour: float | None = None,
        currency: str | None = None,
        instance: str | Instance | None = None,
    ) -> Cluster:
        """One group of catalog GPUs: `Cluster.from_catalog("a100-80g", 64, gpus_per_node=8)`.

        Give the size as `gpus` (total) or `nodes`; `gpus_per_node` defaults to the instance's GPUs, else to
        all GPUs up to 8 (all of them for "local", processes on this machine). Links default to the GPU's
        catalog defaults (NVLink inside an NVLink node, else PCIe; InfiniBand or Ethernet between nodes).
        The price is per GPU-hour or per node-hour with its currency, or comes from `instance`, whose GPU and
        GPUs per node it also sets; an instance with a fraction of a GPU gives one GPU slice per node (its
        compute scaled by the share, its memory as the provider states).
        """
        group = _make_group(
            "cluster",
            gpu=gpu,
            gpus=gpus,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            intra_link=intra_link,
            inter_link=inter_link,
            price_per_gpu_hour=price_per_gpu_hour,
            price_per_node_hour=price_per_node_hour,
            currency=currency,
            instance=instance,
        )
        return Cluster((group,))

    @staticmethod
    def from_file(path: str | Path) -> Cluster:
        """A cluster described in a JSON, TOML or (with PyYAML installed) YAML file.

        Keys: gpu (catalog name or an inline table of GPU fields), gpus or nodes, gpus_per_node, intra_link and
        inter_link (catalog names or inline {latency_s, bw_bytes_per_s}), price_per_gpu_hour or
        price_per_node_hour with currency, or instance (a catalog instance whose price is used). A list under
        `groups` describes node groups of different GPUs; keys outside it are defaults for every group.
        """
        path = Path(path)
        what = f"cluster file {path}"
        suffix = path.suffix.lower()
        if suffix not in (".json", ".toml", ".yaml", ".yml"):
            raise PlanError(f"{what}: the name must end in .json, .toml, .yaml or .yml")
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanError(f"{what}: cannot be read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise PlanError(
                f"{what}: not UTF-8 text ({exc.reason} at byte {exc.start}); a cluster file is JSON, TOML or YAML text"
            ) from None
        try:
            data = _parse(text, suffix, what)
        except RecursionError:
            raise PlanError(f"{what}: nests its tables too deeply to describe a cluster") from None
        return Cluster.from_dict(data, what)

    @staticmethod
    def from_dict(data: Any, what: str = "cluster") -> Cluster:
        """A cluster from the contents of a cluster file (see `from_file`); `what` prefixes every error."""
        if not isinstance(data, Mapping):
            raise PlanError(f"{what}: must hold a table/object of keys, got {type(data).__name__}")
        _check_keys(data, (*_GROUP_KEYS, "groups"), what)
        defaults = {k: v for k, v in data.items() if k != "groups"}
        if "groups" not in data:
            return Cluster((_group_from_dict(defaults, what),))
        groups = data["groups"]
        if not isinstance(groups, list) or not groups:
            raise PlanError(f"{what}: 'groups' must be a non-empty list of tables, got {groups!r}")
        built = []
        for i, group in enumerate(groups):
            where = f"{what}: groups[{i}]"
            if not isinstance(group, Mapping):
                raise PlanError(f"{where}: must be a table/object, got {group!r}")
            _check_keys(group, _GROUP_KEYS, where)
            built.append(_group_from_dict({**defaults, **group}, where))
        return Cluster(tuple(built))


def _parse(text: str, suffix: str, what: str) -> Any:
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{what}: not valid JSON: {exc}") from None
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"{what}: not valid TOML: {exc}") from None
    try:
        import yaml  # optional: PyYAML, only for a YAML cluster file
    except ImportError:
        raise PlanError(
            f"{what}: reading YAML needs PyYAML (pip install pyyaml); or write the file as .json or .toml"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanError(f"{what}: not valid YAML: {' '.join(str(exc).split())}") from None


def _check_keys(data: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"expected one of {', '.join(allowed)}"
            raise PlanError(f"{what}: unknown key '{key}'; {hint}")


def _group_from_dict(data: Mapping[str, Any], what: str) -> NodeGroup:
    gpu = data.get("gpu")
    if isinstance(gpu, Mapping):
        gpu = GPU.from_json({"source": what, **gpu}, f"{what}: 'gpu'")
        gpu.check_complete(f"{what}: 'gpu'")
    elif gpu is not None and not isinstance(gpu, str):
        raise PlanError(f"{what}: 'gpu' must be a catalog name or a table of GPU fields, got {gpu!r}")
    links: dict[str, str | Link | None] = {}
    for key in ("intra_link", "inter_link"):
        value = data.get(key)
        if isinstance(value, Mapping):
            value = Link.from_json({"name": key, "source": what, **value}, f"{what}: '{key}'")
        elif value is not None and not isinstance(value, str):
            raise PlanError(
                f"{what}: '{key}' must be a catalog link name or a table with latency_s and bw_bytes_per_s, "
                f"got {value!r}"
            )
        links[key] = value
    for key in ("currency", "instance"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise PlanError(f"{what}: '{key}' must be a string, got {data[key]!r}")
    if data.get("gpus") is None and data.get("nodes") is None:
        # `from_catalog` defaults to one GPU; a file states its size, so a forgotten key is never planned as 1 GPU.
        raise PlanError(
            f"{what}: no size; add 'gpus' (all its GPUs) or 'nodes' (with 'gpus_per_node' or an 'instance')"
        )
    return _make_group(
        what,
        gpu=gpu,
        gpus=data.get("gpus"),
        nodes=data.get("nodes"),
        gpus_per_node=data.get("gpus_per_node"),
        intra_link=links["intra_link"],
        inter_link=links["inter_link"],
        price_per_gpu_hour=data.get("price_per_gpu_hour"),
        price_per_node_hour=data.get("price_per_node_hour"),
        currency=data.get("currency"),
        instance=data.get("instance"),
    )


def _instance_network_link(inst: Instance, gpus_per_instance: int) -> Link | None:
    """The link each GPU of `inst` has to other instances, from the instance's network bandwidth; the latency is
    that of the catalog Ethernet link closest in bandwidth."""
    if inst.network_bw_bytes_per_s is None:
        return None
    ethernet = [k for k in list_links() if k.name.startswith("eth-") and k.bw_bytes_per_s is not None]
    nearest = min(ethernet, key=lambda k: abs(math.log(k.bw_bytes_per_s / inst.network_bw_bytes_per_s)))
    gbit = inst.network_bw_bytes_per_s * 8 / 1e9
    shared = f", shared by {gpus_per_instance} GPUs" if gpus_per_instance > 1 else ""
    return Link(
        name=f"{inst.name}-network",
        latency_s=nearest.latency_s,
        bw_bytes_per_s=inst.network_bw_bytes_per_s / gpus_per_instance,
        description=f"{inst.name} network, {gbit:g} Gb/s{shared}",
        source=f"bandwidth: the network of instance {inst.name} in the catalog; latency assumed as for {nearest.name}",
    )


def _make_group(
    what: str,
    *,
    gpu: str | GPU | None,
    gpus: int | None,
    nodes: int | None,
    gpus_per_node: int | None,
    intra_link: str | Link | None,
    inter_link: str | Link | None,
    price_per_gpu_hour: float | None,
    price_per_node_hour: float | None,
    currency: str | None,
    instance: str | Instance | None,
) -> NodeGroup:
    """One node group from `Cluster.from_catalog`'s arguments or a cluster file's keys; `what` prefixes every
    error."""
    gpus = _positive_int(gpus, "gpus", what)
    nodes = _positive_int(nodes, "nodes", what)
    gpus_per_node = _positive_int(gpus_per_node, "gpus_per_node", what)
    price_per_gpu_hour = _price(price_per_gpu_hour, "price_per_gpu_hour", what)
    price_per_node_hour = _price(price_per_node_hour, "price_per_node_hour", what)
    if isinstance(gpu, str):
        gpu = get_gpu(gpu)
    inst = get_instance(instance) if isinstance(instance, str) else instance

    # The device of one rank, and how many a node (an instance) holds.
    gpu, per_node_fixed = _rank_device(what, gpu, inst, gpus_per_node)
    if per_node_fixed is not None:
        gpus_per_node = per_node_fixed
    nodes, gpus_per_node = _node_shape(
        what, gpu=gpu, inst=inst, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, per_node_fixed=per_node_fixed
    )
    intra, inter = _links(gpu, inst, gpus_per_node, intra_link=intra_link, inter_link=inter_link)
    price_per_gpu_hour, currency = _price_per_gpu_hour(
        what,
        inst=inst,
        gpus_per_node=gpus_per_node,
        price_per_gpu_hour=price_per_gpu_hour,
        price_per_node_hour=price_per_node_hour,
        currency=currency,
    )
    return NodeGroup(
        gpu=gpu,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        intra_link=get_link(intra) if isinstance(intra, str) else intra,
        inter_link=get_link(inter) if isinstance(inter, str) else inter,
        price_per_gpu_hour=price_per_gpu_hour,
        currency=currency,
        instance=inst.name if inst is not None else None,
    )


def _rank_device(
    what: str, gpu: GPU | None, inst: Instance | None, gpus_per_node: int | None
) -> tuple[GPU, int | None]:
    """The device of one rank (an instance's GPU, or the slice of one it sells) and the GPUs per node the instance
    fixes (None without an instance); raises where `gpu` or `gpus_per_node` disagree with the instance."""
    per_node_fixed: int | None = None
    if inst is not None:
        base = get_gpu(inst.gpu)
        if gpu is not None and gpu.name != base.name:
            raise PlanError(f"{what}: 'gpu' is {gpu.name} but instance {inst.name} has {base.name}")
        if inst.gpus < 1:
            gpu = base.slice(
                inst.gpus,
                name=f"{base.name} {inst.gpus_label}",
                memory_bytes=inst.gpu_memory_bytes,
                source=f"{inst.gpus_label} of {base.name} as instance {inst.name} sells it ({inst.source}); "
                "compute and bandwidth scaled by the share",
            )
            per_node_fixed = 1
        else:
            gpu = base
            per_node_fixed = int(inst.gpus)
        if gpus_per_node is not None and gpus_per_node != per_node_fixed:
            raise PlanError(
                f"{what}: 'gpus_per_node' is {gpus_per_node} but instance {inst.name} has {inst.gpus_label} GPUs"
            )
    if gpu is None:
        raise PlanError(f"{what}: give 'gpu' (a catalog GPU name) or 'instance'")
    return gpu, per_node_fixed


def _node_shape(
    what: str,
    *,
    gpu: GPU,
    inst: Instance | None,
    gpus: int | None,
    nodes: int | None,
    gpus_per_node: int | None,
    per_node_fixed: int | None,
) -> tuple[int, int]:
    """(nodes, GPUs per node) from any two of `gpus`, `nodes` and `gpus_per_node`, or from fewer with the
    defaults: one GPU (or one instance), up to 8 catalog GPUs a node, all of "local"'s processes on one node."""
    if nodes is not None and gpus is not None:
        if gpus_per_node is None:
            if gpus % nodes:
                raise PlanError(f"{what}: 'gpus' ({gpus}) must be a multiple of 'nodes' ({nodes})")
            gpus_per_node = gpus // nodes
        if gpus != nodes * gpus_per_node:
            raise PlanError(f"{what}: 'gpus' ({gpus}) must equal 'nodes' ({nodes}) x 'gpus_per_node' ({gpus_per_node})")
    elif nodes is not None:
        if gpus_per_node is None:
            raise PlanError(f"{what}: 'gpus_per_node' is required with 'nodes'")
    else:
        gpus = gpus if gpus is not None else (per_node_fixed or 1)
        if gpus_per_node is None:
            # Processes on this machine share one node; catalog GPUs come 8 to a node unless told otherwise.
            gpus_per_node = gpus if gpu.name == LOCAL else min(gpus, 8)
        elif gpus < gpus_per_node and per_node_fixed is None:
            gpus_per_node = gpus  # part of one node
        if gpus % gpus_per_node:
            unit = f"instance {inst.name}'s GPUs" if inst is not None else "'gpus_per_node'"
            raise PlanError(f"{what}: 'gpus' ({gpus}) must be a multiple of {unit} ({gpus_per_node})")
        nodes = gpus // gpus_per_node
    assert gpus_per_node is not None
    return nodes, gpus_per_node


def _links(
    gpu: GPU,
    inst: Instance | None,
    gpus_per_node: int,
    *,
    intra_link: str | Link | None,
    inter_link: str | Link | None,
) -> tuple[str | Link, str | Link]:
    """The links inside a node and to other nodes, as given or else the defaults: the GPU's (or the fallbacks)
    inside a node; between nodes, the instance's, else the GPU's, else the fallback."""
    intra = intra_link if intra_link is not None else (gpu.default_intra_link or _FALLBACK_INTRA)
    inter: str | Link | None = inter_link
    if inter is None and inst is not None:
        inter = inst.inter_link or _instance_network_link(inst, gpus_per_node)
    if inter is None:
        inter = gpu.default_inter_link or _FALLBACK_INTER
    return intra, inter


def _price_per_gpu_hour(
    what: str,
    *,
    inst: Instance | None,
    gpus_per_node: int,
    price_per_gpu_hour: float | None,
    price_per_node_hour: float | None,
    currency: str | None,
) -> tuple[float | None, str | None]:
    """(price per GPU-hour, currency): as given per GPU or per node, or the instance's; both None for no price."""
    if price_per_gpu_hour is not None and price_per_node_hour is not None:
        raise PlanError(f"{what}: give 'price_per_gpu_hour' or 'price_per_node_hour', not both")
    if price_per_node_hour is not None:
        price_per_gpu_hour = price_per_node_hour / gpus_per_node
    if price_per_gpu_hour is not None:
        if currency is None:
            raise PlanError(f"{what}: 'currency' is required with a price (an ISO code such as 'USD' or 'CNY')")
    elif currency is not None and inst is None:
        raise PlanError(f"{what}: 'currency' {currency!r} is given without a price")
    elif inst is not None:
        if currency is not None and currency != inst.currency:
            raise PlanError(f"{what}: 'currency' is {currency} but instance {inst.name} is priced in {inst.currency}")
        price_per_gpu_hour = inst.price_per_hour / gpus_per_node
        currency = inst.currency
    if currency is not None:
        check_currency(currency, f"{what}: 'currency'")
    return price_per_gpu_hour, currency
