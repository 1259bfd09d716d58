// Exact pipeline stage partitioning; the problem, tables and recurrences are stated in partition.h.
#include "pyplan/partition.h"

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

// Per-range sums for every stage range [begin, end); flat index end·(L+1) + begin, so that the DP's inner
// loop over begin reads contiguous memory.
struct RangeTables {
    int num_cuts = 0;                 // L + 1
    std::vector<double> time_s;       // t(begin, end)
    std::vector<double> state_bytes;  // Σ state_bytes over the range
    std::vector<double> act_bytes;    // Σ act_bytes + cut_bytes[begin]: bytes per micro-batch in flight

    std::size_t index(int begin, int end) const {
        return static_cast<std::size_t>(end) * num_cuts + begin;
    }
    double need_bytes(int begin, int end, int in_flight) const {
        const std::size_t k = index(begin, end);
        return state_bytes[k] + in_flight * act_bytes[k];
    }
};

// What stage s may hold.
struct StageLimit {
    int in_flight = 0;
    double limit_bytes = 0.0;
};

// The first cut of the last stage in an optimal cover of [0, j) by s stages.
struct Choice {
    int begin_cut = -1;
};

// F[s][j] (or the overflow table H[s][j]) with its choices; flat index s·(L+1) + j.
struct DpTable {
    int num_cuts = 0;
    std::vector<double> value;
    std::vector<Choice> choice;

    DpTable(int num_stages, int cuts, double fill)
        : num_cuts(cuts),
          value(static_cast<std::size_t>(num_stages + 1) * cuts, fill),
          choice(value.size()) {}
    std::size_t index(int stages, int cut) const {
        return static_cast<std::size_t>(stages) * num_cuts + cut;
    }
};

struct Problem {
    RangeTables ranges;
    std::vector<StageLimit> stages;  // [p]
    int num_blocks = 0;
    int num_microbatches = 1;

    int num_stages() const { return static_cast<int>(stages.size()); }
    // Stage s may cover [i, j) only if s blocks fit before i and p−1−s after j.
    int first_end(int s) const { return s + 1; }
    int last_end(int s) const { return num_blocks - (num_stages() - 1 - s); }
};

// Callers test first and build the message only on failure: solvers validate in their hot paths.
[[noreturn]] void fail(const std::string& message) {
    throw std::invalid_argument(message);
}

