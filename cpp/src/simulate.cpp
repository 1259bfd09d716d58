// Per-rank orders of torch's pipeline schedules and their event simulation; see simulate.h for the model.
#include "pyplan/simulate.h"

#include "pyplan/check.h"
#include "pyplan/limits.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pyplan {

namespace {

char op_letter(Op op) {
    switch (op) {
        case Op::Forward: return 'F';
        case Op::Backward: return 'B';
        case Op::BackwardInput: return 'I';
        case Op::BackwardWeight: return 'W';
    }
    return '?';
}

// torch's spelling of an action: stage, op letter, micro-batch ("3F0").
std::string token(const Action& a) {
    return std::to_string(a.stage) + op_letter(a.op) + std::to_string(a.microbatch);
}

// One rank's order under construction. Each stage numbers its own forwards and its own backwards (B and I
// share one counter) from micro-batch 0 upwards, as torch's builders do; each I queues its W, which
// weight() later emits, oldest first.
class RankBuilder {
public:
    explicit RankBuilder(int num_stages)
        : next_forward_(num_stages, 0), next_backward_(num_stages, 0) {}

    void forward(int stage) { actions_.push_back({stage, Op::Forward, next_forward_[stage]++}); }
    void backward(int stage) { actions_.push_back({stage, Op::Backward, next_backward_[stage]++}); }
    void input(int stage) {
        Action a{stage, Op::BackwardInput, next_backward_[stage]++};
        actions_.push_back(a);
        pending_weights_.push_back({stage, Op::BackwardWeight, a.microbatch});
    }
    // Emits the oldest pending W, if any.
    void weight() {
        if (pending_weights_.empty()) return;
        actions_.push_back(pending_weights_.front());
        pending_weights_.pop_front();
    }
    void all_weights() {
        while (!pending_weights_.empty()) weight();
    }
    std::vector<Action> take() { return std::move(actions_); }

private:
    std::vector<Action> actions_;
    std::vector<int> next_forward_;
    std::vector<int> next_backward_;
    std::deque<Action> pending_weights_;
};

std::vector<Action> gpipe_rank(int rank, int p, int m) {
    RankBuilder b(p);
    for (int k = 0; k < m; ++k) b.forward(rank);
    for (int k = 0; k < m; ++k) b.backward(rank);
    return b.take();
}

// Stage s runs min(m, p - s) forwards, then alternates B and F until the forwards run out, then drains
// the backwards (Schedule1F1B._step_microbatches).
std::vector<Action> one_f_one_b_rank(int rank, int p, int m) {
    RankBuilder b(p);
    const int warmup = std::min(m, p - rank);
    for (int k = 0; k < warmup; ++k) b.forward(rank);
    for (int k = 0; k < m; ++k) {
        b.backward(rank);
        if (warmup + k < m) b.forward(rank);
    }
    return b.take();
}

// Forwards of every local stage in stage order, then backwards of every local stage in reverse stage
// order, each stage's micro-batches last to first.
std::vector<Action> looped_bfs_rank(int rank, int p, int m, int v) {
    std::vector<Action> actions;
    for (int local = 0; local < v; ++local)
        for (int k = 0; k < m; ++k) actions.push_back({local * p + rank, Op::Forward, k});
    for (int local = v - 1; local >= 0; --local)
        for (int k = m - 1; k >= 0; --k) actions.push_back({local * p + rank, Op::Backward, k});
    return actions;
}

// The interleaved 1F1B family. Micro-batches go through the local stages in rounds of `per_round`
// (p when m is a multiple of p): forward step i runs local stage (i / per_round) mod v, backward step j
// runs local stage v-1 - (j / per_round) mod v. Rank r first runs `warmup` forwards
// ((v-1)·per_round + factor·(p-1-r), at most m·v), then pairs one forward with one backward, then drains
// the backwards. factor is 2 for Interleaved1F1B; InterleavedZeroBubble uses 1, splits each backward into
// I and W, and holds each W back until r further backwards have run (then flushes the rest at the end).
std::vector<Action> interleaved_rank(int rank, int p, int m, int v, bool zero_bubble) {
    const int rounds = std::max(1, m / p);
    const int per_round = m / rounds;
    const int factor = zero_bubble ? 1 : 2;
    const int total = m * v;
    const int warmup = std::min((v - 1) * per_round + factor * (p - 1 - rank), total);
    auto forward_stage = [&](int step) { return (step / per_round) % v * p + rank; };
    auto backward_stage = [&](int step) { return (v - 1 - (step / per_round) % v) * p + rank; };

    RankBuilder b(v * p);
    auto run_backward = [&](int step) {
        if (!zero_bubble) {
            b.backward(backward_stage(step));
            return;
        }
        b.input(backward_stage(step));
        if (step >= rank) b.weight();
    };
    for (int i = 0; i < warmup; ++i) b.forward(forward_stage(i));
    for (int i = warmup; i < total; ++i) {
        b.forward(forward_stage(i));
        run_backward(i - warmup);
    }
    for (int i = total; i < total + warmup; ++i) run_backward(i - warmup);
    b.all_weights();
    return b.take();
}

// ZB-V on rank r with stages down = r (first leg of the V) and up = 2p-1-r (second leg). The pattern
// assumes n = max(2p-1, m) micro-batches; the actions of micro-batches >= m are dropped afterwards.
std::vector<Action> zbv_rank(int rank, int p, int m) {
    const int n = std::max(2 * p - 1, m);
    const int down = rank;
    const int up = 2 * p - 1 - rank;
    std::vector<Action> actions;
    int f_down = 0, f_up = 0, b_down = 0, b_up = 0;
    auto add = [&](int stage, Op op, int microbatch) { actions.push_back({stage, op, microbatch}); };

    for (int i = 0; i < 2 * (p - rank) - 1; ++i) add(down, Op::Forward, f_down++);
    for (int i = 0; i < rank; ++i) {
        add(up, Op::Forward, f_up++);
        add(down, Op::Forward, f_down++);
    }
    for (int i = 0; i < p - rank; ++i) {
        add(up, Op::Forward, f_up++);
        add(up, Op::BackwardInput, b_up);
        add(up, Op::BackwardWeight, b_up++);
    }
    while (f_up < f_down || f_down < n) {
        if (f_down < n) add(down, Op::Forward, f_down++);
        add(down, Op::BackwardInput, b_down);
        add(down, Op::BackwardWeight, b_down++);
        add(up, Op::Forward, f_up++);
        add(up, Op::BackwardInput, b_up);
        add(up, Op::BackwardWeight, b_up++);
    }
    int w_down = b_down, w_up = b_up;
    for (int i = 0; i < rank; ++i) {
        add(down, Op::BackwardInput, b_down++);
        add(up, Op::BackwardInput, b_up++);
    }
    for (int i = 0; i < p - rank; ++i) {
        add(down, Op::BackwardInput, b_down++);
        add(down, Op::BackwardWeight, w_down++);
    }
    while (w_up < b_up) add(up, Op::BackwardWeight, w_up++);
    while (w_down < b_down) add(down, Op::BackwardWeight, w_down++);

    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [m](const Action& a) { return a.microbatch >= m; }),
                  actions.end());
    return actions;
}

