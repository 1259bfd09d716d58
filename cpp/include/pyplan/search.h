// pyplan/search.h — the plan search: data parallelism × pipeline stages × micro-batches × schedule × ZeRO.
//
// Indices. d data-parallel replicas, p pipeline ranks, v stages per rank (model chunks: 1 for GPipe and 1F1B, any
// allowed v ≥ 2 for Interleaved1F1B and LoopedBFS), so p·v stages; b samples per micro-batch, m micro-batches
// (gradient accumulation steps) with d·b·m = B, the global batch. Stage s (from 0) runs on pipeline rank s mod p
// (torch's loop placement). Pipeline k (from 0, one per replica) puts its pipeline rank r on GPU
//     "pp-inner": k·p + r   (a pipeline's ranks are consecutive)
//     "dp-inner": r·d + k   (a stage's replicas are consecutive)
// and GPU x lies in node x / g. The two placements coincide when d = 1 or p = 1 (evaluated once), and
// every ZeRO stage is the same plan when d = 1 (evaluated once, as the first listed).
//
// Enumeration. Every d, p with d·p = N (or d·p ≤ N with allow_fewer_gpus) and S = p·v ≤ L stages, v among the
// allowed stages_per_rank that the schedule runs (1 for GPipe and 1F1B, 2 or more for the interleaved ones, only
// with p ≥ 2: several stages on one rank and no pipeline gain nothing); every allowed b
// (by default every b dividing B/d, found in O(√(B/d))) with m = B/(d·b); every allowed schedule that torch
// 2.13 builds for (p, m, v) (torch_rejection) with S·m ≤ kMaxStageMicrobatches (limits.h: the size of its
// order and simulation; the reason names the candidates left out when nothing is found); every allowed
// ZeRO stage and placement (with zero3_single_stage, ZeRO-3 only where p·v = 1, under 1F1B: pyplan's runtime
// trains one micro-batch after the other there, as 1F1B does with one stage, and over several stages torch's
// pipelining reduces FSDP2's gradients once a step). The zero-bubble
// schedules are not
// searched yet: they need split I/W times, and they give wrong gradients under DDP/FSDP2 on torch 2.13.
//
// Model of one candidate (units in names; citations in cost.h and partition.h):
//  1. Block i at micro-batch size b: f_i = fwd_alpha_i·b + fwd_beta_i, g_i likewise (Huang et al. eq. 2-3).
//     ZeRO-3 (Rajbhandari et al. 2020) adds, per micro-batch, the all-gather of the block's weights
//     (params_i·P bytes) to f_i and to g_i, and the reduce-scatter of its gradients (params_i·G) to g_i.
//  2. Links. The pipeline link is `intra` when every boundary of every pipeline joins two GPUs of one node,
//     else `inter` (one link per candidate: partition takes one). The dp group of each pipeline rank is
//     laid out on nodes: all in one node: ring over intra (g' = d, n' = 1); the same g' members in each of
//     n' nodes, for every group: hierarchical all-reduce (g', n'); otherwise: ring over inter (g' = 1,
//     n' = d), a conservative stand-in for an uneven layout. A reduce-scatter or an all-gather over the
//     group costs half its all-reduce.
//  3. Stages: partition() of the chain into p·v stages (cost.h's closed form Σ t + (m−1)·max t, each
//     stage within gpu_mem_bytes, receive buffers included, step 9), with state bytes zero_model_state_bytes(params, d, zero) and
//     activations n_s·(saved bytes + input cut bytes) at b. n_s: GPipe m, 1F1B min(m, p−s); with v ≥ 2
//     (Interleaved1F1B, LoopedBFS) the simulated peak in flight of stage s, which depends only on the
//     order, given to the partition as its per-stage in-flight counts. The lower bounds below use the
//     same n_s. With v ≥ 2 the v stages of a rank share its memory, and their own peaks do not coincide: the
//     rank holds max over time of Σ_j n_j(t)·(saved + input cut bytes)_j, the largest over the count vectors of
//     simulate.h's in_flight_peaks (the first on a tie); stage s's activations are its count in that vector
//     times its bytes (at most n_s times them), and a candidate whose rank exceeds gpu_mem_bytes after
//     partitioning is infeasible (not yet part of the partition itself, whose per-stage check at n_s is
//     necessary, not sufficient). This step has no working memory of a running action to add (activations are
//     the blocks' saved bytes); the remat refinement (pyplan/solve/remat_search.py) adds it.
//     With fresh_gradients, a stage of one replica (d = 1, so ZeRO 0) and one stage per rank that runs every
//     micro-batch's forward before its first backward (n_s = m: GPipe, and 1F1B where m = p − s) makes its
//     parameter gradients again after its activations peak (zero_grad freed them; no DDP bucket holds them):
//     its state and activations count min(gradients, n_s·saved bytes) less, what it holds at least before its
//     first backward and at the step (partition.h's fresh_grads; stage_unmade_grad_bytes). A lower bound: the
//     replay of the stage (pyplan/solve/remat_search.py's unmade_grad_bytes) finds what it leaves out exactly.
//  4. Makespan: simulate() of the schedule's per-rank order with the stages' F = Σ f_i and B = Σ g_i and
//     boundary sends p2p(pipeline link, cut bytes at b). The closed form the partition minimizes can
//     undercut the simulation for uneven stages and sends (measured: up to 65 % for GPipe with uneven F/B,
//     16 % for 1F1B with sends); the reported time is the simulated one.
//  5. Gradient sync (d > 1, ZeRO 0-2): an all-reduce (ZeRO 0), or reduce-scatter + all-gather (ZeRO 1-2,
//     the same volume), of stage s's gradients (params_s·G bytes) over its dp group, overlapped with the
//     stage's last backward: exposed_s = max(0, sync_s − B_s); the iteration pays max_s exposed_s.
//     ZeRO-3 pays its collectives in step 1 instead.
//  6. Optimizer step: optimizer_step_time_s(rank state, rank state, mem_bw_bytes_per_s), max over ranks.
//  7. T = makespan + exposed sync + optimizer step (+ host step_s); C = d·p·price_per_gpu_s·T; throughput B/T;
//     peak memory = max over ranks of Σ (state + activations − unmade gradients) of its stages (step 3's
//     activations: with v ≥ 2 at the rank's peak);
//     bubble = Σ idle / (p·makespan).
//  8. Host costs (HostCosts, zero for catalog GPUs): F_s and B_s each gain stage_forward_s / stage_backward_s
//     and message_s per tensor the stage receives or sends (cut_tensors at its input and output cuts); the
//     partition is made on the profiled times (the per-stage constants shift every partition alike; the message
//     costs do not, a small inexactness of the partition, not of the reported time). Without overlap the
//     exposed sync is the most any rank syncs, Σ of its stages' sync_s; the optimizer step adds
//     optimizer_tensor_s per parameter tensor and is at least elements × optimizer_element_s; T adds step_s.
//  9. Receive buffers, as pyplan's runtime holds them (pyplan/runtime/recv.py): a buffer from the posting of its
//     receive until what it holds is used up (simulate.h's receive_buffers, by the schedule's lowered order). A
//     stage that receives its input holds at least its n_s in-flight inputs in receive buffers (counted in step 3)
//     and adds (inputs_s − n_s)·input cut for those posted ahead of their forward; it adds gradients_s·output cut
//     for its output gradients (GPipe and 1F1B: 1, the one its backward reads). The first stage adds
//     (m − n_s)·input cut for the rest of the replica's batch, a later one an input cut more when n_s < m (the
//     last input gradient, partition.h's held_input_cuts); under 1F1B one output cut more where the last warm-up
//     send outlives its micro-batch (simulate.h's warmup_send_held). In the partition's memory (partition.h's
//     input_buffer_cuts and output_buffer_cuts) and in the reported memory.
//
// Objectives: time T, cost C, weighted C + w·T (Huang et al. §III). Ties go to fewer GPUs, then less peak
// memory, then the enumeration order above. The Pareto frontier keeps the feasible candidates that no
// other beats in both T and C (one per equal (T, C), the best by the same tie-break), by increasing T.
//
// Speed (the answer is the same as evaluating every candidate; tests compare with a brute force).
//  - Lower bounds order the evaluation and skip candidates. Before partitioning, with W = Σ_i (f_i + g_i)
//    at b and σ the cheapest boundary send: makespan ≥ W + 2(S−1)σ (micro-batch 0 through every stage and
//    back), ≥ m·max(W/p, max_i w_i) (the busiest rank), and ≥ min over stage works w_s ≤ cap_s of
//    max_s (m·w_s + Σ_{r<s} (w_r + 2σ)) (stage s cannot start before micro-batch 0 reaches it, works m·w_s,
//    and its last backward must travel back), where cap_s is the most work of any block range that fits
//    in memory with stage s's in-flight count (at first, with v ≥ 2, with one micro-batch: a weaker bound
//    that needs no schedule order); exposed sync ≥ the mean of sync_s − B_s; optimizer ≥ the average and
//    the largest block's state. After partitioning, the same stage bound with the actual stages and sends,
//    and the actual sync and optimizer times, can skip the simulation.
//    A candidate is skipped when its bound's objective is worse than the k-th best found and its bound's
//    (T, C) is beaten by a frontier point found, so it could join neither.
//  - Candidates are taken best bound first and refined lazily: popped the first time, one with v ≥ 2 gets
//    its caps at its exact in-flight counts; popped again (the first time for v = 1), the partition bound
//    of search.cpp's least_partition_makespan_s; each time it goes back into the queue. Popped with every
//    bound, it is evaluated unless it can be skipped by then.
//  - A candidate whose caps cannot hold W fits in no partition; it is evaluated only when nothing fits,
//    to name the least memory needed (in order of a lower bound on that need, stopping early).
//  - Partitions are shared by candidates with the same chain, m, in-flight counts (so stage count), stages
//    with fresh gradients and link. For ZeRO 0-2 (same times, less state the higher the stage) the partition
//    of the loosest allowed stage is reused when its stages fit under the tighter one: it is then optimal
//    there too (among partitions tied in the closed form, it may be another than a fresh partition would pick).
// Errors: invalid input (N outside [1, kMaxGpus], B ≤ 0, no d·b·m = B, unknown objective, malformed chain,
// a time, size, count, price or bandwidth outside its range in limits.h — times in [0, kMaxSeconds], sizes and
// counts in [0, kMaxBytes] (gpu_mem_bytes also +∞), bandwidths ≥ kMinBwBytesPerS or +∞, time_sizes ≥ 1,
// price and weight in [0, kMaxPricePerS]) throws std::invalid_argument with a one-line message naming the
// argument, its value and the range. Within those ranges every number of a result is finite. A search where
// nothing fits returns feasible = false and a reason naming the candidate that needs the least memory.
#pragma once

