// layout.h: planning where a page's tensors sit in its frame, and which
// reads bring them there.
//
// Two kinds of page source (the swap store):
//  - in place: tensors are read straight from the model's safetensors files.
//    Tensors of one page that lie close together in a file are coalesced into
//    one run and read with one large aligned read; gaps up to `max_gap` bytes
//    (bytes of other pages) are read through rather than split into another
//    request. Direct I/O needs file offset == frame offset modulo kIoAlign, so
//    a tensor's place in the frame follows from its place in the file; a
//    tensor whose file offset is not a multiple of its item size could not
//    be viewed in place is moved after its bytes land: MLX's own writer
//    does not pad the header, so in MLX-written files most tensors start at
//    odd offsets. Each such tensor is shifted left by a few bytes inside its
//    frame (to kInPlaceAlign), in place, first tensor first, so that the
//    moves can follow the read as it lands (landing.h); a run that moves a
//    tensor gets a lead of a kIoAlign (more if its first tensor needs it)
//    before its window in the frame, so that pages of one shape have one
//    frame size. A memmove on an I/O thread, no second buffer.
//  - swap file: the pager wrote the page itself, contiguously, each tensor at
//    a kTensorAlign boundary, the page padded to kIoAlign: one read per page.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mm/page_table.h"

namespace mlx_pager {

// Alignment of tensors inside swap-file pages (covers every MLX dtype and
// the 16-byte loads of vectorised kernels).
inline constexpr std::uint64_t kTensorAlign = 256;
// Alignment tensors read in place are moved to when their file offset lacks
// it: every MLX dtype's size, and 16-byte vector loads on GPUs.
inline constexpr std::uint64_t kInPlaceAlign = 16;
// Largest gap (bytes of other pages) an in-place run reads through rather
// than starting another request.
inline constexpr std::uint64_t kMaxReadThroughGap = 1u << 20;

struct TensorSource {
  std::string name;
  FileId file = 0;
  std::uint64_t offset = 0;  // absolute byte offset in the file
  std::uint64_t nbytes = 0;
  std::uint32_t itemsize = 1;
};

struct PlacedTensor {
  std::string name;
  std::uint64_t frame_offset = 0;  // where it is once the page's moves ran
  std::uint64_t nbytes = 0;
  std::uint64_t read_offset = 0;  // where the read puts it (frame_offset unless it moves)
};

struct PagePlan {
  std::uint64_t frame_bytes = 0;
  std::vector<Extent> extents;
  std::vector<FrameMove> moves;       // to apply in order, each once its bytes landed
  std::vector<PlacedTensor> tensors;  // in the order given; final offsets
};

// Plans reading `tensors` in place from their files. `file_sizes[f]` bounds
// how many bytes of file f exist (reads past them are padding only). Throws
// std::invalid_argument, naming the tensor, for one that lies outside its file.
PagePlan plan_in_place(
    const std::vector<TensorSource>& tensors,
    const std::vector<std::uint64_t>& file_sizes,
    std::uint64_t max_gap = kMaxReadThroughGap);

// Offsets of tensors packed in a swap-file page, and the page's size on disk.
struct SwapPageLayout {
  std::vector<std::uint64_t> offsets;  // relative to the page start
  std::uint64_t bytes = 0;             // multiple of kIoAlign
};
SwapPageLayout plan_swap_page(const std::vector<std::uint64_t>& nbytes);

// The plan of a page stored in a swap file at `page_offset` (kIoAlign aligned).
PagePlan plan_from_swap(
    FileId swap_file,
    std::uint64_t page_offset,
    const std::vector<std::string>& names,
    const std::vector<std::uint64_t>& nbytes);

}  // namespace mlx_pager
