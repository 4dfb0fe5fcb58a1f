// mlx_frames.h: page frames in MLX's own memory.
//
// A frame is one buffer from MLX's allocator (so MLX's memory counters see
// it, and it is the memory MLX computes on, on every backend). The pager reads
// a page's bytes straight into it with direct I/O; the page's tensors are then
// mx::arrays that view the buffer at their offsets: no copy, and the buffer
// is freed (and the pager's budget credited) when the last view is gone.
//
// Recycling, twice. The pager hands the frame of a page it evicts, once no
// view or lease holds it (unshared), to the read that needed the room
// (PagerConfig::keep_free_frames: it stays charged). And the allocator keeps
// the last frame freed (one buffer, no longer
// charged to the pager's budget) and hands it to the next allocate() it fits,
// so a page streamed through a small budget lands in memory already mapped.
// An allocate() it does not fit frees it first. The kept frame is the one
// whose free just lowered the pager's charge, so charge + kept frame stays
// within the page budget: the plan needs no slack for it. Freeing frames to MLX instead costs a
// fresh mapping (page faults, zeroing) per read, and MLX's own cache keeps a freed frame only when
// its limit has room, which activations may have taken.
//
// Where MLX's buffers are this process's malloc memory (the CPU backend) and
// the platform can move pages (Linux), a page pool (page_pool.h) takes the
// kept frame's place: a freed frame's pages go to the pool, its buffer to
// MLX, and the next frames, of any size, take the pool's pages in place of
// fresh ones. Pages of several sizes (a block in parts) then land in memory
// already mapped too. The pool is memory outside MLX's counts
// (pooled_bytes), within the page budget (the pager bounds it).
//
// There, too, a frame's whole huge pages are advised to be huge pages
// before the read lands (huge_pages.h): direct reads into them run at the
// device's rate, into scattered small pages at 0.5-0.9x of it.
#pragma once

#include <memory>
#include <mutex>

#include <mlx/array.h>

#include "mm/frame.h"

namespace mlx_pager {

namespace mx = mlx::core;

class MlxFrameAllocator : public FrameAllocator {
 public:
  // page_pool: use a page pool where the backend and platform allow it;
  // false: the one kept frame.
  explicit MlxFrameAllocator(bool page_pool = true);
  std::uint64_t footprint(std::uint64_t bytes) const override;
  // footprint() plus what MLX's buffer cache may hand back beyond it (under
  // two of its pages: backend/common/buffer_cache.h), and without a page pool
  // what the kept frame may be reused at (allocate()).
  std::uint64_t charge_bound(std::uint64_t bytes) const override;
  Frame allocate(std::uint64_t bytes, std::function<void()> on_free) override;
  // No lease and no array view holds the frame's buffer.
  bool unshared(const Frame& frame) const override;
  // Frees the kept frame to MLX (then mx.clear_cache() can return it to the
  // OS) and the page pool's pages to the OS; the pool keeps no freed frame's
  // pages until the next frame is allocated (PagePool::release). Returns
  // their bytes (0: none were kept).
  std::uint64_t drop_kept();
  // The kept frame's bytes (0: none): MLX's active memory counts them.
  std::uint64_t kept_bytes() const;
  // The page pool's bytes (0: none): memory outside MLX's counts.
  std::uint64_t pooled_bytes() const;
  // Bytes frames took from the page pool in place of fresh memory.
  std::uint64_t pooled_filled_bytes() const;
  PagePool* pool() override;

  // A row-major array of `dtype` and `shape` viewing the frame at
  // `frame_offset` (which must be a multiple of the dtype's size). The view
  // keeps the frame's memory alive.
  static mx::array view(
      const Frame& frame, std::uint64_t frame_offset, mx::Dtype dtype, const mx::Shape& shape);
  // The same frame behind a buffer of its own (MLX's Data, not owned, so
  // never donated to an op's output): views of the returned frame keep the
  // memory alive, and when the last of them is freed, on whatever thread,
  // `on_release` runs (it must not throw). A lease on the page the frame
  // holds (Pager::acquire_lease).
  static Frame lease(const Frame& frame, std::function<void()> on_release);

  // The one frame kept for reuse; shared with the frames' deleters, which
  // may run after the allocator is gone (on any thread).
  struct Kept {
    ~Kept();
    mutable std::mutex mu;
    void* buffer = nullptr;  // an mx::allocator::Buffer's ptr(); null: none
    std::uint64_t size = 0;  // its size from MLX's allocator
    // Where MLX's buffers are host memory that can move (CPU backend, Linux):
    // freed frames' pages, in place of the kept frame (set once, at
    // construction).
    std::shared_ptr<PagePool> pool;
  };

 private:
  std::shared_ptr<Kept> kept_;
  // Where MLX's buffers are this process's malloc memory (CPU backend):
  // frames are advised into huge pages (huge_pages.h).
  bool huge_pages_ = false;
};

}  // namespace mlx_pager
