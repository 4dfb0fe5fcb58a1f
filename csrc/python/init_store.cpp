// init_store.cpp: binds the swap store's pieces: safetensors tables of
// contents and the swap-file writer.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <mlx/array.h>

#include "mlx/tensor_pager.h"
#include "mm/checksum.h"
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
      .def(
          "write_page_checked",
          [](SwapWriter& w, const std::vector<mx::array>& arrays) {
            nb::gil_scoped_release unlocked;
            std::uint64_t sum = 0;
            std::uint64_t off = write_swap_page(w, arrays, &sum);
            return std::make_pair(off, sum);
          },
          "arrays"_a, "As write_page; returns (offset, checksum).")
      .def("finish", &SwapWriter::finish);
  m.def(
      "inject_swap_write_error",
      [](std::int64_t after_bytes) {
        return SwapWriter::fail_writes_after_for_testing(after_bytes);
      },
      "after_bytes"_a,
      "Test hook: swap writes past `after_bytes` of a file fail with ENOSPC (-1: off).");
  m.def(
      "rewrite_swap_page",
      [](const std::string& path, std::uint64_t offset, const std::vector<mx::array>& arrays) {
        nb::gil_scoped_release unlocked;
        return rewrite_swap_page(path, offset, arrays);
      },
      "path"_a, "offset"_a, "arrays"_a,
      "Writes the page of `arrays` over the page at `offset`; returns its checksum.");
  m.def(
      "write_swap_array",
      [](const std::string& path, std::uint64_t offset, const mx::array& array) {
        nb::gil_scoped_release unlocked;
        write_swap_array(path, offset, array);
      },
      "path"_a, "offset"_a, "array"_a,
      "Writes the array's bytes at `offset` of the file (a spilled activation; no checksum).");
  m.def(
      "hash_file",
      [](const std::string& path, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& r) {
        FileDigest d;
        {
          nb::gil_scoped_release unlocked;
          d = hash_file(path, r);
        }
        return nb::make_tuple(d.file, d.ranges, d.size);
      },
      "path"_a, "ranges"_a = std::vector<std::pair<std::uint64_t, std::uint64_t>>{},
      "(XXH3 of the file, [XXH3 of each (offset, length) range], size), in one pass.");
  m.def(
      "combine_digests", [](const std::vector<std::uint64_t>& d) { return combine_digests(d); },
      "digests"_a, "A page checksum from its tensors' XXH3s, in order.");
  m.def(
      "xxh3_build", []() { return std::string(xxh3_build()); },
      "Which XXH3 build hashes: 'avx2' where the CPU runs it, else 'portable' "
      "(MLX_PAGER_XXH3=portable forces it).");
}
