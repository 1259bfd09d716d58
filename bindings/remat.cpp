// Bindings of remat.h: the chain as arrays and its output values, the plan as a list of (token, block) pairs; ints
// narrowed by convert.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "convert.h"
#include "pyplan/remat.h"

namespace py = pybind11;

namespace {

// An output value as Python gives it: (block, bytes, last cut, savers).
using Value = std::tuple<std::int64_t, double, std::int64_t, std::vector<std::int64_t>>;

// The plan as [("keep", i), ("offload", i), ("begin", -1), ("end", -1), ...].
std::vector<std::pair<std::string, int>> steps_of(const std::vector<pyplan::RematStep>& plan) {
    static const char* names[] = {"keep", "offload", "begin", "end"};
    std::vector<std::pair<std::string, int>> out;
    out.reserve(plan.size());
    for (const auto& st : plan) out.emplace_back(names[static_cast<int>(st.token)], st.block);
    return out;
}

pyplan::RematChain chain_of(std::vector<double> fwd_s, std::vector<double> bwd_s, std::vector<double> kept_bytes,
                            std::vector<double> out_bytes, std::vector<double> fwd_peak_bytes,
                            std::vector<double> fwd_nosave_peak_bytes, std::vector<double> bwd_peak_bytes,
                            std::vector<double> grad_bytes, const std::vector<Value>& values,
                            std::vector<bool> saves, std::vector<double> checkpoint_block_s) {
    std::vector<pyplan::RematValue> vs;
    vs.reserve(values.size());
    for (const auto& [block, bytes, last, savers] : values) {
        vs.push_back({to_int(block, "a value's block", 0, kIntMax), bytes,
                      to_int(last, "a value's last cut", 1, kIntMax), to_ints(savers, "a value's savers", 0, kIntMax)});
    }
    return {std::move(fwd_s),          std::move(bwd_s),
            std::move(kept_bytes),     std::move(out_bytes),
            std::move(fwd_peak_bytes), std::move(fwd_nosave_peak_bytes),
            std::move(bwd_peak_bytes), std::move(grad_bytes),
            std::move(vs),             std::move(saves),
            std::move(checkpoint_block_s)};
}

}  // namespace

