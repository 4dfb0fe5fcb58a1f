// init_store.cpp: binds the swap store's pieces: safetensors tables of
// contents and the swap-file writer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mlx/array.h>

#include "mlx/tensor_pager.h"
#include "mm/layout.h"
#include "mm/safetensors.h"
#include "mm/swapfile.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx_pager;

void init_store(nb::module_& m) {
  m.attr("IO_ALIGN") = kIoAlign;
  m.def(
      "read_safetensors_index",
      [](const std::string& path) {
        SafetensorsIndex idx = read_safetensors_index(path);
        nb::dict tensors;
        for (auto& [name, e] : idx.tensors) {
          nb::list shape;
          for (auto d : e.shape)
            shape.append(d);
          tensors[nb::str(name.c_str())] =
              nb::make_tuple(dtype_from_safetensors(e.dtype), shape, e.offset, e.nbytes);
        }
        nb::dict meta;
        for (auto& [k, v] : idx.metadata)
          meta[nb::str(k.c_str())] = v;
        return nb::make_tuple(tensors, meta, idx.file_size);
      },
      "path"_a,
      "({name: (dtype, shape, offset, nbytes)}, metadata, file_size) of a .safetensors file.");
  m.def(
      "swap_page_bytes",
      [](const std::vector<std::uint64_t>& nbytes) { return plan_swap_page(nbytes).bytes; },
      "nbytes"_a, "Bytes a page of tensors of these sizes takes in a swap file.");

  nb::class_<SwapWriter>(m, "SwapWriter", "Writes pages into a swap file (csrc/mm/swapfile.h).")
      .def(
          nb::init<const std::string&, std::uint64_t, std::size_t, bool>(), "path"_a,
          "reserve_bytes"_a, "staging_bytes"_a = kDefaultStagingBytes, "direct_io"_a = true)
      .def(
          "write_page",
          [](SwapWriter& w, const std::vector<mx::array>& arrays) {
            nb::gil_scoped_release unlocked;
            return write_swap_page(w, arrays);
          },
          "arrays"_a, "Appends a page of arrays; returns its offset in the file.")
      .def("finish", &SwapWriter::finish);
}
