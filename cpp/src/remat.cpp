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
};

double exposed_transfer(const RematChain& c, int s, double bw) {
    const double tau = (c.kept_bytes[s] - c.out_bytes[s]) / bw;
    return std::max(0.0, tau - c.fwd_s[s]) + std::max(0.0, tau - c.bwd_s[s + 1]);
}

// Emit the plan of table entry (d, s, t, m) as flat steps.
void backtrack(const RematChain& c, const RematTable& tab, const Slots& slots, bool unbounded, int d, int s, int t,
               int m, std::vector<RematStep>& out) {
    while (true) {
        const RematChoice ch = RematChoice::unpack(tab.what[tab.index(d, s, t, m)]);
        if (ch.kind == kKeepChoice || ch.kind == kOffloadChoice) {
            const bool keep = ch.kind == kKeepChoice;
            out.push_back({keep ? RematToken::kKeep : RematToken::kOffload, s});
            if (s == t) return;
            m -= slots(keep ? c.kept_bytes[s] : c.out_bytes[s]);
            ++s;
        } else if (ch.kind == kCheckpointChoice) {
            const int k = ch.split;
            out.push_back({RematToken::kBegin, -1});
            backtrack(c, tab, slots, unbounded, unbounded ? 0 : d - 1, s, k - 1, m, out);
            out.push_back({RematToken::kEnd, -1});
            m -= slots(c.out_bytes[k - 1]);
            s = k;
        } else {
            throw std::logic_error("remat: backtracking reached an infeasible entry");
        }
    }
}

// What one micro-batch holds after its forward: the top-level items' leftovers.
double after_forward(const RematChain& c, const std::vector<RematStep>& plan) {
    double total = 0;
    int depth = 0;
    int last_block = -1;
    for (const RematStep& st : plan) {
        if (st.token == RematToken::kBegin) {
            ++depth;
        } else if (st.token == RematToken::kEnd) {
            if (--depth == 0) total += c.out_bytes[last_block];
        } else {
            last_block = st.block;
            if (depth == 0) total += st.token == RematToken::kKeep ? c.kept_bytes[st.block] : c.out_bytes[st.block];
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
    const int S = o.slots;
    const bool unbounded = o.max_depth < 0;
    const bool offload = o.offload_bw_bytes_per_s > 0;
    RematTable tab;
    tab.num_blocks = n;
    tab.slots = S;
    tab.layers = unbounded ? 1 : o.max_depth + 1;
    tab.slot_bytes = o.budget_bytes / S;
    const Slots slots{tab.slot_bytes};
    const std::size_t size = tab.index(tab.layers, 0, 0, 0);
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

    // Relax row `dst` with value + src[m − shift] for m ≥ lo (src may be null: a constant).
    auto relax = [S](double* dst, std::uint32_t* what, const double* src, double value, int lo, int shift,
                     RematChoice choice) {
        lo = std::max(lo, shift);
        for (int m = lo; m <= S; ++m) {
            const double v = value + (src ? src[m - shift] : 0.0);
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
                double* row = &tab.time[tab.index(d, s, t, 0)];
                std::uint32_t* what = &tab.what[tab.index(d, s, t, 0)];
                const double fb = c.fwd_s[s] + c.bwd_s[s];
                const int keep_need = slots(std::max(g + c.fwd_peak_bytes[s], ct.bwd_peak[s]));
                if (s == t) {
                    relax(row, what, nullptr, fb, keep_need, 0, {kKeepChoice, 0});
                    continue;
                }
                const double* rest = &tab.time[tab.index(d, s + 1, t, 0)];
                relax(row, what, rest, fb, keep_need, kept[s], {kKeepChoice, 0});
                if (offload) {
                    const int need = std::max(keep_need, slots(c.kept_bytes[s] + ct.bwd_peak[s + 1]));
                    relax(row, what, rest, fb + exposed_transfer(c, s, o.offload_bw_bytes_per_s), need, out[s],
                          {kOffloadChoice, 0});
                }
                if (!unbounded && d == 0) continue;
                const int inner = unbounded ? 0 : d - 1;
                double nosave = c.fwd_nosave_peak_bytes[s];
                for (int k = s + 1; k <= t; ++k) {
                    if (k > s + 1) nosave = std::max(nosave, c.out_bytes[k - 2] + c.fwd_nosave_peak_bytes[k - 1]);
                    const double* after = &tab.time[tab.index(d, k, t, 0)];
                    const double* recompute = &tab.time[tab.index(inner, s, k - 1, 0)];
                    const double f = fwd_prefix[k] - fwd_prefix[s];
                    const int a = out[k - 1];
                    // Branch-free so that the compiler vectorizes it: this loop is the O(L³·S) part.
                    const std::uint32_t choice =
                        RematChoice{kCheckpointChoice, static_cast<std::uint16_t>(k)}.packed();
                    const double* shifted = after - a;
                    for (int m = std::max(slots(g + nosave), a); m <= S; ++m) {
                        const double v = f + shifted[m] + recompute[m];
                        const bool better = v < row[m];
                        row[m] = better ? v : row[m];
                        what[m] = better ? choice : what[m];
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
    const double t = tab.time[tab.index(top, 0, n - 1, slot)];
    if (!std::isfinite(t)) {
        r.reason = "no plan fits in " + format_bytes(slot * tab.slot_bytes) + "; the least any plan needs is " +
                   format_bytes(r.min_budget_bytes);
        return r;
    }
    r.feasible = true;
    r.time_s = t;
    r.peak_bound_bytes = slot * tab.slot_bytes;
    backtrack(c, tab, Slots{tab.slot_bytes}, o.max_depth < 0, top, 0, n - 1, slot, r.plan);
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
        const double t = tab.time[tab.index(top, 0, n - 1, slot)];
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
    // P[d][s][t]: least peak of a plan for s..t with d nesting levels left.
    const std::size_t rows = static_cast<std::size_t>(n) * (n + 1) / 2;
    std::vector<double> P(layers * rows, kInf);
    auto at = [&](int d, int s, int t) -> double& {
        return P[static_cast<std::size_t>(d) * rows + static_cast<std::size_t>(t) * (t + 1) / 2 + s];
    };
    for (int len = 1; len <= n; ++len) {
        for (int s = 0; s + len <= n; ++s) {
            const int t = s + len - 1;
            const double g = ct.grad_after[t];
            for (int d = 0; d < layers; ++d) {
                double& best = at(d, s, t);
                const double keep = std::max(g + c.fwd_peak_bytes[s], ct.bwd_peak[s]);
                if (s == t) {
                    best = keep;
                    continue;
                }
                best = std::max(keep, c.kept_bytes[s] + at(d, s + 1, t));
                if (offload) {
                    const double need = std::max(keep, c.kept_bytes[s] + ct.bwd_peak[s + 1]);
                    best = std::min(best, std::max(need, c.out_bytes[s] + at(d, s + 1, t)));
                }
                if (!unbounded && d == 0) continue;
                const int inner = unbounded ? 0 : d - 1;
                double nosave = c.fwd_nosave_peak_bytes[s];
                for (int k = s + 1; k <= t; ++k) {
                    if (k > s + 1) nosave = std::max(nosave, c.out_bytes[k - 2] + c.fwd_nosave_peak_bytes[k - 1]);
                    best = std::min(best, std::max({g + nosave, c.out_bytes[k - 1] + at(d, k, t), at(inner, s, k - 1)}));
                }
            }
        }
    }
    return at(layers - 1, 0, n - 1);
}

}  // namespace pyplan
