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

namespace mlx_pager {

struct Frame {
  char* data = nullptr;  // aligned to kIoAlign
  std::size_t size = 0;  // usable bytes at data
  std::shared_ptr<void> owner;  // keeps the memory alive
};

class FrameAllocator {
 public:
  virtual ~FrameAllocator() = default;
  // Bytes an allocation of `bytes` usable bytes costs (what the budget is
  // charged). Must be exact for the accounting to be exact.
  virtual std::uint64_t footprint(std::uint64_t bytes) const = 0;
  // Allocates a frame of at least `bytes` usable bytes aligned to kIoAlign.
  // `on_free` must run exactly once, when the memory is released.
  // Throws std::bad_alloc (or the backend's error) on failure.
  virtual Frame allocate(std::uint64_t bytes, std::function<void()> on_free) = 0;
};

// Frames from posix_memalign: for the MLX-free core and its tests.
class HeapFrameAllocator : public FrameAllocator {
 public:
  std::uint64_t footprint(std::uint64_t bytes) const override;
  Frame allocate(std::uint64_t bytes, std::function<void()> on_free) override;
};

}  // namespace mlx_pager
