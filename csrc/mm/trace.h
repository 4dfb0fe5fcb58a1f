// trace.h: a timeline of what the pager did (cf. Linux tracepoints/ftrace).
//
// Off by default. When on, the pager and its I/O threads record timestamped
// events here (steady clock, nanoseconds; now_ns() is the same clock, so a
// caller can place its own events on the same timeline):
//
//   chunk    one chunk read on an I/O thread (page_io.h): [start, end], bytes
//   verify   what is left of aligning and checking a page's bytes after its
//            last chunk (the rest ran as chunks landed: landing.h), on the
//            I/O thread that completed it (reread events nest inside it)
//   reread   the page read again after a checksum mismatch, same thread
//   read     one page read, from submission to completion; `bytes` is what
//            it added to the pager's bytes_read counter and `total` that
//            counter after it, so reads are matched exactly to any two
//            snapshots of VmStat
//   wait     acquire() blocked on the page's read in flight (its duration is
//            exactly what the wait added to io_wait_ns)
//   reclaim  acquire() blocked making room for the page: from its first
//            wait for memory to the room made (reclaim_wait_ns counts the
//            waits themselves)
//   evict    an instant: the page was evicted; `bytes` its charge
//
// Cost: one relaxed atomic load per event site while off. While on, every
// event takes the recorder's mutex, a leaf: nothing is locked under it, so it
// may be taken under any of the pager's locks (pager.h). Events beyond
// kMaxTraceEvents not yet taken are dropped and counted.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>

namespace mlx_pager {

enum class TraceKind : std::uint8_t { chunk, verify, reread, read, wait, reclaim, evict };

const char* to_string(TraceKind k);

// Which read a chunk belongs to: the page and its read number.
struct TraceTag {
  std::uint32_t page = 0;
  std::uint64_t read = 0;
};

struct TraceEvent {
  TraceKind kind = TraceKind::read;
  // read: started by readahead (else by a fault); wait: for a read readahead
  // started (a late prefetch) rather than this acquire's own fault.
  bool readahead = false;
  bool failed = false;  // chunk, read: the read failed
  int thread = -1;      // the I/O thread's index; -1: a thread that called the pager
  std::uint32_t page = 0;
  std::uint64_t read = 0;  // the page's read number (chunk, verify, reread, read, wait)
  std::uint64_t bytes = 0;
  std::uint64_t total = 0;  // read: the pager's bytes_read counter after it
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;  // == start_ns for an instant
};

inline constexpr std::size_t kMaxTraceEvents = std::size_t{1} << 20;

class TraceRecorder {
 public:
  // The trace clock: std::chrono::steady_clock, in nanoseconds.
  static std::int64_t now_ns() { return ns(std::chrono::steady_clock::now()); }
  static std::int64_t ns(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }

  // Starts (true) or stops recording; events recorded stay until take().
  void enable(bool on) { on_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return on_.load(std::memory_order_relaxed); }
  // Keeps `e` when recording (dropped, and counted, when kMaxTraceEvents
  // are waiting to be taken).
  void record(const TraceEvent& e);
  // The events recorded since the last take(), in the order recorded.
  std::vector<TraceEvent> take();
  // Events dropped since construction because nobody took them.
  std::uint64_t dropped() const;

 private:
  std::atomic<bool> on_{false};
  mutable std::mutex mu_;  // a leaf
  std::vector<TraceEvent> events_;
  std::uint64_t dropped_ = 0;
};

}  // namespace mlx_pager
