// checksum.h: the digests that tell a page's bytes are the ones written.
//
// One hash, XXH3-64 (csrc/third_party/xxhash, BSD-2), used three ways:
//  - a page's checksum: the XXH3 of the XXH3s of its ranges (FrameRange),
//    taken in order. A swap-file page has one range, the whole page as
//    written; an in-place page one per tensor, at its final place in the
//    frame, so read-through gaps and alignment slack are not covered.
//  - a file's digest (the swap cache's key: swapcache.py), and
//  - the digests of byte ranges of that file (the tensors an in-place page
//    checksum is combined from), both in one sequential pass (hash_file).
// The pager hashes a page as its read lands, on the I/O threads, with its
// lock released (landing.h), and compares when the read completes
// (fault.cpp); a mismatch is checked again here, the slow way. XXH3 runs on
// AVX2 where the CPU has it (xxh3_kernels.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mlx_pager {

// `length` bytes at `offset` of a page's frame that its checksum covers.
struct FrameRange {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

std::uint64_t xxh3(const void* data, std::size_t n);

// Which XXH3 build hashes (xxh3_kernels.h): "avx2" where this CPU runs it,
// else "portable" (the compiler's default for the target: SSE2 on x86-64,
// NEON on arm64). The environment variable MLX_PAGER_XXH3=portable forces
// the portable build (to compare them); avx2 asks for AVX2 and fails where
// it cannot run; any other value is an error (std::invalid_argument, at the
// first hash). Chosen once, at the first hash.
const char* xxh3_build();

// The checksum of a page from its ranges' own XXH3s, in order.
std::uint64_t combine_digests(const std::vector<std::uint64_t>& digests);

// The checksum of the ranges of a frame at `data`.
std::uint64_t frame_checksum(const char* data, const std::vector<FrameRange>& ranges);

// A streaming XXH3-64 (for data written piece by piece: swap pages).
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* data, std::size_t n);  // data may be nullptr: n zeros
  std::uint64_t digest() const;

 private:
  void* state_;
};

struct FileDigest {
  std::uint64_t file = 0;             // XXH3 of the whole file
  std::vector<std::uint64_t> ranges;  // XXH3 of each range asked for, in order
  std::uint64_t size = 0;
};

// Reads `path` once, sequentially, and hashes the whole file and each
// (offset, length) range (ranges may overlap and come in any order). Throws
// std::system_error naming the file when it cannot be read, or ends before a
// range does.
FileDigest hash_file(
    const std::string& path, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges);

}  // namespace mlx_pager