void bind_remat(py::module_& m) {
    using pyplan::RematSolution;
    py::class_<RematSolution>(m, "RematSolution", "The best remat plan of a chain within a budget, or why none.")
        .def_readonly("feasible", &RematSolution::feasible)
        .def_readonly("time_s", &RematSolution::time_s)
        .def_readonly("peak_bound_bytes", &RematSolution::peak_bound_bytes)
        .def_readonly("after_forward_bytes", &RematSolution::after_forward_bytes)
        .def_readonly("min_budget_bytes", &RematSolution::min_budget_bytes)
        .def_readonly("reason", &RematSolution::reason)
        .def_property_readonly("plan", [](const RematSolution& r) { return steps_of(r.plan); });

    m.def(
        "remat",
        [](std::vector<double> fwd_s, std::vector<double> bwd_s, std::vector<double> kept_bytes,
           std::vector<double> out_bytes, std::vector<double> fwd_peak_bytes, std::vector<double> fwd_nosave_peak_bytes,
           std::vector<double> bwd_peak_bytes, std::vector<double> grad_bytes, std::vector<Value> values,
           std::vector<bool> saves, double budget_bytes, std::int64_t slots, double offload_bw_bytes_per_s,
           std::int64_t max_depth, std::int64_t in_flight, double checkpoint_s,
           std::vector<double> checkpoint_block_s) {
            const pyplan::RematChain chain =
                chain_of(std::move(fwd_s), std::move(bwd_s), std::move(kept_bytes), std::move(out_bytes),
                         std::move(fwd_peak_bytes), std::move(fwd_nosave_peak_bytes), std::move(bwd_peak_bytes),
                         std::move(grad_bytes), values, std::move(saves), std::move(checkpoint_block_s));
            const pyplan::RematOptions options{budget_bytes, to_int(slots, "slots", 1, pyplan::kMaxRematSlots),
                                               offload_bw_bytes_per_s, to_int(max_depth, "max_depth", -1, kIntMax),
                                               checkpoint_s};
            const int copies = to_int(in_flight, "in_flight", 1, kIntMax);
            py::gil_scoped_release release;
            return pyplan::solve_remat(chain, options, copies);
        },
        py::arg("fwd_s"), py::arg("bwd_s"), py::arg("kept_bytes"), py::arg("out_bytes"), py::arg("fwd_peak_bytes"),
        py::arg("fwd_nosave_peak_bytes"), py::arg("bwd_peak_bytes"), py::arg("grad_bytes"), py::arg("values"),
        py::arg("saves"), py::kw_only(), py::arg("budget_bytes"), py::arg("slots") = 500,
        py::arg("offload_bw_bytes_per_s") = 0.0, py::arg("max_depth") = -1, py::arg("in_flight") = 1,
        py::arg("checkpoint_s") = 0.0, py::arg("checkpoint_block_s") = std::vector<double>{},
        "The least-time rematerialization (and offloading) plan of a chain whose peak stays within budget_bytes,\n"
        "memory discretized into `slots` (sizes rounded up, the budget down). Per block: fwd_s, bwd_s, kept,\n"
        "out, fwd_peak, fwd_nosave_peak, bwd_peak; per cut: grad_bytes; values: every block's output values as\n"
        "(block, bytes, last cut, savers); saves: per block, whether it saves anything (see pyplan/solve/remat.py).\n"
        "offload_bw_bytes_per_s 0 disables offloading; max_depth limits checkpoint nesting (-1: none).\n"
        "in_flight > 1 also requires peak + (in_flight-1)*after_forward <= budget; checkpoint_s is the cost of\n"
        "one checkpoint call, checkpoint_block_s (per block, or empty) what each block adds to a checkpoint.\n"
        "Times in [0, 1e9] s, sizes in [0, 1e18], budget_bytes in (0, 1e18], slots in [1, MAX_REMAT_SLOTS]; a\n"
        "budget below remat_min_peak is answered at once (feasible=False). Raises ValueError on invalid input.");

    m.def(
        "remat_min_peak",
        [](std::vector<double> fwd_s, std::vector<double> bwd_s, std::vector<double> kept_bytes,
           std::vector<double> out_bytes, std::vector<double> fwd_peak_bytes, std::vector<double> fwd_nosave_peak_bytes,
           std::vector<double> bwd_peak_bytes, std::vector<double> grad_bytes, std::vector<Value> values,
           std::vector<bool> saves, bool offload, std::int64_t max_depth) {
            const pyplan::RematChain chain =
                chain_of(std::move(fwd_s), std::move(bwd_s), std::move(kept_bytes), std::move(out_bytes),
                         std::move(fwd_peak_bytes), std::move(fwd_nosave_peak_bytes), std::move(bwd_peak_bytes),
                         std::move(grad_bytes), values, std::move(saves), {});
            const int depth = to_int(max_depth, "max_depth", -1, kIntMax);
            const pyplan::RematOptions options{1.0, 1, offload ? 1.0 : 0.0, depth};
            py::gil_scoped_release release;
            return pyplan::min_peak_bytes(chain, options);
        },
        py::arg("fwd_s"), py::arg("bwd_s"), py::arg("kept_bytes"), py::arg("out_bytes"), py::arg("fwd_peak_bytes"),
        py::arg("fwd_nosave_peak_bytes"), py::arg("bwd_peak_bytes"), py::arg("grad_bytes"), py::arg("values"),
        py::arg("saves"), py::kw_only(), py::arg("offload") = false, py::arg("max_depth") = -1,
        "The least peak (bytes, exact) of any plan of the chain: the smallest feasible budget.");
}
