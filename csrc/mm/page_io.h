// page_io.h: the actual I/O (cf. Linux mm/page_io.c).
//
// One submit() and a completion: a batch of reads is split into chunks that
// a fixed set of I/O threads execute with pread on DirectFiles, in parallel,
// so that one large page read keeps several requests in flight on the SSD.
// When the last chunk of a batch finishes, the batch's completion callback
// runs (on that I/O thread) and waiters wake. A batch may also have a chunk
// callback, run on the I/O thread after each chunk it read successfully,
// before the chunk counts as finished (landing.h hashes and moves there).
//
// Demand reads (a fault someone is blocked on) go ahead of readahead.
//
// A chunk that fails (an I/O error, a short read) is tried again, up to
// kReadAttempts times in all with a short pause between: a transient error
// costs a few milliseconds, a persistent one fails the batch with its last
// error, which says how many attempts were made.
//
//   submit(ops) --> [urgent queue][background queue] --> N I/O threads
//                                                          | pread chunk
//   wait() <-- done + error <-- on_complete(batch) <-------+ last chunk
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mm/direct_io.h"
#include "mm/trace.h"

namespace mlx_pager {

// Default size of the pieces a read is split into: large enough for the SSD
// to stream, small enough that one page keeps several I/O threads busy.
inline constexpr std::size_t kDefaultIoChunkBytes = 8u << 20;
// Tries of one chunk read before its error fails the batch.
inline constexpr int kReadAttempts = 3;

// One contiguous read. `length` bytes are requested (aligned when the file is
// in direct mode); the first `required` of them must exist in the file, the
// rest is alignment padding that may lie past the end of the file.
struct ReadOp {
  const DirectFile* file = nullptr;
  std::uint64_t offset = 0;
  std::size_t length = 0;
  std::size_t required = 0;
  char* dst = nullptr;
};

// Test hook called before every chunk read: it may sleep (to widen races),
// set `err` to an errno to fail the chunk, or lower `len` to cut it short.
using FaultInjector =
    std::function<void(const std::string& path, std::uint64_t offset, std::size_t& len, int& err)>;

// A FaultInjector for reads of files whose path contains `path_contains`:
// the first `skip` such reads pass, the next `count` (-1: all) fail with
// errno `err`, or, when `err` is 0, are cut to `short_len` bytes. Safe to
// call from every I/O thread (its counter is atomic).
FaultInjector fault_rule(
    std::string path_contains, int err, std::size_t short_len, long skip, long count);

class IoBatch {
 public:
  // Blocks until every chunk has finished and the completion callback ran.
  void wait();
  bool done() const;
  // The first error of the batch (nullptr when all reads succeeded).
  std::exception_ptr error() const;
  std::uint64_t bytes_read() const { return bytes_.load(); }

 private:
  friend class PageIO;
  std::function<void(IoBatch&)> on_complete_;
  std::function<void(const ReadOp&)> on_chunk_;
  TraceTag tag_;
  std::atomic<std::size_t> pending_{0};
  std::atomic<std::uint64_t> bytes_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

class PageIO {
 public:
  // `threads` I/O threads; reads are split into `chunk_bytes` pieces
  // (rounded up to kIoAlign). `trace` (may be null; must outlive this)
  // records every chunk read while it is enabled (trace.h).
  PageIO(int threads, std::size_t chunk_bytes, TraceRecorder* trace = nullptr);
  // Waits for every submitted batch to finish, then joins the threads.
  ~PageIO();
  PageIO(const PageIO&) = delete;
  PageIO& operator=(const PageIO&) = delete;

  // Queues `ops`; `on_complete` (may be empty) runs once when all are done,
  // with the batch's error (if any) already recorded. `urgent` batches go
  // ahead of non-urgent ones. `tag` names the read in the trace.
  // `on_chunk` (may be empty) runs after each chunk read successfully, with
  // the piece of an op it read, on that I/O thread, before the batch can
  // complete; what it throws fails the batch. Never blocks on I/O.
  std::shared_ptr<IoBatch> submit(
      std::vector<ReadOp> ops,
      std::function<void(IoBatch&)> on_complete = {},
      bool urgent = true,
      TraceTag tag = {},
      std::function<void(const ReadOp&)> on_chunk = {});

  // Reads synchronously on the calling thread (no queueing); throws on error.
  static std::uint64_t read_now(const ReadOp& op);
  // Reads `op` on the calling thread as an I/O thread does: through the fault
  // injector, retried up to kReadAttempts times. Throws the last error.
  std::uint64_t read_retrying(const ReadOp& op);

  void set_fault_injector(FaultInjector f);
  // The index (0..threads-1) of the I/O thread calling this, or -1 on a
  // thread that is not one of a PageIO's.
  static int current_thread();
  // Chunk reads tried again after an error, since construction.
  std::uint64_t retries() const { return retries_.load(); }

 private:
  struct Chunk {
    std::shared_ptr<IoBatch> batch;
    ReadOp op;  // the piece of the original op this chunk covers
  };
  void worker(int index);
  void run_chunk(Chunk& c, const FaultInjector& injector);
  std::uint64_t read_attempts(const ReadOp& op, const FaultInjector& injector);
  void finish_chunk(const std::shared_ptr<IoBatch>& batch);

  std::size_t chunk_bytes_;
  TraceRecorder* trace_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<Chunk> urgent_;
  std::deque<Chunk> background_;
  std::size_t running_ = 0;
  bool stop_ = false;
  FaultInjector injector_;
  std::atomic<std::uint64_t> retries_{0};
};

}  // namespace mlx_pager
