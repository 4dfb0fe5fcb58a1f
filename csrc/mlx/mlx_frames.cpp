// mlx_frames.cpp: frames allocated by MLX, and zero-copy views into them.
#include "mlx/mlx_frames.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <mlx/allocator.h>
#include <mlx/device.h>

#include "mm/direct_io.h"
#include "mm/huge_pages.h"

namespace mlx_pager {

namespace {

// What a frame's owner holds: a uint8 array owning the MLX buffer, and where
// the aligned frame starts inside that buffer.
struct MlxFrameOwner {
  mx::array base;
  std::uint64_t data_offset;  // bytes from the buffer's raw_ptr to frame.data
};

}  // namespace

MlxFrameAllocator::Kept::~Kept() {
  if (buffer != nullptr) {
    mx::allocator::allocator().free(mx::allocator::Buffer(buffer));
  }
}

MlxFrameAllocator::MlxFrameAllocator(bool page_pool) : kept_(std::make_shared<Kept>()) {
  // MLX's CPU allocator's buffers are malloc's memory, whose pages may move
  // (page_pool.h); a GPU backend's are not.
  if (page_pool && PagePool::supported() && !mx::is_available(mx::Device::gpu)) {
    kept_->pool = std::make_shared<PagePool>();
  }
  huge_pages_ = !mx::is_available(mx::Device::gpu);
}

PagePool* MlxFrameAllocator::pool() {
  return kept_->pool.get();
}

std::uint64_t MlxFrameAllocator::pooled_bytes() const {
  return kept_->pool != nullptr ? kept_->pool->bytes() : 0;
}

std::uint64_t MlxFrameAllocator::pooled_filled_bytes() const {
  return kept_->pool != nullptr ? kept_->pool->filled_bytes() : 0;
}

std::uint64_t MlxFrameAllocator::drop_kept() {
  void* b = nullptr;
  std::uint64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(kept_->mu);
    b = std::exchange(kept_->buffer, nullptr);
    n = std::exchange(kept_->size, 0);
  }
  if (b != nullptr) {
    mx::allocator::allocator().free(mx::allocator::Buffer(b));
  }
  if (kept_->pool != nullptr) {
    n += kept_->pool->release();
  }
  return n;
}

std::uint64_t MlxFrameAllocator::kept_bytes() const {
  std::lock_guard<std::mutex> lock(kept_->mu);
  return kept_->size;
}

std::uint64_t MlxFrameAllocator::footprint(std::uint64_t bytes) const {
  // One kIoAlign of slack lets the frame start aligned inside the buffer.
  return bytes + kIoAlign;
}

std::uint64_t MlxFrameAllocator::charge_bound(std::uint64_t bytes) const {
  std::uint64_t request = footprint(bytes);
  // MLX's buffer cache pages are the VM's (4 KB on Linux, 16 KB on Apple
  // silicon).
  std::uint64_t cache = 2 * PagePool::page_size();
  if (kept_->pool != nullptr) {
    return request + cache;
  }
  return request + std::max({cache, reuse_slack(request), request / 16});
}

namespace {

// The shape of the uint8 array that owns a frame's buffer. MLX's dimensions
// are int32, so a frame of 2 GiB or more (the resident page of a model with
// a large vocabulary: Qwen2.5-7B's embeddings and head in bfloat16 are
// 2.2 GB) is rows of kIoAlign bytes, the last partial row left out: the
// array only owns the buffer, and MLX never reads it (views of the frame
// carry their own shapes and sizes, copy_shared_buffer).
mx::Shape base_shape(std::uint64_t request) {
  constexpr auto kMaxDim = static_cast<std::uint64_t>(std::numeric_limits<int32_t>::max());
  if (request <= kMaxDim) {
    return {static_cast<int32_t>(request)};
  }
  if (request / kIoAlign > kMaxDim) {
    throw std::invalid_argument(
        "[MlxFrameAllocator::allocate] a page of " + std::to_string(request) +
        " bytes is larger than one MLX array can hold: page the model in more parts");
  }
  return {static_cast<int32_t>(request / kIoAlign), static_cast<int32_t>(kIoAlign)};
}

}  // namespace

