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

// Emit the plan of table entry (v, d, s, t, m) as flat steps.
void backtrack(const RematChain& c, const RematTable& tab, const Slots& slots, bool unbounded, int v, int d, int s,
               int t, int m, std::vector<RematStep>& out) {
    while (true) {
        const RematChoice ch = RematChoice::unpack(tab.what[tab.index(v, d, s, t, std::min(m, tab.width))]);
        if (ch.kind == kKeepChoice || ch.kind == kOffloadChoice) {
            const bool keep = ch.kind == kKeepChoice;
            out.push_back({keep ? RematToken::kKeep : RematToken::kOffload, s});
            if (s == t) return;
            const int fr = v == kHeldByKept && s > 0 ? slots.down(free_of(c, s - 1)) : 0;
            m -= slots(keep ? c.kept_bytes[s] : c.out_bytes[s]) - fr;
            v = keep ? kHeldByKept : kHeldWhole;
            ++s;
        } else if (ch.kind == kCheckpointChoice) {
            const int k = ch.split;
            out.push_back({RematToken::kBegin, -1});
            backtrack(c, tab, slots, unbounded, kHeldWhole, unbounded ? 0 : d - 1, s, k - 1, m, out);
            out.push_back({RematToken::kEnd, -1});
            m -= slots(live_from(c, s, k));
            v = kHeldWhole;
            s = k;
        } else {
            throw std::logic_error("remat: backtracking reached an infeasible entry");
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
    const bool unbounded = o.max_depth < 0;
    const bool offload = o.offload_bw_bytes_per_s > 0;
    RematTable tab;
    tab.num_blocks = n;
    tab.slots = o.slots;
    tab.layers = unbounded ? 1 : o.max_depth + 1;
    tab.slot_bytes = o.budget_bytes / o.slots;
    const Slots slots{tab.slot_bytes};
    // Freed bytes are rounded down; the rows reach past the budget by the most any block frees.
    std::vector<int> freed(n, 0);
    for (int i = 0; i < n; ++i) freed[i] = slots.down(free_of(c, i));
    tab.width = o.slots + *std::max_element(freed.begin(), freed.end());
    const int W = tab.width;
    const std::size_t size = tab.index(2, tab.layers, 0, 0, 0);
    tab.time.assign(size, kInf);
    tab.what.assign(size, 0);

    const Counted ct = counted_of(c);
    std::vector<int> kept(n), out(n);
    for (int i = 0; i < n; ++i) {
        kept[i] = slots(c.kept_bytes[i]);
        out[i] = slots(c.out_bytes[i]);
    }
    std::vector<double> fwd_prefix(n + 1, 0.0);
    for (int i = 0; i < n; ++i) fwd_prefix[i + 1] = fwd_prefix[i] + c.fwd_s[i];

    // Relax row `dst` with value + src[m − shift] for m ≥ lo (src may be null: a constant); src is read at
    // most at W (a larger budget answers no worse).
    auto relax = [W](double* dst, std::uint32_t* what, const double* src, double value, int lo, int shift,
                     RematChoice choice) {
        lo = std::max({lo, shift, 0});
        for (int m = lo; m <= W; ++m) {
            const double v = value + (src ? src[std::min(m - shift, W)] : 0.0);
            if (v < dst[m]) {
                dst[m] = v;
                what[m] = choice.packed();
            }
        }
    };

    for (int len = 1; len <= n; ++len) {
        for (int s = 0; s + len <= n; ++s) {
            const int t = s + len - 1;
            const double g = ct.grad_after[t];  // live until B(t)
            for (int d = 0; d < tab.layers; ++d) {
                // Checkpoint(s..k−1) first: the same for both variants (the checkpoint holds its input whole).
                double* row = &tab.time[tab.index(kHeldWhole, d, s, t, 0)];
                std::uint32_t* what = &tab.what[tab.index(kHeldWhole, d, s, t, 0)];
                if (s < t && (unbounded || d > 0)) {
                    const int inner = unbounded ? 0 : d - 1;
                    double nosave = c.fwd_nosave_peak_bytes[s];
                    for (int k = s + 1; k <= t; ++k) {
                        if (k > s + 1) {
                            nosave = std::max(nosave, live_from(c, s, k - 1) + c.fwd_nosave_peak_bytes[k - 1]);
                        }
                        const double* after = &tab.time[tab.index(kHeldWhole, d, k, t, 0)];
                        const double* recompute = &tab.time[tab.index(kHeldWhole, inner, s, k - 1, 0)];
                        const double f = fwd_prefix[k] - fwd_prefix[s];
                        const int a = slots(live_from(c, s, k));
                        // Branch-free so that the compiler vectorizes it: this loop is the O(L³·S) part.
                        const std::uint32_t choice =
                            RematChoice{kCheckpointChoice, static_cast<std::uint16_t>(k)}.packed();
                        const double* shifted = after - a;
                        for (int m = std::max(slots(g + nosave), a); m <= W; ++m) {
                            const double v = f + shifted[m] + recompute[m];
                            const bool better = v < row[m];
                            row[m] = better ? v : row[m];
                            what[m] = better ? choice : what[m];
                        }
                    }
                }
                double* row_k = &tab.time[tab.index(kHeldByKept, d, s, t, 0)];
                std::uint32_t* what_k = &tab.what[tab.index(kHeldByKept, d, s, t, 0)];
                std::copy(row, row + W + 1, row_k);
                std::copy(what, what + W + 1, what_k);
                // Keep and Offload. Held by kept bytes, the saving forward frees fr slots of them.
                const double fb = c.fwd_s[s] + c.bwd_s[s];
                for (int v = 0; v < 2; ++v) {
                    const int fr = v == kHeldByKept && s > 0 ? freed[s - 1] : 0;
                    double* r = v == kHeldByKept ? row_k : row;
                    std::uint32_t* w = v == kHeldByKept ? what_k : what;
                    const int fwd_need = slots(g + c.fwd_peak_bytes[s]);
                    if (s == t) {
                        relax(r, w, nullptr, fb, std::max(fwd_need, slots(ct.bwd_peak[s]) - fr), 0, {kKeepChoice, 0});
                        continue;
                    }
                    const int keep_need = std::max(fwd_need, slots(c.bwd_peak_bytes[s]) - fr);
                    relax(r, w, &tab.time[tab.index(kHeldByKept, d, s + 1, t, 0)], fb, keep_need, kept[s] - fr,
                          {kKeepChoice, 0});
                    if (offload) {
                        const int need = std::max(keep_need, slots(c.kept_bytes[s] + ct.bwd_peak[s + 1]) - fr);
                        relax(r, w, &tab.time[tab.index(kHeldWhole, d, s + 1, t, 0)],
                              fb + exposed_transfer(c, s, o.offload_bw_bytes_per_s), need, out[s] - fr,
                              {kOffloadChoice, 0});
                    }
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
    backtrack(c, tab, Slots{tab.slot_bytes}, o.max_depth < 0, kHeldWhole, top, 0, n - 1, slot, r.plan);
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
