"""pyplan's predictions next to published, measured training runs and DeepSpeed's model-state estimator; two tables.

Run: `python benchmarks/published.py [--cases NAME ...] [--json PATH]` (needs transformers; about 23 minutes on
2 cores). Sources, conversions and a recorded run: benchmarks/PUBLISHED.md.

Table 1, throughput. Each published run (tokens/s per GPU measured on A100s and H100s with FSDP FULL_SHARD, i.e.
ZeRO-3, one of them beside tensor parallelism; Megatron-Core's ZeRO-1 on H100s, beside tensor parallelism for one
model; and Megatron-LM's own runs of GPT models from 1.7B on 32 A100s to 1T on 3072, tensor, pipeline and data
parallel, their throughput converted from the papers' teraFLOP/s or iteration times and their whole layout pinned)
is planned as it ran, in a process of its own: its model built from
a Hugging Face config on the meta device (MPT as the GPT-2 config with the same tensors), `pyplan.search` on the
catalog GPU restricted to the run's ZeRO stage, micro-batch size and tensor-parallel degree, with `remat="full"`
where the run checkpointed every layer, `"selective"` where it ran torchtitan's op policy on every layer, `"none"`
otherwise, at the published global batch; of every plan found, the one with the published layout (dp, tp, pp,
micro-batch, gradient-accumulation steps, ZeRO stage) is read.
pyplan's tokens/s per GPU = global batch x sequence length / predicted iteration time / GPUs. Where that layout is
not among the plans the row says so. Rows that rely on what pyplan does not model (FP8, torch.compile, a GPU
outside the catalog, software older than the GPU, another framework's runtime) stay in the table with the reason,
and out of the statistics. The mixture-of-experts runs of benchmarks/_moe_runs.py are rows too: one pyplan can plan
as it ran is planned at its published layout with its expert-parallel degree pinned, and again as pyplan's own best
plan with `expert_parallel` free (the note prints it); one it cannot (tensor or context parallelism beside EP,
DeepEP, FP8, a GPU outside the catalog, a model whose experts pyplan does not find) is listed with the reason and
not planned.
Targets: median |predicted/published - 1| <= 15 %, worst <= 35 %, every published configuration feasible (its
memory within the GPU's; the share of the GPU is printed, and a note marks rows over pyplan's default 90 %). The
Megatron-LM rows, which ran Megatron's own runtime and are planned as pyplan's runtime would run their layouts, are
in these statistics and also summarized apart: median <= 10 %, and PUBLISHED.md accounts for each beyond 25 %.

Table 2, model-state bytes per GPU for 1.5B, 6.7B and 7.5B parameters on 8 and 64 GPUs under ZeRO 1-3: pyplan's
convention (`Workload.state_bytes_per_gpu`) next to DeepSpeed's `estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs`, and pyplan's sharding function fed DeepSpeed's bytes per parameter, which
must agree within 1 % but for ZeRO-3's largest-layer term (pyplan's state has none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, last_json, new_table, run_child, verdict, write_json

# Published mixture-of-experts runs, as data.
from _moe_runs import MOE_RUNS

# The full-size Hugging Face configurations of benchmarks/real_models.py, reused where a run's model matches.
from real_models import CASES

GiB = 2**30
TARGET_MEDIAN, TARGET_WORST = 0.15, 0.35
# Megatron-LM's runs, on their published layouts: the median target, and the deviation beyond which PUBLISHED.md
# accounts for a row term by term.
MEGATRON_SOURCES, MEGATRON_MEDIAN, MEGATRON_EXPLAINED = ("SC21", "KORTH"), 0.10, 0.25
TOP_K = 10_000  # every plan the search finds, so the published layout is among them when it fits
SLOW_SEARCH_S = 120.0
# Of each GPU's memory planned for: the whole of it, as the published runs had it (pyplan.search keeps 10 % back by
# default; a row that needs more than 90 % says so).
MEMORY_FRACTION = 1.0
DEFAULT_FRACTION = 0.9
ROOMY = 8.0  # memory scale of the GPU that reads what an unplannable layout needs

SOURCES: dict[str, str] = {
    "LF": "MosaicML llm-foundry, scripts/train/benchmarking/README.md (mosaicml/llm-foundry at 061f2c7c), tables "
    "'H100 80GB BF16', 'H100 80GB FP8', 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', "
    "'A100 40GB with 1600 Gbps node-node interconnect (RoCE)'; model shapes from "
    "scripts/train/yamls/pretrain/mpt-*.yaml",
    "TT-A100": "torchtitan, docs/performance.md (pytorch/torchtitan at 04133643), 'Llama 3 performance numbers' and "
    "'Llama 2 performance numbers', FSDP2 on 64 A100 80GB; configs train_configs/llama3_8b.toml, llama2_13b.toml "
    "(seq_len, compile = false)",
    "TT-H100": "torchtitan, docs/performance.md (pytorch/torchtitan at eaea6f6a), Tables 1, 3 and 4 (Llama 3.1 on "
    "H100 96GB HBM2e at 500 W, torch 1963fc8 of 2024-12-23)",
    "DGXC": "NVIDIA DGX Cloud Performance Recipes (NVIDIA/dgxc-benchmarking): tag v25.02.02, "
    "llama3/finetuning/README_8b.md (Llama 3 8B SFT BF16, container nemo:24.12; recipe llama3_finetune.py, NeMo "
    "llama3_8b.finetune_recipe(peft_scheme=None, performance_mode=True)); tag v25.04.02, nemotron/README.md "
    "(Nemotron-4 15B pre-training BF16, NeMo 25.02.01; NeMo scripts/llm/performance/pretrain_nemotron4_15b.py)",
    "SC21": "Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM', SC "
    "2021 (arXiv:2104.04473), Table 1 and Table 2 (PTD-P rows), FLOPs by eq. (3); launch settings from "
    "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh and CONFIG.sh (at 6985e589); Table 1 also in that repository's "
    "README, images/cases_april2021.png (at 50a4b5fa)",
    "MCORE-MOE": "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (at 0b981f9c): first paragraph "
    "('Mixtral 8X7B bf16 training to achieve 438 TFLOPS as of MCore v0.8') and 'Reference Best Parallel Mapping'; "
    "teraFLOP/s to tokens by megatron/training/training.py num_floating_point_operations (see PUBLISHED.md)",
    "DGXC-MOE": "NVIDIA/dgxc-benchmarking tag v25.05.05: deepseek_v3/pretraining/README.md and grok1/README.md, "
    "H100 performance tables (NeMo 25.04 containers)",
    "ZOO": "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (at e8650517), 'Performance Results' / "
    "'H100' table (Qwen3-235B-A22B, 256 H100, GBS 2048, sequence 4096)",
    "BRIDGE": "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md (at 4ab94dfa), GPT OSS 120B and "
    "DeepSeekV3 on DGX-H100",
    "TT-DEEPEP": "pytorch/torchtitan torchtitan/distributed/deepep/README.md (at 2a642d02), Qwen3-30B-A3B on 8 "
    "B200; config qwen3_30b_a3b_with_deepep.toml",
    "KORTH": "Korthikanti et al., 'Reducing Activation Recomputation in Large Transformer Models', MLSys 2023 "
    "(arXiv:2205.05198), Table 3 (layouts), Table 5 (iteration times, MFU by eq. (7)), §6.3 (530B at 8-way data "
    "parallelism); Table 5's MFU also in NVIDIA/Megatron-LM's README (at 2e90a342)",
}

# The MPT benchmark configurations are GPT-2's tensors exactly (learned positions up to the sequence length, biases,
# LayerNorm, 4x GELU MLP, tied embeddings, vocabulary 50368; no dropout in MPTConfig's defaults): the published
# NumParams equal the GPT-2 config's count. MPT's exact-erf GELU is GPT-2's "gelu", not its default tanh "gelu_new".
MPT = "hf:gpt2:n_embd={d},n_layer={n},n_head={h},vocab_size=50368,n_positions=2048,activation_function=gelu,"
MPT += "resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0,seq_len=2048"
MPT_NOTE = (
    "MPT as hf:gpt2 with its tensors, exact GELU, no dropout; flash attention as pyplan prices SDPA; ZeRO-3 priced "
    "as FSDP2's bf16 policy (16-bit gathers), which is llm-foundry's PURE mode: its amp_bf16 (DEFAULT) rows gathered "
    "fp32 weights under autocast"
)
LLAMA2_13B = (
    "hf:llama:hidden_size=5120,intermediate_size=13824,num_hidden_layers=40,num_attention_heads=40,"
    "num_key_value_heads=40,vocab_size=32000,max_position_embeddings=4096,seq_len=4096"
)
LLAMA3_70B = (
    "hf:llama:hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64,"
    "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192,seq_len=8192"
)
# Nemotron-4 15B: transformers' NemotronConfig defaults are its shapes (6144 wide, 32 layers, 48 heads of 128,
# squared-ReLU MLP of 24576, LayerNorm1P, half rotary, untied 256000 vocabulary, no biases) but for its 8 key-value
# groups (NeMo's Nemotron4Config15B, num_query_groups 8). Its parameters counted from that configuration:
# 3,145,728,000 in the two embeddings and 12,483,047,424 in the rest (the technical report, arXiv:2402.16819,
# Table 1: 3.2B embedding and 12.5B non-embedding parameters).
NEMOTRON4_15B = "hf:nemotron:num_key_value_heads=8,seq_len=4096"
CASE = {c.name: c for c in CASES}
LLAMA3_8B_4K = CASE["llama-3-8b"].ref.replace("seq_len=8192", "seq_len=4096")
A100_BF16, H100_BF16, H100_FP8 = 312e12, 989.5e12, 1979e12  # the peaks the sources' MFU divides by
# torchtitan's H100s: 96 GB of HBM2e at 2.4 TB/s (docs/performance.md); peak FLOP/s "between SXM and NVL", unknown.
H100_96G = "h100-96g-hbm2e-500w"


@dataclass(frozen=True)
class Run:
    """One published training run and the pyplan configuration that plans it.

    `tokens_per_s_per_gpu`, `mfu` and `memory_gib` are the source's figures; `peak_flops` is the peak its MFU divides
    by, so that `mfu_from_throughput` (the source's formula, 6N + 12·layers·hidden·seq FLOPs per token) checks the
    transcription; where the source's MFU counts other FLOPs, `flops_per_token` is its model FLOPs per token.
    `excluded` says why a row stays out of the statistics; `tp` is the run's tensor-parallel degree (its dp replicas
    of tp GPUs each); `precision` pyplan's name for the run's (bf16 autocast over fp32 weights unless it says
    otherwise).
    """

    name: str
    source: str
    table: str
    model: str
    ref: str
    published_params: int
    layers: int
    hidden: int
    gpu: str
    gpus: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    checkpointing: str  # as published: "none", "full", "selective op", "selective layer", "selective"
    tokens_per_s_per_gpu: float
    mfu: float | None = None
    peak_flops: float | None = None
    memory_gib: float | None = None
    zero_stage: int = 3
    dp: int | None = None  # None: every GPU is a data-parallel rank
    note: str = ""
    excluded: str = ""
    tp: int = 1
    flops_per_token: float | None = None
    precision: str = "bf16-mixed"
    mfu_step: float = 0.0  # the published MFU's rounding step (0.01: whole percents), allowed in the check
    schedule: str = ""  # pyplan's name for the run's pipeline schedule; set: the whole layout is pinned in the search
    chunks: int = 1  # model chunks (stages) a pipeline rank holds, 2 or more interleaved; pinned in the search
    sequence_parallel: bool = True  # beside tp: the values between the split layers sliced by tokens
    detail: str = ""  # the row's own note, after `note` (which rows of one source may share)
    ep: int = 1  # the run's expert-parallel degree (carved out of dp)
    num_experts: int = 0  # routed experts a mixture-of-experts layer (0: a dense model): EP left free divides them
    planned: bool = True  # False: a run pyplan cannot plan as it ran at all (not planned; the reason in `excluded`)

    def __post_init__(self) -> None:
        if self.replicas * self.micro_batch * self.grad_accum != self.global_batch:
            raise ValueError(
                f"{self.name}: dp {self.replicas} x micro-batch {self.micro_batch} x GA {self.grad_accum} != "
                f"global batch {self.global_batch}"
            )

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules planned for the run's: its own (with its chunks a rank, `chunks`)."""
        return (self.schedule,) if self.schedule else ()

    @property
    def free_degrees(self) -> tuple[int, ...]:
        """The expert-parallel degrees pyplan's own plan chooses from: every E that divides the experts and fits in
        the GPUs (the search keeps those that divide its dp); none for a dense model."""
        if not self.num_experts:
            return ()
        return tuple(e for e in range(1, min(self.num_experts, self.gpus) + 1) if self.num_experts % e == 0)

    @property
    def replicas(self) -> int:
        return self.gpus if self.dp is None else self.dp

    @property
    def remat(self) -> str:
        """pyplan's remat mode for the run's checkpointing: every layer (full), torchtitan's op policy on every
        layer (selective, FSDP units checkpointed selectively), or none."""
        return {"full": "full", "selective op": "selective", "selective": "selective"}.get(self.checkpointing, "none")

    def mfu_from_throughput(self) -> float | None:
        if self.peak_flops is None:
            return None
        flops_per_token = self.flops_per_token
        if flops_per_token is None:
            flops_per_token = 6 * self.published_params + 12 * self.layers * self.hidden * self.seq_len
        return self.tokens_per_s_per_gpu * flops_per_token / self.peak_flops

    def mfu_agrees(self) -> bool:
        """The published MFU re-derived from the transcribed throughput within 1 %, or within half the published
        figure's rounding step (a whole percent of 46 % is 1.1 % of it); true where there is nothing to check."""
        ours, theirs = self.mfu_from_throughput(), self.mfu
        if ours is None or theirs is None:
            return True
        return abs(ours - theirs) <= max(0.01 * theirs, self.mfu_step / 2)


