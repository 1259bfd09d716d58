"""The cost of a mixture-of-experts layer at expert-parallel degree E: per-rank compute, all-to-alls, model state.

Glossary. A layer has N routed experts, each a feed-forward network of P_e parameters; its router (P_r parameters)
sends every token to its top k of them, and its shared experts (P_s parameters in all) take every token. Expert
parallelism splits the N experts over the E ranks of a group, N/E each. Every rank of the group brings its own T
tokens: the group is carved out of ranks whose tokens differ (data-parallel replicas, or context- and
sequence-parallel shards), as Megatron-LM's and torchtitan's expert parallelism are. A rank routes its tokens,
sends each (token, expert) pair to the rank that holds the expert (dispatch) and receives the expert's output
back (combine).

Compute, as FLOPs of the matrix products (the activation, the gate product and the weighted sum are element-wise
and left out, as in the 6·N rule):
- one token through one expert costs 2·P_e forward and 4·P_e backward (input and weight gradients); a gated
  (SwiGLU) expert of intermediate size f has P_e = 3·h·f, a plain one 2·h·f (`ffn_params`);
- the group routes E·T·k pairs; an expert expects E·T·k/N of them and a rank's N/E experts T·k, whatever E is:
  expert parallelism spreads the experts' weights, not the work. The busiest rank computes `imbalance` times the
  mean, so its routed forward FLOPs are imbalance · T · k · 2·P_e;
- the router and the shared experts run on each rank's own tokens: T · 2·(P_r + P_s) forward.

Communication. An all-to-all sends, from each rank, the pairs whose expert lives on another rank: in expectation
S = T·k·h·B·(E−1)/E bytes (B bytes an element), S/(E−1) to each of the E−1 peers. Training runs four per layer
and micro-batch, each of S bytes: dispatch and combine in forward, their gradients in backward. Time is α-β like
pyplan's other collectives (cpp/include/pyplan/cost.h, a latency per message): a group of g ranks per node on n
nodes (E = g·n) sends g−1 messages over the link inside a node and E−g over the link between nodes, at once (NCCL
posts every peer's send together, and the two links carry them side by side), so

    t = max((g−1)·(α_intra + m/BW_intra), (E−g)·(α_inter + m/BW_inter)),   m = imbalance · S/(E−1).

The link figures are the catalog's collective ones, per GPU (pyplan/hardware/data/links.toml: a node whose GPUs
share a port gives each GPU its fraction of it), which is how the GPUs of a node share its network. The busiest
rank receives `imbalance` times the mean, and the all-to-all ends when it has.

Model state. A rank holds its N/E experts' weights, gradients and optimizer state alone (divided by E); the router
and the shared experts are replicated like any dense layer. Bytes per parameter are the workload's convention
(`Workload.bytes_per_param`, pyplan/model_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pyplan.errors import PlanError
from pyplan.hardware.catalog import Link
from pyplan.model_state import activation_scale
from pyplan.plan import Workload

__all__ = [
    "DEFAULT_IMBALANCE",
    "ExpertCost",
    "ExpertLayerFields",
    "ExpertShape",
    "ExpertState",
    "all_to_all_bytes",
    "all_to_all_time_s",
    "expert_cost",
    "expert_state",
    "ffn_params",
    "router_params",
    "token_bytes",
]

# The busiest rank's routed tokens over the mean (≥ 1). 1.0 is balanced routing, what every published MoE
# throughput run in benchmarks/_moe_runs.py measured (NeMo/Megatron-Bridge and torchtitan force-balance the router
# in benchmarks), and the capacity factor DeepSpeed defaults to (deepspeed/moe/layer.py, `capacity_factor: float =
# 1.0`, 0.19.8) and Megatron-LM's MoE README recommends ("a relatively small number like 1.0", at commit
# 0b981f9c53): with capacity-padded token dropping every expert computes its capacity, so the factor is exactly the
# capacity factor. A trained router's skew costs more: Megatron-MoE-ModelZoo's Qwen3-235B-A22B runs on 256 H100s
# at 16K-128K tokens a sequence (best_practice/qwen3/readme.md at e8650517, "Long Context") reach 1.09-1.25x the
# TFLOPS with forced balance that they reach dropless, over the whole step. The sampling noise of a balanced router
# is no reason to raise it: at training sizes it is about 1 % (tests/profile/test_experts_cost.py simulates it).
DEFAULT_IMBALANCE = 1.0


class ExpertLayerFields(Protocol):
    """What this module reads of a captured MoE layer (pyplan/graph/experts.py's `ExpertLayer`), by field name."""

    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def expert_params(self) -> int: ...
    @property
    def shared_params(self) -> int: ...
    @property
    def router_params(self) -> int: ...


def ffn_params(hidden: int, intermediate: int, *, gated: bool, bias: bool = False) -> int:
    """Parameters of one feed-forward expert: gated (SwiGLU: gate, up and down matrices) 3·h·f, else 2·h·f; with
    biases, f on each input-side matrix and h on the output one."""
    if hidden < 1 or intermediate < 1:
        raise PlanError(f"an expert needs positive sizes, got hidden {hidden} and intermediate {intermediate}")
    matrices = 3 if gated else 2
    biases = ((matrices - 1) * intermediate + hidden) if bias else 0
    return matrices * hidden * intermediate + biases


def router_params(hidden: int, num_experts: int, *, bias: bool = False) -> int:
    """Parameters of a linear router: an h × N matrix, plus N biases where it has them."""
    if hidden < 1 or num_experts < 1:
        raise PlanError(f"a router needs positive sizes, got hidden {hidden} and {num_experts} experts")
    return hidden * num_experts + (num_experts if bias else 0)


@dataclass(frozen=True)
class ExpertShape:
    """One MoE layer as the cost model sees it: N routed experts of `expert_params` each, the top `top_k` taken per
    token of `hidden` elements, and the parameters every token uses: the shared experts' and the router's."""

    num_experts: int
    top_k: int
    hidden: int
    expert_params: int
    shared_params: int = 0
    router_params: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise PlanError(
                f"an MoE layer routes each token to 1..{self.num_experts} of its {self.num_experts} experts, got top-k "
                f"{self.top_k}"
            )
        if self.hidden < 1 or self.expert_params < 1:
            raise PlanError(
                f"an MoE layer needs a positive hidden size and expert size, got {self.hidden} and {self.expert_params}"
            )
        if self.shared_params < 0 or self.router_params < 0:
            raise PlanError(
                f"parameter counts cannot be negative: shared {self.shared_params}, router {self.router_params}"
            )

    @staticmethod
    def of(layer: ExpertLayerFields) -> ExpertShape:
        """The shape of a captured layer, read by field name."""
        return ExpertShape(
            num_experts=layer.num_experts,
            top_k=layer.top_k,
            hidden=layer.hidden,
            expert_params=layer.expert_params,
            shared_params=layer.shared_params,
            router_params=layer.router_params,
        )

    @property
    def dense_params(self) -> int:
        """Parameters every token uses and every rank holds: the shared experts' and the router's."""
        return self.shared_params + self.router_params

    @property
    def total_params(self) -> int:
        return self.num_experts * self.expert_params + self.dense_params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by: its k experts', the shared experts' and the router's."""
        return self.top_k * self.expert_params + self.dense_params

    @property
    def forward_flops_per_token(self) -> int:
        """Matrix-product FLOPs of one token's forward through the layer: 2 per active parameter."""
        return 2 * self.active_params


@dataclass(frozen=True)
class ExpertCost:
    """One MoE layer on the busiest rank of an expert-parallel group of `degree`, for one micro-batch.

    `tokens` are the rank's own (T), `expert_tokens` the (token, expert) pairs its `local_experts` compute
    (imbalance · T · k); `all_to_all_bytes` is what a rank sends in each of the four all-to-alls in expectation (S),
    `all_to_all_s` the time of one, set by the busiest receiver."""

    degree: int
    local_experts: int
    tokens: float
    expert_tokens: float
    routed_forward_flops: float
    dense_forward_flops: float
    all_to_all_bytes: float
    all_to_all_s: float

    @property
    def tokens_per_local_expert(self) -> float:
        """Rows of each local expert's matrix products (E·T·k/N, times the imbalance): the grouped GEMM's M."""
        return self.expert_tokens / self.local_experts

    @property
    def forward_flops(self) -> float:
        return self.routed_forward_flops + self.dense_forward_flops

    @property
    def backward_flops(self) -> float:
        """Input and weight gradients: twice the forward's matrix products."""
        return 2 * self.forward_flops

    @property
    def forward_comm_s(self) -> float:
        """Dispatch and combine."""
        return 2 * self.all_to_all_s

    @property
    def backward_comm_s(self) -> float:
        """The gradients of combine and dispatch."""
        return 2 * self.all_to_all_s


def token_bytes(precision: str) -> float:
    """Bytes of one element of the tokens an all-to-all moves: the activations' dtype under `precision` (2 in the
    16-bit precisions, 4 in fp32; pyplan.model_state.activation_scale)."""
    return 4 * activation_scale(precision)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, dtype_bytes: float, degree: int) -> float:
    """Bytes one rank sends in one dispatch (or combine) all-to-all, in expectation: its T·k pairs of h elements of
    `dtype_bytes` each, less the 1/E whose expert is its own."""
    _check_degree(degree)
    if tokens < 0 or dtype_bytes <= 0:
        raise PlanError(f"an all-to-all needs tokens >= 0 and a positive element size, got {tokens} and {dtype_bytes}")
    return tokens * top_k * hidden * dtype_bytes * (degree - 1) / degree


