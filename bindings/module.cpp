// pyplan._core: the module definition. Each algorithm's bindings live in their own file and are
// registered here; bindings only convert between Python and the plain C++ structs of cpp/include.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_cost(py::module_& m);
void bind_partition(py::module_& m);
void bind_simulate(py::module_& m);
void bind_search(py::module_& m);
void bind_remat(py::module_& m);

PYBIND11_MODULE(_core, m) {
    m.doc() = "pyplan's C++17 planning core (private; use the pyplan package).";
    m.attr("abi_version") = 1;
    bind_cost(m);
    bind_partition(m);
    bind_simulate(m);
    bind_search(m);
    bind_remat(m);
}
