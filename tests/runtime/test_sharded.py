"""ZeRO-3 without pipeline stages: the units FSDP2 shards, what it holds gathered, what checkpointing them recomputes,
and the plans the search makes of it (the training itself: tests/runtime/_transparency.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyplan import linearize, load_model, search, trace
from pyplan.errors import PlanError
from pyplan.hardware import Cluster
from pyplan.plan import Workload
from pyplan.remat_plan import Checkpoint, Keep, SelectiveCheckpoint, full_remat, no_remat
from pyplan.runtime.sharded import traced_units
from pyplan.runtime.units import gathered_bytes, remat_kind, shard_units, unit_segments, zero3_overlap
from pyplan.solve.remat_search import segmented


def test_the_units_are_the_layers_and_the_root_holds_the_rest() -> None:
    model = load_model("zoo:gpt-tiny").build()
    layers = list(model.transformer.h)
    assert shard_units(model) == layers
    root = sum(p.numel() for p in model.parameters()) - sum(p.numel() for m in layers for p in m.parameters())
    layer = max(sum(p.numel() for p in m.parameters()) for m in layers)
    # The root (embeddings, tied head, final norm) gathered with its gradients; a layer and the next with its own.
    assert gathered_bytes(model, 2.0, 2.0) == (2 + 2) * root + (2 * 2 + 2) * layer


def test_the_traced_model_is_cut_into_one_piece_per_layer() -> None:
    """Beside tensor parallelism ZeRO-3 shards the traced model's pieces (TracedUnits): one per layer, holding
    that layer's parameters only, the root's operations in the pieces between; run in sequence they compute what
    the model computes. A layer that reads a parameter of the root (a piece recomputes what it reads of the
    parameters) is refused in one line."""
    spec = load_model("zoo:gpt-tiny")
    torch.manual_seed(0)
    model = spec.build()
    units = traced_units(trace(model, spec.example_inputs, batch_size=2), model)
    assert len(units.units) == len(model.transformer.h) and len(units.pieces) == len(units.units) + 2
    for k, i in enumerate(units.units):
        assert {id(p) for p in units.pieces[i].parameters()} == {id(p) for p in model.transformer.h[k].parameters()}
    (ids,) = spec.example_inputs(2)
    assert torch.equal(units(ids), model(ids))
    assert set(units.named_tensors()) >= {n for n, _ in model.named_parameters()}

    class Layer(nn.Linear):
        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x) + bias

    class Shared(nn.Module):  # every layer adds a value made of the model's own parameter
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(8))
            self.layers = nn.ModuleList(Layer(8, 8) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = self.bias * 2
            for layer in self.layers:
                x = layer(x, bias)
            return x

    shared = Shared()
    with pytest.raises(PlanError, match=r"'bias' is read inside a unit it does not belong to; plan it with ZeRO-1"):
        traced_units(trace(shared, lambda b: (torch.randn(b, 8),), batch_size=2), shared)


def test_checkpointing_units_recomputes_the_blocks_each_layer_spans() -> None:
    spec = load_model("zoo:gpt-tiny")
    model = spec.build()
    names = [b.name for b in linearize(trace(model, spec.example_inputs, batch_size=2)).blocks]
    runs = unit_segments(model, names)
    assert [names[a:z] for a, z in runs] == [
        [n for n in names if n.startswith(f"transformer.h.{k}")] for k in range(len(model.transformer.h))
    ]
    plan = segmented(len(names), runs)
    assert [type(it) for it in plan.items] == [Keep] * runs[0][0] + [Checkpoint] * len(runs) + [Keep] * (
        len(names) - runs[-1][1]
    )
    assert all(it.inner == no_remat(a, z) for it, (a, z) in zip(plan.items[runs[0][0] :], runs))


def test_a_zero3_plan_recomputes_whole_units_or_nothing() -> None:
    spec = load_model("zoo:gpt-tiny")
    found = search(spec.build(), spec.example_inputs, Cluster.from_catalog("a100-80g", 4), Workload(global_batch=8),
                   zero_stages=(3,), remat="full", top_k=20)  # fmt: skip
    sharded = [p for p in (found.best, *found.alternatives) if p.layout.zero_stage == 3]
    assert sharded
    for p in sharded:
        assert remat_kind(p.layout) == "units"
        (stage,) = p.layout.remat
        assert [it for it in stage.plan.items if isinstance(it, Checkpoint)]
        assert all(
            all(isinstance(x, Keep) for x in it.inner.items) for it in stage.plan.items if isinstance(it, Checkpoint)
        )
    # Selectively, the units are checkpointed as one each: less recomputed, more kept.
    found = search(spec.build(), spec.example_inputs, Cluster.from_catalog("a100-80g", 4), Workload(global_batch=8),
                   zero_stages=(3,), remat="selective", top_k=20)  # fmt: skip
    selective = next(p for p in (found.best, *found.alternatives) if p.layout.zero_stage == 3)
    assert remat_kind(selective.layout) == "selective units"
    (stage,) = selective.layout.remat
    assert any(isinstance(it, SelectiveCheckpoint) for it in stage.plan.items)
    full = next(p for p in sharded if p.layout.micro_batch_size == selective.layout.micro_batch_size
                and p.layout.dp == selective.layout.dp)  # fmt: skip
    assert selective.stages[0].recompute_s < full.stages[0].recompute_s
    assert selective.stages[0].activation_bytes > full.stages[0].activation_bytes


def test_remat_kinds() -> None:
    from pyplan.plan import Layout, StageRemat

    def layout(plan) -> Layout:
        return Layout(dp=2, pp=1, micro_batch_size=1, num_microbatches=1, schedule="GPipe", cut_positions=(0, 4),
                      zero_stage=3, remat=(StageRemat((0, 1, 2, 3, 4), plan),))  # fmt: skip

    assert remat_kind(layout(no_remat(0, 4))) == "none"
    assert remat_kind(layout(full_remat(0, 4))) == "units"
    nested = segmented(4, [(0, 4)])
    nested = type(nested)((Checkpoint(segmented(4, [(1, 3)])),))
    assert remat_kind(layout(nested)) == "other"
    assert remat_kind(layout(segmented(4, [(0, 2), (2, 4)], selective=True))) == "selective units"
    mixed = type(nested)((Checkpoint(no_remat(0, 2)), SelectiveCheckpoint(no_remat(2, 4))))
    assert remat_kind(layout(mixed)) == "other"


def test_zero3_overlap_against_its_closed_forms() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 6)
        f = [rng.uniform(0.0, 2.0) for _ in range(n)]
        b = [rng.uniform(0.0, 4.0) for _ in range(n)]
        g = [rng.uniform(0.0, 1.0) for _ in range(n)]
        s = [rng.uniform(0.0, 1.0) for _ in range(n)]
        fwd, bwd = zero3_overlap(f, b, g, s)
        # Never more than compute and communication one after the other, nor less than either alone.
        assert sum(f) - 1e-12 <= sum(fwd) <= sum(f) + sum(g) + 1e-12
        assert max(sum(f), sum(g)) - 1e-12 <= sum(fwd)
        assert max(sum(b), sum(g) + sum(s)) - 1e-12 <= sum(bwd) <= sum(b) + sum(g) + sum(s) + 1e-12
        # No communication: the compute alone; no compute: the communication alone.
        alone = zero3_overlap(f, b, [0.0] * n, [0.0] * n)
        assert alone[0] == pytest.approx(f) and alone[1] == pytest.approx(b)
        nothing = [0.0] * n
        fwd0, bwd0 = zero3_overlap(nothing, nothing, g, s)
        assert sum(fwd0) == pytest.approx(sum(g)) and sum(bwd0) == pytest.approx(sum(g) + sum(s))
    # The link ahead of the compute: max(fwd_i, gather_{i+1}) and max(bwd_i, gather_{i-1} + scatter_{i+1}).
    f, b = [3.0, 3.0, 3.0], [6.0, 6.0, 6.0]
    g, s = [1.0, 2.0, 1.5], [2.0, 3.0, 1.0]
    fwd, bwd = zero3_overlap(f, b, g, s)
    assert fwd == [1.0 + 3.0, 3.0, 3.0]
    assert bwd == [6.0 + 2.0, 6.0, 6.0 + 1.5]
    # Communication-bound: every block waits for its weights.
    # Forward: the first gather (2), block 0 (0.5) while the second gathers (2), block 1 waits for it.
    # Backward: block 1 once gathered (2 + 1); block 0 waits for its gather (issued at 2, done at 4) and the link
    # reduce-scatters block 1 (4 to 5), block 0 (5 to 6).
    fwd, bwd = zero3_overlap([0.5, 0.5], [1.0, 1.0], [2.0, 2.0], [1.0, 1.0])
    assert fwd == [2.5, 2.0] and bwd == [2.0 + 1.0, 3.0]