def all_to_all_time_s(nbytes: float, *, ranks_per_node: int, nodes: int, intra_link: Link, inter_link: Link) -> float:
    """Seconds of an all-to-all in which each of `ranks_per_node` × `nodes` ranks sends `nbytes` in all, evenly to
    each peer: the peers in its node over `intra_link` and the others over `inter_link`, side by side, each message
    paying its link's latency (the module's docstring has the formula)."""
    if ranks_per_node < 1 or nodes < 1:
        raise PlanError(f"an all-to-all group spans >= 1 ranks on >= 1 nodes, got {ranks_per_node} x {nodes}")
    if nbytes < 0:
        raise PlanError(f"an all-to-all cannot send {nbytes} bytes")
    degree = ranks_per_node * nodes
    if degree == 1:
        return 0.0
    message = nbytes / (degree - 1)
    inside = _messages_s(ranks_per_node - 1, message, intra_link)
    across = _messages_s(degree - ranks_per_node, message, inter_link)
    return max(inside, across)


def _messages_s(count: int, message: float, link: Link) -> float:
    if count == 0:
        return 0.0
    latency_s, bw_bytes_per_s = link.collective
    return count * (latency_s + message / bw_bytes_per_s)


def expert_cost(
    shape: ExpertShape,
    *,
    degree: int,
    tokens: float,
    dtype_bytes: float,
    ranks_per_node: int,
    nodes: int,
    intra_link: Link,
    inter_link: Link,
    imbalance: float = DEFAULT_IMBALANCE,
) -> ExpertCost:
    """The busiest rank's share of one MoE layer's work and traffic for a micro-batch of `tokens` tokens per rank,
    with the `degree` ranks of the expert-parallel group placed `ranks_per_node` to a node on `nodes` nodes."""
    _check_degree(degree)
    if shape.num_experts % degree:
        raise PlanError(
            f"expert parallelism {degree} must divide the layer's {shape.num_experts} experts (each rank holds "
            "whole experts)"
        )
    if ranks_per_node * nodes != degree:
        raise PlanError(
            f"an expert-parallel group of {degree} ranks cannot be {ranks_per_node} ranks a node on {nodes} nodes"
        )
    if not imbalance >= 1:
        raise PlanError(f"the imbalance is the busiest rank's load over the mean, at least 1, got {imbalance}")
    sent = all_to_all_bytes(tokens, shape.top_k, shape.hidden, dtype_bytes, degree)
    expert_tokens = imbalance * tokens * shape.top_k
    return ExpertCost(
        degree=degree,
        local_experts=shape.num_experts // degree,
        tokens=tokens,
        expert_tokens=expert_tokens,
        routed_forward_flops=expert_tokens * 2 * shape.expert_params,
        dense_forward_flops=tokens * 2 * shape.dense_params,
        all_to_all_bytes=sent,
        all_to_all_s=all_to_all_time_s(
            imbalance * sent,
            ranks_per_node=ranks_per_node,
            nodes=nodes,
            intra_link=intra_link,
            inter_link=inter_link,
        ),
    )


