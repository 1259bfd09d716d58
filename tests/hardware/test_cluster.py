"""Clusters from the catalog and from files: shape, links, prices, currencies, validation and JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pyplan.errors import PlanError
from pyplan.hardware import GIB, Cluster, Money, NodeGroup, get_link

# --- From the catalog ---------------------------------------------------------------------------------------


def test_a100_cluster_shape_and_links() -> None:
    cluster = Cluster.from_catalog("a100-80g", 64, gpus_per_node=8)
    assert (cluster.gpus, cluster.nodes, cluster.gpus_per_node) == (64, 8, 8)
    assert cluster.gpu.name == "a100-80g-sxm"
    assert [cluster.node_of(r) for r in (0, 7, 8, 63)] == [0, 0, 1, 7]
    assert cluster.link_between(0, 7).name == "nvlink3"
    assert cluster.link_between(7, 8).name == "ib-hdr"
    assert cluster.tensor_parallel_degrees() == (1, 2, 4, 8)
    with pytest.raises(PlanError, match="outside the cluster's 64 GPUs"):
        cluster.link_between(0, 64)
    with pytest.raises(PlanError, match="same GPU"):
        cluster.link_between(3, 3)


@pytest.mark.parametrize(
    ("gpu", "intra", "inter"),
    [
        ("h100", "nvlink4", "ib-ndr"),
        ("v100-32g", "nvlink2", "eth-100g"),
        ("t4", "pcie3", "eth-25g"),
        ("l4", "pcie4", "eth-25g"),
        ("h100-pcie", "pcie5", "eth-200g"),
        ("a100-40g-pcie", "pcie4", "eth-100g"),
    ],
)
def test_default_links_per_gpu(gpu: str, intra: str, inter: str) -> None:
    group = Cluster.from_catalog(gpu, 16).groups[0]
    assert (group.intra_link.name, group.inter_link.name) == (intra, inter)


def test_sizes_and_explicit_links() -> None:
    assert Cluster.from_catalog("t4").gpus == 1
    small = Cluster.from_catalog("a100-80g", 4, gpus_per_node=8)  # part of one node
    assert (small.nodes, small.gpus_per_node) == (1, 4)
    assert Cluster.from_catalog("a100-80g", gpus_per_node=4, nodes=3).gpus == 12
    custom = Cluster.from_catalog("a100-80g", 16, intra_link="pcie4", inter_link=get_link("eth-100g"))
    assert custom.link_between(0, 1).name == "pcie4" and custom.link_between(0, 8).name == "eth-100g"


def test_local_processes_share_one_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))  # no calibration file
    cluster = Cluster.from_catalog("local", 16)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.name) == (1, 16, "local")
    link = cluster.link_between(0, 15)
    assert link.name == "local" and link.bw_bytes_per_s is None  # unknown until `pyplan calibrate`
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def test_price_per_gpu_second() -> None:
    cluster = Cluster.from_catalog("a100-80g", 16, price_per_gpu_hour=3.6, currency="USD")
    assert cluster.price_per_gpu_second() == Money(pytest.approx(0.001), "USD")
    assert cluster.price_per_second().amount == pytest.approx(0.016)
    per_node = Cluster.from_catalog("a100-80g", 16, price_per_node_hour=28.8, currency="EUR")
    assert per_node.price_per_gpu_second() == Money(pytest.approx(0.001), "EUR")
    with pytest.raises(PlanError, match="have no price"):
        Cluster.from_catalog("a100-80g", 16).price_per_gpu_second()


def test_instance_sets_gpu_node_size_price_and_network() -> None:
    cluster = Cluster.from_catalog(instance="p4d.24xlarge", gpus=16)
    group = cluster.groups[0]
    assert (group.gpu.name, group.nodes, group.gpus_per_node, group.instance) == ("a100-40g-sxm", 2, 8, "p4d.24xlarge")
    assert cluster.price_per_gpu_second() == Money(pytest.approx(32.7726 / 8 / 3600), "USD")
    assert group.inter_link.bw_bytes_per_s == pytest.approx(400e9 / 8 / 8)  # 400 Gb/s shared by 8 GPUs
    azure = Cluster.from_catalog(instance="Standard_ND96amsr_A100_v4", nodes=4)
    assert azure.gpus == 32 and azure.link_between(0, 8).name == "ib-hdr"


def test_fractional_gpu_instance_gives_one_slice_per_node() -> None:
    cluster = Cluster.from_catalog(instance="sgn7i.xlarge", gpus=4)
    gpu = cluster.gpu
    assert (cluster.nodes, cluster.gpus_per_node) == (4, 1)
    assert gpu.memory_bytes == 2 * GIB
    assert gpu.peak_flops("bf16") == pytest.approx(125e12 / 12)
    assert cluster.price_per_gpu_second() == Money(pytest.approx(1.875 / 3600), "CNY")
    assert cluster.link_between(0, 1).bw_bytes_per_s == pytest.approx(5e9 / 8)  # Table III: 5 Gb/s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": "t4", "gpus": 0}, "cluster: 'gpus' must be a positive integer, got 0"),
        ({"gpu": "t4", "gpus_per_node": True}, "cluster: 'gpus_per_node' must be a positive integer, got True"),
        (
            {"gpu": "t4", "gpus": 12, "gpus_per_node": 8},
            "cluster: 'gpus' (12) must be a multiple of 'gpus_per_node' (8)",
        ),
        ({"gpu": "t4", "gpus": 8, "nodes": 3}, "cluster: 'gpus' (8) must be a multiple of 'nodes' (3)"),
        ({"gpu": "t4", "nodes": 2}, "cluster: 'gpus_per_node' is required with 'nodes'"),
        ({"gpu": "t4", "price_per_gpu_hour": 1.0}, "cluster: 'currency' is required with a price"),
        ({"gpu": "t4", "currency": "USD"}, "cluster: 'currency' 'USD' is given without a price"),
        ({"gpu": "t4", "price_per_gpu_hour": 1.0, "currency": "RMB"}, "RMB is 'CNY'"),
        ({"gpu": "t4", "price_per_gpu_hour": -1.0, "currency": "USD"}, "'price_per_gpu_hour' must be a finite"),
        (
            {"gpu": "t4", "price_per_gpu_hour": 1.0, "price_per_node_hour": 8.0, "currency": "USD"},
            "give 'price_per_gpu_hour' or 'price_per_node_hour', not both",
        ),
        ({"gpu": "t4", "instance": "p4d.24xlarge"}, "cluster: 'gpu' is t4 but instance p4d.24xlarge has a100-40g-sxm"),
        ({"instance": "p4d.24xlarge", "gpus": 4}, "must be a multiple of instance p4d.24xlarge's GPUs (8)"),
        ({"instance": "p4d.24xlarge", "gpus_per_node": 4}, "'gpus_per_node' is 4 but instance p4d.24xlarge has 8"),
        ({"instance": "gn6i.xlarge", "currency": "USD"}, "'currency' is USD but instance gn6i.xlarge is priced in CNY"),
        ({"gpus": 8}, "cluster: give 'gpu' (a catalog GPU name) or 'instance'"),
        ({"gpu": "a100-80"}, "unknown GPU 'a100-80'; closest: a100-80g-sxm"),
        ({"gpu": "t4", "inter_link": "ib"}, "unknown link 'ib'; closest: ib-hdr, ib-ndr"),
    ],
)
def test_from_catalog_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError) as exc:
        Cluster.from_catalog(**kwargs)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


# --- Mixed clusters and currencies --------------------------------------------------------------------------


def _mixed() -> Cluster:
    cny = Cluster.from_catalog(instance="gn6i.xlarge", gpus=2).groups[0]
    usd = Cluster.from_catalog("a100-80g", 8, price_per_gpu_hour=4.0, currency="USD").groups[0]
    return Cluster((cny, usd))


def test_mixed_cluster_answers_per_rank() -> None:
    cluster = _mixed()
    assert cluster.gpus == 10 and cluster.nodes == 3
    assert [cluster.gpu_of(r).name for r in (0, 1, 2, 9)] == ["t4", "t4", "a100-80g-sxm", "a100-80g-sxm"]
    assert cluster.link_between(2, 9).name == "nvlink3"
    assert cluster.link_between(0, 2).name == "gn6i.xlarge-network"  # the slower side: 4 Gb/s
    assert cluster.tensor_parallel_degrees() == (1,)
    with pytest.raises(PlanError, match="mixes GPU types"):
        _ = cluster.gpu
    with pytest.raises(PlanError, match="differ in size"):
        _ = cluster.gpus_per_node


def test_mixed_currencies_need_exchange_rates() -> None:
    cluster = _mixed()
    with pytest.raises(PlanError, match="differ in price"):
        cluster.price_per_gpu_second()
    assert cluster.price_per_gpu_second(group=0) == Money(pytest.approx(11.67 / 3600), "CNY")
    with pytest.raises(PlanError, match="cannot add prices in CNY and USD"):
        cluster.price_per_second()
    with pytest.raises(PlanError, match="without exchange rates"):
        cluster.price_per_second(currency="USD")
    cost = cluster.price_per_second(currency="USD", rates={"USD": 1.0, "CNY": 0.14})
    assert cost.currency == "USD"
    assert cost.amount == pytest.approx((2 * 11.67 * 0.14 + 8 * 4.0) / 3600)


def test_node_group_checks_price_and_currency_together() -> None:
    group = Cluster.from_catalog("t4").groups[0]
    with pytest.raises(PlanError, match="a price needs its currency"):
        NodeGroup(**{**group.__dict__, "price_per_gpu_hour": 1.0})


# --- JSON ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cluster",
    [
        Cluster.from_catalog("h100", 16, price_per_gpu_hour=2.5, currency="USD"),
        Cluster.from_catalog(instance="vgn7i-vws.2xlarge", gpus=3),
        Cluster.from_catalog(instance="p5.48xlarge", nodes=2),
    ],
    ids=["h100", "fractional", "instance"],
)
def test_cluster_json_round_trip(cluster: Cluster) -> None:
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def test_mixed_cluster_json_round_trip() -> None:
    cluster = _mixed()
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


# --- From files ---------------------------------------------------------------------------------------------

TOML_FILE = """\
gpu = "a100-80g"
nodes = 4
gpus_per_node = 8
intra_link = "nvlink3"
inter_link = { latency_s = 5e-6, bw_bytes_per_s = 12.5e9 }
price_per_node_hour = 32.0
currency = "USD"
"""

JSON_FILE = {
    "gpu": "a100-80g",
    "nodes": 4,
    "gpus_per_node": 8,
    "intra_link": "nvlink3",
    "inter_link": {"latency_s": 5e-6, "bw_bytes_per_s": 12.5e9},
    "price_per_node_hour": 32.0,
    "currency": "USD",
}


def _write(tmp_path: Path, name: str, content: Any) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_json_and_toml_files_describe_the_same_cluster(tmp_path: Path) -> None:
    from_toml = Cluster.from_file(_write(tmp_path, "c.toml", TOML_FILE))
    from_json = Cluster.from_file(_write(tmp_path, "c.json", JSON_FILE))
    assert from_toml.gpus == from_json.gpus == 32
    assert from_toml.groups[0].intra_link == from_json.groups[0].intra_link == get_link("nvlink3")
    assert from_toml.link_between(0, 8).bw_bytes_per_s == from_json.link_between(0, 8).bw_bytes_per_s == 12.5e9
    assert from_toml.price_per_gpu_second() == from_json.price_per_gpu_second() == Money(4.0 / 3600, "USD")


def test_file_with_inline_gpu_instance_and_groups(tmp_path: Path) -> None:
    inline = {
        "gpu": {
            "name": "my-gpu",
            "memory_bytes": 8 * GIB,
            "hbm_bw_bytes_per_s": 4e11,
            "peak_flops_per_s": {"fp32": 1e13},
        },
        "gpus": 2,
    }
    cluster = Cluster.from_file(_write(tmp_path, "inline.json", inline))
    assert cluster.gpu.name == "my-gpu" and "inline.json" in cluster.gpu.source
    assert cluster.groups[0].intra_link.name == "pcie4"  # fallback for a GPU without default links

    instance = Cluster.from_file(_write(tmp_path, "inst.toml", 'instance = "gn7e.4xlarge"\nnodes = 3\n'))
    assert instance.gpus == 3 and instance.price_per_gpu_second() == Money(34.742 / 3600, "CNY")

    groups = {
        "inter_link": "ib-hdr",
        "groups": [{"gpu": "a100-80g", "nodes": 1, "gpus_per_node": 8}, {"gpu": "v100-16g", "gpus": 4}],
    }
    mixed = Cluster.from_file(_write(tmp_path, "groups.json", groups))
    assert [g.gpu.name for g in mixed.groups] == ["a100-80g-sxm", "v100-16g"]
    assert all(g.inter_link.name == "ib-hdr" for g in mixed.groups)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpus_per_node": 0}, "'gpus_per_node' must be a positive integer, got 0"),
        ({"nodes": "4"}, "'nodes' must be a positive integer, got '4'"),
        ({"gpus_per_nodes": 8}, "unknown key 'gpus_per_nodes'; did you mean 'gpus_per_node'?"),
        ({"currency": None}, "'currency' is required with a price"),
        ({"currency": 840}, "'currency' must be a string, got 840"),
        ({"price_per_gpu_hour": 4.0}, "give 'price_per_gpu_hour' or 'price_per_node_hour', not both"),
        ({"price_per_node_hour": "32"}, "'price_per_node_hour' must be a finite non-negative number, got '32'"),
        ({"gpu": "a100-80"}, "unknown GPU 'a100-80'; closest: a100-80g-sxm"),
        ({"gpu": 80}, "'gpu' must be a catalog name or a table of GPU fields, got 80"),
        ({"gpu": {"name": "g", "memory_bytes": GIB}}, "'gpu': GPU 'g' lacks 'hbm_bw_bytes_per_s', 'peak_flops_per_s'"),
        ({"inter_link": {"latency_s": 1e-6}}, "'inter_link': 'bw_bytes_per_s' is required"),
        ({"inter_link": {"latency_s": 1e-6, "bw_bytes_per_s": 0}}, "'bw_bytes_per_s' must be positive, got 0"),
        ({"intra_link": 5}, "'intra_link' must be a catalog link name or a table"),
        ({"groups": []}, "'groups' must be a non-empty list of tables"),
        ({"groups": [{"gpu": "t4", "nodez": 1}]}, "groups[0]: unknown key 'nodez'; did you mean 'nodes'?"),
        # A file without its size is refused, never planned as one GPU.
        ({"nodes": None}, "no size; add 'gpus' (all its GPUs) or 'nodes' (with 'gpus_per_node' or an 'instance')"),
        ({"gpu": None, "nodes": None, "gpus_per_node": None, "instance": "p4d.24xlarge"}, "no size; add 'gpus'"),
        ({"nodes": None, "groups": [{"gpu": "t4", "gpus": 2}, {"gpu": "a100-80g"}]}, "groups[1]: no size; add"),
    ],
)
def test_file_validation_errors_name_the_file_and_field(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    data = {k: v for k, v in {**JSON_FILE, **change}.items() if v is not None}
    path = _write(tmp_path, "x.json", data)
    with pytest.raises(PlanError) as exc:
        Cluster.from_file(path)
    assert str(exc.value).startswith(f"cluster file {path}: ") or "unknown GPU" in str(exc.value)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_the_brief_example_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "x.json", {**JSON_FILE, "gpus_per_node": 0})
    with pytest.raises(PlanError) as exc:
        Cluster.from_file("x.json")
    assert str(exc.value) == "cluster file x.json: 'gpus_per_node' must be a positive integer, got 0"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.json", "{", "not valid JSON"),
        ("bad.toml", "gpu = ", "not valid TOML"),
        ("list.json", "[1, 2]", "must hold a table/object of keys, got list"),
        ("c.yaml.txt", "gpu: t4", "the name must end in .json, .toml, .yaml or .yml"),
    ],
)
def test_unreadable_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Cluster.from_file(_write(tmp_path, name, content))
    with pytest.raises(PlanError, match="cannot be read"):
        Cluster.from_file(tmp_path / "missing.json")


def test_yaml_needs_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "c.yaml", "gpu: t4\ngpus: 2\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    with pytest.raises(PlanError, match=r"reading YAML needs PyYAML \(pip install pyyaml\); or write the file as"):
        Cluster.from_file(path)


def test_yaml_when_pyyaml_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    assert Cluster.from_file(_write(tmp_path, "c.yml", "gpu: t4\ngpus: 2\n")).gpus == 2


def test_an_infinite_price_is_refused() -> None:
    with pytest.raises(PlanError, match="'price_per_gpu_hour' must be a finite non-negative number, got inf"):
        Cluster.from_catalog("a100-80g", 2, price_per_gpu_hour=float("inf"), currency="USD")