void require_values(const std::vector<double>& values, const char* name, bool finite) {
    for (std::size_t i = 0; i < values.size(); ++i) {
        const double v = values[i];
        if (!(v >= 0.0 && (!finite || std::isfinite(v)))) {
            fail(std::string(name) + "[" + std::to_string(i) + "] must be a " + (finite ? "finite " : "") +
                 "number >= 0, got " + std::to_string(v));
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
    require_values(chain.fwd_time_s, "fwd_time_s", true);
    require_values(chain.bwd_time_s, "bwd_time_s", true);
    require_values(chain.act_bytes, "act_bytes", true);
    require_values(chain.state_bytes, "state_bytes", true);
    require_values(chain.cut_bytes, "cut_bytes", true);
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
    require_values(options.mem_limit_bytes, "mem_limit_bytes", false);
    if (!(std::isfinite(options.link.latency_s) && options.link.latency_s >= 0.0)) {
        fail("link latency_s must be a finite number >= 0, got " + std::to_string(options.link.latency_s));
    }
    if (!(options.link.bw_bytes_per_s > 0.0)) {
        fail("link bw_bytes_per_s must be > 0, got " + std::to_string(options.link.bw_bytes_per_s));
    }
}

// Cost of sending across cut c between two stages; nothing at the chain's ends.
double boundary_send_s(const Chain& chain, const Link& link, int cut) {
    if (cut == 0 || cut == chain.num_blocks()) return 0.0;
    return p2p_time_s(link, chain.cut_bytes[cut]);
}

RangeTables build_ranges(const Chain& chain, const Link& link) {
    const int L = chain.num_blocks();
    RangeTables r;
    r.num_cuts = L + 1;
    const std::size_t size = static_cast<std::size_t>(L + 1) * (L + 1);
    r.time_s.assign(size, kInf);
    r.state_bytes.assign(size, kInf);
    r.act_bytes.assign(size, kInf);
    std::vector<double> send_s(L + 1);
    for (int c = 0; c <= L; ++c) send_s[c] = boundary_send_s(chain, link, c);
    for (int begin = 0; begin < L; ++begin) {
        double compute_s = 0.0;
        double state = 0.0;
        double act = 0.0;
        for (int end = begin + 1; end <= L; ++end) {
            compute_s += chain.fwd_time_s[end - 1] + chain.bwd_time_s[end - 1];
            state += chain.state_bytes[end - 1];
            act += chain.act_bytes[end - 1];
            const std::size_t k = r.index(begin, end);
            r.time_s[k] = compute_s + send_s[end] + send_s[begin];
            r.state_bytes[k] = state;
            r.act_bytes[k] = act + chain.cut_bytes[begin];
        }
    }
    return r;
}

Problem build_problem(const Chain& chain, const PartitionOptions& options) {
    Problem problem;
    problem.ranges = build_ranges(chain, options.link);
    problem.num_blocks = chain.num_blocks();
    problem.num_microbatches = options.num_microbatches;
    const int p = options.num_stages;
    for (int s = 0; s < p; ++s) {
        problem.stages.push_back({in_flight_microbatches(options.in_flight, s, p, options.num_microbatches),
                                  options.mem_limit_bytes[s]});
    }
    return problem;
}

// F[s][j] of partition.h for the bound B: least Σ t with every t ≤ B and every stage within memory.
DpTable least_sum_table(const Problem& problem, double bound_s) {
    const RangeTables& r = problem.ranges;
    const int p = problem.num_stages();
    DpTable f(p, r.num_cuts, kInf);
    f.value[f.index(0, 0)] = 0.0;
    for (int s = 1; s <= p; ++s) {
        const StageLimit& stage = problem.stages[s - 1];
        for (int j = problem.first_end(s - 1); j <= problem.last_end(s - 1); ++j) {
            double best = kInf;
            int best_begin = -1;
            // A range over the bound or over the memory limit costs ∞, as does an unreachable i (F = ∞).
            for (int i = s - 1; i < j; ++i) {
                const double t = r.time_s[r.index(i, j)];
                const bool allowed = t <= bound_s && r.need_bytes(i, j, stage.in_flight) <= stage.limit_bytes;
                const double total = allowed ? f.value[f.index(s - 1, i)] + t : kInf;
                best_begin = total < best ? i : best_begin;
                best = std::min(total, best);
            }
            f.value[f.index(s, j)] = best;
            f.choice[f.index(s, j)].begin_cut = best_begin;
        }
    }
    return f;
}

// H[s][j]: least worst overflow max(mem − limit) over the first s stages covering [0, j).
// H[0][0] = −∞, H[0][j>0] = ∞, H[s][j] = min_i max(H[s−1][i], mem_{s−1}(i, j) − limit_{s−1}).
DpTable least_overflow_table(const Problem& problem) {
    const RangeTables& r = problem.ranges;
    const int p = problem.num_stages();
    DpTable h(p, r.num_cuts, kInf);
    h.value[h.index(0, 0)] = -kInf;
    for (int s = 1; s <= p; ++s) {
        const StageLimit& stage = problem.stages[s - 1];
        for (int j = problem.first_end(s - 1); j <= problem.last_end(s - 1); ++j) {
            double best = kInf;
            int best_begin = -1;
            for (int i = s - 1; i < j; ++i) {
                const double before = h.value[h.index(s - 1, i)];
                const double over = std::max(before, r.need_bytes(i, j, stage.in_flight) - stage.limit_bytes);
                if (over < best) {
                    best = over;
                    best_begin = i;
                }
            }
            h.value[h.index(s, j)] = best;
            h.choice[h.index(s, j)].begin_cut = best_begin;
        }
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
    const RangeTables& r = problem.ranges;
    PartitionResult result;
    result.feasible = true;
    result.cuts = cuts;
    for (int s = 0; s < problem.num_stages(); ++s) {
        const std::size_t k = r.index(cuts[s], cuts[s + 1]);
        const int in_flight = problem.stages[s].in_flight;
        result.stage_time_s.push_back(r.time_s[k]);
        result.stage_state_bytes.push_back(r.state_bytes[k]);
        result.stage_act_bytes.push_back(in_flight * r.act_bytes[k]);
        result.stage_in_flight.push_back(in_flight);
    }
    result.pipeline_time_s = pipeline_time_s(result.stage_time_s, problem.num_microbatches);
    result.bottleneck_s = *std::max_element(result.stage_time_s.begin(), result.stage_time_s.end());
    return result;
}

std::string format_bytes(double bytes) {
    static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int unit = 0;
    while (std::fabs(bytes) >= 1000.0 && unit < 5) {
        bytes /= 1000.0;
        ++unit;
    }
    char text[64];
    std::snprintf(text, sizeof text, "%.3g %s", bytes, kUnits[unit]);
    return text;
}

PartitionResult infeasible(const Problem& problem) {
    const int p = problem.num_stages();
    const DpTable h = least_overflow_table(problem);
    const std::vector<int> cuts = backtrack(h, p, problem.num_blocks);
    PartitionResult result;
    double worst = -kInf;
    for (int s = 0; s < p; ++s) {
        const StageLimit& stage = problem.stages[s];
        const double need = problem.ranges.need_bytes(cuts[s], cuts[s + 1], stage.in_flight);
        if (need - stage.limit_bytes > worst) {
            worst = need - stage.limit_bytes;
            result.overflow = {s, cuts[s], cuts[s + 1], stage.in_flight, need, stage.limit_bytes};
        }
    }
    const Overflow& o = result.overflow;
    const std::size_t k = problem.ranges.index(o.begin_cut, o.end_cut);
    const std::string blocks = o.end_cut - o.begin_cut == 1
                                   ? "block " + std::to_string(o.begin_cut)
                                   : "blocks " + std::to_string(o.begin_cut) + "-" + std::to_string(o.end_cut - 1);
    result.reason = "no partition into " + std::to_string(p) + " stages fits in memory; the best overflows by " +
                    format_bytes(o.overflow_bytes()) + ": stage " + std::to_string(o.stage) + " (" + blocks +
                    ") needs " + format_bytes(o.need_bytes) + " (state " +
                    format_bytes(problem.ranges.state_bytes[k]) + " + " + std::to_string(o.in_flight) +
                    " micro-batches in flight x " + format_bytes(problem.ranges.act_bytes[k]) + "), limit " +
                    format_bytes(o.limit_bytes);
    return result;
}

// The distinct stage times t(i, j) of the ranges some stage can cover, in increasing order.
std::vector<double> bottleneck_candidates(const Problem& problem) {
    const int L = problem.num_blocks;
    std::vector<double> candidates;
    for (int end = 1; end <= L; ++end) {
        for (int begin = 0; begin < end; ++begin) {
            if (begin + (L - end) >= problem.num_stages() - 1) {
                candidates.push_back(problem.ranges.time_s[problem.ranges.index(begin, end)]);
            }
        }
    }
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
    return candidates;
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

PartitionResult partition(const Chain& chain, const PartitionOptions& options) {
    validate(chain, options);
    const Problem problem = build_problem(chain, options);
    const int p = problem.num_stages();
    const int L = problem.num_blocks;
    const int m = problem.num_microbatches;

    // G(∞): the least sum with no bound; infinite when no partition fits in memory.
    const DpTable unbounded = least_sum_table(problem, kInf);
    const double least_sum_s = unbounded.value[unbounded.index(p, L)];
    if (least_sum_s == kInf) return infeasible(problem);

    PartitionResult best = describe(problem, backtrack(unbounded, p, L));
    // G(B_k) by one DP; every feasible DP also offers its partition as a candidate answer.
    const std::vector<double> candidates = bottleneck_candidates(problem);
    auto least_sum = [&](int rank) {
        const DpTable f = least_sum_table(problem, candidates[rank]);
        const double g = f.value[f.index(p, L)];
        if (g < kInf) {
            PartitionResult offer = describe(problem, backtrack(f, p, L));
            if (offer.pipeline_time_s < best.pipeline_time_s) best = std::move(offer);
        }
        return g;
    };

    // B*: the least bound with a feasible partition; the largest candidate admits every range, so G = G(∞).
    const int top = static_cast<int>(candidates.size()) - 1;
    int low = 0;
    int high = top;
    double least_sum_at_high = least_sum_s;
    while (low < high) {
        const int mid = low + (high - low) / 2;
        const double g = least_sum(mid);
        if (g < kInf) {
            high = mid;
            least_sum_at_high = g;
        } else {
            low = mid + 1;
        }
    }
    if (options.objective == PartitionObjective::kBottleneck) {
        const DpTable f = least_sum_table(problem, candidates[low]);
        return describe(problem, backtrack(f, p, L));
    }

    // Runs of ranks (lo, hi) whose G(lo), G(hi) are known and whose inner ranks are still open.
    struct Run {
        int lo;
        int hi;
        double g_lo;
        double g_hi;
    };
    std::vector<Run> open = {{low, top, least_sum_at_high, least_sum_s}};
    while (!open.empty()) {
        const Run run = open.back();
        open.pop_back();
        if (run.hi - run.lo <= 1 || run.g_lo == run.g_hi) continue;
        if (run.g_hi + (m - 1) * candidates[run.lo + 1] >= best.pipeline_time_s) continue;
        const int mid = run.lo + (run.hi - run.lo) / 2;
        const double g_mid = least_sum(mid);
        open.push_back({mid, run.hi, g_mid, run.g_hi});
        open.push_back({run.lo, mid, run.g_lo, g_mid});
    }
    return best;
}

}  // namespace pyplan
