// read_rate.cpp: batches of the pager's shape through PageIO, timed.
#include "mm/read_rate.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <stdexcept>

#include "mm/direct_io.h"
#include "mm/huge_pages.h"

namespace mlx_pager {

namespace {

// One batch: `required` bytes of `file` at `offset`, read as `length`
// (aligned when the file is direct).
struct Piece {
  std::size_t file = 0;
  std::uint64_t offset = 0;
  std::size_t length = 0;
  std::size_t required = 0;
};

// Memory of the kind the pager reads into (its frames: huge pages where the
// platform has them, huge_pages.h), or the rate is that of other memory.
struct Buffer {
  void* p = nullptr;
  explicit Buffer(std::size_t n) : p(aligned_alloc_io(n)) { advise_huge_pages(p, n); }
  ~Buffer() { aligned_free_io(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() const { return static_cast<char*>(p); }
};

}  // namespace

ReadRate measure_read_rate(const std::vector<std::string>& paths, const ReadRateConfig& config) {
  if (paths.empty()) {
    throw std::invalid_argument("[measure_read_rate] no files to read");
  }
  if (config.threads < 1 || config.depth < 1 || config.chunk_bytes == 0 ||
      config.batch_bytes == 0) {
    throw std::invalid_argument(
        "[measure_read_rate] threads, depth, chunk_bytes and batch_bytes must be positive");
  }
  ReadRate out;
  out.config = config;
  std::vector<DirectFile> files;
  for (const std::string& p : paths) {
    files.push_back(DirectFile::open_read(p));
    out.direct = out.direct && files.back().mode() != IoMode::buffered_drop;
  }
  const std::size_t batch = align_up(config.batch_bytes, kIoAlign);
  // The files front to back, in batches (the last one of a file shorter).
  std::vector<Piece> pieces;
  std::uint64_t planned = 0;
  for (std::size_t f = 0; f < files.size() && planned < config.max_bytes; ++f) {
    std::uint64_t size = files[f].size();
    for (std::uint64_t off = 0; off < size && planned < config.max_bytes; off += batch) {
      std::size_t req = static_cast<std::size_t>(std::min<std::uint64_t>(batch, size - off));
      pieces.push_back(Piece{f, off, static_cast<std::size_t>(align_up(req, kIoAlign)), req});
      planned += req;
    }
  }

  std::vector<std::unique_ptr<Buffer>> buffers;
  for (int i = 0; i < config.depth; ++i) {
    buffers.push_back(std::make_unique<Buffer>(batch));
  }
  PageIO io(config.threads, config.chunk_bytes);
  struct InFlight {
    std::shared_ptr<IoBatch> batch;
    std::size_t piece;
    std::size_t buffer;
  };
  std::deque<InFlight> flight;
  std::vector<std::size_t> free_buffers;
  for (std::size_t i = buffers.size(); i-- > 0;) {
    free_buffers.push_back(i);
  }
  auto seconds = [t0 = std::chrono::steady_clock::now()] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::size_t next = 0;
  bool stop = false;
  while (!flight.empty() || (!stop && next < pieces.size())) {
    while (!stop && next < pieces.size() && !free_buffers.empty()) {
      std::size_t b = free_buffers.back();
      free_buffers.pop_back();
      const Piece& pc = pieces[next];
      ReadOp op{&files[pc.file], pc.offset, pc.length, pc.required, buffers[b]->data()};
      flight.push_back(InFlight{io.submit({op}, {}, /*urgent=*/false), next, b});
      ++next;
    }
    InFlight done = flight.front();
    flight.pop_front();
    done.batch->wait();
    if (std::exception_ptr err = done.batch->error()) {
      // Let the other batches finish (their buffers must outlive them).
      for (InFlight& f : flight) {
        f.batch->wait();
      }
      std::rethrow_exception(err);
    }
    const Piece& pc = pieces[done.piece];
    out.bytes += pc.required;
    if (config.on_batch) {
      config.on_batch(files[pc.file].path(), pc.offset, buffers[done.buffer]->data(), pc.required);
    }
    free_buffers.push_back(done.buffer);
    stop = stop || seconds() >= config.max_seconds;
  }
  out.seconds = seconds();
  out.bytes_per_s = out.seconds > 0 ? out.bytes / out.seconds : 0;
  return out;
}

}  // namespace mlx_pager
