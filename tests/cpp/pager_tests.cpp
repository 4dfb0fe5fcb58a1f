// pager_tests.cpp: the pager against a reference Belady (MIN) simulator, its
// budget under every schedule, races between readahead and faults, and
// failures that name the page.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/pager.h"
#include "mm/swapfile.h"
#include "test_files.h"

using namespace mlx_pager;

namespace {

constexpr std::uint64_t kPage = 64 * 1024;  // frame bytes of every test page

// Pages 0..n-1, page i = bytes [i*kPage, (i+1)*kPage) of one pattern file.
struct Fixture {
  std::string path;
  std::uint64_t seed;
  int n;
  Fixture(int pages, std::uint64_t s, const std::string& name)
      : path(check::pattern_file(name, pages * kPage, s)), seed(s), n(pages) {}
  void register_pages(Pager& p, int priority_every = 0) const {
    FileId f = p.add_file(path);
    for (int i = 0; i < n; ++i) {
      PageSpec s;
      s.name = "block." + std::to_string(i);
      s.frame_bytes = kPage;
      s.extents.push_back(Extent{f, i * kPage, kPage, kPage, 0});
      s.priority = priority_every > 0 && i % priority_every == 0 ? 1 : 0;
      p.add_page(std::move(s));
    }
  }
  bool frame_ok(const Frame& fr, int page) const {
    return check::matches_pattern(fr.data, kPage, seed, page * kPage);
  }
};

// Heap frames, with a hook run first on the allocating thread (which holds
// no pager lock, and whose page is in flight): to stop a read mid-way.
struct GatedAllocator : FrameAllocator {
  HeapFrameAllocator heap;
  std::function<void(std::uint64_t)> hook;
  std::uint64_t footprint(std::uint64_t b) const override { return heap.footprint(b); }
  Frame allocate(std::uint64_t b, std::function<void()> on_free) override {
    if (hook) {
      hook(b);
    }
    return heap.allocate(b, std::move(on_free));
  }
};

PagerConfig config(std::uint64_t pages_budget, Policy policy, int readahead) {
  PagerConfig c;
  c.budget_bytes = pages_budget * kPage;
  c.policy = policy;
  c.readahead_pages = readahead;
  c.io_threads = 2;
  c.io_chunk_bytes = 16 * 1024;
  return c;
}

// The reference: Belady's MIN over `cycles` repetitions of `order` with room
// for `k` equal pages. Returns the number of page loads.
std::uint64_t belady_loads(const std::vector<PageId>& order, int cycles, int k) {
  std::vector<PageId> seq;
  for (int c = 0; c < cycles; ++c)
    seq.insert(seq.end(), order.begin(), order.end());
  std::vector<PageId> cache;
  std::uint64_t loads = 0;
  for (std::size_t t = 0; t < seq.size(); ++t) {
    if (std::find(cache.begin(), cache.end(), seq[t]) != cache.end())
      continue;
    ++loads;
    if (static_cast<int>(cache.size()) == k) {
      // evict the page whose next use is furthest (or never)
      std::size_t victim = 0, best = 0;
      for (std::size_t i = 0; i < cache.size(); ++i) {
        std::size_t nu = seq.size() + 1;
        for (std::size_t u = t + 1; u < seq.size(); ++u) {
          if (seq[u] == cache[i]) {
            nu = u;
            break;
          }
        }
        if (nu > best) {
          best = nu;
          victim = i;
        }
      }
      cache.erase(cache.begin() + victim);
    }
    cache.push_back(seq[t]);
  }
  return loads;
}

std::uint64_t lru_loads(const std::vector<PageId>& order, int cycles, int k) {
  std::vector<PageId> cache;  // front = least recent
  std::uint64_t loads = 0;
  for (int c = 0; c < cycles; ++c) {
    for (PageId p : order) {
      auto it = std::find(cache.begin(), cache.end(), p);
      if (it != cache.end()) {
        cache.erase(it);
      } else {
        ++loads;
        if (static_cast<int>(cache.size()) == k)
          cache.erase(cache.begin());
      }
      cache.push_back(p);
    }
  }
  return loads;
}

std::vector<PageId> forward_backward(int n, int first_adapted = 0) {
  std::vector<PageId> o;
  for (int i = 0; i < n; ++i)
    o.push_back(i);
  for (int i = n - 1; i >= first_adapted; --i)
    o.push_back(i);
  return o;
}

// Runs the schedule through the pager, checking every frame's bytes and that
// the budget holds at every step. Returns pages read.
// Stats once no read is in flight (reads started are then all counted).
VmStat settled(Pager& p) {
  for (int i = 0; i < 5000 && p.stats().in_flight_pages_now > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return p.stats();
}

// The pager is told the whole finite run (the schedule repeated `cycles`
// times, then nothing), as the reference is.
std::uint64_t run_schedule(
    Pager& p,
    const Fixture& fx,
    const std::vector<PageId>& order,
    int cycles,
    std::uint64_t budget) {
  std::vector<PageId> all;
  for (int c = 0; c < cycles; ++c)
    all.insert(all.end(), order.begin(), order.end());
  p.set_schedule(all, /*repeat=*/false);
  for (int c = 0; c < cycles; ++c) {
    for (PageId id : order) {
      Frame f = p.acquire(id);
      CHECK(fx.frame_ok(f, static_cast<int>(id)));
      CHECK(p.stats().resident_bytes_now <= budget);
      f = Frame{};
      p.release(id);
    }
  }
  VmStat s = settled(p);  // let background reads land before counting
  CHECK(s.peak_resident_bytes <= budget);
  return s.pages_read;
}

}  // namespace

TEST_CASE("pager: acquire returns the page's exact bytes, once read") {
  Fixture fx(4, 21, "pager_basic.bin");
  Pager p(config(4, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  Frame a = p.acquire(2);
  CHECK(fx.frame_ok(a, 2));
  CHECK(p.state(2) == PageState::resident);
  Frame b = p.acquire(2);  // a hit: same frame
  CHECK(a.data == b.data);
  p.release(2);
  p.release(2);
  VmStat s = p.stats();
  CHECK_EQ(s.faults, 1u);
  CHECK_EQ(s.hits, 1u);
  CHECK_EQ(s.bytes_read, kPage);
  CHECK_EQ(s.direct_files, 1u);
  CHECK_THROWS_WITH(p.release(2), "not acquired");
}

TEST_CASE("pager: read_busy_ns counts the time reads were in flight, and only that") {
  Fixture fx(4, 23, "pager_busy.bin");
  Pager p(config(4, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  CHECK_EQ(p.stats().read_busy_ns, 0u);
  auto t0 = std::chrono::steady_clock::now();
  for (PageId id : {0, 1, 2}) {
    p.acquire(id);
    p.release(id);
  }
  auto wall =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
  VmStat s = p.stats();
  CHECK(s.read_busy_ns > 0);
  CHECK(s.read_busy_ns <= static_cast<std::uint64_t>(wall.count()));
  // Nothing in flight: the counter stands still.
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK_EQ(p.stats().read_busy_ns, s.read_busy_ns);
}

TEST_CASE("pager: a page made of several extents from several files") {
  auto f1 = check::pattern_file("multi1.bin", 3 * kIoAlign + 10, 31);
  auto f2 = check::pattern_file("multi2.bin", 5 * kIoAlign, 32);
  for (bool direct : {true, false}) {
    PagerConfig c = config(8, Policy::optimal, 0);
    c.direct_io = direct;
    Pager p(c, std::make_shared<HeapFrameAllocator>());
    FileId a = p.add_file(f1), b = p.add_file(f2);
    PageSpec s;
    s.name = "mixed";
    s.frame_bytes = 8 * kIoAlign;
    s.extents = {
        Extent{b, kIoAlign, 2 * kIoAlign, 2 * kIoAlign, 0},
        Extent{a, 2 * kIoAlign, 2 * kIoAlign, kIoAlign + 10, 4 * kIoAlign}};
    PageId id = p.add_page(s);
    Frame f = p.acquire(id);
    CHECK(check::matches_pattern(f.data, 2 * kIoAlign, 32, kIoAlign));
    CHECK(check::matches_pattern(f.data + 4 * kIoAlign, kIoAlign + 10, 31, 2 * kIoAlign));
    CHECK_EQ(p.stats().buffered_files, direct ? 0u : 2u);
    // What the read transferred: the second extent stops at its file's end.
    CHECK_EQ(p.read_bytes(id), 3 * kIoAlign + 10);
    CHECK_EQ(p.stats().bytes_read, p.read_bytes(id));
    p.release(id);
  }
}

TEST_CASE("pager: files that refuse direct I/O are counted, not hidden") {
  Fixture fx(3, 54, "pager_refused.bin");
  Pager p(config(3, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  bool old = DirectFile::refuse_direct_for_testing(true);
  fx.register_pages(p);
  DirectFile::refuse_direct_for_testing(old);
  CHECK_EQ(p.stats().buffered_files, 1u);
  CHECK_EQ(p.stats().direct_files, 0u);
  CHECK(p.file_mode(0) == IoMode::buffered_drop);
  for (PageId id : {0, 1, 2}) {
    Frame f = p.acquire(id);
    CHECK(fx.frame_ok(f, static_cast<int>(id)));
    p.release(id);
  }
}

TEST_CASE("pager: optimal policy reads exactly Belady's minimum over forward-then-backward") {
  Fixture fx(12, 41, "pager_fb.bin");
  for (int first_adapted : {0, 5}) {
    auto order = forward_backward(12, first_adapted);
    for (int k : {1, 2, 3, 5, 8, 12, 13}) {
      for (int readahead : {0, 1, 3}) {
        if (k == 1 && readahead > 0)
          continue;  // no room to read ahead
        std::uint64_t budget = k * kPage;
        Pager p(config(k, Policy::optimal, readahead), std::make_shared<HeapFrameAllocator>());
        fx.register_pages(p);
        std::uint64_t got = run_schedule(p, fx, order, 3, budget);
        std::uint64_t want = belady_loads(order, 3, k);
        if (got != want) {
          std::cerr << "  k=" << k << " readahead=" << readahead
                    << " first_adapted=" << first_adapted << ": read " << got << " pages, Belady "
                    << want << "\n";
        }
        CHECK_EQ(got, want);
      }
    }
  }
}

TEST_CASE("pager: a repeating schedule reads Belady's per-step minimum in steady state") {
  // Told only one step and that it repeats, the pager reads per step what MIN
  // reads per step in the middle of a long run.
  Fixture fx(12, 53, "pager_cyc.bin");
  for (int first_adapted : {0, 4}) {
    auto order = forward_backward(12, first_adapted);
    for (int k : {2, 5, 9}) {
      for (int readahead : {0, 2}) {
        Pager p(config(k, Policy::optimal, readahead), std::make_shared<HeapFrameAllocator>());
        fx.register_pages(p);
        p.set_schedule(order, /*repeat=*/true);
        std::uint64_t before = 0;
        for (int c = 0; c < 4; ++c) {
          if (c == 2)
            before = settled(p).pages_read;
          for (PageId id : order) {
            Frame f = p.acquire(id);
            CHECK(fx.frame_ok(f, static_cast<int>(id)));
            f = Frame{};
            p.release(id);
          }
        }
        std::uint64_t per_step = (settled(p).pages_read - before) / 2;
        std::uint64_t want = (belady_loads(order, 8, k) - belady_loads(order, 6, k)) / 2;
        CHECK_EQ(per_step, want);
      }
    }
  }
}

TEST_CASE("pager: lru matches the LRU simulator, and never beats Belady") {
  Fixture fx(10, 42, "pager_lru.bin");
  // A cyclic forward-only order is LRU's worst case.
  std::vector<PageId> cyclic;
  for (int i = 0; i < 10; ++i)
    cyclic.push_back(i);
  for (auto order : {forward_backward(10), cyclic}) {
    for (int k : {2, 4, 7}) {
      Pager p(config(k, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
      fx.register_pages(p);
      std::uint64_t got = run_schedule(p, fx, order, 3, k * kPage);
      CHECK_EQ(got, lru_loads(order, 3, k));
      CHECK(got >= belady_loads(order, 3, k));
      std::cerr << "  k=" << k << " schedule=" << (order.size() == 10 ? "cyclic" : "fwd+bwd")
                << ": lru " << got << " pages, Belady " << belady_loads(order, 3, k) << "\n";
    }
  }
}

TEST_CASE(
    "pager: optimal equals Belady on random schedules, with and without readahead, frames kept or "
    "not") {
  Fixture fx(9, 43, "pager_rand.bin");
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<PageId> order;
    int len = 5 + static_cast<int>(rng() % 30);
    for (int i = 0; i < len; ++i)
      order.push_back(rng() % 9);
    int k = 1 + static_cast<int>(rng() % 6);
    for (int readahead : {0, 1, 4}) {
      for (bool keep : {false, true}) {
        PagerConfig c = config(k, Policy::optimal, readahead);
        c.keep_free_frames = keep;  // reusing frames changes no decision
        Pager p(c, std::make_shared<HeapFrameAllocator>());
        fx.register_pages(p);
        CHECK_EQ(run_schedule(p, fx, order, 2, k * kPage), belady_loads(order, 2, k));
      }
    }
  }
}

TEST_CASE("pager: readahead overlaps reads with compute and is counted") {
  Fixture fx(8, 44, "pager_ra.bin");
  Pager p(config(4, Policy::optimal, 2), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule(forward_backward(8));
  for (PageId id : forward_backward(8)) {
    Frame f = p.acquire(id);
    CHECK(fx.frame_ok(f, static_cast<int>(id)));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // "compute"
    p.release(id);
  }
  VmStat s = p.stats();
  CHECK(s.readahead_reads > 0);
  CHECK(s.readahead_hits >= s.readahead_reads - 2);
  CHECK(s.faults <= 1);  // only the very first page is a demand fault
}

TEST_CASE("pager: aggressive readahead starts the next streamed page while this one is in use") {
  // 8 blocks, backward down to block 4, 4 pages of budget: MIN keeps blocks
  // 4..6 and streams 0..3 and 7 through one slot, so conservative readahead
  // cannot start block j+1 before block j is released; aggressive can.
  Fixture fx(8, 55, "pager_aggr.bin");
  auto order = forward_backward(8, 4);
  for (bool aggressive : {false, true}) {
    PagerConfig c = config(4, Policy::optimal, 2);
    c.readahead_aggressive = aggressive;
    Pager p(c, std::make_shared<HeapFrameAllocator>());
    fx.register_pages(p);
    p.set_schedule(order);
    int overlapped = 0;
    for (int cycle = 0; cycle < 3; ++cycle) {
      for (std::size_t k = 0; k < order.size(); ++k) {
        PageId id = order[k];
        Frame f = p.acquire(id);
        CHECK(fx.frame_ok(f, static_cast<int>(id)));
        CHECK(p.stats().resident_bytes_now <= 4 * kPage);
        PageId next = order[(k + 1) % order.size()];
        if (cycle == 2 && id <= 2 && next == id + 1 && p.state(next) != PageState::on_disk) {
          ++overlapped;  // block id+1 is on its way while id is in use
        }
        f = Frame{};
        p.release(id);
      }
    }
    CHECK_EQ(overlapped, aggressive ? 3 : 0);
    // Aggressive never reads fewer pages than MIN, and reads them all right.
    CHECK(settled(p).pages_read >= belady_loads(order, 3, 4));
  }
}

TEST_CASE("pager: conservative readahead evicts an idle page that MIN evicts anyway") {
  // 4 blocks of 2 parts (pages 2b, 2b+1), each block's parts held together,
  // backward down to block 2, room for 4 pages. Reading block 1's second
  // part (page 3) while block 0 is released and block 1's first part in
  // use, MIN would evict page 2 (used furthest ahead, in use). Block 0's
  // idle parts go before their next use under MIN all the same:
  // conservative readahead evicts one of them and reads page 3 ahead, where
  // it used to wait and page 3 was a fault every step. Reads: no more than
  // aggressive mode, which evicts any idle page not needed first.
  Fixture fx(8, 66, "pager_idle.bin");
  std::vector<std::vector<PageId>> accesses;
  for (PageId b = 0; b < 4; ++b) {
    accesses.push_back({2 * b, 2 * b + 1});
  }
  for (PageId b = 3; b >= 2; --b) {
    accesses.push_back({2 * b + 1, 2 * b});
  }
  std::vector<PageId> order;
  for (auto& a : accesses) {
    order.insert(order.end(), a.begin(), a.end());
  }
  std::uint64_t reads[2] = {0, 0};
  for (bool aggressive : {false, true}) {
    PagerConfig c = config(4, Policy::optimal, 4);
    c.readahead_aggressive = aggressive;
    Pager p(c, std::make_shared<HeapFrameAllocator>());
    fx.register_pages(p);
    p.set_schedule(order);
    std::set<PageId> faulted;  // in steady state (after the first cycle)
    for (int cycle = 0; cycle < 3; ++cycle) {
      for (const auto& a : accesses) {
        std::vector<Frame> held;
        for (PageId id : a) {
          std::uint64_t before = p.stats().faults;
          held.push_back(p.acquire(id));
          CHECK(fx.frame_ok(held.back(), static_cast<int>(id)));
          if (cycle > 0 && p.stats().faults != before) {
            faulted.insert(id);
          }
        }
        settled(p);  // "compute": the reads readahead started land
        CHECK(p.stats().resident_bytes_now <= 4 * kPage);
        held.clear();
        for (auto it = a.rbegin(); it != a.rend(); ++it) {
          p.release(*it);
        }
      }
    }
    VmStat s = settled(p);
    CHECK_EQ(faulted.count(3), 0u);
    CHECK_EQ(s.readahead_idle_evictions > 0, !aggressive);
    reads[aggressive] = s.pages_read;
  }
  CHECK(reads[0] <= reads[1]);
}

TEST_CASE("pager: the budget holds with many threads racing readahead and faults") {
  Fixture fx(16, 45, "pager_race.bin");
  const int k = 6;
  Pager p(config(k, Policy::optimal, 3), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule(forward_backward(16));
  // Widen the race windows: every chunk read sleeps a little.
  p.set_fault_injector([](const std::string&, std::uint64_t, std::size_t&, int&) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  });
  std::atomic<bool> bad{false};
  std::atomic<bool> stop{false};
  std::thread watcher([&] {
    while (!stop) {
      if (p.stats().resident_bytes_now > k * kPage)
        bad = true;
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 150; ++i) {
        PageId id = rng() % 16;
        try {
          Frame f = p.acquire(id);
          if (!fx.frame_ok(f, static_cast<int>(id)))
            bad = true;
          p.release(id);
        } catch (const BudgetError&) {
          // 4 threads may hold 4 pages; with readahead in flight a fault can
          // find no room, which is an error, never a budget overrun.
        }
      }
    });
  }
  for (auto& t : threads)
    t.join();
  stop = true;
  watcher.join();
  CHECK(!bad.load());
  CHECK(p.stats().peak_resident_bytes <= k * kPage);
}

TEST_CASE("pager: a failed read names the page and file, and a retry succeeds") {
  Fixture fx(3, 46, "pager_eio.bin");
  Pager p(config(3, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_fault_injector([](const std::string&, std::uint64_t off, std::size_t&, int& err) {
    if (off >= kPage && off < 2 * kPage)
      err = EIO;
  });
  CHECK_THROWS_WITH(p.acquire(1), "page 'block.1'");
  CHECK_THROWS_WITH(p.acquire(1), "pager_eio.bin");
  CHECK(p.state(1) == PageState::on_disk);
  CHECK_EQ(p.stats().resident_bytes_now, 0u);  // the failed frame was freed
  CHECK(p.stats().read_errors >= 2);
  CHECK_EQ(p.stats().faults, 2u);  // one read per acquire, however fast it failed
  p.set_fault_injector({});
  Frame f = p.acquire(1);
  CHECK(fx.frame_ok(f, 1));
  p.release(1);
  CHECK_EQ(p.stats().faults, 3u);
  CHECK_EQ(p.stats().hits, 0u);
}

TEST_CASE("pager: a demand read that lands before its acquire looks again is a fault, not a hit") {
  // start_read_locked drops the lock to submit; the I/O threads may land
  // (or fail) a small read before the acquiring thread takes it back. Two
  // pages through a one-page budget, no readahead: every acquire is a read.
  // One chunk per read, and a thread contending for the pager's lock, so
  // that the race happens often.
  Fixture fx(2, 48, "pager_fast.bin");
  PagerConfig c = config(1, Policy::lru, 0);
  c.io_chunk_bytes = kPage;
  Pager p(c, std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  std::atomic<bool> stop{false};
  std::thread contender([&] {
    while (!stop.load()) {
      (void)p.stats();
    }
  });
  constexpr int kRounds = 5000;
  for (int i = 0; i < kRounds; ++i) {
    Frame f = p.acquire(i % 2);
    CHECK(fx.frame_ok(f, i % 2));
    p.release(i % 2);
  }
  stop = true;
  contender.join();
  VmStat st = p.stats();
  CHECK_EQ(st.pages_read, static_cast<std::uint64_t>(kRounds));
  CHECK_EQ(st.faults, static_cast<std::uint64_t>(kRounds));
  CHECK_EQ(st.hits, 0u);
}

TEST_CASE(
    "pager: a page that lands while its acquire waits is not evicted before the acquire takes it") {
  // The acquire moves the cursor past the page, then waits for its read.
  // When the read lands, readahead (run on landing, on any thread) looks at
  // the next page; the landed page's next use is then a whole cycle away,
  // so MIN would pick it. It is wanted now: a waiting acquire holds it.
  // Three pages through a one-page budget, readahead 1: every page is read
  // exactly once a cycle (no read, no eviction more), whoever wins the lock.
  Fixture fx(3, 49, "pager_waiter.bin");
  PagerConfig c = config(1, Policy::optimal, 1);
  c.io_chunk_bytes = kPage;
  Pager p(c, std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule({0, 1, 2});
  // Another thread runs readahead all the time, as MLX's threads do when
  // they let go of leased pages (release_lease) or of evicted memory.
  std::atomic<bool> stop{false};
  std::thread contender([&] {
    while (!stop.load()) {
      (void)p.set_readahead_aggressive(false);
    }
  });
  constexpr int kRounds = 1000;
  for (int i = 0; i < kRounds; ++i) {
    Frame f = p.acquire(i % 3);
    CHECK(fx.frame_ok(f, i % 3));
    f = Frame{};
    p.release(i % 3);
  }
  stop = true;
  contender.join();
  VmStat st = settled(p);
  // The last release may have read the next cycle's first page ahead.
  CHECK(st.pages_read >= static_cast<std::uint64_t>(kRounds));
  CHECK(st.pages_read <= static_cast<std::uint64_t>(kRounds) + 1);
  CHECK_EQ(st.hits + st.readahead_hits + st.faults, static_cast<std::uint64_t>(kRounds));
}

TEST_CASE("pager: readahead that races an acquire does not skip the pages the cursor moved by") {
  // readahead() drops the lock to allocate each frame; an acquire meanwhile
  // moves the schedule's cursor. The pass must look again from the new
  // cursor: going on at the new cursor + k skipped the next pages (on a
  // tight budget they were then read as faults, after the pages behind
  // them had taken the room). Pages of distinct sizes, so the allocator
  // knows which page it allocates for; ample budget, so readahead never
  // has a reason to start a page while an earlier one of its window is on
  // disk.
  constexpr int kPages = 6;
  auto bytes_of = [](int i) { return kPage + static_cast<std::uint64_t>(i) * 4096; };
  auto path = check::pattern_file("pager_ra_race.bin", kPages * 2 * kPage, 53);
  for (int round = 0; round < 20; ++round) {
    auto alloc = std::make_shared<GatedAllocator>();
    PagerConfig c = config(4 * kPages, Policy::optimal, 3);
    Pager p(c, alloc);
    FileId f = p.add_file(path);
    for (int i = 0; i < kPages; ++i) {
      PageSpec s;
      s.name = "block." + std::to_string(i);
      s.frame_bytes = bytes_of(i);
      s.extents.push_back(Extent{f, i * 2 * kPage, bytes_of(i), bytes_of(i), 0});
      p.add_page(std::move(s));
    }
    p.acquire(0);  // resident before the schedule
    p.release(0);
    std::atomic<int> skipped{0};
    std::atomic<bool> first{true};
    std::thread other;
    alloc->hook = [&](std::uint64_t b) {
      int page = static_cast<int>((b - kPage) / 4096);
      for (int q = 0; q < page; ++q) {
        skipped += p.state(q) == PageState::on_disk;
      }
      if (page == 1 && first.exchange(false)) {
        // The pass is starting page 1: an acquire of page 1 moves the cursor
        // past it (and waits for its read).
        other = std::thread([&] {
          p.acquire(1);
          p.release(1);
        });
        while (p.stats().acquires < 2) {
          std::this_thread::yield();
        }
      }
    };
    p.set_schedule({0, 1, 2, 3, 4, 5}, true);  // its readahead pass runs here
    other.join();
    for (int i = 0; i < kPages; ++i) {
      Frame fr = p.acquire(i);  // every page reads back whole
      CHECK(check::matches_pattern(fr.data, bytes_of(i), 53, i * 2 * kPage));
      p.release(i);
    }
    CHECK_EQ(skipped.load(), 0);
    alloc->hook = nullptr;
  }
}

TEST_CASE("pager: evict_all waits for a readahead in flight and drops it too") {
  // A cold start (benchmarks, tests counting a step's reads) must find
  // nothing in memory: a readahead read in flight when evict_all ran used to
  // land resident after it returned.
  Fixture fx(4, 57, "pager_evict_flight.bin");
  auto alloc = std::make_shared<GatedAllocator>();
  Pager p(config(4, Policy::optimal, 1), alloc);
  fx.register_pages(p);
  std::atomic<bool> started{false};
  alloc->hook = [&](std::uint64_t) {
    started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // page 0 in flight
  };
  std::thread ahead([&] { p.set_schedule({0, 1, 2, 3}); });  // reads page 0 ahead
  while (!started.load()) {
    std::this_thread::yield();
  }
  CHECK(p.state(0) == PageState::in_flight);
  CHECK_EQ(p.stats().in_flight_pages_now, 1u);
  CHECK_EQ(p.stats().in_flight_bytes_now, p.read_bytes(0));  // what its read will add to bytes_read
  p.set_readahead(0);
  p.evict_all();
  ahead.join();
  alloc->hook = nullptr;
  for (PageId id = 0; id < 4; ++id) {
    CHECK(p.state(id) == PageState::on_disk);
  }
  CHECK_EQ(p.stats().pages_read, 1u);
  CHECK_EQ(p.stats().resident_bytes_now, 0u);
  CHECK_EQ(p.stats().in_flight_bytes_now, 0u);
}

TEST_CASE("pager: a file shorter than its pages is an error, not a crash") {
  auto path = check::pattern_file("pager_trunc.bin", kPage + 100, 47);
  Pager p(config(4, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  FileId f = p.add_file(path);
  PageSpec s{"block.1", kPage, {Extent{f, kPage, kPage, kPage, 0}}, 0};
  PageId id = p.add_page(s);
  CHECK_THROWS_WITH(p.acquire(id), "page 'block.1'");
}

TEST_CASE("pager: a budget too small for a page says what would fit") {
  Fixture fx(2, 48, "pager_small.bin");
  Pager p(config(0, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  p.set_budget(kPage / 2);
  fx.register_pages(p);
  CHECK_THROWS_WITH(p.acquire(0), "raise the budget to at least 65536");
  p.set_budget(kPage);
  Frame f = p.acquire(0);
  CHECK_THROWS_WITH(p.acquire(1), "every resident page is acquired or pinned");
  p.release(0);
  f = Frame{};       // drop our view of page 0 too, or its memory stays charged
  f = p.acquire(1);  // now 0 can be evicted
  p.release(1);
}

TEST_CASE("pager: memory still referenced after eviction counts until freed") {
  Fixture fx(3, 49, "pager_zombie.bin");
  Pager p(config(2, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  Frame held = p.acquire(0);
  p.release(0);
  Frame f1 = p.acquire(1);
  p.release(1);
  // Page 2 needs room: page 0 is evicted, but `held` still pins its memory.
  std::thread dropper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    held = Frame{};
  });
  Frame f2 = p.acquire(2);  // waits for the drop instead of overrunning
  dropper.join();
  CHECK(fx.frame_ok(f2, 2));
  CHECK(p.stats().peak_resident_bytes <= 2 * kPage);
  p.release(2);
}

TEST_CASE("pager: readahead starts once memory it waited for is freed, with no acquire") {
  // The streamed tail's case: a page the pager evicted is still viewed by an
  // array (MLX's stream computing with it), so readahead finds the budget
  // full. Freeing that memory must start the next read at once, not at the
  // next acquire.
  Fixture fx(3, 52, "pager_free_readahead.bin");
  Pager p(config(2, Policy::optimal, 2), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule({0, 1, 2, 1}, /*repeat=*/false);
  Frame held = p.acquire(0);
  p.release(0);
  Frame f1 = p.acquire(1);
  f1 = Frame{};
  p.release(1);
  // Page 2 is next: readahead evicts page 0 (never used again), whose memory
  // `held` still views, and stops.
  CHECK(p.state(2) == PageState::on_disk);
  CHECK(p.state(0) == PageState::on_disk);
  VmStat before = p.stats();  // page 1 was read ahead while 0 was in use
  held = Frame{};
  // The read is counted once its frame is allocated (after the page left
  // the disk): wait for the count.
  for (int i = 0; i < 5000 && p.stats().readahead_reads == before.readahead_reads; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(p.state(2) != PageState::on_disk);  // the readahead thread started it
  CHECK(p.stats().readahead_reads == before.readahead_reads + 1);
  Frame f2 = p.acquire(2);
  CHECK(fx.frame_ok(f2, 2));
  f2 = Frame{};
  p.release(2);
  VmStat s = settled(p);
  CHECK(s.readahead_hits == before.readahead_hits + 1);
  CHECK(s.peak_resident_bytes <= 2 * kPage);
}

TEST_CASE("pager: a leased page stays in use until its lease ends, on any thread") {
  // Lazily read pages (paged_tensor.h): the arrays viewing the frame hold a
  // lease and end it when MLX frees them, on whatever thread. Until then the
  // page is in use: a fault that needs its room waits instead of evicting
  // it under its views (and then evicting more, as the freed memory is
  // not free yet).
  Fixture fx(3, 55, "pager_lease.bin");
  Pager p(config(2, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  Frame f0 = p.acquire_lease(0);
  Frame f1 = p.acquire(1);
  p.release(1);
  f1 = Frame{};
  // Page 2 needs a frame: page 1 (released) is evicted, page 0 kept.
  Frame f2 = p.acquire(2);
  CHECK(p.state(0) == PageState::resident);
  p.release(2);
  f2 = Frame{};
  // Page 1 again: the budget holds 0 (leased, the least recently used) and
  // 2; 2 goes, 0 stays.
  Frame g1 = p.acquire(1);
  CHECK(p.state(0) == PageState::resident);
  p.release(1);
  g1 = Frame{};
  std::thread ender([&] {
    f0 = Frame{};
    p.release_lease(0);
  });
  ender.join();
  // The lease ended: page 0 is evictable now.
  Frame g2 = p.acquire(2);
  p.release(2);
  CHECK(fx.frame_ok(g2, 2));
  CHECK(p.state(0) == PageState::on_disk);
  CHECK(p.stats().peak_resident_bytes <= 2 * kPage);
}

TEST_CASE("pager: a fault waits for leased pages to be let go of, then gives up clearly") {
  Fixture fx(3, 57, "pager_lease_wait.bin");
  Pager p(config(1, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  Frame f0 = p.acquire_lease(0);
  std::thread ender([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    f0 = Frame{};
    p.release_lease(0);
  });
  auto t0 = std::chrono::steady_clock::now();
  Frame f1 = p.acquire(1);  // waits for the lease, then evicts page 0
  CHECK(std::chrono::steady_clock::now() - t0 >= std::chrono::milliseconds(90));
  CHECK(fx.frame_ok(f1, 1));
  ender.join();
  // A lease nobody ends: the fault waits its while, then says why.
  Frame held = p.acquire_lease(2 - 1);  // page 1, already resident
  p.release(1);
  CHECK_THROWS_WITH(p.acquire(2), "still in use by arrays viewing it");
  held = Frame{};
  p.release_lease(1);
}

TEST_CASE("pager: readahead starts once a lease it waited for ends, with no acquire") {
  // Conservative readahead waits while MIN's victim is in use; the lease's
  // end (on a thread that is not the pager's) wakes the readahead thread.
  Fixture fx(3, 58, "pager_lease_readahead.bin");
  Pager p(config(1, Policy::optimal, 2), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule({0, 1, 2}, /*repeat=*/false);
  Frame f0 = p.acquire_lease(0);
  CHECK(p.state(1) == PageState::on_disk);  // no room: 0 is in use
  std::thread ender([&] {
    f0 = Frame{};
    p.release_lease(0);
  });
  ender.join();
  for (int i = 0; i < 5000 && p.state(1) == PageState::on_disk; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(p.state(1) != PageState::on_disk);
  Frame f1 = p.acquire(1);
  CHECK(fx.frame_ok(f1, 1));
  p.release(1);
}

TEST_CASE("pager: wait_off_disk returns when told, and at once for a page in memory") {
  Fixture fx(2, 53, "pager_wait_off_disk.bin");
  Pager p(config(2, Policy::optimal, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  std::atomic<bool> done{false};
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    done = true;
  });
  CHECK(!p.wait_off_disk(1, done));  // nothing reads page 1: `done` ends the wait
  setter.join();
  Frame f = p.acquire(0);
  std::atomic<bool> not_yet{false};
  CHECK(p.wait_off_disk(0, not_yet));
  f = Frame{};
  p.release(0);
}

TEST_CASE("pager: pinned pages are never evicted and are mlocked where allowed") {
  Fixture fx(4, 50, "pager_pin.bin");
  Pager p(config(2, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.pin(0);
  for (int round = 0; round < 3; ++round) {
    for (PageId id : {1, 2, 3}) {
      Frame f = p.acquire(id);
      CHECK(fx.frame_ok(f, static_cast<int>(id)));
      p.release(id);
    }
  }
  CHECK(p.state(0) == PageState::resident);
  VmStat s = p.stats();
  CHECK_EQ(s.pinned_bytes_now, kPage);
  std::cerr << "  mlocked " << s.mlocked_bytes_now << " of " << s.pinned_bytes_now
            << " pinned bytes\n";
  p.unpin(0);
  p.evict_all();
  CHECK(p.state(0) == PageState::on_disk);
}

TEST_CASE("pager: priority classes decide the eviction order first") {
  Fixture fx(4, 51, "pager_prio.bin");
  Pager p(config(3, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p, /*priority_every=*/2);  // pages 0 and 2 are class 1
  for (PageId id : {0, 1, 2}) {
    p.acquire(id);
    p.release(id);
  }
  p.acquire(3);  // must evict page 1, the only class-0 page, though 0 is older
  p.release(3);
  CHECK(p.state(1) == PageState::on_disk);
  CHECK(p.state(0) == PageState::resident);
}

TEST_CASE("pager: a frame reused a page larger is charged within charge_bound, not footprint") {
  // Page 0 one 4 KB page larger than pages 1 and 2: its free frame is
  // reused for page 2 (within reuse_slack) and charged as it is.
  const std::uint64_t small = kPage - 4096;
  std::string path = check::pattern_file("pager_bound.bin", 3 * kPage, 61);
  PagerConfig c = config(2, Policy::lru, 0);
  c.keep_free_frames = true;
  Pager p(c, std::make_shared<HeapFrameAllocator>());
  FileId f = p.add_file(path);
  for (int i = 0; i < 3; ++i) {
    PageSpec s;
    s.name = "part." + std::to_string(i);
    s.frame_bytes = i == 0 ? kPage : small;
    s.extents.push_back(Extent{f, i * kPage, s.frame_bytes, s.frame_bytes, 0});
    p.add_page(std::move(s));
  }
  HeapFrameAllocator heap;
  CHECK_EQ(p.charge_bound(0), heap.footprint(kPage) + reuse_slack(heap.footprint(kPage)));
  CHECK_EQ(p.frame_charge_bound(small), p.charge_bound(1));
  p.acquire(0);
  p.release(0);
  p.acquire(1);
  p.release(1);
  Frame f2 = p.acquire(2);  // evicts page 0 (LRU) and reads into its frame
  CHECK(check::matches_pattern(f2.data, small, 61, 2 * kPage));
  CHECK_EQ(p.stats().frames_reused, 1u);
  std::uint64_t charged = p.stats().resident_bytes_now;
  CHECK(charged > heap.footprint(small) * 2);  // more than the footprints
  CHECK(charged <= p.charge_bound(1) + p.charge_bound(2));
  p.release(2);
}

TEST_CASE("pager: an evicted page's unreferenced frame stays charged and the next read reuses it") {
  Fixture fx(4, 57, "pager_keep.bin");
  PagerConfig c = config(2, Policy::lru, 0);
  c.keep_free_frames = true;
  Pager p(c, std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  char* d0 = p.acquire(0).data;
  p.release(0);
  p.acquire(1);
  p.release(1);
  std::uint64_t charged = p.stats().resident_bytes_now;
  // Page 2 needs room: LRU evicts page 0, whose frame nothing references.
  Frame f2 = p.acquire(2);
  CHECK(f2.data == d0);
  CHECK(fx.frame_ok(f2, 2));
  VmStat s = p.stats();
  CHECK_EQ(s.frames_reused, 1u);
  CHECK_EQ(s.resident_bytes_now, charged);
  CHECK_EQ(s.free_frame_bytes_now, 0u);
  // A frame still referenced when its page is evicted is never handed to
  // another page: page 3 evicts page 2 (LRU), still viewed by `f2`, then
  // page 1, whose frame it reads into.
  p.release(2);
  p.acquire(1);
  p.release(1);
  char* d1 = nullptr;
  {
    Frame f1 = p.acquire(1);
    d1 = f1.data;
    p.release(1);
  }
  Frame f3 = p.acquire(3);
  CHECK(f3.data != f2.data);
  CHECK(f3.data == d1);
  CHECK(fx.frame_ok(f3, 3));
  CHECK(fx.frame_ok(f2, 2));  // untouched while it is viewed
  CHECK_EQ(p.stats().frames_reused, 2u);
  CHECK(p.stats().peak_resident_bytes <= 2 * kPage);
  f2 = Frame{};
  f3 = Frame{};
  p.release(3);
}

TEST_CASE("pager: frames fill from the page pool, which holds only the budget's room") {
  if (!PagePool::supported()) {
    return;
  }
  // Pages streamed through a budget of 3, then one of twice the size:
  // charged pages plus the pool never pass the budget.
  Fixture fx(4, 59, "pager_pool.bin");
  auto alloc = std::make_shared<HeapFrameAllocator>();
  PagePool* pool = alloc->pool();
  REQUIRE(pool != nullptr);
  std::uint64_t pool_left = 0;
  {
    Pager p(config(3, Policy::lru, 0), alloc);
    fx.register_pages(p);
    FileId file = p.add_file(fx.path);
    PageSpec big;
    big.name = "big";
    big.frame_bytes = 2 * kPage;
    big.extents.push_back(Extent{file, 0, 2 * kPage, 2 * kPage, 0});
    PageId b = p.add_page(std::move(big));
    auto within = [&] { return p.stats().resident_bytes_now + pool->bytes() <= p.budget(); };
    for (PageId id : {0, 1, 2, 3, 0, 1}) {
      p.acquire(id);
      p.release(id);
      CHECK(within());
    }
    // Freed frames' pages went to the pool, and the next frames took them
    // (malloc hands a freed chunk out again: its pages had left).
    CHECK(pool->taken_bytes() > 0);
    CHECK(pool->filled_bytes() > 0);
    p.evict_all();
    CHECK(within());
    CHECK_EQ(p.stats().resident_bytes_now, 0u);
    // A frame of another size: whatever malloc hands out unpopulated comes
    // from the pool; the rest of the pool goes if the budget has no room.
    Frame fb = p.acquire(b);
    CHECK(check::matches_pattern(fb.data, 2 * kPage, fx.seed, 0));
    CHECK(within());
    fb = Frame{};
    p.release(b);
    p.evict_all();
    CHECK(pool->bytes() > 0);
    // A smaller budget trims the pool to its room.
    p.acquire(0);
    p.set_budget(kPage + kPage / 2);
    CHECK(within());
    p.release(0);
    pool_left = pool->bytes();
    CHECK(pool_left <= kPage / 2);
  }
  // The pager gone, nothing bounds the pool: it holds nothing.
  CHECK_EQ(pool->bytes(), 0u);
  Frame f = alloc->allocate(kPage, [] {});
  f = Frame{};
  CHECK_EQ(pool->bytes(), 0u);
}

TEST_CASE("pager: a kept frame that fits no read is dropped before another page is evicted") {
  Fixture fx(4, 58, "pager_keep_drop.bin");
  PagerConfig c = config(3, Policy::lru, 0);
  c.keep_free_frames = true;
  Pager p(c, std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  FileId file = p.add_file(fx.path);
  PageSpec big;  // twice a page: no page's frame fits it
  big.name = "big";
  big.frame_bytes = 2 * kPage;
  big.extents.push_back(Extent{file, 0, 2 * kPage, 2 * kPage, 0});
  PageId b = p.add_page(std::move(big));
  for (PageId id : {0, 1, 2}) {
    p.acquire(id);
    p.release(id);
  }
  // Shrinking evicts page 0 and drops its frame: the budget holds.
  p.set_budget(2 * kPage);
  VmStat s = p.stats();
  CHECK_EQ(s.resident_bytes_now, 2 * kPage);
  CHECK_EQ(s.free_frame_bytes_now, 0u);
  p.set_budget(3 * kPage);
  p.acquire(3);  // room without evicting: a frame of its own
  p.release(3);
  p.acquire(0);  // evicts page 1 (LRU) and reads into its frame
  p.release(0);
  CHECK_EQ(p.stats().frames_reused, 1u);
  // The big page evicts page 2, whose frame is dropped (it does not fit),
  // then page 3: two evictions for two pages of room, not three.
  Frame fb = p.acquire(b);
  CHECK(check::matches_pattern(fb.data, 2 * kPage, fx.seed, 0));
  s = p.stats();
  CHECK_EQ(s.evictions, 4u);  // 0 (shrink), 1, 2, 3
  CHECK_EQ(s.frames_reused, 1u);
  CHECK_EQ(s.resident_bytes_now, 3 * kPage);
  CHECK_EQ(s.free_frame_bytes_now, 0u);
  CHECK_EQ(p.drop_free_frames(), 0u);
  fb = Frame{};
  p.release(b);
}

TEST_CASE("pager: lowering the budget evicts down to it") {
  Fixture fx(4, 52, "pager_shrink.bin");
  Pager p(config(4, Policy::lru, 0), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  for (PageId id : {0, 1, 2, 3}) {
    p.acquire(id);
    p.release(id);
  }
  CHECK_EQ(p.set_budget(2 * kPage), 4 * kPage);
  CHECK(p.stats().resident_bytes_now <= 2 * kPage);
}

TEST_CASE("pager: set_readahead returns the previous value and clamps at 0") {
  Pager p(config(2, Policy::lru, 3), std::make_shared<HeapFrameAllocator>());
  CHECK_EQ(p.readahead_pages(), 3);
  CHECK_EQ(p.set_readahead(-1), 3);
  CHECK_EQ(p.readahead_pages(), 0);
  CHECK_EQ(p.set_readahead(2), 0);
  CHECK_EQ(p.readahead_pages(), 2);
}

TEST_CASE(
    "pager: set_readahead_aggressive returns the previous mode; readahead_aggressive reads it") {
  Pager p(config(2, Policy::lru, 3), std::make_shared<HeapFrameAllocator>());
  CHECK(!p.readahead_aggressive());
  CHECK(!p.set_readahead_aggressive(true));
  CHECK(p.readahead_aggressive());
  CHECK(p.set_readahead_aggressive(false));
  CHECK(!p.readahead_aggressive());
}

TEST_CASE("pager: discard drops a rewritten page, so the next acquire reads the new bytes") {
  Fixture fx(3, 53, "pager_discard.bin");
  Pager p(config(3, Policy::optimal, 2), std::make_shared<HeapFrameAllocator>());
  fx.register_pages(p);
  p.set_schedule({0, 1, 2});
  Frame f = p.acquire(1);
  CHECK(fx.frame_ok(f, 1));
  CHECK_THROWS_WITH(p.discard(1), "held or pinned");  // held: a caller bug
  p.release(1);
  // Rewrite page 1's bytes on disk with page 2's pattern, then discard.
  std::vector<char> other(kPage);
  {
    Frame g = p.acquire(2);
    std::memcpy(other.data(), g.data, kPage);
    p.release(2);
  }
  rewrite_swap_range(fx.path, kPage, other.data(), other.size());
  p.discard(1);
  CHECK(p.state(1) == PageState::on_disk);
  Frame h = p.acquire(1);
  CHECK(std::memcmp(h.data, other.data(), kPage) == 0);
  p.release(1);
  // Discarding a page that is not in memory is a no-op; readahead may be
  // reading it: discard waits for that read and drops it.
  p.discard(0);
  p.discard(1);
  CHECK(p.state(1) == PageState::on_disk);
  CHECK(p.stats().resident_bytes_now <= 3 * kPage);
}
