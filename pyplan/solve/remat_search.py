"""Rematerialization in the plan search: configurations that fit only with recomputation, and each stage's plan.

The search of pyplan/search.h sees one additive memory model per block. With remat it runs on relaxed models of full
recomputation, where every backward also recomputes its forward (an upper bound on time) and a micro-batch in flight
holds a share of each block's output (RELAXED_SHARES: from full recomputation's holding down to nothing, a lower
bound on memory); then each candidate they rank is refined exactly, stage by stage: the stage's blocks get the plan
of the chosen mode that fits its memory with its in-flight micro-batches (`solve` of pyplan/remat.h for "auto", the
best `checkpoint_sequential` segment count for "periodic", one checkpoint per block for "full"; the stages of one
rank share its memory, `_rank_choices`), the stage times become compute + recompute + exposed transfers (the
checkpoints' cost in their first pass in the forward, the rest in the backward), and the pipeline is simulated
again. Candidates that fit no plan are dropped. The refined
candidates are ranked among themselves and with the plain search's. The ranking is exact among the candidates
refined, not over every configuration: a configuration that none of the relaxed searches ranks near the top is not
refined.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pyplan.errors import InfeasibleError, PlanError
from pyplan.plan import Plan, StagePlan, StageRemat
from pyplan.remat_plan import (
    Checkpoint,
    Keep,
    RematItem,
    RematPlan,
    Selective,
    SelectiveCheckpoint,
    full_remat,
    no_remat,
    periodic,
)
from pyplan.solve.remat import (
    BlockMemory,
    RematChain,
    RematProfile,
    Replay,
    checkpoint_cost_s,
    checkpoint_forward_s,
    replay,
    solve,
)
from pyplan.solve.schedules import in_flight_peaks, simulate, stage_placement

__all__ = [
    "FIXED_PLAN_MODES",
    "OFFLOAD_MODES",
    "RELAXED_SHARES",
    "REMAT_MODES",
    "StageChoice",
    "StageParams",
    "refine_plan",
    "relaxed_chain",
    "segmented",
    "selective",
    "selective_gains",
    "stage_outputs",
    "stage_remat",
    "unmade_grad_bytes",
]

REMAT_MODES = ("none", "full", "selective", "periodic", "auto")
OFFLOAD_MODES = ("none", "auto")
# The modes of `stage_remat` whose plan does not depend on the budget: one plan, which fits or not.
FIXED_PLAN_MODES = ("none", "selective", "segments", "selective segments")


# The shares of each block's output the relaxed searches charge per micro-batch in flight: 1 is full
# recomputation's holding (a block's output kept as the next checkpoint's input), 0 charges no activation at all
# (a lower bound on every plan's memory), the share between catches plans that store a few segment inputs.
RELAXED_SHARES = (1.0, 0.25, 0.0)


def relaxed_chain(
    fwd_alpha: Sequence[float],
    fwd_beta: Sequence[float],
    bwd_alpha: Sequence[float],
    bwd_beta: Sequence[float],
    profile: RematProfile,
    scale: float,
    share: float,
) -> tuple[list[float], list[float], list[float], list[float]]:
    """The search's per-block (act per sample, act fixed, bwd alpha, bwd beta) under full recomputation, with
    `share` of each block's output charged per micro-batch in flight."""
    out_ps = [b.out_bytes.per_sample * scale * share for b in profile.blocks]
    out_fx = [b.out_bytes.fixed * scale * share for b in profile.blocks]
    return out_ps, out_fx, [g + f for g, f in zip(bwd_alpha, fwd_alpha)], [g + f for g, f in zip(bwd_beta, fwd_beta)]


@dataclass(frozen=True)
class StageChoice:
    """A stage's remat plan and what it costs per micro-batch (replayed in bytes); `activation_bytes` is the
    peak of one micro-batch plus what the others in flight hold after their forward (`held_bytes` each)."""

    plan: RematPlan
    time_s: float
    recompute_s: float
    transfer_s: float
    activation_bytes: float
    unmade_grad_bytes: float = 0.0  # parameter gradients not yet made at the peak (`unmade_grad_bytes`)
    held_bytes: float = 0.0  # what one micro-batch in flight holds after its forward


@dataclass(frozen=True)
class StageParams:
    """What `refine_plan` needs of the parameters, per block of the chain: `numel` its parameter elements (a
    parameter several blocks read counted in the first), `largest` the elements of the largest tensor it reads;
    `tied` the parameters several blocks read, as (those blocks, elements); `grad_bytes` the gradient bytes per
    element; `step_bytes(elements, largest tensor, dp, ZeRO stage)` what the optimizer step holds beside the state
    (pyplan.profile.memory.optimizer_step_bytes, sharded as the plan's ZeRO stage shards the optimizer)."""

    numel: Sequence[float]
    largest: Sequence[float]
    tied: Sequence[tuple[Sequence[int], float]]
    grad_bytes: float
    step_bytes: Callable[[float, float, int, int], float]


