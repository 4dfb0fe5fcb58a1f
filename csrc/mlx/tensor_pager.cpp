// tensor_pager.cpp: pages of mx::arrays over the MLX-free pager.
#include "mlx/tensor_pager.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <mlx/ops.h>
#include <mlx/transforms.h>

#include "mm/checksum.h"
#include "mm/layout.h"
#include "mm/safetensors.h"

namespace mlx_pager {

static std::uint64_t spec_nbytes(const TensorSpec& t) {
  std::uint64_t n = mx::size_of(t.dtype);
  for (auto d : t.shape) {
    if (d < 0) {
      throw std::invalid_argument("[TensorPager] tensor '" + t.name + "' has a negative dimension");
    }
    n *= static_cast<std::uint64_t>(d);
  }
  return n;
}

TensorPager::TensorPager(PagerConfig config)
    : gate_(std::make_shared<LifetimeGate<TensorPager>>(this)),
      alloc_(std::make_shared<MlxFrameAllocator>(config.page_pool)),
      pager_(config, alloc_) {}

TensorPager::~TensorPager() {
  gate_->close();  // waits for lazy pages being evaluated
}

PageId TensorPager::add(PageSpec spec, std::vector<Placed> tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  PageId id = pager_.add_page(std::move(spec));
  if (id != layouts_.size()) {
    throw std::logic_error("[TensorPager] pages were added to the pager directly");
  }
  layouts_.push_back(std::move(tensors));
  return id;
}

PageId TensorPager::add_page_in_place(
    const std::string& name,
    const std::vector<FileTensor>& tensors,
    int priority,
    const std::uint64_t* checksum) {
  std::vector<TensorSource> sources;
  std::vector<std::uint64_t> file_sizes;
  for (const FileTensor& t : tensors) {
    std::uint64_t want = spec_nbytes(t.spec);
    if (want != t.nbytes) {
      throw std::invalid_argument(
          "[TensorPager] page '" + name + "': tensor '" + t.spec.name + "' is " +
          std::to_string(t.nbytes) + " bytes in " + t.path + " but its dtype and shape need " +
          std::to_string(want));
    }
    FileId f = pager_.add_file(t.path);
    if (f >= file_sizes.size()) {
      file_sizes.resize(f + 1, 0);
    }
    if (file_sizes[f] == 0) {
      file_sizes[f] = std::filesystem::file_size(t.path);  // once per file
    }
    sources.push_back(TensorSource{
        t.spec.name, f, t.offset, t.nbytes, static_cast<std::uint32_t>(mx::size_of(t.spec.dtype))});
  }
  // Read through gaps (other pages' bytes) only when they are small next to
  // the page itself: at most 1/kGapFraction of it, and at most
  // kMaxReadThroughGap.
  constexpr std::uint64_t kGapFraction = 8;
  std::uint64_t page_bytes = 0;
  for (const TensorSource& t : sources) {
    page_bytes += t.nbytes;
  }
  std::uint64_t max_gap = std::min<std::uint64_t>(kMaxReadThroughGap, page_bytes / kGapFraction);
  PagePlan plan;
  try {
    plan = plan_in_place(sources, file_sizes, max_gap);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        "[TensorPager] page '" + name + "' cannot be read in place: " + e.what());
  }
  std::vector<Placed> placed;
  PageSpec spec;
  spec.name = name;
  spec.frame_bytes = plan.frame_bytes;
  spec.extents = plan.extents;
  spec.priority = priority;
  spec.moves = plan.moves;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    placed.push_back(Placed{tensors[i].spec, plan.tensors[i].frame_offset});
    spec.verify.push_back(FrameRange{plan.tensors[i].frame_offset, plan.tensors[i].nbytes});
    spec.verify_as_read.push_back(FrameRange{plan.tensors[i].read_offset, plan.tensors[i].nbytes});
  }
  if (checksum != nullptr) {
    spec.checked = true;
    spec.checksum = *checksum;
  }
  return add(std::move(spec), std::move(placed));
}

PageId TensorPager::add_page_from_swap(
    const std::string& name,
    const std::string& swap_path,
    std::uint64_t page_offset,
    const std::vector<TensorSpec>& tensors,
    int priority,
    const std::uint64_t* checksum) {
  FileId f = pager_.add_file(swap_path);
  std::vector<std::string> names;
  std::vector<std::uint64_t> sizes;
  for (const TensorSpec& t : tensors) {
    names.push_back(t.name);
    sizes.push_back(spec_nbytes(t));
  }
  PagePlan plan = plan_from_swap(f, page_offset, names, sizes);
  std::uint64_t file_size = std::filesystem::file_size(swap_path);
  if (page_offset + plan.frame_bytes > file_size) {
    throw std::invalid_argument(
        "[TensorPager] page '" + name + "' ends at byte " +
        std::to_string(page_offset + plan.frame_bytes) + " of " + swap_path + " but the file has " +
        std::to_string(file_size) +
        " bytes: the swap file is stale or truncated (delete it to rebuild)");
  }
  std::vector<Placed> placed;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    placed.push_back(Placed{tensors[i], plan.tensors[i].frame_offset});
  }
  PageSpec spec;
  spec.name = name;
  spec.frame_bytes = plan.frame_bytes;
  spec.extents = plan.extents;
  spec.priority = priority;
  if (checksum != nullptr) {
    spec.checked = true;
    spec.checksum = *checksum;
    spec.verify.push_back(FrameRange{0, plan.frame_bytes});
    spec.verify_as_read = spec.verify;  // a swap page moves nothing
  }
  return add(std::move(spec), std::move(placed));
}

