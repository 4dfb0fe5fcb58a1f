// page_io.cpp: chunked parallel reads on a fixed set of I/O threads.
#include "mm/page_io.h"
#include "mm/thread_name.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

namespace mlx_pager {

namespace {
thread_local int t_io_thread = -1;  // this thread's index in its PageIO
}  // namespace

int PageIO::current_thread() {
  return t_io_thread;
}

void IoBatch::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
}

bool IoBatch::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::exception_ptr IoBatch::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

PageIO::PageIO(int threads, std::size_t chunk_bytes, TraceRecorder* trace)
    : chunk_bytes_(align_up(std::max<std::size_t>(chunk_bytes, 1), kIoAlign)), trace_(trace) {
  if (threads < 1) {
    throw std::invalid_argument("[PageIO] needs at least one I/O thread");
  }
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this, i] { worker(i); });
  }
}

PageIO::~PageIO() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return urgent_.empty() && background_.empty() && running_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void PageIO::set_fault_injector(FaultInjector f) {
  std::lock_guard<std::mutex> lock(mu_);
  injector_ = std::move(f);
}

std::shared_ptr<IoBatch> PageIO::submit(
    std::vector<ReadOp> ops,
    std::function<void(IoBatch&)> on_complete,
    bool urgent,
    TraceTag tag,
    std::function<void(const ReadOp&)> on_chunk) {
  auto batch = std::make_shared<IoBatch>();
  batch->on_complete_ = std::move(on_complete);
  batch->on_chunk_ = std::move(on_chunk);
  batch->tag_ = tag;
  std::vector<Chunk> chunks;
  for (const ReadOp& op : ops) {
    for (std::size_t off = 0; off < op.length; off += chunk_bytes_) {
      ReadOp piece = op;
      piece.offset = op.offset + off;
      piece.dst = op.dst + off;
      piece.length = std::min(chunk_bytes_, op.length - off);
      piece.required = op.required > off ? std::min(piece.length, op.required - off) : 0;
      chunks.push_back(Chunk{batch, piece});
    }
  }
  if (chunks.empty()) {
    // Nothing to read: complete at once, on the caller's thread.
    if (batch->on_complete_) {
      batch->on_complete_(*batch);
    }
    std::lock_guard<std::mutex> lock(batch->mu_);
    batch->done_ = true;
    return batch;
  }
  batch->pending_ = chunks.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = urgent ? urgent_ : background_;
    for (auto& c : chunks) {
      q.push_back(std::move(c));
    }
  }
  cv_.notify_all();
  return batch;
}

std::uint64_t PageIO::read_now(const ReadOp& op) {
  std::size_t got = op.file->pread_full(op.dst, op.length, op.offset);
  if (got < op.required) {
    throw std::system_error(
        EIO, std::generic_category(),
        "[PageIO::read_now] short read of " + op.file->path() + " at offset " +
            std::to_string(op.offset) + ": needed " + std::to_string(op.required) +
            " bytes, the file has " + std::to_string(got));
  }
  return got;
}

void PageIO::worker(int index) {
  t_io_thread = index;
  name_this_thread(("mlxp-io-" + std::to_string(index)).c_str());
  for (;;) {
    Chunk c;
    FaultInjector injector;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !urgent_.empty() || !background_.empty(); });
      if (stop_ && urgent_.empty() && background_.empty()) {
        return;
      }
      auto& q = urgent_.empty() ? background_ : urgent_;
      c = std::move(q.front());
      q.pop_front();
      ++running_;
      injector = injector_;
    }
    run_chunk(c, injector);
    finish_chunk(c.batch);
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
      if (running_ == 0 && urgent_.empty() && background_.empty()) {
        idle_cv_.notify_all();
      }
    }
  }
}