def _mpt(name: str, size: str, d: int, n: int, h: int, params: int, gpu: str, table: str, **kw: Any) -> Run:
    return Run(name, "LF", table, f"MPT-{size}", MPT.format(d=d, n=n, h=h), params, n, d, gpu, note=MPT_NOTE, **kw)


# Megatron-LM's GPT models of [SC21] and [KORTH]: vocabulary 51,200, sequence 2,048, 4h MLP, learned positions,
# biases, LayerNorm, tied embeddings, dropout 0.1: the tensors of Hugging Face's GPT-2 (its count is eq. (2)'s + 2h:
# eq. (2) leaves out the final LayerNorm). The GELU is Megatron's fused bias-GELU (megatron/model/fused_bias_gelu.py,
# `GeLUFunction`: the tanh approximation in one kernel that saves only its input and bias), which is torch's
# `gelu(approximate="tanh")`, transformers' "gelu_pytorch_tanh", not GPT-2's default "gelu_new" (the same formula in
# eight elementwise operations that keep four 4h tensors a layer where the fused one keeps one).
MEGATRON_VOCAB, MEGATRON_SEQ = 51_200, 2_048
MEGATRON_GPT = "hf:gpt2:n_embd={h},n_layer={l},n_head={a},vocab_size=51200,n_positions=2048,seq_len=2048," \
    "activation_function=gelu_pytorch_tanh"  # fmt: skip


