"""The loss in the last block: its saved bytes, measured and analytic times, and what the search charges for it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyplan import search
from pyplan.api import chain_for
from pyplan.errors import PlanError
from pyplan.graph.layergraph import Affine
from pyplan.hardware.catalog import get_gpu
from pyplan.hardware.cluster import Cluster
from pyplan.plan import Plan, Workload
from pyplan.profile.analytic import Roofline
from pyplan.profile.loss import LossCost, loss_cost, with_loss
from pyplan.spec import cross_entropy

CLASSES = 10


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def inputs(b: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, 16),)


def target(b: int) -> torch.Tensor:
    return torch.zeros(b, dtype=torch.long)


@pytest.fixture(scope="module")
def chain() -> object:
    torch.manual_seed(0)
    found, _ = chain_for(_Classifier(), inputs, Cluster.from_catalog("a100-80g", 1), Workload(global_batch=8))
    return found


def test_saved_bytes_are_what_cross_entropy_keeps(chain: object) -> None:
    # cross_entropy saves its log-softmax (b x classes fp32), the int64 target and a scalar total weight.
    cost = loss_cost(chain, F.cross_entropy, target, (1, 2, 4), roofline=Roofline.from_gpu(get_gpu("a100-80g")))
    assert cost.saved_bytes.per_sample == pytest.approx(CLASSES * 4 + 8)
    assert cost.saved_bytes.fixed == pytest.approx(4)
    assert cost.fwd_time_s(4) > 0 and cost.bwd_time_s(4) > 0
    # Mean squared error to zeros (the default loss) saves the output and the target, both b x classes fp32; the
    # output is counted with the chain's last block (its stage holds it), so the loss adds the target.
    mse = loss_cost(chain, F.mse_loss, None, (1, 2), roofline=Roofline.from_gpu(get_gpu("a100-80g")))
    assert mse.saved_bytes(3) == pytest.approx(3 * CLASSES * 4)


@pytest.mark.parametrize(
    ("precision", "log_softmax_bytes", "cast"),
    [("bf16-mixed", 2, False), ("bf16-master", 4, True), ("fp16-mixed", 2, False)],
)
def test_a_16_bit_output_loses_as_the_runtime_computes_it(
    chain: object, precision: str, log_softmax_bytes: int, cast: bool
) -> None:
    """The last stage returns 16-bit logits: autocast's loss takes them as they are, 16-bit weights' loss casts
    them to fp32 first (the runtime's `_in_fp32`). The bytes come in the chain's units, fp32 as traced, which the
    search halves at a 16-bit precision: the real bytes over activation_scale."""
    gpu = Roofline.from_gpu(get_gpu("h100-sxm"))
    cost = loss_cost(chain, F.cross_entropy, target, (1, 2, 4), roofline=gpu, precision=precision)
    scale = Workload(global_batch=8, precision=precision).activation_scale
    assert cost.saved_bytes.per_sample * scale == pytest.approx(CLASSES * log_softmax_bytes + 8)
    assert cost.saved_bytes.fixed * scale == pytest.approx(log_softmax_bytes)  # the total weight, a scalar
    # The fp32 copy of the logits and its 16-bit gradient: two more ops each way where it casts.
    fp32 = loss_cost(chain, F.cross_entropy, target, (1, 2, 4), roofline=gpu)
    assert cost.fwd_time_s(64) > fp32.fwd_time_s(64) if cast else cost.fwd_time_s(64) < fp32.fwd_time_s(64)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-master"])
def test_pyplans_cross_entropy_takes_the_16_bit_logits_as_they_come(chain: object, precision: str) -> None:
    """pyplan's cross-entropy computes in fp32 by itself (pyplan/cross_entropy.py): the runtime gives it the 16-bit
    logits, cast for no precision, and it keeps nothing of their size (the logits are the stage's); its backward
    makes their 16-bit gradient beside an fp32 copy of one chunk of rows (here all of them)."""
    gpu = Roofline.from_gpu(get_gpu("h100-sxm"))
    cost = loss_cost(chain, cross_entropy, target, (1, 2, 4), roofline=gpu, precision=precision)
    scale = Workload(global_batch=8, precision=precision).activation_scale
    # Per row: the log-sum-exp (fp32), the target as an index (int64) and whether it counts (bool).
    assert cost.saved_bytes.per_sample * scale == pytest.approx(4 + 8 + 1)
    assert CLASSES * (2 + 4) <= cost.bwd_peak_bytes.per_sample * scale < CLASSES * (2 + 4) + 40
    cast = loss_cost(chain, lambda out, t: cross_entropy(out, t), target, (1, 2, 4), roofline=gpu, precision=precision)
    if precision == "bf16-master":  # another loss gets an fp32 copy, whose log-sum-exp chunk is fp32 already
        assert cast.bwd_peak_bytes.per_sample * scale == pytest.approx(CLASSES * (4 + 4 + 2), abs=40)


def test_measured_times_grow_with_the_batch(chain: object) -> None:
    # A loss over one sample can time at 0 once the timer's own cost is taken off (on a loaded machine): the
    # times are never negative, and a large batch takes time (large enough that its backward stays above the
    # timer's noise on a loaded machine: 512 rows of 10 classes once timed at 0).
    big = 1 << 16
    cost = loss_cost(chain, F.cross_entropy, target, (1, big))
    assert cost.fwd_time_s(1) >= 0 and cost.bwd_time_s(1) >= 0
    assert cost.fwd_time_s(big) > 0 and cost.bwd_time_s(big) > 0
    assert cost.saved_bytes(1) == pytest.approx(CLASSES * 4 + 8 + 4)


def test_with_loss_joins_the_last_block_once(chain: object) -> None:
    cost = LossCost(Affine(1e-3, 2e-3), Affine(3e-3, 4e-3), Affine(100.0, 8.0))
    joined = with_loss(chain, cost)
    last, before = joined.blocks[-1], chain.blocks[-1]
    assert last.fwd_time_s == before.fwd_time_s + cost.fwd_time_s
    assert last.bwd_time_s == before.bwd_time_s + cost.bwd_time_s
    assert last.saved_bytes == before.saved_bytes + cost.saved_bytes
    assert joined.blocks[:-1] == chain.blocks[:-1] and joined.loss == cost and chain.loss is None
    with pytest.raises(ValueError, match="already holds a loss"):
        with_loss(joined, cost)


def test_the_search_charges_the_loss_on_the_last_stage(chain: object) -> None:
    model, cluster, work = _Classifier(), Cluster.from_catalog("a100-80g", 1), Workload(global_batch=8)
    options = {"micro_batch_sizes": [2], "schedules": ["GPipe"], "zero_stages": [0], "stage_dag": False}
    bare = search(model, inputs, cluster, work, chain=chain, **options).best
    with_ce = search(model, inputs, cluster, work, chain=chain, loss=F.cross_entropy, target=target, **options)
    cost = with_ce.chain.loss
    assert cost is not None and with_ce.chain is not chain
    got, m = with_ce.best, bare.layout.num_microbatches
    assert got.layout == bare.layout
    assert got.stages[-1].forward_s == pytest.approx(bare.stages[-1].forward_s + cost.fwd_time_s(2), rel=1e-9)
    assert got.stages[-1].backward_s == pytest.approx(bare.stages[-1].backward_s + cost.bwd_time_s(2), rel=1e-9)

    # GPipe keeps every micro-batch's loss state until its backward: at the peak (the first backward, once its own
    # loss state is freed, or the end of the forwards) m - 1 or m of them are live. (Compared in the pipeline, with
    # every gradient counted: the loss moves the peak, and with it the gradients not yet made there; and this
    # small model's step peaks in the optimizer step, `optimizer_step_bytes`.)
    def counted(plan: Plan) -> float:
        return sum(s.state_bytes + s.activation_bytes + s.buffer_bytes for s in plan.stages)

    grown = counted(got) - counted(bare)
    assert (m - 1) * cost.saved_bytes(2) - 1e-6 <= grown <= m * cost.saved_bytes(2) + 1e-6


def test_a_loss_that_does_not_fit_the_output_is_one_line(chain: object) -> None:
    model, cluster, work = _Classifier(), Cluster.from_catalog("a100-80g", 1), Workload(global_batch=8)
    with pytest.raises(PlanError, match="the loss cannot be computed on the model's output") as info:
        search(
            model,
            inputs,
            cluster,
            work,
            chain=replace(chain),
            loss=F.cross_entropy,
            target=lambda b: torch.zeros(b + 1),
        )
    assert "\n" not in str(info.value)


def test_the_replay_with_the_loss_peaks_as_training_does() -> None:
    # A language model's cross-entropy peaks in its own backward, before the last block's: the logits, the
    # log-softmax, its gradient and the logits' gradient are live beside every saved activation. The replay of the
    # chain with the loss folded into its last block counts them (it once left out 393 KB of 6.6 MB at b = 16).
    from pyplan import zoo
    from pyplan.graph.linearize import linearize
    from pyplan.graph.trace import trace
    from pyplan.profile.live import LiveMemory
    from pyplan.profile.loss import remat_with_loss
    from pyplan.profile.remat import remat_bytes
    from pyplan.remat_plan import no_remat
    from pyplan.solve.remat import replay

    spec = zoo.get("gpt-tiny")
    assert spec.loss is not None and spec.target is not None
    torch.manual_seed(0)
    model = spec.build()
    chain = linearize(trace(model, spec.example_inputs, batch_size=4), min_blocks=16)
    cost = loss_cost(chain, spec.loss, spec.target, (4, 8), roofline=Roofline.from_gpu(get_gpu("a100-80g")))
    n, b = len(chain.blocks), 8
    figures = remat_with_loss(remat_bytes(chain, spec.example_inputs, (4, 8)), cost).chain(b, [0.0] * n, [0.0] * n)
    predicted = replay(figures, no_remat(0, n)).peak_bytes
    x, y = spec.example_inputs(b), spec.target(b)
    spec.loss(model(*x), y).backward()  # a steady step: the parameters' gradients exist and accumulate in place
    with LiveMemory() as mem:
        logits = model(*x)  # held through the backward, as a PipelineStage holds its output
        spec.loss(logits, y).backward()
    # The tied embedding's gradient waits in autograd's buffer between its two uses (64 KiB): model state.
    assert mem.peak_bytes == pytest.approx(predicted, rel=0.02)
