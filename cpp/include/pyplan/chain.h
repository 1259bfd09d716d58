// pyplan/chain.h — the chain of blocks the solvers consume: a linearized, profiled model.
#pragma once

#include <vector>

namespace pyplan {

// A chain of L blocks and its L+1 cuts. Block i runs between cut i and cut i+1; cut 0 is the model input,
// cut L its output. A pipeline stage is a range of blocks [begin, end), i.e. the cuts begin..end.
// Times are per micro-batch, already evaluated at the micro-batch size. Bytes are doubles (exact for
// integers below 2^53, and sharded state may be fractional).
struct Chain {
    std::vector<double> fwd_time_s;   // [L] forward time of block i
    std::vector<double> bwd_time_s;   // [L] backward time of block i
    std::vector<double> act_bytes;    // [L] bytes block i saves for backward, per micro-batch
    std::vector<double> state_bytes;  // [L] weights + gradients + optimizer state of block i, after ZeRO sharding
    std::vector<double> cut_bytes;    // [L+1] bytes of every tensor live across cut c, per micro-batch
    // [L] of state_bytes, block i's parameter gradients (each at most state_bytes[i]); empty: none. What a stage that
    // makes its gradients again after its activations peak may leave out (partition.h's fresh_grads).
    std::vector<double> grad_bytes;

    int num_blocks() const { return static_cast<int>(fwd_time_s.size()); }
};

}  // namespace pyplan
