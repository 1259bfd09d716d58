"""An on-disk cache of profiles: a traced model's graph and what profiling measured of each block.

Profiling is the slow step of planning, and most of tracing is recording every node's output shapes on the meta
device; the symbolic trace itself (torch.fx) is cheap. So an entry keeps the traced graph's nodes (with their
recorded shapes) and the numbers profiling adds to the linearized chain: every Block field it changed (FLOPs,
saved bytes, fitted times, ...) and the chain's `input_saved_bytes`. A hit traces the model symbolically again
and checks that the fresh fx graph is node for node the one the entry was made from (names, ops, targets,
arguments), linearizes the cached graph onto it, checks that the blocks (names, node lists) and cuts (positions,
bytes) are the cached ones, and applies the cached numbers: the chain equals a fresh profile's.

The key holds the model's structure (module paths and classes, their `extra_repr`, parameter and buffer names,
shapes and dtypes, tied weights, and a digest of the source files that define its classes), the example inputs'
shapes and dtypes, the traced batch and the micro-batch sizes profiled, the chain options, the target (the
analytic GPU with its roofline figures and compute dtype, or the measuring device and timing options), and the
versions of pyplan and torch with a digest of pyplan's tracing and profiling code. One entry is one JSON file,
`{"format", "key", "sha256", "payload"}`, with `sha256` the digest of the payload; it is written to a temporary
file and renamed, so a reader sees a whole entry or none. An entry that cannot be read, fails its checksum,
holds another key or does not match the model is deleted and the model profiled again, never trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pyplan._files import write_atomic
from pyplan._version import __version__
from pyplan.errors import PlanError
from pyplan.graph.chain import Block, Chain
from pyplan.graph.layergraph import Affine, GraphNode, LayerGraph, Piecewise, TensorInfo
from pyplan.graph.linearize import linearize
from pyplan.graph.trace import Call, ExampleInputs, LeafSpec, _FxFailure, _symbolic_trace, inputs_at
from pyplan.hardware.catalog import GPU, cache_dir
from pyplan.profile.analytic import Roofline
from pyplan.profile.measure import TimingOptions

__all__ = [
    "FORMAT",
    "CacheStats",
    "ProfileCache",
    "ProfileKey",
    "analytic_target",
    "default_profile_dir",
    "measured_target",
    "model_digest",
]

# Version of the entry layout; an entry of another format is a miss.
FORMAT = 3

_PYPLAN_DIR = Path(__file__).resolve().parents[1]
_TORCH_DIR = Path(torch.__file__).resolve().parent
# pyplan's code that a profile depends on: tracing, linearizing and profiling (pyplan/profile/capture.py's
# `chain_for` combines them).
_PROFILING_CODE = ("_torch.py", "graph/*.py", "profile/*.py")
# The fields of GraphNode and TensorInfo, in the order an entry lists them.
_NODE_FIELDS = ("name", "op", "target", "module_path", "inputs", "outputs", "is_tensor", "static")
_TENSOR_FIELDS = ("shape", "dtype", "bytes", "batch_dim")
# Chain fields that are structure, checked rather than stored.
_CHAIN_STRUCTURE = frozenset({"blocks", "cuts", "order", "candidates", "graph"})


def default_profile_dir() -> Path:
    """`profiles/` in pyplan's cache directory: $PYPLAN_CACHE_DIR, else ~/.cache/pyplan (see `cache_dir`)."""
    return cache_dir() / "profiles"


