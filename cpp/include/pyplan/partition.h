// pyplan/partition.h — exact partition of a chain into p contiguous pipeline stages.
//
// Problem. Split the L blocks of a Chain into p non-empty contiguous stages [c_s, c_{s+1}),
// 0 = c_0 < c_1 < ... < c_p = L, minimizing the pipeline iteration time
//     T = Σ_s t_s + (m−1)·max_s t_s                  (Huang et al., gradient accumulation paper, eq. 1)
// subject to mem_s ≤ limit_s for every stage s, where for a stage over blocks [i, j):
//     t(i, j) = (W[j] − W[i]) + send(j) + send(i),   W[c] = Σ_{k<c} (fwd_k + bwd_k) (prefix sums),
//               send(c) = α + cut_bytes[c]/BW with send(0) = send(L) = 0: a stage pays the forward send of
//               its output cut and the gradient send of its input cut, so each inner boundary is paid
//               twice, once per direction;
//     mem_s   = Σ_{k∈[i,j)} state_bytes_k + n_s·(Σ_{k∈[i,j)} act_bytes_k + cut_bytes[i]),
//               summed block by block in this order; n_s the micro-batches in flight in stage s
//               (GPipe m, 1F1B min(m, p−s), or in_flight_per_stage[s] when given, e.g. the simulated
//               peak of an interleaved schedule); the stage keeps its input cut for backward. A tensor
//               that is both in some act_bytes_k and in cut i is counted twice (an over-estimate).
//               mem_s also adds input_buffer_cuts[s]·cut_bytes[i] + output_buffer_cuts[s]·cut_bytes[j] when
//               given (the runtime's receive buffers beyond the inputs in flight, the first stage's batch, kept
//               gradients and sends); the sure/loose estimates below take both cuts (κ, or 0).
//               A stage marked in fresh_grads makes its parameter gradients (Γ = Σ grad_bytes_k, part of the
//               state) again after its activations peak: zero_grad freed them, and every micro-batch runs its
//               forward before the stage's first backward. It holds at least every gradient (at the step) and at
//               least its state less the gradients plus its saved activations (before the first backward), so
//               mem_s leaves out min(Γ, n_s·A), with S and A the stage's Σ state_bytes_k and Σ act_bytes_k:
//               mem_s = S + n_s·(A + cut_i) − min(Γ, n_s·A) + buffers = max(S, S − Γ + n_s·A) + n_s·cut_i +
//               buffers, both terms sums of non-negative block terms as the estimates below need
//               (pyplan/solve/remat_search.py's unmade_grad_bytes finds what the replay leaves out exactly).
// Times are these floating-point expressions, evaluated the same way everywhere (bounds, candidates,
// results), so that "t ≤ B" means one thing; memory is compared in the block-by-block sum above.
//
// Least sum under a bound (the DP). G(B) is the least Σ t_s over the partitions whose stages all have
// t_s ≤ B and fit in memory (∞ if none):
//     F[s][j] = least Σ t over the first s stages covering blocks [0, j), each t ≤ B and within memory
//               (s ∈ [0, p], j ∈ [0, L])
//     F[0][0] = 0,  F[0][j>0] = ∞
//     F[s][j] = min_{i ∈ A_s(j)} F[s−1][i] + t(i, j),
//               A_s(j) = {i < j : t(i, j) ≤ B, mem_{s−1}(i, j) ≤ limit_{s−1}}
//     Choice[s][j] = the i attaining the minimum (the first cut of stage s−1);  G(B) = F[p][L].
// The cost separates: F[s−1][i] + t(i, j) = a_i + (W[j] + send(j)) with a_i = F[s−1][i] − W[i] + send(i),
// so F[s][j] is a minimum of a_i over A_s(j). A_s(j) itself need not be an interval (send(i) and
// cut_bytes[i] jump with i), but it lies between two intervals whose ends move only forward:
//     loose(j) = least i with W[j] − W[i] ≤ B and S(i, j) + n·A(i, j) ≤ limit + ε      (necessary)
//     sure(j)  = least i with W[j] − W[i] + 2σ ≤ B and S(i, j) + n·(A(i, j) + κ) ≤ limit − ε  (sufficient)
// with S, A the prefix-sum state and activation bytes of [i, j) (for a stage in fresh_grads, S + n·A stands for
// max(S, K + n·A), K the prefix-sum state less gradients), n = n_{s−1}, σ the largest send, κ the largest cut
// and ε a bound on the rounding of prefix sums against the block-by-block sum (a range within ε of the limit is
// summed block by block). Every term is a difference of non-decreasing prefix
// sums (rounding is monotone), so both conditions get harder as i falls or j grows: loose(j) ≤ sure(j)
// are non-decreasing in j, and
//     [sure(j), j)  ⊆  A_s(j)  ⊆  [loose(j), j).
// Two pointers track them; a monotone deque (increasing i, increasing a_i) gives the minimum of a_i over
// [sure(j), j) in amortized O(1); the few starts in the fringe [loose(j), sure(j)) (block times within 2σ
// of B, or memory within one cut of the limit) are checked one by one. Rows are also cut to a band: row
// s stops where the window passes the last finite F[s−1][i], and keeps only j ≥ rest[s], the least cut
// from which stages s..p−1 could cover [j, L) under the necessary condition (computed from the last
// stage back). The table stores each row's band only: row s holds cuts [first_s, first_s + its length)
// at flat index offset_s + (j − first_s). One DP costs O(p·L) plus the fringe, and far less near B*
// where the bands are narrow (it was O(p·L²) over all (i, j)).
//
// The optimum (the bottleneck enumeration of Alpa's stage construction, Zheng et al. 2022, §5.2). The
// candidates are the values t(i, j) of the ranges some stage can cover (i + L − j ≥ p − 1); G steps
// only at candidates, G(B) = G(the largest candidate ≤ B), and G is non-increasing. T* = min over
// candidates B of G(B) + (m−1)·B (at the optimum's own bottleneck the DP finds a sum no larger). Alpa
// scans the candidates in increasing order and stops once (m−1)·B ≥ the best found; pyplan gets the same
// answer from fewer DPs and never lists the O(L²) candidates: the least candidate above x and the
// greatest at or below x are found in O(L + fringe) by the same two-pointer argument (next_candidate,
// prev_candidate). It keeps runs (lo, hi] of bounds with G(lo) known and a lower bound g_hi on G over the
// run (G(hi) when hi is finite), starting with (−∞, ∞]: G(−∞) = ∞ and no partition sums to less than W
// plus both sends of the p−1 cheapest inner cuts. A run is closed when no candidate lies strictly inside,
// when G(lo) ≤ g_hi (G is constant on it: same sum, larger bound), or when g_hi + (m−1)·(least candidate
// above lo) ≥ the best T found (Alpa's stop rule, tightened by the sum). Otherwise one DP at a candidate
// c strictly inside splits it: its partition has bottleneck b ≤ c and G(b) = G(c), giving runs (lo, b]
// and (c, hi]. c is the candidate nearest the middle of the run's values; for hi = ∞ it gallops up from
// max(W/p, largest block time), doubling its distance from there: DPs under bounds near B* are cheap (the
// bands are narrow, and an infeasible bound usually fails in rest[]), the wide DPs under large bounds
// are run only when the stop rule cannot exclude them (m = 1, or large sends). Every DP's partition is
// a candidate answer, scored by T on its own stage times; none found means no partition fits in memory.
// Both closing tests treat values within a relative 1e-12 as equal: the DP sums the same stage times in
// another order than the result does (they differ by about L·ε), and many partitions often tie exactly
// (equal cut sizes); the optimum is exact up to that share.
//
// The objective kBottleneck is the limit m → ∞ (torchgpipe's balance): the partition of least max_s t_s,
// then least Σ t_s, i.e. the DP at the least feasible candidate B*; only runs with G(lo) = ∞ stay open.
// m still sets the in-flight micro-batches for memory.
//
// When no partition fits in memory, a min-max DP over the same table layout finds the partition whose
// worst overflow mem_s − limit_s is least, and the result names that stage: the smallest memory the chain
// would need. H[0][0] = −∞, H[0][j>0] = ∞, H[s][j] = min_{i<j} max(H[s−1][i], mem_{s−1}(i, j) − limit_{s−1}),
// with mem by prefix sums; the scan over i goes down from j − 1 and stops once the stage alone overflows
// by the best found. O(p·L²) at worst, run only when nothing fits.
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
    std::vector<int> in_flight_per_stage;  // [p] n_s in [1, m] for each stage; empty: the in_flight rule
    PartitionObjective objective = PartitionObjective::kPipelineTime;
    std::vector<double> mem_limit_bytes;  // [p] memory available to each stage
    Link link;                            // between consecutive stages
    // [p] tensors of its input cut stage s holds beyond its n_s in-flight inputs, and of its output cut: mem_s adds
    // input_buffer_cuts[s]·cut_bytes[i] + output_buffer_cuts[s]·cut_bytes[j]. What the runtime holds beside the
    // activations (search.h step 9): receive buffers posted ahead of their forward, the rest of the replica's
    // batch on the first stage and a kept input gradient (held_input_cuts); output gradients received or handed
    // over (simulate.h's receive_buffers) and a kept send (warmup_send_held). Empty: none.
    std::vector<long long> input_buffer_cuts;
    std::vector<long long> output_buffer_cuts;
    // [p] stage s makes its gradients (the chain's grad_bytes) after its activations peak: mem_s leaves out
    // min(G, n_s·A) (above). Empty: no stage.
    std::vector<bool> fresh_grads;
    // [p+1] a partition to evaluate instead of searching one: 0 = cuts[0] < ... < cuts[p] = L. Empty: search.
    std::vector<int> fixed_cuts;
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
    std::vector<double> stage_unmade_grad_bytes;  // [p] what mem_s leaves out of state + activations (fresh_grads)
    std::vector<int> stage_in_flight;        // [p] micro-batches in flight
    double pipeline_time_s = 0.0;            // Σ t_s + (m−1)·max t_s of this partition
    double bottleneck_s = 0.0;               // max t_s
    Overflow overflow;                       // set when !feasible
    std::string reason;                      // one line, set when !feasible
};

