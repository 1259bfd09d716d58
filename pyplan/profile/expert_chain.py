"""A profiled chain as one rank trains it at expert-parallel degree E: each mixture-of-experts block priced by the cost
model of pyplan/profile/experts.py on top of what the profile recorded.

The chain comes from the capture that keeps each layer's routed experts whole (`expert_leaves`, one `call_module`
node per layer), at every degree, 1 included, so that one chain serves them all. On meta and fake tensors such a node
runs nothing (pyplan/graph/experts.py `WholeExperts`): the profile holds the router, the shared experts and
everything around the experts, and none of the experts' FLOPs, time or saved bytes. `chain_at_expert_degree` adds
them per block holding a layer's experts, for a micro-batch of b samples and T = t·b tokens per rank (t the experts'
tokens per sample, read off the capture), k the top-k, h the hidden width, f an expert's inner width, P_e its
parameters, N the experts, E the degree, and ι the imbalance (the busiest rank's pairs over the mean):

- Compute (where the profile did not time the experts: an analytic profile; a profile measured on this machine ran
  them and timed them already), on the roofline of the GPU at the workload's compute dtype and the matrix products'
  efficiencies (pyplan/profile/analytic.py `Efficiency`):
      forward  = max(F / (peak · eff_compute),  W / (bandwidth · eff_memory)),   F = ι · T · k · 2·P_e,
      backward = max(2F / (peak · eff_compute), 2W / (bandwidth · eff_memory)),  W = N/E · P_e · B,
  F the busiest rank's routed FLOPs (`expert_cost`), W the bytes of its N/E experts' weights read once (B bytes an
  element in the compute dtype, 2 in 16 bits), the backward reading them for the input gradient and writing as much
  weight gradient; the activations' own reads and writes, and the kernels' launches, are left out.
- Communication (E > 1): the four all-to-alls of a layer and micro-batch, dispatch and combine in the forward and
  their gradients in the backward, each `all_to_all_time_s` of ι · S bytes with S = `all_to_all_bytes` (T·k·h·B·
  (E−1)/E), on the links the group spans: a group of E consecutive data-parallel replicas holds g = gcd(E, G) ranks
  on each of E/g nodes of G GPUs. That is exact where the replicas of a stage are neighbours (placement "dp-inner",
  or one stage, which the search pins for E > 1: Megatron-LM's default rank order puts pp outermost for the same
  reason) and E divides G or G divides E.
- Saved activations, per routed pair, of a SwiGLU expert: its input (the token gathered or received, h), the gate and
  up outputs (f each), the activation silu(gate) and the product with up (f each, the down projection's input): h +
  4f; of a plain expert h + 2f (up output and activation); and on the token's rank the expert's output, which the
  weighted sum keeps for the router weights' gradient (h). The busiest rank: (ι · (h + inner) + h) · T · k elements,
  counted in the chain's units (fp32 as traced, 4 bytes; the search scales them to the precision). Checked against
  saved_tensors_hooks on real experts in tests/test_ep_search.py: a dense reference (every expert on every token)
  saves exactly 4f + h per (token, expert) beside its input, and transformers' eager Mixtral experts save these
  tensors and their own: one more h per pair (torch's index_add_ keeps its source) and 20 bytes of indices and
  weight. The same bytes are added to the block's working memory (kept, forward and backward peaks) for the
  refinement's replay.
- Model state (E > 1): the block holds its layer's N/E experts, N·P_e − N/E·P_e fewer parameters, so the state and
  the gradient all-reduce shrink with them. Approximation: the experts' gradients are all-reduced over the dp/E
  replicas holding the same experts (pyplan/runtime/experts.py), priced as 1/E of their bytes over all dp replicas
  (a ring over d ranks sends 2(d−1)/d of the bytes: slightly more than over d/E).

Every added time is a piecewise-linear curve in b, the upper envelope of lines (`envelope`), exact at every whole b,
added to the block's own curve; FLOPs are added to the block's too (ι·F forward, twice that backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pyplan.errors import PlanError
from pyplan.graph.chain import Block, Chain
from pyplan.graph.experts import ExpertLayer
from pyplan.graph.layergraph import Affine, Piecewise
from pyplan.hardware.catalog import Link
from pyplan.hardware.cluster import Cluster
from pyplan.model_state import COMPUTE_DTYPES
from pyplan.plan import Workload
from pyplan.profile.analytic import Roofline
from pyplan.profile.experts import (
    DEFAULT_IMBALANCE,
    ExpertShape,
    all_to_all_bytes,
    expert_cost,
    expert_state,
    token_bytes,
)
from pyplan.solve.remat import RematBytes, RematProfile

__all__ = [
    "ExpertBlockCost",
    "chain_at_expert_degree",
    "envelope",
    "expert_block_costs",
    "group_span",
    "saved_elements_per_pair",
]

# The bytes of one element in the chain's units: saved activations are traced in fp32 (pyplan.model_state).
_TRACED_BYTES = 4


def saved_elements_per_pair(hidden: int, intermediate: int, *, gated: bool) -> int:
    """Elements a routed (token, expert) pair keeps for the backward on the expert's side: the expert's input (h)
    and, of a gated (SwiGLU) expert, the gate and up outputs, the activation and the product (4f); of a plain one,
    the up output and the activation (2f). The token's side keeps the expert's output (h) beside it."""
    return hidden + (4 if gated else 2) * intermediate


def group_span(degree: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks a node, nodes) of an expert-parallel group of `degree` consecutive ranks on nodes of `gpus_per_node`:
    gcd(E, G) ranks on each of E/gcd nodes."""
    per_node = math.gcd(degree, gpus_per_node)
    return per_node, degree // per_node


