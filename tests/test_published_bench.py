"""benchmarks/published.py's Megatron-LM rows without planning them: the papers' formulas, the conversions of their
figures to tokens/s, the transcription checks and the pinned layouts, so that a mistyped row fails here."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "published.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    pytest.importorskip("rich")
    spec = importlib.util.spec_from_file_location("pyplan_published_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def megatron_rows(bench: ModuleType, source: str) -> list:
    return [r for r in bench.RUNS if r.source == source]


def test_eq2_gives_the_sizes_sc21_table_1_prints(bench: ModuleType) -> None:
    # Narayanan et al. 2021, Table 1: billions to one decimal.
    printed = [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
    rows = megatron_rows(bench, "SC21")[: len(printed)]
    assert [round(r.published_params / 1e9, 1) for r in rows] == printed


def test_the_gpt2_config_holds_eq2_and_the_final_layernorm(bench: ModuleType) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pyplan import load_model

    spec = load_model(bench.MEGATRON_GPT.format(h=64, l=2, a=4))
    with torch.device("meta"):
        model = spec.build()
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    assert params == bench.megatron_params(2, 64) + 2 * 64


def test_teraflops_convert_to_tokens_by_eq3_and_back(bench: ModuleType) -> None:
    # 1T: 163 teraFLOP/s per GPU (Table 1); eq. (3) per token is 96·l·h²·(1 + s/6h + V/16lh).
    layers, h = 128, 25600
    per_token = 96 * layers * h**2 * (1 + 2048 / (6 * h) + 51200 / (16 * layers * h))
    assert bench.sc21_flops_per_token(layers, h) == pytest.approx(per_token)
    assert bench.sc21_tokens_per_s(163, layers, h) * per_token == pytest.approx(163e12)
    one_t = bench.BY_NAME["megatron-1008.0b-sc21"]
    assert one_t.tokens_per_s_per_gpu == pytest.approx(163e12 / per_token)


def test_every_megatron_row_reproduces_its_published_utilization(bench: ModuleType) -> None:
    for r in megatron_rows(bench, "SC21") + megatron_rows(bench, "KORTH"):
        assert r.mfu_agrees(), r.name


def test_korthikanti_mfu_from_the_iteration_time(bench: ModuleType) -> None:
    # Table 5: 530B, 280 GPUs, batch 280, 37.83 s, MFU 56.0 % by eq. (7) on 312 teraFLOP/s.
    row = bench.BY_NAME["megatron-530b-sel"]
    assert row.tokens_per_s_per_gpu == pytest.approx(280 * 2048 / 37.83 / 280)
    assert row.mfu_from_throughput() == pytest.approx(0.560, abs=0.001)


def test_a_whole_percent_is_allowed_its_rounding_and_no_more(bench: ModuleType) -> None:
    row = bench.BY_NAME["megatron-7.5b-sc21"]  # 142 teraFLOP/s is 45.5 % of 312, printed 46 %
    assert row.mfu_from_throughput() == pytest.approx(142 / 312)
    assert row.mfu_agrees()
    assert not replace(row, mfu_step=0.0).mfu_agrees()
    assert not replace(row, mfu=0.47).mfu_agrees()


def test_the_pinned_layouts_are_the_published_ones(bench: ModuleType) -> None:
    names = [r.name for r in bench.RUNS]
    assert len(names) == len(set(names))
    for r in megatron_rows(bench, "SC21") + megatron_rows(bench, "KORTH"):
        pp = r.gpus // (r.replicas * r.tp)
        assert r.replicas * r.tp * pp == r.gpus, r.name
        assert r.schedule == ("Interleaved1F1B" if r.chunks > 1 else "1F1B"), r.name
        assert r.schedules == (r.schedule,), r.name
        assert r.chunks == 1 or pp > 1, r.name
        assert r.zero_stage == 0 and r.gpu == "a100-80g", r.name
    # run_table_1.sh: 76B 60 layers / pp 4 / 5 a virtual stage = 3 chunks; 530B 105 / 35 / 1 = 3; 1T not interleaved.
    assert bench.BY_NAME["megatron-76.1b-sc21"].chunks == 3
    assert bench.BY_NAME["megatron-529.6b-sc21"].chunks == 3
    assert bench.BY_NAME["megatron-1008.0b-sc21"].chunks == 1
    # Korthikanti's present work is sequence parallelism without remat (fused attention), the full column neither.
    sel, full = bench.BY_NAME["megatron-175b-sel"], bench.BY_NAME["megatron-175b-full"]
    assert (sel.remat, sel.sequence_parallel) == ("none", True)
    assert (full.remat, full.sequence_parallel) == ("full", False)


def test_megatron_statistics_count_the_planned_and_name_the_rest(bench: ModuleType) -> None:
    a, b, c = (bench.BY_NAME[n] for n in ("megatron-1.7b-sc21", "megatron-22b-full", "megatron-530b-full"))
    rows = [
        (a, {"status": "ok", "tokens_per_s_per_gpu": 1.3 * a.tokens_per_s_per_gpu}),
        (b, {"status": "ok", "tokens_per_s_per_gpu": 0.95 * b.tokens_per_s_per_gpu}),
        (c, {"status": "infeasible", "reason": "x", "roomy": {"status": "ok", "peak_memory_bytes": 100 * 2**30}}),
        (bench.RUNS[0], {"status": "ok", "tokens_per_s_per_gpu": 1.0}),  # not a Megatron row
    ]
    stats = bench.megatron_statistics(rows)
    assert (stats["rows"], stats["planned"]) == (3, 2)
    assert stats["median"] == pytest.approx(0.175) and stats["worst"] == pytest.approx(0.3)
    assert [name for name, _ in stats["beyond"]] == ["megatron-1.7b-sc21"]
    assert stats["unplanned"] == [("megatron-530b-full", "infeasible", 100.0)]
    text = bench.megatron_summary(stats)
    assert "2 of 3 planned" in text and "megatron-530b-full (infeasible, needs 100.0 GiB)" in text


def test_megatron_moe_flops_and_the_mixtral_row(bench: ModuleType) -> None:
    # num_floating_point_operations: 12·l·h²·((1 + g/a + s/h)·(128a/h) + F/h·k·3/2 + V/(2lh)), per token.
    n, h, s, v = 32, 4096, 4096, 32000
    by_hand = 12 * n * h**2 * ((1 + 8 / 32 + s / h) * 1 + 14336 / h * 2 * 1.5 + v / (2 * n * h))
    assert bench.megatron_moe_flops_per_token(n, h, 32, 8, 14336, 2, v, s) == pytest.approx(by_hand)
    row = bench.BY_NAME["megatron-mixtral-8x7b-h100-64"]
    assert row.tokens_per_s_per_gpu == pytest.approx(438e12 / by_hand)
    assert round(row.tokens_per_s_per_gpu) == 5282
    assert row.mfu_from_throughput() == pytest.approx(438e12 / bench.H100_BF16)
    # The reference mapping pinned: TP 1, EP 8 out of dp 16, PP 4, micro-batch 1, GA 256 / 16 = 16; VP 8 planned as
    # 8 interleaved chunks a rank; ZeRO 0 and bf16-mixed, as pyplan's EP runs.
    pp = row.gpus // (row.replicas * row.tp)
    assert (row.replicas, row.tp, row.ep, pp, row.micro_batch, row.grad_accum) == (16, 1, 8, 4, 1, 16)
    assert row.schedules == ("Interleaved1F1B",) and row.chunks == 8
    assert (row.zero_stage, row.precision, row.planned, row.excluded) == (0, "bf16-mixed", True, "")
    assert row.free_degrees == (1, 2, 4, 8)


def test_every_published_moe_run_is_a_row_and_the_unplannable_say_why(bench: ModuleType) -> None:
    from _moe_runs import MOE_RUNS

    assert sorted(r.name for r in bench.MOE_ROWS) == sorted(m.name for m in MOE_RUNS)
    assert all(bench.BY_NAME[r.name] is r for r in bench.MOE_ROWS)
    for r in bench.MOE_ROWS:
        assert r.num_experts and r.free_degrees[0] == 1, r.name
        assert r.planned == (not r.excluded), r.name
        assert r.replicas * r.tp * (r.gpus // (r.replicas * r.tp)) == r.gpus, r.name
    unplanned = [r for r in bench.MOE_ROWS if not r.planned]
    assert len(unplanned) == len(MOE_RUNS) - 1
    assert all("tensor parallelism beside expert parallelism" in r.excluded for r in unplanned if r.tp > 1)
    assert "B200" in bench.BY_NAME["torchtitan-qwen3-30b-b200-8-deepep"].excluded
    # The Qwen3 free degrees: every divisor of 128 up to 128.
    assert bench.BY_NAME["zoo-qwen3-235b-h100-intra-node-ep8-a2a"].free_degrees == (1, 2, 4, 8, 16, 32, 64, 128)


def test_moe_figures_convert_to_tokens_per_gpu(bench: ModuleType) -> None:
    by = bench.BY_NAME
    # DGX Cloud states the total: 342,755.90 tokens/s on 512 GPUs, also 4096 x 4096 / 48.948 s.
    assert by["dgxc-deepseek-v3-h100-512"].tokens_per_s_per_gpu == pytest.approx(342755.90 / 512)
    assert by["dgxc-deepseek-v3-h100-512"].tokens_per_s_per_gpu == pytest.approx(4096 * 4096 / 48.948 / 512, 1e-4)
    # The model zoo states seconds a step: GBS 2048 x 4096 / 19.7 s / 256 GPUs.
    assert by["zoo-qwen3-235b-h100-cross-node-ep32"].tokens_per_s_per_gpu == pytest.approx(2048 * 4096 / 19.7 / 256)
    # Megatron-Bridge and torchtitan state tokens/s per GPU.
    assert by["bridge-deepseek-v3-h100-1024"].tokens_per_s_per_gpu == 1297.0
    assert by["torchtitan-qwen3-30b-b200-8-deepep"].tokens_per_s_per_gpu == 14796.0
    # Grok-1: dp 8 x CP 2 x TP 4 x PP 8 = 512, GA 128 = 1024 / 8.
    grok = by["dgxc-grok1-h100-512"]
    assert (grok.replicas, grok.tp, grok.grad_accum) == (8, 8, 128)


def test_the_notes_of_moe_rows(bench: ModuleType) -> None:
    row = bench.BY_NAME["megatron-mixtral-8x7b-h100-64"]
    free = {"status": "ok", "layout": "dp16 ep8 pp4 b1x16 1F1B ZeRO-0",
            "tokens_per_s_per_gpu": 1.5 * row.tokens_per_s_per_gpu, "peak_memory_bytes": 70 * 2**30}  # fmt: skip
    notes = bench.Footnotes()
    text = bench.free_text(row, free, notes)
    assert "EP free of 1/2/4/8: dp16 ep8 pp4 b1x16 1F1B ZeRO-0" in text and "(ratio 1.50)" in text
    assert bench.free_text(row, {"status": "infeasible", "reason": "r"}, notes).endswith("infeasible (1)")
    unplanned = bench.BY_NAME["zoo-qwen3-235b-h100-intra-node-ep8-a2a"]
    note = bench._note(unplanned, None, bench.Footnotes())
    assert "not planned" in note and "not in statistics: TP 2 tensor parallelism beside" in note
    _, _, ratios, feasible = bench.throughput_table([(unplanned, None)])
    assert ratios == [] and feasible
