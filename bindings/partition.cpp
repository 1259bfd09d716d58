// Bindings of partition.h: the chain as five arrays, the schedule by torch's name, the result as a class; ints
// narrowed by convert.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "convert.h"
#include "pyplan/partition.h"

namespace py = pybind11;

namespace {

pyplan::InFlight to_in_flight(const std::string& schedule) {
    if (schedule == "GPipe") return pyplan::InFlight::kGPipe;
    if (schedule == "1F1B") return pyplan::InFlight::kOneFOneB;
    throw std::invalid_argument("partition knows the in-flight micro-batches of 'GPipe' and '1F1B', got '" +
                                schedule + "'");
}

pyplan::PartitionObjective to_objective(const std::string& objective) {
    if (objective == "pipeline_time") return pyplan::PartitionObjective::kPipelineTime;
    if (objective == "bottleneck") return pyplan::PartitionObjective::kBottleneck;
    throw std::invalid_argument("objective must be 'pipeline_time' or 'bottleneck', got '" + objective + "'");
}

}  // namespace

void bind_partition(py::module_& m) {
    using pyplan::Overflow;
    using pyplan::PartitionResult;

    py::class_<Overflow>(m, "Overflow", "The stage that overflows least when no partition fits: blocks "
                                        "[begin_cut, end_cut).")
        .def_readonly("stage", &Overflow::stage)
        .def_readonly("begin_cut", &Overflow::begin_cut)
        .def_readonly("end_cut", &Overflow::end_cut)
        .def_readonly("in_flight", &Overflow::in_flight)
        .def_readonly("need_bytes", &Overflow::need_bytes)
        .def_readonly("limit_bytes", &Overflow::limit_bytes)
        .def_property_readonly("overflow_bytes", &Overflow::overflow_bytes);

    py::class_<PartitionResult>(m, "PartitionResult", "A partition of the chain into stages, or why none fits.")
        .def_readonly("feasible", &PartitionResult::feasible)
        .def_readonly("cuts", &PartitionResult::cuts, "[p+1] stage s is blocks [cuts[s], cuts[s+1])")
        .def_readonly("stage_time_s", &PartitionResult::stage_time_s)
        .def_readonly("stage_state_bytes", &PartitionResult::stage_state_bytes)
        .def_readonly("stage_act_bytes", &PartitionResult::stage_act_bytes)
        .def_readonly("stage_unmade_grad_bytes", &PartitionResult::stage_unmade_grad_bytes)
        .def_readonly("stage_in_flight", &PartitionResult::stage_in_flight)
        .def_readonly("pipeline_time_s", &PartitionResult::pipeline_time_s)
        .def_readonly("bottleneck_s", &PartitionResult::bottleneck_s)
        .def_readonly("overflow", &PartitionResult::overflow)
        .def_readonly("reason", &PartitionResult::reason)
        .def("__repr__", [](const PartitionResult& r) {
            if (!r.feasible) return "PartitionResult(feasible=False, reason='" + r.reason + "')";
            std::string cuts;
            for (int c : r.cuts) cuts += (cuts.empty() ? "" : ", ") + std::to_string(c);
            return "PartitionResult(feasible=True, cuts=[" + cuts + "], pipeline_time_s=" +
                   std::to_string(r.pipeline_time_s) + ")";
        });

    m.def(
        "held_input_cuts",
        [](std::int64_t num_microbatches, std::int64_t in_flight, std::int64_t stage) {
            return pyplan::held_input_cuts(to_int(num_microbatches, "num_microbatches", 1, kIntMax),
                                           to_int(in_flight, "in_flight", 1, kIntMax),
                                           to_int(stage, "stage", 0, kIntMax));
        },
        py::arg("num_microbatches"), py::arg("in_flight"), py::arg("stage"),
          "Input cuts stage `stage` holds beyond its n in-flight inputs and its receive buffers: the rest of the\n"
          "replica's batch (m - n) on the first stage, the last input gradient (1 when n < m) on a later one\n"
          "(partition.h).");

    m.def(
        "partition",
        [](std::vector<double> fwd_time_s, std::vector<double> bwd_time_s, std::vector<double> act_bytes,
           std::vector<double> state_bytes, std::vector<double> cut_bytes, std::int64_t num_stages,
           std::int64_t num_microbatches, std::vector<double> mem_limit_bytes, const std::string& schedule,
           const std::string& objective, double latency_s, double bw_bytes_per_s,
           const std::vector<std::int64_t>& in_flight_per_stage, std::vector<long long> input_buffer_cuts,
           std::vector<long long> output_buffer_cuts, std::vector<double> grad_bytes, std::vector<bool> fresh_grads) {
            const pyplan::Chain chain{std::move(fwd_time_s), std::move(bwd_time_s), std::move(act_bytes),
                                      std::move(state_bytes), std::move(cut_bytes), std::move(grad_bytes)};
            pyplan::PartitionOptions options;
            options.num_stages = to_int(num_stages, "num_stages", 1, kIntMax);
            options.num_microbatches = to_int(num_microbatches, "num_microbatches", 1, kIntMax);
            options.in_flight = to_in_flight(schedule);
            options.in_flight_per_stage = to_ints(in_flight_per_stage, "in_flight_per_stage", 1, kIntMax);
            options.objective = to_objective(objective);
            options.mem_limit_bytes = std::move(mem_limit_bytes);
            options.link = {latency_s, bw_bytes_per_s};
            options.input_buffer_cuts = std::move(input_buffer_cuts);
            options.output_buffer_cuts = std::move(output_buffer_cuts);
            options.fresh_grads = std::move(fresh_grads);
            py::gil_scoped_release release;
            return pyplan::partition(chain, options);
        },
        py::arg("fwd_time_s"), py::arg("bwd_time_s"), py::arg("act_bytes"), py::arg("state_bytes"),
        py::arg("cut_bytes"), py::kw_only(), py::arg("num_stages"), py::arg("num_microbatches"),
        py::arg("mem_limit_bytes"), py::arg("schedule") = "1F1B", py::arg("objective") = "pipeline_time",
        py::arg("latency_s") = 0.0, py::arg("bw_bytes_per_s") = std::numeric_limits<double>::infinity(),
        py::arg("in_flight_per_stage") = std::vector<std::int64_t>{},
        py::arg("input_buffer_cuts") = std::vector<long long>{},
        py::arg("output_buffer_cuts") = std::vector<long long>{}, py::arg("grad_bytes") = std::vector<double>{},
        py::arg("fresh_grads") = std::vector<bool>{},
        "Exact split of a chain of L blocks into num_stages contiguous stages minimizing\n"
        "sum(t_s) + (m-1) max(t_s) under each stage's memory limit (objective='pipeline_time'), or max(t_s)\n"
        "then sum(t_s) (objective='bottleneck', the limit m -> inf). Per block: fwd_time_s, bwd_time_s,\n"
        "act_bytes, state_bytes; per cut (L+1): cut_bytes. schedule 'GPipe' or '1F1B' sets the micro-batches\n"
        "in flight per stage (m, or min(m, p-s)); in_flight_per_stage, when not empty, gives them instead (one\n"
        "per stage, each in [1, m]: e.g. an interleaved schedule's simulated peak). A boundary at cut c costs\n"
        "latency_s + cut_bytes[c]/bw each way; a stage pays the send of its output and the gradient send of\n"
        "its input. A stage also holds input_buffer_cuts[s] more tensors of its input cut and\n"
        "output_buffer_cuts[s] of its output cut, when given (receive buffers, the batch; partition.h).\n"
        "A stage s with fresh_grads[s] makes its gradients (grad_bytes per block, part of state_bytes) after its\n"
        "activations peak: its need leaves out min(its gradients, in flight x its act_bytes) (partition.h).\n"
        "Times and bytes in [0, 1e100], limits also inf, bw >= 1e-3 or inf (cpp/include/pyplan/limits.h).\n"
        "Raises ValueError on malformed input; returns feasible=False with a reason when nothing fits.");
}
