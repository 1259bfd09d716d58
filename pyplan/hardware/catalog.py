"""The hardware catalog: GPUs, links and cloud instances with prices, read from TOML files shipped in the package."""

from __future__ import annotations

import difflib
import functools
import json
import os
import platform
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from fractions import Fraction
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from pyplan.errors import PlanError

__all__ = [
    "DTYPES",
    "GIB",
    "GPU",
    "LOCAL",
    "Catalog",
    "Instance",
    "Link",
    "Money",
    "cache_dir",
    "check_currency",
    "convert",
    "get_gpu",
    "get_instance",
    "get_link",
    "list_gpus",
    "list_instances",
    "list_links",
    "load_catalog",
    "local_calibration_path",
    "local_efficiency",
    "local_gpu",
    "local_host_json",
    "local_link",
    "total",
]

# Glossary. "GPU" is any device a training process runs on, the local CPU included. Memory is in bytes and
# catalog capacities are GiB (see data/gpus.toml); bandwidths are decimal bytes per second; peak_flops_per_s is
# dense throughput per dtype. A link's bandwidth is unidirectional and per GPU (see data/links.toml).

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
GIB = 2**30
LOCAL = "local"
_ARCH = re.compile(r"sm\d{2,3}|gfx[0-9a-f]{3,4}")
_DEVICE_TYPES = ("cuda", "cpu")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


# The active currency codes of ISO 4217 (list one, as published by SIX for 2025), without the fund codes (BOV, CHE,
# CHW, CLF, COU, MXV, USN, UYI, UYW), precious metals (XAG, XAU, XPD, XPT), settlement units (XBA-XBD, XDR, XSU,
# XUA), the testing code XTS and XXX (no currency): a price is in money someone pays.
ISO_4217 = frozenset(
    """AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP BYN BZD CAD CDF
    CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS GIP GMD GNF GTQ GYD HKD HNL
    HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR LRD LSL LYD MAD MDL
    MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN PGK PHP PKR PLN PYG QAR RON
    RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB TJS TMT TND TOP TRY TTD TWD TZS UAH
    UGX USD UYU UZS VED VES VND VUV WST XAF XCD XCG XOF XPF YER ZAR ZMW ZWG""".split()  # noqa: SIM905 (a table)
)


def check_currency(currency: Any, what: str) -> None:
    """Raise unless `currency` is an active ISO 4217 currency code (`ISO_4217`); `what` names the field in the
    message."""
    rmb = isinstance(currency, str) and currency.upper() == "RMB"  # the name of China's money, not its code
    if rmb or not isinstance(currency, str) or currency not in ISO_4217:
        hint = "; RMB is 'CNY'" if rmb else ""
        if isinstance(currency, str) and currency.upper() in ISO_4217 and currency != currency.upper():
            hint = f"; write it in capitals, '{currency.upper()}'"
        raise PlanError(f"{what} must be an ISO 4217 currency code such as 'USD' or 'CNY', got {currency!r}{hint}")


def _unknown_keys(data: Mapping[str, Any], cls: type, what: str) -> None:
    allowed = [f.name for f in fields(cls)]
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; expected one of {', '.join(allowed)}"
            raise PlanError(f"{what}: unknown key '{key}'{hint}")


