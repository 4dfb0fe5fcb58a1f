// direct_io.h: opening files so that reads bypass the OS page cache.
//
// The page cache is memory the user did not budget for, so every page read
// goes around it: O_DIRECT on Linux, F_NOCACHE on macOS. Where the file
// system refuses direct I/O (tmpfs, some network file systems) the file is
// opened buffered and every read is followed by a cache drop
// (posix_fadvise DONTNEED). The mode a file ended up in is reported, never
// hidden: `DirectFile::mode()` and the pager's counters say which it is.
//
// This is the one place that knows the platform's flags.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mlx_pager {

enum class IoMode {
  direct,         // O_DIRECT (Linux): no page cache, aligned transfers only
  nocache,        // F_NOCACHE (macOS): cache bypassed, any alignment
  buffered_drop,  // buffered read + posix_fadvise(DONTNEED) afterwards
};

const char* to_string(IoMode mode);

// Alignment (bytes) that offsets, lengths and memory addresses of direct
// transfers use. 4096 covers every logical block size seen in practice
// (512 and 4096) and the page size of x86-64 and arm64 Linux.
inline constexpr std::size_t kIoAlign = 4096;

// The most one read(2) or write(2) asks for: macOS fails either above
// INT_MAX bytes with EINVAL, and Linux moves at most 0x7ffff000 bytes a call.
// A multiple of kIoAlign, so that direct transfers stay aligned.
inline constexpr std::size_t kMaxIoCall = std::size_t{1} << 30;

inline constexpr std::uint64_t align_down(std::uint64_t x, std::uint64_t a) {
  return x / a * a;
}
inline constexpr std::uint64_t align_up(std::uint64_t x, std::uint64_t a) {
  return (x + a - 1) / a * a;
}

// A read-only (or, for swap files, read-write) file opened for cache-free
// transfers. Move-only; closes its descriptor on destruction.
class DirectFile {
 public:
  DirectFile() = default;
  // Opens `path`. `want_direct` = false asks for buffered_drop from the start
  // (used by tests and when the user turns direct I/O off). Throws
  // std::system_error naming the path when the file cannot be opened.
  static DirectFile open_read(const std::string& path, bool want_direct = true);
  // Creates (or truncates) `path` for writing, mode 0600 (a private copy of
  // the user's weights), and reserves `reserve_bytes`
  // with posix_fallocate, so that a full disk is an error here (ENOSPC), not
  // a SIGBUS or a short write later.
  static DirectFile create_write(
      const std::string& path, std::uint64_t reserve_bytes, bool want_direct = true);

  DirectFile(DirectFile&& other) noexcept;
  DirectFile& operator=(DirectFile&& other) noexcept;
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  ~DirectFile();

  int fd() const { return fd_; }
  IoMode mode() const { return mode_; }
  const std::string& path() const { return path_; }
  std::uint64_t size() const;  // current file size in bytes
  bool needs_alignment() const { return mode_ == IoMode::direct; }

  // Test hook: while set, open_read/create_write behave as if the file system
  // refused O_DIRECT (as tmpfs did before Linux 6.6). Returns the old value.
  static bool refuse_direct_for_testing(bool refuse);

  // Reads exactly `n` bytes at `offset` into `dst`, retrying short reads.
  // Returns the number of bytes read, which is less than `n` only at end of
  // file. Throws std::system_error (naming path and offset) on an I/O error.
  // In direct mode `dst`, `offset` and `n` must be kIoAlign-aligned.
  std::size_t pread_full(void* dst, std::size_t n, std::uint64_t offset) const;
  // Writes exactly `n` bytes at `offset`; throws on any error or short write.
  void pwrite_full(const void* src, std::size_t n, std::uint64_t offset) const;
  // Drops the page cache for a range (buffered_drop mode; a no-op otherwise).
  void drop_cache(std::uint64_t offset, std::uint64_t n) const;
  // Flushes written data to the device.
  void sync() const;
  // Shrinks or grows the file to exactly `n` bytes.
  void truncate(std::uint64_t n) const;

 private:
  DirectFile(int fd, IoMode mode, std::string path)
      : fd_(fd), mode_(mode), path_(std::move(path)) {}
  int fd_ = -1;
  IoMode mode_ = IoMode::buffered_drop;
  std::string path_;
};

// Memory aligned for direct transfers (posix_memalign); used by the heap
// frame allocator, the swap writer's staging buffer and tests. Throws
// std::bad_alloc.
void* aligned_alloc_io(std::size_t n);
void aligned_free_io(void* p);

// One buffer of memory aligned for direct transfers, allocated once, up
// front, and freed on destruction (the swap writer's staging memory: sized
// once, it can never be what exhausts RAM). Move-only.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // `bytes` rounded up to kIoAlign (at least kIoAlign). Throws std::bad_alloc.
  explicit AlignedBuffer(std::size_t bytes);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  char* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace mlx_pager
