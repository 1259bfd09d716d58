// Pipeline schedules as per-rank action orders, and their event simulation.
//
// Vocabulary (torch.distributed.pipelining's): a *stage* is a contiguous piece of the model; a *rank* is
// one GPU of the pipeline group and holds one stage (GPipe, 1F1B) or several (interleaved, V-shaped);
// an *action* is one computation of one stage on one micro-batch:
//   F  forward
//   B  full backward (input gradient and weight gradient together)
//   I  backward for the input gradient only (zero-bubble schedules)
//   W  backward for the weight gradient only; I + W does the work of B
// Every (stage, micro-batch) has exactly one F, and either one B or one I and one W.
//
// schedule_order builds, for each rank, the order in which torch 2.13's schedule class of the same name
// executes its compute actions (its `pipeline_order` with the idle slots dropped; for GPipe and 1F1B the
// order that their `_step_microbatches` runs). It rejects exactly the configurations torch rejects.
//
// simulate executes a per-rank order. The model:
//   - a rank runs its actions one at a time, in its order; an action starts as soon as the rank is free
//     and its dependencies have arrived, and runs for its stage's F, B, I or W time;
//   - F(s, k) needs F(s-1, k) plus the forward send time of boundary s-1 (the activation);
//   - B(s, k) and I(s, k) need F(s, k), and B or I of (s+1, k) plus the backward send time of
//     boundary s (the gradient); the last stage's needs only its own F (the loss);
//   - W(s, k) needs I(s, k);
//   - sends overlap with computation and never contend: a send costs the receiver latency, not rank time;
//     two stages on the same rank (the tip of a V) pass tensors for free.
// Because each action's start depends only on the previous action of its rank and on its dependencies,
// the start times are unique; the simulation evaluates them in dependency order, waking a rank when the
// action it waits on ends. An order in which some rank waits forever is reported as a deadlock.
// A micro-batch is *in flight* on a stage from the end of its F to the end of its last backward action
// (B, or W under the I/W split, since W still reads saved activations); activation memory scales with it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pyplan {

// What an action computes; the letters are torch's _ComputationType values.
enum class Op { Forward, Backward, BackwardInput, BackwardWeight };

struct Action {
    int stage;
    Op op;
    int microbatch;
};

// Per rank, the actions in execution order: order[rank][i].
using RankOrder = std::vector<std::vector<Action>>;

// The schedules of torch.distributed.pipelining (torch 2.13), by their class names less "Schedule".
enum class Schedule {
    GPipe,                  // one stage per rank: every F, then every B
    OneFOneB,               // one stage per rank: warm-up forwards, then alternate B and F, then drain
    Interleaved1F1B,        // v stages per rank, loop placement, depth first (Narayanan et al. 2021)
    LoopedBFS,              // v stages per rank, loop placement, breadth first (Lamy-Poirier 2023)
    InterleavedZeroBubble,  // interleaved 1F1B with backward split into I and W (ZB1P, Qi et al. 2024)
    ZBVZeroBubble,          // 2 stages per rank, V placement, I/W split (ZB-V, Qi et al. 2024, sec. 6)
    DualPipeV,              // 2 stages per rank, V placement, F and B paired (DeepSeek-V3 report)
};

// torch's class name less "Schedule" ("GPipe", "1F1B", "Interleaved1F1B", ...).
const char* schedule_name(Schedule schedule);

// The rank that holds each stage: [stage] -> rank, for num_ranks * stages_per_rank stages.
// Loop placement puts stage s on rank s mod p; V placement (ZBVZeroBubble, DualPipeV) puts
// stages {r, 2p-1-r} on rank r. Throws std::invalid_argument unless p, v ≥ 1 and p·v ≤ kMaxStageMicrobatches.
std::vector<int> stage_placement(Schedule schedule, int num_ranks, int stages_per_rank);

// Why torch 2.13 refuses to build `schedule` for this shape, in its terms; empty when it accepts it.
std::string torch_rejection(Schedule schedule, int num_ranks, int num_microbatches, int stages_per_rank);

