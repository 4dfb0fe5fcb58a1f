// swapfile.h: writing the pager's own swap file (cf. Linux mm/swapfile.c).
//
// When a page cannot be read in place from the model's files (its tensors are
// computed at load time, misaligned, or spread thin), the pager writes it once
// into a swap file under the user's ssd_cache_dir, laid out for one large
// aligned read per page (layout.h: plan_swap_page). Space is reserved up front
// with posix_fallocate so that a full disk fails here with ENOSPC. Writes go
// through one staging buffer allocated up front (direct_io.h: AlignedBuffer)
// and bypass the page cache.
#pragma once

#include <cstdint>
#include <string>

#include "mm/direct_io.h"

namespace mlx_pager {

// Default size of the swap writer's staging buffer: large enough that each
// direct write is a large sequential request.
inline constexpr std::size_t kDefaultStagingBytes = 8u << 20;

class SwapWriter {
 public:
  // Creates `path` with `reserve_bytes` reserved. `staging_bytes` is the size
  // of the staging buffer (rounded up to kIoAlign).
  SwapWriter(
      const std::string& path,
      std::uint64_t reserve_bytes,
      std::size_t staging_bytes = kDefaultStagingBytes,
      bool want_direct = true);
  SwapWriter(const SwapWriter&) = delete;
  SwapWriter& operator=(const SwapWriter&) = delete;

  // Pads to kIoAlign and returns the offset where the next page starts.
  std::uint64_t begin_page();
  // Appends `n` bytes.
  void write(const void* src, std::size_t n);
  // Appends zeros up to the next multiple of `align`.
  void pad_to(std::uint64_t align);
  // Appends zeros up to `position` (at or after the current position).
  void fill_to(std::uint64_t position);
  std::uint64_t position() const { return pos_; }
  // Flushes, trims the file to what was written (padded to kIoAlign) and
  // syncs it to the device. Returns the file size.
  std::uint64_t finish();

  // Test hook: while >= 0, writes that would reach past that many bytes of
  // a swap file fail with ENOSPC, as on a full disk. Returns the old value.
  static std::int64_t fail_writes_after_for_testing(std::int64_t bytes);

 private:
  void put(const char* src, std::size_t n, std::uint64_t offset);
  void flush_full();

  DirectFile file_;
  AlignedBuffer buf_;
  std::size_t fill_ = 0;          // bytes in buf_
  std::uint64_t buf_offset_ = 0;  // file offset of buf_[0]
  std::uint64_t pos_ = 0;         // logical end of what was written
  bool finished_ = false;
};

// Overwrites `n` bytes at `offset` of an existing swap file with `src` and
// syncs them (a page rebuilt after its checksum failed: pager.h). Throws
// std::system_error naming the file.
void rewrite_swap_range(
    const std::string& path, std::uint64_t offset, const void* src, std::size_t n);

}  // namespace mlx_pager
