// Optimal rematerialization of a chain: the tables and the recurrence are stated in pyplan/remat.h.
#include "pyplan/remat.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "pyplan/format.h"

namespace pyplan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr std::uint8_t kNone = 0, kKeepChoice = 1, kOffloadChoice = 2, kCheckpointChoice = 3;

void check_chain(const RematChain& c) {
    const std::size_t n = c.fwd_s.size();
    if (n == 0) throw std::invalid_argument("remat: the chain has no blocks");
    if (n > 65535) throw std::invalid_argument("remat: at most 65535 blocks");
    for (const auto* v : {&c.bwd_s, &c.kept_bytes, &c.out_bytes, &c.fwd_peak_bytes, &c.fwd_nosave_peak_bytes,
                          &c.bwd_peak_bytes}) {
        if (v->size() != n) throw std::invalid_argument("remat: every per-block vector needs one entry per block");
    }
    if (c.grad_bytes.size() != n + 1) throw std::invalid_argument("remat: grad_bytes needs one entry per cut");
    if (!c.free_bytes.empty() && c.free_bytes.size() != n) {
        throw std::invalid_argument("remat: free_bytes needs one entry per block (or none)");
    }
    if (!c.live_from.empty() && c.live_from.size() != n * (n + 1)) {
        throw std::invalid_argument("remat: live_from needs L·(L+1) entries (or none)");
    }
    if (!c.checkpoint_block_s.empty() && c.checkpoint_block_s.size() != n) {
        throw std::invalid_argument("remat: checkpoint_block_s needs one entry per block (or none)");
    }
}

// The gradient a subproblem ending at block t holds until B(t) consumes it: grad[t+1], except the chain's
// output gradient (resident, not counted); and B(i)'s peak as counted (bwd_peak, less that resident gradient
// for the last block).
struct Counted {
    std::vector<double> grad_after;  // [L] grad_after[t]: the gradient of cut t+1 as counted
    std::vector<double> bwd_peak;    // [L]
};

Counted counted_of(const RematChain& c) {
    const int n = c.num_blocks();
    Counted r;
    for (int t = 0; t < n; ++t) {
        r.grad_after.push_back(t + 1 < n ? c.grad_bytes[t + 1] : 0.0);
        r.bwd_peak.push_back(c.bwd_peak_bytes[t] - (t + 1 < n ? 0.0 : c.grad_bytes[n]));
    }
    return r;
}

// Bytes to slots, rounded up (sizes and needs) so that slot feasibility implies byte feasibility.
struct Slots {
    double slot_bytes;
    int operator()(double bytes) const {
        if (!(bytes > 0)) return 0;
        const double v = std::ceil(bytes / slot_bytes);
        return v > 1e9 ? 1000000000 : static_cast<int>(v);
    }
    // Rounded down: for bytes that are given back.
    int down(double bytes) const {
        if (!(bytes > 0)) return 0;
        const double v = std::floor(bytes / slot_bytes);
        return v > 1e9 ? 1000000000 : static_cast<int>(v);
    }
};

// What block i's kept bytes lose once block i+1 has run a saving forward (0 when not measured).
double free_of(const RematChain& c, int i) {
    return c.free_bytes.empty() ? 0.0 : c.free_bytes[i];
}

// The bytes at cut k made by blocks s..k−1: what a checkpointed segment starting at s stores at cut k.
double live_from(const RematChain& c, int s, int k) {
    if (c.live_from.empty()) return c.out_bytes[k - 1];
    return c.live_from[static_cast<std::size_t>(s) * (c.num_blocks() + 1) + k];
}

double exposed_transfer(const RematChain& c, int s, double bw) {
    const double tau = (c.kept_bytes[s] - c.out_bytes[s]) / bw;
    return std::max(0.0, tau - c.fwd_s[s]) + std::max(0.0, tau - c.bwd_s[s + 1]);
}


