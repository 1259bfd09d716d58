// pyplan/remat.h — optimal rematerialization (and activation offloading) of a chain under a memory budget.
//
// The memory model is the one of pyplan/solve/remat.py, whose docstring defines it operation by operation and
// whose `replay` is the reference every answer here is tested against. In short, per block i of the chain
// (one micro-batch, bytes beyond the block's own inputs): a saving forward F(i) costs fwd_s[i], peaks at
// fwd_peak[i] and leaves kept[i] (saved tensors and outputs); a non-saving forward peaks at fwd_nosave_peak[i]
// and leaves its outputs; the backward B(i) costs bwd_s[i] and peaks at bwd_peak[i] (counting kept[i] with
// every output held, the output gradient grad[i+1], the input gradient grad[i] and temporaries), less the outputs
// and earlier values nobody holds by then. Each output *value* (a storage) of block i has bytes, the last cut it
// is live at, and the blocks whose saving forward saves it (savers). A value made in the current run of saving
// forwards (since the last checkpoint at this level) is *owned*: it dies at the saving forward of its last reader
// when none of its savers saved it, and is counted dead in each backward after which no saver holds it. The chain's
// input and the gradient of its output are resident and not counted.
//
// Schedules (Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova 2019, "Optimal checkpointing for heterogeneous
// chains: how to train deep neural networks with limited memory", the DP of Rotor): a plan for blocks s..t is
// a sequence of items, each
//   Keep(s)            F(s) saving, then the plan for s+1..t, then B(s);
//   Offload(s)         F(s) saving while its saved bytes kept[s] − out[s] go to the host over a link of
//                      bandwidth β (τ_s = (kept[s] − out[s])/β, hidden behind F(s) itself), the plan for s+1..t,
//                      the bytes come back while B(s+1) runs, then B(s) (Beaumont et al. 2021, offloading);
//   Checkpoint(s..k−1) F(s..k−1) without saving, keeping the segment's values at cut k only; the plan for k..t;
//                      then, with the gradient of cut k present, the backward of the trailing blocks that save
//                      nothing (torch's recomputation stops before them) and the plan for s..j* (j* the last block
//                      ≤ k−1 that saves), recursively: nested checkpoints. Only segments that save something
//                      (j* ≥ s): a checkpoint of blocks that save nothing runs as those blocks kept.
// This is torch.utils.checkpoint(use_reentrant=False) nested as the tree, and save_on_cpu for Offload.
//
// States. What a subproblem s..t owes to its start is the set O of owned values live at cut s that no saver has
// saved up to s included (the "relevant" values: one that s saves is held from then on and costs nothing at s);
// a subproblem's options depend on O only through
//   φ(O, s)        the bytes of O whose last reader is s (freed by a saving forward of s),
//   D(O, s, ctx)   the bytes of O and of block s's outputs that are dead during B(s): saved by none of their
//                  savers up to s (and, in the first pass, not an output of the chain, which the caller holds),
//   next(O, s)     the relevant set at cut s+1 after Keep(s),
// and after Checkpoint(c..k−1) the set at k is X(c, k), the segment's values live at k. The distinct sets reached
// at each cut (from ∅, Keep and checkpoint ends) are numbered: the variant v of a table entry.
//
// Tables. Memory is discretized into S slots of σ = budget/S bytes; every size is rounded up to slots (what is
// freed, down) and the budget down, so an answer feasible in slots is feasible in bytes. With layer d the
// checkpoint nesting left (one layer when the depth is unbounded):
//   C[v][d][s][t][m] = least time of a plan for blocks s..t (s ≤ t) whose peak is at most m slots, counting
//                   beyond what is live at its start (variant v at cut s), with the gradient of cut t+1 live from
//                   the start until B(t) uses it (in a recomputation it is; in the first pass at the top it is the
//                   chain's output gradient, resident and not counted: g_t = grad[t+1] for t < L−1, g_{L−1} = 0,
//                   and B(L−1)'s peak is bwd_peak − grad[L]; write bp_i for B(i)'s peak so counted); ∞ if none.
//                   Every entry with t < L−1 is inside a recomputation (ctx), those with t = L−1 at the top.
// The plan is read back from C: at each entry, the first option (Keep, Offload, checkpoints by increasing k)
// whose value, computed by the same expression, is the entry's own.
// Base (s = t):  C = fwd_s + bwd_s  if  g_t + fwd_peak[s] ≤ m and bp_s − D(O, s) ≤ m.
// Recurrence (s < t), the least of
//   Keep:       fwd_s + bwd_s + C[next(O, s)][d][s+1][t][m − kept[s] + φ(O, s)]
//                                                    if g_t + fwd_peak[s] ≤ m and bwd_peak[s] − D(O, s) ≤ m
//   Offload:    fwd_s + bwd_s + max(0, τ_s − fwd_s) + max(0, τ_s − bwd_s[s+1]) + C[∅][d][s+1][t][m − out[s] + φ]
//               if also kept[s] − φ + bp_{s+1} − D(∅, s+1) ≤ m (the prefetched bytes are live during B(s+1))
//   Checkpoint(s..k−1), s < k ≤ t, j* ≥ s:  c + Σ_{j=s}^{k−1} (fwd_s[j] + cb_j) + Σ_{j*<j<k} bwd_s[j]
//               + C[X(s,k)][d][k][t][m − λ(s, k)] + C[∅][d−1][s][j*][m]
//               with λ(s, k) = live_from(s, k), the segment's values at cut k (its input's are held outside),
//               if g_t + max_{s≤j<k} (fwd_nosave_peak[j] + (j > s ? λ(s, j) : 0)) ≤ m and, for each trailing
//               block j, bwd_peak[j] − out[j] ≤ m; c is the cost of a checkpoint call (RematOptions::checkpoint_s)
//               and cb_j = checkpoint_block_s[j] (0 when empty).
// O(L³·S) time (L³/6 triples (s, k, t), S budgets each, an inner loop the compiler vectorizes), O(V·L²·S) memory
// with V the variants per cut (one to three in the zoo's chains). Times are tabled as float: the O(L³·S) loop
// streams half the bytes (pyplan.solve.remat replays the plan it returns, in double), and entries are filled by
// last block t, first block s descending, so that the rows (k, t) it reads stay in the cache.
// C is non-increasing in m (every condition is "something ≤ m"), so one table answers every budget up to S.
//
// The smallest budget any plan fits (exact, in bytes, no slots): P[v][s][t] = least peak of a plan for s..t,
// the same recurrence with max for + and peaks for times (min_peak_bytes). solve_remat computes it first and
// answers a budget below it at once (infeasible, naming it), before any table is built.
//
// Sizes. The table's width W is min(S + the most slots any saving forward frees, kMaxRematSlots): a budget
// that would grow past W (a value freed larger than what is left) is read at W, which C being non-increasing
// in m makes safe (the plan fits; at worst it is not the optimum). In a consistent chain what is freed was held
// within the budget, so W ≤ 2S and the cap binds only for S > kMaxRematSlots/2. Sizes are rounded to slots
// in 64 bits and saturate far above W: a size of more slots than that never fits (a Keep whose kept bytes
// saturate is never taken, whatever it frees). Arguments outside their ranges (below, and limits.h: times in
// [0, kMaxSeconds], sizes in [0, kMaxBytes]) and tables beyond kMaxRematTableEntries throw
// std::invalid_argument with one line naming the argument, its value and the range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pyplan {