def envelope(lines: Sequence[Affine]) -> Affine:
    """The upper envelope max_i(lines[i](b)) of lines in b, exact at every whole b ≥ 1: one line where it is the
    largest from b = 1 on, else a Piecewise curve through b = 1, both whole sizes around each crossing at b ≥ 1, and
    one more past the last (between neighbouring whole sizes the envelope bends at most once, so it is linear from
    one whole size to the next)."""
    if not lines:
        return Affine(0.0, 0.0)
    crossings = sorted(
        (q.fixed - p.fixed) / (p.per_sample - q.per_sample)
        for i, p in enumerate(lines)
        for q in lines[i + 1 :]
        if p.per_sample != q.per_sample
    )
    inside = [x for x in crossings if x > 1]
    if not inside:
        top = max(lines, key=lambda a: (a(1.0), a.per_sample))
        return Affine(top.per_sample, top.fixed)
    sizes = {1, 2}
    for x in inside:
        sizes |= {math.floor(x), math.floor(x) + 1}
    sizes.add(max(sizes) + 1)
    ordered = sorted(sizes)
    return Piecewise.through(ordered, [max(a(float(b)) for a in lines) for b in ordered])


def _plus(a: Affine, b: Affine) -> Affine:
    """a + b, a curve measured or evaluated at sizes (Piecewise) kept as one whichever side it is on."""
    if isinstance(b, Piecewise) and not isinstance(a, Piecewise):
        return b + a
    return a + b


@dataclass(frozen=True)
class ExpertBlockCost:
    """What one mixture-of-experts layer adds to its block at a degree, per micro-batch of b samples: forward and
    backward seconds (`compute_*` the experts' work, `comm_s` one all-to-all: two in each pass), saved bytes and
    FLOPs (per sample), and the parameters the rank does not hold."""

    path: str
    block: int
    tokens_per_sample: float
    compute_fwd_s: Affine
    compute_bwd_s: Affine
    comm_s: Affine
    saved_bytes_per_sample: float
    flops_fwd_per_sample: float
    params_not_held: int

    @property
    def fwd_s(self) -> Affine:
        return _plus(_plus(self.compute_fwd_s, self.comm_s), self.comm_s)

    @property
    def bwd_s(self) -> Affine:
        return _plus(_plus(self.compute_bwd_s, self.comm_s), self.comm_s)


