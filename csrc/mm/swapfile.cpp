// swapfile.cpp: the swap-file writer.
#include "mm/swapfile.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

namespace mlx_pager {

SwapWriter::SwapWriter(
    const std::string& path,
    std::uint64_t reserve_bytes,
    std::size_t staging_bytes,
    bool want_direct)
    : file_(DirectFile::create_write(path, reserve_bytes, want_direct)), buf_(staging_bytes) {}

namespace {
std::atomic<std::int64_t> g_fail_writes_after{-1};
}

std::int64_t SwapWriter::fail_writes_after_for_testing(std::int64_t bytes) {
  return g_fail_writes_after.exchange(bytes);
}

void SwapWriter::put(const char* src, std::size_t n, std::uint64_t offset) {
  std::int64_t limit = g_fail_writes_after.load();
  if (limit >= 0 && offset + n > static_cast<std::uint64_t>(limit)) {
    throw std::system_error(
        ENOSPC, std::generic_category(),
        "[SwapWriter] pwrite(" + file_.path() + ", offset " + std::to_string(offset) +
            ") [injected]");
  }
  file_.pwrite_full(src, n, offset);
}

void SwapWriter::flush_full() {
  put(buf_.data(), buf_.size(), buf_offset_);
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
    put(buf_.data(), fill_, buf_offset_);
    buf_offset_ += fill_;
    fill_ = 0;
  }
  file_.truncate(pos_);
  file_.sync();
  file_.drop_cache(0, pos_);
  finished_ = true;
  return pos_;
}

void rewrite_swap_range(
    const std::string& path, std::uint64_t offset, const void* src, std::size_t n) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  auto fail = [&](const char* what) {
    int err = errno;
    if (fd >= 0) {
      ::close(fd);
    }
    throw std::system_error(
        err, std::generic_category(),
        std::string("[rewrite_swap_range] ") + what + "(" + path + ", offset " +
            std::to_string(offset) + ")");
  };
  if (fd < 0) {
    fail("open");
  }
  const char* p = static_cast<const char*>(src);
  std::size_t done = 0;
  while (done < n) {
    ssize_t k =
        ::pwrite(fd, p + done, std::min(n - done, kMaxIoCall), static_cast<off_t>(offset + done));
    if (k < 0 && errno == EINTR) {
      continue;
    }
    if (k <= 0) {
      if (k == 0) {
        errno = EIO;
      }
      fail("pwrite");
    }
    done += static_cast<std::size_t>(k);
  }
  if (::fsync(fd) != 0) {
    fail("fsync");
  }
#ifdef POSIX_FADV_DONTNEED
  ::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(n), POSIX_FADV_DONTNEED);
#endif
  ::close(fd);
}

}  // namespace mlx_pager
