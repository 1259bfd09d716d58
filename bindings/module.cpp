// pyplan._core: the module definition. Each algorithm's bindings live in their own file and are
// registered here; bindings only convert between Python and the plain C++ structs of cpp/include.
#include <pybind11/pybind11.h>

#include "pyplan/limits.h"
#include "pyplan/remat.h"

namespace py = pybind11;

void bind_cost(py::module_& m);
void bind_partition(py::module_& m);
void bind_simulate(py::module_& m);
void bind_search(py::module_& m);
void bind_remat(py::module_& m);

PYBIND11_MODULE(_core, m) {
    m.doc() = "pyplan's C++17 planning core (private; use the pyplan package).";
    m.attr("abi_version") = 1;
    // The ranges the core accepts (cpp/include/pyplan/limits.h, remat.h), for callers and tests that state them.
    m.attr("MAX_SECONDS") = pyplan::kMaxSeconds;
    m.attr("MAX_BYTES") = pyplan::kMaxBytes;
    m.attr("MAX_PRICE_PER_S") = pyplan::kMaxPricePerS;
    m.attr("MIN_BW_BYTES_PER_S") = pyplan::kMinBwBytesPerS;
    m.attr("MAX_VALUE") = pyplan::kMaxValue;
    m.attr("MAX_GPUS") = pyplan::kMaxGpus;
    m.attr("MAX_STAGE_MICROBATCHES") = pyplan::kMaxStageMicrobatches;
    m.attr("MAX_REMAT_BLOCKS") = pyplan::kMaxRematBlocks;
    m.attr("MAX_REMAT_SLOTS") = pyplan::kMaxRematSlots;
    m.attr("MAX_REMAT_TABLE_ENTRIES") = pyplan::kMaxRematTableEntries;
    bind_cost(m);
    bind_partition(m);
    bind_simulate(m);
    bind_search(m);
    bind_remat(m);
}
