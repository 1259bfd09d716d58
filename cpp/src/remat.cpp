// Optimal rematerialization of a chain: the tables and the recurrence are stated in pyplan/remat.h.
#include "pyplan/remat.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>

#include "pyplan/check.h"
#include "pyplan/format.h"
#include "pyplan/limits.h"

namespace pyplan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfTime = std::numeric_limits<float>::infinity();

bool saves_of(const RematChain& c, int i) { return c.saves.empty() || c.saves[i]; }

bool saved_by(const RematValue& v, int block) {
    return std::binary_search(v.savers.begin(), v.savers.end(), block);
}

void check_chain(const RematChain& c) {
    const std::size_t n = c.fwd_s.size();
    require_int_in(static_cast<long long>(n), 1, kMaxRematBlocks, "the number of blocks (fwd_s)");
    for (const auto* v : {&c.bwd_s, &c.kept_bytes, &c.out_bytes, &c.fwd_peak_bytes, &c.fwd_nosave_peak_bytes,
                          &c.bwd_peak_bytes}) {
        if (v->size() != n) throw std::invalid_argument("remat: every per-block vector needs one entry per block");
    }
    if (c.grad_bytes.size() != n + 1) throw std::invalid_argument("remat: grad_bytes needs one entry per cut");
    if (!c.saves.empty() && c.saves.size() != n) {
        throw std::invalid_argument("remat: saves needs one entry per block (or none)");
    }
    if (!c.checkpoint_block_s.empty() && c.checkpoint_block_s.size() != n) {
        throw std::invalid_argument("remat: checkpoint_block_s needs one entry per block (or none)");
    }
    require_each_in(c.fwd_s, 0.0, kMaxSeconds, "fwd_s");
    require_each_in(c.bwd_s, 0.0, kMaxSeconds, "bwd_s");
    require_each_in(c.kept_bytes, 0.0, kMaxBytes, "kept_bytes");
    require_each_in(c.out_bytes, 0.0, kMaxBytes, "out_bytes");
    require_each_in(c.fwd_peak_bytes, 0.0, kMaxBytes, "fwd_peak_bytes");
    require_each_in(c.fwd_nosave_peak_bytes, 0.0, kMaxBytes, "fwd_nosave_peak_bytes");
    require_each_in(c.bwd_peak_bytes, 0.0, kMaxBytes, "bwd_peak_bytes");
    require_each_in(c.grad_bytes, 0.0, kMaxBytes, "grad_bytes");
    require_each_in(c.checkpoint_block_s, 0.0, kMaxSeconds, "checkpoint_block_s");
    const int L = static_cast<int>(n);
    std::vector<double> total(n, 0.0);
    for (std::size_t q = 0; q < c.values.size(); ++q) {
        if (!(c.values[q].bytes >= 0.0 && c.values[q].bytes <= kMaxBytes)) {
            fail_range("values[" + std::to_string(q) + "] bytes", "[0, " + format_number(kMaxBytes) + "]",
                       format_number(c.values[q].bytes));
        }
    }
    for (const RematValue& v : c.values) {
        if (v.block < 0 || v.block >= L || v.last <= v.block || v.last > L) {
            throw std::invalid_argument("remat: a value must be live from its block's output cut to at most cut L");
        }
        for (std::size_t q = 0; q < v.savers.size(); ++q) {
            const int saver = v.savers[q];
            if (saver < v.block || saver > std::min(v.last, L - 1) || (q > 0 && saver <= v.savers[q - 1]) ||
                !saves_of(c, saver)) {
                throw std::invalid_argument("remat: a value's savers must be ascending blocks that read it and save");
            }
        }
        total[v.block] += v.bytes;
    }
    if (!c.values.empty()) {
        for (int i = 0; i < L; ++i) {
            if (std::abs(total[i] - c.out_bytes[i]) > 1e-9 * std::max(1.0, c.out_bytes[i])) {
                throw std::invalid_argument("remat: a block's values do not add up to its out_bytes");
            }
        }
    }
}