#include <string>
#include <vector>

#include "pyplan/cost.h"
#include "pyplan/simulate.h"

namespace pyplan {

// A chain profiled at two or more micro-batch sizes: every time and size is linear in b. Block i runs
// between cut i and cut i+1 (see chain.h).
struct ProfiledChain {
    std::vector<double> fwd_alpha_s;           // [L] forward seconds per sample
    std::vector<double> fwd_beta_s;            // [L] forward seconds per micro-batch
    std::vector<double> bwd_alpha_s;           // [L]
    std::vector<double> bwd_beta_s;            // [L]
    std::vector<double> act_per_sample_bytes;  // [L] saved for backward, per sample
    std::vector<double> act_fixed_bytes;       // [L] saved for backward, per micro-batch
    std::vector<double> params;                // [L] parameter elements
    std::vector<double> cut_per_sample_bytes;  // [L+1] live across cut c, per sample
    std::vector<double> cut_fixed_bytes;       // [L+1] live across cut c, per micro-batch
    std::vector<double> param_tensors;         // [L] parameter tensors (the optimizer's per-tensor cost); empty: 0
    std::vector<double> cut_tensors;           // [L+1] tensors live across cut c (messages); empty: 0
    // Times measured at K >= 2 micro-batch sizes (pyplan's Piecewise): block i's forward at b is the line through
    // its neighbouring points fwd_points_s[i*K + k], extended along the end segments and at least 0; the alpha
    // and beta arrays then serve nothing but validation. Empty: times are alpha * b + beta.
    std::vector<double> time_sizes;            // [K] strictly ascending
    std::vector<double> fwd_points_s;          // [L*K]
    std::vector<double> bwd_points_s;          // [L*K]