def unmade_grad_bytes(rep: Replay, in_flight: int, grads_bytes: float) -> float:
    """Of a stage's parameter gradients (`grads_bytes`, counted in its state), those not yet made at its peak, for
    a stage whose gradients zero_grad frees every step and whose every micro-batch runs its forward before the
    stage's first backward (`in_flight` of them: GPipe, and 1F1B where m ≤ stages − stage). `rep` is one
    micro-batch's replay with the gradients made block by block (`replay`'s `param_grad_bytes`).

    The stage then peaks in its first backward, beside the other micro-batches in flight and the gradients made
    so far (`peak_with_grads_bytes`), or in its second, one micro-batch fewer in flight and every gradient made,
    and holds every gradient at the end of the step: the largest of the three, against the activation peak plus
    every gradient that the state counts. Measured on the zoo's 1x2 GPipe first stages (every storage live at the
    peak of a steady step): what the plan counted beyond the runtime's peak was exactly the gradients not yet
    made there (gpt-tiny 207,872 bytes of 274,176, resnet-tiny 20,544 of 41,280, vgg-tiny 1,792 of 20,352)."""
    if grads_bytes <= 0:
        return 0.0
    others = (in_flight - 1) * rep.after_forward_bytes
    counted = rep.peak_bytes + others + grads_bytes
    first = rep.peak_with_grads_bytes + others
    second = rep.peak_bytes + others - rep.after_forward_bytes + grads_bytes if in_flight >= 2 else 0.0
    return max(0.0, counted - max(first, second, grads_bytes))


def selective_gains(chain: RematChain) -> list[int]:
    """The blocks selective checkpointing keeps fewer bytes of, most bytes saved per second recomputed first."""
    if not chain.selective_kept_bytes:
        return []
    saved = [chain.kept_bytes[i] - chain.selective_kept_bytes[i] for i in range(len(chain))]

    def worth(i: int) -> float:
        return saved[i] / max(chain.selective_recompute_s[i], 1e-12)

    return sorted((i for i in range(len(chain)) if saved[i] > 0), key=lambda i: (-worth(i), i))


def selective(n: int, blocks: Iterable[int]) -> RematPlan:
    """Blocks [0, n) with `blocks` run under selective checkpointing, every other block kept."""
    chosen = set(blocks)
    return RematPlan(tuple(Selective(i) if i in chosen else Keep(i) for i in range(n)))


def segmented(n: int, segments: Sequence[tuple[int, int]], *, selective: bool = False) -> RematPlan:
    """Blocks [0, n) with each of `segments` (disjoint [start, stop) ranges, in order) checkpointed whole, every other
    block kept: what checkpointing whole modules does (the module keeps its input and runs again in its backward);
    `selective`: each checkpointed selectively (`SelectiveCheckpoint`)."""
    kind = SelectiveCheckpoint if selective else Checkpoint
    items: list[RematItem] = []
    k = 0
    for start, stop in segments:
        items.extend(Keep(i) for i in range(k, start))
        items.append(kind(no_remat(start, stop)))
        k = stop
    items.extend(Keep(i) for i in range(k, n))
    return RematPlan(tuple(items))


