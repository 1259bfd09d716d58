// Exact pipeline stage partitioning; the problem, tables and recurrences are stated in partition.h.
#include "pyplan/partition.h"

#include "pyplan/check.h"
#include "pyplan/format.h"
#include "pyplan/limits.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pyplan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kEps = std::numeric_limits<double>::epsilon();
// Sums of the same stage times in another order differ by about L·ε of their value: two sums or bounds
// closer than this share of the larger are a tie (partition.h).
constexpr double kTie = 1e-12;

// What stage s may hold.
struct StageLimit {
    int in_flight = 0;
    // PartitionOptions::input_buffer_cuts[s] and output_buffer_cuts[s]: mem adds extra_inputs·cut[i] +
    // output_buffers·cut[j].
    long long extra_inputs = 0;
    long long output_buffers = 0;
    bool fresh = false;  // PartitionOptions::fresh_grads[s]: mem leaves out min(Γ, n·A)
    double limit_bytes = 0.0;
    // Prefix-sum estimates of mem_s within `slack` of the limit are summed block by block; below
    // limit − slack a range surely fits, above limit + slack it surely does not (partition.h's ε).
    double sure_limit_bytes = 0.0;
    double loose_limit_bytes = 0.0;
};

// The first cut of the last stage in an optimal cover of [0, j) by s stages.
struct Choice {
    int begin_cut = -1;
};

// F[s][j] (or the overflow table H[s][j]) with its choices, stored row by row: row s holds the cuts
// [first[s], first[s] + its length), flat index offset[s] + (j − first[s]); an entry outside the stored
// rows is ∞. The DP stores only the band of cuts a row can reach, not all L+1.
struct DpTable {
    std::vector<int> first;                 // [rows] the first cut of row s
    std::vector<std::size_t> offset = {0};  // [rows+1] row s is value[offset[s], offset[s+1])
    std::vector<double> value;
    std::vector<Choice> choice;

    void clear() {
        first.clear();
        offset.assign(1, 0);
        value.clear();
        choice.clear();
    }
    void begin_row(int first_cut) { first.push_back(first_cut); }
    void push(double v, int begin_cut) {
        value.push_back(v);
        choice.push_back({begin_cut});
    }
    void end_row() { offset.push_back(value.size()); }
    bool holds(int s, int cut) const {
        return s + 1 < static_cast<int>(offset.size()) && cut >= first[s] &&
               offset[s] + (cut - first[s]) < offset[s + 1];
    }
    std::size_t index(int s, int cut) const { return offset[s] + (cut - first[s]); }
    double at(int s, int cut) const { return holds(s, cut) ? value[index(s, cut)] : kInf; }
};

// The buffers of least_sum_table, shared by the DPs of one partition() call: its table F and its scratch.
struct Workspace {
    DpTable table;
    std::vector<double> start;  // [L+1] a_i of the row being built
    std::vector<int> window;    // [L+1] the deque
    std::vector<int> rest;      // [p+1] rest[q] of least_sum_table
};

// The chain as prefix sums (any range in O(1)), the sends, and each stage's limits.
struct Problem {
    const Chain* chain = nullptr;
    int num_blocks = 0;
    int num_microbatches = 1;
    std::vector<StageLimit> stages;  // [p]
    std::vector<double> work_s;      // [L+1] W[c] = Σ_{k<c} (fwd_k + bwd_k)
    std::vector<double> state;       // [L+1] Σ_{k<c} state_bytes_k
    std::vector<double> act;         // [L+1] Σ_{k<c} act_bytes_k
    std::vector<double> keep;        // [L+1] Σ_{k<c} (state_bytes_k − grad_bytes_k)
    std::vector<double> send_s;      // [L+1] send(c), 0 at the chain's ends
    double max_send_s = 0.0;         // σ
    double max_cut_bytes = 0.0;      // κ

    int num_stages() const { return static_cast<int>(stages.size()); }
    // Stage s may cover [i, j) only if s blocks fit before i and p−1−s after j.
    int last_end(int s) const { return num_blocks - (num_stages() - 1 - s); }
    // Some stage can cover [i, j).
    bool coverable(int i, int j) const { return i + (num_blocks - j) >= num_stages() - 1; }