    int num_blocks() const { return static_cast<int>(fwd_alpha_s.size()); }
};

// What the training runtime costs on each rank's own thread beyond the blocks' profiled times (DESIGN.md "Host
// costs"). Measured by `pyplan calibrate` where the ranks are CPU processes over gloo, where each is large next
// to small blocks; zero for a catalog GPU, whose host work runs ahead of its kernels.
struct HostCosts {
    double stage_forward_s = 0.0;        // per stage and micro-batch: the schedule's and PipelineStage's own work
    double stage_backward_s = 0.0;
    double message_s = 0.0;              // per tensor a stage sends or receives, paid in F and in B alike
    double step_s = 0.0;                 // per optimizer step (zero_grad, the schedule's set-up)
    double optimizer_tensor_s = 0.0;     // per parameter tensor the rank's optimizer updates
    double optimizer_element_s = 0.0;    // per parameter element, when slower than state bytes / HBM bandwidth
    bool sync_overlaps_backward = true;  // false: the gradient all-reduce runs after the backward (one core)
};

struct Hardware {
    int num_gpus = 1;                 // N
    int gpus_per_node = 1;            // g
    double gpu_mem_bytes = 0.0;       // usable memory per GPU
    double mem_bw_bytes_per_s = 1.0;  // HBM bandwidth (optimizer step)
    Link intra;                       // between two GPUs of one node
    Link inter;                       // between nodes, per GPU
    // The same links as collectives see them (equal to intra/inter unless measured: gloo's all-reduce on a CPU
    // adds and copies at a lower rate than it sends). Unset (bw 0): intra/inter.
    Link intra_collective{0.0, 0.0};
    Link inter_collective{0.0, 0.0};
    double price_per_gpu_s = 0.0;
    HostCosts host;
};

enum class Objective { kTime, kCost, kWeighted };
enum class Placement { kPipelineInner, kDataInner };

struct SearchSpace {
    int global_batch = 1;                 // B
    BytesPerParam bytes_per_param;        // P, G, K
    std::vector<int> micro_batch_sizes;   // allowed b; empty: every b dividing B/d
    std::vector<int> data_parallel;       // allowed d; empty: any (pins a what-if)
    std::vector<int> pipeline_ranks;      // allowed p; empty: any
    std::vector<int> num_microbatches;    // allowed m (gradient-accumulation steps); empty: any
    // The stage boundaries, 0 = c_0 < ... < c_S = L: only candidates of S = p·v stages, cut there. Empty: any.
    std::vector<int> fixed_cuts;
    std::vector<Schedule> schedules = {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B,
                                       Schedule::LoopedBFS};
    // Allowed v, stages (model chunks) per pipeline rank: 1 is GPipe's and 1F1B's, 2 or more the interleaved
    // schedules'. Each schedule is enumerated at its allowed v in increasing order, the smallest first for every
    // schedule, then the next (so adding larger v leaves the order of the others as it was).
    std::vector<int> stages_per_rank = {1, 2, 3, 4};
    // Also the top_k and frontier of the candidates of at most 2 stages per rank, exactly as a search of those alone
    // finds them (SearchResult's top_two_chunks, pareto_two_chunks): a candidate is skipped only when it can join
    // neither its lists nor these.
    bool two_chunks_apart = false;
    std::vector<int> zero_stages = {0, 1, 2, 3};
    std::vector<Placement> placements = {Placement::kPipelineInner, Placement::kDataInner};
    bool allow_fewer_gpus = false;  // d·p < N allowed
    bool zero3_single_stage = false;  // ZeRO-3 only for one-stage 1F1B candidates (p·v = 1)
    bool fresh_gradients = false;     // a replica frees its gradients every step (step 3)
    // Bytes per parameter ZeRO-3 all-gathers and reduce-scatters (mixed precision gathers 16-bit weights and
    // reduces fp32 gradients); 0: bytes_per_param's weights and gradients.
    double zero3_gather_bytes = 0.0;
    double zero3_reduce_bytes = 0.0;
    Objective objective = Objective::kTime;
    double weight = 0.0;  // w of the weighted objective
    int top_k = 5;
};

// One evaluated configuration. Stage vectors have p·v entries, rank vectors p.
struct Candidate {
    int dp = 1;
    int pp = 1;
    int stages_per_rank = 1;
    int micro_batch_size = 1;
    int num_microbatches = 1;
    Schedule schedule = Schedule::GPipe;
    int zero_stage = 0;
    Placement placement = Placement::kPipelineInner;
    bool pipeline_inter = false;           // the pipeline link is `inter`
    int dp_gpus_per_node = 1;              // g' of the dp groups' all-reduce
    int dp_nodes = 1;                      // n'
    std::vector<int> cuts;                 // [p·v+1] stage s is blocks [cuts[s], cuts[s+1])
    std::vector<int> stage_rank;           // [p·v] pipeline rank of stage s
    std::vector<double> stage_forward_s;   // [p·v] F_s per micro-batch
    std::vector<double> stage_backward_s;  // [p·v] B_s per micro-batch
    std::vector<double> stage_time_s;      // [p·v] F_s + B_s + sends of its input and output cuts
    std::vector<double> stage_state_bytes;
    std::vector<double> stage_act_bytes;   // [p·v] in flight at its rank's peak × (saved + input cut bytes)
    std::vector<double> stage_unmade_grad_bytes;  // [p·v] gradients its memory leaves out (step 3; 0 for most)
    std::vector<double> stage_buffer_bytes;  // [p·v] receive buffers beyond those in flight, batch (step 9)
    std::vector<int> stage_in_flight;      // [p·v] its own peak in flight, n_s
    std::vector<double> stage_sync_s;      // [p·v] gradient all-reduce (0 under ZeRO-3 or d = 1)
    std::vector<double> rank_memory_bytes; // [p]
    double makespan_s = 0.0;
    double exposed_sync_s = 0.0;
    double optimizer_s = 0.0;
    double host_step_s = 0.0;              // the per-step host cost (HostCosts::step_s)
    double iteration_s = 0.0;
    double cost_per_iteration = 0.0;
    double samples_per_s = 0.0;            // B / T; 0 when T = 0 (a chain whose every time is 0)
    double bubble_fraction = 0.0;
    double peak_memory_bytes = 0.0;
    double objective = 0.0;