@dataclass(frozen=True)
class ExpertState:
    """One MoE layer's model state on one rank: parameter elements and bytes of its own experts (N/E of them) and
    of the router and shared experts every rank holds."""

    expert_params: float
    dense_params: float
    expert_bytes: float
    dense_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.expert_bytes + self.dense_bytes


def expert_state(
    shape: ExpertShape, degree: int, workload: Workload, *, dp: int = 1, expert_dp: int = 1, zero_stage: int = 0
) -> ExpertState:
    """Model-state bytes of one MoE layer on a rank at expert parallelism `degree`, under the workload's bytes per
    parameter and ZeRO stage: the rank's experts are sharded over the `expert_dp` ranks holding the same experts
    (dp/E when expert parallelism is carved out of dp replicas), the router and shared experts over `dp`."""
    _check_degree(degree)
    if shape.num_experts % degree:
        raise PlanError(f"expert parallelism {degree} must divide the layer's {shape.num_experts} experts")
    expert_params = shape.num_experts // degree * shape.expert_params
    dense_params = shape.dense_params
    return ExpertState(
        expert_params=expert_params,
        dense_params=dense_params,
        expert_bytes=workload.state_bytes_per_gpu(expert_params, expert_dp, zero_stage),
        dense_bytes=workload.state_bytes_per_gpu(dense_params, dp, zero_stage),
    )


def _check_degree(degree: int) -> None:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise PlanError(f"the expert-parallel degree must be a positive integer, got {degree!r}")