def _canonical(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _file_digest(path: str) -> str:
    """SHA-256 of a file's bytes, computed again only when its size or modification time changes."""
    st = os.stat(path)
    return _digest_of_file(path, st.st_size, st.st_mtime_ns)


@functools.cache
def _digest_of_file(path: str, size: int, mtime_ns: int) -> str:
    return _sha256(Path(path).read_bytes())


def _code_digest() -> str:
    """Digest of pyplan's tracing and profiling sources, so an edit to them (no version bump in a development
    install) invalidates what they profiled."""
    files = sorted({p for pattern in _PROFILING_CODE for p in _PYPLAN_DIR.glob(pattern)})
    digests = "".join(f"{p.relative_to(_PYPLAN_DIR)}:{_file_digest(str(p))}\n" for p in files)
    return _sha256(digests)


def _class_source(cls: type) -> str:
    """A digest of the file defining `cls` (its forward and the helpers beside it); torch's own classes are
    covered by the torch version, and classes without a file (defined interactively) by their name alone."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    if path is None or not os.path.isfile(path) or Path(path).resolve().is_relative_to(_TORCH_DIR):
        return ""
    return _file_digest(str(Path(path).resolve()))


def model_digest(model: nn.Module) -> str:
    """Digest of what tracing and profiling see of `model` (values of weights excluded): module paths, classes
    and `extra_repr`, parameter and buffer names, shapes, dtypes and `requires_grad`, which parameters are tied,
    and the source files of the module classes."""
    h = hashlib.sha256()
    classes: dict[str, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        cls = type(mod)
        qualname = f"{cls.__module__}.{cls.__qualname__}"
        if qualname not in classes:
            classes[qualname] = _class_source(cls)
        h.update(f"m {name} {qualname} {mod.extra_repr()}\n".encode())
    first_name: dict[int, str] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        tied = first_name.setdefault(id(t), name)
        h.update(f"t {name} {tuple(t.shape)} {t.dtype} {t.requires_grad} {tied}\n".encode())
    for qualname, source in sorted(classes.items()):
        h.update(f"c {qualname} {source}\n".encode())
    return h.hexdigest()


def _inputs_signature(example_inputs: ExampleInputs, batch_size: int) -> list[list[Any]]:
    return [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in inputs_at(example_inputs, batch_size)]


def _leaf_names(leaf_modules: Iterable[LeafSpec]) -> list[str]:
    return [f"{x.__module__}.{x.__qualname__}" if isinstance(x, type) else x for x in leaf_modules]


def analytic_target(gpu: GPU, roofline: Roofline, compute_dtype: str | None, autocast: bool) -> dict[str, Any]:
    """The target of an analytic profile: the GPU with its figures, the roofline's efficiencies (calibrated ones
    for `local`), the dtype a 16-bit precision computes in and whether under autocast."""
    return {
        "mode": "analytic",
        "gpu": gpu.to_json(),
        "peak_flops_per_s": dict(roofline.peak_flops_per_s),
        "mem_bw_bytes_per_s": roofline.mem_bw_bytes_per_s,
        "efficiency": roofline.efficiency.to_json(),
        "compute_dtype": compute_dtype,
        "autocast": autocast,
    }


def measured_target(gpu: GPU, device: torch.device, options: TimingOptions) -> dict[str, Any]:
    """The target of a measured profile: the device it was timed on (and the local catalog entry describing this
    machine) and the timing options."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"mode": "measured", "device": name, "gpu": gpu.to_json(), "timing": dataclasses.asdict(options)}


@dataclass(frozen=True)
class ProfileKey:
    """Everything a profile depends on, as canonical JSON; profiles with equal keys are interchangeable.

    `label` (the model's class name) only names the file; `data` is compared in full on every lookup.
    """

    label: str
    data: Mapping[str, Any]

    @functools.cached_property
    def digest(self) -> str:
        return _sha256(_canonical(self.data))

    @staticmethod
    def of(
        model: nn.Module,
        example_inputs: ExampleInputs,
        *,
        trace_batch: int,
        batch_sizes: Sequence[int],
        target: Mapping[str, Any],
        leaf_modules: Iterable[LeafSpec] = (),
        min_blocks: int,
        max_blocks: int,
    ) -> ProfileKey:
        """The key of profiling `model` as `chain_for` does: traced at `trace_batch`, timed at `batch_sizes`,
        for `target` (JSON: the analytic GPU and its roofline, or the measuring device and timing options)."""

        data = {
            "model": model_digest(model),
            "inputs": _inputs_signature(example_inputs, trace_batch),
            "trace_batch": trace_batch,
            "batch_sizes": list(batch_sizes),
            "leaf_modules": _leaf_names(leaf_modules),
            "min_blocks": min_blocks,
            "max_blocks": max_blocks,
            "target": target,
            "pyplan": __version__,
            "code": _code_digest(),
            "torch": torch.__version__,
        }
        # Through JSON once, so the key compares equal to the one read back from a file (tuples become lists).
        return ProfileKey(label=type(model).__name__, data=json.loads(_canonical(data)))


@dataclass
class CacheStats:
    """What a cache did: entries found and used, not found, found but discarded, and written."""

    hits: int = 0
    misses: int = 0
    discarded: int = 0
    stored: int = 0
    reasons: list[str] = field(default_factory=list)

    def add(self, other: CacheStats) -> None:
        self.hits += other.hits
        self.misses += other.misses
        self.discarded += other.discarded
        self.stored += other.stored
        self.reasons += other.reasons


