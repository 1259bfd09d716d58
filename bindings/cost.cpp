// Bindings of cost.h: links and bytes per parameter as keyword arguments, the formulas unchanged; ints narrowed
// by convert.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "convert.h"
#include "pyplan/cost.h"

namespace py = pybind11;

void bind_cost(py::module_& m) {
    py::class_<pyplan::ModelStateBytes>(m, "ModelStateBytes", "Model-state bytes held by one GPU.")
        .def_readonly("param_bytes", &pyplan::ModelStateBytes::param_bytes)
        .def_readonly("grad_bytes", &pyplan::ModelStateBytes::grad_bytes)
        .def_readonly("optim_bytes", &pyplan::ModelStateBytes::optim_bytes)
        .def_property_readonly("total_bytes", &pyplan::ModelStateBytes::total_bytes)
        .def("__repr__", [](const pyplan::ModelStateBytes& s) {
            return "ModelStateBytes(param_bytes=" + std::to_string(s.param_bytes) + ", grad_bytes=" +
                   std::to_string(s.grad_bytes) + ", optim_bytes=" + std::to_string(s.optim_bytes) + ")";
        });

    m.def(
        "p2p_time_s",
        [](double bytes, double latency_s, double bw_bytes_per_s) {
            return pyplan::p2p_time_s({latency_s, bw_bytes_per_s}, bytes);
        },
        py::arg("bytes"), py::kw_only(), py::arg("latency_s"), py::arg("bw_bytes_per_s"),
        "Point-to-point send, alpha-beta: latency_s + bytes / bw_bytes_per_s.");

    m.def(
        "ring_allreduce_time_s",
        [](double bytes, std::int64_t num_ranks, double latency_s, double bw_bytes_per_s) {
            const int d = to_int(num_ranks, "num_ranks", 1, kIntMax);
            return pyplan::ring_allreduce_time_s({latency_s, bw_bytes_per_s}, bytes, d);
        },
        py::arg("bytes"), py::arg("num_ranks"), py::kw_only(), py::arg("latency_s"), py::arg("bw_bytes_per_s"),
        "Ring all-reduce: 2(d-1)(latency_s + bytes/(d bw_bytes_per_s)) (Jansen thesis, eq. 5.1).");

    m.def(
        "reduce_scatter_time_s",
        [](double bytes, std::int64_t num_ranks, double latency_s, double bw_bytes_per_s) {
            const int d = to_int(num_ranks, "num_ranks", 1, kIntMax);
            return pyplan::reduce_scatter_time_s({latency_s, bw_bytes_per_s}, bytes, d);
        },
        py::arg("bytes"), py::arg("num_ranks"), py::kw_only(), py::arg("latency_s"), py::arg("bw_bytes_per_s"),
        "Ring reduce-scatter of a bytes-sized tensor: (d-1)(latency_s + bytes/(d bw_bytes_per_s)).");

    m.def(
        "all_gather_time_s",
        [](double bytes, std::int64_t num_ranks, double latency_s, double bw_bytes_per_s) {
            const int d = to_int(num_ranks, "num_ranks", 1, kIntMax);
            return pyplan::all_gather_time_s({latency_s, bw_bytes_per_s}, bytes, d);
        },
        py::arg("bytes"), py::arg("num_ranks"), py::kw_only(), py::arg("latency_s"), py::arg("bw_bytes_per_s"),
        "Ring all-gather into a bytes-sized tensor: (d-1)(latency_s + bytes/(d bw_bytes_per_s)).");

    m.def(
        "hierarchical_allreduce_time_s",
        [](double bytes, std::int64_t gpus_per_node, std::int64_t num_nodes, double intra_latency_s,
           double intra_bw_bytes_per_s, double inter_latency_s, double inter_bw_bytes_per_s) {
            return pyplan::hierarchical_allreduce_time_s(
                {intra_latency_s, intra_bw_bytes_per_s}, {inter_latency_s, inter_bw_bytes_per_s}, bytes,
                to_int(gpus_per_node, "gpus_per_node", 1, kIntMax), to_int(num_nodes, "num_nodes", 1, kIntMax));
        },
        py::arg("bytes"), py::arg("gpus_per_node"), py::arg("num_nodes"), py::kw_only(),
        py::arg("intra_latency_s"), py::arg("intra_bw_bytes_per_s"), py::arg("inter_latency_s"),
        py::arg("inter_bw_bytes_per_s"),
        "Reduce-scatter in the node, ring all-reduce of the 1/g shard across nodes, all-gather in the node: "
        "2(g-1)(a_intra + G/(g BW_intra)) + 2(n-1)(a_inter + G/(g n BW_inter)); inter_bw_bytes_per_s is what "
        "each of the g concurrent rings gets.");

    m.def(
        "zero_model_state_bytes",
        [](double num_params, std::int64_t num_replicas, std::int64_t zero_stage, double param_bytes,
           double grad_bytes, double optim_bytes) {
            return pyplan::zero_model_state_bytes(num_params, to_int(num_replicas, "num_replicas", 1, kIntMax),
                                                  to_int(zero_stage, "zero_stage", 0, 3),
                                                  {param_bytes, grad_bytes, optim_bytes});
        },
        py::arg("num_params"), py::arg("num_replicas"), py::arg("zero_stage"), py::kw_only(),
        py::arg("param_bytes"), py::arg("grad_bytes"), py::arg("optim_bytes"),
        "Model-state bytes per GPU under ZeRO stage 0-3 (Rajbhandari et al. 2020), from the bytes per parameter "
        "of weights, gradients and optimizer state (mixed-precision Adam: 2, 2, 12).");

    m.def(
        "pipeline_time_s",
        [](const std::vector<double>& stage_time_s, std::int64_t num_microbatches) {
            return pyplan::pipeline_time_s(stage_time_s, to_int(num_microbatches, "num_microbatches", 1, kIntMax));
        },
        py::arg("stage_time_s"), py::arg("num_microbatches"),
        "Pipeline iteration time: sum(t_s) + (m-1) max(t_s) (Huang et al., eq. 1).");

    m.def(
        "bubble_fraction",
        [](std::int64_t num_stages, std::int64_t num_microbatches, std::int64_t num_chunks) {
            return pyplan::bubble_fraction(to_int(num_stages, "num_stages", 1, kIntMax),
                                           to_int(num_microbatches, "num_microbatches", 1, kIntMax),
                                           to_int(num_chunks, "num_chunks", 1, kIntMax));
        },
        py::arg("num_stages"), py::arg("num_microbatches"), py::arg("num_chunks") = 1,
        "Idle fraction of a balanced pipeline: (p-1)/(v m + p-1); v = 1 gives (p-1)/(m+p-1).");

    m.def("optimizer_step_time_s", &pyplan::optimizer_step_time_s, py::arg("bytes_read"), py::arg("bytes_written"),
          py::arg("mem_bw_bytes_per_s"), "Memory-bound optimizer step: (bytes_read + bytes_written) / bandwidth.");
}