// What min_peak_bytes reads of the options.
void check_depth_and_offload(const RematOptions& o) {
    if (o.max_depth < -1) {
        throw std::invalid_argument("max_depth must be -1 (unbounded) or >= 0, got " + std::to_string(o.max_depth));
    }
    const double bw = o.offload_bw_bytes_per_s;
    if (!(bw == 0.0 || (bw >= kMinBwBytesPerS && bw <= kMaxValue))) {
        fail_range("offload_bw_bytes_per_s",
                   "0 (no offloading) or [" + format_number(kMinBwBytesPerS) + ", " + format_number(kMaxValue) + "]",
                   format_number(bw));
    }
}

void check_options(const RematOptions& o) {
    if (!(o.budget_bytes > 0.0 && o.budget_bytes <= kMaxBytes)) {
        fail_range("budget_bytes", "(0, " + format_number(kMaxBytes) + "]", format_number(o.budget_bytes));
    }
    require_int_in(o.slots, 1, kMaxRematSlots, "slots");
    require_in(o.checkpoint_s, 0.0, kMaxSeconds, "checkpoint_s");
    check_depth_and_offload(o);
}

// Checkpoint nesting layers tabled: any depth ≥ L − 1 allows every plan (each level nests a shorter segment).
int layers_of(const RematOptions& o, int n) { return o.max_depth < 0 ? 1 : std::min(o.max_depth, n - 1) + 1; }

void check_entries(std::size_t entries, const char* what) {
    if (entries > kMaxRematTableEntries) {
        throw std::invalid_argument(std::string("remat: ") + what + " needs " + std::to_string(entries) +
                                    " entries, more than kMaxRematTableEntries (" +
                                    std::to_string(kMaxRematTableEntries) + "): use fewer slots, blocks or max_depth");
    }
}

// The values of the chain; by default each block's outputs are one value, live one cut, saved by the block and
// the next one (held until the block's backward).
std::vector<RematValue> values_of(const RematChain& c) {
    if (!c.values.empty()) return c.values;
    const int n = c.num_blocks();
    std::vector<RematValue> out;
    for (int i = 0; i < n; ++i) {
        out.push_back({i, c.out_bytes[i], i + 1, i + 1 < n ? std::vector<int>{i, i + 1} : std::vector<int>{i}});
    }
    return out;
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

// Slot counts saturate here: far above any width (kMaxRematSlots), and a sum of a few stays far below 2^63.
constexpr long long kSaturated = 1LL << 40;

// Bytes to slots, rounded up (sizes and needs) so that slot feasibility implies byte feasibility; 64-bit and
// saturating at kSaturated (such a need never fits).
struct Slots {
    double slot_bytes;
    long long operator()(double bytes) const {
        if (!(bytes > 0)) return 0;
        const double v = std::ceil(bytes / slot_bytes);
        return v >= static_cast<double>(kSaturated) ? kSaturated : static_cast<long long>(v);
    }
    // Rounded down: for bytes that are given back (saturating under-counts them: safe).
    long long down(double bytes) const {
        if (!(bytes > 0)) return 0;
        const double v = std::floor(bytes / slot_bytes);
        return v >= static_cast<double>(kSaturated) ? kSaturated : static_cast<long long>(v);
    }
};

// What an item leaves held: `held` slots rounded up less `freed` rounded down. A saturated `held` is not a
// size any more: the item is never taken, whatever it frees.
long long held_less_freed(long long held, long long freed) { return held >= kSaturated ? kSaturated : held - freed; }

double exposed_transfer(const RematChain& c, int s, double bw) {
    const double tau = (c.kept_bytes[s] - c.out_bytes[s]) / bw;
    return std::max(0.0, tau - c.fwd_s[s]) + std::max(0.0, tau - c.bwd_s[s + 1]);
}

std::size_t cut_index(int n, int c, int k) { return static_cast<std::size_t>(c) * (n + 1) + k; }

}  // namespace

