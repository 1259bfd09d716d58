"""pyplan's plan search next to Galvatron's search engine, on Galvatron's own profiles; prints a table.

Run: `python benchmarks/galvatron.py --galvatron DIR` (DIR: a checkout of PKU-DAIR/Hetu-Galvatron; needs scipy,
pydantic, pyyaml, pybind11 and a C++ compiler for Galvatron's DP core; about 3 minutes for 8 GPUs and longer for
16 on 2 cores). Sources, conversions and a recorded run: benchmarks/GALVATRON.md.

What it measures, for 8 GPUs (one node) and 16 (two nodes of 8), global batch 8 per GPU:
- Galvatron's search (`GalvatronSearchEngine.parallelism_optimization`, its full space: data parallelism with
  ZeRO-2 or ZeRO-3 per layer, tensor and Ulysses sequence parallelism, pipeline parallelism, checkpointing per
  layer, every number of micro-batches) on the profiles it ships for its GPT model family (Llama-2-7B, sequence
  2048, bf16) and its hardware profiles, in a child process; wall-clock and CPU seconds, its plan and its own
  prediction of the plan's iteration time and memory.
- pyplan's C++ search (`pyplan._core.search`) on the same figures converted to its chain (embedding, 32 layers,
  LM head), once per tensor-parallel degree t in 1, 2, 4, 8 on the chain one tensor-parallel rank runs and the
  N/t groups of t GPUs (as `pyplan.search(tensor_parallel=...)` drives it), each with every schedule and the ZeRO
  stages pyplan plans there (t = 1: 0, 1, and 3 with one stage; beside tensor parallelism 0), with no
  recomputation and with every layer recomputed; the best plan, and the wall-clock of all the searches together
  (median of 3).
- Galvatron's plan priced in pyplan's model: the core pinned to its dp, pp, micro-batch size, micro-batches, degree,
  stage boundaries and 1F1B (its pipedream_flush), its checkpointed layers recomputed block by block, the ZeRO
  stage of most of its layers (the core's ZeRO-2 for Galvatron's default, though pyplan's search leaves ZeRO-2
  out); the ratio of that time to pyplan's best. `--reuse` takes Galvatron's side from an earlier `--json`.

The benchmark imports no Galvatron module itself: the parent reads Galvatron's JSON and YAML files, the child runs
Galvatron's search with one stub (see `_import_galvatron`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, last_json, machine, new_table, run_child, timed

from pyplan import _core
from pyplan.planner import TP_ZERO_STAGES

GPUS_PER_NODE = 8
BATCH_PER_GPU = 8
MEMORY_GB = 36  # Galvatron's memory constraint (GB), that of the plan it ships for these profiles
SEQ = 2048
MODEL = "llama2-7b"
PRECISION = "bf16"
DEGREES = (1, 2, 4, 8)
MiB = 2**20
# Galvatron's cost model turns a bandwidth B (GB/s, as its profiler writes it) into 1/B ms per MiB.
GALVATRON_BW_UNIT = MiB * 1e3
# Galvatron keeps 20 % of a constraint above 20 GB for PyTorch's cache (DpOnModel) and counts 1,024 MiB of context
# per GPU (TrainArgs.pytorch_context_mem); the rest is what its DP plans in, and what pyplan is given.
USABLE_MIB = MEMORY_GB * 1024 - int(MEMORY_GB * 1024 * 0.2) - 1024
HBM_BYTES_PER_S = 2.039e12  # pyplan's catalog A100-80GB SXM; only the optimizer step reads it
BYTES_PER_PARAM = {"param_bytes": 4.0, "grad_bytes": 4.0, "optim_bytes": 8.0}  # bf16 autocast over fp32 Adam
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"]
CHILD_TIMEOUT_S = 3600.0
HOW_TO_GET = (
    "needs a Galvatron checkout: git clone https://github.com/PKU-DAIR/Hetu-Galvatron DIR, then "
    "python benchmarks/galvatron.py --galvatron DIR"
)


# ---- Galvatron's files ----------------------------------------------------------------------------------------


def _paths(root: Path) -> dict[str, Path]:
    """Galvatron's files this benchmark reads, in the checkout `root`."""
    hw = root / "galvatron/profile_hardware/hardware_configs"
    configs = root / "galvatron/models/gpt/configs"
    return {
        "time": configs / f"computation_profiling_{PRECISION}_{MODEL}_all.json",
        "memory": configs / f"memory_profiling_{PRECISION}_{MODEL}_all.json",
        "model": root / f"galvatron/models/model_configs/{MODEL}.yaml",
        "p2p_intra": hw / f"p2p_bandwidth_1nodes_{GPUS_PER_NODE}gpus_per_node.json",
        "allreduce_intra": hw / f"allreduce_bandwidth_1nodes_{GPUS_PER_NODE}gpus_per_node.json",
        "allreduce_inter": hw / f"allreduce_bandwidth_2nodes_{GPUS_PER_NODE}gpus_per_node.json",
        "p2p_inter": hw / f"p2p_bandwidth_2nodes_{GPUS_PER_NODE}gpus_per_node.json",
        # Measured on one node only; tensor-parallel groups stay inside a node, so two nodes reuse it.
        "sp_time": hw / f"sp_time_1nodes_{GPUS_PER_NODE}gpus_per_node.json",
        "dp_core": root / "csrc/dp_core.cpp",
    }


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = m·x + c (what Galvatron's scipy curve_fit of a linear function gives)."""
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    m = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return m, (sy - m * sx) / n


@dataclass(frozen=True)
class Profiles:
    """Galvatron's figures for its GPT profiles (Llama-2-7B, seq 2048, bf16, sequence parallelism), in its units:
    milliseconds and MiB."""

    layers: int
    hidden: int
    layer_fwd_ms: tuple[float, float]  # one layer's forward per micro-batch of x samples: m·x + c (x = lbsz / tp)
    other_fwd_ms: tuple[float, float]  # embedding + LM head together, the same form
    layer_param_mib: float  # fp32 parameters of one layer (before tensor parallelism)
    layer_act_mib: dict[int, float]  # saved activations of one layer per sample, by tensor-parallel degree
    ckpt_act_mib: float  # per sample of a checkpointed layer (its input), before the split by the degree
    first_states_mib: dict[int, float]  # model states (4x fp32 params) of the embedding, by degree
    first_act_mib: dict[int, float]
    last_states_mib: dict[int, float]  # of the LM head and loss
    last_act_mib: dict[int, float]
    allgather_ms: dict[int, tuple[float, float]]  # per degree: m·MiB + c (half Galvatron's all-reduce times)
    p2p_intra_gbps: float  # two GPUs of a node
    p2p_inter_gbps: float  # two GPUs of two nodes
    allreduce_intra_gbps: float  # the 8 GPUs of a node
    allreduce_inter_gbps: float  # two GPUs of two nodes

    @staticmethod
    def read(root: Path) -> Profiles:
        import yaml

        paths = _paths(root)
        model = yaml.safe_load(paths["model"].read_text())
        times = json.loads(paths["time"].read_text())
        memory = json.loads(paths["memory"].read_text())

        def fit(kind: str) -> tuple[float, float]:
            # Galvatron's "batch" time mode: per-sample times at batch sizes 1-12, fitted per micro-batch.
            points = [
                (int(key.split("_")[-2][3:]), value)
                for key, value in times.items()
                if key.startswith(f"layertype_{kind}_") and key.endswith(f"_seq{SEQ}")
            ]
            return _line([b for b, _ in points], [b * t for b, t in points])

        def by_degree(table: dict[str, float]) -> dict[int, float]:
            return {int(k): v for k, v in table.items() if k.isdigit()}

        layer = memory["layertype_0_sp"][str(SEQ)]
        first, last = memory["other_memory_pp_on_first_sp"][str(SEQ)], memory["other_memory_pp_on_last_sp"][str(SEQ)]
        sp_time = json.loads(paths["sp_time"].read_text())
        allgather = {}
        for t in DEGREES[1:]:
            points = [
                (float(key.split("_")[-2][:-2]), 0.5 * value)
                for key, value in sp_time.items()
                if key.startswith(f"allreduce_size_{t}_")
            ]
            allgather[t] = _line([s for s, _ in points], [v for _, v in points])
        p2p_intra = json.loads(paths["p2p_intra"].read_text())
        p2p_inter = json.loads(paths["p2p_inter"].read_text())
        ar_intra = json.loads(paths["allreduce_intra"].read_text())
        ar_inter = json.loads(paths["allreduce_inter"].read_text())
        return Profiles(
            layers=int(model["num_layers"]),
            hidden=int(model["hidden_size"]),
            layer_fwd_ms=fit("0"),
            other_fwd_ms=fit("other"),
            layer_param_mib=layer["parameter_size"],
            layer_act_mib=by_degree(layer["tp_activation_per_bsz_dict"]),
            ckpt_act_mib=layer["tp_activation_per_bsz_dict"]["checkpoint"],
            first_states_mib=by_degree(first["model_states"]),
            first_act_mib=by_degree(first["activation"]),
            last_states_mib=by_degree(last["model_states"]),
            last_act_mib=by_degree(last["activation"]),
            allgather_ms=allgather,
            p2p_intra_gbps=p2p_intra["pp_size_2"],
            p2p_inter_gbps=p2p_inter["pp_size_2"],
            allreduce_intra_gbps=ar_intra[f"allreduce_size_{GPUS_PER_NODE}_consec_1"],
            allreduce_inter_gbps=ar_inter["allreduce_size_2_consec_0"],
        )


# ---- pyplan's chain and search --------------------------------------------------------------------------------


def chain_at(prof: Profiles, t: int, remat: list[bool]) -> tuple[list[float], ...]:
    """The nine arrays of `_core.search` for one rank of tensor-parallel degree t: the embedding, the layers (those
    flagged in `remat` recomputed: their input kept, their backward running the forward again), the LM head.

    Galvatron's own per-degree figures where it has them (saved activations and model states per degree, measured
    all-reduce times per degree); its rules where it has none: compute time f(lbsz / t) (its cost model divides
    the micro-batch by the degree), backward twice the forward (bct_fct_coe = 2), four all-gathers or
    reduce-scatters of the s·h bf16 activations per layer in forward and two in backward (its six per layer), one
    for the embedding and one for the head, each half the measured all-reduce; the embedding and the head each take
    half the "other" time, as Galvatron splits it between the first and last stage. Boundary tensors whole, as in
    benchmarks/solver.py's `at_degree`."""
    ms, mib = 1e-3, float(MiB)
    sample_mib = SEQ * prof.hidden * 2 / MiB
    ag_m, ag_c = prof.allgather_ms[t] if t > 1 else (0.0, 0.0)
    ag_a, ag_b = ag_m * sample_mib * ms, ag_c * ms  # one collective: per sample, per micro-batch

    def block(m: float, c: float, fwd_comms: int, bwd_comms: int) -> tuple[float, float, float, float]:
        fa, fb = m / t * ms + fwd_comms * ag_a, c * ms + fwd_comms * ag_b
        return fa, fb, 2 * m / t * ms + bwd_comms * ag_a, 2 * c * ms + bwd_comms * ag_b

    lm, lc = prof.layer_fwd_ms
    om, oc = prof.other_fwd_ms
    ends = block(om / 2, oc / 2, 1, 0)
    rows = [ends]
    acts = [prof.first_act_mib[t] * mib]
    params = [prof.first_states_mib[t] * mib / 16]  # model states are 4 x fp32 parameters: 16 bytes each
    for recompute in remat:
        fa, fb, ba, bb = block(lm, lc, 4, 2)
        if recompute:
            ba, bb = ba + fa, bb + fb
        rows.append((fa, fb, ba, bb))
        acts.append((prof.ckpt_act_mib / t if recompute else prof.layer_act_mib[t]) * mib)
        params.append(prof.layer_param_mib * mib / 4 / t)
    rows.append(ends)
    acts.append(prof.last_act_mib[t] * mib)
    params.append(prof.last_states_mib[t] * mib / 16)
    fwd_a, fwd_b, bwd_a, bwd_b = (list(col) for col in zip(*rows))
    cut = [SEQ * 8.0] + [SEQ * prof.hidden * 2.0] * (len(remat) + 1) + [4.0]  # token ids, hidden states, loss
    zeros = [0.0] * len(cut)
    return fwd_a, fwd_b, bwd_a, bwd_b, acts, zeros[:-1], params, cut, zeros


def hardware(prof: Profiles, num_gpus: int, t: int, mem_bytes: float) -> dict[str, Any]:
    """The cluster as the search over tensor-parallel groups of t sees it (Cluster.tensor_parallel_groups): N/t
    groups, 8/t per node, links as they are. Galvatron's bandwidths, no latency (its cost model has none)."""
    bw = GALVATRON_BW_UNIT
    return {
        "num_gpus": num_gpus // t,
        "gpus_per_node": GPUS_PER_NODE // t,
        "gpu_mem_bytes": mem_bytes,
        "mem_bw_bytes_per_s": HBM_BYTES_PER_S,
        "intra_latency_s": 0.0,
        "intra_bw_bytes_per_s": prof.p2p_intra_gbps * bw,
        "inter_latency_s": 0.0,
        "inter_bw_bytes_per_s": prof.p2p_inter_gbps * bw,
        "intra_collective": (0.0, prof.allreduce_intra_gbps * bw),
        "inter_collective": (0.0, prof.allreduce_inter_gbps * bw),
    }


def core_search(prof: Profiles, num_gpus: int, t: int, remat: list[bool], mem_bytes: float, **space: Any) -> Any:
    return _core.search(
        *chain_at(prof, t, remat),
        **hardware(prof, num_gpus, t, mem_bytes),
        global_batch=num_gpus * BATCH_PER_GPU,
        **BYTES_PER_PARAM,
        zero3_single_stage=True,
        **space,
    )


@dataclass(frozen=True)
class Found:
    degree: int
    remat: str
    result: Any  # _core.SearchResult
    candidates: int
    evaluated: int


def pyplan_search(prof: Profiles, num_gpus: int) -> Found:
    """One core search per degree t and remat mode (none, every layer), every schedule, the ZeRO stages
    `pyplan.search` plans there (t = 1: 0 and 1, and 3 with one stage; t > 1: `TP_ZERO_STAGES`); the fastest plan."""
    best: Found | None = None
    candidates = evaluated = 0
    mem = USABLE_MIB * float(MiB)
    for t in DEGREES:
        zero = [0, 1, 3] if t == 1 else list(TP_ZERO_STAGES)
        for remat in ("none", "full"):
            flags = [remat == "full"] * prof.layers
            result = core_search(prof, num_gpus, t, flags, mem, schedules=SCHEDULES, zero_stages=zero, top_k=1)
            candidates, evaluated = candidates + result.num_candidates, evaluated + result.num_evaluated
            if result.feasible and (best is None or result.best.iteration_s < best.result.best.iteration_s):
                best = Found(t, remat, result, 0, 0)
    assert best is not None, "no plan fits"
    return Found(best.degree, best.remat, best.result, candidates, evaluated)


# ---- Galvatron's plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GalvatronPlan:
    """What Galvatron's search returned: one strategy per layer and its own predictions."""

    search_s: float  # wall-clock of initialize_search_engine + parallelism_optimization
    search_cpu_s: float  # CPU seconds of the same
    global_batch: int
    chunks: int
    pp: int
    pp_division: list[int]
    layers: list[dict[str, Any]]  # per layer: tp, sp, dp, dp_type ('ddp', 'zero2', 'zero3'), checkpoint
    embedding: dict[str, int]  # vtp, vsp, embed_sdp
    time_s: float  # its predicted iteration time
    memory_mib: list[float]  # its predicted memory per stage (with its 20 % cache reserve)

    @property
    def degree(self) -> int:
        return _most(max(s["tp"], s["sp"]) for s in self.layers)

    @property
    def dp(self) -> int:
        return _most(s["dp"] for s in self.layers)

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.chunks // self.dp

    @property
    def zero(self) -> int:
        """The ZeRO stage of most layers, in the core's model: 3 (Galvatron's FSDP), 2 (its default: optimizer state
        and gradients sharded; the core prices ZeRO-2, though pyplan's search does not offer it, its runtime keeping
        every gradient), 0 with dp 1."""
        if self.dp == 1:
            return 0
        zero3 = sum(s["dp_type"] == "zero3" for s in self.layers)
        return 3 if 2 * zero3 > len(self.layers) else 2

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.layers:
            kinds[s["dp_type"]] = kinds.get(s["dp_type"], 0) + 1
        zero = " + ".join(f"{n} {'ZeRO-3' if k == 'zero3' else 'ZeRO-2' if k == 'zero2' else 'DDP'}"
                          for k, n in sorted(kinds.items(), reverse=True))  # fmt: skip
        ulysses = sum(s["sp"] > 1 for s in self.layers)
        ckpt = sum(s["checkpoint"] for s in self.layers)
        emb = self.embedding
        return (
            f"dp={self.dp} tp={self.degree}{f' ({ulysses} Ulysses SP)' if ulysses else ''} pp={self.pp} "
            f"b={self.micro_batch} m={self.chunks} 1F1B, {zero} layers, remat {ckpt}/{len(self.layers)} layers; "
            f"embedding/head {'SP' if emb['vsp'] else 'TP'} {emb['vtp']}{' ZeRO-3' if emb['embed_sdp'] else ''}"
        )


def _most(values: Any) -> int:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: (counts[v], v))