def megatron_params(layers: int, hidden: int, vocab: int = MEGATRON_VOCAB, seq: int = MEGATRON_SEQ) -> int:
    """Parameters of Megatron's GPT, Narayanan et al. 2021, eq. (2): P = 12lh²(1 + 13/(12h) + (V + s)/(12lh)),
    that is 12lh² + 13lh + (V + s)h."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden


def sc21_flops_per_token(layers: int, hidden: int, seq: int = MEGATRON_SEQ, vocab: int = MEGATRON_VOCAB) -> float:
    """FLOPs per token of a training iteration with full recomputation, Narayanan et al. 2021, eq. (3) over B·s:
    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)), the GEMMs of the forward, the backward and recomputation's second
    forward (the teraFLOP/s of their Table 1 count these)."""
    return 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_model_flops_per_token(
    layers: int, hidden: int, seq: int = MEGATRON_SEQ, vocab: int = MEGATRON_VOCAB
) -> float:
    """Model FLOPs per token, Korthikanti et al. 2022, eq. (7) over B·s: 72·l·h²·(1 + s/(6h) + V/(12lh)), one
    forward and one backward without recomputation (what their MFU divides)."""
    return 72 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def sc21_tokens_per_s(tflops_per_gpu: float, layers: int, hidden: int) -> float:
    """Tokens/s per GPU of a run that [SC21] reports at `tflops_per_gpu` teraFLOP/s per GPU (eq. (3)'s FLOPs)."""
    return tflops_per_gpu * 1e12 / sc21_flops_per_token(layers, hidden)


SC21_NOTE = (
    "Megatron-LM's own runtime (2021: NGC PyTorch 20.12, fp16 with fp32 main weights, static loss scale 8192, fused "
    "kernels, attention as baddbmm + fused scale-mask-softmax + dropout + bmm), planned as pyplan's runtime would run "
    "its layout: bf16 weights and gradients beside fp32 master weights (--fp16 without "
    "--accumulate-allreduce-grads-in-fp32 keeps and all-reduces 16-bit gradients), every layer recomputed "
    "(--checkpoint-activations), no sequence parallelism, ZeRO 0 (no distributed optimizer in 2021); micro-batch and "
    "schedule from examples/sc21/run_table_1.sh; tok/s from teraFLOP/s by eq. (3)"
)
KORTH_NOTE = (
    "Megatron-LM's own runtime (2022, mixed precision: planned as bf16-master, Megatron's --bf16 with fp32 main "
    "gradients; the paper does not say fp16 or bf16); no data parallelism, tok/s = batch x 2048 / iteration time / "
    "GPUs"
)
SHARED_NOTES = (MPT_NOTE, SC21_NOTE, KORTH_NOTE)  # printed once, as a footnote


def _sc21(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float,
          percent: float | None, micro_batch: int, ddp: str, chunks: int = 1, table: str = "Table 1",
          detail: str = "") -> Run:  # fmt: skip
    """A row of [SC21]: the published shape, layout, batch and teraFLOP/s per GPU (with its percentage of the
    peak where published); the micro-batch, DDP implementation and model chunks a rank of
    examples/sc21/run_table_1.sh."""
    dp = gpus // (tp * pp)
    overlap = "gradient all-reduce overlapped with the backward (torch DDP)" if ddp == "torch" else (
        "gradients all-reduced after the backward (local DDP)")  # fmt: skip
    chunked = f"interleaved, {chunks} chunks a rank" if chunks > 1 else ""
    return Run(
        f"megatron-{size.lower()}-sc21" + ("" if table == "Table 1" else f"-{gpus}"),
        "SC21", table, f"GPT {size} (Megatron)", MEGATRON_GPT.format(h=hidden, l=layers, a=heads),
        megatron_params(layers, hidden), layers, hidden, "a100-80g", gpus, micro_batch, batch // (dp * micro_batch),
        batch, MEGATRON_SEQ, "full", sc21_tokens_per_s(tflops, layers, hidden), mfu=percent, peak_flops=A100_BF16,
        flops_per_token=sc21_flops_per_token(layers, hidden), mfu_step=0.01, zero_stage=0, dp=dp, tp=tp,
        precision="bf16-master-bf16-grads", schedule="Interleaved1F1B" if chunks > 1 else "1F1B", chunks=chunks,
        sequence_parallel=False, note=SC21_NOTE,
        detail="; ".join(x for x in (f"{tflops:g} teraFLOP/s per GPU", overlap, chunked, detail) if x),
    )  # fmt: skip


def _korth(size: str, heads: int, hidden: int, layers: int, pp: int, gpus: int, batch: int, micro_batch: int,
           seconds: float, recompute: str, mfu: float | None = None, chunks: int = 1, table: str = "Table 5",
           detail: str = "") -> Run:  # fmt: skip
    """A row of [KORTH] (tensor parallelism 8): "full" is its Full Recompute column (every layer recomputed, no
    sequence parallelism), "selective" its Present Work (sequence parallelism and selective recomputation of the
    core attention, which pyplan's fused attention stands for: it keeps what that keeps, Q, K, V and the output, and
    its backward recomputes the scores; planned without remat)."""
    tp = 8
    dp = gpus // (tp * pp)
    full = recompute == "full"
    chunked = f"interleaved, {chunks} chunks a rank" if chunks > 1 else ""
    what = "every layer recomputed, no sequence parallelism" if full else (
        "sequence parallelism + selective recomputation (fused attention, no remat in pyplan)")  # fmt: skip
    return Run(
        f"megatron-{size.lower()}-{'full' if full else 'sel'}" + ("" if dp == 1 else f"-dp{dp}"),
        "KORTH", table, f"GPT {size} (Megatron)", MEGATRON_GPT.format(h=hidden, l=layers, a=heads),
        megatron_params(layers, hidden), layers, hidden, "a100-80g", gpus, micro_batch, batch // (dp * micro_batch),
        batch, MEGATRON_SEQ, "full" if full else "selective attention", batch * MEGATRON_SEQ / seconds / gpus,
        mfu=mfu, peak_flops=A100_BF16, flops_per_token=megatron_model_flops_per_token(layers, hidden),
        mfu_step=0.001, zero_stage=0, dp=dp, tp=tp, precision="bf16-master",
        schedule="Interleaved1F1B" if chunks > 1 else "1F1B", chunks=chunks, sequence_parallel=not full,
        note=KORTH_NOTE, detail="; ".join(x for x in (f"iteration {seconds:g} s", what, chunked, detail) if x),
    )  # fmt: skip


LF_H100, LF_A100_80, LF_A100_40 = "H100 80GB BF16", "A100 80GB", "A100 40GB"
# The 2023 H100 rows ran Hopper on software written for Ampere; pyplan prices a GPU as current software runs it.
LF_H100_STACK = (
    "2023 software on Hopper, which pyplan does not model: the image mosaicml/pytorch:2.0.1_cu118 "
    "(scripts/train/benchmarking/h100_benchmarks.sh) and MPT's triton flash attention, kernels without Hopper's "
    "warpgroup MMA (FlashAttention-2 on H100: 35 % of peak, Shah et al. 2024); these runs reach 38-46 % MFU where "
    "the same tables' A100 runs reach 51-64 % and 2025 software on H100 56-59 % ([DGXC] rows)"
)
RUNS: tuple[Run, ...] = (
    # llm-foundry, A100 80GB (amp_bf16, FSDP mixed precision DEFAULT, except 70b: bf16 PURE); seq 2048.
    _mpt("mpt-1b-a100-80", "1b", 2048, 24, 16, 1_315_950_592, "a100-80g", LF_A100_80, gpus=8, micro_batch=14,
         grad_accum=4, global_batch=448, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=20513, mfu=0.5986,
         peak_flops=A100_BF16),
    _mpt("mpt-3b-a100-80", "3b", 2560, 32, 20, 2_651_837_440, "a100-80g", LF_A100_80, gpus=8, micro_batch=10,
         grad_accum=2, global_batch=160, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=10811, mfu=0.6211,
         peak_flops=A100_BF16),
    _mpt("mpt-7b-a100-80", "7b", 4096, 32, 32, 6_658_859_008, "a100-80g", LF_A100_80, gpus=8, micro_batch=6,
         grad_accum=2, global_batch=96, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=4641, mfu=0.6423,
         peak_flops=A100_BF16),
    _mpt("mpt-13b-a100-80", "13b", 5120, 40, 40, 12_853_954_560, "a100-80g", LF_A100_80, gpus=8, micro_batch=2,
         grad_accum=3, global_batch=48, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=2262, mfu=0.5957,
         peak_flops=A100_BF16),
    _mpt("mpt-30b-a100-80", "30b", 7168, 48, 56, 29_975_214_080, "a100-80g", LF_A100_80, gpus=8, micro_batch=3,
         grad_accum=21, global_batch=504, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=916, mfu=0.553,
         peak_flops=A100_BF16),
    _mpt("mpt-70b-a100-80", "70b", 8192, 80, 64, 64_862_437_376, "a100-80g", LF_A100_80, gpus=64, micro_batch=8,
         grad_accum=4, global_batch=2048, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=410,
         mfu=0.5333, peak_flops=A100_BF16),
    # llm-foundry, H100 80GB (amp_bf16, DEFAULT); seq 2048.
    _mpt("mpt-1b-h100", "1b", 2048, 24, 16, 1_315_950_592, "h100-sxm", LF_H100, gpus=8, micro_batch=14,
         grad_accum=1, global_batch=112, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=45455,
         mfu=0.4182, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    _mpt("mpt-3b-h100", "3b", 2560, 32, 20, 2_651_837_440, "h100-sxm", LF_H100, gpus=16, micro_batch=10,
         grad_accum=3, global_batch=480, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=24142,
         mfu=0.4373, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    _mpt("mpt-7b-h100", "7b", 4096, 32, 32, 6_658_859_008, "h100-sxm", LF_H100, gpus=8, micro_batch=6,
         grad_accum=1, global_batch=48, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=10643,
         mfu=0.4644, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    _mpt("mpt-13b-h100", "13b", 5120, 40, 40, 12_853_954_560, "h100-sxm", LF_H100, gpus=8, micro_batch=2,
         grad_accum=1, global_batch=16, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=4792,
         mfu=0.3979, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    _mpt("mpt-30b-h100", "30b", 7168, 48, 56, 29_975_214_080, "h100-sxm", LF_H100, gpus=8, micro_batch=3,
         grad_accum=21, global_batch=504, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=2002,
         mfu=0.3811, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    _mpt("mpt-70b-h100", "70b", 8192, 80, 64, 64_862_437_376, "h100-sxm", LF_H100, gpus=64, micro_batch=8,
         grad_accum=4, global_batch=2048, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=1039,
         mfu=0.4257, peak_flops=H100_BF16,
         excluded=LF_H100_STACK),
    # llm-foundry, A100 40GB (bf16, FSDP mixed precision PURE); seq 2048.
    _mpt("mpt-1b-a100-40", "1b", 2048, 24, 16, 1_315_950_592, "a100-40g", LF_A100_40, gpus=8, micro_batch=8,
         grad_accum=8, global_batch=512, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=19271,
         mfu=0.5623, peak_flops=A100_BF16),
    _mpt("mpt-7b-a100-40", "7b", 4096, 32, 32, 6_658_859_008, "a100-40g", LF_A100_40, gpus=8, micro_batch=12,
         grad_accum=4, global_batch=384, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=3679,
         mfu=0.5092, peak_flops=A100_BF16),
    _mpt("mpt-13b-a100-40", "13b", 5120, 40, 40, 12_853_954_560, "a100-40g", LF_A100_40, gpus=64, micro_batch=16,
         grad_accum=1, global_batch=1024, seq_len=2048, checkpointing="full", tokens_per_s_per_gpu=1976,
         mfu=0.5204, peak_flops=A100_BF16),
    # llm-foundry, H100 80GB FP8 (amp_fp8, Transformer Engine): planned in bf16 for comparison only.
    _mpt("mpt-3b-h100-fp8", "3b", 2560, 32, 20, 2_651_837_440, "h100-sxm", "H100 80GB FP8", gpus=8, micro_batch=10,
         grad_accum=6, global_batch=480, seq_len=2048, checkpointing="none", tokens_per_s_per_gpu=30586,
         mfu=0.277, peak_flops=H100_FP8, excluded="FP8 (amp_fp8); pyplan plans bf16"),
    # torchtitan, FSDP2 (ZeRO-3) on 64 A100 80GB, compile = false; Llama 3 at seq 8192, Llama 2 at 4096.
    Run("llama3-8b-a100", "TT-A100", "Llama 3 table", "Llama 3 8B", CASE["llama-3-8b"].ref,
        CASE["llama-3-8b"].published_params, 32, 4096, "a100-80g", 64, 1, 1, 64, 8192, "selective op", 2973,
        mfu=0.582, peak_flops=A100_BF16),
    Run("llama3-70b-a100", "TT-A100", "Llama 3 table", "Llama 3 70B", LLAMA3_70B, 70_553_706_496, 80, 8192,
        "a100-80g", 64, 1, 1, 64, 8192, "full", 331, mfu=0.517, peak_flops=A100_BF16),
    Run("llama2-13b-a100", "TT-A100", "Llama 2 table", "Llama 2 13B", LLAMA2_13B, 13_015_864_320, 40, 5120,
        "a100-80g", 64, 2, 1, 128, 4096, "none", 2162, mfu=0.611, peak_flops=A100_BF16),
    Run("llama2-13b-a100-sac", "TT-A100", "Llama 2 table", "Llama 2 13B", LLAMA2_13B, 13_015_864_320, 40, 5120,
        "a100-80g", 64, 2, 1, 128, 4096, "selective op", 1904, mfu=0.538, peak_flops=A100_BF16),
    Run("llama2-70b-a100", "TT-A100", "Llama 2 table", "Llama 2 70B", CASE["llama-2-70b"].ref,
        CASE["llama-2-70b"].published_params, 80, 8192, "a100-80g", 64, 2, 1, 128, 4096, "full", 353, mfu=0.505,
        peak_flops=A100_BF16),
    Run("llama2-70b-a100-sac", "TT-A100", "Llama 2 table", "Llama 2 70B", CASE["llama-2-70b"].ref,
        CASE["llama-2-70b"].published_params, 80, 8192, "a100-80g", 64, 1, 1, 64, 4096, "selective op", 355,
        mfu=0.508, peak_flops=A100_BF16, note="local batch 1: batch 2 ran out of memory with selective AC"),
    # torchtitan on H100 96GB HBM2e at 500 W (not in the catalog): the FSDP rows without torch.compile or Float8.
    Run("llama31-8b-h100x8", "TT-H100", "Table 1, FSDP", "Llama 3.1 8B", CASE["llama-3-8b"].ref,
        CASE["llama-3-8b"].published_params, 32, 4096, H100_96G, 8, 2, 1, 16, 8192, "selective", 5762,
        memory_gib=82.4, note="selective op AC; seq 8192 from the config of the time",
        excluded="H100 96GB HBM2e at 500 W: not in the catalog, peak FLOP/s unknown (planned with h100-sxm's)"),
    Run("llama31-8b-h100x128", "TT-H100", "Table 3, FSDP", "Llama 3.1 8B", CASE["llama-3-8b"].ref,
        CASE["llama-3-8b"].published_params, 32, 4096, H100_96G, 128, 2, 1, 256, 8192, "selective", 5605,
        memory_gib=67.0, note="selective op AC; seq 8192 from the config of the time",
        excluded="H100 96GB HBM2e at 500 W: not in the catalog, peak FLOP/s unknown (planned with h100-sxm's)"),
    Run("llama31-70b-h100-tp", "TT-H100", "Table 4, 2D", "Llama 3.1 70B", LLAMA3_70B, 70_553_706_496, 80, 8192,
        H100_96G, 256, 16, 1, 512, 8192, "full", 829, memory_gib=71.9, dp=32, tp=8,
        note="FSDP 32 x TP 8 (with sequence parallelism)",
        excluded="torch.compile and Float8; H100 96GB HBM2e at 500 W (planned with h100-sxm's peak)"),
    # NVIDIA's DGX Cloud recipes, Megatron-Core with Transformer Engine in NeMo containers on DGX H100, BF16:
    # distributed optimizer (ZeRO-1), no recomputation. MFU as the sources count it (model FLOPs per sequence:
    # Llama 3 8B SFT 1.84e14, Nemotron-4 15B 3.85e14, sequence 4096; peak 989 TFLOP/s). What 2025 software reaches
    # on an H100. Each holds bf16 weights and gradients beside fp32 master weights (NeMo v2.1.0's
    # llama3_8b.finetune_performance_optimizations and v2.2.0's nemotron4_15b performance mode set
    # grad_reduce_in_fp32=False, which MegatronStrategy copies into the DDP config), which pyplan plans as
    # bf16-master-bf16-grads.
    Run("llama3-8b-sft-h100", "DGXC", "Llama3 8b Finetuning SFT BF16", "Llama 3 8B", LLAMA3_8B_4K,
        CASE["llama-3-8b"].published_params, 32, 4096, "h100-sxm", 8, 1, 4, 32, 4096, "none", 99296 / 8,
        mfu=0.5638, peak_flops=989e12, flops_per_token=1.84e14 / 4096, zero_stage=1, precision="bf16-master-bf16-grads",
        note="full SFT on SQuAD packed to 4096 tokens (attention within each packed sample; pyplan prices causal "
        "attention over all 4096); bf16 weights and gradients, fp32 master weights (bf16-master-bf16-grads); "
        "step 1.32 s"),
    Run("nemotron4-15b-h100x16", "DGXC", "Nemotron4 15b BF16", "Nemotron-4 15B", NEMOTRON4_15B, 15_628_775_424,
        32, 6144, "h100-sxm", 16, 2, 4, 64, 4096, "none", 98550 / 16, mfu=0.5854, peak_flops=989e12,
        flops_per_token=3.85e14 / 4096, zero_stage=1, dp=8, tp=2, precision="bf16-master-bf16-grads",
        note="TP 2 with sequence parallelism; Megatron overlaps tp's communication with the GEMMs (userbuffers), "
        "pyplan's runtime does not; bf16 weights and gradients, fp32 master weights; step 2.66 s"),
    Run("nemotron4-15b-h100x64", "DGXC", "Nemotron4 15b BF16", "Nemotron-4 15B", NEMOTRON4_15B, 15_628_775_424,
        32, 6144, "h100-sxm", 64, 2, 4, 256, 4096, "none", 392725 / 64, mfu=0.5832, peak_flops=989e12,
        flops_per_token=3.85e14 / 4096, memory_gib=round(72972500992 / GiB, 1), zero_stage=1, dp=32, tp=2,
        precision="bf16-master-bf16-grads",
        note="as the 16-GPU row, 8 nodes; memory: the README's example log line of this run (peak_memory_usage, "
        "step 2.693 s), published step 2.67 s"),
    # Megatron-LM on Selene's A100 80GB (8 a node, NVLink and 8 HDR InfiniBand HCAs), sequence 2048, vocabulary
    # 51,200. [SC21] Table 1 (with the launch script's micro-batch, DDP and chunks) and Table 2's PTD-P rows of the
    # 530B model (Table 1's layout, tp 8 x pp 35, at micro-batch 1 and batch 2240).
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 0.44, 16, "torch"),
    _sc21("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 0.44, 16, "torch"),
    _sc21("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 0.46, 16, "torch"),
    _sc21("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 0.43, 8, "torch"),
    _sc21("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 0.44, 4, "local"),
    _sc21("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 0.45, 2, "local", chunks=3),
    _sc21("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 0.47, 2, "local", chunks=2),
    _sc21("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 0.50, 1, "local", chunks=2),
    _sc21("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 0.52, 1, "local", chunks=3),
    _sc21("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 0.52, 1, "local"),
    *(_sc21("529.6B", 128, 20480, 105, 8, 35, gpus, 2240, tflops, None, 1, "local", chunks=3,
            table="Table 2, PTD-P",
            detail="schedule and recomputation assumed as Table 1's (Table 2 states model-parallel size 280 and "
            "micro-batch 1)")
      for gpus, tflops in ((560, 171), (1120, 167), (2240, 159))),
    # [KORTH] Table 3's layouts (tp 8, no data parallelism) at Table 5's iteration times; §6.3's 530B at 8-way data
    # parallelism (2240 GPUs, batch 8 x 280).
    _korth("22B", 64, 6144, 48, 1, 8, 4, 4, 1.42, "full"),
    _korth("22B", 64, 6144, 48, 1, 8, 4, 4, 1.10, "selective", mfu=0.415),
    _korth("175B", 96, 12288, 96, 8, 64, 64, 1, 18.13, "full", chunks=3),
    _korth("175B", 96, 12288, 96, 8, 64, 64, 1, 13.75, "selective", mfu=0.514, chunks=3),
    _korth("530B", 128, 20480, 105, 35, 280, 280, 1, 49.05, "full", chunks=3),
    _korth("530B", 128, 20480, 105, 35, 280, 280, 1, 37.83, "selective", mfu=0.560, chunks=3),
    _korth("530B", 128, 20480, 105, 35, 2240, 2240, 1, 39.15, "selective", mfu=0.542, chunks=3, table="§6.3",
           detail="gradient all-reduce not overlapped (as the paper says); ZeRO 0 assumed"),
    _korth("1T", 160, 25600, 128, 64, 512, 512, 1, 94.42, "full"),
    _korth("1T", 160, 25600, 128, 64, 512, 512, 1, 71.49, "selective", mfu=0.563),
)  # fmt: skip


def megatron_moe_flops_per_token(layers: int, hidden: int, heads: int, groups: int, ffn: int, top_k: int, vocab: int,
                                 seq: int, gated: bool = True) -> float:  # fmt: skip
    """Megatron-LM's FLOPs per token of an MoE GPT (megatron/training/training.py, num_floating_point_operations, of
    MCore v0.8): 12·l·h²·((1 + groups/heads + s/h)·(heads·128/h) + ffn/h·top_k·(3/2 if gated) + V/(2lh)), the
    forward and the two GEMMs of the backward, no recomputation, the attention's scores counted in full."""
    projection = heads * 128 / hidden
    attention = (1 + groups / heads + seq / hidden) * projection
    mlp = ffn / hidden * top_k * (1.5 if gated else 1.0)
    return 12 * layers * hidden**2 * (attention + mlp + vocab / (2 * layers * hidden))


MIXTRAL_8X7B = "hf:mixtral:max_position_embeddings=4096,seq_len=4096"  # transformers' MixtralConfig is 8x7B's shape
MIXTRAL_FLOPS = megatron_moe_flops_per_token(32, 4096, 32, 8, 14336, 2, 32000, 4096)
MOE_NOTE = (
    "a mixture of experts planned with expert parallelism as pyplan's runtime runs it (tp 1, ZeRO 0, EP carved out "
    "of dp on neighbouring ranks, all-to-all dispatch, the experts' load as routed; bf16-mixed, the precision EP "
    "runs in); beside the published layout pinned, pyplan's own best plan at the same GPUs and global batch, EP "
    "free (every E dividing the experts and dp), micro-batch, pipeline, schedule and ZeRO stage free"
)
# Why each published MoE run that pyplan cannot plan as it ran is left unplanned (benchmarks/_moe_runs.py).
TP_BESIDE_EP = "tensor parallelism beside expert parallelism, which pyplan's runtime refuses"
GPT_OSS_UNFOUND = (
    "pyplan plans expert parallelism at ZeRO 0 in bf16-mixed alone (fp32 weights and gradients beside Adam's moments, "
    "16 bytes a parameter: its runtime runs no master-weight precision or optimizer sharding beside EP), and so the "
    "published layout (dp 16, EP 8, PP 4, 1F1B, micro-batch 1) needs 119 GiB on its fullest stage; the page does not "
    "state the run's optimizer sharding or weight precision"
)
MOE_UNPLANNED: dict[str, str] = {
    "dgxc-deepseek-v3-h100-512": f"TP 2 {TP_BESIDE_EP}",
    "dgxc-deepseek-v3-h100-1024": f"TP 2 {TP_BESIDE_EP}",
    "dgxc-grok1-h100-512": f"TP 4 {TP_BESIDE_EP}; context parallelism 2 (tp shown as TP x CP); Grok-1 has no "
    "transformers configuration",
    "zoo-qwen3-235b-h100-cross-node-ep32": f"TP 2 {TP_BESIDE_EP}; DeepEP dispatcher",
    "zoo-qwen3-235b-h100-cross-node-ep32-overlap": f"TP 2 {TP_BESIDE_EP}; DeepEP; 1F1B A2A overlap",
    "zoo-qwen3-235b-h100-intra-node-ep8-fsdp": f"TP 2 {TP_BESIDE_EP}; DeepEP; FSDP beside EP",
    "zoo-qwen3-235b-h100-intra-node-ep8-a2a": f"TP 2 {TP_BESIDE_EP}",
    "zoo-qwen3-235b-h100-intra-node-ep8-tp4": f"TP 4 {TP_BESIDE_EP}; DeepEP",
    "bridge-gpt-oss-120b-h100-64-gbs1280": GPT_OSS_UNFOUND,
    "bridge-gpt-oss-120b-h100-64-gbs512": GPT_OSS_UNFOUND,
    "bridge-deepseek-v3-h100-1024": f"TP 2 {TP_BESIDE_EP}; precision not stated (FP8 granularity in its note)",
    "torchtitan-qwen3-30b-b200-8-deepep": "B200, outside the catalog; DeepEP; FSDP2 beside EP; torch.compile",
    "torchtitan-qwen3-30b-b200-8-default-ep": "B200, outside the catalog; layout not stated (the DeepEP row's "
    "config shown, which the README implies)",
}
MOE_REFS = {
    "DeepSeek-V3 (main model, 671B)": ("hf:deepseek_v3:seq_len=4096", 671_000_000_000),
    "Grok-1 (314B)": ("-", 314_000_000_000),
    "Qwen3-235B-A22B": ("hf:qwen3_moe:hidden_size=4096,num_hidden_layers=94,num_attention_heads=64,"
                        "num_key_value_heads=4,head_dim=128,num_experts=128,num_experts_per_tok=8,"
                        "moe_intermediate_size=1536,vocab_size=151936,seq_len=4096", 235_000_000_000),
    "Qwen3-30B-A3B": ("hf:qwen3_moe:hidden_size=2048,num_hidden_layers=48,num_attention_heads=32,"
                      "num_key_value_heads=4,head_dim=128,num_experts=128,num_experts_per_tok=8,"
                      "moe_intermediate_size=768,vocab_size=151936,seq_len=4096", 30_500_000_000),
    "gpt-oss-120b": ("hf:gpt_oss:seq_len=4096", 116_829_156_672),
}  # fmt: skip
MOE_TABLE = {"dgxc": "H100 Performance", "zoo": "H100 table", "bridge": "DGX-H100", "torchtitan": "Strong Scaling"}
MOE_SOURCE = {"dgxc": "DGXC-MOE", "zoo": "ZOO", "bridge": "BRIDGE", "torchtitan": "TT-DEEPEP"}


def moe_tokens_per_s_per_gpu(m: Any) -> float:
    """A run of benchmarks/_moe_runs.py's figure as tokens/s per GPU: stated per GPU, or the stated total over the
    GPUs, or global batch x sequence / seconds per step / GPUs."""
    if m.unit == "tokens per second per GPU":
        return m.measured
    if m.other_figures.startswith("Throughput "):
        return float(m.other_figures.split()[1]) / m.gpus
    return m.global_batch * m.sequence / m.measured / m.gpus


def _moe_unplanned(m: Any) -> Run:
    """A published MoE run that pyplan cannot plan as it ran: in table 1 with its reason, not planned."""
    ref, params = MOE_REFS[m.model.name]
    dp, mb = m.dp, m.micro_batch
    if not isinstance(dp, int):  # torchtitan's default-EP row: the DeepEP row's config, which the README implies
        dp, mb, gb, seq = 8, 8, 64, 4096
    else:
        gb, seq = m.global_batch, m.sequence
    tp = m.tp if isinstance(m.tp, int) else 1
    cp = m.cp if isinstance(m.cp, int) else 1
    gpu = "b200" if "B200" in m.gpu else "h100-sxm"
    layout = f"EP {m.ep}, TP {m.tp}, PP {m.pp}, CP {m.cp}, VP {m.vp}, ETP {m.etp}; dispatcher {m.dispatcher}"
    return Run(
        m.name, MOE_SOURCE[m.name.split("-")[0]], MOE_TABLE[m.name.split("-")[0]], m.model.name, ref, params,
        m.model.layers, m.model.hidden, gpu, m.gpus, mb, gb // (dp * mb), gb, seq, m.recomputation.split(":")[0],
        moe_tokens_per_s_per_gpu(m), zero_stage=0, dp=dp, tp=tp * cp, ep=m.ep if isinstance(m.ep, int) else 1,
        num_experts=m.model.num_experts, planned=False, excluded=MOE_UNPLANNED[m.name],
        detail=f"{m.measured:g} {m.unit} ({m.other_figures}); {layout}; {m.software}",
    )  # fmt: skip


MOE_ROWS: tuple[Run, ...] = (
    # Megatron-LM's MoE README: Mixtral 8x7B, 438 teraFLOP/s per GPU on 64 H100 (MCore v0.8), its reference
    # mapping TP 1 EP 8 PP 4 VP 8, micro-batch 1, global batch 256, sequence 4096; dp = 64 / (TP 1 x PP 4).
    Run("megatron-mixtral-8x7b-h100-64", "MCORE-MOE", "MoE README", "Mixtral 8x7B", MIXTRAL_8X7B, 46_702_792_704, 32,
        4096, "h100-sxm", 64, 1, 16, 256, 4096, "none", 438e12 / MIXTRAL_FLOPS, peak_flops=H100_BF16,
        flops_per_token=MIXTRAL_FLOPS, zero_stage=0, dp=16, ep=8, num_experts=8, schedule="Interleaved1F1B",
        chunks=8, note=MOE_NOTE,
        detail="438 teraFLOP/s per GPU; interleaved, 8 chunks a rank; "
        "recomputation not stated (planned without); dropless all-to-all dispatch, routing as trained"),
    *(_moe_unplanned(m) for m in MOE_RUNS if m.name != "megatron-mixtral-8x7b-h100-64"),
)  # fmt: skip
RUNS = (*RUNS, *MOE_ROWS)
BY_NAME = {r.name: r for r in RUNS}


def _gpu(name: str) -> Any:
    """The catalog GPU called `name`, or the record of one the catalog lacks."""
    from pyplan.hardware.catalog import get_gpu

    if name != H100_96G:
        return get_gpu(name)
    return replace(
        get_gpu("h100-sxm"),
        name=H100_96G,
        aliases=(),
        memory_bytes=96 * GiB,
        hbm_bw_bytes_per_s=2.4e12,
        tdp_w=500,
        description="NVIDIA H100 96GB HBM2e at 500 W (Grand Teton), peak FLOP/s of the SXM part",
        source="torchtitan docs/performance.md: 96GB HBM2e, 2.4 TB/s, 500 W; peak FLOP/s unknown, h100-sxm's kept",
    )


def plan_run(run: Run, zero_stage: int, *, memory_scale: float = 1.0) -> dict[str, Any]:
    """pyplan's prediction for `run`'s layout under `zero_stage`, in this process; `memory_scale` enlarges the GPU's
    memory (and nothing else) to read what the layout would need where pyplan finds that it does not fit."""
    import torch

    from pyplan import load_model, search
    from pyplan.errors import InfeasibleError, PlanError
    from pyplan.hardware import Cluster
    from pyplan.plan import Workload
    from pyplan.solve.schedules import stage_placement

    spec = load_model(run.ref)
    with torch.device("meta"):
        model = spec.build()
    gpu = _gpu(run.gpu)
    gpu = replace(gpu, memory_bytes=int(gpu.memory_bytes * memory_scale))
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),  # tied weights once
        "budget_bytes": gpu.memory_bytes * MEMORY_FRACTION,
    }
    pp = run.gpus // run.replicas // run.tp
    # A run with a published schedule is planned at its whole layout (Megatron's 32 to 3072 GPUs): the search then
    # refines that layout alone instead of every layout of the cluster.
    pins: dict[str, Any] = (
        dict(data_parallel=(run.replicas,), pipeline_ranks=(pp,), num_microbatches=(run.grad_accum,),
             schedules=run.schedules, stages_per_rank=(run.chunks,))
        if run.schedule else {}
    )  # fmt: skip
    if run.num_experts:
        pins["expert_parallel"] = (run.ep,)
    t0 = time.perf_counter()
    cluster = Cluster.from_catalog(gpu, run.gpus)
    workload = Workload(global_batch=run.global_batch, precision=run.precision)
    try:
        found = search(
            model,
            spec.example_inputs,
            cluster,
            workload,
            zero_stages=(zero_stage,),
            micro_batch_sizes=(run.micro_batch,),
            tensor_parallel=(run.tp,),
            sequence_parallel=run.sequence_parallel,
            remat=run.remat,
            top_k=TOP_K,
            allow_fewer_gpus=False,
            memory_fraction=MEMORY_FRACTION,
            loss=spec.loss,
            target=spec.target,
            **pins,
        )
    except InfeasibleError as exc:
        return {**out, "status": "infeasible", "reason": str(exc), "search_s": time.perf_counter() - t0}
    except PlanError as exc:
        return {**out, "status": "refused", "reason": str(exc), "search_s": time.perf_counter() - t0}
    out["search_s"] = time.perf_counter() - t0
    plans = [found.best, *found.alternatives]
    wanted = (run.replicas, run.tp, pp, run.micro_batch, run.grad_accum, zero_stage, run.ep)

    def layout_of(p: Any) -> tuple[int, ...]:
        lay = p.layout
        return lay.dp, lay.tp, lay.pp, lay.micro_batch_size, lay.num_microbatches, lay.zero_stage, lay.ep

    same = [p for p in plans if layout_of(p) == wanted]
    if not same:
        lay = found.best.layout
        return {
            **out,
            "status": "infeasible",
            "reason": f"the published layout is not among the {len(plans)} plans that fit; the best is dp{lay.dp} "
            f"tp{lay.tp} pp{lay.pp} b{lay.micro_batch_size}x{lay.num_microbatches} {lay.schedule} "
            f"ZeRO-{lay.zero_stage}",
        }
    # Schedules tie in one stage (GPipe keeps every micro-batch's activations there): the fastest, then the least
    # memory, as a run without pipeline stages accumulates its micro-batches one after the other.
    fastest = min(p.predicted.iteration_s for p in same)
    tied = [p for p in same if p.predicted.iteration_s <= fastest * (1 + 1e-9)]
    best = min(tied, key=lambda p: p.predicted.peak_memory_bytes)
    pred = best.predicted
    # The rank that holds the most (an interleaved rank holds several stages), and what its memory is made of.
    placement = stage_placement(best.layout.schedule, best.layout.pp, best.layout.stages_per_rank)
    ranks: dict[int, list[Any]] = {}
    for k, st in enumerate(best.stages):
        ranks.setdefault(placement[k], []).append(st)
    fullest = max(ranks.values(), key=lambda sts: sum(st.memory_bytes for st in sts))
    parts = ("state_bytes", "activation_bytes", "buffer_bytes", "unmade_grad_bytes")
    return {
        **out,
        "status": "ok",
        "schedule": best.layout.schedule,
        "stages_per_rank": best.layout.stages_per_rank,
        "iteration_s": pred.iteration_s,
        "peak_memory_bytes": pred.peak_memory_bytes,
        "exposed_comm_s": pred.exposed_comm_s,
        "recompute_s": pred.recompute_s,
        "bubble_fraction": pred.bubble_fraction,
        "optimizer_s": pred.optimizer_s,
        "host_step_s": pred.host_step_s,
        "tp_comm_s": pred.tp_comm_s,
        "fullest_rank": {k: sum(getattr(st, k) for st in fullest) for k in parts},
        "in_flight": [st.in_flight for st in fullest],
        "tokens_per_s_per_gpu": run.global_batch * run.seq_len / pred.iteration_s / run.gpus,
    }


def layout_text(lay: Any) -> str:
    """A plan's layout in one line: dp, ep, pp, micro-batch x gradient-accumulation steps, schedule, ZeRO stage."""
    chunks = f" x{lay.stages_per_rank}" if lay.stages_per_rank > 1 else ""
    return (f"dp{lay.dp} ep{lay.ep} pp{lay.pp} b{lay.micro_batch_size}x{lay.num_microbatches} "
            f"{lay.schedule}{chunks} ZeRO-{lay.zero_stage}")  # fmt: skip


def plan_free(run: Run) -> dict[str, Any]:
    """pyplan's own best plan for a mixture-of-experts run at its GPUs and global batch: tensor parallelism 1, the
    run's recomputation, expert parallelism free over `run.free_degrees`, and dp, pp, micro-batch, gradient
    accumulation, schedule and ZeRO stage free."""
    import torch

    from pyplan import load_model, search
    from pyplan.errors import InfeasibleError, PlanError
    from pyplan.hardware import Cluster
    from pyplan.plan import Workload

    spec = load_model(run.ref)
    with torch.device("meta"):
        model = spec.build()
    t0 = time.perf_counter()
    try:
        found = search(model, spec.example_inputs, Cluster.from_catalog(_gpu(run.gpu), run.gpus),
                       Workload(global_batch=run.global_batch, precision=run.precision), tensor_parallel=(1,),
                       expert_parallel=run.free_degrees, remat=run.remat, top_k=1, allow_fewer_gpus=False,
                       memory_fraction=MEMORY_FRACTION, loss=spec.loss, target=spec.target)  # fmt: skip
    except (InfeasibleError, PlanError) as exc:
        return {"status": "infeasible", "reason": str(exc), "search_s": time.perf_counter() - t0}
    pred = found.best.predicted
    return {
        "status": "ok",
        "search_s": time.perf_counter() - t0,
        "layout": layout_text(found.best.layout),
        "ep": found.best.layout.ep,
        "iteration_s": pred.iteration_s,
        "peak_memory_bytes": pred.peak_memory_bytes,
        "tokens_per_s_per_gpu": run.global_batch * run.seq_len / pred.iteration_s / run.gpus,
    }


def measure(run: Run) -> dict[str, Any]:
    """The run planned as published. Where pyplan refuses its ZeRO stage, also ZeRO-1 at the same layout as a
    stand-in; where the layout does not fit, also on a GPU with ROOMY times the memory, to read what pyplan says it
    needs. Both go to the note, never to the statistics."""
    got = plan_run(run, run.zero_stage)
    if run.num_experts:
        got["free"] = plan_free(run)
    if got["status"] == "refused" and run.zero_stage != 1 and not run.num_experts:
        got["stand_in"] = plan_run(run, 1)
    if got["status"] == "infeasible":
        got["roomy"] = plan_run(run, run.zero_stage, memory_scale=ROOMY)
    return got


class Footnotes:
    """Long texts printed once under a table, referred to by number in its cells."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"({self.texts.index(text) + 1})"

    def print(self, console: Console) -> None:
        for k, text in enumerate(self.texts, 1):
            console.print(f"({k}) {text}", markup=False)


def _published_cell(run: Run) -> str:
    cell = f"{run.tokens_per_s_per_gpu:,.0f}"
    ours = run.mfu_from_throughput()
    if run.mfu is not None and ours is not None:
        cell += f"\nMFU {run.mfu:.1%} ({ours:.1%})"
    return cell


def _config(run: Run) -> str:
    fsdp = "FSDP FULL_SHARD" if run.zero_stage == 3 else f"ZeRO-{run.zero_stage}"
    if not run.planned:
        fsdp = "sharding as published"
    tp = f" tp{run.tp}" if run.tp > 1 else ""
    tp += f" ep{run.ep}" if run.num_experts else ""
    pp = run.gpus // run.replicas // run.tp
    precision = f"\n{run.precision}" if run.precision != "bf16-mixed" else ""
    return (
        f"dp{run.replicas}{tp} pp{pp} b{run.micro_batch} GA{run.grad_accum}\n{fsdp}, AC {run.checkpointing}\n"
        f"seq {run.seq_len}, GB {run.global_batch}{precision}"
    )


def _figure(run: Run, got: dict[str, Any]) -> str:
    ratio = got["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu
    return f"{got['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (ratio {ratio:.2f}), {got['peak_memory_bytes'] / GiB:.1f} GiB"


def _note(run: Run, got: dict[str, Any] | None, notes: Footnotes) -> str:
    parts = [f"[{run.source}] {run.table}"]
    if run.note:
        parts.append(notes.mark(run.note) if run.note in SHARED_NOTES else run.note)
    if run.detail:
        parts.append(run.detail)
    if run.schedule and got is not None and got.get("status") == "ok":
        parts.append(
            f"planned {got['schedule']}" + (f", {got['stages_per_rank']} chunks" if got["stages_per_rank"] > 1 else "")
        )
    if not run.planned:
        parts.append("not planned")
    free = (got or {}).get("free")
    if free is not None:
        parts.append(free_text(run, free, notes))
    ours, theirs = run.mfu_from_throughput(), run.mfu
    if ours is not None and theirs is not None and not run.mfu_agrees():
        parts.append(f"MFU from tok/s {ours:.1%} != published {theirs:.1%}: check the transcription")
    if run.excluded:
        parts.append(f"not in statistics: {run.excluded}")
    if got is None:
        return "; ".join(parts)
    if "error" in got:
        parts.append(f"error: {got['error']}")
    elif got["status"] == "ok" and got["peak_memory_bytes"] > DEFAULT_FRACTION * got["budget_bytes"] / MEMORY_FRACTION:
        parts.append(notes.mark(f"over the {DEFAULT_FRACTION:.0%} of the GPU pyplan plans with by default"))
    elif got["status"] != "ok":
        parts.append(f"{got['status']} {notes.mark(got['reason'])}")
        stand = got.get("stand_in")
        if stand is not None:
            shown = (
                _figure(run, stand) if stand["status"] == "ok" else f"{stand['status']} {notes.mark(stand['reason'])}"
            )
            parts.append(f"ZeRO-1 stand-in, same layout: {shown}")
        roomy = got.get("roomy")
        if roomy is not None and roomy["status"] == "ok":
            parts.append(
                f"pyplan says it needs {roomy['peak_memory_bytes'] / GiB:.1f} GiB, plans with "
                f"{got['budget_bytes'] / GiB:.1f}; with the memory it would give {_figure(run, roomy)}"
            )
        elif roomy is not None:
            parts.append(f"with {ROOMY:g}x the memory: {roomy['status']} {notes.mark(roomy['reason'])}")
    if got.get("search_s", 0.0) > SLOW_SEARCH_S:
        parts.append(f"search took {got['search_s']:.0f} s (over {SLOW_SEARCH_S:.0f} s)")
    return "; ".join(parts)


def free_text(run: Run, free: dict[str, Any], notes: Footnotes) -> str:
    """The note's account of pyplan's own best plan of a mixture-of-experts run (EP free)."""
    if free["status"] != "ok":
        return f"pyplan's own plan, EP free: {free['status']} {notes.mark(free['reason'])}"
    ratio = free["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu
    return (f"pyplan's own best, EP free of {'/'.join(map(str, run.free_degrees))}: {free['layout']}, "
            f"{free['tokens_per_s_per_gpu']:,.0f} tok/s/GPU (ratio {ratio:.2f}), "
            f"{free['peak_memory_bytes'] / GiB:.1f} GiB")  # fmt: skip


def throughput_table(rows: list[tuple[Run, dict[str, Any] | None]]) -> tuple[Table, Footnotes, list[float], bool]:
    """Table 1, its footnotes, the ratios of the rows in the statistics, and whether each of those rows is feasible
    in pyplan."""
    columns = ("model", "params pyplan\n(published)", "GPUs", "parallel config",
               "published tok/s/GPU\nMFU (from tok/s)", "published\nmemory", "pyplan\ntok/s/GPU", "pyplan\nmemory",
               "ratio", "note")  # fmt: skip
    table = new_table(
        "pyplan vs published training throughput (AdamW, bf16-mixed unless the config says; analytic profile on the "
        "meta device)",
        columns,
        left=columns,
        show_lines=True,
        overflow="fold",
    )
    notes = Footnotes()
    ratios: list[float] = []
    feasible = True
    for run, got in rows:
        counted = not run.excluded
        pred = mem = ratio = "-"
        params = f"- ({run.published_params / 1e9:.3f}B)"
        if got is not None and "params" in got:
            same = "=" if got["params"] == run.published_params else f"{got['params'] / run.published_params - 1:+.2%}"
            params = f"{got['params'] / 1e9:.3f}B\n({same})"
        if got is not None and got.get("status") == "ok":
            r = got["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu
            pred = f"{got['tokens_per_s_per_gpu']:,.0f}"
            share = got["peak_memory_bytes"] / (got["budget_bytes"] / MEMORY_FRACTION)
            mem, ratio = f"{got['peak_memory_bytes'] / GiB:.1f} GiB\n{share:.0%}", f"{r:.2f}"
            if counted:
                ratios.append(r)
        elif got is not None:
            pred = "error" if "error" in got else f"{got['status']} in pyplan"
            feasible = feasible and not counted
        table.add_row(
            run.model,
            params,
            f"{run.gpus} x {run.gpu}",
            _config(run),
            _published_cell(run),
            "-" if run.memory_gib is None else f"{run.memory_gib} GiB",
            pred,
            mem,
            ratio if counted or ratio == "-" else f"({ratio})",
            _note(run, got, notes),
        )
    return table, notes, ratios, feasible


def megatron_statistics(rows: list[tuple[Run, dict[str, Any] | None]]) -> dict[str, Any]:
    """The Megatron-LM rows apart: how many were planned, the median and worst |ratio - 1| of those planned, the
    rows beyond MEGATRON_EXPLAINED (name, ratio) and the rows not planned (name, status, GiB pyplan says they need
    where a larger GPU plans them)."""
    ratios: dict[str, float] = {}
    unplanned: list[tuple[str, str, float | None]] = []
    for run, got in rows:
        if run.source not in MEGATRON_SOURCES or got is None:
            continue
        if got.get("status") == "ok":
            ratios[run.name] = got["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu
            continue
        roomy = got.get("roomy") or {}
        need = roomy["peak_memory_bytes"] / GiB if roomy.get("status") == "ok" else None
        unplanned.append((run.name, "error" if "error" in got else got["status"], need))
    errors = [abs(r - 1) for r in ratios.values()]
    return {
        "rows": len(ratios) + len(unplanned),
        "planned": len(ratios),
        "median": statistics.median(errors) if errors else None,
        "worst": max(errors) if errors else None,
        "beyond": [(name, r) for name, r in ratios.items() if abs(r - 1) > MEGATRON_EXPLAINED],
        "unplanned": unplanned,
    }


def megatron_summary(stats: dict[str, Any]) -> str:
    """`megatron_statistics` as the lines the benchmark prints."""
    median = "n/a" if stats["median"] is None else f"{stats['median']:.1%}"
    worst = "n/a" if stats["worst"] is None else f"{stats['worst']:.1%}"
    met = stats["median"] is not None and stats["median"] <= MEGATRON_MEDIAN
    lines = [
        f"Megatron-LM rows ({', '.join(MEGATRON_SOURCES)}): {stats['planned']} of {stats['rows']} planned at their "
        f"published layout; median |predicted/published - 1| = {median} (target <= {MEGATRON_MEDIAN:.0%}): "
        f"{verdict(met)}; worst {worst}",
        f"  beyond {MEGATRON_EXPLAINED:.0%} (accounted for in PUBLISHED.md): "
        + (", ".join(f"{name} {r:.2f}" for name, r in stats["beyond"]) or "none"),
        "  not planned: "
        + (
            ", ".join(
                f"{name} ({status}" + ("" if need is None else f", needs {need:.1f} GiB") + ")"
                for name, status, need in stats["unplanned"]
            )
            or "none"
        ),
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class StateCase:
    """A model for the model-state table: its parameter count and largest layer as DeepSpeed counts them."""

    name: str
    params: int
    largest_layer: int | None  # None: the source gives no architecture
    source: str


def state_case(name: str, label: str) -> StateCase:
    """A configuration of benchmarks/real_models.py built on the meta device, counted as DeepSpeed's model_to_params
    counts: shared parameters once, the largest layer the most parameters one module holds itself."""
    import torch

    from pyplan import load_model

    with torch.device("meta"):
        model = load_model(CASE[name].ref).build()
    params = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return StateCase(label, params, largest, CASE[name].source)


def deepspeed_bytes(params: int, largest: int | None, gpus: int, stage: int) -> float | None:
    """DeepSpeed's estimate without offload (estimate_zero2_model_states_mem_needs: 2Ψ + 18Ψ/N;
    estimate_zero3_model_states_mem_needs: 4·largest layer + 18Ψ/N); DeepSpeed has none for ZeRO-1."""
    if stage == 2:
        return 2 * params + int(18 * params / gpus)
    if stage == 3:
        return 4 * (largest or 0) + int(18 * params / gpus)
    return None


# DeepSpeed's bytes per parameter as (weights, gradients, optimizer) passed through pyplan's sharding function.
# ZeRO-2 (stage_1_and_2.py's comment): 2 fp16 weights unsharded; 18 = 2 fp16 + 4 fp32 gradients + 4 fp32 weights
# + 8 Adam moments, sharded. ZeRO-3 (stage3.py): 18 per parameter, all sharded, with no split given: the split below
# is ours and does not matter, every term being divided by N.
DS_BYTES = {2: (2.0, 6.0, 12.0), 3: (2.0, 4.0, 12.0)}
ZERO_PAPER_FIG1 = {1: 31.4e9, 2: 16.6e9, 3: 1.9e9}  # Ψ = 7.5e9, N = 64, GB (Rajbhandari et al. 2020, Figure 1)


def state_table() -> tuple[Table, Footnotes, list[dict[str, Any]], bool]:
    """Table 2, its footnotes, its rows, and whether pyplan fed DeepSpeed's bytes per parameter agrees with
    DeepSpeed within 1 % (the largest-layer term aside)."""
    from pyplan import _core
    from pyplan.errors import PlanError
    from pyplan.model_state import model_state_bytes
    from pyplan.plan import Workload

    workload = Workload(global_batch=1, precision="bf16-mixed")
    per = model_state_bytes(1, 0, optimizer=workload.optimizer, precision=workload.precision)
    p, g, k = per.param_bytes, per.grad_bytes, per.optimizer_bytes
    ours = {1: f"{p + g} + {k}/N", 2: f"{p} + {g + k}/N", 3: f"{p + g + k}/N"}
    theirs = {1: "-", 2: "2 + 18/N", 3: "18/N + 4·L/Ψ"}
    cases = (
        state_case("gpt2-xl", "GPT-2 XL 1.5B"),
        state_case("llama-2-7b", "Llama 2 7B (6.7B)"),
        StateCase("ZeRO Fig. 1 7.5B", 7_500_000_000, None, "Rajbhandari et al. 2020, Figure 1 (no architecture)"),
    )
    columns = ("model Ψ (L)", "N", "ZeRO", "pyplan\nB/param", "pyplan\nGB", "DeepSpeed\nB/param",
               "DeepSpeed\nGB", "pyplan\n/ DS", "pyplan fed\nDS B/param GB", "same conv.\nratio",
               "DS largest-\nlayer GB", "check w/o the\nterm (1 %)", "note")  # fmt: skip
    table = new_table(
        f"Model-state bytes per GPU, GB = 1e9 B (pyplan: bf16 mixed AdamW, {p}+{g}+{k} B/param; DeepSpeed's "
        "estimators without offload; Ψ parameters, N GPUs, L the largest layer's parameters)",
        columns,
        left=columns,
        overflow="fold",
    )
    notes = Footnotes()
    rows: list[dict[str, Any]] = []
    ok = True
    for case in cases:
        for gpus in (8, 64):
            for stage in (1, 2, 3):
                note = []
                try:
                    mine: float | None = workload.state_bytes_per_gpu(case.params, gpus, stage)
                except PlanError as exc:
                    mine = None
                    note.append(f"pyplan refuses {notes.mark(str(exc))}")
                ds = deepspeed_bytes(case.params, case.largest_layer, gpus, stage)
                term = 4.0 * (case.largest_layer or 0) if stage == 3 else 0.0
                on_ds = None
                check = "-"
                if stage in DS_BYTES:
                    bp, bg, bo = DS_BYTES[stage]
                    on_ds = _core.zero_model_state_bytes(
                        case.params, gpus, stage, param_bytes=bp, grad_bytes=bg, optim_bytes=bo
                    ).total_bytes
                if ds is not None and on_ds is not None:
                    good = abs(on_ds / (ds - term) - 1) <= 0.01
                    ok = ok and good
                    check = f"{on_ds / (ds - term):.4f} {'ok' if good else 'FAIL'}"
                note.append(
                    notes.mark(
                        {
                            1: "DeepSpeed ships no ZeRO-1 estimator (stage_1_and_2.py has estimate_zero2_* only).",
                            2: "DeepSpeed counts fp32 gradients beside the 16-bit ones: 2 B unsharded + 18 B sharded "
                            "(2 fp16 grads + 4 fp32 grads + 4 fp32 weights + 8 Adam moments) = 20 B, pyplan 16 B "
                            "(autocast: 4 + 4 + 8). pyplan plans no ZeRO-2 (its runtime would run it as ZeRO-1).",
                            3: "DeepSpeed: 18 B/param sharded (the total only, no split given) + 4 B per parameter "
                            "of the largest layer. pyplan's column is the sharded state; its plans add the units "
                            "FSDP2 holds gathered (pyplan/runtime/sharded.py, gathered_bytes: the root's weights and "
                            "gradients, the largest layer's weights twice with its gradients).",
                        }[stage]
                    )
                )
                if stage == 3 and case.largest_layer is None:
                    note.append("no L: the source gives no architecture")
                if case.largest_layer is None and gpus == 64:
                    note.append(f"ZeRO paper {ZERO_PAPER_FIG1[stage] / 1e9:.1f} GB")
                rows.append({"model": case.name, "params": case.params, "largest_layer": case.largest_layer,
                             "gpus": gpus, "zero_stage": stage, "pyplan_bytes": mine, "deepspeed_bytes": ds,
                             "pyplan_on_deepspeed_bytes": on_ds, "largest_layer_term_bytes": term})  # fmt: skip
                largest = "-" if case.largest_layer is None else f"{case.largest_layer / 1e6:.1f}M"
                table.add_row(
                    f"{case.name}: {case.params / 1e9:.3f}B, L {largest}",
                    str(gpus),
                    str(stage),
                    ours[stage],
                    "-" if mine is None else f"{mine / 1e9:.2f}",
                    theirs[stage],
                    "-" if ds is None else f"{ds / 1e9:.2f}",
                    "-" if ds is None or mine is None else f"{mine / ds:.3f}",
                    "-" if on_ds is None else f"{on_ds / 1e9:.2f}",
                    "-" if on_ds is None or ds is None else f"{on_ds / ds:.3f}",
                    f"{term / 1e9:.2f}" if stage == 3 else "-",
                    check,
                    "; ".join(note),
                )
    return table, notes, rows, ok


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--cases", nargs="+", choices=list(BY_NAME), metavar="NAME",
                        help=f"runs to plan (default: all): {', '.join(BY_NAME)}")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write every row here")
    parser.add_argument("--one", choices=list(BY_NAME), help=argparse.SUPPRESS)  # one run, in this process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(BY_NAME[args.one])))
        return 0
    t_start = time.perf_counter()
    rows: list[tuple[Run, dict[str, Any] | None]] = []
    for run in RUNS:
        if args.cases and run.name not in args.cases:
            continue
        if not run.planned:
            rows.append((run, None))
            continue
        t0 = time.perf_counter()
        done = run_child(__file__, "--one", run.name, timeout_s=1800)
        if done.returncode != 0:
            got = {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
        else:
            got = last_json(done.stdout)
        got["wall_s"] = time.perf_counter() - t0
        rows.append((run, got))
        print(f"{run.name}: {got.get('status', 'error')} in {got['wall_s']:.0f} s", file=sys.stderr)
    console = Console(width=200, emoji=False)
    table, notes, ratios, feasible = throughput_table(rows)
    console.print(table)
    notes.print(console)
    for key, text in SOURCES.items():
        if any(run.source == key for run, _ in rows):
            console.print(f"[{key}] {text}", markup=False)
    errors = [abs(r - 1) for r in ratios]
    median = statistics.median(errors) if errors else None
    worst = max(errors) if errors else None
    print(f"statistics over {len(errors)} rows (excluded rows and rows pyplan could not plan are left out):")
    for what, value, target in (("median", median, TARGET_MEDIAN), ("worst", worst, TARGET_WORST)):
        shown = "n/a" if value is None else f"{value:.1%}"
        met = value is not None and value <= target
        print(f"  {what} |predicted/published - 1| = {shown} (target <= {target:.0%}): {verdict(met)}")
    print(f"  every published configuration feasible in pyplan: {verdict(feasible)}")
    megatron = megatron_statistics(rows)
    if megatron["rows"]:
        print(megatron_summary(megatron))
    state, state_notes, state_rows, state_ok = state_table()
    console.print(state)
    state_notes.print(console)
    print(
        "sources: deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py (at 7dee2e06) "
        "estimate_zero2_model_states_mem_needs, deepspeed/runtime/zero/stage3.py (at 007cca6a) "
        "estimate_zero3_model_states_mem_needs; Rajbhandari et al. 2020, ZeRO, Figure 1"
    )
    print(f"pyplan on DeepSpeed's bytes per parameter within 1 % (largest-layer term aside): {verdict(state_ok)}")
    print(f"run time {time.perf_counter() - t_start:.0f} s")
    if args.json:
        write_json(
            args.json,
            {
                "throughput": [{"run": asdict(run), "pyplan": got} for run, got in rows],
                "statistics": {"median": median, "worst": worst, "feasible": feasible, "rows": len(errors)},
                "megatron_statistics": megatron,
                "model_state": state_rows,
            },
            indent=1,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
