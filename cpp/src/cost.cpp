// The closed-form cost model; see cost.h for the formulas and their sources.
#include "pyplan/cost.h"

#include "pyplan/check.h"
#include "pyplan/limits.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace pyplan {
namespace {

[[noreturn]] void fail(const std::string& message) {
    throw std::invalid_argument(message);
}

// The ranges of limits.h: these formulas also take what search() derives (kMaxValue).
void check_link(const Link& link) {
    require_in(link.latency_s, 0.0, kMaxValue, "link latency_s");
    require_bandwidth(link.bw_bytes_per_s, "link bw_bytes_per_s");
}

void check_bytes(double bytes) { require_in(bytes, 0.0, kMaxValue, "bytes"); }

void check_ranks(int num_ranks) {
    if (num_ranks < 1) fail("the number of ranks must be >= 1, got " + std::to_string(num_ranks));
}

// One step of a ring collective: every rank sends its 1/d share of G to its neighbour.
double ring_step_time_s(const Link& link, double bytes, int num_ranks) {
    return link.latency_s + bytes / (num_ranks * link.bw_bytes_per_s);
}

}  // namespace

double p2p_time_s(const Link& link, double bytes) {
    check_link(link);
    check_bytes(bytes);
    return link.latency_s + bytes / link.bw_bytes_per_s;
}

double ring_allreduce_time_s(const Link& link, double bytes, int num_ranks) {
    return 2.0 * reduce_scatter_time_s(link, bytes, num_ranks);
}

double reduce_scatter_time_s(const Link& link, double bytes, int num_ranks) {
    check_link(link);
    check_bytes(bytes);
    check_ranks(num_ranks);
    return (num_ranks - 1) * ring_step_time_s(link, bytes, num_ranks);
}

double all_gather_time_s(const Link& link, double bytes, int num_ranks) {
    return reduce_scatter_time_s(link, bytes, num_ranks);
}

double hierarchical_allreduce_time_s(const Link& intra, const Link& inter, double bytes, int gpus_per_node,
                                     int num_nodes) {
    require_in(intra.latency_s, 0.0, kMaxValue, "intra_latency_s");
    require_bandwidth(intra.bw_bytes_per_s, "intra_bw_bytes_per_s");
    require_in(inter.latency_s, 0.0, kMaxValue, "inter_latency_s");
    require_bandwidth(inter.bw_bytes_per_s, "inter_bw_bytes_per_s");
    check_ranks(gpus_per_node);
    check_ranks(num_nodes);
    const double inside = reduce_scatter_time_s(intra, bytes, gpus_per_node) +
                          all_gather_time_s(intra, bytes, gpus_per_node);
    const double across = ring_allreduce_time_s(inter, bytes / gpus_per_node, num_nodes);
    return inside + across;
}

ModelStateBytes zero_model_state_bytes(double num_params, int num_replicas, int zero_stage,
                                       const BytesPerParam& bytes_per_param) {
    require_in(num_params, 0.0, kMaxValue, "num_params");
    check_ranks(num_replicas);
    if (zero_stage < 0 || zero_stage > 3) {
        fail("zero_stage must be 0, 1, 2 or 3, got " + std::to_string(zero_stage));
    }
    require_in(bytes_per_param.param_bytes, 0.0, kMaxValue, "param_bytes");
    require_in(bytes_per_param.grad_bytes, 0.0, kMaxValue, "grad_bytes");
    require_in(bytes_per_param.optim_bytes, 0.0, kMaxValue, "optim_bytes");
    // Stage k shards the first k of (optimizer state, gradients, weights) over the d replicas.
    const double full = num_params;
    const double shard = num_params / num_replicas;
    ModelStateBytes state;
    state.optim_bytes = bytes_per_param.optim_bytes * (zero_stage >= 1 ? shard : full);
    state.grad_bytes = bytes_per_param.grad_bytes * (zero_stage >= 2 ? shard : full);
    state.param_bytes = bytes_per_param.param_bytes * (zero_stage >= 3 ? shard : full);
    return state;
}

double pipeline_time_s(const std::vector<double>& stage_time_s, int num_microbatches) {
    if (stage_time_s.empty()) fail("a pipeline needs at least one stage");
    if (num_microbatches < 1) fail("num_microbatches must be >= 1, got " + std::to_string(num_microbatches));
    require_each_in(stage_time_s, 0.0, kMaxValue, "stage_time_s");
    double sum_s = 0.0;
    for (double t : stage_time_s) sum_s += t;
    const double max_s = *std::max_element(stage_time_s.begin(), stage_time_s.end());
    return sum_s + (num_microbatches - 1) * max_s;
}

double bubble_fraction(int num_stages, int num_microbatches, int num_chunks) {
    if (num_stages < 1) fail("num_stages must be >= 1, got " + std::to_string(num_stages));
    if (num_microbatches < 1) fail("num_microbatches must be >= 1, got " + std::to_string(num_microbatches));
    if (num_chunks < 1) fail("num_chunks must be >= 1, got " + std::to_string(num_chunks));
    const double bubble = num_stages - 1;
    return bubble / (static_cast<double>(num_chunks) * num_microbatches + bubble);
}

double optimizer_step_time_s(double bytes_read, double bytes_written, double mem_bw_bytes_per_s) {
    require_in(bytes_read, 0.0, kMaxValue, "bytes_read");
    require_in(bytes_written, 0.0, kMaxValue, "bytes_written");
    require_bandwidth(mem_bw_bytes_per_s, "mem_bw_bytes_per_s");
    return (bytes_read + bytes_written) / mem_bw_bytes_per_s;
}

}  // namespace pyplan