def price(prof: Profiles, num_gpus: int, plan: GalvatronPlan) -> tuple[Any, bool]:
    """Galvatron's plan in pyplan's model: the core pinned to its layout, its stage boundaries (the embedding with the
    first stage, the head with the last) and its checkpointed layers. Returns the result and whether it fits in the
    memory Galvatron planned in (if not, the result is the same plan priced without a memory limit)."""
    cuts = [0]
    for n in plan.pp_division:
        cuts.append(cuts[-1] + n)
    cuts = [0] + [c + 1 for c in cuts[1:-1]] + [prof.layers + 2]
    pins = {
        "data_parallel": [plan.dp],
        "pipeline_ranks": [plan.pp],
        "micro_batch_sizes": [plan.micro_batch],
        "num_microbatches": [plan.chunks],
        "schedules": ["1F1B"],
        "zero_stages": [plan.zero],
        "fixed_cuts": cuts if plan.pp > 1 else [],
        "top_k": 1,
    }
    remat = [bool(s["checkpoint"]) for s in plan.layers]
    result = core_search(prof, num_gpus, plan.degree, remat, USABLE_MIB * float(MiB), **pins)
    if result.feasible:
        return result, True
    return core_search(prof, num_gpus, plan.degree, remat, math.inf, **pins), False


