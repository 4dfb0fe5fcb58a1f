// checksum_tests.cpp: page checksums verified on every read (a mismatch read
// again, then rebuilt through the hook or failed naming the file), file
// digests in one pass, and transient read errors retried.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <thread>
#include <vector>

#include "check.h"
#include "mm/checksum.h"
#include "mm/pager.h"
#include "mm/swapfile.h"
#include "test_files.h"

using namespace mlx_pager;

namespace {

constexpr std::uint64_t kPage = 64 * 1024;

PagerConfig small_config(int readahead = 0) {
  PagerConfig c;
  c.budget_bytes = 4 * kPage;
  c.policy = Policy::lru;
  c.readahead_pages = readahead;
  c.io_threads = 2;
  c.io_chunk_bytes = 16 * 1024;
  return c;
}

std::vector<char> read_file(const std::string& path, std::uint64_t off, std::uint64_t n) {
  std::vector<char> b(n);
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(off));
  in.read(b.data(), static_cast<std::streamsize>(n));
  return b;
}

void flip_byte(const std::string& path, std::uint64_t off) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  char c = 0;
  REQUIRE(::pread(fd, &c, 1, static_cast<off_t>(off)) == 1);
  c = static_cast<char>(c ^ 0x5a);
  REQUIRE(::pwrite(fd, &c, 1, static_cast<off_t>(off)) == 1);
  ::fsync(fd);
  ::close(fd);
}

// Pages 0..n-1 of one pattern file, each with the checksum of its bytes.
std::string checked_pages(Pager& p, const std::string& name, int n, std::uint64_t seed) {
  std::string path = check::pattern_file(name, n * kPage, seed);
  FileId f = p.add_file(path);
  for (int i = 0; i < n; ++i) {
    PageSpec s;
    s.name = "page." + std::to_string(i);
    s.frame_bytes = kPage;
    s.extents.push_back(Extent{f, i * kPage, kPage, kPage, 0});
    auto bytes = read_file(path, i * kPage, kPage);
    s.checked = true;
    s.verify.push_back(FrameRange{0, kPage});
    s.checksum = frame_checksum(bytes.data(), s.verify);
    p.add_page(std::move(s));
  }
  return path;
}

}  // namespace

TEST_CASE("checksum: frame checksums combine the ranges' digests in order") {
  std::vector<char> a(1000);
  for (std::size_t i = 0; i < a.size(); ++i)
    a[i] = static_cast<char>(i * 7);
  std::vector<FrameRange> r = {{0, 100}, {500, 300}};
  CHECK_EQ(
      frame_checksum(a.data(), r),
      combine_digests({xxh3(a.data(), 100), xxh3(a.data() + 500, 300)}));
  std::vector<FrameRange> swapped = {{500, 300}, {0, 100}};
  CHECK(frame_checksum(a.data(), r) != frame_checksum(a.data(), swapped));
  Hasher h;
  h.update(a.data(), 10);
  h.update(nullptr, 5000);
  h.update(a.data() + 10, 990);
  std::vector<char> b(a.begin(), a.begin() + 10);
  b.resize(5010, 0);
  b.insert(b.end(), a.begin() + 10, a.end());
  CHECK_EQ(h.digest(), xxh3(b.data(), b.size()));
}

TEST_CASE("checksum: hash_file digests the file and its ranges in one pass") {
  const std::uint64_t n = 20 * (1 << 20) + 333;  // several 8 MiB chunks
  auto path = check::pattern_file("hash.bin", n, 71);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges = {
      {9 << 20, 100}, {5, 17 << 20}, {n - 10, 10}, {(8 << 20) - 3, 6}};
  FileDigest d = hash_file(path, ranges);
  auto all = read_file(path, 0, n);
  CHECK_EQ(d.size, n);
  CHECK_EQ(d.file, xxh3(all.data(), n));
  REQUIRE(d.ranges.size() == ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i)
    CHECK_EQ(d.ranges[i], xxh3(all.data() + ranges[i].first, ranges[i].second));
  CHECK_THROWS_WITH(hash_file(path, {{n - 1, 2}}), "truncated");
  CHECK_THROWS_WITH(hash_file(check::temp_dir() + "/nope.bin", {}), "nope.bin");
}