    // W[j] − W[i]: non-increasing in i and non-decreasing in j (rounding is monotone); t(i, j) lies in
    // [compute, most_time_s(compute)].
    double compute_s(int i, int j) const { return work_s[j] - work_s[i]; }
    double stage_time_s(int i, int j) const { return compute_s(i, j) + send_s[j] + send_s[i]; }
    double most_time_s(double compute) const { return compute + max_send_s + max_send_s; }

    // The definitions of partition.h, summed block by block.
    double state_bytes(int i, int j) const {
        double sum = 0.0;
        for (int k = i; k < j; ++k) sum += chain->state_bytes[k];
        return sum;
    }
    double saved_bytes(int i, int j) const {  // per micro-batch in flight, without the input cut
        double sum = 0.0;
        for (int k = i; k < j; ++k) sum += chain->act_bytes[k];
        return sum;
    }
    double act_bytes(int i, int j) const {  // per micro-batch in flight, with the input cut
        return saved_bytes(i, j) + chain->cut_bytes[i];
    }
    double unmade_bytes(int i, int j, const StageLimit& stage) const {
        if (!stage.fresh || chain->grad_bytes.empty()) return 0.0;
        double grads = 0.0;
        for (int k = i; k < j; ++k) grads += chain->grad_bytes[k];
        return unmade_grad_bytes(grads, stage.in_flight, saved_bytes(i, j));
    }
    double buffer_bytes(int i, int j, const StageLimit& stage) const {
        return stage.extra_inputs * chain->cut_bytes[i] + stage.output_buffers * chain->cut_bytes[j];
    }
    double need_bytes(int i, int j, const StageLimit& stage) const {
        double need = state_bytes(i, j) + stage.in_flight * act_bytes(i, j);
        if (stage.fresh) need -= unmade_bytes(i, j, stage);
        return stage.extra_inputs == 0 && stage.output_buffers == 0 ? need : need + buffer_bytes(i, j, stage);
    }
    // The prefix-sum estimate of need_bytes with `in_cut` bytes for the input cut and `out_cut` for the
    // output cut: non-increasing in i and non-decreasing in j and in both cuts (a fresh stage's
    // max(S, K + n·A) too: both are differences of non-decreasing prefix sums).
    double estimate_bytes(int i, int j, const StageLimit& stage, double in_cut, double out_cut) const {
        if (stage.fresh) {
            const double kept = (keep[j] - keep[i]) + stage.in_flight * (act[j] - act[i]);
            const double held = std::max(state[j] - state[i], kept);
            return held + stage.in_flight * in_cut + (stage.extra_inputs * in_cut + stage.output_buffers * out_cut);
        }
        return (state[j] - state[i]) + stage.in_flight * ((act[j] - act[i]) + in_cut) +
               (stage.extra_inputs * in_cut + stage.output_buffers * out_cut);
    }

    // i ∈ [loose(j), j): may stage s cover [i, j) under bound B? Necessary for it (partition.h).
    bool may_fit(int i, int j, const StageLimit& stage, double bound_s) const {
        return compute_s(i, j) <= bound_s && estimate_bytes(i, j, stage, 0.0, 0.0) <= stage.loose_limit_bytes;
    }
    // i ∈ [sure(j), j): sufficient for it.
    bool surely_fits(int i, int j, const StageLimit& stage, double bound_s) const {
        return most_time_s(compute_s(i, j)) <= bound_s &&
               estimate_bytes(i, j, stage, max_cut_bytes, max_cut_bytes) <= stage.sure_limit_bytes;
    }
    // Exactly: t(i, j) ≤ B and mem ≤ limit.
    bool fits(int i, int j, const StageLimit& stage, double bound_s) const {
        if (!(stage_time_s(i, j) <= bound_s)) return false;
        const double estimate = estimate_bytes(i, j, stage, chain->cut_bytes[i], chain->cut_bytes[j]);
        if (estimate <= stage.sure_limit_bytes) return true;
        if (estimate > stage.loose_limit_bytes) return false;
        return need_bytes(i, j, stage) <= stage.limit_bytes;
    }
};

// Callers test first and build the message only on failure: solvers validate in their hot paths.
[[noreturn]] void fail(const std::string& message) {
    throw std::invalid_argument(message);
}

