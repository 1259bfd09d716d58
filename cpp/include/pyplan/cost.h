// pyplan/cost.h — the closed-form cost model: communication, model-state memory, pipeline time.
//
// Every function is a formula of DESIGN.md "Cost model"; the units are in the names (seconds, bytes,
// bytes per second). Collectives follow the α-β model: a message of n bytes over a link costs
// latency_s + n / bw_bytes_per_s. Invalid arguments (d < 1, bytes or times outside [0, kMaxValue], a
// bandwidth below kMinBwBytesPerS, NaN, ...; limits.h) throw std::invalid_argument naming the argument, its
// value and the range. A bandwidth of +∞ is a free transfer (only the latency is paid).
#pragma once

#include <vector>

namespace pyplan {

// An α-β link: per-message latency α and bandwidth 1/β.
struct Link {
    double latency_s = 0.0;
    double bw_bytes_per_s = 1.0;
};

// Bytes per parameter of each kind of model state, a stated convention (DESIGN.md: tools disagree).
// Mixed-precision Adam as counted by the ZeRO paper is {2, 2, 12}: fp16 weights, fp16 gradients,
// fp32 master weights + momentum + variance.
struct BytesPerParam {
    double param_bytes = 0.0;
    double grad_bytes = 0.0;
    double optim_bytes = 0.0;
};

// Model-state bytes held by one GPU.
struct ModelStateBytes {
    double param_bytes = 0.0;
    double grad_bytes = 0.0;
    double optim_bytes = 0.0;
    double total_bytes() const { return param_bytes + grad_bytes + optim_bytes; }
};

// Point-to-point send: c(n) = α + n/BW.
double p2p_time_s(const Link& link, double bytes);

// Ring all-reduce of `bytes` over d ranks: 2(d−1)·(α + G/(d·BW)) (Jansen thesis, eq. 5.1). 0 when d = 1.
double ring_allreduce_time_s(const Link& link, double bytes, int num_ranks);

// Ring reduce-scatter or all-gather of a `bytes`-sized tensor (each rank ends with or starts from G/d):
// (d−1)·(α + G/(d·BW)), half a ring all-reduce. ZeRO-2/3 use them (Rajbhandari et al. 2020, §7).
double reduce_scatter_time_s(const Link& link, double bytes, int num_ranks);
double all_gather_time_s(const Link& link, double bytes, int num_ranks);

// Hierarchical all-reduce over n nodes of g GPUs (d = g·n): reduce-scatter inside each node over `intra`,
// then g concurrent ring all-reduces across nodes over `inter`, each on the node's 1/g shard, then an
// all-gather inside the node:
//   2(g−1)·(α_intra + G/(g·BW_intra)) + 2(n−1)·(α_inter + G/(g·n·BW_inter)).
// inter.bw_bytes_per_s is the bandwidth each of the g concurrent rings gets (per-GPU NICs); when the
// node's GPUs share one NIC of bandwidth B, pass B/g. Equals ring_allreduce_time_s(intra) when n = 1
// and ring_allreduce_time_s(inter) when g = 1.
double hierarchical_allreduce_time_s(const Link& intra, const Link& inter, double bytes, int gpus_per_node,
                                     int num_nodes);

// Model-state bytes per GPU for Ψ parameters under ZeRO stage 0-3 over d data-parallel replicas
// (Rajbhandari et al. 2020, §5 and Figure 1), with P, G, K the bytes per parameter of weights,
// gradients and optimizer state:
//   stage 0: (P+G+K)·Ψ            stage 1: (P+G)·Ψ + K·Ψ/d
//   stage 2: P·Ψ + (G+K)·Ψ/d      stage 3: (P+G+K)·Ψ/d
// Check: Ψ = 7.5e9, d = 64, {2, 2, 12}: 120, 31.4, 16.6, 1.9 GB.
ModelStateBytes zero_model_state_bytes(double num_params, int num_replicas, int zero_stage,
                                       const BytesPerParam& bytes_per_param);

// Iteration time of a pipeline from its per-micro-batch stage times t_s:
// Σ_s t_s + (m−1)·max_s t_s (Huang et al., gradient accumulation on cloud training, eq. 1).
double pipeline_time_s(const std::vector<double>& stage_time_s, int num_microbatches);

// Idle fraction of a balanced pipeline of p stages over m micro-batches: (p−1)/(m+p−1). Interleaving v
// chunks per GPU divides the bubble time by v (Narayanan et al. 2021, §2.2), giving (p−1)/(v·m+p−1).
double bubble_fraction(int num_stages, int num_microbatches, int num_chunks = 1);

// A memory-bound optimizer step: (bytes read + bytes written) / memory bandwidth.
double optimizer_step_time_s(double bytes_read, double bytes_written, double mem_bw_bytes_per_s);

}  // namespace pyplan
