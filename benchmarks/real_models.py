"""Full-size Hugging Face configurations, captured and planned analytically on the meta device; prints a table.

Run: `python benchmarks/real_models.py` (needs transformers; about 5-10 minutes on 2 cores). Each model runs in a
process of its own, so its peak resident memory is its own. Per model: build from the config on the meta device
(no weights), the parameter count against the published one, capture (torch.export) + linearize, and
`pyplan.search` for 8 and for 64 A100-80GB (bf16 mixed precision, AdamW, the global batch below, `--remat auto`),
each search from the model as `pyplan plan` runs it (profiling included).
Targets: every plan under 60 s; capture + linearize of the
Llama-2-7B configuration under 20 s; peak resident memory under 2 GB for the 70B configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import argument_parser, last_json, new_table, peak_rss_bytes, run_child, verdict, write_json


@dataclass(frozen=True)
class Case:
    name: str
    ref: str
    published_params: int
    source: str
    global_batch: int
    gpus: tuple[int, ...] = (8, 64)  # the clusters of A100s planned for


CASES = (
    Case(
        "llama-2-7b",
        "hf:llama:hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
        "num_key_value_heads=32,vocab_size=32000,max_position_embeddings=4096,seq_len=4096",
        6_738_415_616,
        "meta-llama/Llama-2-7b-hf, LlamaForCausalLM",
        512,
    ),
    Case(
        "llama-3-8b",
        "hf:llama:hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,"
        "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=8192,seq_len=8192",
        8_030_261_248,
        "meta-llama/Meta-Llama-3-8B, LlamaForCausalLM",
        256,
    ),
    Case(
        "gpt2-xl",
        "hf:gpt2:n_layer=48,n_embd=1600,n_head=25,seq_len=1024",
        1_557_611_200,
        "openai-community/gpt2-xl, GPT2LMHeadModel (lm_head tied)",
        512,
    ),
    Case(
        "bert-large",
        "hf:bert:hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,intermediate_size=4096,seq_len=512",
        335_174_458,
        "google-bert/bert-large-uncased, BertForMaskedLM (decoder tied to the word embeddings)",
        512,
    ),
    Case(
        "vit-large",
        "hf:vit:hidden_size=1024,num_hidden_layers=24,num_attention_heads=16,intermediate_size=4096,patch_size=16,"
        "image_size=224,num_labels=1000",
        304_326_632,
        "google/vit-large-patch16-224, ViTForImageClassification",
        1024,
    ),
    Case(
        "t5-large",
        "hf:t5:d_model=1024,d_ff=4096,num_layers=24,num_heads=16,d_kv=64,vocab_size=32128,seq_len=512",
        737_668_096,
        "google-t5/t5-large, T5ForConditionalGeneration (lm_head tied)",
        512,
    ),
    Case(
        "llama-2-70b",
        "hf:llama:hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64,"
        "num_key_value_heads=8,vocab_size=32000,max_position_embeddings=4096,seq_len=4096",
        68_976_648_192,
        "meta-llama/Llama-2-70b-hf, LlamaForCausalLM",
        1024,
        (64,),  # 8 A100s hold 640 GB, the model state alone 1.1 TB (16 bytes a parameter)
    ),
)
GPUS = (8, 64)  # the table's columns
TARGET_PLAN_S, TARGET_CAPTURE_S, TARGET_RSS_BYTES = 60.0, 20.0, 2e9


def measure(case: Case) -> dict[str, Any]:
    """Every step for one model, in this process."""
    import torch

    from pyplan import linearize, load_model, search, trace
    from pyplan.hardware import Cluster
    from pyplan.plan import Workload

    spec = load_model(case.ref)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = spec.build()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())  # tied weights once
    t0 = time.perf_counter()
    graph = trace(model, spec.example_inputs, batch_size=1)
    chain = linearize(graph)
    capture_s = time.perf_counter() - t0
    plans = {}
    for gpus in case.gpus:
        t0 = time.perf_counter()
        found = search(
            model,
            spec.example_inputs,
            Cluster.from_catalog("a100-80g", gpus),
            Workload(global_batch=case.global_batch, precision="bf16-mixed"),
            loss=spec.loss,
            target=spec.target,
            remat="auto",  # as a user plans a model this size: recompute where nothing fits without
        )
        lay = found.best.layout
        plans[str(gpus)] = {
            "s": time.perf_counter() - t0,
            "plan": f"dp{lay.dp} pp{lay.pp} b{lay.micro_batch_size}x{lay.num_microbatches} {lay.schedule} "
            f"ZeRO-{lay.zero_stage}",
            "iteration_s": found.best.predicted.iteration_s,
        }
    return {
        "case": asdict(case),
        "params": params,
        "blocks": len(chain),
        "build_s": build_s,
        "capture_s": capture_s,
        "plans": plans,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--models", nargs="+", choices=[c.name for c in CASES], help="default: all")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES:
        if args.models and case.name not in args.models:
            continue
        done = run_child(__file__, "--one", case.name, timeout_s=1800)
        if done.returncode != 0:
            rows.append({"case": asdict(case), "error": done.stderr.strip().splitlines()[-1]})
        else:
            rows.append(last_json(done.stdout))
    columns = ("model", "params (published)", "blocks", "capture s", *(f"plan {g} s" for g in GPUS), "RSS GB",
               "plan for 64")  # fmt: skip
    table = new_table(
        "Full-size configurations on the meta device, A100-80GB (bf16 mixed, AdamW, remat auto)", columns, left=columns
    )
    met = True
    for r in rows:
        case = r["case"]
        if "error" in r:
            table.add_row(case["name"], "error", r["error"])
            met = False
            continue
        same = r["params"] == case["published_params"]
        times = [r["plans"][str(g)]["s"] if str(g) in r["plans"] else None for g in GPUS]
        met = met and same and all(t is None or t <= TARGET_PLAN_S for t in times)
        if case["name"] == "llama-2-7b":
            met = met and r["capture_s"] <= TARGET_CAPTURE_S
        if case["name"] == "llama-2-70b":
            met = met and r["peak_rss_bytes"] <= TARGET_RSS_BYTES
        plan64 = r["plans"][str(GPUS[-1])]
        table.add_row(
            case["name"],
            f"{r['params']:,} ({'=' if same else '!= ' + format(case['published_params'], ',')})",
            str(r["blocks"]),
            f"{r['capture_s']:.1f}",
            *("-" if t is None else f"{t:.1f}" for t in times),
            f"{r['peak_rss_bytes'] / 1e9:.2f}",
            f"{plan64['plan']}, {plan64['iteration_s'] * 1e3:.0f} ms",
        )
    Console(width=180, emoji=False).print(table)
    print(f"targets: plans <= {TARGET_PLAN_S:.0f} s, Llama-2-7B capture <= {TARGET_CAPTURE_S:.0f} s, 70B RSS <= "
          f"{TARGET_RSS_BYTES / 1e9:.0f} GB, parameter counts as published: {verdict(met)}")  # fmt: skip
    if args.json:
        write_json(args.json, rows)
    return 0 if met else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(next(c for c in CASES if c.name == sys.argv[2]))))
    else:
        sys.exit(main())