def stage_remat(
    chain: RematChain,
    budget_bytes: float,
    in_flight: int,
    *,
    mode: str,
    offload_bw_bytes_per_s: float | None,
    slots: int = 200,
    fresh_grad_bytes: Sequence[float] = (),
    segments: Sequence[tuple[int, int]] = (),
) -> StageChoice | None:
    """The plan of `mode` for one stage's blocks (numbered from 0) within `budget_bytes` (activations only), or
    None. `fresh_grad_bytes` (per block; empty: none): the stage's parameter gradients, where zero_grad frees them
    every step and every micro-batch's forward runs before the stage's first backward (`unmade_grad_bytes`); what
    is not yet made at the peak is left out of the need. ("auto" chooses its plan within the budget without
    that allowance, then counts it.) Mode "segments" checkpoints each of `segments` ([start, stop) blocks) whole and
    keeps the other blocks: the plan of a runtime that checkpoints modules (`segmented`); "selective segments"
    checkpoints them selectively, and "any segments" takes the fastest of keeping them and either way that fits."""
    n = len(chain)

    def unmade(plan: RematPlan) -> float:
        if not fresh_grad_bytes:
            return 0.0
        return _replayed(chain, plan, in_flight, offload_bw_bytes_per_s, fresh_grad_bytes).unmade_grad_bytes

    def fits(plan: RematPlan) -> StageChoice | None:
        got = _replayed(chain, plan, in_flight, offload_bw_bytes_per_s, fresh_grad_bytes)
        return None if got.activation_bytes - got.unmade_grad_bytes > budget_bytes else got

    if mode == "none":
        return fits(no_remat(0, n))
    if mode == "full":
        # With several micro-batches in flight, the last block checkpointed too is the plan that may fit (its
        # activations are otherwise held once for each): the faster of the two that fit.
        options = [fits(full_remat(0, n)), fits(full_remat(0, n, last=True)) if in_flight > 1 else None]
        return min((r for r in options if r is not None), key=lambda r: r.time_s, default=None)
    if mode == "selective":
        return fits(selective(n, selective_gains(chain)))
    if mode == "segments":
        return fits(segmented(n, segments))
    if mode == "selective segments":
        return fits(segmented(n, segments, selective=True))
    if mode == "any segments":
        # Whole modules kept, checkpointed selectively or checkpointed: the fastest that fits.
        options = [fits(no_remat(0, n)), fits(segmented(n, segments, selective=True)), fits(segmented(n, segments))]
        return min((r for r in options if r is not None), key=lambda r: r.time_s, default=None)
    if mode == "periodic":
        options = [r for k in range(1, n + 1) if (r := fits(periodic(0, n, k))) is not None]
        return min(options, key=lambda r: r.time_s, default=None)
    if mode != "auto":
        raise PlanError(f"unknown remat mode '{mode}'; choose one of {', '.join(REMAT_MODES)}")
    if budget_bytes <= 0:
        return None
    try:
        # solve replays its plan in bytes and also tries keeping everything (and the other baselines).
        got = solve(
            chain, budget_bytes, slots=slots, offload_bw_bytes_per_s=offload_bw_bytes_per_s, in_flight=in_flight
        )
    except InfeasibleError:
        return None
    need = got.peak_bytes + (in_flight - 1) * got.after_forward_bytes
    best = StageChoice(
        got.plan, got.time_s, got.recompute_s, got.transfer_s, need, unmade(got.plan), got.after_forward_bytes
    )
    # Selective checkpointing block by block, the blocks that save most bytes per second recomputed first, as
    # few as fit: the DP's plans do not include it; the faster of the two is the stage's plan.
    gains = selective_gains(chain)
    for k in range(1, len(gains) + 1):
        mixed = fits(selective(n, gains[:k]))
        if mixed is not None:
            return mixed if mixed.time_s < best.time_s else best
    return best


def _replayed(
    chain: RematChain, plan: RematPlan, in_flight: int, offload_bw_bytes_per_s: float | None,
    fresh_grad_bytes: Sequence[float],
) -> StageChoice:  # fmt: skip
    """`plan` replayed in bytes on a stage's blocks with `in_flight` micro-batches, its gradients not yet made at the
    peak (`unmade_grad_bytes`) where `fresh_grad_bytes` are given."""
    rep = replay(chain, plan, offload_bw_bytes_per_s=offload_bw_bytes_per_s or math.inf,
                 param_grad_bytes=fresh_grad_bytes)  # fmt: skip
    need = rep.peak_bytes + (in_flight - 1) * rep.after_forward_bytes
    free = unmade_grad_bytes(rep, in_flight, sum(fresh_grad_bytes)) if fresh_grad_bytes else 0.0
    return StageChoice(plan, rep.time_s, rep.recompute_s, rep.transfer_s, need, free, rep.after_forward_bytes)


def stage_outputs(lo: int, hi: int, mems: Sequence[BlockMemory], num_cuts: int) -> tuple[tuple[int, int], ...]:
    """The outputs of the stage over blocks [lo, hi), as (block, value) of `mems[block].out_values`: the storages
    its blocks make that live past its last cut; none for the last stage (its output is the loss).

    Its PipelineStage keeps them for each micro-batch in flight from the forward to the end of the backward
    (`fwd_cache`, then `backward_one_chunk` while it runs), where the replay of the stage alone frees them once no
    block saves them: the stage counts them per micro-batch in flight, as it counts its inputs. Measured on
    vgg-tiny's 1x2 1F1B first stage: a 524 KB convolution output live beside the backward the replay had freed."""
    if hi >= num_cuts - 1:
        return ()
    return tuple((k, i) for k in range(lo, hi) for i, (_, last, _) in enumerate(mems[k].out_values) if last >= hi)


def _recomputed_outputs(
    plan: RematPlan, lo: int, mems: Sequence[BlockMemory], outputs: Sequence[tuple[int, int]]
) -> float:
    """Bytes of the stage's outputs (`stage_outputs`, unscaled) that a recomputation makes again beside the ones the
    stage holds, the most of any checkpoint: those a block of that checkpoint saves (a ReLU's output that a residual
    carries to the next stage); the copy lives until that checkpoint's backward ends. Measured on resnet-tiny's 1x2
    first stage under full recomputation: one such output (262 KB at b=4, 524 KB at b=8) at the peak."""
    most = 0.0
    for item in plan.items:
        if not isinstance(item, Checkpoint):
            continue
        inside = range(lo + item.inner.first, lo + item.inner.last + 1)
        made = sum(
            mems[k].out_values[i][0]
            for k, i in outputs
            if k in inside and any(q in inside for q in mems[k].out_values[i][2])
        )
        most = max(most, float(made))
    return most


