// layout.cpp: page layout planning (in-place runs and swap-file packing).
#include "mm/layout.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include "mm/direct_io.h"

namespace mlx_pager {

PagePlan plan_in_place(
    const std::vector<TensorSource>& tensors,
    const std::vector<std::uint64_t>& file_sizes,
    std::uint64_t max_gap) {
  PagePlan plan;
  plan.tensors.resize(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSource& t = tensors[i];
    if (t.file >= file_sizes.size() || t.offset + t.nbytes > file_sizes[t.file]) {
      throw std::invalid_argument(
          "[plan_in_place] tensor '" + t.name + "' lies past the end of its file");
    }
  }
  // Visit tensors in file order and cut them into runs.
  std::vector<std::size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return std::tie(tensors[a].file, tensors[a].offset) <
        std::tie(tensors[b].file, tensors[b].offset);
  });
  std::uint64_t frame_cursor = 0;  // next free (aligned) frame position
  std::size_t i = 0;
  while (i < order.size()) {
    const TensorSource& first = tensors[order[i]];
    std::uint64_t run_begin = first.offset;
    std::uint64_t run_end = first.offset + first.nbytes;
    std::size_t j = i + 1;
    while (j < order.size()) {
      const TensorSource& t = tensors[order[j]];
      if (t.file != first.file || t.offset > run_end + max_gap) {
        break;
      }
      run_end = std::max(run_end, t.offset + t.nbytes);
      ++j;
    }
    std::uint64_t win_begin = align_down(run_begin, kIoAlign);
    std::uint64_t win_end = align_up(run_end, kIoAlign);
    // Shift misaligned tensors LEFT by a running amount that only grows from
    // the run's end to its start, so that moving them first-first, in the
    // order their bytes land, never overwrites a tensor not yet moved (the
    // moves can run while the read lands: landing.h). File and frame
    // positions agree modulo kIoAlign, so aligning in file coordinates
    // aligns in the frame. The first may move to before the window, into a
    // lead the frame leaves before it.
    std::vector<std::int64_t> to_rel(j - i);  // destinations, relative to the window
    std::int64_t shift = 0;
    const auto align = static_cast<std::int64_t>(kInPlaceAlign);
    for (std::size_t k = j; k-- > i;) {
      auto rel = static_cast<std::int64_t>(tensors[order[k]].offset - win_begin);
      std::int64_t want = rel - shift;
      std::int64_t to = want >= 0 ? want / align * align : -((-want + align - 1) / align * align);
      shift = rel - to;
      to_rel[k - i] = to;
    }
    // Every run that moves a tensor gets a lead, needed or not, so that
    // pages of one shape (the blocks of a model) have one frame size
    // whatever their tensors' offsets: a frame freed by one is then the
    // right size for the next (the pager's kept frames), where frames one
    // kIoAlign apart were not (q4 bench at 25%: a 197 MB peak, 185 MB with
    // one size).
    bool moves = false;
    for (std::size_t k = i; k < j && !moves; ++k) {
      moves = tensors[order[k]].nbytes != 0 &&
          to_rel[k - i] != static_cast<std::int64_t>(tensors[order[k]].offset - win_begin);
    }
    std::uint64_t need =
        to_rel[0] < 0 ? align_up(static_cast<std::uint64_t>(-to_rel[0]), kIoAlign) : 0;
    std::uint64_t lead = moves ? std::max<std::uint64_t>(need, kIoAlign) : need;
    Extent x;
    x.file = first.file;
    x.file_offset = win_begin;
    x.length = win_end - win_begin;
    x.required = std::min(win_end, file_sizes[first.file]) - win_begin;
    x.frame_offset = frame_cursor + lead;
    plan.extents.push_back(x);
    std::uint64_t base = x.frame_offset - win_begin;  // frame pos = base + file offset
    for (std::size_t k = i; k < j; ++k) {
      const TensorSource& t = tensors[order[k]];
      std::uint64_t at = base + t.offset;
      std::uint64_t to =
          static_cast<std::uint64_t>(static_cast<std::int64_t>(x.frame_offset) + to_rel[k - i]);
      if (to != at && t.nbytes != 0) {
        plan.moves.push_back(FrameMove{at, to, t.nbytes});
      }
      plan.tensors[order[k]] = PlacedTensor{t.name, to, t.nbytes, at};
    }
    frame_cursor = align_up(x.frame_offset + x.length, kIoAlign);
    i = j;
  }
  plan.frame_bytes = std::max<std::uint64_t>(frame_cursor, kIoAlign);
  return plan;
}

SwapPageLayout plan_swap_page(const std::vector<std::uint64_t>& nbytes) {
  SwapPageLayout l;
  std::uint64_t cur = 0;
  for (std::uint64_t n : nbytes) {
    cur = align_up(cur, kTensorAlign);
    l.offsets.push_back(cur);
    cur += n;
  }
  l.bytes = std::max<std::uint64_t>(align_up(cur, kIoAlign), kIoAlign);
  return l;
}

PagePlan plan_from_swap(
    FileId swap_file,
    std::uint64_t page_offset,
    const std::vector<std::string>& names,
    const std::vector<std::uint64_t>& nbytes) {
  if (names.size() != nbytes.size()) {
    throw std::invalid_argument("[plan_from_swap] names and sizes differ in length");
  }
  if (page_offset % kIoAlign != 0) {
    throw std::invalid_argument("[plan_from_swap] page offset is not aligned");
  }
  SwapPageLayout l = plan_swap_page(nbytes);
  PagePlan plan;
  plan.frame_bytes = l.bytes;
  plan.extents.push_back(Extent{swap_file, page_offset, l.bytes, l.bytes, 0});
  for (std::size_t i = 0; i < names.size(); ++i) {
    plan.tensors.push_back(PlacedTensor{names[i], l.offsets[i], nbytes[i], l.offsets[i]});
  }
  return plan;
}

}  // namespace mlx_pager