// Blocks of a remat chain: the states take O(L²) memory and min_peak_bytes O(L³) time (1024: 8 MB, ~1 s);
// pyplan solves one pipeline stage's blocks at a time, a few hundred at most.
inline constexpr int kMaxRematBlocks = 1024;

// Memory slots: the most RematOptions::slots and the table's width W. The DP takes O(L³·W) time and its table
// V·L(L+1)/2·(W+1) floats (V variants per cut, one to three in the zoo): 8192 slots are 330 MB for 100 blocks
// with V = 2. More buys nothing: rounding costs at most one slot per rounded size, 1/S of the budget (0.2 %
// at the default 500, 0.01 % at 8192), below the spread of measured sizes.
inline constexpr int kMaxRematSlots = 8192;

// Entries of the table (floats, and of min_peak_bytes' doubles and the states' sets): 2^28 is 1 GiB of
// floats, the most this machine's 24 GB (shared with the rest of a search) should give one solve.
inline constexpr std::size_t kMaxRematTableEntries = std::size_t{1} << 28;

// One output value (a storage) of a block: its bytes, the last cut it is live at (block+1..L), and the blocks
// whose saving forward saves it (ascending, each in block..min(last, L−1)).
struct RematValue {
    int block = 0;
    double bytes = 0;
    int last = 0;
    std::vector<int> savers;
};

