"""The profile cache: a hit skips profiling and gives the same chain; a bad entry is deleted and rebuilt."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pyplan import Cluster, Workload, zoo
from pyplan.api import chain_for
from pyplan.graph.chain import Chain
from pyplan.profile import capture
from pyplan.profile.cache import ProfileCache, _canonical, _sha256, default_profile_dir, model_digest

A100 = Cluster.from_catalog("a100-80g", 8)
WORKLOAD = Workload(global_batch=16)


def meta_model(name: str) -> tuple[nn.Module, Any]:
    spec = zoo.get(name)
    with torch.device("meta"):
        return spec.build(), spec.example_inputs


# The smallest zoo model keeps these tests fast; its five blocks are enough to corrupt.
MODEL = "mlp-tiny"


@pytest.fixture(scope="module")
def fresh() -> Chain:
    """The model profiled for an A100 without a cache."""
    model, inputs = meta_model(MODEL)
    return chain_for(model, inputs, A100, WORKLOAD)[0]


def profiled(cache: ProfileCache, cluster: Cluster = A100, workload: Workload = WORKLOAD) -> tuple[Chain, str]:
    model, inputs = meta_model(MODEL)
    return chain_for(model, inputs, cluster, workload, cache=cache)


def no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiling, and recording the traced graph's shapes, fail from here on: a hit needs neither."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("profiled although the cache holds the profile")

    for name in ("trace", "profile", "analytic_blocks"):
        monkeypatch.setattr(capture, name, refuse)


def test_a_hit_gives_the_same_chain_without_profiling(
    tmp_path: Path, fresh: Chain, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ProfileCache(tmp_path)
    first, how = profiled(cache)
    assert first == fresh and how == "analytic roofline of a100-80g-sxm"
    assert (cache.stats.misses, cache.stats.stored, cache.stats.hits) == (1, 1, 0)
    (entry,) = tmp_path.iterdir()
    assert entry.name.startswith("Sequential-") and entry.suffix == ".json"

    no_profiling(monkeypatch)
    # Another cluster of the same GPU needs the same profile.
    again, how_again = profiled(cache, Cluster.from_catalog("a100-80g", 64))
    assert again == fresh and how_again == how
    assert all(b.fwd_time_s is not None and b.saved_bytes is not None for b in again.blocks)
    assert cache.stats.hits == 1
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no temporary files left behind


def test_the_key_holds_the_target_the_precision_and_the_model(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    profiled(cache)
    profiled(cache, Cluster.from_catalog("h100", 8))
    profiled(cache, workload=Workload(global_batch=16, precision="bf16-mixed"))
    assert cache.stats.misses == 3 and len(list(tmp_path.iterdir())) == 3

    model, _ = meta_model("gpt-tiny")
    digest = model_digest(model)
    weights = zoo.get("gpt-tiny").build()
    with torch.no_grad():
        next(weights.parameters()).add_(1.0)
    assert model_digest(weights) == digest  # values are not part of a profile
    wider, _ = meta_model("mlp-tiny")
    narrower, _ = meta_model("mlp-tiny")
    narrower[0] = nn.Linear(narrower[0].in_features, narrower[0].out_features, bias=False, device="meta")
    assert model_digest(wider) != model_digest(narrower)


def _payload_edit(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], str]:
    """Change the payload and re-sign it, so only the structural checks can catch the change."""

    def apply(entry: dict[str, Any]) -> str:
        edit(entry["payload"])
        entry["sha256"] = _sha256(_canonical(entry["payload"]))
        return json.dumps(entry)

    return apply


def _set(entry: dict[str, Any], path: tuple[Any, ...], value: Any) -> str:
    target = entry
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return json.dumps(entry)


CORRUPTIONS: dict[str, Callable[[dict[str, Any], str], str]] = {
    "truncated": lambda entry, text: text[: len(text) // 2],
    "not json": lambda entry, text: "{oops",
    "empty": lambda entry, text: "",
    "wrong checksum": lambda entry, text: _set(entry, ("payload", "blocks", 3, "fields", "fwd_time_s", 0), 1.0),
    "another key": lambda entry, text: _set(entry, ("key", "trace_batch"), 2),
    "another format": lambda entry, text: _set(entry, ("format",), 0),
    "other nodes": lambda entry, text: _payload_edit(lambda p: p["blocks"][2]["nodes"].append("extra"))(entry),
    "other fx graph": lambda entry, text: _payload_edit(lambda p: p["fx"][3].__setitem__(2, "torch.relu"))(entry),
    "other shapes": lambda entry, text: _payload_edit(lambda p: p["graph"]["nodes"][1][5][0].__setitem__(2, 1.0))(
        entry
    ),
    "bad graph node": lambda entry, text: _payload_edit(lambda p: p["graph"]["nodes"][2].pop())(entry),
    "fewer blocks": lambda entry, text: _payload_edit(lambda p: p["blocks"].pop())(entry),
    "other cuts": lambda entry, text: _payload_edit(lambda p: p["cuts"][1].__setitem__(1, 1.0))(entry),
    "unknown field": lambda entry, text: _payload_edit(lambda p: p["blocks"][0]["fields"].update(speed=[1, 2]))(entry),
    "not a number": lambda entry, text: _payload_edit(lambda p: p["blocks"][0]["fields"].update(fwd_time_s=["x", 0.0]))(
        entry
    ),
    "wrong type": lambda entry, text: _payload_edit(lambda p: p["blocks"][1]["fields"].update(saved_bytes="many"))(
        entry
    ),
    "wrong dataclass": lambda entry, text: _payload_edit(
        lambda p: p["blocks"][1]["fields"].update(saved_bytes={"type": "pyplan.api:nn.Module", "fields": {}})
    )(entry),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_entry_is_deleted_and_rebuilt(tmp_path: Path, fresh: Chain, corruption: str) -> None:
    profiled(ProfileCache(tmp_path))
    (path,) = tmp_path.iterdir()
    text = path.read_text()
    path.write_text(CORRUPTIONS[corruption](json.loads(text), text))

    cache = ProfileCache(tmp_path)
    chain, _ = profiled(cache)
    assert chain == fresh
    assert (cache.stats.discarded, cache.stats.stored, cache.stats.hits) == (1, 1, 0), cache.stats.reasons
    assert path.read_text() == text  # rebuilt as it was

    again = ProfileCache(tmp_path)
    profiled(again)
    assert again.stats.hits == 1


def test_a_measured_profile_is_cached_for_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))  # no calibration file: the default local entry
    spec = zoo.get("mlp-tiny")
    local = Cluster.from_catalog("local", 2)
    cache = ProfileCache()
    assert cache.directory == default_profile_dir() == tmp_path / "profiles"
    first, how = chain_for(spec.build(), spec.example_inputs, local, WORKLOAD, cache=cache)
    assert how == "measured on this machine"
    no_profiling(monkeypatch)
    again, _ = chain_for(spec.build(), spec.example_inputs, local, WORKLOAD, cache=cache)
    assert again == first and cache.stats.hits == 1
    entry = json.loads(next((tmp_path / "profiles").iterdir()).read_text())
    assert entry["key"]["target"]["mode"] == "measured" and entry["key"]["target"]["timing"]["threads"] == 1


def test_an_unwritable_cache_only_costs_time(tmp_path: Path, fresh: Chain) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = ProfileCache(blocker / "profiles")
    chain, _ = profiled(cache)
    assert chain == fresh and cache.stats.stored == 0 and "not stored" in cache.stats.reasons[0]