// A memory limit: in [0, kMaxValue], or +∞ (no limit).
void require_limits(const std::vector<double>& limits) {
    for (std::size_t i = 0; i < limits.size(); ++i) {
        if (!(limits[i] >= 0.0 && (limits[i] <= kMaxValue || limits[i] == kInf))) {
            fail_range("mem_limit_bytes[" + std::to_string(i) + "]", "[0, " + format_number(kMaxValue) + "] or inf",
                       format_number(limits[i]));
        }
    }
}

void validate(const Chain& chain, const PartitionOptions& options) {
    const std::size_t num_blocks = chain.fwd_time_s.size();
    const std::string blocks = std::to_string(num_blocks);
    if (num_blocks == 0) fail("the chain has no blocks");
    if (chain.bwd_time_s.size() != num_blocks || chain.act_bytes.size() != num_blocks ||
        chain.state_bytes.size() != num_blocks) {
        fail("fwd_time_s, bwd_time_s, act_bytes and state_bytes must all have one entry per block (" + blocks +
             ")");
    }
    if (chain.cut_bytes.size() != num_blocks + 1) {
        fail("cut_bytes must have one entry per cut, L+1 = " + std::to_string(num_blocks + 1) + ", got " +
             std::to_string(chain.cut_bytes.size()));
    }
    require_each_in(chain.fwd_time_s, 0.0, kMaxValue, "fwd_time_s");
    require_each_in(chain.bwd_time_s, 0.0, kMaxValue, "bwd_time_s");
    require_each_in(chain.act_bytes, 0.0, kMaxValue, "act_bytes");
    require_each_in(chain.state_bytes, 0.0, kMaxValue, "state_bytes");
    require_each_in(chain.cut_bytes, 0.0, kMaxValue, "cut_bytes");
    if (!chain.grad_bytes.empty()) {
        if (chain.grad_bytes.size() != num_blocks) {
            fail("grad_bytes must be empty or have one entry per block (" + blocks + "), got " +
                 std::to_string(chain.grad_bytes.size()));
        }
        for (std::size_t k = 0; k < num_blocks; ++k) {
            const std::string entry = "grad_bytes[" + std::to_string(k) + "]";
            require_in(chain.grad_bytes[k], 0.0, chain.state_bytes[k], entry.c_str());
        }
    }
    const int p = options.num_stages;
    if (p < 1 || p > chain.num_blocks()) {
        fail("num_stages must be in [1, " + blocks + "] for a chain of " + blocks + " blocks, got " +
             std::to_string(p));
    }
    if (options.num_microbatches < 1) {
        fail("num_microbatches must be >= 1, got " + std::to_string(options.num_microbatches));
    }
    if (options.mem_limit_bytes.size() != static_cast<std::size_t>(p)) {
        fail("mem_limit_bytes must have one entry per stage (" + std::to_string(p) + "), got " +
             std::to_string(options.mem_limit_bytes.size()));
    }
    require_limits(options.mem_limit_bytes);
    require_in(options.link.latency_s, 0.0, kMaxValue, "link latency_s");
    require_bandwidth(options.link.bw_bytes_per_s, "link bw_bytes_per_s");
    const std::vector<int>& in_flight = options.in_flight_per_stage;
    if (!in_flight.empty() && in_flight.size() != static_cast<std::size_t>(p)) {
        fail("in_flight_per_stage must be empty or have one entry per stage (" + std::to_string(p) + "), got " +
             std::to_string(in_flight.size()));
    }
    for (std::size_t s = 0; s < in_flight.size(); ++s) {
        if (in_flight[s] < 1 || in_flight[s] > options.num_microbatches) {
            fail("in_flight_per_stage[" + std::to_string(s) + "] must be in [1, " +
                 std::to_string(options.num_microbatches) + "], got " + std::to_string(in_flight[s]));
        }
    }
    for (const auto& [buffers, name] : {std::pair{&options.input_buffer_cuts, "input_buffer_cuts"},
                                        std::pair{&options.output_buffer_cuts, "output_buffer_cuts"}}) {
        if (!buffers->empty() && buffers->size() != static_cast<std::size_t>(p)) {
            fail(std::string(name) + " must be empty or have one entry per stage (" + std::to_string(p) + "), got " +
                 std::to_string(buffers->size()));
        }
        for (std::size_t s = 0; s < buffers->size(); ++s) {
            const std::string entry = std::string(name) + "[" + std::to_string(s) + "]";
            require_int_in((*buffers)[s], 0, static_cast<long long>(kMaxBytes), entry.c_str());
        }
    }
    if (!options.fresh_grads.empty() && options.fresh_grads.size() != static_cast<std::size_t>(p)) {
        fail("fresh_grads must be empty or have one entry per stage (" + std::to_string(p) + "), got " +
             std::to_string(options.fresh_grads.size()));
    }
    const std::vector<int>& fixed = options.fixed_cuts;
    if (!fixed.empty()) {
        bool ordered = fixed.size() == static_cast<std::size_t>(p) + 1 && fixed.front() == 0 &&
                       fixed.back() == chain.num_blocks();
        for (std::size_t k = 1; ordered && k < fixed.size(); ++k) ordered = fixed[k - 1] < fixed[k];
        if (!ordered) {
            fail("fixed_cuts must be p+1 = " + std::to_string(p + 1) + " increasing cuts from 0 to " + blocks);
        }
    }
}