# ---- the child: Galvatron's search -----------------------------------------------------------------------------


def _dp_core(root: Path) -> str:
    """A directory holding Galvatron's C++ DP core (csrc/dp_core.cpp) built for this Python, as its Makefile builds
    it; cached by the source's hash."""
    source = _paths(root)["dp_core"]
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"pyplan-galvatron-dp-core-{digest}"
    target = out / f"galvatron_dp_core{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.exists():
        import pybind11

        out.mkdir(parents=True, exist_ok=True)
        includes = [f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11.get_include()}"]
        cmd = ["g++", "-O3", "-Wall", "-shared", "-std=c++11", "-fPIC", *includes, str(source), "-o", str(target)]
        subprocess.run(cmd, check=True, capture_output=True)
    return str(out)


def _import_galvatron(root: Path) -> None:
    """Galvatron's search modules importable from `root`. One stub: the package `galvatron.core.runtime` is an
    empty package over its own directory, so that importing its `args_schema` (pydantic models the search's
    arguments use) does not run its `__init__`, which imports the training runtime (tensor-parallel layers, MoE
    kernels: triton, CUDA extensions) the search never calls."""
    import types

    sys.path[:0] = [str(root), _dp_core(root)]
    import galvatron.core  # noqa: F401  (its __init__ imports nothing)

    runtime = types.ModuleType("galvatron.core.runtime")
    runtime.__path__ = [str(root / "galvatron/core/runtime")]
    sys.modules["galvatron.core.runtime"] = runtime


