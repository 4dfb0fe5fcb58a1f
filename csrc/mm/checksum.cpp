// checksum.cpp: XXH3 digests of frames, streams and files.
#include "mm/checksum.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <system_error>

#include "mm/xxh3_kernels.h"

namespace mlx_pager {

namespace {

const MlxpXxh3Kernels* choose_kernels() {
  const MlxpXxh3Kernels* portable = mlxp_xxh3_portable();
  const MlxpXxh3Kernels* avx2 = mlxp_xxh3_avx2();
  const char* want = std::getenv("MLX_PAGER_XXH3");
  std::string w = want == nullptr ? "" : want;
  if (w == "portable") {
    return portable;
  }
  if (!w.empty() && w != "auto" && w != "avx2") {
    throw std::invalid_argument(
        "MLX_PAGER_XXH3=" + w + ": not a hash build; use auto (the default), avx2 or portable");
  }
  bool runs = avx2 != nullptr && mlxp_cpu_runs_avx2() != 0;
  if (w == "avx2" && !runs) {
    throw std::invalid_argument(
        std::string("MLX_PAGER_XXH3=avx2: ") +
        (avx2 == nullptr ? "this build has no AVX2 hash (not x86-64)"
                         : "this CPU does not run AVX2") +
        "; unset it or use portable");
  }
  return runs ? avx2 : portable;
}

const MlxpXxh3Kernels& kernels() {
  static const MlxpXxh3Kernels* k = choose_kernels();
  return *k;
}

}  // namespace

const char* xxh3_build() {
  return kernels().name;
}

std::uint64_t xxh3(const void* data, std::size_t n) {
  return kernels().hash(data, n);
}

std::uint64_t combine_digests(const std::vector<std::uint64_t>& digests) {
  return kernels().hash(digests.data(), digests.size() * sizeof(std::uint64_t));
}

std::uint64_t frame_checksum(const char* data, const std::vector<FrameRange>& ranges) {
  std::vector<std::uint64_t> d;
  d.reserve(ranges.size());
  for (const FrameRange& r : ranges) {
    d.push_back(kernels().hash(data + r.offset, r.length));
  }
  return combine_digests(d);
}

Hasher::Hasher() : state_(mlxp_xxh3_create_state()) {
  if (state_ == nullptr) {
    throw std::bad_alloc();
  }
}

Hasher::~Hasher() {
  mlxp_xxh3_free_state(state_);
}

void Hasher::update(const void* data, std::size_t n) {
  const MlxpXxh3Kernels& k = kernels();
  if (data != nullptr) {
    k.update(state_, data, n);
    return;
  }
  static const char zeros[4096] = {};
  while (n > 0) {
    std::size_t m = std::min(n, sizeof(zeros));
    k.update(state_, zeros, m);
    n -= m;
  }
}

std::uint64_t Hasher::digest() const {
  return kernels().digest(state_);
}

FileDigest hash_file(
    const std::string& path, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& ranges) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw std::system_error(errno, std::generic_category(), "[hash_file] open(" + path + ")");
  }
  std::unique_ptr<int, void (*)(int*)> closer(&fd, [](int* p) { ::close(*p); });
#ifdef POSIX_FADV_SEQUENTIAL
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  // Ranges by start; each gets its own stream, fed while the file passes by.
  std::vector<std::size_t> order(ranges.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return ranges[a].first < ranges[b].first;
  });
  std::vector<std::unique_ptr<Hasher>> hs(ranges.size());
  for (auto& h : hs) {
    h = std::make_unique<Hasher>();
  }
  Hasher whole;
  constexpr std::size_t kChunk = 8u << 20;
  std::vector<char> buf(kChunk);
  std::uint64_t pos = 0;
  std::size_t first_open = 0;  // ranges before it (in `order`) are finished
  for (;;) {
    ssize_t got = ::pread(fd, buf.data(), kChunk, static_cast<off_t>(pos));
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw std::system_error(
          errno, std::generic_category(),
          "[hash_file] pread(" + path + ", offset " + std::to_string(pos) + ")");
    }
    if (got == 0) {
      break;
    }
    std::uint64_t end = pos + static_cast<std::uint64_t>(got);
    whole.update(buf.data(), static_cast<std::size_t>(got));
    for (std::size_t k = first_open; k < order.size(); ++k) {
      auto [off, len] = ranges[order[k]];
      if (off >= end) {
        break;  // sorted: no later range starts in this chunk
      }
      std::uint64_t a = std::max(off, pos), b = std::min(off + len, end);
      if (a < b) {
        hs[order[k]]->update(buf.data() + (a - pos), static_cast<std::size_t>(b - a));
      }
    }
    while (first_open < order.size() &&
           ranges[order[first_open]].first + ranges[order[first_open]].second <= end) {
      ++first_open;
    }
    pos = end;
  }
  for (const auto& [off, len] : ranges) {
    if (off + len > pos) {
      throw std::system_error(
          EIO, std::generic_category(),
          "[hash_file] " + path + " has " + std::to_string(pos) +
              " bytes but a tensor ends at byte " + std::to_string(off + len) +
              ": the file is truncated");
    }
  }
#ifdef POSIX_FADV_DONTNEED
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
#endif
  FileDigest out;
  out.file = whole.digest();
  out.size = pos;
  for (auto& h : hs) {
    out.ranges.push_back(h->digest());
  }
  return out;
}

}  // namespace mlx_pager