class _Invalid(Exception):
    """An entry that must not be used; the message says why."""


def _encode(value: Any) -> Any:
    """JSON for a profiled value: numbers and strings as they are, an Affine as [per_sample, fixed], a Piecewise
    as [per_sample, fixed, [[size, value], ...]], other pyplan dataclasses, tuples, lists and dicts tagged with
    what they are."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Piecewise):
        return [value.per_sample, value.fixed, [[b, v] for b, v in value.points]]
    if isinstance(value, Affine):
        return [value.per_sample, value.fixed]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if not cls.__module__.startswith("pyplan."):
            raise TypeError(f"the profile cache stores pyplan's dataclasses only, got {cls.__qualname__}")
        fields = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"type": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(value, tuple | list):
        return {type(value).__name__: [_encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    raise TypeError(f"the profile cache cannot store a {type(value).__name__}; teach pyplan/profile/cache.py")


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _Invalid(f"{value!r} is not a finite number")
    return value


def _dataclass(name: Any) -> type:
    """The pyplan dataclass called "module:qualname" (nothing outside pyplan is imported)."""
    module, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not module.startswith("pyplan.") or not qualname:
        raise _Invalid(f"{name!r} is not a pyplan dataclass")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise _Invalid(f"{name!r} does not exist") from None
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise _Invalid(f"{name!r} is not a dataclass")
    if not obj.__module__.startswith("pyplan."):  # reached through a name a pyplan module imported (torch's, ...)
        raise _Invalid(f"{name!r} is not a pyplan dataclass")
    return obj


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        if len(value) == 3 and isinstance(value[2], list):
            points = value[2]
            if len(points) < 2 or not all(isinstance(p, list) and len(p) == 2 for p in points):
                raise _Invalid(f"a curve needs two or more [size, value] points, got {points!r}")
            sizes = [int(_number(b)) for b, _ in points]
            if sizes != sorted(set(sizes)):
                raise _Invalid(f"a curve's sizes must increase, got {sizes}")
            return Piecewise(
                _number(value[0]), _number(value[1]), tuple((b, _number(v)) for b, (_, v) in zip(sizes, points))
            )
        if len(value) != 2:
            raise _Invalid(f"an affine value needs 2 numbers, got {value!r}")
        return Affine(_number(value[0]), _number(value[1]))
    if isinstance(value, float):
        return _number(value)
    if not isinstance(value, dict):
        return value
    if set(value) == {"type", "fields"} and isinstance(value["fields"], dict):
        try:
            return _dataclass(value["type"])(**{k: _decode(v) for k, v in value["fields"].items()})
        except TypeError as exc:
            raise _Invalid(f"{value['type']}: {exc}") from None
    if len(value) == 1:
        ((tag, items),) = value.items()
        if tag in ("tuple", "list") and isinstance(items, list):
            decoded = [_decode(v) for v in items]
            return tuple(decoded) if tag == "tuple" else decoded
        if tag == "dict" and isinstance(items, dict):
            return {k: _decode(v) for k, v in items.items()}
    raise _Invalid(f"cannot read the value {value!r}")


def _changed(fresh: Any, profiled: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The dataclass fields profiling changed, encoded."""
    return {
        f.name: _encode(getattr(profiled, f.name))
        for f in dataclasses.fields(fresh)
        if f.name not in skip and getattr(fresh, f.name) != getattr(profiled, f.name)
    }


def _fits(value: Any, hint: Any) -> bool:
    """Whether `value` is of the type `hint` names, as far as a cache entry can hold: classes, unions, the outer
    type of generics (tuple[...], dict[...]), Any."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    cls = origin or hint
    return not isinstance(cls, type) or isinstance(value, cls)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field types of a dataclass, each resolved in its module; one that names a type imported only for type
    checking is Any."""
    namespace = vars(importlib.import_module(cls.__module__))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        try:
            out[f.name] = eval(f.type, namespace) if isinstance(f.type, str) else f.type
        except NameError:
            out[f.name] = Any
    return out