// The recurrence of remat.h for one entry (v, d, s, t), in slots: each option is worth
// base + first[min(m − shift, W)] + second[m] (a null row counts 0) where lo ≤ m ≤ hi. The table is filled
// from these and the plan read back from them, so both agree by construction.
struct Option {
    RematToken token;      // kKeep, kOffload or kBegin (a checkpoint of s..split−1)
    int split = 0;
    double base = 0;
    int lo = 0, hi = 0, shift = 0;
    const double* first = nullptr;
    const double* second = nullptr;
    double at(int m, int width) const {
        return base + (first ? first[std::min(m - shift, width)] : 0.0) + (second ? second[m] : 0.0);
    }
};

struct Recurrence {
    const RematChain& c;
    const RematTable& tab;
    Slots slots;
    bool unbounded;
    bool offload;
    double bw;
    double checkpoint_s;
    std::vector<int> kept, freed;
    std::vector<double> fwd_prefix;
    std::vector<double> extra_prefix;  // Σ checkpoint_block_s
    Counted ct;

    Recurrence(const RematChain& chain, const RematTable& table, const RematOptions& o)
        : c(chain), tab(table), slots{table.slot_bytes}, unbounded(o.max_depth < 0),
          offload(o.offload_bw_bytes_per_s > 0), bw(o.offload_bw_bytes_per_s), checkpoint_s(o.checkpoint_s),
          ct(counted_of(chain)) {
        const int n = c.num_blocks();
        fwd_prefix.assign(n + 1, 0.0);
        extra_prefix.assign(n + 1, 0.0);
        for (int i = 0; i < n; ++i) {
            kept.push_back(slots(c.kept_bytes[i]));
            freed.push_back(slots.down(free_of(c, i)));
            const double extra = c.checkpoint_block_s.empty() ? 0.0 : c.checkpoint_block_s[i];
            fwd_prefix[i + 1] = fwd_prefix[i] + c.fwd_s[i];
            extra_prefix[i + 1] = extra_prefix[i] + extra;
        }
    }

    const double* row(int v, int d, int s, int t) const { return &tab.time[tab.index(v, d, s, t, 0)]; }

    // The least budget (slots) from which keeping every block of s..t fits, held as v.
    long long all_keep(int v, int s, int t) const { return tab.all_keep[tab.keep_index(v, s, t)]; }

    // Keep and Offload of block s; held by kept bytes, its saving forward frees fr slots of them.
    void first_block(int v, int d, int s, int t, std::vector<Option>& out) const {
        const int fr = v == kHeldByKept && s > 0 ? freed[s - 1] : 0;
        const double g = ct.grad_after[t];
        const double fb = c.fwd_s[s] + c.bwd_s[s];
        const int fwd_need = slots(g + c.fwd_peak_bytes[s]);
        const int W = tab.width;
        if (s == t) {
            out.push_back({RematToken::kKeep, 0, fb, std::max({fwd_need, slots(ct.bwd_peak[s]) - fr, 0}), W, 0});
            return;
        }
        const int keep_need = std::max(fwd_need, slots(c.bwd_peak_bytes[s]) - fr);
        const int shift = kept[s] - fr;
        out.push_back({RematToken::kKeep, 0, fb, std::max({keep_need, shift, 0}), W, shift,
                       row(kHeldByKept, d, s + 1, t)});
        if (offload) {
            const int need = std::max(keep_need, slots(c.kept_bytes[s] + ct.bwd_peak[s + 1]) - fr);
            const int o_shift = slots(c.out_bytes[s]) - fr;
            out.push_back({RematToken::kOffload, 0, fb + exposed_transfer(c, s, bw), std::max({need, o_shift, 0}), W,
                           o_shift, row(kHeldWhole, d, s + 1, t)});
        }
    }

    // Checkpoint(s..k−1) for every k (none at d = 0 with a bounded depth); up to all_keep − 1, beyond which
    // keeping everything is as fast as anything.
    void checkpoints(int d, int s, int t, std::vector<Option>& out) const {
        if (s == t || (!unbounded && d == 0)) return;
        const int inner = unbounded ? 0 : d - 1;
        const double g = ct.grad_after[t];
        const int hi = static_cast<int>(std::min<long long>(tab.width, all_keep(kHeldWhole, s, t) - 1));
        double nosave = c.fwd_nosave_peak_bytes[s];
        for (int k = s + 1; k <= t; ++k) {
            if (k > s + 1) nosave = std::max(nosave, live_from(c, s, k - 1) + c.fwd_nosave_peak_bytes[k - 1]);
            const int a = slots(live_from(c, s, k));
            const double base = checkpoint_s + (fwd_prefix[k] - fwd_prefix[s]) + (extra_prefix[k] - extra_prefix[s]);
            out.push_back({RematToken::kBegin, k, base, std::max(slots(g + nosave), a), hi, a, row(kHeldWhole, d, k, t),
                           row(kHeldWhole, inner, s, k - 1)});
        }
    }
};