RematStates remat_states(const RematChain& c) {
    check_chain(c);
    const int n = c.num_blocks();
    const std::vector<RematValue> values = values_of(c);
    std::vector<std::vector<int>> own(n);
    for (int v = 0; v < static_cast<int>(values.size()); ++v) own[values[v].block].push_back(v);
    RematStates st;
    // live_from(c, k) = Σ_{j=c}^{k−1} (values of j live at k): add block k−1's values, drop those that ended.
    st.live_from.assign(static_cast<std::size_t>(n) * (n + 1), 0.0);
    for (int from = 0; from < n; ++from) {
        std::vector<double> ending(n + 2, 0.0);
        double total = 0;
        for (int k = from + 1; k <= n; ++k) {
            for (int v : own[k - 1]) {
                total += values[v].bytes;
                ending[values[v].last + 1] += values[v].bytes;
            }
            total -= ending[k];
            st.live_from[cut_index(n, from, k)] = total;
        }
    }
    st.last_saving.assign(n, -1);
    for (int i = 0; i < n; ++i) st.last_saving[i] = saves_of(c, i) ? i : (i > 0 ? st.last_saving[i - 1] : -1);

    // The relevant sets reached at each cut, numbered in order of discovery (∅ first).
    std::vector<std::vector<std::vector<int>>> sets(n);
    std::vector<std::map<std::vector<int>, int>> numbers(n);
    std::size_t members = 0;  // of every set numbered so far: the states' memory
    auto number = [&](int s, std::vector<int> set) {
        const auto [it, fresh] = numbers[s].emplace(set, static_cast<int>(sets[s].size()));
        if (fresh) {
            members += set.size() + 1;
            check_entries(members, "the states (sets of owned values)");
            sets[s].push_back(std::move(set));
        }
        return it->second;
    };
    st.next.assign(n, {});
    st.checkpoint.assign(static_cast<std::size_t>(n) * (n + 1), -1);
    for (int s = 0; s < n; ++s) {
        number(s, {});
        if (s > 0) {
            // Keep(s−1): what it leaves unsaved passes on, its own unsaved outputs join; values that s saves
            // cost nothing at s and are held from there on, so they leave.
            for (std::size_t v = 0; v < sets[s - 1].size(); ++v) {
                std::vector<int> image;
                for (int u : sets[s - 1][v]) {
                    if (values[u].last >= s && !saved_by(values[u], s)) image.push_back(u);
                }
                for (int u : own[s - 1]) {
                    if (values[u].bytes > 0 && !saved_by(values[u], s - 1) && !saved_by(values[u], s)) {
                        image.push_back(u);
                    }
                }
                std::sort(image.begin(), image.end());
                st.next[s - 1].push_back(number(s, std::move(image)));
            }
            // Checkpoint(from..s−1), when it saves anything: the segment's values live at s.
            for (int from = 0; from < s; ++from) {
                if (st.last_saving[s - 1] < from) continue;
                std::vector<int> made;
                for (int j = from; j < s; ++j) {
                    for (int u : own[j]) {
                        if (values[u].bytes > 0 && values[u].last >= s && !saved_by(values[u], s)) made.push_back(u);
                    }
                }
                st.checkpoint[cut_index(n, from, s)] = number(s, std::move(made));
            }
        }
    }
    st.count.assign(n, 0);
    st.phi.assign(n, {});
    st.dead_top.assign(n, {});
    st.dead_rec.assign(n, {});
    for (int s = 0; s < n; ++s) {
        st.count[s] = static_cast<int>(sets[s].size());
        double own_top = 0, own_rec = 0;
        for (int u : own[s]) {
            if (saved_by(values[u], s)) continue;
            own_rec += values[u].bytes;
            if (values[u].last < n) own_top += values[u].bytes;
        }
        for (const std::vector<int>& set : sets[s]) {
            double phi = 0, top = own_top, rec = own_rec;
            for (int u : set) {
                if (values[u].last == s) phi += values[u].bytes;
                rec += values[u].bytes;
                if (values[u].last < n) top += values[u].bytes;
            }
            st.phi[s].push_back(phi);
            st.dead_top[s].push_back(top);
            st.dead_rec[s].push_back(rec);
        }
    }
    return st;
}

