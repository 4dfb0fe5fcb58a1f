// mempool_tests.cpp: the pool is fixed, aligned, reused, and blocks when empty.
#include <atomic>
#include <chrono>
#include <thread>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/mempool.h"

using namespace mlx_pager;

TEST_CASE("mempool: buffers are aligned, reused and never more than capacity") {
  MemPool pool(2, 5000);
  CHECK_EQ(pool.buffer_bytes(), 2 * kIoAlign);
  char* first;
  {
    auto a = pool.get();
    auto b = pool.get();
    CHECK(reinterpret_cast<std::uintptr_t>(a.data()) % kIoAlign == 0);
    CHECK(a.data() != b.data());
    CHECK(!pool.try_get());  // both on loan
    CHECK_EQ(pool.in_use(), 2u);
    first = a.data();
  }
  CHECK_EQ(pool.in_use(), 0u);
  auto c = pool.get();
  auto d = pool.get();
  CHECK(c.data() == first || d.data() == first);  // the same memory again
  CHECK_EQ(pool.high_water(), 2u);
}

TEST_CASE("mempool: get() waits for a buffer to come back") {
  MemPool pool(1, kIoAlign);
  auto held = pool.get();
  std::atomic<bool> got{false};
  std::thread t([&] {
    auto b = pool.get();
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!got.load());
  held = MemPool::Buffer();  // give it back
  t.join();
  CHECK(got.load());
}