// row[m] = min(row[m], f + after[m − shift] + recompute[m]) for m in [lo, hi]: branch-free over non-aliasing rows
// so that the compiler vectorizes it (this loop is the O(L³·S) part).
void relax_checkpoint(double* __restrict row, const double* __restrict after, const double* __restrict recompute,
                      double f, int lo, int hi) {
    for (int m = lo; m <= hi; ++m) row[m] = std::min(row[m], f + after[m] + recompute[m]);
}

// Emit the plan of table entry (v, d, s, t, m) as flat steps: at each entry the first option (Keep, Offload,
// then checkpoints by increasing split) whose value is the entry's own, computed by the same expression.
void backtrack(const Recurrence& rec, int v, int d, int s, int t, int m, std::vector<RematStep>& out) {
    std::vector<Option> options;
    while (true) {
        const double want = rec.tab.time[rec.tab.index(v, d, s, t, m)];
        options.clear();
        rec.first_block(v, d, s, t, options);
        rec.checkpoints(d, s, t, options);
        const Option* pick = nullptr;
        for (const Option& opt : options) {
            if (m >= opt.lo && m <= opt.hi && opt.at(m, rec.tab.width) == want) {
                pick = &opt;
                break;
            }
        }
        if (pick == nullptr) throw std::logic_error("remat: backtracking found no option of the entry's value");
        if (pick->token != RematToken::kBegin) {
            out.push_back({pick->token, s});
            if (s == t) return;
            m = std::min(m - pick->shift, rec.tab.width);
            v = pick->token == RematToken::kKeep ? kHeldByKept : kHeldWhole;
            ++s;
        } else {
            const int k = pick->split;
            out.push_back({RematToken::kBegin, -1});
            backtrack(rec, kHeldWhole, rec.unbounded ? 0 : d - 1, s, k - 1, m, out);
            out.push_back({RematToken::kEnd, -1});
            m -= pick->shift;
            v = kHeldWhole;
            s = k;
        }
    }
}

// What one micro-batch holds after its forward: the top-level items' leftovers (a kept block followed by a
// kept or offloaded one has lost its freed bytes; a checkpoint holds its segment's values at its output cut).
double after_forward(const RematChain& c, const std::vector<RematStep>& plan) {
    double total = 0;
    int depth = 0;
    int last_block = -1;
    int segment_start = -1;
    bool previous_kept = false;  // the previous top-level item was Keep(last_block)
    for (const RematStep& st : plan) {
        if (st.token == RematToken::kBegin) {
            if (depth++ == 0) {
                previous_kept = false;
                segment_start = -1;
            }
        } else if (st.token == RematToken::kEnd) {
            if (--depth == 0) total += live_from(c, segment_start, last_block + 1);
        } else {
            if (depth == 0) {
                if (previous_kept) total -= free_of(c, st.block - 1);
                total += st.token == RematToken::kKeep ? c.kept_bytes[st.block] : c.out_bytes[st.block];
                previous_kept = st.token == RematToken::kKeep;
            } else if (segment_start < 0) {
                segment_start = st.block;
            }
            last_block = st.block;
        }
    }
    return total;
}

}  // namespace

