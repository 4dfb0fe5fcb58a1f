// page_pool.cpp: moving resident pages between mappings (Linux mremap);
// elsewhere a pool that keeps nothing.
#include "mm/page_pool.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#define MLX_PAGER_PAGE_POOL 1
#else
#define MLX_PAGER_PAGE_POOL 0
#endif

namespace mlx_pager {

namespace {

#if MLX_PAGER_PAGE_POOL
// The kernel refused MREMAP_DONTUNMAP once: put() keeps nothing.
std::atomic<bool> g_no_dontunmap{false};

// The whole pages inside [p, p + len): [first, end), empty (first == end)
// when there are none.
std::pair<char*, char*> whole_pages(void* p, std::uint64_t len, std::uint64_t pg) {
  auto begin = reinterpret_cast<std::uintptr_t>(p);
  auto first = (begin + pg - 1) / pg * pg;
  auto end = std::max(first, (begin + len) / pg * pg);
  return {reinterpret_cast<char*>(first), reinterpret_cast<char*>(end)};
}

// Calls f(run, run_bytes, resident) for each run of pages in [a, e) (page
// aligned) that are all resident or all not. False when the range is not
// all mapped.
template <typename F>
bool for_each_run(char* a, char* e, std::uint64_t pg, F&& f) {
  std::vector<unsigned char> vec(static_cast<std::size_t>((e - a) / pg));
  if (vec.empty()) {
    return true;
  }
  if (::mincore(a, static_cast<std::size_t>(e - a), vec.data()) != 0) {
    return false;
  }
  std::size_t i = 0;
  while (i < vec.size()) {
    bool in = (vec[i] & 1) != 0;
    std::size_t j = i + 1;
    while (j < vec.size() && ((vec[j] & 1) != 0) == in) {
      ++j;
    }
    if (!f(a + i * pg, (j - i) * pg, in)) {
      break;
    }
    i = j;
  }
  return true;
}
#endif

}  // namespace

PagePool::~PagePool() {
  std::lock_guard<std::mutex> lock(mu_);
  trim_locked(0);
}

bool PagePool::supported() {
  return MLX_PAGER_PAGE_POOL != 0;
}

std::uint64_t PagePool::page_size() {
  static const std::uint64_t pg = [] {
    long n = ::sysconf(_SC_PAGESIZE);
    return n > 0 ? static_cast<std::uint64_t>(n) : std::uint64_t{4096};
  }();
  return pg;
}

void PagePool::set_room(Room room) {
  std::lock_guard<std::mutex> lock(mu_);
  room_ = std::move(room);
}

std::uint64_t PagePool::put(void* p, std::uint64_t len, std::uint64_t freeing) {
#if MLX_PAGER_PAGE_POOL
  const std::uint64_t pg = page_size();
  auto [a, e] = whole_pages(p, len, pg);
  std::lock_guard<std::mutex> lock(mu_);
  if (!room_ || paused_ || e == a || g_no_dontunmap.load()) {
    return 0;
  }
  std::uint64_t room = room_(freeing);
  std::uint64_t left = room > bytes_ ? (room - bytes_) / pg * pg : 0;
  std::uint64_t took = 0;
  for_each_run(a, e, pg, [&](char* run, std::uint64_t n, bool resident) {
    if (left == 0) {
      return false;
    }
    if (!resident) {
      return true;
    }
    n = std::min(n, left);
    std::uint64_t moved = move_out_locked(run, n);
    took += moved;
    left -= moved;
    return moved == n;
  });
  return took;
#else
  (void)p;
  (void)len;
  (void)freeing;
  return 0;
#endif
}

#if MLX_PAGER_PAGE_POOL
std::uint64_t PagePool::move_out_locked(char* run, std::uint64_t n) {
  void* dst = ::mmap(nullptr, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (dst == MAP_FAILED) {
    return 0;
  }
  // A pinned frame's pages are locked (mlock.h): the pool's are not.
  (void)::munlock(run, n);
  // MREMAP_DONTUNMAP: the frame's range stays mapped (unpopulated) in the
  // same call, for whoever frees it (malloc, or a cache that hands the
  // buffer out again). Never a hole in it, not even for a moment: another
  // thread's mmap could be given the hole, and the frame's owner would
  // then map over or unmap that thread's memory.
  if (::mremap(run, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, dst) == MAP_FAILED) {
    int err = errno;
    ::munmap(dst, n);
    if (err == EINVAL) {
      g_no_dontunmap.store(true);  // a kernel before 5.7: no pool
      return 0;
    }
    const std::uint64_t pg = page_size();
    if (err != EFAULT || n <= pg) {
      return 0;
    }
    // The run spans several mappings (a frame filled from several pieces),
    // which older kernels refuse to move in one call (EFAULT): each half.
    std::uint64_t half = n / pg / 2 * pg;
    std::uint64_t first = move_out_locked(run, half);
    return first < half ? first : first + move_out_locked(run + half, n - half);
  }
  pieces_.push_back(Piece{static_cast<char*>(dst), n});
  bytes_ += n;
  taken_ += n;
  return n;
}
#endif

std::uint64_t PagePool::fill(void* p, std::uint64_t len) {
#if MLX_PAGER_PAGE_POOL
  const std::uint64_t pg = page_size();
  auto [a, e] = whole_pages(p, len, pg);
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = false;  // paging again: frames freed from now on are kept
  if (pieces_.empty()) {
    return 0;
  }
  std::uint64_t moved = 0;
  for_each_run(a, e, pg, [&](char* run, std::uint64_t n, bool resident) {
    if (resident) {
      return true;
    }
    while (n > 0 && !pieces_.empty()) {
      Piece& src = pieces_.back();
      std::uint64_t take = std::min(n, src.len);
      // The piece's last `take` bytes over the run's first (the run's own
      // unpopulated pages are unmapped by the move).
      if (::mremap(src.addr + (src.len - take), take, take, MREMAP_MAYMOVE | MREMAP_FIXED, run) ==
          MAP_FAILED) {
        return false;
      }
      src.len -= take;
      if (src.len == 0) {
        pieces_.pop_back();
      }
      bytes_ -= take;
      filled_ += take;
      moved += take;
      run += take;
      n -= take;
    }
    return !pieces_.empty();
  });
  // The frame is charged already: what it did not take (its memory was
  // populated, or smaller) may be more than the room left.
  trim_locked(room_ ? room_(0) : 0);
  return moved;
#else
  (void)p;
  (void)len;
  return 0;
#endif
}

std::uint64_t PagePool::trim(std::uint64_t keep) {
  std::lock_guard<std::mutex> lock(mu_);
  return trim_locked(keep);
}

std::uint64_t PagePool::release() {
  std::lock_guard<std::mutex> lock(mu_);
  paused_ = true;
  return trim_locked(0);
}

std::uint64_t PagePool::trim_to_room() {
  std::lock_guard<std::mutex> lock(mu_);
  return trim_locked(room_ ? room_(0) : 0);
}

std::uint64_t PagePool::trim_locked(std::uint64_t keep) {
  std::uint64_t released = 0;
#if MLX_PAGER_PAGE_POOL
  while (bytes_ > keep && !pieces_.empty()) {
    Piece& last = pieces_.back();
    std::uint64_t drop =
        std::min(last.len, (bytes_ - keep + page_size() - 1) / page_size() * page_size());
    ::munmap(last.addr + (last.len - drop), drop);
    last.len -= drop;
    if (last.len == 0) {
      pieces_.pop_back();
    }
    bytes_ -= drop;
    released += drop;
  }
#else
  (void)keep;
#endif
  return released;
}

std::uint64_t PagePool::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

std::uint64_t PagePool::filled_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return filled_;
}

std::uint64_t PagePool::taken_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return taken_;
}

}  // namespace mlx_pager
