// trace_tests.cpp: the trace recorder (off by default, bounded, drained by
// take), and the pager's events checked against its own counters: every
// read's chunks on I/O threads sum to its bytes, reads' totals are the
// bytes_read counter, waits sum to io_wait_ns, evictions are counted.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "check.h"
#include "mm/checksum.h"
#include "mm/pager.h"
#include "test_files.h"

using namespace mlx_pager;

namespace {

constexpr std::uint64_t kPage = 64 * 1024;
constexpr int kIoThreads = 3;

PagerConfig config(std::uint64_t pages_budget, int readahead) {
  PagerConfig c;
  c.budget_bytes = pages_budget * kPage;
  c.policy = Policy::optimal;
  c.readahead_pages = readahead;
  c.io_threads = kIoThreads;
  c.io_chunk_bytes = 16 * 1024;  // 4 chunks per page
  return c;
}

void register_pages(Pager& p, const std::string& path, int n) {
  FileId f = p.add_file(path);
  for (int i = 0; i < n; ++i) {
    PageSpec s;
    s.name = "block." + std::to_string(i);
    s.frame_bytes = kPage;
    s.extents.push_back(Extent{f, i * kPage, kPage, kPage, 0});
    p.add_page(std::move(s));
  }
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

VmStat settled(Pager& p) {
  for (int i = 0; i < 5000 && p.stats().in_flight_pages_now > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return p.stats();
}

// Forward 0..n-1 then backward n-1..0, `cycles` times.
void run(Pager& p, int n, int cycles) {
  std::vector<PageId> order;
  for (int i = 0; i < n; ++i)
    order.push_back(i);
  for (int i = n - 1; i >= 0; --i)
    order.push_back(i);
  p.set_schedule(order);
  for (int c = 0; c < cycles; ++c) {
    for (PageId id : order) {
      p.acquire(id);
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // "compute"
      p.release(id);
    }
  }
}

}  // namespace

TEST_CASE("trace: the recorder keeps nothing while off, everything while on, until taken") {
  TraceRecorder r;
  CHECK(!r.enabled());
  TraceEvent e;
  e.kind = TraceKind::evict;
  e.page = 7;
  r.record(e);
  CHECK(r.take().empty());
  r.enable(true);
  std::int64_t t0 = TraceRecorder::now_ns();
  e.start_ns = e.end_ns = t0;
  r.record(e);
  e.page = 8;
  r.record(e);
  auto got = r.take();
  REQUIRE(got.size() == 2u);
  CHECK_EQ(got[0].page, 7u);
  CHECK_EQ(got[1].page, 8u);
  CHECK(r.take().empty());  // taken once
  CHECK(TraceRecorder::now_ns() >= t0);
  CHECK_EQ(std::string(to_string(TraceKind::reclaim)), std::string("reclaim"));
}

TEST_CASE("trace: events nobody takes are bounded, and the dropped ones counted") {
  TraceRecorder r;
  r.enable(true);
  TraceEvent e;
  for (std::size_t i = 0; i < kMaxTraceEvents + 5; ++i)
    r.record(e);
  CHECK_EQ(r.dropped(), 5u);
  CHECK_EQ(r.take().size(), kMaxTraceEvents);
  r.record(e);
  CHECK_EQ(r.take().size(), 1u);
}

TEST_CASE("trace: a pager records nothing unless tracing is on") {
  auto path = check::pattern_file("trace_off.bin", 6 * kPage, 91);
  Pager p(config(3, 1), std::make_shared<HeapFrameAllocator>());
  register_pages(p, path, 6);
  run(p, 6, 2);
  settled(p);
  CHECK(p.stats().pages_read > 0);
  CHECK(p.take_trace().empty());
}

TEST_CASE("trace: reads, chunks, waits and evictions match the pager's counters") {
  const int n = 8;
  auto path = check::pattern_file("trace_on.bin", n * kPage, 92);
  for (int readahead : {0, 2}) {
    Pager p(config(3, readahead), std::make_shared<HeapFrameAllocator>());
    register_pages(p, path, n);
    p.set_tracing(true);
    std::int64_t t_begin = TraceRecorder::now_ns();
    run(p, n, 3);
    VmStat s = settled(p);
    p.set_tracing(false);
    std::int64_t t_end = TraceRecorder::now_ns();
    auto events = p.take_trace();

    std::map<std::pair<std::uint32_t, std::uint64_t>, std::uint64_t> chunk_bytes;
    std::map<int, std::vector<std::pair<std::int64_t, std::int64_t>>> per_thread;
    std::uint64_t reads = 0, read_bytes = 0, last_total = 0, evictions = 0, readahead_reads = 0;
    std::uint64_t wait_ns = 0;
    std::vector<TraceEvent> read_events;
    for (const TraceEvent& e : events) {
      CHECK(e.start_ns <= e.end_ns);
      CHECK(e.start_ns >= t_begin);
      CHECK(e.end_ns <= t_end);
      switch (e.kind) {
        case TraceKind::chunk:
          CHECK(e.thread >= 0 && e.thread < kIoThreads);
          CHECK(!e.failed);
          chunk_bytes[{e.page, e.read}] += e.bytes;
          per_thread[e.thread].push_back({e.start_ns, e.end_ns});
          break;
        case TraceKind::read:
          CHECK(e.thread >= 0 && e.thread < kIoThreads);  // completed on an I/O thread
          CHECK(!e.failed);
          CHECK_EQ(e.bytes, kPage);
          ++reads;
          read_bytes += e.bytes;
          readahead_reads += e.readahead;
          // Recorded in the order the counter grew, with the counter.
          CHECK_EQ(e.total, last_total + e.bytes);
          last_total = e.total;
          read_events.push_back(e);
          break;
        case TraceKind::wait:
          CHECK_EQ(e.thread, -1);
          wait_ns += static_cast<std::uint64_t>(e.end_ns - e.start_ns);
          break;
        case TraceKind::evict:
          CHECK_EQ(e.start_ns, e.end_ns);
          CHECK(e.bytes >= kPage);
          ++evictions;
          break;
        default:
          break;
      }
    }
    CHECK_EQ(reads, s.pages_read);
    CHECK_EQ(read_bytes, s.bytes_read);
    CHECK_EQ(last_total, s.bytes_read);
    CHECK_EQ(readahead_reads, s.readahead_reads);
    CHECK_EQ(evictions, s.evictions);
    CHECK(evictions > 0);  // 8 pages through a budget of 3
    CHECK_EQ(wait_ns, s.io_wait_ns);
    if (readahead == 0) {
      CHECK(wait_ns > 0);  // every fault waits for its own read
    }
    // Each read's chunks add up to its bytes and lie within it.
    for (const TraceEvent& r : read_events) {
      CHECK_EQ((chunk_bytes[{r.page, r.read}]), r.bytes);
    }
    for (const TraceEvent& c : events) {
      if (c.kind != TraceKind::chunk)
        continue;
      auto it = std::find_if(read_events.begin(), read_events.end(), [&](const TraceEvent& r) {
        return r.page == c.page && r.read == c.read;
      });
      REQUIRE(it != read_events.end());
      CHECK(it->start_ns <= c.start_ns && c.end_ns <= it->end_ns);
    }
    // One I/O thread reads one chunk at a time.
    std::size_t threads_used = 0;
    for (auto& [t, spans] : per_thread) {
      ++threads_used;
      std::sort(spans.begin(), spans.end());
      for (std::size_t i = 1; i < spans.size(); ++i)
        CHECK(spans[i - 1].second <= spans[i].first);
    }
    CHECK(threads_used >= 1u);
  }
}

TEST_CASE("trace: a checksum mismatch shows its re-read inside the verify, on the I/O thread") {
  const int n = 2;
  auto path = check::pattern_file("trace_ck.bin", n * kPage, 93);
  Pager p(config(4, 0), std::make_shared<HeapFrameAllocator>());
  FileId f = p.add_file(path);
  std::vector<char> bytes(kPage);
  for (int i = 0; i < n; ++i) {
    PageSpec s;
    s.name = "page." + std::to_string(i);
    s.frame_bytes = kPage;
    s.extents.push_back(Extent{f, i * kPage, kPage, kPage, 0});
    for (std::uint64_t k = 0; k < kPage; ++k)
      bytes[k] = static_cast<char>(check::pattern_byte(93, i * kPage + k));
    s.checked = true;
    s.verify.push_back(FrameRange{0, kPage});
    s.checksum = frame_checksum(bytes.data(), s.verify);
    p.add_page(std::move(s));
  }
  // Page 1's first read sees a flipped byte; the injector puts it back before
  // the re-read (as a bad transfer would vanish).
  flip_byte(path, kPage + 100);
  std::atomic<int> calls{0};
  p.set_fault_injector([&](const std::string&, std::uint64_t off, std::size_t&, int&) {
    if (off >= kPage && calls.fetch_add(1) == 4)  // after the page's 4 chunks
      flip_byte(path, kPage + 100);
  });
  p.set_tracing(true);
  for (PageId i = 0; i < n; ++i) {
    Frame fr = p.acquire(i);
    CHECK(check::matches_pattern(fr.data, kPage, 93, i * kPage));
    p.release(i);
  }
  VmStat s = settled(p);
  auto events = p.take_trace();
  std::uint64_t read_bytes = 0;
  const TraceEvent* verify = nullptr;
  const TraceEvent* reread = nullptr;
  for (const TraceEvent& e : events) {
    if (e.kind == TraceKind::read)
      read_bytes += e.bytes;
    if (e.kind == TraceKind::verify && e.page == 1)
      verify = &e;
    if (e.kind == TraceKind::reread)
      reread = &e;
  }
  CHECK_EQ(s.rereads, 1u);
  CHECK_EQ(read_bytes, s.bytes_read);  // the re-read counts in its read's bytes
  REQUIRE(verify != nullptr);
  REQUIRE(reread != nullptr);
  CHECK_EQ(reread->page, 1u);
  CHECK_EQ(reread->bytes, kPage);
  CHECK(!verify->failed);
  CHECK(verify->thread >= 0);
  CHECK_EQ(reread->thread, verify->thread);
  CHECK(verify->start_ns <= reread->start_ns && reread->end_ns <= verify->end_ns);
}
