// Bindings of simulate.h: schedules by torch's names, actions as (stage, "F"|"B"|"I"|"W", micro-batch); ints
// narrowed by convert.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "convert.h"
#include "pyplan/simulate.h"

namespace py = pybind11;

namespace {

using pyplan::Op;
using pyplan::Schedule;

// torch's names (get_schedule_class) for each schedule.
const std::array<std::pair<const char*, Schedule>, 7> kSchedules{{
    {"GPipe", Schedule::GPipe},
    {"1F1B", Schedule::OneFOneB},
    {"Interleaved1F1B", Schedule::Interleaved1F1B},
    {"LoopedBFS", Schedule::LoopedBFS},
    {"InterleavedZeroBubble", Schedule::InterleavedZeroBubble},
    {"ZBVZeroBubble", Schedule::ZBVZeroBubble},
    {"DualPipeV", Schedule::DualPipeV},
}};

Schedule to_schedule(const std::string& name) {
    for (const auto& [n, s] : kSchedules)
        if (name == n) return s;
    std::string known;
    for (const auto& entry : kSchedules) known += (known.empty() ? "" : ", ") + std::string(entry.first);
    throw std::invalid_argument("unknown schedule '" + name + "' (known: " + known + ")");
}

// A schedule's shape as the bindings take it: torch's name, ranks, micro-batches and stages per rank, narrowed.
struct Shape {
    Schedule schedule;
    int p, m, v;
};

Shape to_shape(const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
               std::int64_t stages_per_rank) {
    return {to_schedule(schedule), to_int(num_ranks, "num_ranks", 1, kIntMax),
            to_int(num_microbatches, "num_microbatches", 1, kIntMax),
            to_int(stages_per_rank, "stages_per_rank", 1, kIntMax)};
}

const char* op_name(Op op) {
    switch (op) {
        case Op::Forward: return "F";
        case Op::Backward: return "B";
        case Op::BackwardInput: return "I";
        case Op::BackwardWeight: return "W";
    }
    return "?";
}

const char* step_name(pyplan::Step step) {
    switch (step) {
        case pyplan::Step::Compute: return "compute";
        case pyplan::Step::Send: return "send";
        case pyplan::Step::Receive: return "receive";
    }
    return "?";
}

Op to_op(const std::string& name) {
    if (name == "F") return Op::Forward;
    if (name == "B") return Op::Backward;
    if (name == "I") return Op::BackwardInput;
    if (name == "W") return Op::BackwardWeight;
    throw std::invalid_argument("unknown action kind '" + name + "' (known: F, B, I, W)");
}

using PyAction = std::tuple<int, std::string, int>;
using PyActionIn = std::tuple<std::int64_t, std::string, std::int64_t>;

std::vector<std::vector<PyAction>> to_py(const pyplan::RankOrder& order) {
    std::vector<std::vector<PyAction>> out(order.size());
    for (size_t r = 0; r < order.size(); ++r)
        for (const auto& a : order[r]) out[r].emplace_back(a.stage, op_name(a.op), a.microbatch);
    return out;
}

pyplan::RankOrder from_py(const std::vector<std::vector<PyActionIn>>& order) {
    pyplan::RankOrder out(order.size());
    for (size_t r = 0; r < order.size(); ++r)
        for (const auto& [stage, op, microbatch] : order[r])
            out[r].push_back({to_int(stage, "an action's stage", 0, kIntMax), to_op(op),
                              to_int(microbatch, "an action's micro-batch", 0, kIntMax)});
    return out;
}

}  // namespace

