// pyplan/limits.h — the ranges of the numbers the solvers accept, and the most any of them builds.
//
// Every public function checks its arguments against these before any arithmetic and throws
// std::invalid_argument with one line naming the argument, its value and the range. Within them no sum,
// product or quotient a solver forms leaves double's finite range, no count leaves int, and no table
// outgrows memory: so a result is never NaN or ∞, and no input makes undefined behaviour.
//
// Two levels. What is measured or configured (a block's time, a tensor's bytes, a link, a price) enters
// through search() and the remat solver, bounded far beyond any real training job. The other solvers
// (partition, simulate, the cost formulas) also take values that search() derives from those, products of
// a few inputs (a time per sample times a batch of up to 2^31 samples, ZeRO-3's gathered bytes over a slow
// link: below about 1e70); they accept anything up to kMaxValue, so that their own sums over at most 2^31
// blocks, ranks or micro-batches stay below about 1e130, far from DBL_MAX (1.8e308).
#pragma once

namespace pyplan {

// A measured time in seconds (a block's forward or backward, per sample or per micro-batch; a latency; a
// host cost): about 32 years.
inline constexpr double kMaxSeconds = 1e9;

// A measured size in bytes (activations, state, cuts, a memory budget or limit; bytes per parameter), or a
// count (parameter elements, tensors, samples): an exabyte. Memory limits may also be +∞ (no limit).
inline constexpr double kMaxBytes = 1e18;

// A price per GPU-second, and the weight w of the objective C + w·T (also money per second).
inline constexpr double kMaxPricePerS = 1e9;

// The least bandwidth, bytes per second; +∞ is accepted where stated (a link that costs only its latency).
// A bandwidth that low (a kilobyte in 1e6 s) is no link; a lower one would let bytes/bandwidth overflow.
inline constexpr double kMinBwBytesPerS = 1e-3;

// Any time or size the partition, the simulation and the cost formulas take (see above).
inline constexpr double kMaxValue = 1e100;

// GPUs in one search: more than any cluster (the largest hold ~1e5); the search loops over d ≤ N.
inline constexpr int kMaxGpus = 1 << 20;

// Stages × micro-batches of one schedule order. An order and its simulation take about 250 bytes per
// (stage, micro-batch) pair, so one stays under ~256 MB; torch's pipelines run a few hundred stages over a
// few thousand micro-batches at most (2^19). The search leaves out candidates beyond it.
inline constexpr int kMaxStageMicrobatches = 1 << 20;

}  // namespace pyplan