// DualPipeV on rank r with stages down = r and up = 2p-1-r. torch pairs some F and B into one
// OVERLAP_F_B action whose parts run one after the other; here they are listed in that order.
std::vector<Action> dualpipev_rank(int rank, int p, int m) {
    const int down = rank;
    const int up = 2 * p - 1 - rank;
    RankBuilder b(2 * p);

    for (int i = 0; i < 2 * (p - rank - 1); ++i) b.forward(down);
    for (int i = 0; i < rank + 1; ++i) {
        b.forward(down);
        b.forward(up);
    }
    for (int i = 0; i < p - rank - 1; ++i) {
        b.input(up);
        b.weight();
        b.forward(up);
    }
    for (int i = 0; i < m - 2 * p + rank + 1; ++i) {
        b.forward(down);
        b.backward(up);
        b.forward(up);
        b.backward(down);
    }
    for (int i = 0; i < p - rank - 1; ++i) {
        b.backward(up);
        b.forward(up);
        b.backward(down);
    }
    // Drain both legs; half way through (on the `up` leg for odd ranks, after it for even ranks) the
    // backwards switch to the I/W split, whose Ws fill the remaining gaps.
    bool split = false;
    auto drain = [&](int stage) { split ? b.input(stage) : b.backward(stage); };
    const int half = (rank + 1) / 2;
    for (int i = 0; i < rank + 1; ++i) {
        if (i == half && rank % 2 == 1) split = true;
        drain(up);
        if (i == half && rank % 2 == 0) split = true;
        drain(down);
    }
    for (int i = 0; i < p - rank - 1; ++i) {
        b.weight();
        drain(down);
    }
    for (int i = 0; i < rank + 1; ++i) b.weight();
    return b.take();
}