void bind_simulate(py::module_& m) {
    std::vector<std::string> names;
    for (const auto& entry : kSchedules) names.emplace_back(entry.first);
    m.attr("SCHEDULES") = py::tuple(py::cast(names));

    m.def(
        "stage_placement",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t stages_per_rank) {
            return pyplan::stage_placement(to_schedule(schedule), to_int(num_ranks, "num_ranks", 1, kIntMax),
                                           to_int(stages_per_rank, "stages_per_rank", 1, kIntMax));
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("stages_per_rank"),
        "[stage] -> rank: loop placement, or V placement for ZBVZeroBubble and DualPipeV.");

    m.def(
        "warmup_send_held",
        [](const std::string& schedule, std::int64_t num_microbatches, std::int64_t num_stages, std::int64_t stage) {
            return pyplan::warmup_send_held(
                to_schedule(schedule), to_int(num_microbatches, "num_microbatches", 1, kIntMax),
                to_int(num_stages, "num_stages", 1, kIntMax), to_int(stage, "stage", 0, kIntMax));
        },
        py::arg("schedule"), py::arg("num_microbatches"), py::arg("num_stages"), py::arg("stage"),
        "Whether the stage keeps the output of its last warm-up send past that micro-batch's backward (1F1B).");

    m.def(
        "torch_rejection",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
           std::int64_t stages_per_rank) {
            const auto [s, p, m, v] = to_shape(schedule, num_ranks, num_microbatches, stages_per_rank);
            return pyplan::torch_rejection(s, p, m, v);
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank"),
        "Why torch 2.13 refuses this schedule shape; '' when it accepts it.");

    m.def(
        "schedule_order",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
           std::int64_t stages_per_rank) {
            const auto [s, p, m, v] = to_shape(schedule, num_ranks, num_microbatches, stages_per_rank);
            pyplan::RankOrder order;
            {
                py::gil_scoped_release release;
                order = pyplan::schedule_order(s, p, m, v);
            }
            return to_py(order);
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank"),
        "Per rank, the (stage, op, micro-batch) actions in the order torch's schedule runs them.");

    m.def(
        "lower_order",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
           std::int64_t stages_per_rank) {
            const auto [s, p, m, v] = to_shape(schedule, num_ranks, num_microbatches, stages_per_rank);
            pyplan::LoweredOrder lowered;
            {
                py::gil_scoped_release release;
                lowered = pyplan::lower_order(s, pyplan::schedule_order(s, p, m, v), pyplan::stage_placement(s, p, v));
            }
            std::vector<std::vector<std::tuple<std::string, int, std::string, int>>> out(lowered.size());
            for (size_t r = 0; r < lowered.size(); ++r)
                for (const auto& [step, a] : lowered[r])
                    out[r].emplace_back(step_name(step), a.stage, op_name(a.op), a.microbatch);
            return out;
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank"),
        "Per rank, the schedule's order with its messages, as pyplan's runtime runs it: (step, stage, op,\n"
        "micro-batch) with step 'compute', 'send' or 'receive'; a message's op is 'F' (activation) or 'B'\n"
        "(gradient), a receive names the receiving stage (simulate.h).");

    m.def(
        "receive_buffers",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
           std::int64_t stages_per_rank) {
            const auto [s, p, m, v] = to_shape(schedule, num_ranks, num_microbatches, stages_per_rank);
            pyplan::ReceiveBuffers got;
            {
                py::gil_scoped_release release;
                got = pyplan::schedule_receive_buffers(s, p, m, v);
            }
            py::dict out;
            out["inputs"] = got.inputs;
            out["gradients"] = got.gradients;
            return out;
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank"),
        "Per stage, the most input receive buffers and output gradients it holds at once as pyplan's runtime\n"
        "runs the schedule: {'inputs': [...], 'gradients': [...]} (simulate.h).");

    m.def(
        "in_flight_peaks",
        [](const std::string& schedule, std::int64_t num_ranks, std::int64_t num_microbatches,
           std::int64_t stages_per_rank) {
            const auto [s, p, m, v] = to_shape(schedule, num_ranks, num_microbatches, stages_per_rank);
            pyplan::InFlightPeaks peaks;
            {
                py::gil_scoped_release release;
                peaks = pyplan::in_flight_peaks(pyplan::schedule_order(s, p, m, v), pyplan::stage_placement(s, p, v));
            }
            return peaks;
        },
        py::arg("schedule"), py::arg("num_ranks"), py::arg("num_microbatches"), py::arg("stages_per_rank"),
        "Per rank, the counts of micro-batches in flight on its stages (in stage order) at which its activations\n"
        "may peak: max over time of sum_j n_j(t)*A_j is the max over these of sum_j n_j*A_j (simulate.h).");

    m.def(
        "simulate",
        [](const std::vector<std::vector<PyActionIn>>& order, const std::vector<std::int64_t>& stage_rank,
           std::vector<double> forward_s, std::vector<double> backward_s,
           std::vector<double> backward_weight_s, std::vector<double> send_forward_s,
           std::vector<double> send_backward_s, std::int64_t num_microbatches) {
            const pyplan::RankOrder actions = from_py(order);
            const std::vector<int> ranks = to_ints(stage_rank, "stage_rank", 0, kIntMax);
            const int m = to_int(num_microbatches, "num_microbatches", 1, kIntMax);
            const pyplan::StageTimes times{std::move(forward_s), std::move(backward_s),
                                           std::move(backward_weight_s), std::move(send_forward_s),
                                           std::move(send_backward_s)};
            pyplan::Simulation sim;
            {
                py::gil_scoped_release release;
                sim = pyplan::simulate(actions, ranks, times, m);
            }
            std::vector<std::tuple<int, int, std::string, int, double, double>> events;
            events.reserve(sim.events.size());
            for (const auto& e : sim.events)
                events.emplace_back(e.rank, e.action.stage, op_name(e.action.op), e.action.microbatch,
                                    e.start_s, e.end_s);
            py::dict out;
            out["makespan_s"] = sim.makespan_s;
            out["busy_s"] = sim.busy_s;
            out["idle_s"] = sim.idle_s;
            out["peak_in_flight"] = sim.peak_in_flight;
            out["events"] = events;
            return out;
        },
        py::arg("order"), py::arg("stage_rank"), py::arg("forward_s"), py::arg("backward_s"),
        py::arg("backward_weight_s"), py::arg("send_forward_s"), py::arg("send_backward_s"),
        py::arg("num_microbatches"),
        "Event simulation of a per-rank order; returns makespan_s, busy_s, idle_s, peak_in_flight and "
        "events [(rank, stage, op, micro-batch, start_s, end_s)] sorted by start.");
}