// Cost of sending across cut c between two stages; nothing at the chain's ends.
double boundary_send_s(const Chain& chain, const Link& link, int cut) {
    if (cut == 0 || cut == chain.num_blocks()) return 0.0;
    return p2p_time_s(link, chain.cut_bytes[cut]);
}

Problem build_problem(const Chain& chain, const PartitionOptions& options) {
    const int L = chain.num_blocks();
    const int p = options.num_stages;
    Problem problem;
    problem.chain = &chain;
    problem.num_blocks = L;
    problem.num_microbatches = options.num_microbatches;
    problem.work_s.assign(L + 1, 0.0);
    problem.state.assign(L + 1, 0.0);
    problem.act.assign(L + 1, 0.0);
    problem.keep.assign(L + 1, 0.0);
    problem.send_s.assign(L + 1, 0.0);
    for (int k = 0; k < L; ++k) {
        problem.work_s[k + 1] = problem.work_s[k] + (chain.fwd_time_s[k] + chain.bwd_time_s[k]);
        problem.state[k + 1] = problem.state[k] + chain.state_bytes[k];
        problem.act[k + 1] = problem.act[k] + chain.act_bytes[k];
        const double grads = chain.grad_bytes.empty() ? 0.0 : chain.grad_bytes[k];
        problem.keep[k + 1] = problem.keep[k] + (chain.state_bytes[k] - grads);
    }
    for (int c = 0; c <= L; ++c) {
        problem.send_s[c] = boundary_send_s(chain, options.link, c);
        problem.max_send_s = std::max(problem.max_send_s, problem.send_s[c]);
        problem.max_cut_bytes = std::max(problem.max_cut_bytes, chain.cut_bytes[c]);
    }
    for (int s = 0; s < p; ++s) {
        StageLimit stage;
        stage.in_flight = options.in_flight_per_stage.empty()
                              ? in_flight_microbatches(options.in_flight, s, p, options.num_microbatches)
                              : options.in_flight_per_stage[s];
        if (!options.input_buffer_cuts.empty()) stage.extra_inputs = options.input_buffer_cuts[s];
        if (!options.output_buffer_cuts.empty()) stage.output_buffers = options.output_buffer_cuts[s];
        stage.fresh = !options.fresh_grads.empty() && options.fresh_grads[s];
        stage.limit_bytes = options.mem_limit_bytes[s];
        // Each of S, A and the block-by-block sums is off by at most (L+1)·ε/2 of its total; the slack
        // covers both sides, the product and the rounding of limit ± slack with a wide margin.
        const double total = problem.state[L] + stage.in_flight * (problem.act[L] + problem.max_cut_bytes) +
                             (stage.extra_inputs + stage.output_buffers) * problem.max_cut_bytes;
        const double finite_limit = std::isfinite(stage.limit_bytes) ? stage.limit_bytes : 0.0;
        const double slack = 16.0 * (L + 4) * kEps * (total + finite_limit);
        stage.sure_limit_bytes = stage.limit_bytes - slack;
        stage.loose_limit_bytes = stage.limit_bytes + slack;
        problem.stages.push_back(stage);
    }
    return problem;
}