bool is_v_shaped(Schedule s) { return s == Schedule::ZBVZeroBubble || s == Schedule::DualPipeV; }

bool is_single_stage(Schedule s) { return s == Schedule::GPipe || s == Schedule::OneFOneB; }

}  // namespace

const char* schedule_name(Schedule s) {
    switch (s) {
        case Schedule::GPipe: return "GPipe";
        case Schedule::OneFOneB: return "1F1B";
        case Schedule::Interleaved1F1B: return "Interleaved1F1B";
        case Schedule::LoopedBFS: return "LoopedBFS";
        case Schedule::InterleavedZeroBubble: return "InterleavedZeroBubble";
        case Schedule::ZBVZeroBubble: return "ZBVZeroBubble";
        case Schedule::DualPipeV: return "DualPipeV";
    }
    return "?";
}

std::vector<int> stage_placement(Schedule schedule, int num_ranks, int stages_per_rank) {
    if (num_ranks < 1 || stages_per_rank < 1)
        throw std::invalid_argument("need at least one rank and one stage per rank (got " +
                                    std::to_string(num_ranks) + " ranks, " +
                                    std::to_string(stages_per_rank) + " stages per rank)");
    require_int_in(static_cast<long long>(num_ranks) * stages_per_rank, 1, kMaxStageMicrobatches,
                   "num_ranks x stages_per_rank");
    const int p = num_ranks;
    std::vector<int> rank(static_cast<size_t>(p * stages_per_rank));
    for (int s = 0; s < p * stages_per_rank; ++s) {
        const int leg = s / p, pos = s % p;
        // V placement walks down the ranks on even legs and back up on odd ones.
        rank[s] = (is_v_shaped(schedule) && leg % 2 == 1) ? p - 1 - pos : pos;
    }
    return rank;
}

std::string torch_rejection(Schedule schedule, int num_ranks, int num_microbatches, int stages_per_rank) {
    const int p = num_ranks, m = num_microbatches, v = stages_per_rank;
    const std::string name = schedule_name(schedule);
    if (p < 1 || m < 1 || v < 1)
        return "need at least one rank, micro-batch and stage per rank (got p=" + std::to_string(p) +
               ", m=" + std::to_string(m) + ", v=" + std::to_string(v) + ")";
    if (is_single_stage(schedule) && v != 1)
        return name + " runs one stage per rank (got " + std::to_string(v) + ")";
    if (is_v_shaped(schedule) && v != 2)
        return name + " runs exactly 2 stages per rank (got " + std::to_string(v) + ")";
    if (schedule == Schedule::OneFOneB && m < p)
        return "1F1B needs at least as many micro-batches as stages (" + std::to_string(m) + " < " +
               std::to_string(p) + ")";
    if (schedule == Schedule::DualPipeV && m < 2LL * p)
        return "DualPipeV needs at least as many micro-batches as stages (" + std::to_string(m) + " < " +
               std::to_string(2LL * p) + ")";
    if (schedule == Schedule::Interleaved1F1B || schedule == Schedule::InterleavedZeroBubble) {
        const int rounds = std::max(1, m / p);
        if (m % rounds != 0)
            return name + " needs the micro-batches to be a multiple of the rounds max(1, m / p) (" +
                   std::to_string(m) + " is not a multiple of " + std::to_string(rounds) + ")";
    }
    return {};
}

bool warmup_send_held(Schedule schedule, int num_microbatches, int num_stages, int stage) {
    require_int_in(num_microbatches, 1, std::numeric_limits<int>::max(), "num_microbatches");
    require_int_in(num_stages, 1, std::numeric_limits<int>::max(), "num_stages");
    require_int_in(stage, 0, num_stages - 1, "stage");
    const int w = std::min(num_microbatches, num_stages - stage);
    return schedule == Schedule::OneFOneB && stage < num_stages - 1 && w >= 2 && num_microbatches >= 2LL * w - 1;
}

