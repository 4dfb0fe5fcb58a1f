// read_rate_tests.cpp: the read-rate measurement reads the files' real
// bytes, front to back, into memory of the kind the pager's frames are,
// stops at its limits, and names what it cannot read.
#include <map>
#include <mutex>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/huge_pages.h"
#include "mm/read_rate.h"
#include "smaps.h"
#include "test_files.h"

using namespace mlx_pager;

TEST_CASE("read_rate: every byte of every file is read once, at every shape") {
  const std::uint64_t n1 = 5 * (1 << 20) + 3 * kIoAlign + 77;  // odd tails
  const std::uint64_t n2 = 2 * (1 << 20) + 1;
  auto p1 = check::pattern_file("rr1.bin", n1, 31);
  auto p2 = check::pattern_file("rr2.bin", n2, 32);
  for (int threads : {1, 3, 8}) {
    for (std::size_t chunk : {kIoAlign, std::size_t(256 << 10), std::size_t(4 << 20)}) {
      for (int depth : {1, 2, 4}) {
        ReadRateConfig c;
        c.threads = threads;
        c.chunk_bytes = chunk;
        c.batch_bytes = (1 << 20) + 1;  // rounded up to kIoAlign
        c.depth = depth;
        std::map<std::string, std::uint64_t> seen;
        bool ok = true;
        c.on_batch = [&](const std::string& path, std::uint64_t off, const char* d, std::size_t n) {
          ok = ok && check::matches_pattern(d, n, path == p1 ? 31 : 32, off);
          ok = ok && seen[path] == off;  // front to back, no gap, no repeat
          seen[path] += n;
        };
        ReadRate r = measure_read_rate({p1, p2}, c);
        CHECK(ok);
        CHECK_EQ(r.bytes, n1 + n2);
        CHECK_EQ(seen[p1], n1);
        CHECK_EQ(seen[p2], n2);
        CHECK(r.direct);
        CHECK(r.seconds > 0);
        CHECK(r.bytes_per_s > 0);
        CHECK_EQ(r.config.threads, threads);
      }
    }
  }
}

TEST_CASE("read_rate: stops at max_bytes and at max_seconds") {
  auto p = check::pattern_file("rr3.bin", 8 << 20, 33);
  ReadRateConfig c;
  c.batch_bytes = 1 << 20;
  c.max_bytes = 3 << 20;
  ReadRate r = measure_read_rate({p}, c);
  CHECK_EQ(r.bytes, std::uint64_t(3 << 20));
  c.max_bytes = 1ull << 40;
  c.max_seconds = 0;  // the batches already in flight finish, no more start
  c.depth = 2;
  r = measure_read_rate({p}, c);
  CHECK(r.bytes >= std::uint64_t(1 << 20));
  CHECK(r.bytes <= std::uint64_t(2 << 20));
}

TEST_CASE("read_rate: bad settings and missing files are errors naming them") {
  auto p = check::pattern_file("rr4.bin", 1 << 20, 34);
  ReadRateConfig c;
  CHECK_THROWS_WITH(measure_read_rate({}, c), "no files");
  c.threads = 0;
  CHECK_THROWS_WITH(measure_read_rate({p}, c), "must be positive");
  c.threads = 2;
  CHECK_THROWS_WITH(measure_read_rate({p, check::temp_dir() + "/missing.bin"}, c), "missing.bin");
}

TEST_CASE("read_rate: batches land in memory advised into huge pages, as the pager's frames") {
  const std::uint64_t h = huge_page_bytes();
  if (h == 0) {
    return;  // no huge pages on this platform: frames and buffers alike
  }
  auto p = check::pattern_file("rr5.bin", 6 * h, 35);
  ReadRateConfig c;
  c.batch_bytes = 3 * h;
  int advised = 0, batches = 0;
  c.on_batch = [&](const std::string&, std::uint64_t, const char* d, std::size_t) {
    advised += check::huge_page_advised(check::first_huge_page(d, h));
    ++batches;
  };
  measure_read_rate({p}, c);
  CHECK_EQ(batches, 2);
  CHECK_EQ(advised, 2);
}