RematTable remat_table(const RematChain& c, const RematOptions& o) {
    check_chain(c);
    if (o.slots < 1) throw std::invalid_argument("remat: slots must be at least 1");
    if (!(o.budget_bytes > 0)) throw std::invalid_argument("remat: the budget must be positive");
    const int n = c.num_blocks();
    RematTable tab;
    tab.num_blocks = n;
    tab.slots = o.slots;
    tab.layers = o.max_depth < 0 ? 1 : o.max_depth + 1;
    tab.slot_bytes = o.budget_bytes / o.slots;
    const Slots slots{tab.slot_bytes};
    // Freed bytes are rounded down; the rows reach past the budget by the most any block frees.
    int most_freed = 0;
    for (int i = 0; i < n; ++i) most_freed = std::max(most_freed, slots.down(free_of(c, i)));
    tab.width = o.slots + most_freed;
    const int W = tab.width;
    tab.time.assign(tab.index(2, tab.layers, 0, 0, 0), kInf);
    tab.all_keep.assign(2 * tab.rows(), 0);
    const Recurrence rec(c, tab, o);
    const Counted& ct = rec.ct;

    // Below first_finite[row] an entry is ∞: the checkpoint loop starts there.
    std::vector<int> first_finite(2 * tab.layers * tab.rows(), W + 1);
    std::vector<Option> options;
    for (int len = 1; len <= n; ++len) {
        for (int s = 0; s + len <= n; ++s) {
            const int t = s + len - 1;
            for (int v = 0; v < 2; ++v) {
                const int fr = v == kHeldByKept && s > 0 ? rec.freed[s - 1] : 0;
                const long long fwd_need = slots(ct.grad_after[t] + c.fwd_peak_bytes[s]);
                tab.all_keep[tab.keep_index(v, s, t)] =
                    s == t ? std::max<long long>(fwd_need, slots(ct.bwd_peak[s]) - fr)
                           : std::max({fwd_need, static_cast<long long>(slots(c.bwd_peak_bytes[s]) - fr),
                                       rec.kept[s] - fr + tab.all_keep[tab.keep_index(kHeldByKept, s + 1, t)]});
            }
            for (int d = 0; d < tab.layers; ++d) {
                // Checkpoints first: the same for both variants (a checkpoint holds its input whole).
                double* row = &tab.time[tab.index(kHeldWhole, d, s, t, 0)];
                options.clear();
                rec.checkpoints(d, s, t, options);
                const int inner = rec.unbounded ? 0 : d - 1;
                for (const Option& opt : options) {
                    const int k = opt.split;
                    const int lo = std::max({opt.lo, opt.shift + first_finite[tab.row(kHeldWhole, d, k, t)],
                                             first_finite[tab.row(kHeldWhole, inner, s, k - 1)]});
                    relax_checkpoint(row, opt.first - opt.shift, opt.second, opt.base, lo, opt.hi);
                }
                double* row_k = &tab.time[tab.index(kHeldByKept, d, s, t, 0)];
                std::copy(row, row + W + 1, row_k);
                for (int v = 0; v < 2; ++v) {
                    double* r = v == kHeldByKept ? row_k : row;
                    options.clear();
                    rec.first_block(v, d, s, t, options);
                    for (const Option& opt : options) {
                        for (int m = opt.lo; m <= opt.hi; ++m) r[m] = std::min(r[m], opt.at(m, W));
                    }
                    int m = 0;
                    while (m <= W && !std::isfinite(r[m])) ++m;
                    first_finite[tab.row(v, d, s, t)] = m;
                }
            }
        }
    }
    return tab;
}

RematSolution remat_at(const RematChain& c, const RematOptions& o, const RematTable& tab, int slot) {
    RematSolution r;
    r.min_budget_bytes = min_peak_bytes(c, o);
    const int n = c.num_blocks();
    const int top = tab.layers - 1;
    slot = std::clamp(slot, 0, tab.slots);
    const double t = tab.time[tab.index(kHeldWhole, top, 0, n - 1, slot)];
    if (!std::isfinite(t)) {
        r.reason = "no plan fits in " + format_bytes(slot * tab.slot_bytes) + "; the least any plan needs is " +
                   format_bytes(r.min_budget_bytes);
        return r;
    }
    r.feasible = true;
    r.time_s = t;
    r.peak_bound_bytes = slot * tab.slot_bytes;
    backtrack(Recurrence(c, tab, o), kHeldWhole, top, 0, n - 1, slot, r.plan);
    r.after_forward_bytes = after_forward(c, r.plan);
    return r;
}

