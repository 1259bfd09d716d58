// The plan search; the enumeration, the model of a candidate and the pruning are stated in search.h.
#include "pyplan/search.h"

#include "pyplan/check.h"
#include "pyplan/format.h"
#include "pyplan/limits.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "pyplan/chain.h"
#include "pyplan/partition.h"

namespace pyplan {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

[[noreturn]] void fail(const std::string& message) {
    throw std::invalid_argument(message);
}

std::string join(const std::vector<int>& values) {
    std::string out;
    for (std::size_t i = 0; i < values.size() && i < 12; ++i) out += (i ? ", " : "") + std::to_string(values[i]);
    if (values.size() > 12) out += ", ...";
    return out;
}

// The allowed stages per rank that `schedule` runs, increasing: 1 for GPipe and 1F1B, 2 or more for the
// interleaved schedules (search.h's enumeration).
std::vector<int> stages_per_rank_of(Schedule schedule, const std::vector<int>& allowed) {
    const bool single = schedule == Schedule::GPipe || schedule == Schedule::OneFOneB;
    std::vector<int> out;
    for (int v : allowed) {
        if ((v == 1) == single && std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
    }
    std::sort(out.begin(), out.end());
    return out;
}

// ---- validation ----------------------------------------------------------------------------------

// `values` has `size` entries, each in [0, hi] (limits.h).
void require_array(const std::vector<double>& values, std::size_t size, const char* name, double hi,
                   const char* per) {
    require_size(values.size(), size, name, per);
    require_each_in(values, 0.0, hi, name);
}

void require_link(const Link& link, const char* latency_name, const char* bw_name) {
    require_in(link.latency_s, 0.0, kMaxSeconds, latency_name);
    require_bandwidth(link.bw_bytes_per_s, bw_name);
}

// Every input within limits.h's ranges for measured values: what the search derives from them (a time at
// b ≤ 2^31 samples, ZeRO-3's collectives, sums over blocks and micro-batches) then stays finite, and within
// what partition() and simulate() accept (kMaxValue).
void validate(const ProfiledChain& c, const Hardware& hw, const SearchSpace& space) {
    const std::size_t L = c.fwd_alpha_s.size();
    if (L == 0) fail("the chain has no blocks");
    require_array(c.fwd_alpha_s, L, "fwd_alpha_s", kMaxSeconds, "one per block");
    require_array(c.fwd_beta_s, L, "fwd_beta_s", kMaxSeconds, "one per block");
    require_array(c.bwd_alpha_s, L, "bwd_alpha_s", kMaxSeconds, "one per block");
    require_array(c.bwd_beta_s, L, "bwd_beta_s", kMaxSeconds, "one per block");
    require_array(c.act_per_sample_bytes, L, "act_per_sample_bytes", kMaxBytes, "one per block");
    require_array(c.act_fixed_bytes, L, "act_fixed_bytes", kMaxBytes, "one per block");
    require_array(c.params, L, "params", kMaxBytes, "one per block");
    require_array(c.cut_per_sample_bytes, L + 1, "cut_per_sample_bytes", kMaxBytes, "one per cut");
    require_array(c.cut_fixed_bytes, L + 1, "cut_fixed_bytes", kMaxBytes, "one per cut");
    if (!c.param_tensors.empty()) require_array(c.param_tensors, L, "param_tensors", kMaxBytes, "one per block");
    if (!c.cut_tensors.empty()) require_array(c.cut_tensors, L + 1, "cut_tensors", kMaxBytes, "one per cut");
    if (!c.time_sizes.empty() || !c.fwd_points_s.empty() || !c.bwd_points_s.empty()) {
        const std::size_t K = c.time_sizes.size();
        if (K < 2) fail("time_sizes needs two or more sizes, got " + std::to_string(K));
        // Sizes of at least one sample keep the slopes between them finite (distinct doubles ≥ 1 differ by
        // at least 2^−52).
        require_each_in(c.time_sizes, 1.0, kMaxBytes, "time_sizes");
        for (std::size_t k = 1; k < K; ++k) {
            if (!(c.time_sizes[k] > c.time_sizes[k - 1])) fail("time_sizes must be strictly ascending");
        }
        require_array(c.fwd_points_s, L * K, "fwd_points_s", kMaxSeconds, "one per block and size");
        require_array(c.bwd_points_s, L * K, "bwd_points_s", kMaxSeconds, "one per block and size");
    }
    require_int_in(hw.num_gpus, 1, kMaxGpus, "the number of GPUs");
    if (hw.gpus_per_node <= 0) fail("gpus_per_node must be >= 1, got " + std::to_string(hw.gpus_per_node));
    if (!(hw.gpu_mem_bytes >= 0.0 && (hw.gpu_mem_bytes <= kMaxBytes || hw.gpu_mem_bytes == kInf))) {
        fail_range("gpu_mem_bytes", "[0, " + format_number(kMaxBytes) + "] or inf", format_number(hw.gpu_mem_bytes));
    }
    require_bandwidth(hw.mem_bw_bytes_per_s, "mem_bw_bytes_per_s");
    require_link(hw.intra, "intra_latency_s", "intra_bw_bytes_per_s");
    require_link(hw.inter, "inter_latency_s", "inter_bw_bytes_per_s");
    if (hw.intra_collective.bw_bytes_per_s != 0.0) {
        require_link(hw.intra_collective, "intra_collective latency_s", "intra_collective bw_bytes_per_s");
    }
    if (hw.inter_collective.bw_bytes_per_s != 0.0) {
        require_link(hw.inter_collective, "inter_collective latency_s", "inter_collective bw_bytes_per_s");
    }
    const HostCosts& h = hw.host;
    require_in(h.stage_forward_s, 0.0, kMaxSeconds, "host cost stage_forward_s");
    require_in(h.stage_backward_s, 0.0, kMaxSeconds, "host cost stage_backward_s");
    require_in(h.message_s, 0.0, kMaxSeconds, "host cost message_s");
    require_in(h.step_s, 0.0, kMaxSeconds, "host cost step_s");
    require_in(h.optimizer_tensor_s, 0.0, kMaxSeconds, "host cost optimizer_tensor_s");
    require_in(h.optimizer_element_s, 0.0, kMaxSeconds, "host cost optimizer_element_s");
    require_in(hw.price_per_gpu_s, 0.0, kMaxPricePerS, "price_per_gpu_s");
    if (space.global_batch <= 0) fail("the global batch must be >= 1, got " + std::to_string(space.global_batch));
    const BytesPerParam& bpp = space.bytes_per_param;
    require_in(bpp.param_bytes, 0.0, kMaxBytes, "param_bytes");
    require_in(bpp.grad_bytes, 0.0, kMaxBytes, "grad_bytes");
    require_in(bpp.optim_bytes, 0.0, kMaxBytes, "optim_bytes");
    require_in(space.zero3_gather_bytes, 0.0, kMaxBytes, "zero3_gather_bytes");
    require_in(space.zero3_reduce_bytes, 0.0, kMaxBytes, "zero3_reduce_bytes");
    for (int b : space.micro_batch_sizes) {
        if (b < 1) fail("micro-batch sizes must be >= 1, got " + std::to_string(b));
    }
    for (const auto& [pins, what] : {std::pair{&space.data_parallel, "data-parallel degrees"},
                                     std::pair{&space.pipeline_ranks, "pipeline ranks"},
                                     std::pair{&space.num_microbatches, "micro-batch counts"}}) {
        for (int x : *pins) {
            if (x < 1) fail(std::string(what) + " must be >= 1, got " + std::to_string(x));
        }
    }
    const std::vector<int>& cuts = space.fixed_cuts;
    if (!cuts.empty()) {
        bool ordered = cuts.size() >= 2 && cuts.front() == 0 && cuts.back() == static_cast<int>(L);
        for (std::size_t k = 1; ordered && k < cuts.size(); ++k) ordered = cuts[k - 1] < cuts[k];
        if (!ordered) fail("fixed_cuts must rise from 0 to the chain's " + std::to_string(L) + " blocks");
    }
    if (space.schedules.empty()) fail("no schedule to search");
    for (Schedule s : space.schedules) {
        if (s != Schedule::GPipe && s != Schedule::OneFOneB && s != Schedule::Interleaved1F1B &&
            s != Schedule::LoopedBFS) {
            fail(std::string(schedule_name(s)) +
                 " is not searched: the zero-bubble schedules need split I/W times and give wrong gradients "
                 "with DDP/FSDP2 on torch 2.13");
        }
    }
    if (space.stages_per_rank.empty()) fail("no stages per rank to search");
    for (int v : space.stages_per_rank) {
        if (v < 1) fail("stages per rank must be >= 1, got " + std::to_string(v));
    }
    if (space.zero_stages.empty()) fail("no ZeRO stage to search");
    for (int z : space.zero_stages) {
        if (z < 0 || z > 3) fail("ZeRO stages are 0, 1, 2 or 3, got " + std::to_string(z));
    }
    if (space.placements.empty()) fail("no placement to search");
    require_in(space.weight, 0.0, kMaxPricePerS, "the weight");
    if (space.top_k < 1) fail("top_k must be >= 1, got " + std::to_string(space.top_k));
}

// ---- layout of a (d, p, placement) on nodes ---------------------------------------------------------

struct Layout {
    bool pipeline_inter = false;
    int dp_gpus_per_node = 1;  // g'
    int dp_nodes = 1;          // n'
};

Layout layout_of(int d, int p, int v, int g, Placement placement) {
    auto gpu = [&](int k, int r) { return placement == Placement::kPipelineInner ? k * p + r : r * d + k; };
    Layout out;
    // Boundaries join pipeline ranks r and r+1, and with v ≥ 2 also p−1 and 0.
    for (int k = 0; k < d && !out.pipeline_inter; ++k) {
        for (int r = 0; r + 1 < p; ++r) out.pipeline_inter |= gpu(k, r) / g != gpu(k, r + 1) / g;
        if (v > 1 && p > 1) out.pipeline_inter |= gpu(k, p - 1) / g != gpu(k, 0) / g;
    }
    // Members of each dp group per node: gpu(k, r) grows with k, so a group's nodes come in runs.
    int common = -1;
    bool uniform = true;
    for (int r = 0; r < p && uniform; ++r) {
        int run = 0;
        for (int k = 0; k < d && uniform; ++k) {
            ++run;
            const bool run_ends = k + 1 == d || gpu(k + 1, r) / g != gpu(k, r) / g;
            if (!run_ends) continue;
            if (common < 0) common = run;
            uniform = run == common;
            run = 0;
        }
    }
    if (uniform) {
        out.dp_gpus_per_node = common;
        out.dp_nodes = d / common;
    } else {
        out.dp_gpus_per_node = 1;
        out.dp_nodes = d;
    }
    return out;
}

// ---- one configuration ------------------------------------------------------------------------------

struct Config {
    int d = 1, p = 1, v = 1, b = 1, m = 1;
    Schedule schedule = Schedule::GPipe;
    int zero = 0;
    Placement placement = Placement::kPipelineInner;
    long long index = 0;            // enumeration order, the last tie-break
    double bound_time_s = 0.0;      // no candidate of this configuration is faster
    double bound_objective = 0.0;
    double bound_makespan_s = 0.0;  // its makespan part
    double bound_rest_s = 0.0;      // its exposed sync and optimizer parts
    double least_send_s = 0.0;      // the cheapest boundary send
    double work_s = 0.0;            // Σ_i (f_i + g_i)
    bool fits_bound = true;         // false: no partition can fit in memory (its stages cannot hold the work)
    double need_bound_bytes = 0.0;  // the fullest GPU of any partition needs at least this much
};

// Step 9: what each stage of a candidate's schedule holds beside its state and in-flight activations, in tensors of
// its input cut and of its output cut (partition.h's input_buffer_cuts and output_buffer_cuts).
struct HeldCuts {
    std::vector<long long> inputs;   // [S] receive buffers beyond the n_s in flight; the batch, a kept input gradient
    std::vector<long long> outputs;  // [S] output gradients received or handed over; a kept send
};

double objective_of(const SearchSpace& space, const Hardware& hw, int num_gpus, double time_s) {
    const double cost = num_gpus * hw.price_per_gpu_s * time_s;
    switch (space.objective) {
        case Objective::kTime: return time_s;
        case Objective::kCost: return cost;
        case Objective::kWeighted: return cost + space.weight * time_s;
    }
    return time_s;
}

class Searcher {
public:
    Searcher(const ProfiledChain& chain, const Hardware& hw, const SearchSpace& space)
        : chain_(chain), hw_(hw), space_(space), L_(chain.num_blocks()) {
        for (double params : chain.params) total_params_ += params;
        for (double tensors : chain.param_tensors) total_tensors_ += tensors;
    }

    SearchResult run();

private:
    // Dp collectives of a layout: all-reduce, and reduce-scatter / all-gather as its half.
    double allreduce_s(const Layout& lay, double bytes) const {
        const Link& intra = hw_.intra_collective.bw_bytes_per_s > 0.0 ? hw_.intra_collective : hw_.intra;
        const Link& inter = hw_.inter_collective.bw_bytes_per_s > 0.0 ? hw_.inter_collective : hw_.inter;
        return hierarchical_allreduce_time_s(intra, inter, bytes, lay.dp_gpus_per_node, lay.dp_nodes);
    }
    // Tensors crossing cut `cut` (0 at the model's input and output: nothing is sent there).
    double cut_tensors(int cut) const {
        return cut == 0 || cut == L_ || chain_.cut_tensors.empty() ? 0.0 : chain_.cut_tensors[cut];
    }
    // The optimizer step of a rank holding `state` bytes of `elements` parameter elements in `tensors` tensors:
    // the state streamed through memory, or the measured per-element rate when slower, plus the per-tensor cost.
    // Convex in (state, elements, tensors), so the bound's step of the average rank is a lower bound.
    double optimizer_s(double state, double elements, double tensors) const {
        const HostCosts& h = hw_.host;
        const double streamed_s = optimizer_step_time_s(state, state, hw_.mem_bw_bytes_per_s);
        return std::max(streamed_s, elements * h.optimizer_element_s) + tensors * h.optimizer_tensor_s;
    }
    const Layout& layout(int d, int p, int v, Placement placement);
    std::vector<Config> enumerate();
    void bound(Config& config);
    double capped_makespan_s(const Config& config, const Chain& chain, const std::vector<int>& in_flight,
                             const std::vector<bool>& fresh);
    void raise_makespan_bound(Config& config, double makespan_s);
    void cap_exactly(Config& config);
    void tighten(Config& config);
    double block_time_s(const Config& config, const Layout& lay, int block, bool forward) const;
    const PartitionResult& partition_for(const Config& config, const Layout& lay, const Chain& chain);
    const PartitionResult& cached_partition(const Config& config, const Layout& lay, const Chain& chain);
    bool stages_fit(const Config& config, const Chain& chain, const std::vector<int>& cuts);
    Chain chain_at(const Config& config, const Layout& lay) const;
    const Chain& chain_for(const Config& config, const Layout& lay);
    const RankOrder& order_for(Schedule schedule, int p, int m, int v);
    const std::vector<int>& in_flight_of(const Config& config);
    const InFlightPeaks& peaks_of(const Config& config);
    bool may_be_fresh(const Config& config) const;
    std::vector<bool> fresh_of(const Config& config);
    const HeldCuts& held_cuts_of(const Config& config);
    void evaluate(const Config& config);
    // A candidate's top and frontier lists: the overall ones, and with two_chunks_apart those of at most 2 stages per
    // rank.
    using Ranked = std::vector<std::pair<Candidate, long long>>;
    void offer(Candidate candidate, long long index);
    void offer_to(Ranked& top, Ranked& pareto, std::pair<Candidate, long long> entry) const;
    bool prunable(int num_gpus, int v, double bound_time_s) const;
    bool beaten(const Ranked& top, const Ranked& pareto, int num_gpus, double bound_time_s) const;
    void infeasible(const Config& config, double need_bytes, const std::string& where, bool exact = true);

    const ProfiledChain& chain_;
    const Hardware& hw_;
    const SearchSpace& space_;
    const int L_;
    double total_params_ = 0.0;
    double total_tensors_ = 0.0;
    double tensors_of(int block) const { return chain_.param_tensors.empty() ? 0.0 : chain_.param_tensors[block]; }
    std::map<std::tuple<int, int, int, int>, Layout> layouts_;
    std::map<std::vector<long long>, Chain> chains_;
    std::map<std::vector<long long>, PartitionResult> partitions_;
    std::map<std::tuple<int, int, int, int>, RankOrder> orders_;
    std::map<std::tuple<int, int, int, int>, std::vector<int>> in_flight_;
    std::map<std::tuple<int, int, int, int>, InFlightPeaks> peaks_;  // with v ≥ 2, by the key of in_flight_
    std::map<std::tuple<int, int, int, int>, HeldCuts> held_cuts_;
    // [n] or NaN, per chain and whether the stage makes its gradients after its peak; chains_ never moves its chains
    std::map<std::pair<const Chain*, bool>, std::vector<double>> caps_;
    // What `bound` needs of a chain, whatever the candidate (per chain and optimizer sharding): sums over its
    // blocks, its smallest cut and the largest optimizer step of one block.
    struct ChainSums {
        double work_s = 0, backward_s = 0, block_max_s = 0, state = 0, keep = 0, act = 0, optimizer_s = 0;
        double least_cut_bytes = kInf;
    };
    std::map<std::pair<const Chain*, double>, ChainSums> sums_;
    // per chain, least micro-batches in flight and whether a stage may make its gradients after its peak
    std::map<std::tuple<const Chain*, int, bool>, double> block_need_;
    // least_partition_makespan_s by (chain, schedule, p, m, v, least send, fresh gradients): the same for many
    // candidates.
    std::map<std::tuple<const Chain*, int, int, int, int, double, bool>, double> tightened_;

    SearchResult result_;
    Ranked top_;     // best first, with enumeration index
    Ranked pareto_;  // by increasing time
    Ranked top_two_, pareto_two_;  // the same of the candidates of at most 2 stages per rank (two_chunks_apart)
    double least_need_bytes_ = kInf;
    std::string least_need_text_;
    double least_bound_bytes_ = kInf;  // lower bounds on needs (several stages per rank), used when no need is exact
    std::string least_bound_text_;
    long long too_long_ = 0;  // candidates left out: more than kMaxStageMicrobatches stages × micro-batches
};

const Layout& Searcher::layout(int d, int p, int v, Placement placement) {
    const auto key = std::make_tuple(d, p, v, static_cast<int>(placement));
    auto it = layouts_.find(key);
    if (it == layouts_.end()) it = layouts_.emplace(key, layout_of(d, p, v, hw_.gpus_per_node, placement)).first;
    return it->second;
}

// The allowed micro-batch sizes that divide a replica's share n of the batch, increasing. Divisors come in
// pairs (b, n/b) with b ≤ √n: O(√n) steps, b·b in 64 bits, for any n up to 2^31 − 1.
std::vector<int> micro_batch_sizes(const std::vector<int>& allowed, int per_replica) {
    std::vector<int> small, large;
    for (long long b = 1; b * b <= per_replica; ++b) {
        if (per_replica % b != 0) continue;
        small.push_back(static_cast<int>(b));
        if (b * b != per_replica) large.push_back(static_cast<int>(per_replica / b));
    }
    small.insert(small.end(), large.rbegin(), large.rend());
    std::vector<int> sizes;
    for (int b : small) {
        if (allowed.empty() || std::find(allowed.begin(), allowed.end(), b) != allowed.end()) sizes.push_back(b);
    }
    return sizes;
}

std::vector<Config> Searcher::enumerate() {
    const int N = hw_.num_gpus;
    const int B = space_.global_batch;
    std::vector<Config> configs;
    std::vector<int> degrees;  // the data-parallel degrees some pipeline depth allows
    bool any_batch = false;
    // The allowed v of each schedule, and the most any has.
    std::map<int, std::vector<int>> schedule_v;
    std::size_t most_v = 0;
    for (Schedule schedule : space_.schedules) {
        schedule_v[static_cast<int>(schedule)] = stages_per_rank_of(schedule, space_.stages_per_rank);
        most_v = std::max(most_v, schedule_v[static_cast<int>(schedule)].size());
    }
    // Every schedule torch builds for (p, m, v), every ZeRO stage and placement, deduplicated (search.h).
    auto allowed = [](const std::vector<int>& pins, int x) {
        return pins.empty() || std::find(pins.begin(), pins.end(), x) != pins.end();
    };
    auto add_schedule = [&](int d, int p, int b, int m, Schedule schedule, int v) {
        if (p * v > L_ || (v > 1 && p < 2) || !torch_rejection(schedule, p, m, v).empty()) return;
        if (!space_.fixed_cuts.empty() && static_cast<std::size_t>(p * v) + 1 != space_.fixed_cuts.size()) return;
        if (static_cast<long long>(p) * v > kMaxStageMicrobatches / m) {  // S·m > the cap, without the product
            ++too_long_;
            return;
        }
        const std::size_t zeros = d == 1 ? 1 : space_.zero_stages.size();
        const std::size_t placements = d == 1 || p == 1 ? 1 : space_.placements.size();
        for (std::size_t z = 0; z < zeros; ++z) {
            if (d > 1 && space_.zero_stages[z] == 3 && space_.zero3_single_stage &&
                (p * v > 1 || schedule != Schedule::OneFOneB)) {
                continue;
            }
            for (std::size_t k = 0; k < placements; ++k) {
                Config c;
                c.d = d;
                c.p = p;
                c.v = v;
                c.b = b;
                c.m = m;
                c.schedule = schedule;
                c.zero = d == 1 ? 0 : space_.zero_stages[z];
                c.placement = space_.placements[k];
                c.index = static_cast<long long>(configs.size());
                configs.push_back(c);
            }
        }
    };
    auto add = [&](int d, int p, int b, int m) {
        if (!allowed(space_.pipeline_ranks, p) || !allowed(space_.num_microbatches, m)) return;
        // Pass k takes each schedule at its k-th allowed v (search.h).
        for (std::size_t pass = 0; pass < most_v; ++pass) {
            for (Schedule schedule : space_.schedules) {
                const std::vector<int>& vs = schedule_v[static_cast<int>(schedule)];
                if (pass < vs.size()) add_schedule(d, p, b, m, schedule, vs[pass]);
            }
        }
    };
    for (int d = 1; d <= N; ++d) {
        const int p_max = std::min(N / d, L_);
        const int p_min = space_.allow_fewer_gpus ? 1 : N / d;
        if ((!space_.allow_fewer_gpus && N % d != 0) || p_min > p_max || !allowed(space_.data_parallel, d)) continue;
        degrees.push_back(d);
        if (B % d != 0) continue;
        const std::vector<int> sizes = micro_batch_sizes(space_.micro_batch_sizes, B / d);
        any_batch = any_batch || !sizes.empty();
        for (int p = p_min; p <= p_max; ++p)
            for (int b : sizes) add(d, p, b, B / d / b);
    }
    if (!any_batch) {
        const std::string sizes = space_.micro_batch_sizes.empty() ? "any" : join(space_.micro_batch_sizes);
        if (degrees.empty()) fail("no data-parallel degree of the pinned " + join(space_.data_parallel) + " fits");
        fail("the global batch " + std::to_string(B) + " is not d·b·m for any data-parallel degree d (of " +
             join(degrees) + ") and micro-batch size b (" + sizes + ")");
    }
    const bool pinned = !space_.pipeline_ranks.empty() || !space_.num_microbatches.empty();
    if (configs.empty() && pinned) {
        fail("no configuration has the pinned pipeline ranks (" +
             (space_.pipeline_ranks.empty() ? std::string("any") : join(space_.pipeline_ranks)) +
             ") and micro-batch counts (" +
             (space_.num_microbatches.empty() ? std::string("any") : join(space_.num_microbatches)) + ")");
    }
    if (configs.empty() && !space_.fixed_cuts.empty()) {
        fail("no configuration has " + std::to_string(space_.fixed_cuts.size() - 1) +
             " stages, as the pinned cuts make");
    }
    return configs;
}

// Block i's gradients (chain.h's grad_bytes; 0 where it has none).
double grad_of(const Chain& chain, int i) {
    return chain.grad_bytes.empty() ? 0.0 : chain.grad_bytes[i];
}

// A stage's memory without its input cut and buffers, from its sums of state, state less gradients (keep) and saved
// activations, n in flight: partition.h's mem_s, which a stage with fresh gradients takes as max(S, K + n·A).
double held_bytes(double state, double keep, double act, int in_flight, bool fresh) {
    return fresh ? std::max(state, keep + in_flight * act) : state + in_flight * act;
}

// The most work Σ (f+g) of any range of blocks that fits in `limit` with n micro-batches in flight (`fresh`: its
// gradients made after its peak, partition.h), its input cut left out (a relaxation, so an upper bound on any
// stage's work). Two pointers.
double max_stage_work_s(const Chain& chain, int in_flight, bool fresh, double limit) {
    const int L = chain.num_blocks();
    const double slack = 1.0 + 1e-9;  // running sums round: never call a fitting range too big
    double best = 0.0, work = 0.0, state = 0.0, keep = 0.0, act = 0.0;
    for (int i = 0, j = 0; j < L; ++j) {
        work += chain.fwd_time_s[j] + chain.bwd_time_s[j];
        state += chain.state_bytes[j];
        keep += chain.state_bytes[j] - grad_of(chain, j);
        act += chain.act_bytes[j];
        while (i <= j && held_bytes(state, keep, act, in_flight, fresh) > limit * slack) {
            work -= chain.fwd_time_s[i] + chain.bwd_time_s[i];
            state -= chain.state_bytes[i];
            keep -= chain.state_bytes[i] - grad_of(chain, i);
            act -= chain.act_bytes[i];
            ++i;
        }
        if (i <= j) best = std::max(best, work);
    }
    return best * slack;
}

// Least V = max_s (m·w_s + Σ_{r<s} (w_r + 2σ)) over stage works 0 ≤ w_s ≤ cap_s with Σ w_s = W, σ the
// least boundary send. Stage s starts after micro-batch 0's forwards (and sends) through the stages before
// it, its rank works m·w_s on it, and the backward of its last action must still pass back through them,
// so V bounds the makespan of every searched schedule (with v ≥ 2 a rank also works on its other stages,
// which only adds). For a given V, taking w_s = min(cap_s, (V − Σ_{r<s} (w_r + 2σ))/m) in order covers
// the most work (none once the budget V is spent); bisection finds the least V that covers W and returns
// its low end (a lower bound). Infinite when the caps cannot cover W.
double least_pipeline_makespan_s(const std::vector<double>& cap, int m, double work_s, double send_s) {
    auto covers = [&](double v) {
        double rest = v, total = 0.0;
        for (double c : cap) {
            const double w = std::min(c, rest / m);
            total += w;
            rest -= w + 2 * send_s;
            if (total >= work_s) return true;
            if (rest <= 0.0) return false;
        }
        return false;
    };
    double lo = work_s, hi = (m + 1.0) * work_s + 2 * send_s * cap.size();
    if (!covers(hi)) return kInf;
    for (int it = 0; it < 200 && hi - lo > 1e-7 * hi; ++it) {
        const double mid = 0.5 * (lo + hi);
        (covers(mid) ? hi : lo) = mid;
    }
    return lo;
}

// The least makespan bound of a whole partition: min over cuts 0 = c_0 ≤ ... ≤ c_S = L of max_s of
//     T[c_s] + 2σ·s + m·(T[c_{s+1}] − T[c_s])                  (least_pipeline_makespan_s, per stage)
//     W + 2(S−1)σ + (m − k_s)·F_s + (m − 1)·B_s               (with one stage per rank, see below)
// with T the prefix sums of f + g, F_s and B_s the stage's forward and backward per micro-batch. The second
// term: a rank of GPipe or 1F1B runs k_s forwards (m, or min(m, p−s)) before its first backward, which
// waits for micro-batch 0 to go through every forward and back through the later stages' backwards; the
// rank's other m − k_s forwards and m backwards follow, and its last backward goes back through the
// earlier stages. Relaxed so that it stays a lower bound: stages may be empty and memory is checked
// without the input cut. Table D[s][j] = the least bound of s stages over blocks [0, j), D[0][0] = 0,
// D[0][j>0] = ∞, D[s+1][j] = min_{i ∈ [lo_s(j), j]} max(D[s][i], stage bound of [i, j)), lo_s(j) the first
// i whose range [i, j) fits with stage s's in-flight count. D[s][·] is non-decreasing (cut the last stage
// short) and the stage bound non-increasing in i, so the minimum sits where they cross; the stage bound of
// a fixed i grows with j, so the crossing only moves forward as j grows: two pointers, O(S·L). Infinite
// when no relaxed partition fits.
double least_partition_makespan_s(const Chain& chain, const std::vector<int>& in_flight,
                                  const std::vector<bool>& fresh, const std::vector<int>& warmup, int m,
                                  double send_s, double limit) {
    const int L = chain.num_blocks();
    const int S = static_cast<int>(in_flight.size());
    const double fit_limit = limit * (1.0 + 1e-9);
    std::vector<double> fwd(L + 1, 0.0), bwd(L + 1, 0.0), state(L + 1, 0.0), keep(L + 1, 0.0), act(L + 1, 0.0);
    for (int i = 0; i < L; ++i) {
        fwd[i + 1] = fwd[i] + chain.fwd_time_s[i];
        bwd[i + 1] = bwd[i] + chain.bwd_time_s[i];
        state[i + 1] = state[i] + chain.state_bytes[i];
        keep[i + 1] = keep[i] + (chain.state_bytes[i] - grad_of(chain, i));
        act[i + 1] = act[i] + chain.act_bytes[i];
    }
    const double round_trip_s = fwd[L] + bwd[L] + 2 * (S - 1) * send_s;
    std::vector<double> before(L + 1, kInf), after(L + 1);
    before[0] = 0.0;
    for (int s = 0; s < S; ++s) {
        const int n = in_flight[s];
        const double start_s = 2 * send_s * s;
        int lo = 0;
        int a = 0;  // the first i in [lo, j] with before[i] >= stage_bound(i), or j + 1
        for (int j = 0; j <= L; ++j) {
            while (lo < j && held_bytes(state[j] - state[lo], keep[j] - keep[lo], act[j] - act[lo], n, fresh[s]) >
                                 fit_limit) {
                ++lo;
            }
            auto stage_bound = [&](int i) {
                const double f = fwd[j] - fwd[i], b = bwd[j] - bwd[i];
                double bound = fwd[i] + bwd[i] + start_s + m * (f + b);
                if (!warmup.empty()) bound = std::max(bound, round_trip_s + (m - warmup[s]) * f + (m - 1) * b);
                return bound;
            };
            a = std::max(a, lo);
            while (a <= j && before[a] < stage_bound(a)) ++a;
            double best = kInf;
            if (a <= j) best = std::max(before[a], stage_bound(a));
            if (a > lo) best = std::min(best, std::max(before[a - 1], stage_bound(a - 1)));
            after[j] = best;
        }
        std::swap(before, after);
    }
    return before[L];
}

// Raises the makespan part of the bound to `makespan_s`; ∞ means no partition fits.
void Searcher::raise_makespan_bound(Config& c, double makespan_s) {
    if (makespan_s == kInf) {
        c.fits_bound = false;
        return;
    }
    c.bound_makespan_s = std::max(c.bound_makespan_s, makespan_s);
    c.bound_time_s = (c.bound_makespan_s + c.bound_rest_s) * (1.0 - 1e-9);
    c.bound_objective = objective_of(space_, hw_, c.d * c.p, c.bound_time_s);
}

// The pipeline bound with the stages' memory caps (least_pipeline_makespan_s), each stage at most the most
// work that fits with the given in-flight count (and fresh gradients); ∞ when the caps cannot hold the work.
double Searcher::capped_makespan_s(const Config& c, const Chain& chain, const std::vector<int>& in_flight,
                                   const std::vector<bool>& fresh) {
    std::vector<double> cap(in_flight.size());
    double cap_total = 0.0;
    for (std::size_t s = 0; s < cap.size(); ++s) {
        const int n = in_flight[s];
        std::vector<double>& known = caps_[{&chain, fresh[s]}];
        if (n >= static_cast<int>(known.size())) known.resize(n + 1, std::nan(""));
        if (std::isnan(known[n])) known[n] = max_stage_work_s(chain, n, fresh[s], hw_.gpu_mem_bytes);
        cap[s] = known[n];
        cap_total += cap[s];
    }
    if (cap_total < c.work_s) return kInf;
    return least_pipeline_makespan_s(cap, c.m, c.work_s, c.least_send_s);
}

// With several stages per rank, bound() caps the stages at one micro-batch in flight; this uses their counts.
void Searcher::cap_exactly(Config& c) {
    const Chain& chain = chain_for(c, layout(c.d, c.p, c.v, c.placement));
    raise_makespan_bound(c, capped_makespan_s(c, chain, in_flight_of(c), fresh_of(c)));
}

// Raises the makespan part of the bound to least_partition_makespan_s; called only for candidates the
// cheaper bounds do not skip.
void Searcher::tighten(Config& c) {
    const Layout& lay = layout(c.d, c.p, c.v, c.placement);
    const Chain& chain = chain_for(c, lay);
    const std::vector<int>& in_flight = in_flight_of(c);
    const std::vector<bool> fresh = fresh_of(c);
    const bool any_fresh = std::find(fresh.begin(), fresh.end(), true) != fresh.end();
    const auto key =
        std::make_tuple(&chain, static_cast<int>(c.schedule), c.p, c.m, c.v, c.least_send_s, any_fresh);
    auto it = tightened_.find(key);
    if (it == tightened_.end()) {
        std::vector<int> warmup;
        if (c.v == 1) warmup = in_flight;  // GPipe runs all m forwards first, 1F1B min(m, p−s)
        const double least_s =
            least_partition_makespan_s(chain, in_flight, fresh, warmup, c.m, c.least_send_s, hw_.gpu_mem_bytes);
        it = tightened_.emplace(key, least_s).first;
    }
    raise_makespan_bound(c, it->second);
}

void Searcher::bound(Config& c) {
    const Layout& lay = layout(c.d, c.p, c.v, c.placement);
    const Chain& chain = chain_for(c, lay);
    const int S = c.p * c.v;
    const int least_in_flight = c.schedule == Schedule::GPipe ? c.m : 1;
    // Where some stage may make its gradients after its peak, every stage's need is bounded as such a stage's.
    const bool relieved = may_be_fresh(c);
    const double shard = c.zero >= 1 ? c.d : 1;
    auto found = sums_.find({&chain, shard});
    if (found == sums_.end()) {
        ChainSums t;
        for (int i = 0; i < L_; ++i) {
            const double w = chain.fwd_time_s[i] + chain.bwd_time_s[i];
            t.work_s += w;
            t.backward_s += chain.bwd_time_s[i];
            t.block_max_s = std::max(t.block_max_s, w);
            t.state += chain.state_bytes[i];
            t.keep += chain.state_bytes[i] - grad_of(chain, i);
            t.act += chain.act_bytes[i];
            const double step_s = this->optimizer_s(chain.state_bytes[i], chain_.params[i] / shard, tensors_of(i));
            t.optimizer_s = std::max(t.optimizer_s, step_s);
        }
        for (int cut = 1; cut < L_; ++cut) t.least_cut_bytes = std::min(t.least_cut_bytes, chain.cut_bytes[cut]);
        found = sums_.emplace(std::make_pair(&chain, shard), t).first;
    }
    const ChainSums& sums = found->second;
    const double work_s = sums.work_s, backward_s = sums.backward_s, block_max_s = sums.block_max_s;
    const double state = sums.state, act = sums.act;
    auto need = block_need_.find({&chain, least_in_flight, relieved});
    if (need == block_need_.end()) {
        double most = 0;
        for (int i = 0; i < L_; ++i) {
            const double keep = chain.state_bytes[i] - grad_of(chain, i);
            const double held = held_bytes(chain.state_bytes[i], keep, chain.act_bytes[i], least_in_flight, relieved);
            most = std::max(most, held);
        }
        need = block_need_.emplace(std::make_tuple(&chain, least_in_flight, relieved), most).first;
    }
    const double block_need = need->second;
    // Memory: the fullest stage holds at least the average and the largest block, at its least in flight.
    c.need_bound_bytes = std::max(block_need, held_bytes(state, sums.keep, act, least_in_flight, relieved) / S);

    // Makespan: micro-batch 0's dependency chain, the busiest rank, and the pipeline bound above with the
    // stages' memory caps; with several stages per rank, at one micro-batch in flight each (a lower bound that
    // needs no schedule order; cap_exactly refines it for the candidates it does not skip).
    const Link& link = lay.pipeline_inter ? hw_.inter : hw_.intra;
    // A transfer takes longer the more bytes it moves: the least send is the smallest cut's.
    double send_s = L_ > 1 ? p2p_time_s(link, sums.least_cut_bytes) : kInf;
    if (S == 1) send_s = 0.0;
    c.least_send_s = send_s;
    c.work_s = work_s;
    double makespan_s = std::max(work_s + 2 * (S - 1) * send_s, c.m * std::max(work_s / c.p, block_max_s));
    const double capped_s = c.v == 1 ? capped_makespan_s(c, chain, in_flight_of(c), fresh_of(c))
                                     : capped_makespan_s(c, chain, std::vector<int>(S, 1), std::vector<bool>(S, false));
    c.fits_bound = capped_s < kInf;
    if (c.fits_bound) makespan_s = std::max(makespan_s, capped_s);

    // Exposed sync: at least the mean of sync_s − B_s; the all-reduce is affine in bytes, so Σ_s sync_s
    // is S·sync(0) plus the sync of all gradients less its latency part.
    double exposed_s = 0.0;
    if (c.d > 1 && c.zero < 3) {
        const double fixed_s = allreduce_s(lay, 0.0);
        const double sync_total = S * fixed_s + allreduce_s(lay, total_params_ * space_.bytes_per_param.grad_bytes) -
                                  fixed_s;
        // Without overlap, the rank that syncs most syncs at least the average over ranks.
        // With overlap, Σ_s B_s is at most the profiled backward plus every stage's host costs (each cut's
        // messages counted on both sides).
        double messages = 0.0;
        for (int cut = 1; cut < L_; ++cut) messages += cut_tensors(cut);
        const double most_backward_s =
            backward_s + S * hw_.host.stage_backward_s + 2.0 * hw_.host.message_s * messages;
        exposed_s = hw_.host.sync_overlaps_backward ? std::max(0.0, (sync_total - most_backward_s) / S)
                                                    : sync_total / c.p;
    }
    // Optimizer (affine in state, elements and tensors): the rank with the most work does at least the average
    // and at least any single block's.
    const double optimizer_s = std::max(
        this->optimizer_s(state / c.p, total_params_ / shard / c.p, total_tensors_ / c.p), sums.optimizer_s);
    const double rest_s = exposed_s + optimizer_s + hw_.host.step_s;
    c.bound_makespan_s = makespan_s;
    c.bound_rest_s = rest_s;
    c.bound_time_s = (makespan_s + rest_s) * (1.0 - 1e-9);  // summation order differs
    c.bound_objective = objective_of(space_, hw_, c.d * c.p, c.bound_time_s);
}

// The line through the neighbouring points of `values` (at `sizes`, K >= 2 ascending) at b, extended along the
// end segments, at least 0.
double piecewise_at(const std::vector<double>& sizes, const double* values, double b) {
    const std::size_t K = sizes.size();
    std::size_t k = 1;
    while (k < K - 1 && b > sizes[k]) ++k;
    const double t = values[k - 1] + (values[k] - values[k - 1]) * (b - sizes[k - 1]) / (sizes[k] - sizes[k - 1]);
    return std::max(t, 0.0);
}

// f_i (forward) or g_i (backward) at the configuration's b, with ZeRO-3's collectives (step 1).
double Searcher::block_time_s(const Config& c, const Layout& lay, int i, bool forward) const {
    const BytesPerParam& bpp = space_.bytes_per_param;
    const std::size_t K = chain_.time_sizes.size();
    double t = 0.0;
    if (K >= 2) {
        const std::vector<double>& points = forward ? chain_.fwd_points_s : chain_.bwd_points_s;
        t = piecewise_at(chain_.time_sizes, points.data() + static_cast<std::size_t>(i) * K, c.b);
    } else {
        t = forward ? chain_.fwd_alpha_s[i] * c.b + chain_.fwd_beta_s[i]
                    : chain_.bwd_alpha_s[i] * c.b + chain_.bwd_beta_s[i];
    }
    if (c.zero == 3) {
        const double gather = space_.zero3_gather_bytes > 0.0 ? space_.zero3_gather_bytes : bpp.param_bytes;
        const double reduce = space_.zero3_reduce_bytes > 0.0 ? space_.zero3_reduce_bytes : bpp.grad_bytes;
        t += allreduce_s(lay, chain_.params[i] * gather) / 2;  // all-gather the weights
        if (!forward) t += allreduce_s(lay, chain_.params[i] * reduce) / 2;  // reduce-scatter grads
    }
    return t;
}

Chain Searcher::chain_at(const Config& c, const Layout& lay) const {
    Chain out;
    const BytesPerParam& bpp = space_.bytes_per_param;
    for (int i = 0; i < L_; ++i) {
        out.fwd_time_s.push_back(block_time_s(c, lay, i, true));
        out.bwd_time_s.push_back(block_time_s(c, lay, i, false));
        out.act_bytes.push_back(chain_.act_per_sample_bytes[i] * c.b + chain_.act_fixed_bytes[i]);
        const ModelStateBytes state = zero_model_state_bytes(chain_.params[i], c.d, c.zero, bpp);
        out.state_bytes.push_back(state.total_bytes());
        out.grad_bytes.push_back(std::min(state.grad_bytes, out.state_bytes.back()));
    }
    for (int cut = 0; cut <= L_; ++cut) {
        out.cut_bytes.push_back(chain_.cut_per_sample_bytes[cut] * c.b + chain_.cut_fixed_bytes[cut]);
    }
    return out;
}

// chain_at, shared by the candidates with the same b, ZeRO stage, d (when sharded) and dp layout (ZeRO-3).
const Chain& Searcher::chain_for(const Config& c, const Layout& lay) {
    const std::vector<long long> key = {c.b, c.zero, c.zero > 0 ? c.d : 0, c.zero == 3 ? lay.dp_gpus_per_node : 0,
                                        c.zero == 3 ? lay.dp_nodes : 0};
    auto it = chains_.find(key);
    if (it == chains_.end()) it = chains_.emplace(key, chain_at(c, lay)).first;
    return it->second;
}

const PartitionResult& Searcher::partition_for(const Config& c, const Layout& lay, const Chain& chain) {
    // ZeRO 0-2 share the chain's times and differ in state bytes only, less with a higher stage. The optimum
    // under the loosest allowed stage is also optimal under a tighter one whenever it fits there (its
    // feasible set is a subset), so it is tried first.
    if (c.d > 1 && c.zero < 3) {
        int loosest = c.zero;
        for (int z : space_.zero_stages)
            if (z < 3) loosest = std::max(loosest, z);
        if (loosest > c.zero) {
            Config looser = c;
            looser.zero = loosest;
            const PartitionResult& found = cached_partition(looser, lay, chain_for(looser, lay));
            if (found.feasible && stages_fit(c, chain, found.cuts)) return found;
        }
    }
    return cached_partition(c, lay, chain);
}

// Every stage of `cuts` within gpu_mem_bytes with the partition's in-flight counts (partition.h's mem_s).
bool Searcher::stages_fit(const Config& c, const Chain& chain, const std::vector<int>& cuts) {
    const int S = c.p * c.v;
    const std::vector<int>& in_flight = in_flight_of(c);
    const HeldCuts& held = held_cuts_of(c);
    const std::vector<bool> fresh = fresh_of(c);
    for (int s = 0; s < S; ++s) {
        double state = 0.0, act = 0.0, grads = 0.0;
        for (int i = cuts[s]; i < cuts[s + 1]; ++i) {
            state += chain.state_bytes[i];
            act += chain.act_bytes[i];
            grads += grad_of(chain, i);
        }
        const double unmade = fresh[s] ? unmade_grad_bytes(grads, in_flight[s], act) : 0.0;
        const double need = (state + in_flight[s] * (act + chain.cut_bytes[cuts[s]]) - unmade) +
                            (held.inputs[s] * chain.cut_bytes[cuts[s]] +
                             held.outputs[s] * chain.cut_bytes[cuts[s + 1]]);
        if (need > hw_.gpu_mem_bytes) return false;
    }
    return true;
}

const PartitionResult& Searcher::cached_partition(const Config& c, const Layout& lay, const Chain& chain) {
    // Everything the partition depends on: the chain (b; the ZeRO stage and d through state bytes and
    // ZeRO-3 times; the dp layout through ZeRO-3 times), m, the link and the in-flight counts (whose number
    // is the stage count).
    const bool sharded = c.zero > 0;
    const std::vector<int>& in_flight = in_flight_of(c);
    std::vector<long long> key = {c.b,
                                  c.m,
                                  c.zero,
                                  sharded ? c.d : 0,
                                  c.zero == 3 ? lay.dp_gpus_per_node : 0,
                                  c.zero == 3 ? lay.dp_nodes : 0,
                                  c.p > 1 && lay.pipeline_inter};
    key.insert(key.end(), in_flight.begin(), in_flight.end());
    const HeldCuts& held = held_cuts_of(c);
    key.insert(key.end(), held.inputs.begin(), held.inputs.end());
    key.insert(key.end(), held.outputs.begin(), held.outputs.end());
    const std::vector<bool> fresh = fresh_of(c);
    key.insert(key.end(), fresh.begin(), fresh.end());
    auto it = partitions_.find(key);
    if (it != partitions_.end()) return it->second;
    PartitionOptions options;
    options.num_stages = c.p * c.v;
    options.num_microbatches = c.m;
    options.in_flight_per_stage = in_flight;
    options.input_buffer_cuts = held.inputs;
    options.output_buffer_cuts = held.outputs;
    options.fresh_grads = fresh;
    options.mem_limit_bytes.assign(options.num_stages, hw_.gpu_mem_bytes);
    options.link = lay.pipeline_inter ? hw_.inter : hw_.intra;
    options.fixed_cuts = space_.fixed_cuts;
    ++result_.num_partitions;
    return partitions_.emplace(key, partition(chain, options)).first->second;
}

const RankOrder& Searcher::order_for(Schedule schedule, int p, int m, int v) {
    const auto key = std::make_tuple(static_cast<int>(schedule), p, m, v);
    auto it = orders_.find(key);
    if (it == orders_.end()) it = orders_.emplace(key, schedule_order(schedule, p, m, v)).first;
    return it->second;
}

// n_s of step 3: GPipe m and 1F1B min(m, p−s) (partition.h's rules); with several stages per rank the peak
// simulate() reports. It depends only on the order: the F and B of a stage run on one rank, one at a
// time, so walking each rank's order and counting, as simulate() counts its events in rank order, gives
// it without timing anything.
const std::vector<int>& Searcher::in_flight_of(const Config& c) {
    const auto key = std::make_tuple(static_cast<int>(c.schedule), c.p, c.m, c.v);
    auto it = in_flight_.find(key);
    if (it != in_flight_.end()) return it->second;
    const int S = c.p * c.v;
    std::vector<int> in_flight(S, 0);
    if (c.v == 1) {
        const InFlight rule = c.schedule == Schedule::OneFOneB ? InFlight::kOneFOneB : InFlight::kGPipe;
        for (int s = 0; s < S; ++s) in_flight[s] = in_flight_microbatches(rule, s, S, c.m);
    } else {
        std::vector<int> now(S, 0);
        // A fresh order, not order_for's cached one: only the plans simulated keep theirs (a cache of every
        // candidate's order grew with the GPUs and blocks: 1.6 GB for 1,000 blocks on 1,024 GPUs).
        const RankOrder order = schedule_order(c.schedule, c.p, c.m, c.v);
        peaks_.emplace(key, in_flight_peaks(order, stage_placement(c.schedule, c.p, c.v)));
        for (const std::vector<Action>& rank : order) {
            for (const Action& a : rank) {
                if (a.op == Op::Forward) {
                    in_flight[a.stage] = std::max(in_flight[a.stage], ++now[a.stage]);
                } else if (a.op != Op::BackwardInput) {
                    --now[a.stage];
                }
            }
        }
    }
    return in_flight_.emplace(key, std::move(in_flight)).first->second;
}

// With several stages per rank, the count vectors at which each rank's activations may peak (simulate.h).
const InFlightPeaks& Searcher::peaks_of(const Config& c) {
    in_flight_of(c);
    return peaks_.at(std::make_tuple(static_cast<int>(c.schedule), c.p, c.m, c.v));
}

// Step 3's fresh gradients: with fresh_gradients, one replica (d = 1, ZeRO 0) and one stage per rank, some stage may
// run every forward before its first backward.
bool Searcher::may_be_fresh(const Config& c) const {
    return space_.fresh_gradients && c.d == 1 && c.v == 1;
}

// Per stage, whether it makes its gradients after its peak: every micro-batch in flight at once (n_s = m).
std::vector<bool> Searcher::fresh_of(const Config& c) {
    const std::vector<int>& in_flight = in_flight_of(c);
    std::vector<bool> fresh(in_flight.size(), false);
    if (!may_be_fresh(c)) return fresh;
    for (std::size_t s = 0; s < fresh.size(); ++s) fresh[s] = in_flight[s] == c.m;
    return fresh;
}

// Step 9 of search.h, from the runtime's receive buffers under the schedule (simulate.h's receive_buffers): a stage
// that receives its input holds at least its n_s in-flight inputs in them (counted with the activations), and the
// rest here.
const HeldCuts& Searcher::held_cuts_of(const Config& c) {
    const auto key = std::make_tuple(static_cast<int>(c.schedule), c.p, c.m, c.v);
    auto it = held_cuts_.find(key);
    if (it != held_cuts_.end()) return it->second;
    const int S = c.p * c.v;
    const std::vector<int>& in_flight = in_flight_of(c);
    const ReceiveBuffers received = schedule_receive_buffers(c.schedule, c.p, c.m, c.v);
    HeldCuts held{std::vector<long long>(S, 0), std::vector<long long>(S, 0)};
    for (int s = 0; s < S; ++s) {
        const long long ahead = received.inputs[s] > 0 ? received.inputs[s] - in_flight[s] : 0;
        held.inputs[s] = held_input_cuts(c.m, in_flight[s], s) + ahead;
        const long long kept = warmup_send_held(c.schedule, c.m, S, s) ? 1 : 0;
        held.outputs[s] = s + 1 < S ? static_cast<long long>(received.gradients[s]) + kept : 0;
    }
    return held_cuts_.emplace(key, std::move(held)).first->second;
}

std::string describe(const Config& c) {
    // v is named where it is not the schedule's first (1, or 2 interleaved).
    std::string text = "dp=" + std::to_string(c.d) + ", pp=" + std::to_string(c.p) +
                       (c.v > 2 ? ", v=" + std::to_string(c.v) : std::string()) + ", b=" + std::to_string(c.b) +
                       ", m=" + std::to_string(c.m) + ", " + schedule_name(c.schedule) + ", ZeRO-" +
                       std::to_string(c.zero);
    if (c.d > 1 && c.p > 1) text += std::string(", ") + placement_name(c.placement);
    return text;
}

void Searcher::infeasible(const Config& c, double need_bytes, const std::string& where, bool exact) {
    double& least = exact ? least_need_bytes_ : least_bound_bytes_;
    if (need_bytes < least) {
        least = need_bytes;
        (exact ? least_need_text_ : least_bound_text_) =
            "the best candidate (" + describe(c) + ") needs " + (exact ? "" : "at least ") + format_bytes(need_bytes) +
            " on " + where + ", the GPU has " + format_bytes(hw_.gpu_mem_bytes);
    }
}

void Searcher::evaluate(const Config& c) {
    const Layout& lay = layout(c.d, c.p, c.v, c.placement);
    const Chain& chain = chain_for(c, lay);
    const PartitionResult& part = partition_for(c, lay, chain);
    if (!part.feasible) {
        ++result_.num_evaluated;
        // With several stages per rank the partition's stage limits are necessary, not sufficient (the rank holds
        // both): its overflow is a lower bound on the candidate's need, named only when no exact need is known.
        infeasible(c, part.overflow.need_bytes, "stage " + std::to_string(part.overflow.stage), c.v == 1);
        return;
    }
    const int S = c.p * c.v;
    const Link& link = lay.pipeline_inter ? hw_.inter : hw_.intra;

    Candidate cand;
    cand.dp = c.d;
    cand.pp = c.p;
    cand.stages_per_rank = c.v;
    cand.micro_batch_size = c.b;
    cand.num_microbatches = c.m;
    cand.schedule = c.schedule;
    cand.zero_stage = c.zero;
    cand.placement = c.placement;
    cand.pipeline_inter = c.p > 1 && lay.pipeline_inter;
    cand.dp_gpus_per_node = lay.dp_gpus_per_node;
    cand.dp_nodes = lay.dp_nodes;
    cand.cuts = part.cuts;
    cand.stage_rank = stage_placement(c.schedule, c.p, c.v);

    // Stage sums from this candidate's chain (the partition may be shared with a looser ZeRO stage).
    StageTimes times;
    std::vector<double> act_per_microbatch(S), saved_per_microbatch(S), stage_grads(S);
    std::vector<double> rank_state(c.p, 0.0), rank_work_s(c.p, 0.0), rank_elements(c.p, 0.0), rank_tensors(c.p, 0.0);
    std::vector<double> rank_sync_s(c.p, 0.0);
    auto send_s = [&](int cut) { return cut == 0 || cut == L_ ? 0.0 : p2p_time_s(link, chain.cut_bytes[cut]); };
    const HostCosts& host = hw_.host;
    const double shard = c.zero >= 1 ? c.d : 1;
    double before_s = 0.0, makespan_bound_s = 0.0;
    for (int s = 0; s < S; ++s) {
        double f = 0, g = 0, state = 0, act = 0, grads = 0, params = 0, tensors = 0;
        for (int i = part.cuts[s]; i < part.cuts[s + 1]; ++i) {
            f += chain.fwd_time_s[i];
            g += chain.bwd_time_s[i];
            state += chain.state_bytes[i];
            act += chain.act_bytes[i];
            grads += grad_of(chain, i);
            params += chain_.params[i];
            tensors += tensors_of(i);
        }
        saved_per_microbatch[s] = act;
        stage_grads[s] = grads;
        // 8. Host costs of the stage per micro-batch: its own bookkeeping and the messages it receives and sends.
        const double messages_s = host.message_s * (cut_tensors(part.cuts[s]) + cut_tensors(part.cuts[s + 1]));
        f += host.stage_forward_s + messages_s;
        g += host.stage_backward_s + messages_s;
        act += chain.cut_bytes[part.cuts[s]];  // summed as partition.h's mem_s
        times.forward_s.push_back(f);
        times.backward_s.push_back(g);
        if (s + 1 < S) times.send_forward_s.push_back(send_s(part.cuts[s + 1]));
        cand.stage_time_s.push_back(f + g + send_s(part.cuts[s]) + send_s(part.cuts[s + 1]));
        cand.stage_state_bytes.push_back(state);
        act_per_microbatch[s] = act;
        // 5. Gradient sync of the stage, overlapped with its last backward.
        const bool syncs = c.d > 1 && c.zero < 3;
        const double sync_s = syncs ? allreduce_s(lay, params * space_.bytes_per_param.grad_bytes) : 0.0;
        cand.stage_sync_s.push_back(sync_s);
        if (host.sync_overlaps_backward) cand.exposed_sync_s = std::max(cand.exposed_sync_s, sync_s - g);
        rank_sync_s[cand.stage_rank[s]] += sync_s;
        rank_elements[cand.stage_rank[s]] += params / shard;
        rank_tensors[cand.stage_rank[s]] += tensors;
        rank_state[cand.stage_rank[s]] += state;
        rank_work_s[cand.stage_rank[s]] += c.m * (f + g);
        makespan_bound_s = std::max(makespan_bound_s, before_s + c.m * (f + g));  // see least_pipeline_makespan_s
        before_s += f + g + (s + 1 < S ? 2 * send_s(part.cuts[s + 1]) : 0.0);
    }
    times.backward_weight_s.assign(S, 0.0);
    times.send_backward_s = times.send_forward_s;
    // 6. Optimizer step of the rank with the most state.
    for (int r = 0; r < c.p; ++r) {
        cand.optimizer_s = std::max(cand.optimizer_s, optimizer_s(rank_state[r], rank_elements[r], rank_tensors[r]));
        if (!host.sync_overlaps_backward) cand.exposed_sync_s = std::max(cand.exposed_sync_s, rank_sync_s[r]);
    }
    cand.host_step_s = host.step_s;
    // The makespan is at least each stage's bound and each rank's work: skip the simulation when that
    // already cannot make the top-k or the frontier.
    makespan_bound_s = std::max(makespan_bound_s, *std::max_element(rank_work_s.begin(), rank_work_s.end()));
    const double rest_s = cand.exposed_sync_s + cand.optimizer_s + cand.host_step_s;
    if (prunable(c.d * c.p, c.v, (makespan_bound_s + rest_s) * (1.0 - 1e-9))) return;

    // 4. The simulated makespan; activation memory with the in-flight micro-batches.
    ++result_.num_evaluated;
    const Simulation sim = simulate(order_for(c.schedule, c.p, c.m, c.v), cand.stage_rank, times, c.m);
    cand.stage_forward_s = times.forward_s;
    cand.stage_backward_s = times.backward_s;
    cand.rank_memory_bytes = rank_state;
    const std::vector<int>& in_flight = in_flight_of(c);
    const HeldCuts& held = held_cuts_of(c);
    const std::vector<bool> fresh = fresh_of(c);
    // 3. The micro-batches of each stage in flight at its rank's peak: its own peak with one stage per rank; with
    // several, the count vector of the rank's peaks (simulate.h's in_flight_peaks) with the most activations.
    std::vector<int> at_peak = in_flight;
    if (c.v > 1) {
        const InFlightPeaks& peaks = peaks_of(c);
        for (int r = 0; r < c.p; ++r) {
            std::vector<int> mine;
            std::vector<double> bytes;
            for (int s = 0; s < S; ++s)
                if (cand.stage_rank[s] == r) {
                    mine.push_back(s);
                    bytes.push_back(act_per_microbatch[s]);
                }
            const std::vector<int>& most = peaks[r][heaviest_peak(peaks[r], bytes)];
            for (std::size_t j = 0; j < mine.size(); ++j) at_peak[mine[j]] = most[j];
        }
    }
    for (int s = 0; s < S; ++s) {
        const int n = in_flight[s];  // the partition's, as the simulation finds them
        cand.stage_in_flight.push_back(n);
        cand.stage_act_bytes.push_back(at_peak[s] * act_per_microbatch[s]);
        // 3. Gradients not yet made at the peak of a stage that makes them after it (fresh_gradients).
        cand.stage_unmade_grad_bytes.push_back(
            fresh[s] ? unmade_grad_bytes(stage_grads[s], n, saved_per_microbatch[s]) : 0.0);
        // 9. Receive buffers beyond the n in flight and output gradients, as the schedule holds them; the first
        // stage's batch; the last input gradient; 1F1B's last warm-up send (held_cuts_of).
        const double input_cut = chain.cut_bytes[part.cuts[s]], output_cut = chain.cut_bytes[part.cuts[s + 1]];
        cand.stage_buffer_bytes.push_back(held.inputs[s] * input_cut + held.outputs[s] * output_cut);
        // Added one at a time, as the partition sums a stage's need: (state + activations − unmade) + buffers.
        cand.rank_memory_bytes[cand.stage_rank[s]] += cand.stage_act_bytes[s];
        cand.rank_memory_bytes[cand.stage_rank[s]] -= cand.stage_unmade_grad_bytes[s];
        cand.rank_memory_bytes[cand.stage_rank[s]] += cand.stage_buffer_bytes[s];
    }
    const auto fullest = std::max_element(cand.rank_memory_bytes.begin(), cand.rank_memory_bytes.end());
    cand.peak_memory_bytes = *fullest;
    // One stage per rank: the partition has checked it, with the same sums.
    if (c.v > 1 && cand.peak_memory_bytes > hw_.gpu_mem_bytes) {
        const int r = static_cast<int>(fullest - cand.rank_memory_bytes.begin());
        std::string stages;
        for (int s = 0; s < S; ++s)
            if (cand.stage_rank[s] == r) stages += (stages.empty() ? "" : " and ") + std::to_string(s);
        infeasible(c, cand.peak_memory_bytes, "rank " + std::to_string(r) + " (stages " + stages + ")");
        return;
    }

    // 7. Totals.
    cand.makespan_s = sim.makespan_s;
    double idle_s = 0.0;
    for (double idle : sim.idle_s) idle_s += idle;
    cand.bubble_fraction = sim.makespan_s > 0 ? idle_s / (c.p * sim.makespan_s) : 0.0;
    cand.iteration_s = cand.makespan_s + rest_s;
    cand.cost_per_iteration = c.d * c.p * hw_.price_per_gpu_s * cand.iteration_s;
    cand.samples_per_s = cand.iteration_s > 0 ? space_.global_batch / cand.iteration_s : 0.0;
    cand.objective = objective_of(space_, hw_, c.d * c.p, cand.iteration_s);
    ++result_.num_feasible;
    offer(std::move(cand), c.index);
}

// The tie-break order: objective, then fewer GPUs, then less memory, then enumeration order.
bool better(const std::pair<Candidate, long long>& a, const std::pair<Candidate, long long>& b) {
    return std::make_tuple(a.first.objective, a.first.num_gpus(), a.first.peak_memory_bytes, a.second) <
           std::make_tuple(b.first.objective, b.first.num_gpus(), b.first.peak_memory_bytes, b.second);
}

// Ties on (T, C) go to fewer GPUs, then less memory, then enumeration order (objective is equal then).
bool preferred(const std::pair<Candidate, long long>& a, const std::pair<Candidate, long long>& b) {
    return std::make_tuple(a.first.num_gpus(), a.first.peak_memory_bytes, a.second) <
           std::make_tuple(b.first.num_gpus(), b.first.peak_memory_bytes, b.second);
}

// a is at least as good in time and cost as b, and strictly better in one, or equal and preferred.
bool dominates(const std::pair<Candidate, long long>& a, const std::pair<Candidate, long long>& b) {
    const double ta = a.first.iteration_s, ca = a.first.cost_per_iteration;
    const double tb = b.first.iteration_s, cb = b.first.cost_per_iteration;
    if (ta <= tb && ca <= cb && (ta < tb || ca < cb)) return true;
    return ta == tb && ca == cb && preferred(a, b);
}

// A plan of `num_gpus` GPUs no faster than `bound_time_s` can join neither the top-k (its objective is
// worse than the k-th) nor the frontier (a point found beats it in time or cost and ties the other).
bool Searcher::prunable(int num_gpus, int v, double bound_time_s) const {
    if (!beaten(top_, pareto_, num_gpus, bound_time_s)) return false;
    return !(space_.two_chunks_apart && v <= 2) || beaten(top_two_, pareto_two_, num_gpus, bound_time_s);
}

bool Searcher::beaten(const Ranked& top, const Ranked& pareto, int num_gpus, double bound_time_s) const {
    const double objective = objective_of(space_, hw_, num_gpus, bound_time_s);
    if (static_cast<int>(top.size()) < space_.top_k || !(objective > top.back().first.objective)) return false;
    const double cost = num_gpus * hw_.price_per_gpu_s * bound_time_s;
    for (const auto& entry : pareto) {
        const double tp = entry.first.iteration_s, cp = entry.first.cost_per_iteration;
        if (tp <= bound_time_s && cp <= cost && (tp < bound_time_s || cp < cost)) return true;
    }
    return false;
}

void Searcher::offer(Candidate candidate, long long index) {
    if (space_.two_chunks_apart && candidate.stages_per_rank <= 2) offer_to(top_two_, pareto_two_, {candidate, index});
    offer_to(top_, pareto_, {std::move(candidate), index});
}

void Searcher::offer_to(Ranked& top, Ranked& pareto, std::pair<Candidate, long long> entry) const {
    const bool joins_top = static_cast<int>(top.size()) < space_.top_k || better(entry, top.back());
    bool joins_pareto = true;
    for (const auto& other : pareto) {
        if (dominates(other, entry)) {
            joins_pareto = false;
            break;
        }
    }
    if (joins_pareto) {
        pareto.erase(std::remove_if(pareto.begin(), pareto.end(),
                                    [&](const std::pair<Candidate, long long>& other) {
                                        return dominates(entry, other);
                                    }),
                     pareto.end());
        const auto at = std::upper_bound(pareto.begin(), pareto.end(), entry, [](const auto& a, const auto& b) {
            return a.first.iteration_s < b.first.iteration_s;
        });
        pareto.insert(at, entry);
    }
    if (joins_top) {
        top.insert(std::upper_bound(top.begin(), top.end(), entry, better), std::move(entry));
        if (static_cast<int>(top.size()) > space_.top_k) top.pop_back();
    }
}

SearchResult Searcher::run() {
    std::vector<Config> configs = enumerate();
    result_.num_candidates = static_cast<long long>(configs.size());
    for (Config& c : configs) bound(c);
    // Best first by bound, refining lazily: a candidate popped with its cheap bound gets the next bound
    // (with several stages per rank first its exact caps, then the partition bound) and goes back in; popped
    // with every bound, it is evaluated unless it can be skipped by then.
    auto later = [&](std::size_t a, std::size_t b) {
        const Config &x = configs[a], &y = configs[b];
        return std::make_tuple(x.bound_objective, x.d * x.p, x.index) >
               std::make_tuple(y.bound_objective, y.d * y.p, y.index);
    };
    std::priority_queue<std::size_t, std::vector<std::size_t>, decltype(later)> queue(later);
    std::vector<int> refined(configs.size(), 0);  // 0: bound(), 1: cap_exactly(), 2: tighten()
    std::vector<const Config*> cannot_fit;
    for (std::size_t k = 0; k < configs.size(); ++k) {
        if (configs[k].fits_bound) queue.push(k); else cannot_fit.push_back(&configs[k]);
    }
    while (!queue.empty()) {
        const std::size_t k = queue.top();
        queue.pop();
        Config& c = configs[k];
        if (prunable(c.d * c.p, c.v, c.bound_time_s)) continue;
        if (refined[k] < 2) {
            if (refined[k] == 0 && c.v > 1) {
                cap_exactly(c);
                refined[k] = 1;
            } else {
                tighten(c);
                refined[k] = 2;
            }
            if (c.fits_bound) queue.push(k); else cannot_fit.push_back(&c);
            continue;
        }
        evaluate(c);
    }
    // Those that cannot fit matter only to name the least memory needed when nothing fits.
    if (top_.empty()) {
        std::sort(cannot_fit.begin(), cannot_fit.end(), [](const Config* a, const Config* b) {
            return std::make_tuple(a->need_bound_bytes, a->index) < std::make_tuple(b->need_bound_bytes, b->index);
        });
        for (const Config* c : cannot_fit) {
            if (c->need_bound_bytes >= least_need_bytes_) break;
            evaluate(*c);
        }
    }
    result_.num_pruned = result_.num_candidates - result_.num_evaluated;
    if (top_.empty()) {
        result_.feasible = false;
        if (least_need_bytes_ == kInf) {
            least_need_bytes_ = least_bound_bytes_;
            least_need_text_ = least_bound_text_;
        }
        result_.least_need_bytes = least_need_bytes_ < kInf ? least_need_bytes_ : 0.0;
        result_.reason = least_need_bytes_ < kInf
                             ? "no plan fits: " + least_need_text_
                             : "no plan: torch builds none of the allowed schedules for any d, p, b, m, or the "
                               "chain has fewer blocks than the stages";
        if (too_long_ > 0) {
            result_.reason += " (" + std::to_string(too_long_) + " candidates with more than " +
                              std::to_string(kMaxStageMicrobatches) +
                              " stages x micro-batches left out: allow larger micro-batches)";
        }
        return result_;
    }
    result_.feasible = true;
    for (auto& entry : top_) result_.top.push_back(entry.first);
    result_.best = result_.top.front();
    for (auto& entry : pareto_) result_.pareto.push_back(entry.first);
    for (auto& entry : top_two_) result_.top_two_chunks.push_back(entry.first);
    for (auto& entry : pareto_two_) result_.pareto_two_chunks.push_back(entry.first);
    return result_;
}

}  // namespace

Objective objective_from_name(const std::string& name) {
    if (name == "time") return Objective::kTime;
    if (name == "cost") return Objective::kCost;
    if (name == "weighted") return Objective::kWeighted;
    fail("the objective must be 'time', 'cost' or 'weighted', got '" + name + "'");
}

Placement placement_from_name(const std::string& name) {
    if (name == "pp-inner") return Placement::kPipelineInner;
    if (name == "dp-inner") return Placement::kDataInner;
    fail("the placement must be 'pp-inner' or 'dp-inner', got '" + name + "'");
}

const char* placement_name(Placement placement) {
    return placement == Placement::kPipelineInner ? "pp-inner" : "dp-inner";
}

SearchResult search(const ProfiledChain& chain, const Hardware& hardware, const SearchSpace& space) {
    validate(chain, hardware, space);
    return Searcher(chain, hardware, space).run();
}

}  // namespace pyplan