RankOrder schedule_order(Schedule schedule, int num_ranks, int num_microbatches, int stages_per_rank) {
    const std::string reason = torch_rejection(schedule, num_ranks, num_microbatches, stages_per_rank);
    if (!reason.empty()) throw std::invalid_argument(reason);
    // p·v·m > K exactly when p·v > ⌊K/m⌋ (all ≥ 1 here): no product of the three, which may exceed 64 bits.
    if (static_cast<long long>(num_ranks) * stages_per_rank > kMaxStageMicrobatches / num_microbatches)
        throw std::invalid_argument("num_ranks x stages_per_rank x num_microbatches must be in [1, " +
                                    std::to_string(kMaxStageMicrobatches) + "], got " + std::to_string(num_ranks) +
                                    " x " + std::to_string(stages_per_rank) + " x " +
                                    std::to_string(num_microbatches));
    const int p = num_ranks, m = num_microbatches, v = stages_per_rank;
    RankOrder order(static_cast<size_t>(p));
    for (int r = 0; r < p; ++r) {
        switch (schedule) {
            case Schedule::GPipe: order[r] = gpipe_rank(r, p, m); break;
            case Schedule::OneFOneB: order[r] = one_f_one_b_rank(r, p, m); break;
            case Schedule::Interleaved1F1B: order[r] = interleaved_rank(r, p, m, v, false); break;
            case Schedule::LoopedBFS: order[r] = looped_bfs_rank(r, p, m, v); break;
            case Schedule::InterleavedZeroBubble: order[r] = interleaved_rank(r, p, m, v, true); break;
            case Schedule::ZBVZeroBubble: order[r] = zbv_rank(r, p, m); break;
            case Schedule::DualPipeV: order[r] = dualpipev_rank(r, p, m); break;
        }
    }
    return order;
}

namespace {

void check_times(const std::vector<double>& t, size_t size, const char* name) {
    if (t.size() != size)
        throw std::invalid_argument(std::string(name) + " has " + std::to_string(t.size()) +
                                    " entries, expected " + std::to_string(size));
    for (size_t i = 0; i < t.size(); ++i)
        if (!(t[i] >= 0.0 && t[i] <= kMaxValue))
            throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) + "] = " +
                                        std::to_string(t[i]) + " is not a finite time in [0, " +
                                        format_number(kMaxValue) + "]");
}

// Every action of `order` within num_stages stages and m micro-batches, on the rank stage_rank places its stage
// on, and each (stage, micro-batch) with one F and either one B or one I and one W.
void check_order(const RankOrder& order, const std::vector<int>& stage_rank, int num_stages, int m) {
    const int num_ranks = static_cast<int>(order.size());
    const size_t S = static_cast<size_t>(num_stages);
    if (stage_rank.size() != S)
        throw std::invalid_argument("stage_rank has " + std::to_string(stage_rank.size()) +
                                    " entries for " + std::to_string(num_stages) + " stages");
    for (int s = 0; s < num_stages; ++s)
        if (stage_rank[s] < 0 || stage_rank[s] >= num_ranks)
            throw std::invalid_argument("stage " + std::to_string(s) + " is placed on rank " +
                                        std::to_string(stage_rank[s]) + ", but there are " +
                                        std::to_string(num_ranks) + " ranks");

    // Each (stage, micro-batch) has two or three actions. The tables below have S·m entries: allocated only
    // when the order has at least as many actions (else some pair surely lacks its F), memory stays in
    // proportion to the input.
    std::size_t actions = 0;
    for (const std::vector<Action>& rank : order) actions += rank.size();
    const unsigned long long cells = static_cast<unsigned long long>(S) * static_cast<unsigned long long>(m);
    if (actions < cells)
        throw std::invalid_argument("the order has " + std::to_string(actions) + " actions; " +
                                    std::to_string(num_stages) + " stages x " + std::to_string(m) +
                                    " micro-batches need at least " + std::to_string(2 * cells));

    // count[(stage, microbatch) * 4 + op]: how often each action occurs; each F once, and B once or I
    // and W once each.
    auto cell = [m](int stage, int microbatch) { return static_cast<size_t>(stage) * m + microbatch; };
    std::vector<int> count(S * m * 4, 0);
    for (int r = 0; r < num_ranks; ++r)
        for (const Action& a : order[r]) {
            if (a.stage < 0 || a.stage >= num_stages || a.microbatch < 0 || a.microbatch >= m)
                throw std::invalid_argument("action " + token(a) + " on rank " + std::to_string(r) +
                                            " is outside " + std::to_string(num_stages) + " stages and " +
                                            std::to_string(m) + " micro-batches");
            if (stage_rank[a.stage] != r)
                throw std::invalid_argument("action " + token(a) + " is on rank " + std::to_string(r) +
                                            ", but stage " + std::to_string(a.stage) + " is placed on rank " +
                                            std::to_string(stage_rank[a.stage]));
            ++count[cell(a.stage, a.microbatch) * 4 + static_cast<size_t>(a.op)];
        }
    for (int s = 0; s < num_stages; ++s)
        for (int k = 0; k < m; ++k) {
            const int* c = &count[cell(s, k) * 4];
            const int f = c[0], b = c[1], i = c[2], w = c[3];
            const bool ok = f == 1 && ((b == 1 && i == 0 && w == 0) || (b == 0 && i == 1 && w == 1));
            if (!ok)
                throw std::invalid_argument(
                    "stage " + std::to_string(s) + " micro-batch " + std::to_string(k) + " has " +
                    std::to_string(f) + " F, " + std::to_string(b) + " B, " + std::to_string(i) + " I, " +
                    std::to_string(w) + " W; expected one F and either one B or one I and one W");
        }
}

