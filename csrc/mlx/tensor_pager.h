// tensor_pager.h: the pager as MLX sees it: pages of named mx::arrays.
//
// Each page is a group of tensors (one transformer block's frozen weights,
// say) with a dtype and shape each, read either in place from safetensors
// files or from the pager's swap file. acquire() returns the tensors as
// mx::arrays holding exactly the stored bytes, viewing the page's frame (no
// copy); release() lets the page be evicted. Everything else (budget,
// schedule, policies, readahead, counters) is the Pager's (mm/pager.h).
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <mlx/array.h>

#include "mlx/mlx_frames.h"
#include "mm/lifetime_gate.h"
#include "mm/pager.h"
#include "mm/swapfile.h"

namespace mlx_pager {

struct TensorSpec {
  std::string name;
  mx::Dtype dtype = mx::uint8;
  mx::Shape shape;
};

// A tensor stored in a file: `nbytes` bytes at absolute `offset` of `path`.
struct FileTensor {
  TensorSpec spec;
  std::string path;
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
};

using NamedArrays = std::vector<std::pair<std::string, mx::array>>;

class TensorPager {
 public:
  explicit TensorPager(PagerConfig config);
  // Lazy pages evaluated from now on throw; arrays still viewing frames keep
  // their memory (mlx_frames.h), and their leases end harmlessly
  // (Pager::lease_releaser).
  ~TensorPager();
  TensorPager(const TensorPager&) = delete;
  TensorPager& operator=(const TensorPager&) = delete;

  // A page read in place from the tensors' files. Throws std::invalid_argument
  // (naming the page and tensor) if a tensor cannot be viewed in place; such
  // a page goes to the swap file instead.
  // `checksum`: verify every read against it (checksum.h: the combined XXH3
  // of the tensors' bytes, in the order given); nullptr: no verification.
  PageId add_page_in_place(
      const std::string& name,
      const std::vector<FileTensor>& tensors,
      int priority = 0,
      const std::uint64_t* checksum = nullptr);
  // A page written by write_swap_page() at `page_offset` of `swap_path`.
  PageId add_page_from_swap(
      const std::string& name,
      const std::string& swap_path,
      std::uint64_t page_offset,
      const std::vector<TensorSpec>& tensors,
      int priority = 0,
      const std::uint64_t* checksum = nullptr);  // as write_swap_page returned it

  // The page's tensors, in registration order. Blocks while the page is read.
  NamedArrays acquire(PageId id);
  void release(PageId id) { pager_.release(id); }
  // acquire() whose arrays release the page themselves: when the last of
  // them is freed, on any thread (Pager::acquire_lease, MlxFrameAllocator::
  // lease). Until then the pager counts the page as in use, so it neither
  // evicts it under the arrays nor reads another page into memory they
  // still hold. No release() call.
  NamedArrays acquire_leased(PageId id);
  // The page's tensors' (dtype, shape), in registration order (no read).
  std::vector<std::pair<mx::Dtype, mx::Shape>> specs(PageId id) const;

  // Reaches this TensorPager while it lives: what a graph holding lazy pages
  // (paged_tensor.h), which may outlive it, holds.
  std::shared_ptr<LifetimeGate<TensorPager>> gate() const { return gate_; }

  Pager& pager() { return pager_; }
  const Pager& pager() const { return pager_; }
  // The frames' allocator, which keeps the last frame freed for reuse.
  MlxFrameAllocator& frames() { return *alloc_; }
  const MlxFrameAllocator& frames() const { return *alloc_; }

 private:
  struct Placed {
    TensorSpec spec;
    std::uint64_t frame_offset;
  };
  PageId add(PageSpec spec, std::vector<Placed> tensors);
  // Page `id`'s tensors viewing `frame`, in registration order.
  NamedArrays views(PageId id, const Frame& frame) const;

  std::shared_ptr<LifetimeGate<TensorPager>> gate_;
  std::shared_ptr<MlxFrameAllocator> alloc_;
  Pager pager_;
  mutable std::mutex mu_;
  std::deque<std::vector<Placed>> layouts_;  // by PageId
};

// Appends one page made of `arrays` to a swap file (evaluating them), laid
// out as add_page_from_swap expects. Returns the page's offset in the file;
// stores the page's checksum (checksum.h) in `*checksum` when given.
std::uint64_t write_swap_page(
    SwapWriter& writer, const std::vector<mx::array>& arrays, std::uint64_t* checksum = nullptr);

// Writes the page made of `arrays` over the page at `page_offset` of an
// existing swap file (a page rebuilt after a checksum failure). Returns the
// checksum of what was written.
std::uint64_t rewrite_swap_page(
    const std::string& swap_path, std::uint64_t page_offset, const std::vector<mx::array>& arrays);

// Writes the bytes of `array` (made contiguous) at `offset` of the existing
// file `path`, synced and dropped from the page cache, with no checksum: a
// spilled activation (spill.py) that lives for one step. The page registered
// there must then be discarded (Pager::discard) before it is acquired again.
void write_swap_array(const std::string& path, std::uint64_t offset, const mx::array& array);

// The MLX dtype of a safetensors dtype name; throws naming unknown ones.
mx::Dtype dtype_from_safetensors(const std::string& name);

}  // namespace mlx_pager