def _without(mem: BlockMemory, drop: set[int]) -> BlockMemory:
    """`mem` (a BlockMemory) with its output values `drop` counted elsewhere: their bytes leave every figure."""
    if not drop:
        return mem
    gone = sum(mem.out_values[i][0] for i in drop)
    return replace(
        mem,
        kept_bytes=max(0, mem.kept_bytes - gone),
        out_bytes=max(0, mem.out_bytes - gone),
        fwd_peak_bytes=max(0, mem.fwd_peak_bytes - gone),
        fwd_nosave_peak_bytes=max(0, mem.fwd_nosave_peak_bytes - gone),
        bwd_peak_bytes=max(0, mem.bwd_peak_bytes - gone),
        selective_kept_bytes=max(0, mem.selective_kept_bytes - gone),
        out_values=tuple(
            (0, last, savers) if i in drop else (b, last, savers) for i, (b, last, savers) in enumerate(mem.out_values)
        ),
    )


def refine_plan(
    plan: Plan,
    profile: RematProfile,
    fwd_s: Callable[[int], list[float]],
    bwd_s: Callable[[int], list[float]],
    *,
    scale: float,
    gpu_mem_bytes: float,
    cut_bytes: Callable[[int], list[float]],
    positions: Sequence[int],
    send_s: Callable[[float], float],
    stage_sync_s: Sequence[float],
    mode: str,
    offload_bw_bytes_per_s: float | None,
    checkpoint_s: float = 0.0,
    host: Mapping[str, float | bool] | None = None,
    cut_tensors: Sequence[float] = (),
    checkpoint_block_s: Sequence[float] = (),
    checkpoint_forward_share: float = 0.0,
    params: StageParams | None = None,
    tied_copy_numel: Sequence[float] = (),
    segments: Sequence[tuple[int, int]] = (),
) -> Plan | None:
    """`plan` (from the search on the relaxed chain) with each stage's remat plan, times and memory; None
    when some stage fits no plan of `mode`. `fwd_s(b)`/`bwd_s(b)` give the blocks' seconds at micro-batch b,
    `cut_bytes(b)` every cut's bytes, `positions` every cut's node position; `send_s(bytes)` a boundary transfer
    on the plan's pipeline link; `checkpoint_s` the cost of one checkpoint call on the device; `host` the search's
    host costs (search.h's HostCosts by name) with `cut_tensors` the tensors crossing each cut;
    `checkpoint_block_s` what each block adds to a checkpoint it is inside (empty: nothing), and
    `checkpoint_forward_share` the share of those costs paid in the forward pass (the rest in the backward). The
    stages of one rank (the chunks of an interleaved schedule) share its memory beside their state and buffers, at
    the rank's peak over the schedule's time, not each chunk's own (`_rank_choices`, `_rank_peak`); each such stage's
    activations are its share of that peak.

    With `params`, a stage's memory is the larger of two moments: in the pipeline, where one replica's stage that
    runs every forward before its first backward peaks before most gradients are made again (`_stage_grads`), and
    in the optimizer step (`_optimizer_step`, with `tied_copy_numel` the elements of the tied copies each stage
    keeps, as pyplan.solve.tied.tied_copies charges them; empty: none)."""
    host = host or {}
    tensors = list(cut_tensors) or [0.0] * len(cut_bytes(1))
    tensors[0] = tensors[-1] = 0.0
    lay = plan.layout
    b = lay.micro_batch_size
    f_all, g_all, cuts = fwd_s(b), bwd_s(b), cut_bytes(b)
    grads = [g(b) * scale for g in profile.grad_bytes]
    mems = [blk.at(b) for blk in profile.blocks]
    ranks: dict[int, list[int]] = {}
    stage_rank = _stage_ranks(plan)
    for s, r in enumerate(stage_rank):
        ranks.setdefault(r, []).append(s)
    outputs = [stage_outputs(st.first_block, st.last_block + 1, mems, len(cuts)) for st in plan.stages]
    # What each stage holds beside the replay: its inputs and outputs, per micro-batch and for those in flight at
    # its own peak; and its buffers.
    per_microbatch = [
        cuts[st.first_block] + scale * sum(mems[k].out_values[i][0] for k, i in outputs[s])
        for s, st in enumerate(plan.stages)
    ]
    resident = [st.in_flight * x for st, x in zip(plan.stages, per_microbatch, strict=True)]
    stages: list[StagePlan] = []
    remat: list[StageRemat | None] = []
    step, in_step = _optimizer_step(plan, params, tied_copy_numel, cuts)
    if any(sum(in_step[x] for x in xs) > gpu_mem_bytes for xs in ranks.values()):
        return None
    planned: list[_StagePlanning] = []
    for s, st in enumerate(plan.stages):
        lo, hi = st.first_block, st.last_block + 1
        blocks = [_without(mems[k], {i for j, i in outputs[s] if j == k}) for k in range(lo, hi)]
        chain = replace(
            _stage_chain(blocks, f_all[lo:hi], g_all[lo:hi], grads[lo : hi + 1], lo, hi, scale),
            checkpoint_s=checkpoint_s,
            checkpoint_block_s=tuple(checkpoint_block_s[lo:hi]),
            checkpoint_forward_share=checkpoint_forward_share,
        )
        # One replica (no DDP buckets), one stage per rank (GPipe, 1F1B), every forward before the first backward.
        fresh = lay.dp == 1 and lay.stages_per_rank == 1 and st.in_flight == lay.num_microbatches
        planned.append(
            _StagePlanning(
                chain,
                st.in_flight,
                tuple(_stage_grads(params, lo, hi)) if params is not None and fresh else (),
                tuple((max(a, lo) - lo, min(z, hi) - lo) for a, z in segments if a < hi and z > lo),
                functools.partial(_recomputed_outputs, lo=lo, mems=mems, outputs=outputs[s]),
                scale,
                per_microbatch[s],
            )
        )
    peaks = (
        _rank_peaks(lay.schedule, lay.pp, lay.num_microbatches, lay.stages_per_rank)
        if lay.stages_per_rank > 1
        else None
    )
    chosen: dict[int, _Choice] = {}
    activation: dict[int, float] = {}  # each stage's share of its rank's activations at the rank's peak
    for r, xs in ranks.items():
        rank_state = sum(plan.stages[x].state_bytes for x in xs)
        if peaks is None:
            # One stage: its plan within what its rank holds beside its state and what it holds beside its blocks.
            (x,) = xs
            one = planned[x].within(gpu_mem_bytes - rank_state - (resident[x] + plan.stages[x].buffer_bytes), mode,
                                    offload_bw_bytes_per_s)  # fmt: skip
            if one is None:
                return None
            chosen[x] = one
            activation[x] = one.choice.activation_bytes + (one.again + resident[x])
            continue
        # Several: their plans within what the rank holds beside its state and buffers, at its peak over time.
        got = _rank_choices([planned[x] for x in xs], gpu_mem_bytes - rank_state - sum(plan.stages[x].buffer_bytes
                            for x in xs), mode, offload_bw_bytes_per_s, peaks[r])  # fmt: skip
        if got is None:
            return None
        chosen.update(zip(xs, got, strict=True))
        activation.update(zip(xs, _rank_peak([planned[x] for x in xs], got, peaks[r])[1], strict=True))
    for s, st in enumerate(plan.stages):
        lo, hi = st.first_block, st.last_block + 1
        got = chosen[s].choice
        remat.append(None if got.plan == no_remat(0, hi - lo) else StageRemat(tuple(positions[lo : hi + 1]), got.plan))
        messages = float(host.get("message_s", 0.0)) * (tensors[lo] + tensors[hi])
        sends = send_s(cuts[lo]) * (lo > 0) + send_s(cuts[hi]) * (hi < len(cuts) - 1)
        held = _Held(activation[s], in_step[s], step[s])
        stages.append(_stage_plan(st, planned[s].chain, got, held, host, messages, sends))
    return _with_stages(plan, stages, remat, send_s, cuts, stage_sync_s, host, ranks)


