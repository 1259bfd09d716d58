// pyplan/partition.h — exact partition of a chain into p contiguous pipeline stages.
//
// Problem. Split the L blocks of a Chain into p non-empty contiguous stages [c_s, c_{s+1}),
// 0 = c_0 < c_1 < ... < c_p = L, minimizing the pipeline iteration time
//     T = Σ_s t_s + (m−1)·max_s t_s                  (Huang et al., gradient accumulation paper, eq. 1)
// subject to mem_s ≤ limit_s for every stage s, where for a stage over blocks [i, j):
//     t(i, j) = Σ_{k∈[i,j)} (fwd_k + bwd_k) + send(j) + send(i),  send(c) = α + cut_bytes[c]/BW
//               with send(0) = send(L) = 0: a stage pays the forward send of its output cut and the
//               gradient send of its input cut, so each inner boundary is paid twice, once per direction;
//     mem_s   = Σ_{k∈[i,j)} state_bytes_k + n_s·(Σ_{k∈[i,j)} act_bytes_k + cut_bytes[i]),
//               n_s the micro-batches in flight in stage s (GPipe m, 1F1B min(m, p−s)); the stage keeps
//               its input cut for backward. A tensor that is both in some act_bytes_k and in cut i
//               is counted twice (an over-estimate, never an under-estimate).
//
// Algorithm (the bottleneck enumeration of Alpa's stage construction, Zheng et al. 2022, §5.2). Let G(B)
// be the least Σ t_s over the partitions whose stages all have t_s ≤ B and fit in memory (∞ if none):
//     F[s][j] = least Σ t over the first s stages covering blocks [0, j), each t ≤ B and within memory
//               (s ∈ [0, p], j ∈ [0, L]; flat index s·(L+1) + j)
//     F[0][0] = 0,  F[0][j>0] = ∞
//     F[s][j] = min_{s−1 ≤ i < j, t(i,j) ≤ B, mem_{s−1}(i,j) ≤ limit_{s−1}} F[s−1][i] + t(i, j)
//     Choice[s][j] = the i attaining the minimum (the first cut of stage s−1);  G(B) = F[p][L].
// Each DP is O(p·L²). The optimum T* is min over the candidates B ∈ {t(i, j)} of G(B) + (m−1)·B (at the
// optimum's own bottleneck the DP finds a sum no larger). Alpa scans the candidates in increasing order and
// stops once (m−1)·B ≥ the best found; pyplan gets the same answer from fewer DPs:
//   1. G(∞) by one DP; if it is ∞, nothing fits (see below).
//   2. B*, the least feasible candidate, by bisection (feasibility is monotone in B).
//   3. Above B*, G is non-increasing. For a run of candidate ranks lo < k < hi whose ends are evaluated, no k
//      beats lo when G(lo) = G(hi) (same sum, larger bound), and no k beats the best T found when
//      G(hi) + (m−1)·B_{lo+1} ≥ T (Alpa's stop rule, tightened by the sum); otherwise the run is bisected.
// Every DP's partition is a candidate answer, scored by T on its own stage times. On L = 200, p = 16 this
// takes 15-35 DPs where the increasing scan takes up to ~450 (m = 2 with costly boundaries).
//
// The objective kBottleneck is the limit m → ∞ (torchgpipe's balance): it returns the partition at B*,
// i.e. least max_s t_s, then least Σ t_s; m still sets the in-flight micro-batches for memory.
//
// When no partition fits in memory, a min-max DP over the same table layout finds the partition whose
// worst overflow mem_s − limit_s is least, and the result names that stage: the smallest memory the chain
// would need.
#pragma once

#include <string>
#include <vector>

#include "pyplan/chain.h"
#include "pyplan/cost.h"

namespace pyplan {

// How many micro-batches' activations stage s holds at its peak.
enum class InFlight {
    kGPipe,     // every stage holds all m (all forwards before any backward)
    kOneFOneB,  // stage s (from 0) holds min(m, p−s) (PipeDream-Flush / 1F1B)
};

enum class PartitionObjective {
    kPipelineTime,  // Σ_s t_s + (m−1)·max_s t_s
    kBottleneck,    // max_s t_s, ties broken by Σ_s t_s (the limit m → ∞)
};

struct PartitionOptions {
    int num_stages = 1;        // p, 1 ≤ p ≤ L
    int num_microbatches = 1;  // m ≥ 1
    InFlight in_flight = InFlight::kOneFOneB;
    PartitionObjective objective = PartitionObjective::kPipelineTime;
    std::vector<double> mem_limit_bytes;  // [p] memory available to each stage
    Link link;                            // between consecutive stages
};

// The stage that overflows least when nothing fits: blocks [begin_cut, end_cut) as stage `stage`.
struct Overflow {
    int stage = -1;
    int begin_cut = -1;
    int end_cut = -1;
    int in_flight = 0;
    double need_bytes = 0.0;
    double limit_bytes = 0.0;
    double overflow_bytes() const { return need_bytes - limit_bytes; }
};

struct PartitionResult {
    bool feasible = false;
    std::vector<int> cuts;                   // [p+1] stage s is blocks [cuts[s], cuts[s+1])
    std::vector<double> stage_time_s;        // [p] t_s
    std::vector<double> stage_state_bytes;   // [p] weights + gradients + optimizer state
    std::vector<double> stage_act_bytes;     // [p] in_flight × (saved activations + input cut)
    std::vector<int> stage_in_flight;        // [p] micro-batches in flight
    double pipeline_time_s = 0.0;            // Σ t_s + (m−1)·max t_s of this partition
    double bottleneck_s = 0.0;               // max t_s
    Overflow overflow;                       // set when !feasible
    std::string reason;                      // one line, set when !feasible
};

// Micro-batches in flight in stage `stage` (from 0) of p under the rule.
int in_flight_microbatches(InFlight rule, int stage, int num_stages, int num_microbatches);

// The exact optimum. Throws std::invalid_argument on malformed input (array lengths, p outside [1, L],
// m < 1, negative or NaN values); an input that fits no partition returns feasible = false and a reason.
PartitionResult partition(const Chain& chain, const PartitionOptions& options);

}  // namespace pyplan