// Dependencies are the ends of two kinds of action per (stage, micro-batch): its F, and its B or I
// (the moment the input gradient exists). W ends are not waited on by anything.
enum Signal { kForwardDone = 0, kGradDone = 1 };

}  // namespace

Simulation simulate(const RankOrder& order, const std::vector<int>& stage_rank, const StageTimes& times,
                    int num_microbatches) {
    const int num_stages = static_cast<int>(times.forward_s.size());
    const int num_ranks = static_cast<int>(order.size());
    const int m = num_microbatches;
    if (num_stages < 1 || num_ranks < 1 || m < 1)
        throw std::invalid_argument("need at least one stage, rank and micro-batch (got " +
                                    std::to_string(num_stages) + " stages, " + std::to_string(num_ranks) +
                                    " ranks, " + std::to_string(m) + " micro-batches)");
    const size_t S = static_cast<size_t>(num_stages);
    check_times(times.forward_s, S, "forward_s");
    check_times(times.backward_s, S, "backward_s");
    check_times(times.backward_weight_s, S, "backward_weight_s");
    check_times(times.send_forward_s, S - 1, "send_forward_s");
    check_times(times.send_backward_s, S - 1, "send_backward_s");
    for (size_t s = 0; s < S; ++s)
        if (times.backward_weight_s[s] > times.backward_s[s])
            throw std::invalid_argument("stage " + std::to_string(s) + ": backward_weight_s " +
                                        std::to_string(times.backward_weight_s[s]) +
                                        " exceeds backward_s " + std::to_string(times.backward_s[s]));
    check_order(order, stage_rank, num_stages, m);
    auto cell = [m](int stage, int microbatch) { return static_cast<size_t>(stage) * m + microbatch; };

    // end[cell * 2 + signal]: when that signal's action ended, negative while it has not run;
    // waiting[cell * 2 + signal]: the ranks stalled on it.
    std::vector<double> end(S * m * 2, -1.0);
    std::vector<std::vector<int>> waiting(S * m * 2);
    auto key = [&](int stage, int microbatch, Signal sig) { return cell(stage, microbatch) * 2 + sig; };

    Simulation sim;
    sim.busy_s.assign(num_ranks, 0.0);
    std::vector<double> rank_free(num_ranks, 0.0);
    std::vector<size_t> next(num_ranks, 0);
    std::vector<int> runnable(num_ranks);
    for (int r = 0; r < num_ranks; ++r) runnable[r] = num_ranks - 1 - r;

    // Appends to `deps` (key, transfer time) what action a waits on.
    std::vector<std::pair<size_t, double>> deps;
    auto dependencies = [&](const Action& a) {
        deps.clear();
        const int s = a.stage, k = a.microbatch;
        switch (a.op) {
            case Op::Forward:
                if (s > 0) {
                    const bool remote = stage_rank[s - 1] != stage_rank[s];
                    deps.push_back({key(s - 1, k, kForwardDone), remote ? times.send_forward_s[s - 1] : 0.0});
                }
                break;
            case Op::Backward:
            case Op::BackwardInput:
                deps.push_back({key(s, k, kForwardDone), 0.0});
                if (s + 1 < num_stages) {
                    const bool remote = stage_rank[s + 1] != stage_rank[s];
                    deps.push_back({key(s + 1, k, kGradDone), remote ? times.send_backward_s[s] : 0.0});
                }
                break;
            case Op::BackwardWeight: deps.push_back({key(s, k, kGradDone), 0.0}); break;
        }
    };
    auto duration = [&](const Action& a) {
        switch (a.op) {
            case Op::Forward: return times.forward_s[a.stage];
            case Op::Backward: return times.backward_s[a.stage];
            case Op::BackwardInput: return times.backward_s[a.stage] - times.backward_weight_s[a.stage];
            case Op::BackwardWeight: return times.backward_weight_s[a.stage];
        }
        return 0.0;
    };

    while (!runnable.empty()) {
        const int r = runnable.back();
        runnable.pop_back();
        while (next[r] < order[r].size()) {
            const Action& a = order[r][next[r]];
            dependencies(a);
            double start = rank_free[r];
            bool blocked = false;
            for (const auto& [dep, transfer] : deps) {
                if (end[dep] < 0.0) {
                    waiting[dep].push_back(r);
                    blocked = true;
                    break;
                }
                start = std::max(start, end[dep] + transfer);
            }
            if (blocked) break;
            const double finish = start + duration(a);
            sim.events.push_back({r, a, start, finish});
            sim.busy_s[r] += finish - start;
            rank_free[r] = finish;
            ++next[r];
            if (a.op != Op::BackwardWeight) {
                const size_t done = key(a.stage, a.microbatch, a.op == Op::Forward ? kForwardDone : kGradDone);
                end[done] = finish;
                for (int w : waiting[done]) runnable.push_back(w);
                waiting[done].clear();
            }
        }
    }

    std::string stuck;
    for (int r = 0; r < num_ranks; ++r)
        if (next[r] < order[r].size()) stuck += (stuck.empty() ? "" : ", ") + std::string("rank ") +
                                                std::to_string(r) + " at " + token(order[r][next[r]]);
    if (!stuck.empty()) throw std::invalid_argument("the order deadlocks: " + stuck + " wait forever");

    // Actions of one stage run on one rank, one at a time, so its events in rank order are in time order.
    sim.peak_in_flight.assign(S, 0);
    std::vector<int> in_flight(S, 0);
    for (const Event& e : sim.events) {
        const int s = e.action.stage;
        if (e.action.op == Op::Forward) {
            sim.peak_in_flight[s] = std::max(sim.peak_in_flight[s], ++in_flight[s]);
        } else if (e.action.op != Op::BackwardInput) {
            --in_flight[s];
        }
    }

    for (double f : rank_free) sim.makespan_s = std::max(sim.makespan_s, f);
    sim.idle_s.resize(num_ranks);
    for (int r = 0; r < num_ranks; ++r) sim.idle_s[r] = sim.makespan_s - sim.busy_s[r];
    std::stable_sort(sim.events.begin(), sim.events.end(), [](const Event& a, const Event& b) {
        return a.start_s != b.start_s ? a.start_s < b.start_s : a.rank < b.rank;
    });
    return sim;
}

