// pyplan/check.h — argument checks shared by the solvers, against the ranges of limits.h.
//
// Each throws std::invalid_argument with one line naming the argument, its value and the accepted range
// ("fwd_time_s[3] must be in [0, 1e+09], got 1e+308"); NaN is in no range. The message is built only on
// failure: the cost formulas check their arguments on the search's hot paths.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pyplan {

// "%.6g": "1e+308", "0.001", "inf", "nan".
std::string format_number(double value);

[[noreturn]] void fail_range(const std::string& name, const std::string& range, const std::string& got);

// lo ≤ value ≤ hi (either end may be ±∞).
inline void require_in(double value, double lo, double hi, const char* name) {
    if (!(value >= lo && value <= hi)) {
        fail_range(name, "[" + format_number(lo) + ", " + format_number(hi) + "]", format_number(value));
    }
}

inline void require_int_in(long long value, long long lo, long long hi, const char* name) {
    if (value < lo || value > hi) {
        fail_range(name, "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]", std::to_string(value));
    }
}

// Every entry in [lo, hi]; the message names the entry: "name[i]".
void require_each_in(const std::vector<double>& values, double lo, double hi, const char* name);

// A bandwidth: in [kMinBwBytesPerS, +∞] (∞: the transfer is free).
void require_bandwidth(double bw_bytes_per_s, const char* name);

// `size` entries (one per block, per cut, ...): "name has 3 entries, expected 4 (one per cut)".
void require_size(std::size_t size, std::size_t expected, const char* name, const char* per);

}  // namespace pyplan
