// frame.cpp: the heap frame allocator.
#include "mm/frame.h"

#include "mm/direct_io.h"
#include "mm/huge_pages.h"

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

HeapFrameAllocator::HeapFrameAllocator(bool page_pool)
    : pool_(page_pool && PagePool::supported() ? std::make_shared<PagePool>() : nullptr) {}

Frame HeapFrameAllocator::allocate(std::uint64_t bytes, std::function<void()> on_free) {
  std::size_t n = footprint(bytes);
  char* p = static_cast<char*>(aligned_alloc_io(n));
  advise_huge_pages(p, n);  // before anything touches it (huge_pages.h)
  if (pool_ != nullptr) {
    pool_->fill(p, n);
  }
  Frame f;
  f.data = p;
  f.size = n;
  f.footprint = n;
  f.owner = std::shared_ptr<void>(p, [on_free = std::move(on_free), pool = pool_, n](void* q) {
    if (pool != nullptr) {
      pool->put(q, n, n);
    }
    aligned_free_io(q);
    on_free();
  });
  return f;
}

}  // namespace mlx_pager
