// Bindings of search.h: the chain as nine arrays, the hardware and space as keyword arguments, schedules,
// placements and the objective by name, the result as read-only classes; ints narrowed by convert.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "convert.h"
#include "pyplan/limits.h"
#include "pyplan/search.h"

namespace py = pybind11;

namespace {

using pyplan::Candidate;
using pyplan::Schedule;
using pyplan::SearchResult;

Schedule to_schedule(const std::string& name) {
    for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::LoopedBFS,
                       Schedule::InterleavedZeroBubble, Schedule::ZBVZeroBubble, Schedule::DualPipeV}) {
        if (name == pyplan::schedule_name(s)) return s;
    }
    throw std::invalid_argument("unknown schedule '" + name + "' (searched: GPipe, 1F1B, Interleaved1F1B, LoopedBFS)");
}

}  // namespace

void bind_search(py::module_& m) {
    py::class_<Candidate>(m, "Candidate",
                          "One evaluated plan: stage vectors have pp*stages_per_rank entries, rank vectors pp.")
        .def_readonly("dp", &Candidate::dp)
        .def_readonly("pp", &Candidate::pp)
        .def_readonly("stages_per_rank", &Candidate::stages_per_rank)
        .def_readonly("micro_batch_size", &Candidate::micro_batch_size)
        .def_readonly("num_microbatches", &Candidate::num_microbatches)
        .def_property_readonly("schedule", [](const Candidate& c) { return pyplan::schedule_name(c.schedule); })
        .def_readonly("zero_stage", &Candidate::zero_stage)
        .def_property_readonly("placement", [](const Candidate& c) { return pyplan::placement_name(c.placement); })
        .def_property_readonly("num_gpus", &Candidate::num_gpus)
        .def_readonly("pipeline_inter", &Candidate::pipeline_inter, "the pipeline link is the inter-node one")
        .def_readonly("dp_gpus_per_node", &Candidate::dp_gpus_per_node)
        .def_readonly("dp_nodes", &Candidate::dp_nodes)
        .def_readonly("cuts", &Candidate::cuts, "stage s is blocks [cuts[s], cuts[s+1])")
        .def_readonly("stage_rank", &Candidate::stage_rank)
        .def_readonly("stage_forward_s", &Candidate::stage_forward_s)
        .def_readonly("stage_backward_s", &Candidate::stage_backward_s)
        .def_readonly("stage_time_s", &Candidate::stage_time_s, "F + B + the sends of its input and output cuts")
        .def_readonly("stage_state_bytes", &Candidate::stage_state_bytes)
        .def_readonly("stage_act_bytes", &Candidate::stage_act_bytes)
        .def_readonly("stage_unmade_grad_bytes", &Candidate::stage_unmade_grad_bytes,
                      "gradients not yet made at the stage's peak, left out of its memory (fresh_gradients)")
        .def_readonly("stage_buffer_bytes", &Candidate::stage_buffer_bytes)
        .def_readonly("stage_in_flight", &Candidate::stage_in_flight)
        .def_readonly("stage_sync_s", &Candidate::stage_sync_s)
        .def_readonly("rank_memory_bytes", &Candidate::rank_memory_bytes)
        .def_readonly("makespan_s", &Candidate::makespan_s)
        .def_readonly("exposed_sync_s", &Candidate::exposed_sync_s)
        .def_readonly("optimizer_s", &Candidate::optimizer_s)
        .def_readonly("host_step_s", &Candidate::host_step_s)
        .def_readonly("iteration_s", &Candidate::iteration_s)
        .def_readonly("cost_per_iteration", &Candidate::cost_per_iteration)
        .def_readonly("samples_per_s", &Candidate::samples_per_s)
        .def_readonly("bubble_fraction", &Candidate::bubble_fraction)
        .def_readonly("peak_memory_bytes", &Candidate::peak_memory_bytes)
        .def_readonly("objective", &Candidate::objective)
        .def("__repr__", [](const Candidate& c) {
            return "Candidate(dp=" + std::to_string(c.dp) + ", pp=" + std::to_string(c.pp) +
                   ", b=" + std::to_string(c.micro_batch_size) + ", m=" + std::to_string(c.num_microbatches) +
                   ", schedule='" + pyplan::schedule_name(c.schedule) + "', zero_stage=" +
                   std::to_string(c.zero_stage) + ", placement='" + pyplan::placement_name(c.placement) +
                   "', iteration_s=" + std::to_string(c.iteration_s) + ")";
        });

    py::class_<SearchResult>(m, "SearchResult", "The best plan, the top-k, the Pareto frontier, or why none fits.")
        .def_readonly("feasible", &SearchResult::feasible)
        .def_property_readonly("best",
                               [](const SearchResult& r) -> py::object {
                                   return r.feasible ? py::cast(r.best) : py::none();
                               })
        .def_readonly("top", &SearchResult::top)
        .def_readonly("pareto", &SearchResult::pareto)
        .def_readonly("top_two_chunks", &SearchResult::top_two_chunks)
        .def_readonly("pareto_two_chunks", &SearchResult::pareto_two_chunks)
        .def_readonly("num_candidates", &SearchResult::num_candidates)
        .def_readonly("num_evaluated", &SearchResult::num_evaluated)
        .def_readonly("num_pruned", &SearchResult::num_pruned)
        .def_readonly("num_feasible", &SearchResult::num_feasible)
        .def_readonly("num_partitions", &SearchResult::num_partitions)
        .def_readonly("reason", &SearchResult::reason)
        .def_readonly("least_need_bytes", &SearchResult::least_need_bytes);

    m.def(
        "search",
        [](std::vector<double> fwd_alpha_s, std::vector<double> fwd_beta_s, std::vector<double> bwd_alpha_s,
           std::vector<double> bwd_beta_s, std::vector<double> act_per_sample_bytes,
           std::vector<double> act_fixed_bytes, std::vector<double> params, std::vector<double> cut_per_sample_bytes,
           std::vector<double> cut_fixed_bytes, std::int64_t num_gpus, std::int64_t gpus_per_node,
           double gpu_mem_bytes,
           double mem_bw_bytes_per_s, double intra_latency_s, double intra_bw_bytes_per_s, double inter_latency_s,
           double inter_bw_bytes_per_s, double price_per_gpu_s, std::int64_t global_batch, double param_bytes,
           double grad_bytes, double optim_bytes, const std::vector<std::int64_t>& micro_batch_sizes,
           const std::vector<std::string>& schedules, const std::vector<std::int64_t>& zero_stages,
           const std::vector<std::string>& placements, bool allow_fewer_gpus, const std::string& objective,
           double weight, std::int64_t top_k, std::vector<double> param_tensors, std::vector<double> cut_tensors,
           std::pair<double, double> intra_collective, std::pair<double, double> inter_collective,
           const py::dict& host, std::vector<double> time_sizes, std::vector<double> fwd_points_s,
           std::vector<double> bwd_points_s, bool zero3_single_stage, double zero3_gather_bytes,
           double zero3_reduce_bytes, const std::vector<std::int64_t>& data_parallel,
           const std::vector<std::int64_t>& pipeline_ranks,
           const std::vector<std::int64_t>& num_microbatches, const std::vector<std::int64_t>& fixed_cuts,
           bool fresh_gradients, const std::vector<std::int64_t>& stages_per_rank, bool two_chunks_apart) {
            pyplan::ProfiledChain chain{std::move(fwd_alpha_s),     std::move(fwd_beta_s),
                                              std::move(bwd_alpha_s),     std::move(bwd_beta_s),
                                              std::move(act_per_sample_bytes), std::move(act_fixed_bytes),
                                              std::move(params),          std::move(cut_per_sample_bytes),
                                              std::move(cut_fixed_bytes), std::move(param_tensors),
                                              std::move(cut_tensors),     std::move(time_sizes),
                                              std::move(fwd_points_s),    std::move(bwd_points_s)};
            pyplan::Hardware hardware;
            hardware.num_gpus = to_int(num_gpus, "num_gpus", 1, pyplan::kMaxGpus);
            hardware.gpus_per_node = to_int(gpus_per_node, "gpus_per_node", 1, kIntMax);
            hardware.gpu_mem_bytes = gpu_mem_bytes;
            hardware.mem_bw_bytes_per_s = mem_bw_bytes_per_s;
            hardware.intra = {intra_latency_s, intra_bw_bytes_per_s};
            hardware.inter = {inter_latency_s, inter_bw_bytes_per_s};
            hardware.intra_collective = {intra_collective.first, intra_collective.second};
            hardware.inter_collective = {inter_collective.first, inter_collective.second};
            hardware.price_per_gpu_s = price_per_gpu_s;
            pyplan::HostCosts& h = hardware.host;
            for (const auto& item : host) {
                const std::string key = py::str(item.first);
                if (key == "sync_overlaps_backward") {
                    h.sync_overlaps_backward = item.second.cast<bool>();
                    continue;
                }
                const double value = item.second.cast<double>();
                if (key == "stage_forward_s") h.stage_forward_s = value;
                else if (key == "stage_backward_s") h.stage_backward_s = value;
                else if (key == "message_s") h.message_s = value;
                else if (key == "step_s") h.step_s = value;
                else if (key == "optimizer_tensor_s") h.optimizer_tensor_s = value;
                else if (key == "optimizer_element_s") h.optimizer_element_s = value;
                else throw std::invalid_argument("unknown host cost '" + key + "'");
            }
            pyplan::SearchSpace space;
            space.global_batch = to_int(global_batch, "global_batch", 1, kIntMax);
            space.bytes_per_param = {param_bytes, grad_bytes, optim_bytes};
            space.micro_batch_sizes = to_ints(micro_batch_sizes, "micro_batch_sizes", 1, kIntMax);
            space.data_parallel = to_ints(data_parallel, "data_parallel", 1, kIntMax);
            space.pipeline_ranks = to_ints(pipeline_ranks, "pipeline_ranks", 1, kIntMax);
            space.num_microbatches = to_ints(num_microbatches, "num_microbatches", 1, kIntMax);
            space.fixed_cuts = to_ints(fixed_cuts, "fixed_cuts", 0, kIntMax);
            space.schedules.clear();
            for (const auto& name : schedules) space.schedules.push_back(to_schedule(name));
            space.stages_per_rank = to_ints(stages_per_rank, "stages_per_rank", 1, kIntMax);
            space.two_chunks_apart = two_chunks_apart;
            space.zero_stages = to_ints(zero_stages, "zero_stages", 0, 3);
            space.placements.clear();
            for (const auto& name : placements) space.placements.push_back(pyplan::placement_from_name(name));
            space.allow_fewer_gpus = allow_fewer_gpus;
            space.zero3_single_stage = zero3_single_stage;
            space.zero3_gather_bytes = zero3_gather_bytes;
            space.zero3_reduce_bytes = zero3_reduce_bytes;
            space.fresh_gradients = fresh_gradients;
            space.objective = pyplan::objective_from_name(objective);
            space.weight = weight;
            space.top_k = to_int(top_k, "top_k", 1, kIntMax);
            py::gil_scoped_release release;
            return pyplan::search(chain, hardware, space);
        },
        py::arg("fwd_alpha_s"), py::arg("fwd_beta_s"), py::arg("bwd_alpha_s"), py::arg("bwd_beta_s"),
        py::arg("act_per_sample_bytes"), py::arg("act_fixed_bytes"), py::arg("params"),
        py::arg("cut_per_sample_bytes"), py::arg("cut_fixed_bytes"), py::kw_only(), py::arg("num_gpus"),
        py::arg("gpus_per_node"), py::arg("gpu_mem_bytes"), py::arg("mem_bw_bytes_per_s"),
        py::arg("intra_latency_s"), py::arg("intra_bw_bytes_per_s"), py::arg("inter_latency_s"),
        py::arg("inter_bw_bytes_per_s"), py::arg("price_per_gpu_s") = 0.0, py::arg("global_batch"),
        py::arg("param_bytes"), py::arg("grad_bytes"), py::arg("optim_bytes"),
        py::arg("micro_batch_sizes") = std::vector<std::int64_t>{},
        py::arg("schedules") = std::vector<std::string>{"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"},
        py::arg("zero_stages") = std::vector<std::int64_t>{0, 1, 2, 3},
        py::arg("placements") = std::vector<std::string>{"pp-inner", "dp-inner"},
        py::arg("allow_fewer_gpus") = false, py::arg("objective") = "time", py::arg("weight") = 0.0,
        py::arg("top_k") = 5, py::arg("param_tensors") = std::vector<double>{},
        py::arg("cut_tensors") = std::vector<double>{}, py::arg("intra_collective") = std::make_pair(0.0, 0.0),
        py::arg("inter_collective") = std::make_pair(0.0, 0.0), py::arg("host") = py::dict(),
        py::arg("time_sizes") = std::vector<double>{}, py::arg("fwd_points_s") = std::vector<double>{},
        py::arg("bwd_points_s") = std::vector<double>{}, py::arg("zero3_single_stage") = false,
        py::arg("zero3_gather_bytes") = 0.0, py::arg("zero3_reduce_bytes") = 0.0,
        py::arg("data_parallel") = std::vector<std::int64_t>{}, py::arg("pipeline_ranks") = std::vector<std::int64_t>{},
        py::arg("num_microbatches") = std::vector<std::int64_t>{}, py::arg("fixed_cuts") = std::vector<std::int64_t>{},
        py::arg("fresh_gradients") = false, py::arg("stages_per_rank") = std::vector<std::int64_t>{1, 2, 3, 4},
        py::arg("two_chunks_apart") = false,
        "Searches data parallelism x pipeline stages x micro-batch size x schedule x ZeRO stage x placement\n"
        "for a chain profiled as t(b) = alpha*b + beta per block, or, with time_sizes (K ascending sizes), as\n"
        "the line between the neighbouring points fwd/bwd_points_s[i*K + k] (see cpp/include/pyplan/search.h for the\n"
        "model). Per block (L): fwd/bwd alpha and beta in seconds, saved activation bytes per sample and per\n"
        "micro-batch, parameter elements; per cut (L+1): live bytes per sample and per micro-batch.\n"
        "Optional: param_tensors (L) and cut_tensors (L+1) counts, intra/inter_collective (latency_s, bw) links\n"
        "for collectives, host: HostCosts fields by name (search.h); fresh_gradients: one replica frees its\n"
        "gradients every step, so a stage that runs every forward before its first backward counts those not\n"
        "yet made at its peak out (search.h step 3); stages_per_rank: the allowed v (1: GPipe, 1F1B; 2 or more:\n"
        "the interleaved schedules); two_chunks_apart: also top_two_chunks and pareto_two_chunks, the top and\n"
        "frontier of the candidates of at most 2 stages per rank.\n"
        "objective: 'time', 'cost' or 'weighted' (cost + weight * time). Times in [0, 1e9] s, sizes and counts\n"
        "in [0, 1e18], bandwidths >= 1e-3 or inf, num_gpus <= 2^20 (cpp/include/pyplan/limits.h). Raises\n"
        "ValueError on invalid input; returns feasible=False with a reason when no plan fits in memory.");
}