// F[s][j] of partition.h for the bound B, into ws.table: least Σ t with every t ≤ B and every stage within
// memory, by the window argument there. `start` holds a_i = F[s−1][i] − W[i] + send(i), `window` the deque.
// Row s keeps only the cuts j ≥ rest[s], a lower bound on where stage s can start in any partition:
// rest[p] = L, and rest[q] is the least i < rest[q+1] with may_fit(i, rest[q+1]) for stage q, or rest[q+1]
// when there is none. (If stage q started at some c < rest[q+1], its range would contain [c, rest[q+1]),
// and may_fit only gets easier for a shorter range.) A bound above L − (p − q) or rest[0] > 0 means no
// partition.
void least_sum_table(const Problem& problem, double bound_s, Workspace& ws) {
    const int p = problem.num_stages();
    const int L = problem.num_blocks;
    DpTable& f = ws.table;
    f.clear();
    std::vector<int>& rest = ws.rest;
    rest.assign(p + 1, L);
    for (int q = p - 1; q >= 0; --q) {
        int i = rest[q + 1];
        while (i > q && problem.may_fit(i - 1, rest[q + 1], problem.stages[q], bound_s)) --i;
        if (i > problem.last_end(q) - 1) return;
        rest[q] = i;
    }
    if (rest[0] > 0) return;
    f.begin_row(0);
    f.push(0.0, -1);
    f.end_row();
    std::vector<double>& start = ws.start;
    std::vector<int>& window = ws.window;
    start.resize(L + 1);
    window.resize(L + 1);
    int first = 0;  // F[s−1][i] is ∞ outside [first, last]
    int last = 0;
    for (int s = 1; s <= p; ++s) {
        const StageLimit& stage = problem.stages[s - 1];
        for (int i = first; i <= last; ++i) {
            start[i] = f.at(s - 1, i) - problem.work_s[i] + problem.send_s[i];
        }
        int head = 0;  // window[head, tail): starts in [sure, j), increasing in i and in a_i
        int tail = 0;
        int loose = first;
        int sure = first;
        int next_first = -1;
        int next_last = -1;
        const int row_first = std::max(first + 1, rest[s]);
        f.begin_row(row_first);
        for (int j = first + 1; j <= problem.last_end(s - 1); ++j) {
            while (loose < j && !problem.may_fit(loose, j, stage, bound_s)) ++loose;
            if (loose > last) break;  // so are the windows of every later j
            sure = std::max(sure, loose);
            while (sure < j && !problem.surely_fits(sure, j, stage, bound_s)) ++sure;
            const int newest = j - 1;
            if (newest >= sure && newest <= last && start[newest] < kInf) {
                while (tail > head && start[window[tail - 1]] >= start[newest]) --tail;
                window[tail++] = newest;
            }
            while (head < tail && window[head] < sure) ++head;
            if (j < row_first) continue;
            double best = head < tail ? start[window[head]] : kInf;
            int best_begin = head < tail ? window[head] : -1;
            for (int i = loose; i < std::min(sure, last + 1); ++i) {
                if (start[i] < best && problem.fits(i, j, stage, bound_s)) {
                    best = start[i];
                    best_begin = i;
                }
            }
            f.push(best == kInf ? kInf : best + (problem.work_s[j] + problem.send_s[j]), best_begin);
            if (best == kInf) continue;
            if (next_first < 0) next_first = j;
            next_last = j;
        }
        f.end_row();
        if (next_first < 0) return;  // F[p][L] = ∞
        first = next_first;
        last = next_last;
    }
}

// H[s][j] of partition.h: least worst overflow max(mem − limit) over the first s stages covering [0, j),
// with mem estimated by prefix sums (infeasible() reports the chosen partition's overflow exactly). The
// scan over the last stage's first cut i goes down from j − 1 and stops once the stage alone, without its
// input cut, overflows by the best found: that only grows as i falls.
DpTable least_overflow_table(const Problem& problem) {
    const int p = problem.num_stages();
    DpTable h;
    h.begin_row(0);
    h.push(-kInf, -1);
    h.end_row();
    for (int s = 1; s <= p; ++s) {
        const StageLimit& stage = problem.stages[s - 1];
        h.begin_row(s);
        for (int j = s; j <= problem.last_end(s - 1); ++j) {
            double best = kInf;
            int best_begin = -1;
            for (int i = j - 1; i >= s - 1; --i) {
                const double out_cut = problem.chain->cut_bytes[j];
                if (problem.estimate_bytes(i, j, stage, 0.0, out_cut) - stage.limit_bytes >= best) break;
                const double before = h.at(s - 1, i);
                const double need = problem.estimate_bytes(i, j, stage, problem.chain->cut_bytes[i], out_cut);
                const double over = std::max(before, need - stage.limit_bytes);
                if (over < best) {
                    best = over;
                    best_begin = i;
                }
            }
            h.push(best, best_begin);
        }
        h.end_row();
    }
    return h;
}

