"""Published, measured mixture-of-experts training throughput, with the layouts the runs used: data for a benchmark.

Every figure is copied from the source its `citation` names (a file at a commit, or a tag); a field the source does
not state is NOT_STATED, never filled in. Arithmetic on stated figures (dp as GPUs / (TP·PP·CP)) is marked in the
run's note. Model shapes cite their own configuration files. The runs:

- NVIDIA DGX Cloud Benchmarking (NVIDIA/dgxc-benchmarking, tag v25.05.05): DeepSeek-V3 on 512 and 1024 H100s and
  Grok-1 on 512 H100s in BF16, NeMo 25.04 containers, seconds per step with TFLOPS or throughput;
- Megatron-LM's MoE README (MCore v0.8): Mixtral 8x7B in BF16 on 64 H100s, 438 TFLOPS a GPU;
- Megatron-MoE-ModelZoo (the model zoo Megatron-LM's README points to): Qwen3-235B-A22B in BF16 on 256 H100s under
  five layouts, with the all-to-all and DeepEP dispatchers;
- Megatron-Bridge's performance summary (NeMo 25.09, 25.11, 26.04.01 containers): GPT-OSS 120B in BF16 and
  DeepSeek-V3 on DGX-H100, tokens/s and model TFLOP/s per GPU, force-balanced routing;
- torchtitan's DeepEP README: Qwen3-30B-A3B on one node of 8 B200s, with DeepEP and with torchtitan's default
  all-to-all expert parallelism.

Layout names follow the sources: EP the expert-parallel degree, ETP the experts' own tensor parallelism, VP the
virtual pipeline stages per rank (interleaving), CP context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MOE_RUNS", "NOT_STATED", "MoeModel", "MoeRun"]

NOT_STATED = "not stated"


@dataclass(frozen=True)
class MoeModel:
    """The shape of an MoE transformer: `layers` blocks of which `moe_layers` replace the FFN by `num_experts`
    routed experts of `expert_intermediate` (top `top_k` a token) and `shared_experts` shared ones of the same size;
    the others keep a dense FFN of `dense_intermediate`. `gated`: three matrices an FFN (SwiGLU-like), else two."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    attention: str
    vocab: int | str
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_experts: int
    dense_intermediate: int | None
    gated: bool
    source: str


@dataclass(frozen=True)
class MoeRun:
    """One published run: the model, the machines, the layout, and the measured figure in `unit` (`other_figures`
    holds the rest of the row, verbatim)."""

    name: str
    model: MoeModel
    gpus: int
    gpu: str
    network: str
    dp: int | str
    tp: int | str
    pp: int | str
    ep: int | str
    cp: int | str
    etp: int | str
    vp: int | str
    micro_batch: int | str
    global_batch: int | str
    sequence: int | str
    precision: str
    recomputation: str
    sharding: str
    dispatcher: str
    routing: str
    measured: float
    unit: str
    other_figures: str
    software: str
    citation: str
    note: str = ""


# --- Models -------------------------------------------------------------------------------------------------------

DEEPSEEK_V3 = MoeModel(
    name="DeepSeek-V3 (main model, 671B)",
    layers=61,
    moe_layers=58,
    hidden=7168,
    attention="MLA: 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, "
    "v_head_dim 128",
    vocab=129280,
    num_experts=256,
    top_k=8,
    expert_intermediate=2048,
    shared_experts=1,
    dense_intermediate=18432,
    gated=True,
    source="deepseek-ai/DeepSeek-V3 inference/configs/config_671B.json at 9b4e9788e4a3a731f7567338ed15d3ec549ce03b "
    "(n_layers 61, n_dense_layers 3, inter_dim 18432, moe_inter_dim 2048, n_routed_experts 256, n_shared_experts 1, "
    "n_activated_experts 8); SwiGLU experts (inference/model.py, Expert: w1, w2, w3)",
)

