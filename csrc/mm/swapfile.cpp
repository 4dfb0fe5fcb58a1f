// swapfile.cpp: the swap-file writer.
#include "mm/swapfile.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace mlx_pager {

SwapWriter::SwapWriter(
    const std::string& path,
    std::uint64_t reserve_bytes,
    std::size_t staging_bytes,
    bool want_direct)
    : file_(DirectFile::create_write(path, reserve_bytes, want_direct)), buf_(staging_bytes) {}

void SwapWriter::flush_full() {
  file_.pwrite_full(buf_.data(), buf_.size(), buf_offset_);
  buf_offset_ += buf_.size();
  fill_ = 0;
}

void SwapWriter::write(const void* src, std::size_t n) {
  if (finished_) {
    throw std::logic_error("[SwapWriter::write] write after finish()");
  }
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    std::size_t k = std::min(n, buf_.size() - fill_);
    if (p != nullptr) {
      std::memcpy(buf_.data() + fill_, p, k);
      p += k;
    } else {
      std::memset(buf_.data() + fill_, 0, k);
    }
    fill_ += k;
    pos_ += k;
    n -= k;
    if (fill_ == buf_.size()) {
      flush_full();
    }
  }
}

void SwapWriter::pad_to(std::uint64_t align) {
  std::uint64_t target = align_up(pos_, align);
  write(nullptr, target - pos_);
}

void SwapWriter::fill_to(std::uint64_t position) {
  if (position < pos_) {
    throw std::logic_error(
        "[SwapWriter::fill_to] position " + std::to_string(position) +
        " is behind what was written (" + std::to_string(pos_) + " bytes)");
  }
  write(nullptr, position - pos_);
}

std::uint64_t SwapWriter::begin_page() {
  pad_to(kIoAlign);
  return pos_;
}

std::uint64_t SwapWriter::finish() {
  if (finished_) {
    return pos_;
  }
  pad_to(kIoAlign);
  if (fill_ > 0) {
    // fill_ is a multiple of kIoAlign here, as direct writes need.
    file_.pwrite_full(buf_.data(), fill_, buf_offset_);
    buf_offset_ += fill_;
    fill_ = 0;
  }
  file_.truncate(pos_);
  file_.sync();
  file_.drop_cache(0, pos_);
  finished_ = true;
  return pos_;
}

}  // namespace mlx_pager