TEST_CASE("checksum: every read is verified; a clean page reads with no error counted") {
  Pager p(small_config(1), std::make_shared<HeapFrameAllocator>());
  checked_pages(p, "ck_clean.bin", 3, 72);
  p.set_schedule({0, 1, 2});
  for (int round = 0; round < 3; ++round) {
    for (PageId i = 0; i < 3; ++i) {
      Frame f = p.acquire(i);
      CHECK(check::matches_pattern(f.data, kPage, 72, i * kPage));
      p.release(i);
    }
  }
  VmStat s = p.stats();
  CHECK_EQ(s.checksum_errors, 0u);
  CHECK_EQ(s.read_errors, 0u);
  // Each read was hashed as its chunks landed (landing.h).
  CHECK(s.pages_read > 0);
  CHECK_EQ(s.verified_landing, s.pages_read);
}

TEST_CASE("checksum: a transient corruption is caught and fixed by the re-read") {
  Pager p(small_config(), std::make_shared<HeapFrameAllocator>());
  auto path = checked_pages(p, "ck_transient.bin", 2, 73);
  flip_byte(path, kPage + 100);
  // The first chunk read of page 1 sees the flipped byte; the injector puts
  // the byte back before the re-read (as a bad transfer would vanish).
  std::atomic<int> calls{0};
  p.set_fault_injector([&](const std::string&, std::uint64_t off, std::size_t&, int&) {
    if (off >= kPage && calls.fetch_add(1) == 4)  // after the page's 4 chunks
      flip_byte(path, kPage + 100);
  });
  Frame f = p.acquire(1);
  CHECK(check::matches_pattern(f.data, kPage, 73, kPage));
  p.release(1);
  VmStat s = p.stats();
  CHECK_EQ(s.checksum_errors, 1u);
  CHECK_EQ(s.rereads, 1u);
  CHECK_EQ(s.read_errors, 0u);
  CHECK_EQ(s.pages_rebuilt, 0u);
  CHECK_EQ(s.verified_landing, 0u);  // the mismatch went the slow way, which re-read
}

TEST_CASE("checksum: bytes wrong on disk are rebuilt through the hook, then read") {
  Pager p(small_config(), std::make_shared<HeapFrameAllocator>());
  auto path = checked_pages(p, "ck_rebuild.bin", 3, 74);
  auto good = read_file(path, 2 * kPage, kPage);
  flip_byte(path, 2 * kPage + 4095);
  std::atomic<int> hooks{0};
  p.set_rebuild_hook([&](PageId id) {
    ++hooks;
    CHECK_EQ(id, 2u);
    rewrite_swap_range(path, 2 * kPage, good.data(), good.size());
    return true;
  });
  Frame f = p.acquire(2);
  CHECK(check::matches_pattern(f.data, kPage, 74, 2 * kPage));
  p.release(2);
  VmStat s = p.stats();
  CHECK_EQ(hooks.load(), 1);
  CHECK_EQ(s.checksum_errors, 2u);  // the read and its re-read
  CHECK_EQ(s.pages_rebuilt, 1u);
  CHECK_EQ(s.read_errors, 1u);
  CHECK_EQ(s.resident_bytes_now, kPage);  // the failed frame was given back
}