// Micro-batches in flight in stage `stage` (from 0) of p under the rule.
int in_flight_microbatches(InFlight rule, int stage, int num_stages, int num_microbatches);

// Input-cut-sized tensors stage `stage` holds beyond its n in-flight inputs and its receive buffers: the first stage
// the rest of the replica's batch, m − n micro-batches (the schedule splits the batch into views, and the whole
// batch lives through the step; measured as the input tensor the benchmark's first-stage rank holds); a later
// stage, when a backward can run beside n − 1 others in flight after an earlier one (n < m), the input gradient
// it keeps from its last backward until its next (Schedule1F1B's loop holds the op that sent it).
// Measured on the zoo's 1x2 1F1B pipelines: the last stage's peak held one such tensor more than the plan
// (vgg-tiny b=16: 525 KB against 524 KB cuts; gpt-tiny and resnet-tiny alike); GPipe's peak (all m in flight,
// before any backward) does not.
// Throws std::invalid_argument unless m ≥ 1, 1 ≤ in_flight ≤ m and stage ≥ 0.
int held_input_cuts(int num_microbatches, int in_flight, int stage);

// What mem_s leaves out of a stage in fresh_grads: min(Γ, n·A), from its block-by-block sums of grad_bytes (Γ) and
// act_bytes (A, without the input cut) and its n micro-batches in flight; its need is then
// (S + n·(A + cut)) − this, plus its buffers, in that order wherever it is computed.
double unmade_grad_bytes(double grad_bytes, int in_flight, double act_bytes);

// The exact optimum. Throws std::invalid_argument on malformed input (array lengths, p outside [1, L],
// m < 1, times and bytes outside [0, kMaxValue] or NaN, memory limits outside [0, kMaxValue] and not +∞, a link
// latency outside [0, kMaxValue] or bandwidth below kMinBwBytesPerS (+∞: sends cost only the latency; limits.h),
// in_flight_per_stage of the wrong length or outside [1, m], input_buffer_cuts or output_buffer_cuts of the wrong
// length or outside [0, kMaxBytes], fresh_grads of the wrong length, grad_bytes of the wrong length or outside
// [0, state_bytes]); an input that fits no partition returns feasible = false and a reason.
// Within those ranges every result is finite.
PartitionResult partition(const Chain& chain, const PartitionOptions& options);

}  // namespace pyplan
