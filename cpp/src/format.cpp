// Numbers in messages; see format.h.
#include "pyplan/format.h"

#include <cmath>
#include <cstdio>

namespace pyplan {

std::string format_bytes(double bytes) {
    static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int unit = 0;
    while (std::fabs(bytes) >= 1024.0 && unit < 5) {
        bytes /= 1024.0;
        ++unit;
    }
    char text[64];
    std::snprintf(text, sizeof text, "%.3g %s", bytes, kUnits[unit]);
    return text;
}

}  // namespace pyplan
