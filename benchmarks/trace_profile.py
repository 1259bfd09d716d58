"""Wall time of trace, linearize and profile for the examples and large zoo models; prints a table.

Run: `python benchmarks/trace_profile.py`. Targets: trace + linearize of a 48-layer GPT-2-style model under 5 s
on a 2-core machine; analytic (FLOPs and bytes) profiling of a 10^10-parameter model on the meta device without
allocating its weights (peak resident memory stays far below its 40 GB). Where transformers is installed, the
full-size Hugging Face configurations of benchmarks/real_models.py too, each in a process of its own so that its peak
resident memory is its own: capture (torch.export) + linearize of Llama-2-7B under 20 s, Llama-2-70B under 2 GB.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from rich.console import Console

import pyplan
from pyplan.zoo.transformer import GPT, GPTConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import machine, new_table, peak_rss_bytes, target_line, timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Row:
    name: str
    mode: str
    params: int
    blocks: int
    trace_s: float
    linearize_s: float
    profile_s: float
    peak_rss_gb: float


def run(name: str, spec: pyplan.ModelSpec, *, meta: bool, batch_size: int) -> Row:
    if meta:
        with torch.device("meta"):
            model = spec.build()
    else:
        model = spec.build()
    graph, t_trace = timed(lambda: pyplan.trace(model, spec.example_inputs, batch_size=batch_size))
    chain, t_lin = timed(lambda: pyplan.linearize(graph))
    sizes = (batch_size, 2 * batch_size)
    profiled, t_prof = timed(lambda: pyplan.profile(chain, spec.example_inputs, measure=not meta, batch_sizes=sizes))
    return Row(
        name,
        "meta (FLOPs, bytes)" if meta else "measured (1 thread)",
        profiled.param_numel,
        len(profiled),
        t_trace,
        t_lin,
        t_prof,
        peak_rss_bytes() / 1.024e9,  # ru_maxrss's kB / 1e6, as this table has always counted
    )


def _hf_row(name: str, ref: str) -> Row:
    return run(name, pyplan.load_model(ref), meta=True, batch_size=1)


def hf_rows() -> list[Row]:
    """The full-size Hugging Face configurations, each in a fresh process."""
    from real_models import CASES

    rows = []
    for case in CASES:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(_hf_row, f"hf {case.name}", case.ref).result())
    return rows


def main() -> int:
    torch.manual_seed(0)
    rows = []
    for ex in ("mlp", "resnet", "gpt"):
        rows.append(
            run(
                f"examples/{ex}.py",
                pyplan.load_model(os.path.join(ROOT, "examples", f"{ex}.py")),
                meta=False,
                batch_size=8,
            )
        )
    rows.append(run("zoo:resnet50", pyplan.load_model("zoo:resnet50"), meta=True, batch_size=8))
    rows.append(run("zoo:gpt2-xl (48 layers)", pyplan.load_model("zoo:gpt2-xl"), meta=True, batch_size=1))
    cfg = GPTConfig(n_layer=48, n_head=40, n_embd=5120, n_ctx=2048)
    big = pyplan.ModelSpec(
        name="gpt-15b",
        build=lambda: GPT(cfg),
        example_inputs=lambda b: (torch.randint(0, cfg.vocab_size, (b, cfg.n_ctx)),),
    )
    rows.append(run(f"GPT {cfg.n_layer}x{cfg.n_embd}, seq {cfg.n_ctx}", big, meta=True, batch_size=1))
    big_row = rows[-1]
    hf = hf_rows() if importlib.util.find_spec("transformers") is not None else []
    rows += hf

    table = new_table(
        f"trace / linearize / profile wall time ({machine()})",
        ("model", "mode", "params", "blocks", "trace s", "linearize s", "trace+lin s", "profile s", "peak RSS GB"),
        left=("model", "mode"),
    )
    for r in rows:
        table.add_row(
            r.name,
            r.mode,
            f"{r.params:.3g}",
            str(r.blocks),
            f"{r.trace_s:.2f}",
            f"{r.linearize_s:.2f}",
            f"{r.trace_s + r.linearize_s:.2f}",
            f"{r.profile_s:.2f}",
            f"{r.peak_rss_gb:.2f}",
        )
    Console(width=160).print(table)
    xl = next(r for r in rows if "gpt2-xl" in r.name)
    ok_time = xl.trace_s + xl.linearize_s < 5.0
    ok_big = big_row.params >= 1e10 and big_row.peak_rss_gb < 8.0
    print(target_line("trace+linearize of 48-layer GPT-2 < 5 s", ok_time, f"{xl.trace_s + xl.linearize_s:.2f} s"))
    print(
        target_line(
            "1e10-parameter model profiled on meta without its weights",
            ok_big,
            f"{big_row.params:.3g} parameters, peak RSS {big_row.peak_rss_gb:.2f} GB, "
            f"weights would take {big_row.params * 4 / 1e9:.0f} GB",
        )
    )
    ok = ok_time and ok_big
    if hf:
        llama = next(r for r in hf if r.name == "hf llama-2-7b")
        huge = next(r for r in hf if r.name == "hf llama-2-70b")
        ok_llama, ok_huge = llama.trace_s + llama.linearize_s < 20.0, huge.peak_rss_gb < 2.0
        capture_s = llama.trace_s + llama.linearize_s
        print(target_line("capture+linearize of Llama-2-7B < 20 s", ok_llama, f"{capture_s:.2f} s"))
        print(target_line("Llama-2-70B peak RSS < 2 GB", ok_huge, f"{huge.peak_rss_gb:.2f} GB"))
        ok = ok and ok_llama and ok_huge
    else:
        print("transformers is not installed: the Hugging Face configurations are left out")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