def galvatron_search(root: Path, nodes: int) -> dict[str, Any]:
    """Galvatron's search as its models/gpt/search_dist.py runs it with scripts/search_dist.yaml, but at sequence
    2048 (its shipped time profile has no other length, which the yaml's "sequence" time mode needs), the "batch"
    time mode (its linear fit over the 12 profiled batch sizes), a memory constraint of 36 GB (that of the plan it
    ships), one global batch of 8 per GPU, and its logs and output in a temporary directory."""
    _import_galvatron(root)
    from galvatron.core.search_engine.args_schema import GalvatronSearchArgs
    from galvatron.core.search_engine.search_engine import GalvatronSearchEngine
    from galvatron.utils.hf_config_adapter import model_layer_configs, model_name, resolve_model_config

    num_gpus = nodes * GPUS_PER_NODE
    with tempfile.TemporaryDirectory() as tmp:
        sp_time = Path(tmp, "hardware")
        sp_time.mkdir()
        # Galvatron names the file by the node count; its tensor-parallel groups stay inside a node.
        Path(sp_time, f"sp_time_{nodes}nodes_{GPUS_PER_NODE}gpus_per_node.json").write_text(
            _paths(root)["sp_time"].read_text()
        )
        config = {
            "model_info": {"model_config_path": str(_paths(root)["model"]), "model_size": MODEL,
                           "is_moe_model": False, "set_seqlen_manually": 1},
            "common_train_info": {"seq_length": SEQ, "sequence_parallel": True, "global_memory_buffer": True},
            "parallelism_info": {"default_dp_type": "zero2", "pipeline_type": "pipedream_flush",
                                 "async_grad_reduce": True, "mixed_precision": PRECISION},
            "hardware_info": {"num_nodes": nodes, "num_gpus_per_node": GPUS_PER_NODE, "memory_constraint": MEMORY_GB},
            "batch_size_info": {"min_bsz": num_gpus * BATCH_PER_GPU, "max_bsz": num_gpus * BATCH_PER_GPU,
                                "bsz_scale": 8, "settle_bsz": -1, "recommend_min_bsz": 0},
            "search_space_info": {"disable_dp": 0, "disable_tp": 0, "disable_cp": 1, "disable_sp": 0,
                                  "disable_embedding_lmhead_tp": 0, "max_tp_deg": 8, "max_pp_deg": 8,
                                  "max_sp_deg": 8, "max_cp_deg": 8},
            "profiling_info": {"time_profile_mode": "batch", "memory_profile_mode": "static",
                               "sp_time_path": str(sp_time)},
            "options_info": {"parallel_search": False, "log_dir": str(Path(tmp, "logs")), "fine_grained_mode": 1,
                             "output_config_path": str(Path(tmp, "out"))},
        }  # fmt: skip
        args = GalvatronSearchArgs.model_validate(config)
        resolve_model_config(args)
        engine = GalvatronSearchEngine(args)
        chosen: dict[str, Any] = {}
        save = engine.save_results

        def keep(optimal: dict[str, Any], bsz: int, chunk: int) -> None:
            chosen.update(optimal=optimal, bsz=bsz, chunk=chunk)
            save(optimal, bsz, chunk)

        engine.save_results = keep
        with contextlib.redirect_stdout(io.StringIO()):
            wall, cpu = time.perf_counter(), time.process_time()
            engine.set_search_engine_info(
                path=str(root / "galvatron/models/gpt"),
                model_layer_configs=model_layer_configs(args),
                model_name=model_name(args),
            )
            engine.initialize_search_engine()
            engine.parallelism_optimization()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    optimal = chosen["optimal"]
    return {
        "search_s": wall,
        "search_cpu_s": cpu,
        "global_batch": chosen["bsz"],
        "chunks": chosen["chunk"],
        "pp": optimal["pp_size"],
        "pp_division": [int(n) for n in optimal["pp_stage_list"]],
        "layers": [
            {
                "tp": s.tp_size,
                "sp": s.sp_size,
                "dp": s.dp_size,
                "dp_type": s.dp_type.value,
                "checkpoint": bool(s.checkpoint),
            }
            for s in optimal["strategy_list"]
        ],
        "embedding": {
            "vtp": int(optimal["embedding_lmhead_tp_sp_size"]),
            "vsp": int(optimal["embedding_lmhead_sp"]),
            "embed_sdp": int(optimal["embedding_lmhead_sdp"]),
        },
        "time_s": float(optimal["time_cost"]),
        "memory_mib": [float(m) for m in optimal["memory_cost"]],
    }


