"""The hardware catalog: required entries and figures, Table III of the GA paper, lookups, currencies, local."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pyplan.errors import PlanError
from pyplan.hardware import (
    DTYPES,
    GIB,
    GPU,
    Instance,
    Link,
    Money,
    cache_dir,
    convert,
    get_gpu,
    get_instance,
    get_link,
    list_gpus,
    list_instances,
    list_links,
    load_catalog,
    local_calibration_path,
    local_gpu,
    local_link,
    total,
)

REQUIRED_GPUS = [
    "h100-sxm",
    "h100-pcie",
    "h200",
    "a100-40g-sxm",
    "a100-80g-sxm",
    "a100-40g-pcie",
    "a100-80g-pcie",
    "v100-16g",
    "v100-32g",
    "t4",
    "a10",
    "l4",
    "l40s",
    "rtx-4090",
    "mi300x",
]

REQUIRED_LINKS = {
    # name: bandwidth per GPU and direction, bytes/s
    "nvlink2": 150e9,
    "nvlink3": 300e9,
    "nvlink4": 450e9,
    "pcie3": 15.75e9,
    "pcie4": 31.5e9,
    "pcie5": 63.0e9,
    "ib-hdr": 25e9,
    "ib-ndr": 50e9,
    "eth-10g": 1.25e9,
    "eth-25g": 3.125e9,
    "eth-100g": 12.5e9,
    "eth-200g": 25e9,
    "eth-400g": 50e9,
}

# Huang et al., Table III: instance, GPU, GPUs (fractions: shared GPUs), GPU memory (GB), price (RMB/hour).
TABLE_III = [
    ("gn6i.xlarge", "t4", 1, 16, 11.67),
    ("gn6i.2xlarge", "t4", 1, 16, 14.04),
    ("gn7i.2xlarge", "a10", 1, 24, 12.75),
    ("gn7i.4xlarge", "a10", 1, 24, 13.50),
    ("vgn7i-vws.xlarge", "a10", 1 / 6, 4, 3.117),
    ("vgn7i-vws.2xlarge", "a10", 1 / 3, 8, 5.609),
    ("vgn7i-vws.3xlarge", "a10", 1 / 2, 12, 8.102),
    ("sgn7i.xlarge", "a10", 1 / 12, 2, 1.875),
    ("sgn7i.2xlarge", "a10", 1 / 6, 4, 3.124),
    ("sgn7i.4xlarge", "a10", 1 / 3, 8, 5.621),
    ("gn6v.2xlarge", "v100-16g", 1, 16, 26.46),
    ("gn7e.4xlarge", "a100-80g-sxm", 1, 80, 34.742),
]

CLOUD_INSTANCES = {
    "aws": [
        "p4d.24xlarge",
        "p4de.24xlarge",
        "p5.48xlarge",
        "g5.xlarge",
        "g5.48xlarge",
        "g6.xlarge",
        "p3.2xlarge",
        "p3.8xlarge",
        "p3.16xlarge",
        "g4dn.xlarge",
    ],
    "gcp": ["a2-highgpu-1g", "a2-highgpu-8g", "a2-ultragpu-8g", "a3-highgpu-8g", "g2-standard-4"],
    "azure": [
        "Standard_ND96asr_v4",
        "Standard_ND96amsr_A100_v4",
        "Standard_ND96isr_H100_v5",
        "Standard_NC24ads_A100_v4",
    ],
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty pyplan cache directory, so no real calibration file is read."""
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path))
    return tmp_path


# --- GPUs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REQUIRED_GPUS)
def test_required_gpu_has_positive_figures_and_a_source(name: str) -> None:
    gpu = get_gpu(name)
    assert gpu.name == name
    assert gpu.memory_bytes is not None and gpu.memory_bytes > 0
    assert gpu.hbm_bw_bytes_per_s is not None and gpu.hbm_bw_bytes_per_s > 0
    assert "fp32" in gpu.peak_flops_per_s and ("bf16" in gpu.peak_flops_per_s or "fp16" in gpu.peak_flops_per_s)
    assert set(gpu.peak_flops_per_s) <= set(DTYPES)
    assert all(v > 0 for v in gpu.peak_flops_per_s.values())
    assert gpu.source.strip()
    assert get_link(gpu.default_intra_link or "").bw_bytes_per_s
    assert get_link(gpu.default_inter_link or "").bw_bytes_per_s