// The p+1 cuts of the optimum recorded in a table whose entry [p][L] is finite.
std::vector<int> backtrack(const DpTable& table, int num_stages, int num_blocks) {
    std::vector<int> cuts(num_stages + 1, 0);
    cuts[num_stages] = num_blocks;
    for (int s = num_stages; s >= 1; --s) cuts[s - 1] = table.choice[table.index(s, cuts[s])].begin_cut;
    return cuts;
}

PartitionResult describe(const Problem& problem, const std::vector<int>& cuts) {
    PartitionResult result;
    result.feasible = true;
    result.cuts = cuts;
    for (int s = 0; s < problem.num_stages(); ++s) {
        const int in_flight = problem.stages[s].in_flight;
        result.stage_time_s.push_back(problem.stage_time_s(cuts[s], cuts[s + 1]));
        result.stage_state_bytes.push_back(problem.state_bytes(cuts[s], cuts[s + 1]));
        result.stage_act_bytes.push_back(in_flight * problem.act_bytes(cuts[s], cuts[s + 1]));
        result.stage_unmade_grad_bytes.push_back(problem.unmade_bytes(cuts[s], cuts[s + 1], problem.stages[s]));
        result.stage_in_flight.push_back(in_flight);
    }
    // cost.h's pipeline_time_s, Σ t_s + (m−1)·max t_s, whose argument check (each t_s ≤ kMaxValue) a stage of
    // many blocks may exceed: below kMaxValue·L + sends, the sum stays finite (limits.h).
    result.bottleneck_s = *std::max_element(result.stage_time_s.begin(), result.stage_time_s.end());
    double sum_s = 0.0;
    for (double t : result.stage_time_s) sum_s += t;
    result.pipeline_time_s = sum_s + (problem.num_microbatches - 1.0) * result.bottleneck_s;
    return result;
}

// The stage of `cuts` whose need exceeds its limit the most (the first such stage on a tie).
Overflow worst_stage(const Problem& problem, const std::vector<int>& cuts) {
    Overflow worst;
    double most = -kInf;
    for (int s = 0; s < problem.num_stages(); ++s) {
        const StageLimit& stage = problem.stages[s];
        const double need = problem.need_bytes(cuts[s], cuts[s + 1], stage);
        if (need - stage.limit_bytes > most) {
            most = need - stage.limit_bytes;
            worst = {s, cuts[s], cuts[s + 1], stage.in_flight, need, stage.limit_bytes};
        }
    }
    return worst;
}

PartitionResult infeasible(const Problem& problem) {
    const int p = problem.num_stages();
    const DpTable h = least_overflow_table(problem);
    const std::vector<int> cuts = backtrack(h, p, problem.num_blocks);
    PartitionResult result;
    result.overflow = worst_stage(problem, cuts);
    const Overflow& o = result.overflow;
    const std::string blocks = o.end_cut - o.begin_cut == 1
                                   ? "block " + std::to_string(o.begin_cut)
                                   : "blocks " + std::to_string(o.begin_cut) + "-" + std::to_string(o.end_cut - 1);
    const double state = problem.state_bytes(o.begin_cut, o.end_cut);
    const double act = problem.act_bytes(o.begin_cut, o.end_cut);
    const double buffers = problem.buffer_bytes(o.begin_cut, o.end_cut, problem.stages[o.stage]);
    const double unmade = problem.unmade_bytes(o.begin_cut, o.end_cut, problem.stages[o.stage]);
    result.reason = "no partition into " + std::to_string(p) + " stages fits in memory; the best overflows by " +
                    format_bytes(o.overflow_bytes()) + ": stage " + std::to_string(o.stage) + " (" + blocks +
                    ") needs " + format_bytes(o.need_bytes) + " (state " + format_bytes(state) + " + " +
                    std::to_string(o.in_flight) + " micro-batches in flight x " + format_bytes(act) +
                    (unmade > 0 ? " - gradients not yet made " + format_bytes(unmade) : std::string()) +
                    (buffers > 0 ? " + receive buffers " + format_bytes(buffers) : std::string()) + "), limit " +
                    format_bytes(o.limit_bytes);
    return result;
}