# ---- the table -------------------------------------------------------------------------------------------------


def describe(found: Found) -> str:
    b = found.result.best
    return (
        f"dp={b.dp} tp={found.degree} pp={b.pp} b={b.micro_batch_size} m={b.num_microbatches} {b.schedule} "
        f"ZeRO-{b.zero_stage}, remat {found.remat}" + (f", stages {list(b.cuts)}" if b.pp > 1 else "")
    )


def compare(root: Path, nodes: int, reuse: dict[int, dict[str, Any]]) -> tuple[list[str], list[str], dict[str, Any]]:
    """Galvatron's search in a child process (or its result for these GPUs in `reuse`), then pyplan's search and the
    pricing here; two table rows."""
    num_gpus = nodes * GPUS_PER_NODE
    if num_gpus in reuse:
        plan = GalvatronPlan(**reuse[num_gpus])
    else:
        child = run_child(__file__, "--galvatron", str(root), "--worker", str(nodes), timeout_s=CHILD_TIMEOUT_S)
        if child.returncode != 0:
            raise RuntimeError(f"Galvatron's search for {num_gpus} GPUs failed:\n{child.stderr[-3000:]}")
        plan = GalvatronPlan(**last_json(child.stdout))
    prof = Profiles.read(root)
    found, seconds = timed(lambda: pyplan_search(prof, num_gpus), 3)
    priced, fits = price(prof, num_gpus, plan)
    ours, theirs = found.result.best, priced.best
    gib = 2**30
    over_mib = theirs.peak_memory_bytes / MiB - USABLE_MIB
    galvatron_row = [
        str(num_gpus),
        "Galvatron",
        f"{plan.search_s:.1f} s ({plan.search_cpu_s:.1f} s CPU)",
        plan.describe(),
        f"{plan.time_s:.3f} s, {max(plan.memory_mib) / 1024:.1f} GiB",
        f"{theirs.iteration_s:.3f} s, {theirs.peak_memory_bytes / gib:.2f} GiB"
        + ("" if fits else f" (over the {USABLE_MIB / 1024:.2f} GiB by {over_mib:.0f} MiB)"),
        f"{theirs.iteration_s / ours.iteration_s:.2f}",
    ]
    pyplan_row = [
        str(num_gpus),
        "pyplan",
        f"{seconds * 1e3:.1f} ms",
        describe(found),
        "",
        f"{ours.iteration_s:.3f} s, {ours.peak_memory_bytes / gib:.2f} GiB",
        "1.00",
    ]
    record = {
        "gpus": num_gpus,
        "galvatron": plan.__dict__,
        "galvatron_in_pyplan": {"iteration_s": theirs.iteration_s, "peak_memory_bytes": theirs.peak_memory_bytes,
                                "fits": fits, "zero_stage": theirs.zero_stage, "cuts": list(theirs.cuts),
                                "makespan_s": theirs.makespan_s, "exposed_sync_s": theirs.exposed_sync_s,
                                "optimizer_s": theirs.optimizer_s},
        "pyplan": {"search_s": seconds, "plan": describe(found), "iteration_s": ours.iteration_s,
                   "peak_memory_bytes": ours.peak_memory_bytes, "candidates": found.candidates,
                   "evaluated": found.evaluated, "makespan_s": ours.makespan_s,
                   "exposed_sync_s": ours.exposed_sync_s, "optimizer_s": ours.optimizer_s},
    }  # fmt: skip
    return galvatron_row, pyplan_row, record


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--galvatron", type=Path, help="a checkout of PKU-DAIR/Hetu-Galvatron")
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="nodes of 8 GPUs (default: 1 2)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--reuse", type=Path, help="take Galvatron's plans and search times from this --json output")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # the child that runs Galvatron
    args = parser.parse_args()
    if args.galvatron is None or not (args.galvatron / "galvatron/core/search_engine").is_dir():
        print(HOW_TO_GET, file=sys.stderr)
        sys.exit(2)
    root = args.galvatron.resolve()
    if args.worker is not None:
        print(json.dumps(galvatron_search(root, args.worker)))
        return

    from rich.console import Console

    console = Console(width=200)
    prof = Profiles.read(root)
    table = new_table(
        f"pyplan's search next to Galvatron's on Galvatron's Llama-2-7B profiles (seq {SEQ}, bf16, "
        f"{MEMORY_GB} GB constraint, global batch {BATCH_PER_GPU} per GPU; {machine()})",
        ("GPUs", "planner", "search time", "plan", "Galvatron's prediction", "in pyplan's model", "vs pyplan's plan"),
        left=("planner", "plan"),
        caption=f"pyplan: one core search per degree t in {', '.join(map(str, DEGREES))} and remat none/full, median "
        f"of 3; {USABLE_MIB / 1024:.1f} GiB planned per GPU (Galvatron's usable memory). Layer forward "
        f"{prof.layer_fwd_ms[0]:.2f} ms/sample + {prof.layer_fwd_ms[1]:.2f} ms.",
        show_lines=True,
    )
    reuse = {r["gpus"]: r["galvatron"] for r in json.loads(args.reuse.read_text())} if args.reuse else {}
    records = []
    for nodes in args.nodes:
        galvatron_row, pyplan_row, record = compare(root, nodes, reuse)
        table.add_row(*galvatron_row)
        table.add_row(*pyplan_row)
        records.append(record)
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