GROK_1 = MoeModel(
    name="Grok-1 (314B)",
    layers=64,
    moe_layers=64,
    hidden=6144,
    attention="48 query heads, 8 key-value heads, key_size 128",
    vocab=131072,
    num_experts=8,
    top_k=2,
    expert_intermediate=32768,
    shared_experts=0,
    dense_intermediate=None,
    gated=True,
    source="xai-org/grok-1 run.py at 7050ed204b8206bb8645c7b7bbef7252f79561b0 (vocab_size 128 * 1024, emb_size "
    "48 * 128, widening_factor 8, key_size 128, num_q_heads 48, num_kv_heads 8, num_layers 64, num_experts 8, "
    "num_selected_experts 2); model.py `ffn_size`: int(8 * 6144) * 2 // 3 = 32768, a multiple of 8; gated GELU "
    "(linear_v, linear, linear_1)",
)

MIXTRAL_8X7B = MoeModel(
    name="Mixtral 8x7B",
    layers=32,
    moe_layers=32,
    hidden=4096,
    attention="32 heads, 8 key-value heads, head_dim 128",
    vocab=32000,
    num_experts=8,
    top_k=2,
    expert_intermediate=14336,
    shared_experts=0,
    dense_intermediate=None,
    gated=True,
    source="arXiv:2401.04088 Table 1 (dim 4096, n_layers 32, head_dim 128, hidden_dim 14336, n_heads 32, "
    "n_kv_heads 8, vocab_size 32000, num_experts 8, top_k_experts 2); SwiGLU experts (§2.1)",
)

QWEN3_235B_A22B = MoeModel(
    name="Qwen3-235B-A22B",
    layers=94,
    moe_layers=94,
    hidden=4096,
    attention="64 heads, 4 key-value heads, head_dim 128, QK-norm",
    vocab=151936,
    num_experts=128,
    top_k=8,
    expert_intermediate=1536,
    shared_experts=0,
    dense_intermediate=None,
    gated=True,
    source="pytorch/torchtitan torchtitan/models/qwen3/__init__.py flavor '235B-A22B' at "
    "2a642d022de2eb0e63be4ddd4d95619c3da0b518; the same shape in yanring/Megatron-MoE-ModelZoo "
    "model_configs/benchmarking/Qwen3-235B-A22B.yaml at e8650517d60d71ab73fc6b3b0388cac4ba435181 (--num-layers 94, "
    "--hidden-size 4096, --num-attention-heads 64, --num-query-groups 4, --kv-channels 128, --num-experts 128, "
    "--moe-ffn-hidden-size 1536, --moe-router-topk 8, --swiglu)",
)

QWEN3_30B_A3B = MoeModel(
    name="Qwen3-30B-A3B",
    layers=48,
    moe_layers=48,
    hidden=2048,
    attention="32 heads, 4 key-value heads, head_dim 128, QK-norm",
    vocab=151936,
    num_experts=128,
    top_k=8,
    expert_intermediate=768,
    shared_experts=0,
    dense_intermediate=None,
    gated=True,
    source="pytorch/torchtitan torchtitan/models/qwen3/__init__.py flavor '30B-A3B-deepep' at "
    "2a642d022de2eb0e63be4ddd4d95619c3da0b518 (vocab_size 151936, dim 2048, n_layers 48, n_heads 32, n_kv_heads 4, "
    "moe_inter_dim 768, num_experts 128, num_shared_experts 0, top_k 8)",
)

GPT_OSS_120B = MoeModel(
    name="gpt-oss-120b",
    layers=36,
    moe_layers=36,
    hidden=2880,
    attention="64 heads, 8 key-value heads, head_dim 64; sliding window of 128 on every other layer",
    vocab=201088,
    num_experts=128,
    top_k=4,
    expert_intermediate=2880,
    shared_experts=0,
    dense_intermediate=None,
    gated=True,
    source="openai/gpt-oss gpt_oss/torch/model.py `ModelConfig` defaults at 7b583341fe16729127f6d5b94a7b09ccae97e1a1 "
    "(num_hidden_layers 36, num_experts 128, experts_per_token 4, vocab_size 201088, hidden_size 2880, "
    "intermediate_size 2880, head_dim 64, num_attention_heads 64, num_key_value_heads 8, sliding_window 128)",
)