// The least candidate t(i, j) > x, ∞ if none. For each j, i ≥ k(j) — the least i with
// most_time_s(compute_s(i, j)) ≤ x, non-decreasing in j — has t ≤ x; below it, compute_s(i, j) ≤ t(i, j)
// grows as i falls, so the scan down stops once it reaches the least candidate found.
double next_candidate(const Problem& problem, double x) {
    const int L = problem.num_blocks;
    double best = kInf;
    int k = 0;
    for (int j = 1; j <= L; ++j) {
        while (k < j && problem.most_time_s(problem.compute_s(k, j)) > x) ++k;
        for (int i = k - 1; i >= 0 && problem.coverable(i, j) && problem.compute_s(i, j) < best; --i) {
            const double t = problem.stage_time_s(i, j);
            if (t > x && t < best) best = t;
        }
    }
    return best;
}

// The greatest candidate t(i, j) ≤ x, −∞ if none. For each j, i < r(j) — r(j) the least i with
// compute_s(i, j) ≤ x, non-decreasing in j — has t > x; above it, most_time_s(compute_s(i, j)) ≥ t(i, j)
// falls as i grows, so the scan up stops once it reaches the greatest candidate found.
double prev_candidate(const Problem& problem, double x) {
    const int L = problem.num_blocks;
    double best = -kInf;
    int r = 0;
    for (int j = 1; j <= L; ++j) {
        while (r < j && problem.compute_s(r, j) > x) ++r;
        for (int i = r; i < j && problem.most_time_s(problem.compute_s(i, j)) > best; ++i) {
            const double t = problem.stage_time_s(i, j);
            if (problem.coverable(i, j) && t <= x && t > best) best = t;
        }
    }
    return best;
}

}  // namespace

int in_flight_microbatches(InFlight rule, int stage, int num_stages, int num_microbatches) {
    if (stage < 0 || stage >= num_stages) {
        fail("stage must be in [0, " + std::to_string(num_stages) + "), got " + std::to_string(stage));
    }
    if (num_microbatches < 1) fail("num_microbatches must be >= 1, got " + std::to_string(num_microbatches));
    switch (rule) {
        case InFlight::kGPipe:
            return num_microbatches;
        case InFlight::kOneFOneB:
            return std::min(num_microbatches, num_stages - stage);
    }
    throw std::invalid_argument("unknown in-flight rule");
}

double unmade_grad_bytes(double grad_bytes, int in_flight, double act_bytes) {
    return std::min(grad_bytes, in_flight * act_bytes);
}

int held_input_cuts(int num_microbatches, int in_flight, int stage) {
    if (num_microbatches < 1) fail("num_microbatches must be >= 1, got " + std::to_string(num_microbatches));
    require_int_in(in_flight, 1, num_microbatches, "in_flight");
    if (stage < 0) fail("stage must be >= 0, got " + std::to_string(stage));
    if (stage == 0) return num_microbatches - in_flight;
    return in_flight < num_microbatches ? 1 : 0;
}

// The given partition when every stage fits; else infeasible, naming the stage that overflows most.
PartitionResult fixed_partition(const Problem& problem, const std::vector<int>& cuts) {
    PartitionResult result;
    result.overflow = worst_stage(problem, cuts);
    if (result.overflow.overflow_bytes() <= 0.0) return describe(problem, cuts);
    const Overflow& o = result.overflow;
    result.reason = "the given partition does not fit in memory: stage " + std::to_string(o.stage) + " (blocks " +
                    std::to_string(o.begin_cut) + "-" + std::to_string(o.end_cut - 1) + ") needs " +
                    format_bytes(o.need_bytes) + ", limit " + format_bytes(o.limit_bytes);
    return result;
}

