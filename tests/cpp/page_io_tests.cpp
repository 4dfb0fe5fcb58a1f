// page_io_tests.cpp: byte-exact chunked reads at every queue depth, and
// failures (EIO, short read, EOF) that name the file.
#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/page_io.h"
#include "test_files.h"

using namespace mlx_pager;

TEST_CASE("page_io: round trips are byte-exact across threads, chunks and offsets") {
  const std::uint64_t n = 3 * (1 << 20) + 5 * kIoAlign + 123;
  auto path = check::pattern_file("pio.bin", n, 11);
  auto f = DirectFile::open_read(path);
  for (int threads : {1, 2, 4, 8}) {
    for (std::size_t chunk : {kIoAlign, std::size_t(64 << 10), std::size_t(1 << 20)}) {
      PageIO io(threads, chunk);
      // Several reads at different aligned offsets in one batch.
      std::vector<std::uint64_t> offsets = {
          0, kIoAlign, 17 * kIoAlign, align_down(n - 1, kIoAlign)};
      std::vector<char*> bufs;
      std::vector<ReadOp> ops;
      for (auto off : offsets) {
        std::uint64_t want = std::min<std::uint64_t>(n - off, 1 << 20);
        std::size_t len = align_up(want, kIoAlign);
        char* b = static_cast<char*>(aligned_alloc_io(len));
        bufs.push_back(b);
        ops.push_back(ReadOp{&f, off, len, static_cast<std::size_t>(want), b});
      }
      std::atomic<int> completions{0};
      auto batch = io.submit(ops, [&](IoBatch&) { ++completions; });
      batch->wait();
      CHECK(batch->error() == nullptr);
      CHECK_EQ(completions.load(), 1);
      for (std::size_t i = 0; i < ops.size(); ++i) {
        CHECK(check::matches_pattern(bufs[i], ops[i].required, 11, ops[i].offset));
        aligned_free_io(bufs[i]);
      }
    }
  }
}

TEST_CASE("page_io: many batches in flight at once all complete correctly") {
  const std::uint64_t n = 8 << 20;
  auto path = check::pattern_file("pio_many.bin", n, 12);
  auto f = DirectFile::open_read(path);
  PageIO io(4, 256 << 10);
  std::vector<std::shared_ptr<IoBatch>> batches;
  std::vector<char*> bufs;
  for (int i = 0; i < 32; ++i) {
    std::uint64_t off = (i * 37 % 31) * (256 << 10);
    char* b = static_cast<char*>(aligned_alloc_io(256 << 10));
    bufs.push_back(b);
    batches.push_back(io.submit({ReadOp{&f, off, 256 << 10, 256 << 10, b}}, {}, i % 2 == 0));
  }
  for (int i = 0; i < 32; ++i) {
    batches[i]->wait();
    CHECK(batches[i]->error() == nullptr);
    CHECK(check::matches_pattern(bufs[i], 256 << 10, 12, (i * 37 % 31) * (256 << 10)));
    aligned_free_io(bufs[i]);
  }
}

TEST_CASE("page_io: reading past the end of the file is an error naming the file") {
  auto path = check::pattern_file("short.bin", 2 * kIoAlign, 13);
  auto f = DirectFile::open_read(path);
  PageIO io(2, kIoAlign);
  char* b = static_cast<char*>(aligned_alloc_io(4 * kIoAlign));
  auto batch = io.submit({ReadOp{&f, 0, 4 * kIoAlign, 3 * kIoAlign, b}});
  batch->wait();
  REQUIRE(batch->error() != nullptr);
  try {
    std::rethrow_exception(batch->error());
  } catch (const std::exception& e) {
    std::string msg = e.what();
    CHECK(msg.find("short.bin") != std::string::npos);
    CHECK(msg.find("short read") != std::string::npos);
  }
  aligned_free_io(b);
}

TEST_CASE("page_io: injected EIO and short reads fail the batch, not the process") {
  auto path = check::pattern_file("inject.bin", 1 << 20, 14);
  auto f = DirectFile::open_read(path);
  PageIO io(3, 64 << 10);
  char* b = static_cast<char*>(aligned_alloc_io(1 << 20));
  io.set_fault_injector([](const std::string&, std::uint64_t off, std::size_t&, int& err) {
    if (off == (512 << 10))
      err = EIO;
  });
  auto batch = io.submit({ReadOp{&f, 0, 1 << 20, 1 << 20, b}});
  batch->wait();
  CHECK_THROWS_WITH(std::rethrow_exception(batch->error()), "inject.bin");
  io.set_fault_injector([](const std::string&, std::uint64_t off, std::size_t& len, int&) {
    if (off == 0)
      len = kIoAlign;  // a short read
  });
  batch = io.submit({ReadOp{&f, 0, 1 << 20, 1 << 20, b}});
  batch->wait();
  CHECK_THROWS_WITH(std::rethrow_exception(batch->error()), "short read");
  io.set_fault_injector({});
  batch = io.submit({ReadOp{&f, 0, 1 << 20, 1 << 20, b}});
  batch->wait();
  CHECK(batch->error() == nullptr);
  CHECK(check::matches_pattern(b, 1 << 20, 14, 0));
  aligned_free_io(b);
}

TEST_CASE("page_io: the destructor waits for reads still queued") {
  auto path = check::pattern_file("dtor.bin", 1 << 20, 15);
  auto f = DirectFile::open_read(path);
  char* b = static_cast<char*>(aligned_alloc_io(1 << 20));
  std::atomic<bool> done{false};
  {
    PageIO io(1, kIoAlign);
    io.set_fault_injector([](const std::string&, std::uint64_t, std::size_t&, int&) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
    io.submit(
        {ReadOp{&f, 0, 1 << 20, 1 << 20, b}}, [&](IoBatch&) { done = true; }, false);
  }
  CHECK(done.load());
  CHECK(check::matches_pattern(b, 1 << 20, 15, 0));
  aligned_free_io(b);
}