RematSolution solve_remat(const RematChain& c, const RematOptions& o, int in_flight) {
    if (in_flight < 1) throw std::invalid_argument("remat: in_flight must be at least 1");
    const RematTable tab = remat_table(c, o);
    RematSolution best = remat_at(c, o, tab, tab.slots);
    if (!best.feasible || in_flight == 1) return best;
    // Each smaller budget's optimum, while it stays feasible; keep the fastest whose copies fit.
    RematSolution fit;
    const int n = c.num_blocks();
    const int top = tab.layers - 1;
    double last_time = -1;
    for (int slot = tab.slots; slot >= 0; --slot) {
        const double t = tab.time[tab.index(kHeldWhole, top, 0, n - 1, slot)];
        if (!std::isfinite(t)) break;
        if (fit.feasible && t >= fit.time_s) continue;
        if (t == last_time) continue;  // the same optimum as at slot + 1 (ties keep the larger budget's plan)
        last_time = t;
        RematSolution cand = remat_at(c, o, tab, slot);
        if (cand.peak_bound_bytes + (in_flight - 1) * cand.after_forward_bytes <= o.budget_bytes) {
            fit = std::move(cand);
        }
    }
    if (!fit.feasible) {
        fit.min_budget_bytes = best.min_budget_bytes;
        fit.reason = std::to_string(in_flight) + " micro-batches in flight fit in no plan within " +
                     format_bytes(o.budget_bytes);
    }
    return fit;
}

double min_peak_bytes(const RematChain& c, const RematOptions& o) {
    check_chain(c);
    const int n = c.num_blocks();
    const bool unbounded = o.max_depth < 0;
    const bool offload = o.offload_bw_bytes_per_s > 0;
    const int layers = unbounded ? 1 : o.max_depth + 1;
    const Counted ct = counted_of(c);
    // P[v][d][s][t]: least peak of a plan for s..t with d nesting levels left, input held as v.
    const std::size_t rows = static_cast<std::size_t>(n) * (n + 1) / 2;
    std::vector<double> P(2 * layers * rows, kInf);
    auto at = [&](int v, int d, int s, int t) -> double& {
        return P[static_cast<std::size_t>(v * layers + d) * rows + static_cast<std::size_t>(t) * (t + 1) / 2 + s];
    };
    for (int len = 1; len <= n; ++len) {
        for (int s = 0; s + len <= n; ++s) {
            const int t = s + len - 1;
            const double g = ct.grad_after[t];
            for (int d = 0; d < layers; ++d) {
                double ckpt = kInf;
                if (s < t && (unbounded || d > 0)) {
                    const int inner = unbounded ? 0 : d - 1;
                    double nosave = c.fwd_nosave_peak_bytes[s];
                    for (int k = s + 1; k <= t; ++k) {
                        if (k > s + 1) {
                            nosave = std::max(nosave, live_from(c, s, k - 1) + c.fwd_nosave_peak_bytes[k - 1]);
                        }
                        ckpt = std::min(ckpt, std::max({g + nosave, live_from(c, s, k) + at(kHeldWhole, d, k, t),
                                                        at(kHeldWhole, inner, s, k - 1)}));
                    }
                }
                for (int v = 0; v < 2; ++v) {
                    const double phi = v == kHeldByKept && s > 0 ? free_of(c, s - 1) : 0.0;
                    double& best = at(v, d, s, t);
                    if (s == t) {
                        best = std::max(g + c.fwd_peak_bytes[s], ct.bwd_peak[s] - phi);
                        continue;
                    }
                    const double keep = std::max(g + c.fwd_peak_bytes[s], c.bwd_peak_bytes[s] - phi);
                    best = std::min(ckpt, std::max(keep, c.kept_bytes[s] - phi + at(kHeldByKept, d, s + 1, t)));
                    if (offload) {
                        const double need = std::max(keep, c.kept_bytes[s] + ct.bwd_peak[s + 1] - phi);
                        best = std::min(best, std::max(need, c.out_bytes[s] - phi + at(kHeldWhole, d, s + 1, t)));
                    }
                }
            }
        }
    }
    return at(kHeldWhole, layers - 1, 0, n - 1);
}

}  // namespace pyplan
