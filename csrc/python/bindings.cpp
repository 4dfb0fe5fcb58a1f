// bindings.cpp: the extension module mlx_pager._core. Thin: one init_<concept>
// per file, each only m.def/class_ over the C++ core.
//
// mx.array crosses this boundary because the module is built with the same
// nanobind as mlx and NB_DOMAIN mlx (CMakeLists.txt); import mlx.core first
// (mlx_pager/__init__.py does) so that its type casters are registered.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_io(nb::module_& m);
void init_pager(nb::module_& m);
void init_store(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "mlx-pager's C++ core: paging frozen weights between SSD and memory";
  nb::module_::import_("mlx.core");
  init_pager(m);
  init_store(m);
  init_io(m);
}