namespace {

// The recurrence of remat.h for one entry (v, d, s, t), in slots: each option is worth
// base + first[min(m − shift, W)] + second[m] (a null row counts 0) where lo ≤ m ≤ hi, in float (the table's
// type: half the memory the O(L³·S) loop streams). The table is filled from these and the plan read back from
// them, so both agree by construction.
struct Option {
    RematToken token;      // kKeep, kOffload or kBegin (a checkpoint of s..split−1)
    int split = 0;
    float base = 0;
    int lo = 0, hi = 0, shift = 0;
    const float* first = nullptr;
    const float* second = nullptr;
    float at(int m, int width) const {
        return base + (first ? first[std::min(m - shift, width)] : 0.0f) + (second ? second[m] : 0.0f);
    }
};

struct Recurrence {
    const RematChain& c;
    const RematStates& st;
    const RematTable& tab;
    Slots slots;
    bool unbounded;
    bool offload;
    double bw;
    double checkpoint_s;
    int n;
    int W;  // the table's width
    std::vector<long long> kept;
    std::vector<double> fwd_prefix;
    std::vector<double> extra_prefix;  // Σ checkpoint_block_s
    std::vector<double> bwd_prefix;
    Counted ct;

    Recurrence(const RematChain& chain, const RematStates& states, const RematTable& table, const RematOptions& o)
        : c(chain), st(states), tab(table), slots{table.slot_bytes}, unbounded(o.max_depth < 0),
          offload(o.offload_bw_bytes_per_s > 0), bw(o.offload_bw_bytes_per_s), checkpoint_s(o.checkpoint_s),
          n(chain.num_blocks()), W(table.width), ct(counted_of(chain)) {
        fwd_prefix.assign(n + 1, 0.0);
        extra_prefix.assign(n + 1, 0.0);
        bwd_prefix.assign(n + 1, 0.0);
        for (int i = 0; i < n; ++i) {
            kept.push_back(slots(c.kept_bytes[i]));
            const double extra = c.checkpoint_block_s.empty() ? 0.0 : c.checkpoint_block_s[i];
            fwd_prefix[i + 1] = fwd_prefix[i] + c.fwd_s[i];
            extra_prefix[i + 1] = extra_prefix[i] + extra;
            bwd_prefix[i + 1] = bwd_prefix[i] + c.bwd_s[i];
        }
    }

    const float* row(int v, int d, int s, int t) const { return &tab.time[tab.index(v, d, s, t, 0)]; }

    // A slot count as an option holds it, clamped to [−(W+1), W+1]: that changes no option (a budget above W is
    // read at W, a need above W never fits) and keeps the options' sums in int.
    int in_table(long long count) const { return static_cast<int>(std::clamp<long long>(count, -(W + 1), W + 1)); }

    // D(O, s) for a subproblem ending at t: in a recomputation when t < L−1.
    double dead(int v, int s, int t) const { return t + 1 < n ? st.dead_rec[s][v] : st.dead_top[s][v]; }

    // The least budget (slots) from which keeping every block of s..t fits, at variant v (kSaturated: above any
    // width; an over-estimate only widens the checkpoint options' range).
    long long all_keep(int v, int s, int t) const { return tab.all_keep[tab.row(v, 0, s, t)]; }

