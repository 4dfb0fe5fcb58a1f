// frame.h: the memory a resident page lives in.
//
// The pager does not own memory; a FrameAllocator does. The MLX layer
// allocates frames from MLX's own allocator, so that a page's tensors are
// mx::arrays viewing the frame with no copy; tests use the heap allocator.
// A frame is freed when the last reference to `owner` goes, which may be long
// after the pager evicted it (an array still in use elsewhere). The
// allocator calls `on_free` at that moment, so the pager's accounting sees
// memory that is really gone, not memory it merely let go of.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "mm/page_pool.h"

namespace mlx_pager {

struct Frame {
  char* data = nullptr;  // aligned to kIoAlign
  std::size_t size = 0;  // usable bytes at data
  // Bytes the allocation really costs (what the budget is charged): at least
  // footprint(size) asked for; more when the backend rounds up or hands back
  // a larger cached buffer.
  std::uint64_t footprint = 0;
  std::shared_ptr<void> owner;  // keeps the memory alive
};

// How much more than a fresh frame's `need` bytes a reused one may cost: a
// kept frame of a page's own size, give or take MLX's rounding (a few pages);
// for a small page (under 256 KB) 1/16 of it, but at least one IO_ALIGN, so
// that pages of different sizes do not swap frames and each charge up to a
// third more. (With 16 KB VM pages, as on Apple silicon, a page under 64 KB
// then never reuses a frame: only test-sized pages are that small.)
// (MLX's one kept frame, mlx_frames.h, also takes up to 1/16 more for a large
// page: MLX's cache rounds those by more, and a frame not reused there is
// one more allocation beside the one freed.)
inline constexpr std::uint64_t reuse_slack(std::uint64_t need) {
  constexpr std::uint64_t kPage = 4096;  // kIoAlign (direct_io.h)
  std::uint64_t rel = need / 16;
  return rel < kPage ? kPage : (rel > 4 * kPage ? 4 * kPage : rel);
}

class FrameAllocator {
 public:
  virtual ~FrameAllocator() = default;
  // Bytes an allocation of `bytes` usable bytes asks the backend for: what
  // the pager reserves in the budget before allocating. The allocated
  // frame's `footprint` is the exact cost, charged once it is known.
  virtual std::uint64_t footprint(std::uint64_t bytes) const = 0;
  // The most a frame of `bytes` usable bytes may cost: footprint(), or more
  // where the backend hands out a larger buffer it rounds up or reuses.
  // Default: footprint().
  virtual std::uint64_t charge_bound(std::uint64_t bytes) const { return footprint(bytes); }
  // Allocates a frame of at least `bytes` usable bytes aligned to kIoAlign,
  // with `footprint` set to what the memory really costs. `on_free` runs
  // exactly once, when the memory of the returned frame is released; never
  // when allocate throws. Throws std::bad_alloc (or the backend's error).
  virtual Frame allocate(std::uint64_t bytes, std::function<void()> on_free) = 0;
  // True when nothing but `frame` itself references its memory (no array
  // views it): the pager may then keep it, still charged, for another page's
  // read (PagerConfig::keep_free_frames). A pure query: the pager calls it
  // under its lock. Default: never (the frame is freed on eviction).
  virtual bool unshared(const Frame& frame) const;
  // The pool that hands freed frames' pages to the next frames (page_pool.h),
  // or null: frames are mapped fresh. The pager bounds it by its budget.
  virtual PagePool* pool() { return nullptr; }
};

// Frames from posix_memalign: for the MLX-free core and its tests.
// With a page pool where the platform has one (page_pool.h): a freed
// frame's pages go to the next frames.
class HeapFrameAllocator : public FrameAllocator {
 public:
  explicit HeapFrameAllocator(bool page_pool = true);
  std::uint64_t footprint(std::uint64_t bytes) const override;
  Frame allocate(std::uint64_t bytes, std::function<void()> on_free) override;
  bool unshared(const Frame& frame) const override;
  PagePool* pool() override { return pool_.get(); }

 private:
  // Shared with the frames' deleters, which may run after the allocator is
  // gone.
  std::shared_ptr<PagePool> pool_;
};

}  // namespace mlx_pager