struct RematChain {
    std::vector<double> fwd_s;               // [L]
    std::vector<double> bwd_s;               // [L]
    std::vector<double> kept_bytes;          // [L] left by a saving forward
    std::vector<double> out_bytes;           // [L] the outputs (the bytes of its values)
    std::vector<double> fwd_peak_bytes;      // [L]
    std::vector<double> fwd_nosave_peak_bytes;  // [L]
    std::vector<double> bwd_peak_bytes;      // [L]
    std::vector<double> grad_bytes;          // [L+1] per cut
    std::vector<RematValue> values;          // every block's output values; empty: each block's outputs one
                                             // value, live one cut, saved by the block and the next one
    std::vector<bool> saves;                 // [L] or empty (all): whether the saving forward saves anything
    std::vector<double> checkpoint_block_s;  // [L] or empty: what block i adds to each checkpoint it is inside
                                             // (torch's hooks on its saved tensors, both passes), beyond fwd_s

    int num_blocks() const { return static_cast<int>(fwd_s.size()); }
};

struct RematOptions {
    double budget_bytes = 0;            // in (0, kMaxBytes]
    int slots = 500;                    // S, in [1, kMaxRematSlots]
    double offload_bw_bytes_per_s = 0;  // 0: no offloading; else finite, ≥ kMinBwBytesPerS
    int max_depth = -1;                 // checkpoint nesting allowed; −1: unbounded (Rotor), 1: checkpoint sets;
                                        // any depth ≥ L − 1 is unbounded in effect (tabled as L − 1)
    double checkpoint_s = 0;            // the cost of one checkpoint call, added to each Checkpoint option
};

// One token of a plan written flat: Keep/Offload name a block; a checkpoint's items sit between Begin and End.
enum class RematToken : std::uint8_t { kKeep, kOffload, kBegin, kEnd };
struct RematStep {
    RematToken token;
    int block;  // for kKeep/kOffload; −1 otherwise
};

// The relevant sets of owned values reached at each cut, numbered, with what each costs (see States above).
// Variant 0 at every cut is ∅.
struct RematStates {
    std::vector<int> count;                      // [L] variants per cut
    std::vector<std::vector<double>> phi;        // [s][v] φ(O, s)
    std::vector<std::vector<double>> dead_top;   // [s][v] D(O, s) in the first pass
    std::vector<std::vector<double>> dead_rec;   // [s][v] D(O, s) in a recomputation
    std::vector<std::vector<int>> next;          // [s][v] next(O, s) at s+1 (s < L−1)
    std::vector<int> checkpoint;                 // [c·(L+1) + k] X(c, k) at k, −1 when [c, k) saves nothing
    std::vector<double> live_from;               // [c·(L+1) + k] λ(c, k)
    std::vector<int> last_saving;                // [L] j*: the last block ≤ i that saves, −1 if none
};

RematStates remat_states(const RematChain& chain);

struct RematTable {
    int num_blocks = 0;
    int slots = 0;   // S: the budget
    int width = 0;   // W in [S, kMaxRematSlots]: budgets are tabled up to W (a subproblem's budget grows by what
                     // is freed; beyond W it is read at W)
    int layers = 1;
    double slot_bytes = 0;
    std::vector<std::size_t> base;     // [L] the first row of cut s
    std::vector<int> variants;         // [L] variants per cut
    std::vector<float> time;           // C, flat: index(v, d, s, t, m)
    std::vector<long long> all_keep;   // [row(v, 0, s, t)]: the least m from which keeping every block fits
    std::size_t rows() const { return base.empty() ? 0 : base.back() + static_cast<std::size_t>(variants.back()) * layers; }
    std::size_t row(int v, int d, int s, int t) const {
        return base[s] + static_cast<std::size_t>(v * layers + d) * (num_blocks - s) + static_cast<std::size_t>(t - s);
    }
    std::size_t index(int v, int d, int s, int t, int m) const { return row(v, d, s, t) * (width + 1) + m; }
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

RematTable remat_table(const RematChain& chain, const RematStates& states, const RematOptions& options);

// The best plan within `slot` slots of the table (slot ≤ table.slots).
RematSolution remat_at(const RematChain& chain, const RematStates& states, const RematOptions& options,
                       const RematTable& table, int slot);

// The best plan within the budget. With in_flight > 1 micro-batches held at once (a pipeline stage), the plan
// must also satisfy peak + (in_flight − 1)·after_forward ≤ budget: the best plan of each smaller budget
// is tried (exact for one micro-batch; for more, the best among the one-micro-batch optima that fit).
// A budget below min_peak_bytes is answered without a table: infeasible, naming the least budget.
RematSolution solve_remat(const RematChain& chain, const RematOptions& options, int in_flight = 1);

// The least peak (bytes) of any plan allowed by the options (offloading, max_depth), ignoring the budget and
// slots.
double min_peak_bytes(const RematChain& chain, const RematOptions& options);

}  // namespace pyplan