def _build(cls: type, values: dict[str, Any], prefix: str, what: str | None) -> Any:
    """cls(**values); a validation error names the entry by `what` (e.g. the file it came from) instead of
    by its own name (`prefix`)."""
    try:
        return cls(**values)
    except PlanError as exc:
        raise PlanError(str(exc).replace(prefix, what, 1) if what else str(exc)) from None
    except TypeError as exc:
        raise PlanError(f"{what or prefix}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class GPU:
    """A device type: memory, memory bandwidth and peak dense FLOP/s per dtype, with the source of the figures.

    Figures are None (or the FLOP/s dict empty) only for the `local` entry before calibration. `device_type` is
    the torch device a process uses on it ("cuda" also for ROCm GPUs); `cpu_threads` is set for a CPU.
    """

    name: str
    memory_bytes: int | None
    hbm_bw_bytes_per_s: float | None
    peak_flops_per_s: Mapping[str, float] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    description: str = ""
    tdp_w: float | None = None
    device_type: str = "cuda"
    cpu_threads: int | None = None
    default_intra_link: str | None = None
    default_inter_link: str | None = None
    source: str = ""
    # "smXY" (NVIDIA compute capability X.Y) or "gfxNNN" (AMD); None where unknown (a CPU, an uncalibrated local).
    arch: str | None = None

    def __post_init__(self) -> None:
        what = f"GPU '{self.name}'"
        if self.arch is not None and not (isinstance(self.arch, str) and _ARCH.fullmatch(self.arch)):
            raise PlanError(f"{what}: 'arch' must read like 'sm80' or 'gfx942', got {self.arch!r}")
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"GPU: 'name' must be a non-empty string, got {self.name!r}")
        if self.memory_bytes is not None and not (isinstance(self.memory_bytes, int) and _positive(self.memory_bytes)):
            raise PlanError(f"{what}: 'memory_bytes' must be a positive integer, got {self.memory_bytes!r}")
        for key in ("hbm_bw_bytes_per_s", "tdp_w"):
            value = getattr(self, key)
            if value is not None and not _positive(value):
                raise PlanError(f"{what}: '{key}' must be positive, got {value!r}")
        if not isinstance(self.peak_flops_per_s, Mapping):
            raise PlanError(f"{what}: 'peak_flops_per_s' must map dtypes to FLOP/s, got {self.peak_flops_per_s!r}")
        # Read-only, so that no caller can change a cached catalog entry.
        object.__setattr__(self, "peak_flops_per_s", MappingProxyType(dict(self.peak_flops_per_s)))
        for dtype, flops in self.peak_flops_per_s.items():
            if dtype not in DTYPES:
                raise PlanError(f"{what}: unknown dtype '{dtype}' in 'peak_flops_per_s'; known: {', '.join(DTYPES)}")
            if not _positive(flops):
                raise PlanError(f"{what}: 'peak_flops_per_s.{dtype}' must be positive, got {flops!r}")
        if self.device_type not in _DEVICE_TYPES:
            raise PlanError(
                f"{what}: 'device_type' must be one of {', '.join(_DEVICE_TYPES)}, got {self.device_type!r}"
            )
        if self.cpu_threads is not None and not (isinstance(self.cpu_threads, int) and self.cpu_threads > 0):
            raise PlanError(f"{what}: 'cpu_threads' must be a positive integer, got {self.cpu_threads!r}")

    def __hash__(self) -> int:
        return hash((self.name, self.memory_bytes, self.hbm_bw_bytes_per_s, tuple(self.peak_flops_per_s.items())))

    @property
    def calibrated(self) -> bool:
        """Whether memory, bandwidth and at least one peak FLOP/s figure are known."""
        return self.memory_bytes is not None and self.hbm_bw_bytes_per_s is not None and bool(self.peak_flops_per_s)

    def check_complete(self, what: str) -> None:
        """Raise unless every figure a plan needs is known and the figures have a source."""
        missing = [
            key
            for key in ("memory_bytes", "hbm_bw_bytes_per_s", "peak_flops_per_s", "source")
            if not getattr(self, key)
        ]
        if missing:
            raise PlanError(f"{what}: GPU '{self.name}' lacks {', '.join(repr(k) for k in missing)}")

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype`; raises when the catalog has no figure for it."""
        if dtype not in DTYPES:
            raise PlanError(f"unknown dtype '{dtype}'; known: {', '.join(DTYPES)}")
        if dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        if not self.peak_flops_per_s:
            raise PlanError(f"GPU '{self.name}' has no peak FLOP/s figures yet: run `pyplan calibrate`")
        have = ", ".join(self.peak_flops_per_s)
        raise PlanError(f"GPU '{self.name}' has no {dtype} peak in the catalog; it has {have}")

    def slice(self, share: float, *, name: str, memory_bytes: int | None = None, source: str = "") -> GPU:
        """A share (0 < share ≤ 1) of this GPU, as a vGPU or shared-GPU instance sells it.

        Compute and bandwidth scale with the share (time slicing); memory is `memory_bytes` when the provider
        states it, else the share of the whole.
        """
        if not 0 < share <= 1:
            raise PlanError(f"a share of GPU '{self.name}' must lie in (0, 1], got {share}")
        memory = memory_bytes if memory_bytes is not None else self.memory_bytes
        if memory_bytes is None and memory is not None:
            memory = int(memory * share)
        return replace(
            self,
            name=name,
            aliases=(),
            memory_bytes=memory,
            hbm_bw_bytes_per_s=self.hbm_bw_bytes_per_s * share if self.hbm_bw_bytes_per_s else None,
            peak_flops_per_s={k: v * share for k, v in self.peak_flops_per_s.items()},
            tdp_w=None,
            source=source or f"{_fraction(share)} of {self.name}: compute and bandwidth scaled by the share",
        )

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["aliases"] = list(self.aliases)
        data["peak_flops_per_s"] = dict(self.peak_flops_per_s)
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any], what: str | None = None) -> GPU:
        _unknown_keys(data, GPU, what or "GPU")
        if "name" not in data:
            raise PlanError(f"{what or 'GPU'}: 'name' is required")
        values = {"memory_bytes": None, "hbm_bw_bytes_per_s": None, **data}
        if isinstance(values.get("aliases"), list):
            values["aliases"] = tuple(values["aliases"])
        if isinstance(values.get("peak_flops_per_s"), Mapping):
            values["peak_flops_per_s"] = dict(values["peak_flops_per_s"])
        return _build(GPU, values, f"GPU '{values['name']}'", what)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A connection between two GPUs in the α-β model: a transfer of n bytes takes latency_s + n/bw_bytes_per_s.

    `bw_bytes_per_s` is unidirectional and per GPU, as a ring all-reduce step sees it (data/links.toml says
    what each figure is). Both numbers are None only for the uncalibrated `local` link.
    """

    name: str
    latency_s: float | None
    bw_bytes_per_s: float | None
    aliases: tuple[str, ...] = ()
    description: str = ""
    source: str = ""
    # The α-β a ring collective's step sees, when measured and unlike a send's (gloo's all-reduce on a CPU adds
    # and copies slower than it sends): None, the same as latency_s and bw_bytes_per_s.
    collective_latency_s: float | None = None
    collective_bw_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"link: 'name' must be a non-empty string, got {self.name!r}")
        if (self.collective_latency_s is None) != (self.collective_bw_bytes_per_s is None):
            raise PlanError(f"link '{self.name}': give both collective_latency_s and collective_bw_bytes_per_s")
        if self.collective_bw_bytes_per_s is not None and not (
            _positive(self.collective_bw_bytes_per_s)
            and (_positive(self.collective_latency_s) or self.collective_latency_s == 0)
        ):
            raise PlanError(f"link '{self.name}': collective latency must be >= 0 and bandwidth > 0")
        if self.latency_s is not None and not (_positive(self.latency_s) or self.latency_s == 0):
            raise PlanError(f"link '{self.name}': 'latency_s' must be zero or positive, got {self.latency_s!r}")
        if self.bw_bytes_per_s is not None and not _positive(self.bw_bytes_per_s):
            raise PlanError(f"link '{self.name}': 'bw_bytes_per_s' must be positive, got {self.bw_bytes_per_s!r}")

    @property
    def calibrated(self) -> bool:
        return self.latency_s is not None and self.bw_bytes_per_s is not None

    def check_complete(self, what: str) -> None:
        missing = [key for key in ("latency_s", "bw_bytes_per_s", "source") if getattr(self, key) in (None, "")]
        if missing:
            raise PlanError(f"{what}: link '{self.name}' lacks {', '.join(repr(k) for k in missing)}")

    @property
    def collective(self) -> tuple[float, float]:
        """(latency_s, bw_bytes_per_s) of one ring step of a collective."""
        if self.collective_latency_s is not None and self.collective_bw_bytes_per_s is not None:
            return self.collective_latency_s, self.collective_bw_bytes_per_s
        if self.latency_s is None or self.bw_bytes_per_s is None:
            raise PlanError(f"link '{self.name}' has no latency and bandwidth yet: run `pyplan calibrate`")
        return self.latency_s, self.bw_bytes_per_s

    def time_s(self, nbytes: float) -> float:
        """α-β time of one transfer of `nbytes`."""
        if self.latency_s is None or self.bw_bytes_per_s is None:
            raise PlanError(f"link '{self.name}' has no latency and bandwidth yet: run `pyplan calibrate`")
        return self.latency_s + nbytes / self.bw_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["aliases"] = list(self.aliases)
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any], what: str | None = None) -> Link:
        _unknown_keys(data, Link, what or "link")
        for key in ("name", "latency_s", "bw_bytes_per_s"):
            if key not in data:
                raise PlanError(f"{what or 'link'}: '{key}' is required")
        values = dict(data)
        if isinstance(values.get("aliases"), list):
            values["aliases"] = tuple(values["aliases"])
        return _build(Link, values, f"link '{values['name']}'", what)


@dataclass(frozen=True)
class Money:
    """An amount in one currency (ISO 4217 code). Adding or comparing two currencies raises PlanError."""

    amount: float
    currency: str

    def __post_init__(self) -> None:
        check_currency(self.currency, "a price's currency")

    def _same(self, other: Money, op: str) -> None:
        if not isinstance(other, Money):
            raise TypeError(f"cannot {op} Money and {type(other).__name__}")
        if other.currency != self.currency:
            raise PlanError(
                f"cannot {op} {self} and {other}: different currencies; convert with explicit exchange rates first"
            )

    def __add__(self, other: Money) -> Money:
        self._same(other, "add")
        return Money(self.amount + other.amount, self.currency)

    def __lt__(self, other: Money) -> bool:
        self._same(other, "compare")
        return self.amount < other.amount

    def __le__(self, other: Money) -> bool:
        self._same(other, "compare")
        return self.amount <= other.amount

    def __gt__(self, other: Money) -> bool:
        self._same(other, "compare")
        return self.amount > other.amount

    def __ge__(self, other: Money) -> bool:
        self._same(other, "compare")
        return self.amount >= other.amount

    def scaled(self, factor: float) -> Money:
        return Money(self.amount * factor, self.currency)

    def __str__(self) -> str:
        return f"{self.amount:.4g} {self.currency}"


def convert(money: Money, currency: str, rates: Mapping[str, float] | None) -> Money:
    """`money` in `currency`. `rates` gives the value of one unit of each currency in a common unit of account,
    e.g. {"USD": 1.0, "CNY": 0.138}; it is required whenever the currencies differ."""
    check_currency(currency, "the target currency")
    if money.currency == currency:
        return money
    if rates is None:
        raise PlanError(f"cannot convert {money} to {currency} without exchange rates")
    for code in (money.currency, currency):
        if not _positive(rates.get(code)):
            raise PlanError(f"exchange rates give no positive value for {code}: {dict(rates)}")
    return Money(money.amount * rates[money.currency] / rates[currency], currency)


def total(prices: Iterable[Money], *, currency: str | None = None, rates: Mapping[str, float] | None = None) -> Money:
    """The sum of `prices`: in their one currency, or in `currency` through explicit `rates`."""
    items = list(prices)
    if currency is None:
        codes = sorted({p.currency for p in items})
        if len(codes) > 1:
            raise PlanError(f"cannot add prices in {' and '.join(codes)} without a target currency and exchange rates")
        if not codes:
            raise PlanError("cannot total no prices without a currency")
        currency = codes[0]
    result = Money(0.0, currency)
    for price in items:
        result = result + convert(price, currency, rates)
    return result


def _fraction(x: float) -> str:
    f = Fraction(x).limit_denominator(64)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


@dataclass(frozen=True, kw_only=True)
class Instance:
    """A cloud instance: its GPUs (a fraction for a shared GPU) and its on-demand price per hour of one instance.

    `gpu_memory_bytes` is the memory of a GPU slice when the provider states it; `network_bw_bytes_per_s` is the
    instance's whole network bandwidth; `inter_link`, where set, is the catalog link each GPU uses to reach
    other instances (e.g. one InfiniBand port per GPU).
    """

    provider: str
    name: str
    gpu: str
    gpus: float
    price_per_hour: float
    currency: str
    gpu_memory_bytes: int | None = None
    region: str | None = None
    vcpus: int | None = None
    network_bw_bytes_per_s: float | None = None
    inter_link: str | None = None
    aliases: tuple[str, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        what = f"instance '{self.name}'"
        if not _positive(self.gpus):
            raise PlanError(f"{what}: 'gpus' must be positive, got {self.gpus!r}")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise PlanError(f"{what}: 'gpus' above 1 must be whole, got {self.gpus!r}")
        if not (_positive(self.price_per_hour) or self.price_per_hour == 0):
            raise PlanError(f"{what}: 'price_per_hour' must be zero or positive, got {self.price_per_hour!r}")
        check_currency(self.currency, f"{what}: 'currency'")
        for key in ("gpu_memory_bytes", "vcpus", "network_bw_bytes_per_s"):
            value = getattr(self, key)
            if value is not None and not _positive(value):
                raise PlanError(f"{what}: '{key}' must be positive, got {value!r}")

    @property
    def gpus_label(self) -> str:
        """GPUs per instance as the provider writes it: "8", "1/6"."""
        return _fraction(self.gpus)

    def price(self) -> Money:
        """Price of one instance per hour."""
        return Money(self.price_per_hour, self.currency)

    def price_per_gpu_hour(self) -> Money:
        """Price per hour of one whole GPU's worth (a 1/6 slice costs a sixth of this)."""
        return Money(self.price_per_hour / self.gpus, self.currency)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["aliases"] = list(self.aliases)
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any], what: str | None = None) -> Instance:
        _unknown_keys(data, Instance, what or "instance")
        values = dict(data)
        if isinstance(values.get("aliases"), list):
            values["aliases"] = tuple(values["aliases"])
        return _build(Instance, values, f"instance '{values.get('name')}'", what)


# --- Reading the TOML files ---------------------------------------------------------------------------------


def _key(name: str) -> str:
    """The lookup form of a name: lower case, '-' for spaces and underscores, no 'nvidia-', '80gb' read as '80g'."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    key = re.sub(r"^nvidia-", "", key)
    return re.sub(r"(\d)gb\b", r"\1g", key)


def _gpus_value(value: Any, what: str) -> float:
    if isinstance(value, str):
        try:
            return float(Fraction(value))
        except (ValueError, ZeroDivisionError):
            raise PlanError(f"{what}: 'gpus' must be a number or a fraction such as \"1/6\", got {value!r}") from None
    return value


def _gpu_from_toml(entry: dict[str, Any], what: str) -> GPU:
    entry = dict(entry)
    if "memory_gib" in entry:
        entry["memory_bytes"] = round(entry.pop("memory_gib") * GIB)
    return GPU.from_json(entry, what)


def _instance_from_toml(entry: dict[str, Any], what: str) -> Instance:
    entry = dict(entry)
    entry["gpus"] = _gpus_value(entry.get("gpus"), what)
    if "gpu_memory_gib" in entry:
        entry["gpu_memory_bytes"] = round(entry.pop("gpu_memory_gib") * GIB)
    if "network_gbit_per_s" in entry:
        entry["network_bw_bytes_per_s"] = entry.pop("network_gbit_per_s") * 1e9 / 8
    return Instance.from_json(entry, what)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{path}: not valid TOML: {exc}") from None


def _suggest(kind: str, name: str, entries: Iterable[GPU | Link | Instance], hint: str) -> PlanError:
    key = _key(name)

    def score(entry: GPU | Link | Instance) -> tuple[bool, float]:
        # Names that the query begins (their own or an alias) first, so "a100" lists the A100s, not the A10;
        # then by similarity of the canonical name.
        prefix = any(_key(n).startswith(key) for n in (entry.name, *entry.aliases))
        return prefix, difflib.SequenceMatcher(None, key, _key(entry.name)).ratio()

    ranked = sorted(entries, key=score, reverse=True)
    return PlanError(f"unknown {kind} '{name}'; closest: {', '.join(e.name for e in ranked[:3])} ({hint})")


def _index(entries: Iterable[GPU | Link | Instance], kind: str, where: str) -> dict[str, Any]:
    index: dict[str, Any] = {}
    for entry in entries:
        for alias in (entry.name, *entry.aliases):
            key = _key(alias)
            if key in index and index[key] is not entry:
                raise PlanError(
                    f"{where}: {kind} name '{alias}' is used by both '{index[key].name}' and '{entry.name}'"
                )
            index[key] = entry
    if LOCAL in index:
        raise PlanError(f"{where}: '{LOCAL}' is reserved for this machine's own device")
    return index


@dataclass(frozen=True)
class Catalog:
    """GPUs, links and instances read from one directory of TOML files (gpus.toml, links.toml, instances.toml)."""

    gpus: tuple[GPU, ...]
    links: tuple[Link, ...]
    instances: tuple[Instance, ...]

    _lookup: dict[str, dict[str, Any]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        gpu_index = _index(self.gpus, "GPU", "gpus.toml")
        link_index = _index(self.links, "link", "links.toml")
        instance_index = _index(self.instances, "instance", "instances.toml")
        for gpu in self.gpus:
            for key in ("default_intra_link", "default_inter_link"):
                link = getattr(gpu, key)
                if link is not None and _key(link) not in link_index:
                    raise PlanError(f"gpus.toml: GPU '{gpu.name}': '{key}' names unknown link '{link}'")
        for inst in self.instances:
            if _key(inst.gpu) not in gpu_index:
                raise PlanError(f"instances.toml: instance '{inst.name}' names unknown GPU '{inst.gpu}'")
            if inst.inter_link is not None and _key(inst.inter_link) not in link_index:
                raise PlanError(f"instances.toml: instance '{inst.name}' names unknown link '{inst.inter_link}'")
        # Frozen: the lookup tables are set once here (keys are _key() forms of names and aliases).
        object.__setattr__(self, "_lookup", {"gpu": gpu_index, "link": link_index, "instance": instance_index})

    def gpu(self, name: str) -> GPU:
        """The GPU called `name` (or an alias); "local" is this machine's device."""
        key = _key(name)
        if key == LOCAL:
            return local_gpu()
        if key in self._lookup["gpu"]:
            return self._lookup["gpu"][key]
        raise _suggest("GPU", name, self.gpus, "pyplan hardware list --kind gpus")

    def link(self, name: str) -> Link:
        """The link called `name` (or an alias); "local" is the link between processes on this machine."""
        key = _key(name)
        if key == LOCAL:
            return local_link()
        if key in self._lookup["link"]:
            return self._lookup["link"][key]
        raise _suggest("link", name, self.links, "pyplan hardware list --kind links")

    def instance(self, name: str) -> Instance:
        key = _key(name)
        if key in self._lookup["instance"]:
            return self._lookup["instance"][key]
        raise _suggest("instance", name, self.instances, "pyplan hardware list --kind instances")

    def lookup(self, name: str) -> list[GPU | Link | Instance]:
        """Every entry called `name`, of any kind ("local" is both a GPU and a link); raises with the closest
        names over all kinds when there is none."""
        key = _key(name)
        if key == LOCAL:
            return [local_gpu(), local_link()]
        found = [self._lookup[kind][key] for kind in ("gpu", "link", "instance") if key in self._lookup[kind]]
        if not found:
            raise _suggest("hardware name", name, (*self.gpus, *self.links, *self.instances), "pyplan hardware list")
        return found

    def list_instances(self, provider: str | None = None, gpu: str | None = None) -> list[Instance]:
        """Instances, optionally of one provider and/or one GPU type, in catalog order."""
        result = list(self.instances)
        if provider is not None:
            providers = sorted({i.provider for i in self.instances})
            if provider.lower() not in providers:
                raise PlanError(f"unknown provider '{provider}'; known: {', '.join(providers)}")
            result = [i for i in result if i.provider == provider.lower()]
        if gpu is not None:
            wanted = self.gpu(gpu).name
            result = [i for i in result if self.gpu(i.gpu).name == wanted]
        return result


def _data_dir() -> Path:
    return Path(str(resources.files("pyplan.hardware") / "data"))


def load_catalog(directory: str | Path | None = None) -> Catalog:
    """Read gpus.toml, links.toml and instances.toml from `directory` (default: the package's data)."""
    if directory is None:
        return _default_catalog()
    return _load(Path(directory))


@functools.cache
def _default_catalog() -> Catalog:
    return _load(_data_dir())


def _load(directory: Path) -> Catalog:
    tables = {name: _read_toml(directory / f"{name}.toml") for name in ("gpus", "links", "instances")}

    def entries(table: str, key: str) -> list[dict[str, Any]]:
        items = tables[table].get(key, [])
        for i, item in enumerate(items):
            if not item.get("source"):
                raise PlanError(f"{table}.toml: [[{key}]] #{i + 1} ({item.get('name', '?')}) has no 'source'")
        return items

    gpus = tuple(_gpu_from_toml(e, f"gpus.toml: gpu '{e.get('name')}'") for e in entries("gpus", "gpu"))
    for gpu in gpus:
        gpu.check_complete("gpus.toml")
    links = tuple(Link.from_json(e, f"links.toml: link '{e.get('name')}'") for e in entries("links", "link"))
    for link in links:
        link.check_complete("links.toml")
    instances = tuple(
        _instance_from_toml(e, f"instances.toml: instance '{e.get('name')}'") for e in entries("instances", "instance")
    )
    return Catalog(gpus, links, instances)


def get_gpu(name: str) -> GPU:
    """The catalog GPU called `name` (case-insensitive, aliases such as "a100-80g", "h100"); "local" is this
    machine's device. An unknown name raises PlanError listing the closest known names."""
    return load_catalog().gpu(name)


def get_link(name: str) -> Link:
    """The catalog link called `name` ("nvlink3", "ib-hdr", "eth-25g", ...); "local" is the calibrated local link."""
    return load_catalog().link(name)


def get_instance(name: str) -> Instance:
    """The catalog cloud instance called `name` ("p4d.24xlarge", "gn6i.xlarge", ...)."""
    return load_catalog().instance(name)


def list_gpus() -> list[GPU]:
    """Catalog GPUs in catalog order (the `local` entry is not listed; ask `local_gpu()`)."""
    return list(load_catalog().gpus)


def list_links() -> list[Link]:
    return list(load_catalog().links)


def list_instances(provider: str | None = None, gpu: str | None = None) -> list[Instance]:
    return load_catalog().list_instances(provider, gpu)


# --- This machine ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """pyplan's cache directory: $PYPLAN_CACHE_DIR, else $XDG_CACHE_HOME/pyplan, else ~/.cache/pyplan."""
    if os.environ.get("PYPLAN_CACHE_DIR"):
        return Path(os.environ["PYPLAN_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "pyplan"
    return Path.home() / ".cache" / "pyplan"


def local_calibration_path() -> Path:
    """Where `pyplan calibrate` writes, and the catalog reads, the local device's measured figures.

    The file is a JSON object; the keys read here are
      "device": the description of the device measured (a file for another device is ignored),
      "gpu":    any GPU fields except name (e.g. "peak_flops_per_s", "hbm_bw_bytes_per_s", "source"),
      "link":   "latency_s", "bw_bytes_per_s", optionally "collective_latency_s", "collective_bw_bytes_per_s"
                and "source" of the link between local processes,
      "efficiency": per-op-class efficiencies, handed out by `local_efficiency` (`analytic.Efficiency` reads them),
      "host":   the runtime's host costs, handed out by `local_host_json`, read by pyplan/profile/host.py.
    Other keys (e.g. "measured", the details of a calibration) are for people and ignored here.
    """
    return cache_dir() / "local.json"


def _read_calibration() -> tuple[dict[str, Any] | None, Path]:
    path = local_calibration_path()
    if not path.is_file():
        return None, path
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"calibration file {path}: cannot be read ({exc}); rerun `pyplan calibrate`") from None
    if not isinstance(data, dict):
        raise PlanError(f"calibration file {path}: must hold a JSON object; rerun `pyplan calibrate`")
    return data, path


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _detect_local() -> GPU:
    """This machine's device as detected, with no performance figures."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return GPU(
            name=LOCAL,
            description=f"{props.name} (cuda:0 of {torch.cuda.device_count()})",
            memory_bytes=int(props.total_memory),
            hbm_bw_bytes_per_s=None,
            device_type="cuda",
            default_intra_link=LOCAL,
            default_inter_link=LOCAL,
            source="this machine: detected with torch.cuda.get_device_properties",
        )
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        memory: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return GPU(
        name=LOCAL,
        description=f"CPU: {_cpu_name()}, {threads} threads",
        memory_bytes=memory,
        hbm_bw_bytes_per_s=None,
        device_type="cpu",
        cpu_threads=threads,
        default_intra_link=LOCAL,
        default_inter_link=LOCAL,
        source="this machine: detected from /proc/cpuinfo and the CPU affinity mask; memory is the host's RAM",
    )


def local_gpu() -> GPU:
    """This machine's device (CPU or the first CUDA GPU), with the figures of its calibration file if present.

    Without a calibration file, peak FLOP/s and bandwidth are unknown (None / empty) and the source says so.
    """
    detected = _detect_local()
    data, path = _read_calibration()
    calib = data.get("gpu") if data is not None else None
    if calib is None:
        note = f"not calibrated: peak FLOP/s and memory bandwidth unknown; run `pyplan calibrate` (writes {path})"
        return replace(detected, source=f"{detected.source}; {note}")
    device = data.get("device") if data is not None else None
    if device is not None and device != detected.description:
        note = f"calibration file {path} is for '{device}', not this device; ignored: run `pyplan calibrate`"
        return replace(detected, source=f"{detected.source}; {note}")
    if not isinstance(calib, dict):
        raise PlanError(f"calibration file {path}: 'gpu' must be an object; rerun `pyplan calibrate`")
    if "name" in calib:
        raise PlanError(f"calibration file {path}: 'gpu' must not set 'name'; rerun `pyplan calibrate`")
    merged = {**detected.to_json(), **calib}
    merged["source"] = f"{detected.source}; calibrated: {path}" + (f" ({calib['source']})" if "source" in calib else "")
    return GPU.from_json(merged, f"calibration file {path}: 'gpu'")


def local_link() -> Link:
    """The link between processes on this machine: measured by `pyplan calibrate`, else unknown (None figures)."""
    data, path = _read_calibration()
    calib = data.get("link") if data is not None else None
    if calib is None:
        return Link(
            name=LOCAL,
            latency_s=None,
            bw_bytes_per_s=None,
            description="between processes on this machine",
            source=f"not calibrated: latency and bandwidth unknown; run `pyplan calibrate` (writes {path})",
        )
    if not isinstance(calib, dict) or "name" in calib:
        raise PlanError(f"calibration file {path}: 'link' must be an object without 'name'; rerun `pyplan calibrate`")
    note = f"calibrated: {path}" + (f" ({calib['source']})" if "source" in calib else "")
    values = {"description": "between processes on this machine", **calib, "name": LOCAL, "source": note}
    return Link.from_json(values, f"calibration file {path}: 'link'")


def local_host_json() -> tuple[dict[str, Any], Path] | None:
    """The "host" object of the calibration file (the runtime's host costs; `pyplan.profile.host.local_host_costs`
    reads it) and the file's path, or None when there is no file, no such object, or the file is for another
    device."""
    data, path = _read_calibration()
    if data is None or data.get("host") is None:
        return None
    if data.get("device") is not None and data["device"] != _detect_local().description:
        return None
    return data["host"], path


def local_efficiency() -> dict[str, Any] | None:
    """The "efficiency" object of the calibration file (per-op-class achieved fractions of the roofline and the
    launch cost of an op; `pyplan.profile.analytic.Efficiency.from_json` reads it), or None when there is no file,
    no such object, or the file is for another device."""
    data, path = _read_calibration()
    if data is None or data.get("efficiency") is None:
        return None
    if data.get("device") is not None and data["device"] != _detect_local().description:
        return None
    if not isinstance(data["efficiency"], dict):
        raise PlanError(f"calibration file {path}: 'efficiency' must be an object; rerun `pyplan calibrate`")
    return data["efficiency"]