namespace {

// The micro-batches an order spans: one more than its largest index (at least 1).
int order_microbatches(const RankOrder& order) {
    int m = 0;
    for (const std::vector<Action>& rank : order)
        for (const Action& a : rank) m = std::max(m, a.microbatch);
    return m + 1;
}

// GPipe and 1F1B: each receive just before the action that reads it, each send just after the one that makes it.
LoweredOrder lower_just_in_time(const RankOrder& order, int num_stages) {
    LoweredOrder out(order.size());
    for (size_t r = 0; r < order.size(); ++r)
        for (const Action& a : order[r]) {
            const int s = a.stage, k = a.microbatch;
            const bool forward = a.op == Op::Forward, weight = a.op == Op::BackwardWeight;
            const Op message = forward ? Op::Forward : Op::Backward;
            if (forward ? s > 0 : !weight && s + 1 < num_stages) out[r].push_back({Step::Receive, {s, message, k}});
            out[r].push_back({Step::Compute, a});
            if (forward ? s + 1 < num_stages : !weight && s > 0) out[r].push_back({Step::Send, {s, message, k}});
        }
    return out;
}

// torch's _add_send_recv over `order` (simulate.h).
LoweredOrder lower_in_rounds(const RankOrder& order, const std::vector<int>& stage_rank, int m) {
    const int num_ranks = static_cast<int>(order.size());
    const int num_stages = static_cast<int>(stage_rank.size());
    auto cell = [m](int stage, int microbatch) { return static_cast<size_t>(stage) * m + microbatch; };
    const size_t cells = static_cast<size_t>(num_stages) * m;
    // received[cell * 2 + 0]: RECV_F of (stage, micro-batch) listed; [cell * 2 + 1]: RECV_B. ran[...]: its F
    // ran, its B or I ran.
    std::vector<char> received(cells * 2, 0), ran(cells * 2, 0);
    auto local = [&](int a, int b) { return stage_rank[a] == stage_rank[b]; };
    auto ready = [&](const Action& a) {
        const int s = a.stage, k = a.microbatch;
        switch (a.op) {
            case Op::Forward:
                return s == 0 || received[cell(s, k) * 2] || (local(s - 1, s) && ran[cell(s - 1, k) * 2]);
            case Op::Backward:
            case Op::BackwardInput:
                return s + 1 == num_stages || received[cell(s, k) * 2 + 1] ||
                       (local(s + 1, s) && ran[cell(s + 1, k) * 2 + 1]);
            case Op::BackwardWeight: return true;
        }
        return true;
    };

    LoweredOrder out(order.size());
    std::vector<size_t> next(order.size(), 0);
    size_t left = 0;
    for (const std::vector<Action>& rank : order) left += rank.size();
    while (left > 0) {
        bool progress = false;
        for (int r = 0; r < num_ranks; ++r) {
            if (next[r] == order[r].size() || !ready(order[r][next[r]])) continue;
            const Action& a = order[r][next[r]];
            const int s = a.stage, k = a.microbatch;
            out[r].push_back({Step::Compute, a});
            if (a.op == Op::Forward) {
                ran[cell(s, k) * 2] = 1;
                if (s + 1 < num_stages && !local(s, s + 1)) {
                    out[r].push_back({Step::Send, {s, Op::Forward, k}});
                    out[stage_rank[s + 1]].push_back({Step::Receive, {s + 1, Op::Forward, k}});
                    received[cell(s + 1, k) * 2] = 1;
                }
            } else if (a.op != Op::BackwardWeight) {
                ran[cell(s, k) * 2 + 1] = 1;
                if (s > 0 && !local(s, s - 1)) {
                    out[r].push_back({Step::Send, {s, Op::Backward, k}});
                    out[stage_rank[s - 1]].push_back({Step::Receive, {s - 1, Op::Backward, k}});
                    received[cell(s - 1, k) * 2 + 1] = 1;
                }
            }
            ++next[r];
            --left;
            progress = true;
        }
        if (!progress) {
            std::string stuck;
            for (int r = 0; r < num_ranks; ++r)
                if (next[r] < order[r].size()) stuck += (stuck.empty() ? "" : ", ") + std::string("rank ") +
                                                        std::to_string(r) + " at " + token(order[r][next[r]]);
            throw std::invalid_argument("the order cannot be lowered: " + stuck + " wait for a message no rank sends");
        }
    }
    return out;
}

}  // namespace