    int num_gpus() const { return dp * pp; }
};

struct SearchResult {
    bool feasible = false;
    Candidate best;                  // valid when feasible
    std::vector<Candidate> top;      // up to top_k, best first
    std::vector<Candidate> pareto;   // by increasing iteration_s
    std::vector<Candidate> top_two_chunks;     // with two_chunks_apart: top and pareto of the candidates of at most
    std::vector<Candidate> pareto_two_chunks;  // 2 stages per rank
    long long num_candidates = 0;    // configurations enumerated
    long long num_evaluated = 0;     // simulated, or found not to fit
    long long num_pruned = 0;        // skipped by a bound: num_candidates − num_evaluated
    long long num_feasible = 0;      // evaluated and fitting in memory
    long long num_partitions = 0;    // partition() calls (the rest were shared)
    std::string reason;              // one line, set when !feasible
    double least_need_bytes = 0.0;   // when !feasible: the least memory any candidate needs on its fullest GPU
};

// "time" | "cost" | "weighted"; throws std::invalid_argument otherwise.
Objective objective_from_name(const std::string& name);
// "pp-inner" | "dp-inner"; throws std::invalid_argument otherwise.
Placement placement_from_name(const std::string& name);
const char* placement_name(Placement placement);

SearchResult search(const ProfiledChain& chain, const Hardware& hardware, const SearchSpace& space);

}  // namespace pyplan