def _experts_nodes(chain: Chain) -> dict[str, tuple[int, str]]:
    """Each module called by a `call_module` node of the chain's graph -> (its block, the node's name)."""
    block_of = {name: i for i, blk in enumerate(chain.blocks) for name in blk.nodes}
    out: dict[str, tuple[int, str]] = {}
    for n in chain.graph.module.graph.nodes:
        if n.op == "call_module" and n.name in block_of:
            out.setdefault(str(n.target), (block_of[n.name], n.name))
    return out


def _tokens_per_sample(chain: Chain, node: str, layer: ExpertLayer) -> float:
    """The tokens the experts take per sample: their output (one row of h per token) at the traced batch."""
    info = chain.graph.node(node).outputs[0] if chain.graph.node(node).outputs else None
    if info is None or info.batch_dim is None or not info.shape or info.shape[-1] != layer.hidden:
        raise PlanError(
            f"the experts of '{layer.path}' do not return one row of {layer.hidden} per token of the batch; they "
            "cannot be priced"
        )
    return math.prod(info.shape[:-1]) / chain.graph.batch_size


def _side_line(count: int, per_message_bytes: float, link: Link) -> Affine:
    """`count` messages of `per_message_bytes`·b bytes in a row over `link`: count·(α + m·b/BW)."""
    if count == 0:
        return Affine(0.0, 0.0)
    latency_s, bw = link.collective
    return Affine(count * per_message_bytes / bw, count * latency_s)


def expert_block_costs(
    chain: Chain,
    layers: Sequence[ExpertLayer],
    degree: int,
    cluster: Cluster,
    workload: Workload,
    *,
    imbalance: float = DEFAULT_IMBALANCE,
    experts_timed: bool = False,
) -> list[ExpertBlockCost]:
    """What each layer of `layers` (kept whole in `chain`'s capture) adds to its block at `degree` on `cluster`
    (see the module). `experts_timed`: the profile ran and timed the experts (measured on this machine), so their
    compute is not added. One line (PlanError) for a degree that does not split a layer, or a layer the capture
    traced into where E > 1."""
    where = _experts_nodes(chain)
    group = cluster.groups[0]
    per_node, nodes = group_span(degree, group.gpus_per_node)
    dtype_bytes = token_bytes(workload.precision)
    roofline = None if experts_timed else Roofline.from_gpu(cluster.gpu)
    compute_dtype = COMPUTE_DTYPES[workload.precision] or "float32"
    out = []
    for layer in layers:
        if layer.path not in where or not layer.kept_whole:
            if degree > 1:
                raise PlanError(
                    f"the experts of '{layer.path}' were traced into, not kept whole: capture the model with "
                    "leaf_modules=expert_leaves(model) for expert parallelism"
                )
            continue  # traced into at E = 1: its ops are in the profile already
        why = layer.why_not(degree)
        if why:
            raise PlanError(f"expert parallelism {degree} does not split '{layer.path}': {why}")
        block, node = where[layer.path]
        t = _tokens_per_sample(chain, node, layer)
        shape = ExpertShape.of(layer)
        # At one sample per micro-batch: FLOPs and bytes are linear in b.
        one = expert_cost(shape, degree=degree, tokens=t, dtype_bytes=dtype_bytes, ranks_per_node=per_node,
                          nodes=nodes, intra_link=group.intra_link, inter_link=group.inter_link,
                          imbalance=imbalance)  # fmt: skip
        flops = one.routed_forward_flops
        if roofline is None:
            fwd = bwd = Affine(0.0, 0.0)
        else:
            compute = roofline.peak(compute_dtype) * roofline.efficiency.compute["matmul"]
            memory = roofline.mem_bw_bytes_per_s * roofline.efficiency.memory["matmul"]
            weights = expert_state(shape, degree, workload).expert_params * dtype_bytes
            fwd = envelope([Affine(flops / compute, 0.0), Affine(0.0, weights / memory)])
            bwd = envelope([Affine(2 * flops / compute, 0.0), Affine(0.0, 2 * weights / memory)])
        comm = Affine(0.0, 0.0)
        if degree > 1:
            message = imbalance * all_to_all_bytes(t, layer.top_k, layer.hidden, dtype_bytes, degree) / (degree - 1)
            comm = envelope([
                _side_line(per_node - 1, message, group.intra_link),
                _side_line(degree - per_node, message, group.inter_link),
            ])  # fmt: skip
        inner = saved_elements_per_pair(layer.hidden, layer.intermediate, gated=layer.gated)
        saved = (imbalance * inner + layer.hidden) * t * layer.top_k * _TRACED_BYTES
        held = expert_state(shape, degree, workload).expert_params
        out.append(ExpertBlockCost(layer.path, block, t, fwd, bwd, comm, saved, flops,
                                   int(layer.num_experts * layer.expert_params - held)))  # fmt: skip
    return out