// Whether `stage` keeps one output beyond its micro-batches in flight through its peak: Schedule1F1B waits for the
// send of each warm-up forward's output but the last one it fires, and keeps that send's Work (its tensor with it)
// until the steady phase ends. That outlives the micro-batch's backward when the stage sends (not the last)
// after w = min(m, stages − stage) ≥ 2 warm-ups and the steady phase reaches backward w − 1 (m ≥ 2w − 1).
// Measured on the zoo's 1x2 1F1B first stages: micro-batch 0's output live beside the in-flight ones during
// backward 1. Throws std::invalid_argument unless m ≥ 1, stages ≥ 1 and 0 ≤ stage < stages.
bool warmup_send_held(Schedule schedule, int num_microbatches, int num_stages, int stage);

// The per-rank compute order of `schedule`; throws std::invalid_argument with torch_rejection's reason
// for a shape torch does not accept, and for p·v·m > kMaxStageMicrobatches (limits.h: the order's size).
RankOrder schedule_order(Schedule schedule, int num_ranks, int num_microbatches, int stages_per_rank);

// ---- sends, receives and the receive buffers they hold -------------------------------------------------
//
// A lowered order adds to each rank's compute the messages between its stages and the others' (torch's
// SEND_F, RECV_F, SEND_B, RECV_B actions): a step sends or receives stage action.stage's activation
// (action.op Forward) or gradient (action.op Backward) of micro-batch action.microbatch; a receive names the
// receiving stage. Two stages on one rank pass their tensors without a message (torch's V-schedule case).
//
// Where the receives go. GPipe and 1F1B (torch's PipelineScheduleSingle) post each receive just before the
// action that reads it. The multi-stage schedules run an order lowered by torch's _add_send_recv (torch 2.13,
// distributed/pipelining/schedules.py), which pyplan's runtime hands to torch's _PipelineScheduleRuntime in
// place of the one torch lowers from its idle-padded pipeline_order: rounds over the ranks in increasing order;
// in a round each rank takes the next action of its order if it is ready (F(s, k) once RECV_F(s, k) is in its
// list or it ran F(s−1, k) itself, B or I(s, k) once RECV_B(s, k) is or it ran B or I of (s+1, k), anything
// else at once), appends it, and, when the neighbour stage is on another rank, appends the send to its own
// list and the matching receive to the neighbour's. Both ranks of a pair list their messages to each other in
// one order (the rounds'), the property torch's lowering gives its runtime; only the idle slots are left out.
//
// What the receive buffers hold. pyplan's runtime (pyplan/runtime/recv.py) allocates a buffer when its receive
// is posted and drops it once consumed:
//   - the input of (s, k) is received into a buffer that becomes the stage's input: alive from its receive to
//     the end of the last backward action of (s, k), B or W (both read it);
//   - the output gradient of (s, k), received or handed over by stage s+1 on the same rank at the end of its B
//     or I, is alive until the end of the last backward action of (s, k) too: torch keeps it for W in the state
//     its I leaves (stage 0's W runs the whole backward from it), and a W starts from the gradients its I saw
//     reach the weighted operations, the output gradient itself where such an operation makes the output.
// A stage whose previous stage is on its rank takes that stage's output as its input, not a receive buffer.
enum class Step { Compute, Send, Receive };

struct LoweredAction {
    Step step;
    Action action;
};

using LoweredOrder = std::vector<std::vector<LoweredAction>>;

// `order` (one of `schedule`'s shape, stages placed by stage_rank) with its sends and receives, as pyplan's
// runtime posts them. Throws std::invalid_argument for an order simulate() rejects (an action on the wrong
// rank, a missing or repeated action) and for one whose lowering stalls (a rank waits for a message no rank
// sends). Memory in proportion to the order; time to p × the rounds, which number about the longest rank's actions
// plus the stages (a gradient goes back one rank a round).
LoweredOrder lower_order(Schedule schedule, const RankOrder& order, const std::vector<int>& stage_rank);

// The most receive buffers each stage holds at once, by the lifetimes above, walking each rank's lowered order.
struct ReceiveBuffers {
    std::vector<int> inputs;     // [stage] input receive buffers, in flight ones included: at least the stage's
                                 // peak in flight where it receives its input, 0 where it does not (stage 0, or
                                 // its previous stage on its rank)
    std::vector<int> gradients;  // [stage] output gradients, received or handed over (0 on the last stage)
};

