// frame.cpp: the heap frame allocator.
#include "mm/frame.h"

#include "mm/direct_io.h"

namespace mlx_pager {

bool FrameAllocator::unshared(const Frame&) const {
  return false;
}

bool HeapFrameAllocator::unshared(const Frame& frame) const {
  return frame.owner != nullptr && frame.owner.use_count() == 1;
}

std::uint64_t HeapFrameAllocator::footprint(std::uint64_t bytes) const {
  return align_up(bytes == 0 ? 1 : bytes, kIoAlign);
}

Frame HeapFrameAllocator::allocate(std::uint64_t bytes, std::function<void()> on_free) {
  std::size_t n = footprint(bytes);
  char* p = static_cast<char*>(aligned_alloc_io(n));
  Frame f;
  f.data = p;
  f.size = n;
  f.footprint = n;
  f.owner = std::shared_ptr<void>(p, [on_free = std::move(on_free)](void* q) {
    aligned_free_io(q);
    on_free();
  });
  return f;
}

}  // namespace mlx_pager
