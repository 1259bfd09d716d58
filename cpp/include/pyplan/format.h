// pyplan/format.h — numbers in the one-line messages the solvers return (decimal units, as pyplan's tables).
#pragma once

#include <string>

namespace pyplan {

// Bytes with three significant digits and a decimal unit: "91.2 GB", "381 kB".
std::string format_bytes(double bytes);

}  // namespace pyplan
