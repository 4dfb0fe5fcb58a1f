// mlx_frames.h: page frames in MLX's own memory.
//
// A frame is one buffer from MLX's allocator (so MLX's memory counters see
// it, and it is the memory MLX computes on, on every backend). The pager reads
// a page's bytes straight into it with direct I/O; the page's tensors are then
// mx::arrays that view the buffer at their offsets: no copy, and the buffer
// is freed (and the pager's budget credited) when the last view is gone.
#pragma once

#include <memory>

#include <mlx/array.h>

#include "mm/frame.h"

namespace mlx_pager {

namespace mx = mlx::core;

class MlxFrameAllocator : public FrameAllocator {
 public:
  std::uint64_t footprint(std::uint64_t bytes) const override;
  Frame allocate(std::uint64_t bytes, std::function<void()> on_free) override;

  // A row-major array of `dtype` and `shape` viewing the frame at
  // `frame_offset` (which must be a multiple of the dtype's size). The view
  // keeps the frame's memory alive.
  static mx::array view(
      const Frame& frame, std::uint64_t frame_offset, mx::Dtype dtype, const mx::Shape& shape);
};

}  // namespace mlx_pager
