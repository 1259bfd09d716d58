"""`pyplan inspect`'s tables fit 80 columns: no figure cut, every block and module told apart."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from pyplan.report.inspect import render_inspect, render_tensor_parallel, shortened
from pyplan.units import fmt_bytes, fmt_count, fmt_seconds

LAYERS = 43


def _blocks(measured: bool) -> dict[str, Any]:
    """An inspect document of a 43-block language model whose block names share a long prefix."""
    names = ["model.embed_tokens", *(f"model.language_model.layers.{i}" for i in range(LAYERS - 2)), "lm_head"]
    blocks = [
        {
            "index": i,
            "name": name,
            "params": 1.2e8 + i,
            "flops_fwd": 3.4e12,
            "flops_bwd": 6.8e12,
            "activation_bytes_per_sample": 5.6e8,
            "activation_fixed_bytes": 0.0,
            "cut_bytes_per_sample": 3.2e7,
            "cut_fixed_bytes": 0.0,
            "fwd_time_s": 0.0123 if measured else None,
            "bwd_time_s": 0.0246 if measured else None,
        }
        for i, name in enumerate(names)
    ]
    return {
        "model": "llama",
        "batch_size": 8,
        "device": "cpu" if measured else "meta (not timed)",
        "threads": 1,
        "measured": measured,
        "params": 5.2e9,
        "flops_fwd": 1.5e14,
        "flops_bwd": 3e14,
        "activation_bytes": 1.9e11,
        "fwd_time_s": 0.53 if measured else None,
        "bwd_time_s": 1.06 if measured else None,
        "blocks": blocks,
    }


def _rows(text: str) -> list[list[str]]:
    """The body rows' cells."""
    return [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_inspect_at_80_columns_tells_every_block_apart_and_cuts_no_figure() -> None:
    for measured in (False, True):
        data = _blocks(measured)
        console = Console(width=80, record=True, emoji=False)
        render_inspect(data, console)
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= 80
        rows = _rows(text)[:LAYERS]
        names = [r[1] for r in rows]
        assert len(set(names)) == LAYERS  # every block told apart
        for shown, x in zip(names, data["blocks"]):
            assert x["name"].endswith(shown.removeprefix("…"))
        assert not any("…" in cell for r in rows for cell in r[2:])  # no figure cut
        figures = {c for r in rows for c in r[2:]}
        assert {fmt_count(1.2e8), fmt_bytes(5.6e8 * 8), fmt_bytes(3.2e7 * 8)} <= figures
        if measured:
            assert {fmt_seconds(0.0123), fmt_seconds(0.0246)} <= figures
        else:  # FLOPs shown, no columns of unmeasured times
            assert {fmt_count(3.4e12), fmt_count(6.8e12)} <= figures and len(rows[0]) == 7


def test_inspect_tp_at_80_columns_keeps_the_distinguishing_tail_of_module_names() -> None:
    styles = {}
    for i in range(32):
        for proj, style in (("q_proj", "ColwiseParallel"), ("o_proj", "RowwiseParallel")):
            styles[f"model.language_model.layers.{i}.self_attn.{proj}"] = style
    data = {
        "degree": 2,
        "styles": styles,
        "pieces": {},
        "whole": {"model.language_model.layers.0.mlp.gate_up": "2 does not divide 11 (heads or features)"},
        "region_partial_gradients": [],
        "sequence_parallel": False,
        "sequence_parallel_reason": "no norm between the split layers",
        "partial_gradients": [],
        "vocab_parallel_loss": False,
    }
    console = Console(width=80, record=True, emoji=False)
    render_tensor_parallel(data, console)
    rows = [r for r in _rows(console.export_text()) if r[0]]
    modules = [*styles, *data["whole"]]
    assert len(rows) == len(modules) and len({r[0] for r in rows}) == len(modules)
    for (shown, style, _), module in zip(rows, modules):
        assert shown.startswith("…") and module.endswith(shown[1:])
        assert style in ("ColwiseParallel", "RowwiseParallel", "whole")


def test_shortened_names_keep_their_tails_or_give_up() -> None:
    assert shortened(["a.b.layers.12.mlp", "lm_head"], 15) == ["…layers.12.mlp", "lm_head"]
    assert shortened(["abcdefghijklmnop"], 8) == ["…jklmnop"]
    assert shortened(["x.layers.1.mlp", "y.layers.1.mlp"], 12) is None  # the tails would read the same