void PageIO::run_chunk(Chunk& c, const FaultInjector& injector) {
  {
    // Skip the work of a batch that has already failed.
    std::lock_guard<std::mutex> lock(c.batch->mu_);
    if (c.batch->error_) {
      return;
    }
  }
  bool traced = trace_ != nullptr && trace_->enabled();
  std::int64_t t0 = traced ? TraceRecorder::now_ns() : 0;
  std::uint64_t n = 0;
  bool failed = false;
  auto fail = [&c] {
    std::lock_guard<std::mutex> lock(c.batch->mu_);
    if (!c.batch->error_) {
      c.batch->error_ = std::current_exception();
    }
  };
  try {
    n = read_attempts(c.op, injector);
    c.batch->bytes_ += n;
  } catch (...) {
    failed = true;
    fail();
  }
  if (traced) {
    // The read alone: what the chunk callback does after it is the
    // caller's (landing.h's work shows in the page's verify span and read).
    TraceEvent e;
    e.kind = TraceKind::chunk;
    e.failed = failed;
    e.thread = t_io_thread;
    e.page = c.batch->tag_.page;
    e.read = c.batch->tag_.read;
    e.bytes = n;
    e.start_ns = t0;
    e.end_ns = TraceRecorder::now_ns();
    trace_->record(e);
  }
  if (!failed && c.batch->on_chunk_) {
    try {
      c.batch->on_chunk_(c.op);
    } catch (...) {
      fail();
    }
  }
}

std::uint64_t PageIO::read_attempts(const ReadOp& op, const FaultInjector& injector) {
  for (int attempt = 1;; ++attempt) {
    try {
      ReadOp o = op;
      if (injector) {
        std::size_t len = o.length;
        int err = 0;
        injector(o.file->path(), o.offset, len, err);
        if (err != 0) {
          throw std::system_error(
              err, std::generic_category(),
              "[PageIO] pread(" + o.file->path() + ", offset " + std::to_string(o.offset) +
                  ") [injected]");
        }
        o.length = std::min(len, o.length);  // an injected short read
      }
      return read_now(o);
    } catch (const std::system_error& e) {
      if (attempt >= kReadAttempts) {
        // what() ends with ": <strerror>", which system_error appends again.
        std::string what = e.what(), tail = ": " + e.code().message();
        if (what.size() >= tail.size() &&
            what.compare(what.size() - tail.size(), tail.size(), tail) == 0) {
          what.resize(what.size() - tail.size());
        }
        throw std::system_error(e.code(), what + " (" + std::to_string(attempt) + " attempts)");
      }
      ++retries_;
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * attempt));
    }
  }
}

std::uint64_t PageIO::read_retrying(const ReadOp& op) {
  FaultInjector injector;
  {
    std::lock_guard<std::mutex> lock(mu_);
    injector = injector_;
  }
  std::uint64_t n = 0;
  for (std::size_t off = 0; off < op.length; off += chunk_bytes_) {
    ReadOp piece = op;
    piece.offset = op.offset + off;
    piece.dst = op.dst + off;
    piece.length = std::min(chunk_bytes_, op.length - off);
    piece.required = op.required > off ? std::min(piece.length, op.required - off) : 0;
    n += read_attempts(piece, injector);
  }
  return n;
}

FaultInjector fault_rule(
    std::string path_contains, int err, std::size_t short_len, long skip, long count) {
  auto seen = std::make_shared<std::atomic<long>>(0);
  return [=](const std::string& path, std::uint64_t, std::size_t& len, int& e) {
    if (path.find(path_contains) == std::string::npos) {
      return;
    }
    long n = seen->fetch_add(1);
    if (n < skip || (count >= 0 && n >= skip + count)) {
      return;
    }
    if (err != 0) {
      e = err;
    } else {
      len = std::min(len, short_len);
    }
  };
}

void PageIO::finish_chunk(const std::shared_ptr<IoBatch>& batch) {
  if (batch->pending_.fetch_sub(1) != 1) {
    return;
  }
  if (batch->on_complete_) {
    batch->on_complete_(*batch);
  }
  {
    std::lock_guard<std::mutex> lock(batch->mu_);
    batch->done_ = true;
  }
  batch->cv_.notify_all();
}

}  // namespace mlx_pager
