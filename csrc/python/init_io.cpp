// init_io.cpp: binds the read-rate measurement (mm/read_rate.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mm/read_rate.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace mlx_pager;

void init_io(nb::module_& m) {
  m.def(
      "measure_read_rate",
      [](const std::vector<std::string>& paths, int threads, std::size_t chunk_bytes,
         std::size_t batch_bytes, int depth, std::uint64_t max_bytes, double max_seconds) {
        ReadRateConfig c;
        c.threads = threads;
        c.chunk_bytes = chunk_bytes;
        c.batch_bytes = batch_bytes;
        c.depth = depth;
        c.max_bytes = max_bytes;
        c.max_seconds = max_seconds;
        ReadRate r;
        {
          nb::gil_scoped_release unlocked;
          r = measure_read_rate(paths, c);
        }
        nb::dict d;
        d["bytes_per_s"] = r.bytes_per_s;
        d["bytes"] = r.bytes;
        d["seconds"] = r.seconds;
        d["direct"] = r.direct;
        d["threads"] = threads;
        d["chunk_bytes"] = chunk_bytes;
        d["batch_bytes"] = batch_bytes;
        d["depth"] = depth;
        return d;
      },
      "paths"_a, "threads"_a = 4, "chunk_bytes"_a = kDefaultIoChunkBytes,
      "batch_bytes"_a = std::size_t(64) << 20, "depth"_a = 2,
      "max_bytes"_a = std::uint64_t(1) << 30, "max_seconds"_a = 2.0,
      "Bytes/s of direct reads of `paths` the way the pager reads (csrc/mm/read_rate.h):\n"
      "front to back in batch_bytes batches, `depth` in flight, split into chunk_bytes\n"
      "chunks over `threads` I/O threads; stops at max_bytes, max_seconds or the files'\n"
      "end. Returns {bytes_per_s, bytes, seconds, direct, threads, chunk_bytes, ...};\n"
      "direct is False when a file system refused direct I/O (the rate then includes\n"
      "the page cache).");
  m.attr("DEFAULT_IO_CHUNK_BYTES") = kDefaultIoChunkBytes;
}
