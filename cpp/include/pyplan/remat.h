// pyplan/remat.h — optimal rematerialization (and activation offloading) of a chain under a memory budget.
//
// The memory model is the one of pyplan/solve/remat.py, whose docstring defines it operation by operation and
// whose `replay` is the reference every answer here is tested against. In short, per block i of the chain
// (one micro-batch, bytes beyond the block's own inputs): a saving forward F(i) costs fwd_s[i], peaks at
// fwd_peak[i] and leaves kept[i] (saved tensors and outputs); a non-saving forward peaks at fwd_nosave_peak[i]
// and leaves out[i] (the outputs); the backward B(i) costs bwd_s[i], peaks at bwd_peak[i] (counting kept[i],
// the output gradient grad[i+1], the input gradient grad[i] and temporaries) and leaves grad[i]. The chain's
// input and the gradient of its output are resident and not counted.
//
// Schedules (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova 2019, "Optimal checkpointing for heterogeneous
// chains: how to train deep neural networks with limited memory", the DP of Rotor): a plan for blocks s..t is
// a sequence of items, each
//   Keep(s)            F(s) saving, then the plan for s+1..t, then B(s);
//   Offload(s)         F(s) saving while its saved bytes kept[s] − out[s] go to the host over a link of
//                      bandwidth β (τ_s = (kept[s] − out[s])/β, hidden behind F(s) itself), the plan for s+1..t,
//                      the bytes come back while B(s+1) runs, then B(s) (Beaumont et al. 2021, offloading);
//   Checkpoint(s..k−1) F(s..k−1) without saving, keeping out[k−1] only; the plan for k..t; then, with the
//                      gradient of cut k present, the plan for s..k−1 (recursively: nested checkpoints).
// This is torch.utils.checkpoint(use_reentrant=False) nested as the tree, and save_on_cpu for Offload.
//
// Tables. Memory is discretized into S slots of σ = budget/S bytes; every size is rounded up to slots and the
// budget down, so an answer feasible in slots is feasible in bytes. With layer d the checkpoint nesting left
// (one layer when the depth is unbounded):
//   C[d][s][t][m] = least time of a plan for blocks s..t (s ≤ t) whose peak is at most m slots, counting
//                   beyond the input of s, with the gradient of cut t+1 live from the start until B(t) uses it
//                   (in a recomputation it is; in the first pass at the top it is the chain's output gradient,
//                   resident and not counted: g_t = grad[t+1] for t < L−1, g_{L−1} = 0, and B(L−1)'s peak is
//                   bwd_peak − grad[L]; write bp_i for B(i)'s peak so counted);  ∞ if none.
// The plan is read back from C: at each entry, the first option (Keep, Offload, checkpoints by increasing k)
// whose value, computed by the same expression, is the entry's own.
// Two variants of each entry, by how the input of s is held (kHeldWhole, kHeldByKept): held by block s−1's
// kept bytes, a saving forward of s frees φ = free_bytes[s−1] of them, so the rest of the subproblem has φ
// more, backward peaks included (φ = 0 when held whole). A checkpoint holds its input whole.
// Base (s = t):  C = fwd_s + bwd_s  if  g_t + fwd_peak[s] ≤ m and bp_s − φ ≤ m.
// Recurrence (s < t), the least of
//   Keep:       fwd_s + bwd_s + C^Kept[d][s+1][t][m − kept[s] + φ]      if g_t + fwd_peak[s] ≤ m, bp_s − φ ≤ m
//   Offload:    fwd_s + bwd_s + max(0, τ_s − fwd_s) + max(0, τ_s − bwd_s[s+1])
//               + C^Whole[d][s+1][t][m − out[s] + φ]                   if also kept[s] + bp_{s+1} − φ ≤ m (the prefetched bytes are live during B(s+1))
//   Checkpoint(s..k−1), s < k ≤ t:  c + Σ_{j=s}^{k−1} (fwd_s[j] + cb_j) + C^Whole[d][k][t][m − λ(s,k)] + C^Whole[d−1][s][k−1][m]
//               with λ(s, k) = live_from(s, k), the segment's values at cut k (its input's are held outside),
//               if g_t + max_{s≤j<k} (fwd_nosave_peak[j] + (j > s ? λ(s, j) : 0)) ≤ m; the recomputation
//               holds the gradient of cut k, which its own table entry counts (g_{k−1}); c is the cost of a
//               checkpoint call (RematOptions::checkpoint_s) and cb_j = checkpoint_block_s[j] (0 when empty).
// O(L³·S) time (L³/6 triples (s, k, t), S budgets each, an inner loop the compiler vectorizes), O(L²·S) memory.
// C is non-increasing in m (every condition is "something ≤ m"), so one table answers every budget up to S.
//
// The smallest budget any plan fits (exact, in bytes, no slots): P[s][t] = least peak of a plan for s..t,
// the same recurrence with max for + and peaks for times (min_peak_bytes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pyplan {

