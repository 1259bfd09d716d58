// Argument checks; see check.h.
#include "pyplan/check.h"

#include <cstdio>
#include <limits>
#include <stdexcept>

#include "pyplan/limits.h"

namespace pyplan {

std::string format_number(double value) {
    char text[32];
    std::snprintf(text, sizeof text, "%.6g", value);
    return text;
}

void fail_range(const std::string& name, const std::string& range, const std::string& got) {
    throw std::invalid_argument(name + " must be in " + range + ", got " + got);
}

void require_each_in(const std::vector<double>& values, double lo, double hi, const char* name) {
    for (std::size_t i = 0; i < values.size(); ++i) {
        if (!(values[i] >= lo && values[i] <= hi)) {
            fail_range(std::string(name) + "[" + std::to_string(i) + "]",
                       "[" + format_number(lo) + ", " + format_number(hi) + "]", format_number(values[i]));
        }
    }
}

void require_bandwidth(double bw_bytes_per_s, const char* name) {
    require_in(bw_bytes_per_s, kMinBwBytesPerS, std::numeric_limits<double>::infinity(), name);
}

void require_size(std::size_t size, std::size_t expected, const char* name, const char* per) {
    if (size != expected) {
        throw std::invalid_argument(std::string(name) + " has " + std::to_string(size) + " entries, expected " +
                                    std::to_string(expected) + " (" + per + ")");
    }
}

}  // namespace pyplan