def _with_costs(blk: Block, costs: Sequence[ExpertBlockCost]) -> Block:
    if not costs:
        return blk
    assert blk.fwd_time_s is not None and blk.bwd_time_s is not None and blk.saved_bytes is not None
    fwd, bwd = blk.fwd_time_s, blk.bwd_time_s
    for c in costs:
        fwd, bwd = _plus(fwd, c.fwd_s), _plus(bwd, c.bwd_s)
    saved = sum(c.saved_bytes_per_sample for c in costs)
    flops = sum(c.flops_fwd_per_sample for c in costs)
    removed = sum(c.params_not_held for c in costs)
    per_param = blk.param_bytes / blk.param_numel if blk.param_numel else 0.0
    return replace(
        blk,
        fwd_time_s=fwd,
        bwd_time_s=bwd,
        saved_bytes=blk.saved_bytes + Affine(saved, 0.0),
        flops_fwd=(blk.flops_fwd or Affine()) + Affine(flops, 0.0),
        flops_bwd=(blk.flops_bwd or Affine()) + Affine(2 * flops, 0.0),
        param_numel=blk.param_numel - removed,
        param_bytes=round(blk.param_bytes - removed * per_param),
    )


def _memory_with(mem: RematBytes, saved: float) -> RematBytes:
    """A block's working memory with `saved` bytes per sample more kept through its forward and backward."""
    more = Affine(saved, 0.0)
    return replace(
        mem,
        kept_bytes=mem.kept_bytes + more,
        fwd_peak_bytes=mem.fwd_peak_bytes + more,
        fwd_nosave_peak_bytes=mem.fwd_nosave_peak_bytes + more,
        bwd_peak_bytes=mem.bwd_peak_bytes + more,
        selective_kept_bytes=None if mem.selective_kept_bytes is None else mem.selective_kept_bytes + more,
    )


def chain_at_expert_degree(
    chain: Chain,
    layers: Sequence[ExpertLayer],
    degree: int,
    cluster: Cluster,
    workload: Workload,
    *,
    imbalance: float = DEFAULT_IMBALANCE,
    experts_timed: bool = False,
) -> Chain:
    """`chain` (captured with the experts kept whole, profiled, its loss in or not) as a rank of an expert-parallel
    group of `degree` trains it on `cluster`: each block holding a layer's experts with their compute, all-to-alls,
    saved activations and the parameters the rank holds (`expert_block_costs`; the module says how). Pure: the
    chain's other blocks, cuts and graph are shared, not copied."""
    costs = expert_block_costs(chain, layers, degree, cluster, workload, imbalance=imbalance,
                               experts_timed=experts_timed)  # fmt: skip
    if not costs:
        return chain
    by_block: dict[int, list[ExpertBlockCost]] = {}
    for c in costs:
        by_block.setdefault(c.block, []).append(c)
    blocks = [_with_costs(blk, by_block.get(i, [])) for i, blk in enumerate(chain.blocks)]
    memory = chain.memory
    if memory is not None:
        saved = {i: sum(c.saved_bytes_per_sample for c in cs) for i, cs in by_block.items()}
        memory = RematProfile(
            tuple(_memory_with(m, saved[i]) if i in saved else m for i, m in enumerate(memory.blocks)),
            memory.grad_bytes,
        )
    return replace(chain, blocks=blocks, memory=memory)
