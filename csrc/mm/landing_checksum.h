// landing_checksum.h: a page's checksum taken while its read lands.
//
// A checked page (checksum.h) is verified after its read. Done after the last
// chunk, hashing the whole page sits between the read and its first use (a
// 207 MB page: 38 ms of XXH3 on one core, a fifth of its read at 1.3 GB/s),
// while the CPU waited idle for the disk. Here each range of the checksum is
// hashed as soon as its bytes have landed: the I/O thread that finished a
// chunk (page_io.h's on_chunk) feeds every range whose next bytes are now in
// the frame into that range's streaming XXH3, in order, so that what is left
// after the last chunk is the part of the page it brought.
//
// The ranges are given where the READ puts their bytes: a tensor that the
// plan moves after the read (layout.h) is hashed at its source, before the
// move, which only shifts the same bytes. The result equals
// frame_checksum() of the page after its moves.
//
// Thread safety: landed() from any number of threads at once (one of them
// hashes at a time, the others return at once, leaving their bytes to it);
// finish() after the last landed() has returned.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "mm/checksum.h"

namespace mlx_pager {

class LandingChecksum {
 public:
  // `frame`: where the read lands; `ranges`: the checksum's ranges, in the
  // checksum's order, at the frame offsets the read fills them at.
  LandingChecksum(const char* frame, const std::vector<FrameRange>& ranges);
  ~LandingChecksum();
  LandingChecksum(const LandingChecksum&) = delete;
  LandingChecksum& operator=(const LandingChecksum&) = delete;

  // Bytes [offset, offset + length) of the frame have landed (a chunk read
  // succeeded). May hash, on the calling thread, whatever is now hashable.
  void landed(std::uint64_t offset, std::uint64_t length);

  // Hashes what is left and returns the page's checksum (combine_digests of
  // the ranges' XXH3s, in order); nullopt when some range's bytes never
  // landed (a chunk failed).
  std::optional<std::uint64_t> finish();

 private:
  struct Range {
    std::uint64_t offset = 0;
    std::uint64_t length = 0;
    std::uint64_t hashed = 0;  // bytes fed to `hasher`, from `offset` on
    std::unique_ptr<Hasher> hasher;
  };
  // Feeds every range the bytes landed so far that follow what it has
  // hashed. Takes and drops `lock` around each piece of hashing.
  void hash_landed(std::unique_lock<std::mutex>& lock);
  // The end of the landed run of bytes that contains `pos` (pos itself if none).
  std::uint64_t landed_end(std::uint64_t pos) const;

  const char* frame_;
  std::vector<Range> ranges_;  // in the checksum's order
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::uint64_t> landed_;  // start -> end, merged
  bool hashing_ = false;
};

}  // namespace mlx_pager
