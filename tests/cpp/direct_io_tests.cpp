// direct_io_tests.cpp: opening modes, exact reads, errors that name the file.
#include <sys/statfs.h>

#include <filesystem>
#include <system_error>

#include "check.h"
#include "mm/direct_io.h"
#include "test_files.h"

using namespace mlx_pager;

TEST_CASE("direct_io: aligned direct reads return the file's bytes") {
  auto path = check::pattern_file("dio.bin", 3 * kIoAlign + 100, 7);
  auto f = DirectFile::open_read(path);
  CHECK(f.mode() != IoMode::buffered_drop);  // this disk allows direct I/O
  char* buf = static_cast<char*>(aligned_alloc_io(4 * kIoAlign));
  std::size_t got = f.pread_full(buf, 4 * kIoAlign, 0);
  CHECK_EQ(got, 3 * kIoAlign + 100);  // short only at end of file
  CHECK(check::matches_pattern(buf, got, 7, 0));
  got = f.pread_full(buf, kIoAlign, 2 * kIoAlign);
  CHECK_EQ(got, kIoAlign);
  CHECK(check::matches_pattern(buf, got, 7, 2 * kIoAlign));
  aligned_free_io(buf);
}

TEST_CASE("direct_io: buffered mode reads any range and says so") {
  auto path = check::pattern_file("buf.bin", 10000, 8);
  auto f = DirectFile::open_read(path, /*want_direct=*/false);
  CHECK(f.mode() == IoMode::buffered_drop);
  CHECK(!f.needs_alignment());
  char buf[333];
  CHECK_EQ(f.pread_full(buf, sizeof buf, 1234), sizeof buf);
  CHECK(check::matches_pattern(buf, sizeof buf, 8, 1234));
}

TEST_CASE("direct_io: a file system that refuses O_DIRECT falls back, visibly") {
  // /dev/shm is tmpfs on Linux; older kernels refuse O_DIRECT there.
  std::string dir = "/dev/shm";
  if (!std::filesystem::exists(dir)) {
    return;
  }
  std::string path = dir + "/mlx_pager_fallback_test.bin";
  {
    auto w = DirectFile::create_write(path, 0, false);
    char data[5000];
    for (int i = 0; i < 5000; ++i)
      data[i] = static_cast<char>(i * 7);
    w.pwrite_full(data, sizeof data, 0);
  }
  auto f = DirectFile::open_read(path);
  // Either mode is fine; what matters is that the mode is the truth and the
  // bytes are right in it.
  char* buf = static_cast<char*>(aligned_alloc_io(2 * kIoAlign));
  std::size_t got = f.pread_full(buf, 2 * kIoAlign, 0);
  CHECK_EQ(got, 5000u);
  bool ok = true;
  for (int i = 0; i < 5000; ++i)
    ok &= buf[i] == static_cast<char>(i * 7);
  CHECK(ok);
  aligned_free_io(buf);
  std::filesystem::remove(path);
}

TEST_CASE("direct_io: a refused O_DIRECT falls back to buffered reads, and says so") {
  auto path = check::pattern_file("refused.bin", 3 * kIoAlign + 7, 9);
  bool old = DirectFile::refuse_direct_for_testing(true);
  auto f = DirectFile::open_read(path);
  DirectFile::refuse_direct_for_testing(old);
  CHECK(f.mode() == IoMode::buffered_drop);
  char* buf = static_cast<char*>(aligned_alloc_io(4 * kIoAlign));
  CHECK_EQ(f.pread_full(buf, 4 * kIoAlign, 0), 3 * kIoAlign + 7);
  CHECK(check::matches_pattern(buf, 3 * kIoAlign + 7, 9, 0));
  aligned_free_io(buf);
}

TEST_CASE("direct_io: a missing file is an error naming the path") {
  CHECK_THROWS_WITH(
      DirectFile::open_read("/nonexistent/dir/model.safetensors"),
      "/nonexistent/dir/model.safetensors");
}

TEST_CASE("direct_io: create_write reserves space up front") {
  std::string path = check::temp_dir() + "/reserved.bin";
  auto w = DirectFile::create_write(path, 1 << 20);
  CHECK_EQ(w.size(), 1u << 20);
  CHECK_THROWS_WITH(
      DirectFile::create_write(check::temp_dir() + "/no/such/dir/x.bin", 10), "no/such/dir");
}

TEST_CASE("direct_io: an aligned buffer is aligned, rounded up and movable") {
  AlignedBuffer a(5000);
  CHECK_EQ(a.size(), 2 * kIoAlign);
  CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % kIoAlign == 0);
  char* p = a.data();
  AlignedBuffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(a.data() == nullptr);
  b = AlignedBuffer(0);
  CHECK_EQ(b.size(), kIoAlign);
}