    // Keep and Offload of block s at variant v; its saving forward frees φ slots (rounded down).
    void first_block(int v, int d, int s, int t, std::vector<Option>& out) const {
        const double g = ct.grad_after[t];
        const double fb = c.fwd_s[s] + c.bwd_s[s];
        const long long fwd_need = slots(g + c.fwd_peak_bytes[s]);
        if (s == t) {
            out.push_back({RematToken::kKeep, 0, static_cast<float>(fb),
                           in_table(std::max({fwd_need, slots(ct.bwd_peak[s] - dead(v, s, t)), 0LL})), W, 0});
            return;
        }
        const long long fr = slots.down(st.phi[s][v]);
        const long long keep_need = std::max(fwd_need, slots(c.bwd_peak_bytes[s] - dead(v, s, t)));
        const long long shift = held_less_freed(kept[s], fr);
        out.push_back({RematToken::kKeep, 0, static_cast<float>(fb), in_table(std::max({keep_need, shift, 0LL})), W,
                       in_table(shift), row(st.next[s][v], d, s + 1, t)});
        if (offload) {
            const double next_peak = ct.bwd_peak[s + 1] - dead(0, s + 1, t);
            const long long need = std::max(keep_need, slots(c.kept_bytes[s] - st.phi[s][v] + next_peak));
            const long long o_shift = held_less_freed(slots(c.out_bytes[s]), fr);
            out.push_back({RematToken::kOffload, 0, static_cast<float>(fb + exposed_transfer(c, s, bw)),
                           in_table(std::max({need, o_shift, 0LL})), W, in_table(o_shift), row(0, d, s + 1, t)});
        }
    }

    // Checkpoint(s..k−1) for every k whose segment saves anything (none at d = 0 with a bounded depth); up to
    // all_keep − 1, beyond which keeping everything is as fast as anything.
    void checkpoints(int d, int s, int t, std::vector<Option>& out) const {
        if (s == t || (!unbounded && d == 0)) return;
        const int inner = unbounded ? 0 : d - 1;
        const double g = ct.grad_after[t];
        const int hi = static_cast<int>(std::min<long long>(W, all_keep(0, s, t) - 1));
        double nosave = c.fwd_nosave_peak_bytes[s];
        double tail = 0;  // the trailing blocks' backward, before the recomputation: bwd_peak − out
        for (int k = s + 1; k <= t; ++k) {
            if (k > s + 1) nosave = std::max(nosave, st.live_from[cut_index(n, s, k - 1)] + c.fwd_nosave_peak_bytes[k - 1]);
            const int last = st.last_saving[k - 1];
            if (last < s) continue;
            tail = last == k - 1 ? 0.0 : std::max(tail, c.bwd_peak_bytes[k - 1] - c.out_bytes[k - 1]);
            const long long a = slots(st.live_from[cut_index(n, s, k)]);
            const double base = checkpoint_s + (fwd_prefix[k] - fwd_prefix[s]) + (extra_prefix[k] - extra_prefix[s]) +
                                (bwd_prefix[k] - bwd_prefix[last + 1]);
            out.push_back({RematToken::kBegin, k, static_cast<float>(base),
                           in_table(std::max({slots(g + nosave), a, slots(tail)})), hi, in_table(a),
                           row(st.checkpoint[cut_index(n, s, k)], d, k, t), row(0, inner, s, last)});
        }
    }
};

// row[m] = min(row[m], f + after[m − shift] + recompute[m]) for m in [lo, hi] (lo ≥ shift ≥ 0): branch-free over
// non-aliasing rows so that the compiler vectorizes it (this loop is the O(L³·S) part).
void relax_checkpoint(float* __restrict row, const float* __restrict after, const float* __restrict recompute,
                      float f, int shift, int lo, int hi) {
    for (int m = lo; m <= hi; ++m) row[m] = std::min(row[m], f + after[m - shift] + recompute[m]);
}

// Emit the plan of table entry (v, d, s, t, m) as flat steps: at each entry the first option (Keep, Offload,
// then checkpoints by increasing split) whose value is the entry's own, computed by the same expression.
void backtrack(const Recurrence& rec, int v, int d, int s, int t, int m, std::vector<RematStep>& out) {
    std::vector<Option> options;
    while (true) {
        const float want = rec.tab.time[rec.tab.index(v, d, s, t, m)];
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
            v = pick->token == RematToken::kKeep ? rec.st.next[s][v] : 0;
            ++s;
        } else {
            const int k = pick->split;
            const int last = rec.st.last_saving[k - 1];
            out.push_back({RematToken::kBegin, -1});
            backtrack(rec, 0, rec.unbounded ? 0 : d - 1, s, last, m, out);
            for (int j = last + 1; j < k; ++j) out.push_back({RematToken::kKeep, j});
            out.push_back({RematToken::kEnd, -1});
            m -= pick->shift;
            v = rec.st.checkpoint[cut_index(rec.n, s, k)];
            s = k;
        }
    }
}