LoweredOrder lower_order(Schedule schedule, const RankOrder& order, const std::vector<int>& stage_rank) {
    const int num_stages = static_cast<int>(stage_rank.size());
    if (num_stages < 1 || order.empty())
        throw std::invalid_argument("need at least one stage and one rank (got " + std::to_string(num_stages) +
                                    " stages, " + std::to_string(order.size()) + " ranks)");
    const int m = order_microbatches(order);
    check_order(order, stage_rank, num_stages, m);
    return is_single_stage(schedule) ? lower_just_in_time(order, num_stages) : lower_in_rounds(order, stage_rank, m);
}

ReceiveBuffers receive_buffers(const LoweredOrder& order, const std::vector<int>& stage_rank) {
    const int num_stages = static_cast<int>(stage_rank.size());
    const int num_ranks = static_cast<int>(order.size());
    for (int s = 0; s < num_stages; ++s)
        if (stage_rank[s] < 0 || stage_rank[s] >= num_ranks)
            throw std::invalid_argument("stage " + std::to_string(s) + " is placed on rank " +
                                        std::to_string(stage_rank[s]) + ", but there are " +
                                        std::to_string(num_ranks) + " ranks");
    ReceiveBuffers peak{std::vector<int>(num_stages, 0), std::vector<int>(num_stages, 0)};
    std::vector<int> inputs(num_stages, 0), gradients(num_stages, 0);
    // Stage s receives its input (not its rank's previous stage's output).
    auto receives = [&](int s) { return s > 0 && stage_rank[s - 1] != stage_rank[s]; };
    auto add = [](std::vector<int>& live, std::vector<int>& most, int s) { most[s] = std::max(most[s], ++live[s]); };
    for (int r = 0; r < num_ranks; ++r)
        for (const LoweredAction& step : order[r]) {
            const int s = step.action.stage;
            if (s < 0 || s >= num_stages || stage_rank[s] != r)
                throw std::invalid_argument("a step of stage " + std::to_string(s) + " is on rank " +
                                            std::to_string(r) + ", which does not hold it");
            if (step.step == Step::Receive) {
                add(step.action.op == Op::Forward ? inputs : gradients,
                    step.action.op == Op::Forward ? peak.inputs : peak.gradients, s);
                continue;
            }
            if (step.step != Step::Compute) continue;
            const Op op = step.action.op;
            const bool last = s + 1 == num_stages;
            if (op == Op::Backward || op == Op::BackwardWeight) {
                if (receives(s)) --inputs[s];
                if (!last) --gradients[s];
            }
            // The input gradient handed to the previous stage on this rank.
            if ((op == Op::Backward || op == Op::BackwardInput) && s > 0 && stage_rank[s - 1] == r)
                add(gradients, peak.gradients, s - 1);
        }
    return peak;
}