TEST_CASE("checksum: with no hook (or one that cannot rebuild) the error names the file") {
  Pager p(small_config(), std::make_shared<HeapFrameAllocator>());
  auto path = checked_pages(p, "ck_nohook.bin", 2, 75);
  flip_byte(path, 10);
  CHECK_THROWS_WITH(p.acquire(0), "ck_nohook.bin");
  CHECK_THROWS_WITH(p.acquire(0), "do not match their checksum");
  p.set_rebuild_hook([](PageId) { return false; });
  CHECK_THROWS_WITH(p.acquire(0), "page 'page.0'");
  // A hook that rebuilt nothing useful: one retry, then the error.
  std::atomic<int> hooks{0};
  p.set_rebuild_hook([&](PageId) {
    ++hooks;
    return true;
  });
  CHECK_THROWS_WITH(p.acquire(0), "corrupt");
  CHECK_EQ(hooks.load(), 1);
  CHECK(p.state(0) == PageState::on_disk);
  Frame f = p.acquire(1);  // the other page is fine
  CHECK(check::matches_pattern(f.data, kPage, 75, kPage));
  p.release(1);
  CHECK_EQ(p.stats().resident_bytes_now, kPage);
}

TEST_CASE("checksum: readahead of a corrupt page fails quietly; the fault rebuilds it") {
  Pager p(small_config(2), std::make_shared<HeapFrameAllocator>());
  auto path = checked_pages(p, "ck_ra.bin", 4, 76);
  auto good = read_file(path, 3 * kPage, kPage);
  flip_byte(path, 3 * kPage + 7);
  std::atomic<int> hooks{0};
  p.set_rebuild_hook([&](PageId id) {
    ++hooks;
    rewrite_swap_range(path, id * kPage, good.data(), good.size());
    return true;
  });
  p.set_schedule({0, 1, 2, 3});
  for (int round = 0; round < 2; ++round) {
    for (PageId i = 0; i < 4; ++i) {
      Frame f = p.acquire(i);
      CHECK(check::matches_pattern(f.data, kPage, 76, i * kPage));
      p.release(i);
    }
  }
  CHECK_EQ(hooks.load(), 1);
  CHECK_EQ(p.stats().pages_rebuilt, 1u);
}

TEST_CASE("page_io: transient errors are retried; persistent ones fail after 3 attempts") {
  Pager p(small_config(), std::make_shared<HeapFrameAllocator>());
  auto path = checked_pages(p, "ck_retry.bin", 3, 77);
  // Two failures, then success: the read goes through.
  p.set_fault_injector(fault_rule("ck_retry", EIO, 0, 0, 2));
  Frame f = p.acquire(0);
  CHECK(check::matches_pattern(f.data, kPage, 77, 0));
  p.release(0);
  CHECK_EQ(p.stats().io_retries, 2u);
  CHECK_EQ(p.stats().read_errors, 0u);
  // A short read once: retried too.
  p.set_fault_injector(fault_rule("ck_retry", 0, 100, 0, 1));
  f = p.acquire(1);
  CHECK(check::matches_pattern(f.data, kPage, 77, kPage));
  p.release(1);
  CHECK_EQ(p.stats().read_errors, 0u);
  // Always failing: the read fails, naming the file and the attempts.
  p.set_fault_injector(fault_rule("ck_retry", EIO, 0, 0, -1));
  CHECK_THROWS_WITH(p.acquire(2), "3 attempts");
  CHECK_THROWS_WITH(p.acquire(2), "ck_retry.bin");
  // Other files are not touched by the rule.
  p.set_fault_injector(fault_rule("elsewhere", EIO, 0, 0, -1));
  f = p.acquire(2);
  CHECK(check::matches_pattern(f.data, kPage, 77, 2 * kPage));
  p.release(2);
}

TEST_CASE("swapfile: an injected ENOSPC fails the write and names the file") {
  std::string path = check::temp_dir() + "/enospc.swap";
  SwapWriter::fail_writes_after_for_testing(64 * 1024);
  std::vector<char> data(256 * 1024, 'x');
  bool threw = false;
  try {
    SwapWriter w(path, data.size(), 16 * 1024);
    w.write(data.data(), data.size());
    w.finish();
  } catch (const std::system_error& e) {
    threw = true;
    CHECK_EQ(e.code().value(), ENOSPC);
    CHECK(std::string(e.what()).find("enospc.swap") != std::string::npos);
  }
  SwapWriter::fail_writes_after_for_testing(-1);
  CHECK(threw);
}