// What one micro-batch holds after its forward: the top-level items' leftovers (a saving forward frees the
// owned values whose last reader it is; a checkpoint holds its segment's values at its output cut).
double after_forward(const RematChain& c, const RematStates& st, const std::vector<RematStep>& plan) {
    const int n = c.num_blocks();
    double total = 0;
    int depth = 0;
    int v = 0;  // the variant at the next top-level item's first block
    int segment_start = -1;
    int last_block = -1;
    for (const RematStep& step : plan) {
        if (step.token == RematToken::kBegin) {
            if (depth++ == 0) segment_start = -1;
        } else if (step.token == RematToken::kEnd) {
            if (--depth == 0) {
                total += st.live_from[cut_index(n, segment_start, last_block + 1)];
                v = st.checkpoint[cut_index(n, segment_start, last_block + 1)];
            }
        } else {
            const int s = step.block;
            if (depth == 0) {
                total += (step.token == RematToken::kKeep ? c.kept_bytes[s] : c.out_bytes[s]) - st.phi[s][v];
                v = step.token == RematToken::kKeep && s + 1 < n ? st.next[s][v] : 0;
            } else if (segment_start < 0) {
                segment_start = s;
            }
            last_block = s;
        }
    }
    return total;
}

}  // namespace

RematTable remat_table(const RematChain& c, const RematStates& st, const RematOptions& o) {
    check_options(o);
    const int n = c.num_blocks();
    RematTable tab;
    tab.num_blocks = n;
    tab.slots = o.slots;
    tab.layers = layers_of(o, n);
    tab.slot_bytes = o.budget_bytes / o.slots;
    const Slots slots{tab.slot_bytes};
    // What a saving forward frees is rounded down; the rows reach past the budget by the most any frees, up to
    // kMaxRematSlots (remat.h: a budget beyond W is read at W).
    long long most_freed = 0;
    for (int s = 0; s < n; ++s) {
        for (double phi : st.phi[s]) most_freed = std::max(most_freed, slots.down(phi));
    }
    tab.width = static_cast<int>(std::min<long long>(o.slots + most_freed, kMaxRematSlots));
    const int W = tab.width;
    tab.variants = st.count;
    std::size_t rows = 0;
    for (int s = 0; s < n; ++s) {
        tab.base.push_back(rows);
        rows += static_cast<std::size_t>(st.count[s]) * tab.layers * (n - s);
    }
    check_entries(rows > kMaxRematTableEntries ? rows : rows * (W + 1), "the table");
    tab.time.assign(rows * (W + 1), kInfTime);
    tab.all_keep.assign(rows, 0);
    const Recurrence rec(c, st, tab, o);
    const Counted& ct = rec.ct;

    // Below first_finite[row] an entry is ∞: the checkpoint loop starts there.
    std::vector<int> first_finite(rows, W + 1);
    std::vector<float> shared(W + 1);
    std::vector<Option> options;
    // By last block t, and for each from the last first block s down: entry (s, t) reads (k, t) for k > s, hot in
    // the cache while the s-loop runs, and (s, j) for j < t, done in an earlier t.
    for (int t = 0; t < n; ++t) {
        for (int s = t; s >= 0; --s) {
            for (int v = 0; v < st.count[s]; ++v) {
                const long long fwd_need = slots(ct.grad_after[t] + c.fwd_peak_bytes[s]);
                const double dead = rec.dead(v, s, t);
                if (s == t) {
                    tab.all_keep[tab.row(v, 0, s, t)] = std::max(fwd_need, slots(ct.bwd_peak[s] - dead));
                    continue;
                }
                // Saturating (a saturated term stays saturated, an over-estimate): each term is at most
                // kSaturated, so the sum stays far inside 64 bits.
                const long long rest = rec.all_keep(st.next[s][v], s + 1, t);
                const long long keep_rest =
                    rest >= kSaturated ? kSaturated
                                       : std::min(kSaturated,
                                                  held_less_freed(rec.kept[s], slots.down(st.phi[s][v])) + rest);
                tab.all_keep[tab.row(v, 0, s, t)] =
                    std::max({fwd_need, slots(c.bwd_peak_bytes[s] - dead), keep_rest});
            }
            for (int d = 0; d < tab.layers; ++d) {
                // Checkpoints first: the same for every variant (a checkpoint holds its input whole).
                std::fill(shared.begin(), shared.end(), kInfTime);
                options.clear();
                rec.checkpoints(d, s, t, options);
                const int inner = rec.unbounded ? 0 : d - 1;
                for (const Option& opt : options) {
                    const int k = opt.split;
                    const int v_rest = st.checkpoint[cut_index(n, s, k)];
                    const int lo = std::max({opt.lo, opt.shift + first_finite[tab.row(v_rest, d, k, t)],
                                             first_finite[tab.row(0, inner, s, st.last_saving[k - 1])]});
                    relax_checkpoint(shared.data(), opt.first, opt.second, opt.base, opt.shift, lo, opt.hi);
                }
                for (int v = 0; v < st.count[s]; ++v) {
                    float* r = &tab.time[tab.index(v, d, s, t, 0)];
                    std::copy(shared.begin(), shared.end(), r);
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

namespace {

// remat_at with the least peak known.
RematSolution solution_at(const RematChain& c, const RematStates& st, const RematOptions& o, const RematTable& tab,
                          int slot, double least_bytes) {
    RematSolution r;
    r.min_budget_bytes = least_bytes;
    const int n = c.num_blocks();
    const int top = tab.layers - 1;
    slot = std::clamp(slot, 0, tab.slots);
    const float t = tab.time[tab.index(0, top, 0, n - 1, slot)];
    if (!std::isfinite(t)) {
        r.reason = "no plan fits in " + format_bytes(slot * tab.slot_bytes) + "; the least any plan needs is " +
                   format_bytes(r.min_budget_bytes);
        return r;
    }
    r.feasible = true;
    r.time_s = t;
    r.peak_bound_bytes = slot * tab.slot_bytes;
    backtrack(Recurrence(c, st, tab, o), 0, top, 0, n - 1, slot, r.plan);
    r.after_forward_bytes = after_forward(c, st, r.plan);
    return r;
}

double least_peak_bytes(const RematChain& c, const RematStates& st, const RematOptions& o);

}  // namespace

RematSolution remat_at(const RematChain& c, const RematStates& st, const RematOptions& o, const RematTable& tab,
                       int slot) {
    return solution_at(c, st, o, tab, slot, least_peak_bytes(c, st, o));
}

RematSolution solve_remat(const RematChain& c, const RematOptions& o, int in_flight) {
    if (in_flight < 1) throw std::invalid_argument("in_flight must be >= 1, got " + std::to_string(in_flight));
    check_options(o);
    const RematStates st = remat_states(c);
    // Below the least peak nothing fits: answered before any table is built (its width grows as 1/budget).
    const double least = least_peak_bytes(c, st, o);
    if (o.budget_bytes < least) {
        RematSolution none;
        none.min_budget_bytes = least;
        none.reason = "no plan fits in " + format_bytes(o.budget_bytes) + "; the least any plan needs is " +
                      format_bytes(least);
        return none;
    }
    const RematTable tab = remat_table(c, st, o);
    RematSolution best = solution_at(c, st, o, tab, tab.slots, least);
    if (!best.feasible || in_flight == 1) return best;
    // Each smaller budget's optimum, while it stays feasible; keep the fastest whose copies fit.
    RematSolution fit;
    const int n = c.num_blocks();
    const int top = tab.layers - 1;
    float last_time = -1;
    for (int slot = tab.slots; slot >= 0; --slot) {
        const float t = tab.time[tab.index(0, top, 0, n - 1, slot)];
        if (!std::isfinite(t)) break;
        if (fit.feasible && t >= fit.time_s) continue;
        if (t == last_time) continue;  // the same optimum as at slot + 1 (ties keep the larger budget's plan)
        last_time = t;
        RematSolution cand = solution_at(c, st, o, tab, slot, least);
        if (cand.peak_bound_bytes + (in_flight - 1.0) * cand.after_forward_bytes <= o.budget_bytes) {
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
    check_depth_and_offload(o);
    return least_peak_bytes(c, remat_states(c), o);
}

namespace {

double least_peak_bytes(const RematChain& c, const RematStates& st, const RematOptions& o) {
    const int n = c.num_blocks();
    const bool unbounded = o.max_depth < 0;
    const bool offload = o.offload_bw_bytes_per_s > 0;
    const int layers = layers_of(o, n);
    const Counted ct = counted_of(c);
    // P[v][d][s][t]: least peak of a plan for s..t with d nesting levels left, at variant v of cut s.
    std::vector<std::size_t> base;
    std::size_t rows = 0;
    for (int s = 0; s < n; ++s) {
        base.push_back(rows);
        rows += static_cast<std::size_t>(st.count[s]) * layers * (n - s);
    }
    check_entries(rows, "the least-peak table");
    std::vector<double> P(rows, kInf);
    auto at = [&](int v, int d, int s, int t) -> double& {
        return P[base[s] + static_cast<std::size_t>(v * layers + d) * (n - s) + static_cast<std::size_t>(t - s)];
    };
    auto dead = [&](int v, int s, int t) { return t + 1 < n ? st.dead_rec[s][v] : st.dead_top[s][v]; };
    for (int len = 1; len <= n; ++len) {
        for (int s = 0; s + len <= n; ++s) {
            const int t = s + len - 1;
            const double g = ct.grad_after[t];
            for (int d = 0; d < layers; ++d) {
                double ckpt = kInf;
                if (s < t && (unbounded || d > 0)) {
                    const int inner = unbounded ? 0 : d - 1;
                    double nosave = c.fwd_nosave_peak_bytes[s];
                    double tail = 0;
                    for (int k = s + 1; k <= t; ++k) {
                        if (k > s + 1) {
                            nosave = std::max(nosave, st.live_from[cut_index(n, s, k - 1)] +
                                                          c.fwd_nosave_peak_bytes[k - 1]);
                        }
                        const int last = st.last_saving[k - 1];
                        if (last < s) continue;
                        tail = last == k - 1 ? 0.0 : std::max(tail, c.bwd_peak_bytes[k - 1] - c.out_bytes[k - 1]);
                        const double lambda = st.live_from[cut_index(n, s, k)];
                        ckpt = std::min(ckpt, std::max({g + nosave, tail,
                                                        lambda + at(st.checkpoint[cut_index(n, s, k)], d, k, t),
                                                        at(0, inner, s, last)}));
                    }
                }
                for (int v = 0; v < st.count[s]; ++v) {
                    double& best = at(v, d, s, t);
                    if (s == t) {
                        best = std::max(g + c.fwd_peak_bytes[s], ct.bwd_peak[s] - dead(v, s, t));
                        continue;
                    }
                    const double phi = st.phi[s][v];
                    const double keep = std::max(g + c.fwd_peak_bytes[s], c.bwd_peak_bytes[s] - dead(v, s, t));
                    best = std::min(ckpt, std::max(keep, c.kept_bytes[s] - phi + at(st.next[s][v], d, s + 1, t)));
                    if (offload) {
                        const double need =
                            std::max(keep, c.kept_bytes[s] - phi + ct.bwd_peak[s + 1] - dead(0, s + 1, t));
                        best = std::min(best, std::max(need, c.out_bytes[s] - phi + at(0, d, s + 1, t)));
                    }
                }
            }
        }
    }
    return at(0, layers - 1, 0, n - 1);
}

}  // namespace

}  // namespace pyplan