@dataclass(frozen=True)
class _Choice:
    """A stage's remat plan with the bytes its recomputation makes again of the outputs the stage holds (`again`,
    `_recomputed_outputs`), planned with `in_flight` micro-batches: the stage's blocks take `need` of their rank's
    free memory, of which `working_bytes` beyond what those micro-batches hold after their forward."""

    choice: StageChoice
    again: float
    in_flight: int

    @property
    def need(self) -> float:
        return self.choice.activation_bytes - self.choice.unmade_grad_bytes + self.again

    @property
    def working_bytes(self) -> float:
        """One micro-batch's peak beyond what it holds after its forward, with the held outputs its recomputation
        makes again."""
        return max(0.0, self.need - self.in_flight * self.choice.held_bytes)


@dataclass(frozen=True)
class _StagePlanning:
    """One stage's blocks as `refine_plan` plans them: its chain, micro-batches in flight (its own peak), gradients
    made after its peak (`stage_remat`'s `fresh_grad_bytes`), checkpointable units, `recomputed(plan)` the unscaled
    bytes of its held outputs that `plan` makes again (scaled by `scale`), and `resident_bytes` what each micro-batch
    in flight holds beside its blocks (its input and the outputs its PipelineStage keeps)."""

    chain: RematChain
    in_flight: int
    fresh_grad_bytes: tuple[float, ...]
    segments: tuple[tuple[int, int], ...]
    recomputed: Callable[[RematPlan], float]
    scale: float
    resident_bytes: float = 0.0

    def within(
        self, budget_bytes: float, mode: str, offload_bw_bytes_per_s: float | None, in_flight: int | None = None
    ) -> _Choice | None:
        """The plan of `mode` within `budget_bytes` (`stage_remat`) that fits it with what it makes again, with
        `in_flight` micro-batches (default: its own peak)."""
        n = self.in_flight if in_flight is None else in_flight
        got = stage_remat(self.chain, budget_bytes, n, mode=mode, offload_bw_bytes_per_s=offload_bw_bytes_per_s,
                          fresh_grad_bytes=self.fresh_grad_bytes, segments=self.segments)  # fmt: skip
        if got is None:
            return None
        choice = _Choice(got, self.scale * self.recomputed(got.plan), n)
        return choice if choice.need <= budget_bytes else None

    def least(self, offload_bw_bytes_per_s: float | None) -> _Choice:
        """Full recomputation with the least need at its own peak, of checkpointing every block but the last and
        every block: each micro-batch in flight holds its blocks' inputs, one runs its backward."""
        n = len(self.chain)
        return min(
            (
                _Choice(c, self.scale * self.recomputed(c.plan), self.in_flight)
                for plan in (full_remat(0, n), full_remat(0, n, last=True))
                for c in [_replayed(self.chain, plan, self.in_flight, offload_bw_bytes_per_s, self.fresh_grad_bytes)]
            ),
            key=lambda c: c.need,
        )