struct RematChain {
    std::vector<double> fwd_s;               // [L]
    std::vector<double> bwd_s;               // [L]
    std::vector<double> kept_bytes;          // [L] left by a saving forward
    std::vector<double> out_bytes;           // [L] left by a non-saving forward
    std::vector<double> fwd_peak_bytes;      // [L]
    std::vector<double> fwd_nosave_peak_bytes;  // [L]
    std::vector<double> bwd_peak_bytes;      // [L]
    std::vector<double> grad_bytes;          // [L+1] per cut
    std::vector<double> free_bytes;          // [L] or empty: freed from kept[i] by a saving forward of block i+1
    std::vector<double> live_from;           // [L·(L+1)] or empty: [s·(L+1) + k] the bytes at cut k made by
                                             // blocks s..k−1 (empty: out[k−1], no value outlives its cut)
    std::vector<double> checkpoint_block_s;  // [L] or empty: what block i adds to each checkpoint it is inside
                                             // (torch's hooks on its saved tensors, both passes), beyond fwd_s

    int num_blocks() const { return static_cast<int>(fwd_s.size()); }
};

struct RematOptions {
    double budget_bytes = 0;
    int slots = 500;
    double offload_bw_bytes_per_s = 0;  // 0: no offloading
    int max_depth = -1;                 // checkpoint nesting allowed; −1: unbounded (Rotor), 1: checkpoint sets
    double checkpoint_s = 0;            // the cost of one checkpoint call, added to each Checkpoint option
};

// One token of a plan written flat: Keep/Offload name a block; a checkpoint's items sit between Begin and End.
enum class RematToken : std::uint8_t { kKeep, kOffload, kBegin, kEnd };
struct RematStep {
    RematToken token;
    int block;  // for kKeep/kOffload; −1 otherwise
};

// How the input of a subproblem's first block is held: whole (the chain's input, a checkpoint's input or
// output, an offloaded block's output) or by the previous block's kept bytes, which that block's saving
// forward shrinks by free_bytes.
constexpr int kHeldWhole = 0;
constexpr int kHeldByKept = 1;

struct RematTable {
    int num_blocks = 0;
    int slots = 0;   // S: the budget
    int width = 0;   // W ≥ S: budgets are tabled up to W (a subproblem's budget grows by what is freed)
    int layers = 1;
    double slot_bytes = 0;
    std::vector<double> time;          // C, flat: index(v, d, s, t, m), v the held variant
    std::vector<long long> all_keep;   // [v][tri(s, t)]: the least m from which keeping every block fits
    std::size_t rows() const { return static_cast<std::size_t>(num_blocks) * (num_blocks + 1) / 2; }
    std::size_t row(int v, int d, int s, int t) const {
        return static_cast<std::size_t>(v * layers + d) * rows() + static_cast<std::size_t>(t) * (t + 1) / 2 + s;
    }
    std::size_t index(int v, int d, int s, int t, int m) const { return row(v, d, s, t) * (width + 1) + m; }
    std::size_t keep_index(int v, int s, int t) const {
        return static_cast<std::size_t>(v) * rows() + static_cast<std::size_t>(t) * (t + 1) / 2 + s;
    }
};

struct RematSolution {
    bool feasible = false;
    double time_s = 0;             // compute + recompute + exposed transfers, one micro-batch
    double peak_bound_bytes = 0;   // the slots the plan was solved in, in bytes: its peak is at most this
    double after_forward_bytes = 0;  // what one micro-batch holds between its forward and its backward
    std::vector<RematStep> plan;
    double min_budget_bytes = 0;   // the least peak of any plan (exact, bytes)
    std::string reason;            // why not feasible
};

RematTable remat_table(const RematChain& chain, const RematOptions& options);

// The best plan within `slot` slots of the table (slot ≤ table.slots).
RematSolution remat_at(const RematChain& chain, const RematOptions& options, const RematTable& table, int slot);

// The best plan within the budget. With in_flight > 1 micro-batches held at once (a pipeline stage), the plan
// must also satisfy peak + (in_flight − 1)·after_forward ≤ budget: the best plan of each smaller budget
// is tried (exact for one micro-batch; for more, the best among the one-micro-batch optima that fit).
RematSolution solve_remat(const RematChain& chain, const RematOptions& options, int in_flight = 1);

// The least peak (bytes) of any plan allowed by the options, ignoring the budget and slots.
double min_peak_bytes(const RematChain& chain, const RematOptions& options);

}  // namespace pyplan