# --- Sources ------------------------------------------------------------------------------------------------------

_DGXC = "NVIDIA/dgxc-benchmarking tag v25.05.05 (commit c5c765f2684f983e787eaada4073b63c8287caf6)"
_DGXC_DEEPSEEK = (
    f"{_DGXC}, deepseek_v3/pretraining/README.md, tables 'H100s specifications' and 'H100 Performance'; "
    "launch.sh (H100: RM='mla_up_proj', FW_VERSION=25.04.01, GBS = 8 x GPUs)"
)
_MEGATRON_MOE = (
    "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md at 0b981f9c53059a21f868aa71ecc2868251aea5d0: first "
    "paragraph ('boosts Mixtral 8X7B bf16 training to achieve **438 TFLOPS** as of MCore v0.8') and 'Reference Best "
    "Parallel Mapping' with its 'Detailed Benchmark Information'"
)
_ZOO = (
    "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md at e8650517d60d71ab73fc6b3b0388cac4ba435181, "
    "'Performance Results' / 'H100' table"
)
_BRIDGE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md at 4ab94dfad36641cabdeb96452b21bf676aac4772"
_TORCHTITAN_DEEPEP = (
    "pytorch/torchtitan torchtitan/distributed/deepep/README.md at 2a642d022de2eb0e63be4ddd4d95619c3da0b518"
)
_TORCHTITAN_CONFIG = (
    "torchtitan/models/qwen3/train_configs/qwen3_30b_a3b_with_deepep.toml at the same commit (the README's Quick "
    "Start config; the table does not name its config): local_batch_size 8, seq_len 4096, data_parallel_shard_degree "
    "-1, tensor_parallel_degree 1, context_parallel_degree 1, expert_parallel_degree 8, activation_checkpoint mode "
    "'full', compile ['model', 'loss'], moe_force_load_balance = true"
)
_ZOO_NETWORK = "8 GPUs a node; NVLink 4th Generation; InfiniBand 8x50 GB/s"
_ZOO_NOTE = "dp is the table's DP column; EDP (expert data parallelism) {edp}; Notes column: '{notes}'; code {code}"


def _zoo_run(
    name: str,
    *,
    dispatcher: str,
    tp: int,
    ep: int,
    pp: int,
    edp: int,
    vp: int,
    dp: int,
    fsdp: str,
    micro_batch: int,
    ga: int,
    recompute: str,
    step_s: float,
    tflops: int,
    notes: str,
    code: str,
) -> MoeRun:
    """A row of the Megatron-MoE-ModelZoo Qwen3-235B-A22B H100 table (256 GPUs, sequence 4096, GBS 2048, CP 1,
    ETP 1, BF16)."""
    return MoeRun(
        name=name,
        model=QWEN3_235B_A22B,
        gpus=256,
        gpu="H100",
        network=_ZOO_NETWORK,
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        cp=1,
        etp=1,
        vp=vp,
        micro_batch=micro_batch,
        global_batch=2048,
        sequence=4096,
        precision="BF16",
        recomputation=recompute or "none (the recompute column is empty)",
        sharding=f"FSDP {fsdp}",
        dispatcher=dispatcher,
        routing=NOT_STATED,
        measured=step_s,
        unit="s per step",
        other_figures=f"GA {ga}; Per GPU TF {tflops}",
        software=f"Megatron-Core {code}",
        citation=_ZOO,
        note=_ZOO_NOTE.format(edp=edp, notes=notes, code=code),
    )


