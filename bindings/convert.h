// Python ints for the bindings: taken as 64-bit and narrowed to int here, so that a value beyond int is a
// ValueError naming the argument and the range it accepts (pybind11 would refuse it with a TypeError). The
// range is checked here only beyond int; within it the core checks it, in its own words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "pyplan/check.h"

inline constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();

inline bool fits_int(std::int64_t value) {
    return value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max();
}

// The message names `name` (and `[index]` when index ≥ 0) and [lo, hi]; built only on failure.
inline int to_int(std::int64_t value, const char* name, std::int64_t lo, std::int64_t hi, long long index = -1) {
    if (!fits_int(value)) {
        const std::string where = index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
        pyplan::require_int_in(value, lo, hi, where.c_str());
        pyplan::require_int_in(value, std::numeric_limits<int>::min(), std::numeric_limits<int>::max(), where.c_str());
    }
    return static_cast<int>(value);
}

inline std::vector<int> to_ints(const std::vector<std::int64_t>& values, const char* name, std::int64_t lo,
                                std::int64_t hi) {
    std::vector<int> out;
    out.reserve(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) {
        out.push_back(to_int(values[i], name, lo, hi, static_cast<long long>(i)));
    }
    return out;
}