Frame MlxFrameAllocator::allocate(std::uint64_t bytes, std::function<void()> on_free) {
  std::uint64_t request = footprint(bytes);
  // Set once the frame is handed out: if building it throws, the buffer is
  // freed without on_free (the caller never saw the frame).
  auto handed_out = std::make_shared<std::atomic<bool>>(false);
  mx::allocator::Allocator& mlx_alloc = mx::allocator::allocator();
  // The kept frame, if this page fits it without wasting more than MLX's
  // own cache would (it hands back buffers up to two pages larger, plus
  // rounding): pages of one model's blocks are one size.
  // A kept frame this page does not fit is freed first: the kept frame is
  // the one the pager's charge just dropped, so the charge plus the kept
  // frame never exceeds what the charge once was (the page budget), and a
  // new frame never lands beside a stale one.
  mx::allocator::Buffer buf(nullptr);
  void* stale = nullptr;
  std::shared_ptr<PagePool> pool = kept_->pool;
  if (pool == nullptr) {
    std::lock_guard<std::mutex> lock(kept_->mu);
    if (kept_->buffer != nullptr) {
      void* b = std::exchange(kept_->buffer, nullptr);
      // Up to 1/16 larger (MLX's cache rounds larger pages by more than the
      // pager's reuse_slack allows), never more than reuse_slack for a small
      // page.
      bool fits = kept_->size >= request &&
          kept_->size <= request + std::max(reuse_slack(request), request / 16);
      kept_->size = 0;
      if (fits) {
        buf = mx::allocator::Buffer(b);
      } else {
        stale = b;
      }
    }
  }
  if (stale != nullptr) {
    mlx_alloc.free(mx::allocator::Buffer(stale));
  }
  if (buf.ptr() == nullptr) {
    buf = mlx_alloc.malloc(request);
    if (pool != nullptr && buf.ptr() != nullptr && mlx_alloc.size(buf) > request) {
      // MLX's cache handed back a larger buffer: with the pool, freed
      // frames' shells (their pages gone to the pool) sit in MLX's cache, and
      // a page a little smaller than the last one would be charged the
      // difference (a one-page budget then evicts the page read ahead for
      // the next use). Hold it aside for a buffer of the exact size; they
      // go back to the cache.
      std::vector<mx::allocator::Buffer> aside;
      for (int tries = 0; tries < 4 && buf.ptr() != nullptr && mlx_alloc.size(buf) > request;
           ++tries) {
        aside.push_back(buf);
        buf = mlx_alloc.malloc(request);
      }
      if (buf.ptr() == nullptr || mlx_alloc.size(buf) > request) {
        if (buf.ptr() != nullptr) {
          aside.push_back(buf);
        }
        buf = aside.front();  // the first, as any allocation would have had
        aside.erase(aside.begin());
      }
      for (mx::allocator::Buffer b : aside) {
        mlx_alloc.free(b);
      }
    }
  }
  if (buf.ptr() == nullptr) {
    throw std::bad_alloc();
  }
  // What the buffer really holds: Metal rounds up to pages, and every
  // backend's cache may hand back a larger free buffer (the CPU one does,
  // up to two pages larger).
  std::uint64_t exact = mlx_alloc.size(buf);
  auto* raw = static_cast<char*>(buf.raw_ptr());
  std::uint64_t offset = align_up(reinterpret_cast<std::uintptr_t>(raw), kIoAlign) -
      reinterpret_cast<std::uintptr_t>(raw);
  std::uint64_t footprint = std::max(exact, request);
  if (huge_pages_) {
    // Direct reads into huge pages run at the device's rate, not at where
    // scattered small pages happen to lie (huge_pages.h).
    advise_huge_pages(raw + offset, bytes);
  }
  if (pool != nullptr) {
    // Pages freed frames left behind, in place of fresh ones.
    pool->fill(raw + offset, bytes);
  }
  mx::array base(
      mx::allocator::Data(
          buf,
          [on_free = std::move(on_free), handed_out, kept = kept_, offset, bytes,
           footprint](mx::allocator::Buffer b) {
            mx::allocator::Allocator& a = mx::allocator::allocator();
            if (kept->pool != nullptr) {
              // Its pages go to the pool (as far as the budget has room
              // once this frame's charge is credited back), the buffer to
              // MLX.
              bool charged = handed_out->load();
              kept->pool->put(
                  static_cast<char*>(b.raw_ptr()) + offset, bytes, charged ? footprint : 0);
              a.free(b);
              if (charged) {
                on_free();
              }
              return;
            }
            // Keep this frame for the next read; free the one kept before.
            std::uint64_t size = a.size(b);
            void* old = nullptr;
            {
              std::lock_guard<std::mutex> lock(kept->mu);
              old = std::exchange(kept->buffer, b.ptr());
              kept->size = size;
            }
            if (old != nullptr) {
              a.free(mx::allocator::Buffer(old));
            }
            if (handed_out->load()) {
              on_free();
            }
          }),
      base_shape(request), mx::uint8);
  Frame f;
  f.data = raw + offset;
  f.size = bytes;
  f.footprint = footprint;
  f.owner = std::make_shared<MlxFrameOwner>(MlxFrameOwner{std::move(base), offset});
  handed_out->store(true);
  return f;
}