@functools.lru_cache(maxsize=64)
def _rank_peaks(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`in_flight_peaks`, kept for the many candidates of one shape (it walks the whole order: 0.8 s at p 64, v 4,
    m 2048)."""
    return tuple(tuple(rank) for rank in in_flight_peaks(schedule, p, m, v))


def _at_peak(stages: Sequence[_StagePlanning], choices: Sequence[_Choice], counts: Sequence[int]) -> tuple[float, int]:
    """What a rank's stages hold with `choices` and `counts` micro-batches in flight: Σ_j n_j·(held_j + resident_j),
    what each micro-batch in flight holds after its forward and beside its blocks, plus the largest working memory
    (`_Choice.working_bytes`) of the stages with n_j ≥ 1; and that stage (-1 when every count is 0)."""
    held = sum(n * (c.choice.held_bytes + x.resident_bytes) for x, c, n in zip(stages, choices, counts, strict=True))
    running = max((j for j, n in enumerate(counts) if n > 0), key=lambda j: choices[j].working_bytes, default=-1)
    return held + (choices[running].working_bytes if running >= 0 else 0.0), running


def _rank_peak(
    stages: Sequence[_StagePlanning], choices: Sequence[_Choice], peaks: Sequence[Sequence[int]]
) -> tuple[float, list[float]]:
    """The most a rank's stages (the chunks of an interleaved schedule) hold at once with `choices`, and each
    stage's share of it: the largest `_at_peak` over the count vectors at which the rank may peak (`in_flight_peaks`,
    the first on a tie). The action running there is one of a stage with n_j ≥ 1 in the vector (an F that brought
    the counts there, or a B, I or W of a micro-batch in flight: simulate.h), so adding the largest working memory
    of those stages is a sound bound, exact when that stage's action runs at the peak. At any other moment the
    counts are at most those of the peak before it (they only fall between two runs of forwards), so no moment
    holds more. A stage's share: its count times what each of its micro-batches holds, with the working memory on
    the stage it is taken from."""
    most, shares = -1.0, [0.0] * len(stages)
    for counts in peaks:
        total, running = _at_peak(stages, choices, counts)
        if total > most:
            most = total
            shares = [n * (c.choice.held_bytes + x.resident_bytes) for x, c, n in zip(stages, choices, counts,
                                                                                     strict=True)]  # fmt: skip
            if running >= 0:
                shares[running] += choices[running].working_bytes
    return most, shares


def _rank_choices(
    stages: Sequence[_StagePlanning], free_bytes: float, mode: str, offload_bw_bytes_per_s: float | None,
    peaks: Sequence[Sequence[int]],
) -> list[_Choice] | None:  # fmt: skip
    """The plans of a rank's stages (the chunks of an interleaved schedule) that fit together in its `free_bytes`
    (beside its state and its receive buffers) at the rank's peak over time (`_rank_peak` over `peaks`), or None.

    The chunks' own peaks do not coincide (Megatron-LM's 530B: 70, 69 and 35 micro-batches on rank 0, at most 139 at
    once), so each is planned for its count in the vector of `peaks` that holds most under full recomputation: the
    fastest that fits (least Σ stage time, the first on a tie) of the free memory beside the chunks' inputs and
    outputs there split evenly, split in proportion to each chunk's least need there (full recomputation's,
    `least`), and each chunk's plan within the whole at its own peak. Where the mode's plan does not depend on the
    budget (FIXED_PLAN_MODES), the last alone."""

    def fitting(got: Sequence[_Choice | None]) -> list[_Choice] | None:
        if any(c is None for c in got):
            return None
        choices = [c for c in got if c is not None]
        return choices if _rank_peak(stages, choices, peaks)[0] <= free_bytes else None

    whole = fitting([x.within(free_bytes, mode, offload_bw_bytes_per_s) for x in stages])
    if mode in FIXED_PLAN_MODES:
        return whole
    # Full recomputation's held and working bytes do not depend on the count: its need at n is working + n·held.
    least = [x.least(offload_bw_bytes_per_s) for x in stages]
    heaviest = max(peaks, key=lambda counts: _at_peak(stages, least, counts)[0])
    counts = [max(1, n) for n in heaviest]
    beside = free_bytes - sum(n * x.resident_bytes for n, x in zip(heaviest, stages, strict=True))
    needs = [c.working_bytes + n * c.choice.held_bytes for c, n in zip(least, counts, strict=True)]

    def within(budgets: Sequence[float]) -> list[_Choice] | None:
        return fitting([x.within(b, mode, offload_bw_bytes_per_s, n) for x, b, n in zip(stages, budgets, counts,
                                                                                         strict=True)])  # fmt: skip

    options = [within([beside / len(stages)] * len(stages))]
    if sum(needs) > 0:
        options.append(within([beside * n / sum(needs) for n in needs]))
    options.append(whole)
    chosen = [o for o in options if o is not None]
    return min(chosen, key=lambda o: sum(c.choice.time_s for c in o), default=None)


@dataclass(frozen=True)
class _Held:
    """What a stage holds beside its state and buffers: in the pipeline (`activation`: its replayed blocks with
    their micro-batches in flight, its inputs and outputs, outputs recomputed again; with several stages a rank,
    its share of the rank's peak, `_rank_peak`), in the optimizer step (`in_step`, of which `step` the step's
    temporaries)."""

    activation: float
    in_step: float
    step: float


def _stage_plan(
    st: StagePlan, chain: RematChain, got: StageChoice, held: _Held, host: Mapping[str, float | bool], messages: float,
    sends: float,
) -> StagePlan:  # fmt: skip
    """The stage with the times and memory of its remat plan `got`, its host costs and boundary sends."""
    # The checkpoints' first passes run in the forward: what they cost there is the forward's.
    ahead = checkpoint_forward_s(chain, got.plan)
    fwd = sum(chain.fwd_s) + ahead + float(host.get("stage_forward_s", 0.0)) + messages
    bwd = got.time_s - sum(chain.fwd_s) - ahead + float(host.get("stage_backward_s", 0.0)) + messages
    activation = held.activation
    return replace(
        st,
        forward_s=fwd,
        backward_s=bwd,
        time_s=fwd + bwd + sends,
        activation_bytes=activation,
        memory_bytes=max(st.state_bytes + activation + st.buffer_bytes - got.unmade_grad_bytes, held.in_step),
        unmade_grad_bytes=got.unmade_grad_bytes,
        optimizer_step_bytes=held.step,
        recompute_s=got.recompute_s,
        checkpoint_s=checkpoint_cost_s(chain, got.plan),
        checkpoint_forward_s=ahead,
        transfer_s=got.transfer_s,
    )


def _with_stages(
    plan: Plan, stages: list[StagePlan], remat: list[StageRemat | None], send_s: Callable[[float], float],
    cuts: list[float], stage_sync_s: Sequence[float], host: Mapping[str, float | bool], ranks: dict[int, list[int]],
) -> Plan:  # fmt: skip
    """`plan` with its refined stages and remat plans: the schedule simulated again over the stages' times, the
    data-parallel sync exposed beyond each stage's backward (or after the pipeline on a CPU), the peak per rank."""
    lay = plan.layout
    boundaries = [send_s(cuts[st.last_block + 1]) for st in stages[:-1]]
    sim = simulate(
        lay.schedule,
        [st.forward_s for st in stages],
        [st.backward_s for st in stages],
        num_microbatches=lay.num_microbatches,
        stages_per_rank=lay.stages_per_rank,
        send_forward_s=boundaries or 0.0,
        send_backward_s=boundaries or 0.0,
    )
    if host.get("sync_overlaps_backward", True):
        exposed = max((max(0.0, y - st.backward_s) for y, st in zip(stage_sync_s, stages)), default=0.0)
    else:
        exposed = max((sum(stage_sync_s[x] for x in xs) for xs in ranks.values()), default=0.0)
    pred = plan.predicted
    iteration = sim.makespan_s + exposed + pred.optimizer_s + pred.host_step_s
    peak = max(sum(stages[x].memory_bytes for x in xs) for xs in ranks.values())
    per_s = pred.cost_per_iteration / pred.iteration_s if pred.iteration_s > 0 else 0.0
    predicted = replace(
        pred,
        iteration_s=iteration,
        samples_per_s=lay.global_batch / iteration,
        peak_memory_bytes=peak,
        bubble_fraction=sim.bubble_fraction,
        pipeline_s=sim.makespan_s,
        exposed_comm_s=exposed,
        cost_per_iteration=per_s * iteration,
        cost_per_epoch=None if pred.cost_per_epoch is None else pred.cost_per_epoch / pred.iteration_s * iteration,
        recompute_s=lay.num_microbatches * max(st.recompute_s + st.transfer_s for st in stages),
    )
    layout = replace(lay, remat=tuple(remat) if any(r is not None for r in remat) else ())
    return replace(plan, layout=layout, stages=tuple(stages), predicted=predicted)


