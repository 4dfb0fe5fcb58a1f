// read_rate.h: the device's direct-read rate at the pager's own I/O shape.
//
// A bound on a paged step is only honest if the rate it divides by is the
// best the device gives the way the pager reads: page-sized batches split
// into chunks that several I/O threads read in parallel with direct I/O (no
// page cache), one or two batches in flight as readahead keeps them, into
// memory of the kind its frames are (huge pages where the platform has
// them: the rate depends on it, huge_pages.h). This
// measures exactly that, through the pager's own PageIO and DirectFile: the
// files are read front to back in `batch_bytes` batches, `depth` batches in
// flight, until `max_bytes` are read, `max_seconds` have passed, or the
// files end (they are not read twice). One stream of `dd iflag=direct`
// measures less than several threads do, and a pager reading with several
// threads then "beats" a bound built on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mm/page_io.h"

namespace mlx_pager {

struct ReadRateConfig {
  int threads = 4;                                 // I/O threads, as PagerConfig::io_threads
  std::size_t chunk_bytes = kDefaultIoChunkBytes;  // as PagerConfig::io_chunk_bytes
  std::size_t batch_bytes = 64u << 20;             // one page read (rounded up to kIoAlign)
  int depth = 2;                                   // batches in flight at once
  std::uint64_t max_bytes = 1ull << 30;            // stop after this many bytes ...
  double max_seconds = 2.0;                        // ... or this long
  // Test hook: called on the measuring thread for every batch read, with
  // the file, the offset and the bytes read.
  std::function<void(
      const std::string& path, std::uint64_t offset, const char* data, std::size_t n)>
      on_batch;
};

struct ReadRate {
  double bytes_per_s = 0;
  std::uint64_t bytes = 0;  // bytes read (what the files hold, no padding)
  double seconds = 0;
  bool direct = true;  // every file was read around the page cache
  ReadRateConfig config;
};

// Reads `paths` as described above and returns the rate. Throws
// std::invalid_argument for an empty list or a bad setting, and what
// DirectFile / PageIO throw (naming the file) when a read fails.
ReadRate measure_read_rate(const std::vector<std::string>& paths, const ReadRateConfig& config);

}  // namespace mlx_pager