MOE_RUNS: list[MoeRun] = [
    MoeRun(
        name="dgxc-deepseek-v3-h100-512",
        model=DEEPSEEK_V3,
        gpus=512,
        gpu="H100 (at least 80GB)",
        network=NOT_STATED,
        dp=32,
        tp=2,
        pp=8,
        ep=64,
        cp=1,
        etp=1,
        vp=1,
        micro_batch=1,
        global_batch=4096,
        sequence=4096,
        precision="BF16",
        recomputation="selective: --recompute_modules mla_up_proj (launch.sh)",
        sharding=NOT_STATED,
        dispatcher=NOT_STATED,
        routing=NOT_STATED,
        measured=48.948,
        unit="s per step",
        other_figures="Throughput 342755.90 tokens per second; TFLOPS_per_GPU 174.02; Model flops utilization 17.60%",
        software="NeMo 25.04.01 container (launch.sh FW_VERSION)",
        citation=_DGXC_DEEPSEEK,
        note="GA 128 as stated; whether the MTP module was trained is not stated",
    ),
    MoeRun(
        name="dgxc-deepseek-v3-h100-1024",
        model=DEEPSEEK_V3,
        gpus=1024,
        gpu="H100 (at least 80GB)",
        network=NOT_STATED,
        dp=32,
        tp=2,
        pp=16,
        ep=64,
        cp=1,
        etp=1,
        vp=1,
        micro_batch=1,
        global_batch=8192,
        sequence=4096,
        precision="BF16",
        recomputation="selective: --recompute_modules mla_up_proj (launch.sh)",
        sharding=NOT_STATED,
        dispatcher=NOT_STATED,
        routing=NOT_STATED,
        measured=52.04,
        unit="s per step",
        other_figures="Throughput 644781.55 tokens per second; TFLOPS_per_GPU 163.7; Model flops utilization 16.55%",
        software="NeMo 25.04.01 container (launch.sh FW_VERSION)",
        citation=_DGXC_DEEPSEEK,
        note="GA 256 as stated; whether the MTP module was trained is not stated",
    ),
    MoeRun(
        name="dgxc-grok1-h100-512",
        model=GROK_1,
        gpus=512,
        gpu="H100 (at least 80 GB)",
        network=NOT_STATED,
        dp=8,
        tp=4,
        pp=8,
        ep=8,
        cp=2,
        etp=1,
        vp=8,
        micro_batch=1,
        global_batch=1024,
        sequence=8192,
        precision="BF16",
        recomputation=NOT_STATED,
        sharding=NOT_STATED,
        dispatcher=NOT_STATED,
        routing=NOT_STATED,
        measured=15.933,
        unit="s per step",
        other_figures="Throughput 526493 tokens per second; Model flops utilization 54.2%",
        software="NeMo 25.04.00 container (grok1/launch.sh FW_VERSION)",
        citation=f"{_DGXC}, grok1/README.md, table 'H100' and 'H100 Performance' (Grok1 314b BF16)",
        note="GA 128 as stated; context parallelism 2, which pyplan does not model",
    ),
    MoeRun(
        name="megatron-mixtral-8x7b-h100-64",
        model=MIXTRAL_8X7B,
        gpus=64,
        gpu="H100 80GB HBM3",
        network="8xH100 a server; NVLink 4th Generation; InfiniBand 8x400 Gbit/s",
        dp=16,
        tp=1,
        pp=4,
        ep=8,
        cp=NOT_STATED,
        etp=NOT_STATED,
        vp=8,
        micro_batch=1,
        global_batch=256,
        sequence=4096,
        precision="BF16",
        recomputation=NOT_STATED,
        sharding=NOT_STATED,
        dispatcher="All-to-All",
        routing="dropless",
        measured=438.0,
        unit="TFLOPS per GPU",
        other_figures="none",
        software="Megatron-Core v0.8; PyTorch 24.04 container with TransformerEngine v1.9",
        citation=_MEGATRON_MOE,
        note="the README gives the 438 TFLOPS in its first paragraph and the layout as MCore v0.8's reference mapping "
        "for Mixtral 8x7B, without saying in so many words that the figure was measured on that mapping; dp is "
        "64 / (TP 1 x PP 4), assuming no context parallelism",
    ),
    _zoo_run(
        "zoo-qwen3-235b-h100-cross-node-ep32",
        dispatcher="DeepEP",
        tp=2,
        ep=32,
        pp=8,
        edp=1,
        vp=4,
        dp=16,
        fsdp="/",
        micro_batch=1,
        ga=128,
        recompute="norm, act",
        step_s=19.7,
        tflops=245,
        notes="",
        code="moe_dev(f3e6c5)",
    ),
    _zoo_run(
        "zoo-qwen3-235b-h100-cross-node-ep32-overlap",
        dispatcher="DeepEP",
        tp=2,
        ep=32,
        pp=8,
        edp=1,
        vp=4,
        dp=16,
        fsdp="/",
        micro_batch=1,
        ga=128,
        recompute="norm, act",
        step_s=17.6,
        tflops=276,
        notes="+1f1b overlap",
        code="moe_dev(f3e6c5)",
    ),
    _zoo_run(
        "zoo-qwen3-235b-h100-intra-node-ep8-fsdp",
        dispatcher="DeepEP",
        tp=2,
        ep=8,
        pp=1,
        edp=32,
        vp=1,
        dp=128,
        fsdp="On",
        micro_batch=4,
        ga=4,
        recompute="full",
        step_s=17.6,
        tflops=276,
        notes="disable log para norm",
        code="main(1e057005)",
    ),
    _zoo_run(
        "zoo-qwen3-235b-h100-intra-node-ep8-a2a",
        dispatcher="A2A",
        tp=2,
        ep=8,
        pp=32,
        edp=1,
        vp=3,
        dp=4,
        fsdp="/",
        micro_batch=1,
        ga=512,
        recompute="norm, act",
        step_s=24.2,
        tflops=200,
        notes="",
        code="main(1e057005)",
    ),
    _zoo_run(
        "zoo-qwen3-235b-h100-intra-node-ep8-tp4",
        dispatcher="DeepEP",
        tp=4,
        ep=8,
        pp=8,
        edp=4,
        vp=4,
        dp=8,
        fsdp="/",
        micro_batch=1,
        ga=256,
        recompute="",
        step_s=29.0,
        tflops=167,
        notes="",
        code="main(1e057005)",
    ),
    MoeRun(
        name="bridge-gpt-oss-120b-h100-64-gbs1280",
        model=GPT_OSS_120B,
        gpus=64,
        gpu="DGX-H100",
        network=NOT_STATED,
        dp=16,
        tp=1,
        pp=4,
        ep=8,
        cp=1,
        etp=NOT_STATED,
        vp="n/a",
        micro_batch=1,
        global_batch=1280,
        sequence=4096,
        precision="BF16",
        recomputation=NOT_STATED,
        sharding="FSDP 0 (DDP, per the page's nomenclature)",
        dispatcher=NOT_STATED,
        routing="force-balanced, token-dropless (the page's footnote on MoE benchmarks)",
        measured=5824.0,
        unit="tokens per second per GPU",
        other_figures="Model TFLOP / sec / GPU 158",
        software="NeMo 26.04.01 container (Megatron-Bridge performance recipes)",
        citation=f"{_BRIDGE}, '26.04.01 NeMo Container' / 'Model: GPT OSS 120B', row DGX-H100",
        note="dp is 64 / (TP 1 x PP 4 x CP 1)",
    ),
    MoeRun(
        name="bridge-gpt-oss-120b-h100-64-gbs512",
        model=GPT_OSS_120B,
        gpus=64,
        gpu="DGX-H100",
        network=NOT_STATED,
        dp=16,
        tp=1,
        pp=4,
        ep=8,
        cp=1,
        etp=NOT_STATED,
        vp=1,
        micro_batch=4,
        global_batch=512,
        sequence=4096,
        precision="BF16",
        recomputation=NOT_STATED,
        sharding="FSDP 0 (DDP, per the page's nomenclature)",
        dispatcher=NOT_STATED,
        routing="force-balanced, token-dropless (the section's note)",
        measured=5630.0,
        unit="tokens per second per GPU",
        other_figures="GA 2; Model TFLOP / sec / GPU 153",
        software="NeMo 25.11 container (Megatron-Bridge performance recipes)",
        citation=f"{_BRIDGE}, '25.11 NeMo Container' / 'System: DGX-H100', row GPT OSS 120B",
        note="dp is 64 / (TP 1 x PP 4 x CP 1) = 16, which does not fit the stated GA 2: 512 / (16 x 4) = 8, and GA 2 "
        "would need dp 64 (no pipeline); the source does not resolve which",
    ),
    MoeRun(
        name="bridge-deepseek-v3-h100-1024",
        model=DEEPSEEK_V3,
        gpus=1024,
        gpu="DGX-H100",
        network=NOT_STATED,
        dp=64,
        tp=2,
        pp=8,
        ep=64,
        cp=1,
        etp=NOT_STATED,
        vp=4,
        micro_batch=1,
        global_batch=8192,
        sequence=4096,
        precision=NOT_STATED,
        recomputation=NOT_STATED,
        sharding="FSDP 0 (DDP, per the page's nomenclature)",
        dispatcher=NOT_STATED,
        routing="dropless, force-balanced (the row's name and the section's note)",
        measured=1297.0,
        unit="tokens per second per GPU",
        other_figures="GA 128; Model TFLOP / sec / GPU 338 (330)",
        software="NeMo 25.09 container (Megatron-Bridge performance recipes)",
        citation=f"{_BRIDGE}, '25.09 NeMo Container' / 'System: DGX-H100', row 'DeepSeekV3 (dropless)'",
        note="the section's table has no precision column; its note says the figure in parentheses uses DeepSeek-V3's "
        "FP8 quantization granularity (128x128 weights, 1x128 activations). dp is 1024 / (TP 2 x PP 8 x CP 1), "
        "consistent with GA 128 = 8192 / 64",
    ),
    MoeRun(
        name="torchtitan-qwen3-30b-b200-8-deepep",
        model=QWEN3_30B_A3B,
        gpus=8,
        gpu="NVIDIA B200 (Blackwell)",
        network="one node",
        dp=8,
        tp=1,
        pp=1,
        ep=8,
        cp=1,
        etp=NOT_STATED,
        vp=NOT_STATED,
        micro_batch=8,
        global_batch=64,
        sequence=4096,
        precision=NOT_STATED,
        recomputation="full (config)",
        sharding="FSDP2 over the 8 GPUs (data_parallel_shard_degree -1, config)",
        dispatcher="DeepEP",
        routing="forced balance (moe_force_load_balance = true, config)",
        measured=14796.0,
        unit="tokens per second per GPU",
        other_figures="TFLOPS 341; Memory/GPU 167.93 GiB (94.15%)",
        software="PyTorch 2.9.0+cu128, Triton 3.5.0, CUDA 12.8 ('For Debugging Purposes')",
        citation=f"{_TORCHTITAN_DEEPEP}, 'Strong Scaling' table, row '1 node'; {_TORCHTITAN_CONFIG}",
        note="the first line states the figure per GPU ('14,796 vs 9,930 tok/s/GPU at EP=8'); micro-batch, global "
        "batch (8 x 8), sharding, recomputation and routing are the Quick Start config's, which the table does not "
        "name",
    ),
    MoeRun(
        name="torchtitan-qwen3-30b-b200-8-default-ep",
        model=QWEN3_30B_A3B,
        gpus=8,
        gpu="NVIDIA B200 (Blackwell)",
        network="one node",
        dp=NOT_STATED,
        tp=NOT_STATED,
        pp=NOT_STATED,
        ep=8,
        cp=NOT_STATED,
        etp=NOT_STATED,
        vp=NOT_STATED,
        micro_batch=NOT_STATED,
        global_batch=NOT_STATED,
        sequence=NOT_STATED,
        precision=NOT_STATED,
        recomputation=NOT_STATED,
        sharding=NOT_STATED,
        dispatcher="torchtitan's default expert parallelism (all-to-all)",
        routing=NOT_STATED,
        measured=9930.0,
        unit="tokens per second per GPU",
        other_figures="none",
        software=NOT_STATED,
        citation=f"{_TORCHTITAN_DEEPEP}, first paragraph ('33% faster than TorchTitan's default expert "
        "parallelism (14,796 vs 9,930 tok/s/GPU at EP=8)')",
        note="the comparison implies the DeepEP run's setup with the default dispatcher, but the README does not "
        "state it",
    ),
]