def _optimizer_step(
    plan: Plan, params: StageParams | None, tied_copy_numel: Sequence[float], cuts: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Per stage, the optimizer step's temporaries (`optimizer_step_bytes`), and all it holds: the state, the
    temporaries, and on the first stage the caller's batch (m micro-batches of its input cut); the schedule has
    ended, and the runtime's receive buffers with it (pyplan/runtime/recv.py). It matters where activations are
    small."""
    step = _step_bytes(plan, params, tied_copy_numel) if params is not None else [0.0] * len(plan.stages)
    batch = plan.layout.num_microbatches * cuts[0]
    in_step = [st.state_bytes + (batch if s == 0 else 0.0) + step[s] for s, st in enumerate(plan.stages)]
    return step, in_step


def _stage_chain(
    blocks: Sequence[BlockMemory], fwd_s: Sequence[float], bwd_s: Sequence[float], grads: Sequence[float], lo: int,
    hi: int, scale: float,
) -> RematChain:  # fmt: skip
    """The RematChain of a stage over blocks [lo, hi), the blocks' memory at the micro-batch scaled to the
    precision, values and savers beyond the stage cut at its end; its outputs held through its backward (a
    PipelineStage keeps a micro-batch's output until its backward is done: `RematChain.with_outputs_held`)."""
    return RematChain(
        fwd_s=tuple(fwd_s),
        bwd_s=tuple(bwd_s),
        kept_bytes=tuple(m.kept_bytes * scale for m in blocks),
        out_bytes=tuple(m.out_bytes * scale for m in blocks),
        fwd_peak_bytes=tuple(m.fwd_peak_bytes * scale for m in blocks),
        fwd_nosave_peak_bytes=tuple(m.fwd_nosave_peak_bytes * scale for m in blocks),
        bwd_peak_bytes=tuple(m.bwd_peak_bytes * scale for m in blocks),
        grad_bytes=tuple(grads),
        out_values=tuple(tuple((b * scale, min(last, hi) - lo) for b, last, _ in m.out_values) for m in blocks),
        out_savers=tuple(
            tuple(tuple(q - lo for q in savers if q < hi) for _, _, savers in m.out_values) for m in blocks
        ),
        saves=tuple(m.saves for m in blocks),
        selective_kept_bytes=tuple(m.selective_kept_bytes * scale for m in blocks),
        selective_recompute_s=tuple(m.selective_share * f for m, f in zip(blocks, fwd_s)),
        selective_holds=tuple(m.selective_holds for m in blocks),
    ).with_outputs_held()


def _stage_grads(params: StageParams, lo: int, hi: int) -> list[float]:
    """The parameter gradient bytes each block of a stage over blocks [lo, hi) makes in its backward: its own, with
    each tied parameter the stage reads made at its last reader there (counted in its first reader by the chain).
    On one data-parallel replica (no DDP buckets) zero_grad frees the gradients every step, so a stage whose every
    micro-batch runs its forward before its first backward peaks before most are made again
    (`unmade_grad_bytes`)."""
    out = [n * params.grad_bytes for n in params.numel[lo:hi]]
    for blocks, numel in params.tied:
        readers = [k for k in blocks if lo <= k < hi]
        if not readers:
            continue
        if lo <= blocks[0] < hi:
            out[blocks[0] - lo] -= numel * params.grad_bytes
        out[max(readers) - lo] += numel * params.grad_bytes
    return out


def _step_bytes(plan: Plan, params: StageParams, tied_copy_numel: Sequence[float]) -> list[float]:
    """Per stage, what the optimizer step holds beside the state: over its parameters and its tied copies."""
    lay = plan.layout
    copies = list(tied_copy_numel) or [0.0] * len(plan.stages)
    return [
        params.step_bytes(
            sum(params.numel[st.first_block : st.last_block + 1]) + copy,
            max(params.largest[st.first_block : st.last_block + 1], default=0.0),
            lay.dp,
            lay.zero_stage,
        )
        for st, copy in zip(plan.stages, copies)
    ]


def _stage_ranks(plan: Plan) -> list[int]:
    lay = plan.layout
    return stage_placement(lay.schedule, lay.pp, lay.stages_per_rank)