ReceiveBuffers receive_buffers(const LoweredOrder& order, const std::vector<int>& stage_rank);

// receive_buffers of schedule_order(schedule, p, m, v) lowered with stage_placement(schedule, p, v); throws as
// schedule_order does.
ReceiveBuffers schedule_receive_buffers(Schedule schedule, int num_ranks, int num_microbatches, int stages_per_rank);

// ---- micro-batches in flight on the stages of one rank -------------------------------------------------
//
// A rank that holds several stages (the chunks of an interleaved schedule) holds at time t the activations
// Σ_j n_j(t)·A_j over its stages j, n_j(t) stage j's micro-batches in flight (simulate's count: from the end of
// an F to the end of its B, or of its W) and A_j what each holds. The chunks' own peaks do not coincide: summing
// them counted Megatron-LM's 530B (p 35, v 3, m 280) at 70 + 69 + 35 micro-batches on rank 0, where it holds
// at most 139 at once. Only the rank's own actions change its counts, and it runs them one at a time, so its
// order walks the counts through time without timing anything. With every A_j ≥ 0 the sum rises over a run of
// forwards and does not rise until the next one, so its largest value over time, whatever the A_j, is at the end
// of some run of forwards; a count vector that another such vector equals or exceeds in every stage can never
// give more. in_flight_peaks keeps the rest: max_t Σ_j n_j(t)·A_j = max over peaks[r] of Σ_j peak[j]·A_j.
// The action running then is an F of a stage whose count the peak includes, or a B, I or W of one still in
// flight there (its count ≥ 1), so a stage with count 0 in every peak runs nothing at the rank's peak.
//
// [rank][k][j]: the k-th count vector of rank r (distinct, none equalled or exceeded in every stage by another,
// in increasing lexicographic order); j indexes the rank's stages in increasing stage order.
using InFlightPeaks = std::vector<std::vector<std::vector<int>>>;

// Throws std::invalid_argument for an order simulate() rejects (an action on the wrong rank, a missing or
// repeated action). Time and memory in proportion to the order, plus the pairs of distinct vectors compared.
InFlightPeaks in_flight_peaks(const RankOrder& order, const std::vector<int>& stage_rank);

// The index in `peaks` (one rank's) of the vector with the largest Σ_j peak[j]·bytes[j], the first on a tie;
// throws std::invalid_argument when `peaks` is empty or a vector's length is not bytes.size().
std::size_t heaviest_peak(const std::vector<std::vector<int>>& peaks, const std::vector<double>& bytes);

// Times of one micro-batch, in seconds. Stage vectors have one entry per stage; boundary vectors one per
// pair of consecutive stages (boundary s lies between stage s and s+1).
struct StageTimes {
    std::vector<double> forward_s;          // F of stage s
    std::vector<double> backward_s;         // B of stage s (full backward)
    std::vector<double> backward_weight_s;  // W of stage s; I takes backward_s - backward_weight_s
    std::vector<double> send_forward_s;     // activation from stage s to stage s+1
    std::vector<double> send_backward_s;    // gradient from stage s+1 to stage s
};

struct Event {
    int rank;
    Action action;
    double start_s;
    double end_s;
};

struct Simulation {
    double makespan_s = 0.0;          // end of the last action (the pipeline starts at 0)
    std::vector<double> busy_s;       // [rank] time spent computing
    std::vector<double> idle_s;       // [rank] makespan_s - busy_s
    std::vector<int> peak_in_flight;  // [stage] most micro-batches in flight at once
    std::vector<Event> events;        // every action, by start time, then rank
};

// Simulates `order` with stages placed on ranks by `stage_rank` ([stage] -> rank). The number of stages
// is the length of times.forward_s. Throws std::invalid_argument for inconsistent input (an action on
// the wrong rank, a missing or repeated action, fewer actions than stages × micro-batches, times outside
// [0, kMaxValue] or NaN) and for a deadlocked order. Memory is in proportion to the order's length.
Simulation simulate(const RankOrder& order, const std::vector<int>& stage_rank, const StageTimes& times,
                    int num_microbatches);

}  // namespace pyplan
