// pyplan/format.h — numbers in the one-line messages the solvers return (decimal units, as pyplan's tables).
#pragma once

#include <string>

namespace pyplan {

// Bytes with three significant digits and a binary unit (1 GiB = 2^30 B), as pyplan prints every memory
// figure: "84.9 GiB", "372 KiB".
std::string format_bytes(double bytes);

}  // namespace pyplan
