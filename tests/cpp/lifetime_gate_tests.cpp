// lifetime_gate_tests.cpp: a callback reaches its owner only while it lives,
// close() waits for the calls running, and a pager's lease releasers outlive
// it harmlessly.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "check.h"
#include "mm/lifetime_gate.h"
#include "mm/pager.h"
#include "test_files.h"

using namespace mlx_pager;

namespace {

struct Owner {
  std::atomic<int> calls{0};
};

}  // namespace

TEST_CASE("lifetime_gate: run reaches the owner until close, then never") {
  Owner o;
  auto gate = std::make_shared<LifetimeGate<Owner>>(&o);
  CHECK(gate->run([](Owner& w) { ++w.calls; }));
  CHECK_EQ(o.calls.load(), 1);
  gate->close();
  CHECK(!gate->run([](Owner& w) { ++w.calls; }));
  CHECK_EQ(o.calls.load(), 1);
  gate->close();  // closing twice is harmless
}

TEST_CASE("lifetime_gate: close waits for the calls running; calls run side by side") {
  Owner o;
  auto gate = std::make_shared<LifetimeGate<Owner>>(&o);
  std::atomic<int> inside{0};
  std::atomic<bool> go{false};
  std::atomic<bool> finished{false};
  std::vector<std::thread> callers;
  for (int i = 0; i < 2; ++i) {
    callers.emplace_back([&] {
      gate->run([&](Owner& w) {
        ++inside;
        while (!go.load()) {
          std::this_thread::yield();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        ++w.calls;
        finished = true;
      });
    });
  }
  while (inside.load() < 2) {  // both inside at once: shared
    std::this_thread::yield();
  }
  go = true;
  gate->close();  // returns only once both calls are done
  CHECK(finished.load());
  CHECK_EQ(o.calls.load(), 2);
  for (auto& t : callers) {
    t.join();
  }
}

TEST_CASE("lifetime_gate: a lease released after its pager is gone does nothing") {
  constexpr std::uint64_t kBytes = 64 * 1024;
  std::string path = check::pattern_file("gate_lease.bin", kBytes, 7);
  std::function<void()> releaser;
  Frame held;
  {
    PagerConfig c;
    c.budget_bytes = 1 << 20;
    c.readahead_pages = 0;
    Pager pager(c, std::make_shared<HeapFrameAllocator>());
    PageSpec s;
    s.name = "p";
    s.frame_bytes = kBytes;
    s.extents.push_back(Extent{pager.add_file(path), 0, kBytes, kBytes, 0});
    PageId id = pager.add_page(std::move(s));
    held = pager.acquire_lease(id);
    releaser = pager.lease_releaser(id);
    CHECK(pager.stats().resident_bytes_now >= kBytes);
  }
  // The pager and its page table are gone; the frame is the holder's own.
  releaser();  // under AddressSanitizer, a use after free if it reached them
  CHECK(check::matches_pattern(held.data, kBytes, 7, 0));
}