NamedArrays TensorPager::views(PageId id, const Frame& frame) const {
  const std::vector<Placed>* layout;
  {
    std::lock_guard<std::mutex> lock(mu_);
    layout = &layouts_.at(id);  // deque: stays valid as pages are added
  }
  NamedArrays out;
  out.reserve(layout->size());
  for (const Placed& p : *layout) {
    out.emplace_back(
        p.spec.name, MlxFrameAllocator::view(frame, p.frame_offset, p.spec.dtype, p.spec.shape));
  }
  return out;
}

NamedArrays TensorPager::acquire(PageId id) {
  Frame frame = pager_.acquire(id);
  try {
    return views(id, frame);
  } catch (...) {
    pager_.release(id);
    throw;
  }
}

NamedArrays TensorPager::acquire_leased(PageId id) {
  Frame frame = pager_.acquire_lease(id);
  Frame leased;
  try {
    leased = MlxFrameAllocator::lease(frame, pager_.lease_releaser(id));
  } catch (...) {
    pager_.release_lease(id);
    throw;
  }
  // The lease ends when `leased` and these views are all gone (also if
  // making them throws).
  return views(id, leased);
}

// Evaluates `a` as a row-contiguous array (e.g. of a transposed or
// broadcast one), whose bytes are the tensor's.
static mx::array contiguous_eval(const mx::array& a) {
  mx::array c = a;
  mx::eval(c);
  if (!c.flags().row_contiguous) {
    c = mx::contiguous(c);
    mx::eval(c);
  }
  return c;
}

std::uint64_t write_swap_page(
    SwapWriter& writer, const std::vector<mx::array>& arrays, std::uint64_t* checksum) {
  // The layout is plan_swap_page's, the one add_page_from_swap reads back.
  std::vector<std::uint64_t> nbytes;
  nbytes.reserve(arrays.size());
  for (const mx::array& a : arrays) {
    nbytes.push_back(a.nbytes());
  }
  SwapPageLayout layout = plan_swap_page(nbytes);
  std::uint64_t start = writer.begin_page();
  Hasher h;  // what is written from `start` on, zeros included
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    mx::array c = contiguous_eval(arrays[i]);
    h.update(nullptr, start + layout.offsets[i] - writer.position());
    writer.fill_to(start + layout.offsets[i]);
    h.update(c.data<char>(), c.nbytes());
    writer.write(c.data<char>(), c.nbytes());
  }
  h.update(nullptr, start + layout.bytes - writer.position());
  writer.fill_to(start + layout.bytes);
  if (checksum != nullptr) {
    *checksum = combine_digests({h.digest()});
  }
  return start;
}

std::uint64_t rewrite_swap_page(
    const std::string& swap_path, std::uint64_t page_offset, const std::vector<mx::array>& arrays) {
  std::vector<std::uint64_t> nbytes;
  for (const mx::array& a : arrays) {
    nbytes.push_back(a.nbytes());
  }
  SwapPageLayout layout = plan_swap_page(nbytes);
  std::vector<char> page(layout.bytes, 0);
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    mx::array c = contiguous_eval(arrays[i]);
    std::memcpy(page.data() + layout.offsets[i], c.data<char>(), c.nbytes());
  }
  rewrite_swap_range(swap_path, page_offset, page.data(), page.size());
  return combine_digests({xxh3(page.data(), page.size())});
}

void write_swap_array(const std::string& path, std::uint64_t offset, const mx::array& array) {
  mx::array c = contiguous_eval(array);
  rewrite_swap_range(path, offset, c.data<char>(), c.nbytes());
}

static mx::Dtype to_mlx(ScalarType t) {
  switch (t) {  // exhaustive: a new ScalarType fails to compile (-Wswitch)
    case ScalarType::bool_:
      return mx::bool_;
    case ScalarType::uint8:
      return mx::uint8;
    case ScalarType::int8:
      return mx::int8;
    case ScalarType::uint16:
      return mx::uint16;
    case ScalarType::int16:
      return mx::int16;
    case ScalarType::uint32:
      return mx::uint32;
    case ScalarType::int32:
      return mx::int32;
    case ScalarType::uint64:
      return mx::uint64;
    case ScalarType::int64:
      return mx::int64;
    case ScalarType::float16:
      return mx::float16;
    case ScalarType::bfloat16:
      return mx::bfloat16;
    case ScalarType::float32:
      return mx::float32;
    case ScalarType::float64:
      return mx::float64;
    case ScalarType::complex64:
      return mx::complex64;
  }
  throw std::logic_error("[dtype_from_safetensors] unhandled scalar type");
}

mx::Dtype dtype_from_safetensors(const std::string& d) {
  const SafetensorsDtype* row = find_safetensors_dtype(d);
  if (row == nullptr) {
    throw std::invalid_argument("[dtype_from_safetensors] unknown safetensors dtype '" + d + "'");
  }
  mx::Dtype dtype = to_mlx(row->type);
  if (mx::size_of(dtype) != row->itemsize) {
    throw std::logic_error("[dtype_from_safetensors] item size of '" + d + "' disagrees with MLX");
  }
  return dtype;
}

std::vector<std::pair<mx::Dtype, mx::Shape>> TensorPager::specs(PageId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<mx::Dtype, mx::Shape>> out;
  for (const Placed& p : layouts_.at(id)) {
    out.emplace_back(p.spec.dtype, p.spec.shape);
  }
  return out;
}

}  // namespace mlx_pager
