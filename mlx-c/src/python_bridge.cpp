// Crossing mlx.core.array objects between Python and the C ABI, with no copy
// and no evaluation.
//
// mlx.core is a nanobind 3 extension in the nanobind domain "mlx"; this unit is
// compiled against the same nanobind sources with NB_DOMAIN=mlx, so it shares
// mlx's type registry and sees mlx::core::array's Python type.
#include <nanobind/nanobind.h>

#include "mlxc/veloxquant_ext.h"
#include "private.h"

namespace nb = nanobind;
using namespace mlxc;

extern "C" {

int vq_python_bridge_init(void* module) {
  if (!nb::register_module(nb::handle(static_cast<PyObject*>(module)))) {
    return 1;  // a Python error is set
  }
  return 0;
}

int vq_python_is_array(void* obj) {
  return nb::isinstance<mx::array>(nb::handle(static_cast<PyObject*>(obj))) ? 1 : 0;
}

int vq_python_array_borrow(mlx_array* res, void* obj) {
  return guard([&] {
    nb::handle h(static_cast<PyObject*>(obj));
    if (!nb::isinstance<mx::array>(h)) throw std::invalid_argument("object is not an mlx.core.array");
    set_array(res, *nb::inst_ptr<mx::array>(h));
  });
}

void* vq_python_array_wrap(const mlx_array a) {
  try {
    mx::array copy = arr(a);
    return nb::cast(std::move(copy), nb::rv_policy::move).release().ptr();
  } catch (const std::exception& e) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
  return nullptr;
}

}  // extern "C"