def _applied(obj: Any, values: Any, what: str) -> Any:
    if not isinstance(values, dict):
        raise _Invalid(f"{what}: expected an object of fields")
    names = {f.name for f in dataclasses.fields(obj)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise _Invalid(f"{what}: unknown field '{unknown[0]}'")
    decoded = {k: _decode(v) for k, v in values.items()}
    hints = _hints(type(obj))
    for k, v in decoded.items():
        if not _fits(v, hints.get(k, Any)):
            raise _Invalid(f"{what}: field '{k}' holds a {type(v).__name__}, not {hints[k]}")
    return dataclasses.replace(obj, **decoded)


def _cut_json(chain: Chain) -> list[list[Any]]:
    return [[c.position, c.bytes.per_sample, c.bytes.fixed] for c in chain.cuts]


def _target(target: Any) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _fx_signature(gm: fx.GraphModule) -> list[list[str]]:
    """Each fx node's name, op, target and arguments (other nodes by name; addresses dropped from reprs)."""
    return [
        [
            n.name,
            n.op,
            _target(n.target),
            re.sub(r" at 0x[0-9a-f]+", "", repr(fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{a.name}"))),
        ]
        for n in gm.graph.nodes
    ]


def _check_fields(cls: type, expected: tuple[str, ...]) -> None:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if names != expected:
        raise TypeError(f"{cls.__name__} has the fields {names}; teach pyplan/profile/cache.py to store them")


def _node_row(n: GraphNode) -> list[Any]:
    outputs = [[list(t.shape), t.dtype, t.bytes.per_sample, t.bytes.fixed, t.batch_dim] for t in n.outputs]
    return [n.name, n.op, n.target, n.module_path, list(n.inputs), outputs, n.is_tensor, n.static]


def _node(row: Any) -> GraphNode:
    try:
        name, op, target, module_path, inputs, outputs, is_tensor, static = row
        infos = tuple(
            TensorInfo(
                tuple(int(d) for d in shape),
                str(dtype),
                Affine(_number(ps), _number(fixed)),
                None if batch_dim is None else int(batch_dim),
            )
            for shape, dtype, ps, fixed, batch_dim in outputs
        )
        return GraphNode(
            str(name),
            str(op),
            str(target),
            str(module_path),
            tuple(map(str, inputs)),
            infos,
            bool(is_tensor),
            bool(static),
        )
    except (TypeError, ValueError) as exc:
        raise _Invalid(f"a graph node cannot be read ({exc})") from None


def _payload(fresh: Chain, profiled: Chain, profiled_on: str) -> dict[str, Any]:
    if len(fresh) != len(profiled):
        raise ValueError(f"profiling changed the chain's length from {len(fresh)} to {len(profiled)} blocks")
    _check_fields(GraphNode, _NODE_FIELDS)
    _check_fields(TensorInfo, _TENSOR_FIELDS)
    graph = fresh.graph
    return {
        "profiled_on": profiled_on,
        "fx": _fx_signature(graph.module),
        "graph": {
            "batch_size": graph.batch_size,
            "leaf_modules": list(graph.leaf_modules),
            "nodes": [_node_row(n) for n in graph.nodes],
        },
        "blocks": [
            {"name": b.name, "nodes": list(b.nodes), "fields": _changed(b, p, frozenset({"name", "nodes"}))}
            for b, p in zip(fresh.blocks, profiled.blocks)
        ],
        "cuts": _cut_json(fresh),
        "chain": _changed(fresh, profiled, _CHAIN_STRUCTURE),
    }


def _graph(payload: dict[str, Any], gm: fx.GraphModule) -> LayerGraph:
    """The cached LayerGraph on the freshly traced `gm`, after checking that `gm` is the graph it was made of."""
    if payload.get("fx") != _fx_signature(gm):
        raise _Invalid("the model's fx graph differs from the cached one")
    graph = payload.get("graph")
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        raise _Invalid("the payload has no graph")
    nodes = [_node(row) for row in graph["nodes"]]
    if [n.name for n in nodes] != [n.name for n in gm.graph.nodes]:
        raise _Invalid("the cached graph's nodes are not the fx graph's")
    batch_size, leaves = graph.get("batch_size"), graph.get("leaf_modules")
    if not isinstance(batch_size, int) or not isinstance(leaves, list):
        raise _Invalid("the cached graph has no batch size or leaf modules")
    return LayerGraph(nodes=nodes, batch_size=batch_size, module=gm, leaf_modules=tuple(map(str, leaves)))


def _apply(payload: dict[str, Any], chain: Chain) -> tuple[Chain, str]:
    """`chain` with the payload's profile, after checking that it was made from the same blocks and cuts."""
    if not isinstance(payload.get("blocks"), list):
        raise _Invalid("the payload has no blocks")
    entries = payload["blocks"]
    if len(entries) != len(chain):
        raise _Invalid(f"{len(entries)} blocks cached, the chain has {len(chain)}")
    blocks: list[Block] = []
    for i, (entry, block) in enumerate(zip(entries, chain.blocks)):
        if not isinstance(entry, dict) or entry.get("name") != block.name or entry.get("nodes") != list(block.nodes):
            raise _Invalid(f"block {i} ({block.name}) has other nodes than the cached one")
        blocks.append(_applied(block, entry.get("fields"), f"block {i}"))
    if payload.get("cuts") != _cut_json(chain):
        raise _Invalid("the chain's cuts (positions or bytes) differ from the cached ones")
    profiled_on = payload.get("profiled_on")
    if not isinstance(profiled_on, str):
        raise _Invalid("the payload does not say how it was profiled")
    profiled = _applied(dataclasses.replace(chain, blocks=blocks), payload.get("chain"), "chain")
    return profiled, profiled_on


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-.")[:48] or "model"


@dataclass
class ProfileCache:
    """Profiles on disk in `directory` (default: `default_profile_dir()`), shared by processes: writes are
    atomic renames, and concurrent writers of one key write equal entries. `stats` counts what it did."""

    directory: Path = field(default_factory=default_profile_dir)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).expanduser()

    def path(self, key: ProfileKey) -> Path:
        return self.directory / f"{_slug(key.label)}-{key.digest[:24]}.json"

    def load(
        self,
        key: ProfileKey,
        model: nn.Module,
        call: Call,
        *,
        leaf_modules: Iterable[LeafSpec] = (),
        min_blocks: int,
        max_blocks: int,
    ) -> tuple[Chain, str] | None:
        """The cached profile of `key` as a chain of `model` called as `call` (traced symbolically, its shapes not
        recorded again, linearized with `min_blocks` and `max_blocks`), and how it was profiled; None when there is
        none. An entry that cannot be read or does not match the model is deleted (and counted)."""
        path = self.path(key)
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            self.stats.misses += 1
            return None
        except (OSError, UnicodeDecodeError) as exc:
            return self._discard(path, f"unreadable ({exc})")
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise _Invalid(f"not a format-{FORMAT} entry")
            if entry.get("key") != key.data:
                raise _Invalid("it holds another key")
            payload = entry.get("payload")
            if not isinstance(payload, dict) or entry.get("sha256") != _sha256(_canonical(payload)):
                raise _Invalid("its checksum does not match")
            try:
                traced = _symbolic_trace(model, tuple(leaf_modules), call)
            except _FxFailure:  # captured by torch.export: not checked again here, so profiled anew
                self.stats.misses += 1
                return None
            graph = _graph(payload, traced)
            result = _apply(payload, linearize(graph, min_blocks=min_blocks, max_blocks=max_blocks))
        except json.JSONDecodeError as exc:
            return self._discard(path, f"not valid JSON ({exc})")
        except RecursionError:
            return self._discard(path, "its JSON nests too deeply")
        except _Invalid as exc:
            return self._discard(path, str(exc))
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            # A field of the wrong type that the checksum vouches for: it would fail again on every run.
            return self._discard(path, f"a field cannot be used ({type(exc).__name__}: {exc})")
        self.stats.hits += 1
        return result

    def store(self, key: ProfileKey, fresh: Chain, profiled: Chain, profiled_on: str) -> None:
        """Keep the traced graph of `fresh` (a linearized chain) and what profiling added to it (giving
        `profiled`). A cache that cannot be written is skipped: it only saves time."""
        payload = _payload(fresh, profiled, profiled_on)
        entry = {"format": FORMAT, "key": key.data, "sha256": _sha256(_canonical(payload)), "payload": payload}
        try:
            write_atomic(self.path(key), json.dumps(entry, sort_keys=True), make_parents=True)
        except (OSError, PlanError) as exc:  # (write_atomic says why in a PlanError)
            self.stats.reasons.append(f"not stored: {exc}")
            return
        self.stats.stored += 1

    def _discard(self, path: Path, reason: str) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
        self.stats.discarded += 1
        self.stats.reasons.append(f"{path.name}: {reason}")
        return None