bool MlxFrameAllocator::unshared(const Frame& frame) const {
  if (frame.owner == nullptr || frame.owner.use_count() != 1) {
    return false;  // leased (a lease keeps the owner)
  }
  // Views share the base array's Data (copy_shared_buffer).
  const auto& owner = *static_cast<const MlxFrameOwner*>(frame.owner.get());
  return owner.base.data_shared_ptr().use_count() == 1;
}

Frame MlxFrameAllocator::lease(const Frame& frame, std::function<void()> on_release) {
  const auto& owner = *static_cast<const MlxFrameOwner*>(frame.owner.get());
  mx::array base = owner.base;
  mx::allocator::Buffer buf = base.buffer();
  std::shared_ptr<void> keep = frame.owner;
  mx::array leased(
      mx::allocator::Data(
          buf,
          [keep = std::move(keep),
           on_release = std::move(on_release)](mx::allocator::Buffer) mutable {
            // The lease's hold on the frame goes first: the pager, told
            // next, may evict the page at once, and keeps its frame for
            // another read only when nothing else holds it (unshared). A
            // frame the page still holds is not freed here.
            keep.reset();
            on_release();
          }),
      base.shape(), base.dtype());
  Frame out = frame;
  out.owner = std::make_shared<MlxFrameOwner>(MlxFrameOwner{std::move(leased), owner.data_offset});
  return out;
}

mx::array MlxFrameAllocator::view(
    const Frame& frame, std::uint64_t frame_offset, mx::Dtype dtype, const mx::Shape& shape) {
  const auto& owner = *static_cast<const MlxFrameOwner*>(frame.owner.get());
  std::uint64_t item = mx::size_of(dtype);
  // copy_shared_buffer's offset counts elements of the new dtype, from the
  // buffer's raw_ptr: the tensor must start at a whole element both in the
  // frame and from raw_ptr (which the frame start is aligned against).
  std::uint64_t byte_offset = owner.data_offset + frame_offset;
  if (frame_offset % item != 0 || byte_offset % item != 0) {
    throw std::logic_error(
        "[MlxFrameAllocator::view] tensor offset " + std::to_string(frame_offset) +
        " is not a multiple of its item size " + std::to_string(item));
  }
  mx::array out(shape, dtype, nullptr, {});
  std::uint64_t nbytes = out.nbytes();
  // Written so that nothing overflows (frame.size is any 64-bit size).
  if (nbytes > frame.size || frame_offset > frame.size - nbytes) {
    throw std::logic_error(
        "[MlxFrameAllocator::view] tensor of " + std::to_string(nbytes) + " bytes at offset " +
        std::to_string(frame_offset) + " runs past its frame of " + std::to_string(frame.size) +
        " bytes");
  }
  mx::Strides strides(shape.size());
  int64_t stride = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  mx::array::Flags flags;
  flags.contiguous = true;
  flags.row_contiguous = true;
  int64_t nontrivial = 0;
  for (auto d : shape) {
    nontrivial += d > 1;
  }
  flags.col_contiguous = nontrivial <= 1;
  out.copy_shared_buffer(
      owner.base, strides, flags, out.size(), static_cast<std::int64_t>(byte_offset / item));
  out.set_status(mx::array::Status::available);
  return out;
}

}  // namespace mlx_pager