def test_anchor_figures_and_the_gib_convention() -> None:
    a100 = get_gpu("a100-80g")
    assert a100.name == "a100-80g-sxm"
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("tf32") == 156e12  # dense, not the 312 "with sparsity"
    assert a100.memory_bytes == 80 * GIB == 85_899_345_920  # marketed "80 GB" is 80 GiB
    h100 = get_gpu("h100")
    assert h100.name == "h100-sxm"
    assert h100.peak_flops("bf16") == pytest.approx(989e12, rel=2e-3)
    assert h100.memory_bytes == 80 * GIB
    assert get_gpu("a100-40g-sxm").memory_bytes == 40 * GIB
    assert get_gpu("mi300x").memory_bytes == 192 * GIB


def test_bf16_faster_than_fp32_where_both_exist() -> None:
    for gpu in list_gpus():
        if "bf16" in gpu.peak_flops_per_s:
            assert gpu.peak_flops_per_s["bf16"] > gpu.peak_flops_per_s["fp32"], gpu.name


@pytest.mark.parametrize(
    "alias", ["A100-80GB-SXM", "a100-80gb-sxm", "NVIDIA A100 80GB SXM", "a100_80g_sxm", " a100-sxm4-80g "]
)
def test_lookup_is_case_insensitive_with_aliases(alias: str) -> None:
    assert get_gpu(alias).name == "a100-80g-sxm"


def test_missing_dtype_names_the_ones_present() -> None:
    with pytest.raises(PlanError, match=r"GPU 't4' has no bf16 peak in the catalog; it has fp32, fp16, int8"):
        get_gpu("t4").peak_flops("bf16")


# --- Links --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "bw"), REQUIRED_LINKS.items())
def test_required_link(name: str, bw: float) -> None:
    link = get_link(name)
    assert link.bw_bytes_per_s == pytest.approx(bw, rel=1e-3)
    assert link.latency_s is not None and 0 < link.latency_s < 1e-3
    assert link.source.strip()
    assert link.time_s(1e9) == pytest.approx(link.latency_s + 1e9 / link.bw_bytes_per_s)


def test_link_aliases() -> None:
    assert get_link("InfiniBand HDR").name == "ib-hdr"
    assert get_link("100GbE").name == "eth-100g"
    assert get_link("PCIe-Gen4").name == "pcie4"


# --- Instances ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "gpu", "gpus", "memory_gb", "price"), TABLE_III)
def test_table_iii_instance(name: str, gpu: str, gpus: float, memory_gb: int, price: float) -> None:
    inst = get_instance(name)
    assert (inst.name, inst.provider, inst.gpu) == (name, "alicloud", gpu)
    assert inst.gpus == pytest.approx(gpus)
    assert inst.price_per_hour == price
    assert inst.currency == "CNY"
    assert inst.source.startswith("Huang et al., Table III")
    memory = inst.gpu_memory_bytes if inst.gpus < 1 else get_gpu(inst.gpu).memory_bytes
    assert memory == memory_gb * GIB


def test_table_iii_is_all_of_alicloud() -> None:
    assert [i.name for i in list_instances(provider="alicloud")] == [row[0] for row in TABLE_III]


@pytest.mark.parametrize(("provider", "name"), [(p, n) for p, names in CLOUD_INSTANCES.items() for n in names])
def test_cloud_instance_priced_in_usd_with_region(provider: str, name: str) -> None:
    inst = get_instance(name)
    assert inst.provider == provider
    assert inst.currency == "USD" and inst.price_per_hour > 0
    assert inst.region and inst.source.strip()
    assert get_gpu(inst.gpu).name == inst.gpu


def test_every_instance_names_a_catalog_gpu() -> None:
    for inst in list_instances():
        assert get_gpu(inst.gpu).name == inst.gpu
        assert inst.source.strip()
    assert {i.name for i in list_instances(gpu="h100")} >= {"p5.48xlarge", "a3-highgpu-8g"}


def test_instance_price_per_gpu_hour() -> None:
    assert get_instance("p4d.24xlarge").price_per_gpu_hour() == Money(32.7726 / 8, "USD")
    assert get_instance("sgn7i.xlarge").price_per_gpu_hour().amount == pytest.approx(1.875 * 12)