ReceiveBuffers schedule_receive_buffers(Schedule schedule, int num_ranks, int num_microbatches,
                                        int stages_per_rank) {
    const RankOrder order = schedule_order(schedule, num_ranks, num_microbatches, stages_per_rank);
    const std::vector<int> stage_rank = stage_placement(schedule, num_ranks, stages_per_rank);
    return receive_buffers(lower_order(schedule, order, stage_rank), stage_rank);
}

InFlightPeaks in_flight_peaks(const RankOrder& order, const std::vector<int>& stage_rank) {
    const int num_stages = static_cast<int>(stage_rank.size());
    if (num_stages < 1 || order.empty())
        throw std::invalid_argument("need at least one stage and one rank (got " + std::to_string(num_stages) +
                                    " stages, " + std::to_string(order.size()) + " ranks)");
    check_order(order, stage_rank, num_stages, order_microbatches(order));
    InFlightPeaks peaks(order.size());
    for (size_t r = 0; r < order.size(); ++r) {
        // local[s]: stage s's index among rank r's stages.
        std::vector<int> local(num_stages, -1);
        int held = 0;
        for (int s = 0; s < num_stages; ++s)
            if (stage_rank[s] == static_cast<int>(r)) local[s] = held++;
        std::vector<int> now(held, 0);
        std::vector<std::vector<int>> ends;
        const std::vector<Action>& actions = order[r];
        for (size_t i = 0; i < actions.size(); ++i) {
            const Action& a = actions[i];
            if (a.op == Op::Forward) {
                ++now[local[a.stage]];
                if (i + 1 == actions.size() || actions[i + 1].op != Op::Forward) ends.push_back(now);
            } else if (a.op != Op::BackwardInput) {
                --now[local[a.stage]];
            }
        }
        std::sort(ends.begin(), ends.end());
        ends.erase(std::unique(ends.begin(), ends.end()), ends.end());
        // Keep the vectors no other one equals or exceeds in every stage (they are distinct, so "equals" is moot).
        auto covers = [](const std::vector<int>& a, const std::vector<int>& b) {
            for (size_t j = 0; j < a.size(); ++j)
                if (a[j] < b[j]) return false;
            return true;
        };
        for (size_t k = 0; k < ends.size(); ++k) {
            bool dominated = false;
            for (size_t q = 0; q < ends.size() && !dominated; ++q) dominated = q != k && covers(ends[q], ends[k]);
            if (!dominated) peaks[r].push_back(ends[k]);
        }
    }
    return peaks;
}

std::size_t heaviest_peak(const std::vector<std::vector<int>>& peaks, const std::vector<double>& bytes) {
    if (peaks.empty()) throw std::invalid_argument("heaviest_peak: no count vectors");
    std::size_t best = 0;
    double most = 0.0;
    for (std::size_t k = 0; k < peaks.size(); ++k) {
        if (peaks[k].size() != bytes.size())
            throw std::invalid_argument("heaviest_peak: a count vector of " + std::to_string(peaks[k].size()) +
                                        " stages for " + std::to_string(bytes.size()) + " byte counts");
        double sum = 0.0;
        for (std::size_t j = 0; j < bytes.size(); ++j) sum += peaks[k][j] * bytes[j];
        if (k == 0 || sum > most) {
            best = k;
            most = sum;
        }
    }
    return best;
}

}  // namespace pyplan