PartitionResult partition(const Chain& chain, const PartitionOptions& options) {
    validate(chain, options);
    const Problem problem = build_problem(chain, options);
    if (!options.fixed_cuts.empty()) return fixed_partition(problem, options.fixed_cuts);
    const int p = problem.num_stages();
    const int L = problem.num_blocks;
    const int m = problem.num_microbatches;
    const bool bottleneck = options.objective == PartitionObjective::kBottleneck;

    PartitionResult best;  // feasible once some DP finds a partition
    auto sum_s = [](const PartitionResult& r) {
        double sum = 0.0;
        for (double t : r.stage_time_s) sum += t;
        return sum;
    };
    auto better = [&](const PartitionResult& a, const PartitionResult& b) {
        if (!b.feasible) return true;
        if (bottleneck) return std::make_pair(a.bottleneck_s, sum_s(a)) < std::make_pair(b.bottleneck_s, sum_s(b));
        return a.pipeline_time_s < b.pipeline_time_s;
    };
    // G(B) by one DP, and the bottleneck of its partition (≤ B); every feasible DP offers its partition.
    Workspace ws;
    auto least_sum = [&](double bound_s) {
        least_sum_table(problem, bound_s, ws);
        const double g = ws.table.at(p, L);
        if (g == kInf) return std::make_pair(kInf, kInf);
        PartitionResult offer = describe(problem, backtrack(ws.table, p, L));
        const double reached_s = offer.bottleneck_s;
        if (better(offer, best)) best = std::move(offer);
        return std::make_pair(g, reached_s);
    };

    // Probes start from what balance needs, max_s t_s ≥ W/p and ≥ every block's time (a guess, not a
    // claim): DPs under bounds near B* are the cheap ones, their rows narrow.
    double floor_s = problem.work_s[L] / p;
    for (int k = 0; k < L; ++k) floor_s = std::max(floor_s, problem.compute_s(k, k + 1));
    floor_s *= 1.0 - 1e-9;
    // No partition sums to less than W plus both sends of its p−1 inner cuts, at least the cheapest ones.
    std::vector<double> sends(problem.send_s.begin() + 1, problem.send_s.end() - 1);
    std::nth_element(sends.begin(), sends.begin() + (p - 1), sends.end());
    double least_sum_floor_s = problem.work_s[L];
    for (int k = 0; k < p - 1; ++k) least_sum_floor_s += 2 * sends[k];

    // Runs (lo, hi) of bounds: G(lo) = g_lo (∞ for lo = −∞), g_hi ≤ G(B) for every B in (lo, hi] (G(hi)
    // when hi is finite, the floor above for hi = ∞). A run is closed as partition.h says (g_lo ≤ g_hi,
    // within a tie, means G is constant on it); otherwise a DP at a candidate c strictly inside splits it,
    // at the middle of its values, or for hi = ∞ above lo by twice lo's distance from floor_s (galloping).
    struct Run {
        double lo;
        double hi;
        double g_lo;
        double g_hi;
    };
    std::vector<Run> open = {{-kInf, kInf, kInf, least_sum_floor_s}};
    while (!open.empty()) {
        const Run run = open.back();
        open.pop_back();
        if (run.g_hi >= run.g_lo * (1.0 - kTie) || (bottleneck && run.g_lo < kInf)) continue;
        const double first = next_candidate(problem, run.lo);
        if (!(first < run.hi)) continue;
        const double least_time_s = run.g_hi + (m - 1) * first;
        if (!bottleneck && best.feasible && least_time_s >= best.pipeline_time_s * (1.0 - kTie)) continue;
        const double low = std::max(run.lo, floor_s);
        const double probe_s = run.hi == kInf ? low + std::max(low - floor_s, floor_s / 128)
                                              : (low < run.hi ? low + (run.hi - low) / 2 : first);
        double bound_s = prev_candidate(problem, probe_s);
        if (!(bound_s > run.lo && bound_s < run.hi)) bound_s = first;
        const auto [g, reached_s] = least_sum(bound_s);
        open.push_back({bound_s, run.hi, g, run.g_hi});
        // reached_s ≤ bound_s < run.hi, so both runs hold fewer candidates: the loop ends.
        const double split_s = std::min(reached_s, bound_s);
        if (g < kInf && split_s > run.lo) open.push_back({run.lo, split_s, run.g_lo, g});
    }
    if (!best.feasible) return infeasible(problem);
    return best;
}

}  // namespace pyplan