# --- Unknown names ------------------------------------------------------------------------------------------


def test_unknown_gpu_lists_the_closest_names() -> None:
    with pytest.raises(PlanError) as exc:
        get_gpu("a100-80")
    assert str(exc.value) == (
        "unknown GPU 'a100-80'; closest: a100-80g-sxm, a100-80g-pcie, a100-40g-sxm (pyplan hardware list --kind gpus)"
    )
    with pytest.raises(PlanError, match=r"closest: a100-40g-sxm, a100-80g-sxm, a100-40g-pcie"):
        get_gpu("a100")


def test_unknown_link_and_instance_and_provider() -> None:
    with pytest.raises(PlanError, match=r"^unknown link 'nvlink5'; closest: nvlink"):
        get_link("nvlink5")
    with pytest.raises(PlanError, match=r"^unknown instance 'p4d'; closest: p4d.24xlarge, p4de.24xlarge"):
        get_instance("p4d")
    with pytest.raises(PlanError, match=r"unknown provider 'oracle'; known: alicloud, aws, azure, gcp"):
        list_instances(provider="oracle")
    with pytest.raises(PlanError, match=r"^unknown hardware name 'gn7'; closest: "):
        load_catalog().lookup("gn7")


# --- Currencies ---------------------------------------------------------------------------------------------


def test_money_never_mixes_currencies_silently() -> None:
    usd, cny = Money(1.0, "USD"), Money(7.0, "CNY")
    assert usd + Money(2.0, "USD") == Money(3.0, "USD")
    assert usd < Money(2.0, "USD")
    with pytest.raises(PlanError, match="different currencies"):
        usd + cny
    with pytest.raises(PlanError, match="different currencies"):
        usd < cny  # noqa: B015
    with pytest.raises(PlanError, match="without a target currency and exchange rates"):
        total([usd, cny])
    with pytest.raises(PlanError, match="without exchange rates"):
        convert(cny, "USD", None)
    with pytest.raises(PlanError, match="no positive value for CNY"):
        convert(cny, "USD", {"USD": 1.0})
    rates = {"USD": 1.0, "CNY": 1 / 7}
    assert convert(cny, "USD", rates).amount == pytest.approx(1.0)
    assert total([usd, cny], currency="USD", rates=rates).amount == pytest.approx(2.0)
    assert total([cny, cny]) == Money(14.0, "CNY")


def test_currency_must_be_an_iso_code() -> None:
    with pytest.raises(PlanError, match="RMB is 'CNY'"):
        Money(1.0, "RMB")
    with pytest.raises(PlanError, match="write it in capitals, 'USD'"):
        Money(1.0, "usd")
    for made_up in ("XYZ", "ABC", "XXX", "XAU"):  # three capitals, but no money anyone is paid in
        with pytest.raises(PlanError, match="ISO 4217 currency code"):
            Money(1.0, made_up)
    assert Money(1.0, "EUR").currency == "EUR" and Money(1.0, "INR").currency == "INR"


# --- JSON ---------------------------------------------------------------------------------------------------


def test_json_round_trip_of_every_entry() -> None:
    for gpu in list_gpus():
        assert GPU.from_json(json.loads(json.dumps(gpu.to_json()))) == gpu
    for link in list_links():
        assert Link.from_json(json.loads(json.dumps(link.to_json()))) == link
    for inst in list_instances():
        assert Instance.from_json(json.loads(json.dumps(inst.to_json()))) == inst


def test_from_json_rejects_unknown_keys_and_bad_values() -> None:
    data = get_gpu("t4").to_json()
    with pytest.raises(PlanError, match=r"unknown key 'memory'; did you mean 'memory_bytes'\?"):
        GPU.from_json({**data, "memory": 1})
    with pytest.raises(PlanError, match=r"unknown dtype 'fp4'"):
        GPU.from_json({**data, "peak_flops_per_s": {"fp4": 1e12}})
    with pytest.raises(PlanError, match=r"'memory_bytes' must be a positive integer, got -1"):
        GPU.from_json({**data, "memory_bytes": -1})
    with pytest.raises(PlanError, match=r"'bw_bytes_per_s' is required"):
        Link.from_json({"name": "x", "latency_s": 1e-6})


def test_gpu_slice_scales_compute_and_takes_the_stated_memory() -> None:
    a10 = get_gpu("a10")
    part = a10.slice(1 / 6, name="a10 1/6", memory_bytes=4 * GIB)
    assert part.memory_bytes == 4 * GIB
    assert part.peak_flops("bf16") == pytest.approx(125e12 / 6)
    assert part.hbm_bw_bytes_per_s == pytest.approx(600e9 / 6)


# --- Catalog files ------------------------------------------------------------------------------------------


def _catalog_copy(tmp_path: Path) -> Path:
    src = Path(__file__).resolve().parents[2] / "pyplan" / "hardware" / "data"
    for name in ("gpus.toml", "links.toml", "instances.toml"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


def test_catalog_files_are_checked(tmp_path: Path) -> None:
    data = _catalog_copy(tmp_path)
    assert len(load_catalog(data).gpus) == len(list_gpus())
    gpus = (data / "gpus.toml").read_text()
    (data / "gpus.toml").write_text(gpus.replace('default_inter_link = "ib-ndr"', 'default_inter_link = "ib-xdr"', 1))
    with pytest.raises(PlanError, match=r"GPU 'h100-sxm': 'default_inter_link' names unknown link 'ib-xdr'"):
        load_catalog(data)
    (data / "gpus.toml").write_text(gpus.replace('aliases = ["a10-24g"]', 'aliases = ["t4"]'))
    with pytest.raises(PlanError, match=r"GPU name 't4' is used by both 't4' and 'a10'"):
        load_catalog(data)
    (data / "gpus.toml").write_text(gpus + '\n[[gpu]]\nname = "x"\nmemory_gib = 1\n')
    with pytest.raises(PlanError, match=r"gpus.toml: \[\[gpu\]\] #17 \(x\) has no 'source'"):
        load_catalog(data)


# --- This machine -------------------------------------------------------------------------------------------


def test_cache_dir_respects_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYPLAN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pyplan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "pyplan"
    monkeypatch.setenv("PYPLAN_CACHE_DIR", str(tmp_path / "mine"))
    assert local_calibration_path() == tmp_path / "mine" / "local.json"


def test_local_without_calibration_has_unknown_figures(cache: Path) -> None:
    gpu = get_gpu("local")
    assert gpu.name == "local" and not gpu.calibrated
    assert gpu.hbm_bw_bytes_per_s is None and gpu.peak_flops_per_s == {}
    assert gpu.device_type in ("cpu", "cuda") and gpu.description
    if gpu.device_type == "cpu":
        assert gpu.cpu_threads is not None and gpu.cpu_threads >= 1
    assert "not calibrated" in gpu.source and str(cache / "local.json") in gpu.source
    with pytest.raises(PlanError, match="run `pyplan calibrate`"):
        gpu.peak_flops("fp32")
    link = get_link("local")
    assert link.latency_s is None and link.bw_bytes_per_s is None
    with pytest.raises(PlanError, match="run `pyplan calibrate`"):
        link.time_s(1.0)


def test_local_reads_its_calibration_file(cache: Path) -> None:
    device = local_gpu().description
    calibration = {
        "device": device,
        "gpu": {"peak_flops_per_s": {"fp32": 1e11}, "hbm_bw_bytes_per_s": 2e10, "source": "test"},
        "link": {"latency_s": 1e-5, "bw_bytes_per_s": 1e9},
        "efficiency": {"matmul": 0.7},
    }
    (cache / "local.json").write_text(json.dumps(calibration))
    gpu = local_gpu()
    assert gpu.calibrated and gpu.peak_flops("fp32") == 1e11 and gpu.hbm_bw_bytes_per_s == 2e10
    assert "calibrated" in gpu.source
    assert local_link().time_s(1e9) == pytest.approx(1.00001)

    (cache / "local.json").write_text(json.dumps({**calibration, "device": "some other device"}))
    assert not local_gpu().calibrated and "ignored" in local_gpu().source

    (cache / "local.json").write_text("{not json")
    with pytest.raises(PlanError, match=r"calibration file .*local.json: cannot be read"):
        local_gpu()
