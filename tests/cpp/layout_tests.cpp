// layout_tests.cpp: in-place plans coalesce, stay aligned and never overlap;
// swap pages pack tensors at kTensorAlign.
#include <cstring>
#include <map>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/layout.h"
#include "test_files.h"

using namespace mlx_pager;

// Simulates a page read: file bytes land in the frame per extent, then the
// moves run. Every tensor must then hold its file bytes at its planned,
// aligned offset, and extents must be aligned and disjoint in the frame.
static bool plan_is_consistent(const PagePlan& p, const std::vector<TensorSource>& src) {
  for (std::size_t i = 0; i < p.extents.size(); ++i) {
    const Extent& a = p.extents[i];
    if (a.file_offset % kIoAlign || a.length % kIoAlign || a.frame_offset % kIoAlign)
      return false;
    if (a.frame_offset + a.length > p.frame_bytes)
      return false;
    for (std::size_t j = i + 1; j < p.extents.size(); ++j) {
      const Extent& b = p.extents[j];
      if (a.frame_offset < b.frame_offset + b.length && b.frame_offset < a.frame_offset + a.length)
        return false;
    }
  }
  std::vector<char> frame(p.frame_bytes, 0);
  for (const Extent& x : p.extents) {
    for (std::uint64_t k = 0; k < x.length; ++k) {
      frame[x.frame_offset + k] = static_cast<char>(check::pattern_byte(x.file, x.file_offset + k));
    }
  }
  for (const FrameMove& m : p.moves) {
    if (std::max(m.from, m.to) + m.length > p.frame_bytes)
      return false;
    std::memmove(frame.data() + m.to, frame.data() + m.from, m.length);
  }
  for (std::size_t t = 0; t < src.size(); ++t) {
    const PlacedTensor& pt = p.tensors[t];
    if (pt.frame_offset % std::min<std::uint64_t>(kInPlaceAlign, 16) != 0)
      return false;
    if (!check::matches_pattern(
            frame.data() + pt.frame_offset, src[t].nbytes, src[t].file, src[t].offset)) {
      return false;
    }
  }
  return true;
}

TEST_CASE("layout: adjacent tensors of a block become one aligned read") {
  std::vector<TensorSource> t = {
      {"b", 0, 1000 + 4096, 8192, 2},
      {"a", 0, 1000, 4096, 4},                    // given out of file order
      {"c", 0, 1000 + 4096 + 8192 + 64, 100, 4},  // a small gap
  };
  auto p = plan_in_place(t, {1 << 20});
  CHECK_EQ(p.extents.size(), 1u);
  CHECK_EQ(p.tensors[0].name, std::string("b"));
  CHECK(plan_is_consistent(p, t));
}

TEST_CASE("layout: tensors far apart or in other files get reads of their own") {
  std::vector<TensorSource> t = {
      {"x", 0, 8, 100, 4},
      {"y", 0, 50u << 20, 100, 4},
      {"z", 1, 24, 4000, 2},
  };
  auto p = plan_in_place(t, {60u << 20, 4030}, /*max_gap=*/1 << 20);
  CHECK_EQ(p.extents.size(), 3u);
  CHECK(plan_is_consistent(p, t));
  // The aligned read of file 1 runs past its end; only what exists is required.
  for (auto& x : p.extents) {
    if (x.file == 1) {
      CHECK_EQ(x.length, 4096u);
      CHECK_EQ(x.required, 4030u);
    }
  }
}

TEST_CASE("layout: misaligned tensors are moved into place after the read") {
  // As in files MLX writes: the data section starts at an odd offset.
  std::vector<TensorSource> t;
  std::uint64_t off = 8 + 143;
  for (int i = 0; i < 20; ++i) {
    std::uint64_t n = (i % 3 == 0) ? 6 : 4096 + 2 * i;  // odd sizes shift later tensors
    t.push_back({"t" + std::to_string(i), 0, off, n, 2});
    off += n;
  }
  auto p = plan_in_place(t, {off});
  CHECK_EQ(p.extents.size(), 1u);
  CHECK(!p.moves.empty());
  CHECK(plan_is_consistent(p, t));
  // Tensors move left, first tensor first (in the order a read lands them:
  // landing.h): no move writes where a later move still reads.
  for (std::size_t i = 0; i < p.moves.size(); ++i) {
    CHECK(p.moves[i].to < p.moves[i].from);
    for (std::size_t j = i + 1; j < p.moves.size(); ++j) {
      CHECK(p.moves[i].from < p.moves[j].from);
      CHECK(p.moves[i].to + p.moves[i].length <= p.moves[j].from);
    }
  }
}

TEST_CASE("layout: pages of one shape read in equal windows get one frame size") {
  // The same three tensors at 64 offsets (as the blocks of an MLX-written
  // file): plans whose read window has the same length have one frame
  // size, whatever the tensors' offsets inside it, so a frame freed by one
  // block's page fits the next (the pager's kept frames).
  std::map<std::uint64_t, std::uint64_t> frame_by_window;
  int moved = 0;
  for (std::uint64_t at = 8; at < 8 + 64 * 67; at += 67) {
    std::vector<TensorSource> t = {
        {"a", 0, at, 4000, 4}, {"b", 0, at + 4000, 12, 4}, {"c", 0, at + 4012, 50000, 2}};
    auto p = plan_in_place(t, {at + 60000});
    CHECK(plan_is_consistent(p, t));
    if (p.moves.empty())
      continue;
    ++moved;
    auto [it, fresh] = frame_by_window.emplace(p.extents[0].length, p.frame_bytes);
    CHECK_EQ(p.frame_bytes, it->second);
  }
  CHECK(moved > 32);
}

TEST_CASE("layout: a run whose first tensor must move before its window gets a lead") {
  // The first tensor at byte 3 of its 4 KiB block must move left past the
  // window's start: the window sits a kIoAlign lead into the frame.
  std::vector<TensorSource> t = {{"a", 0, 4096 + 3, 100, 4}, {"b", 0, 4096 + 103, 4000, 4}};
  auto p = plan_in_place(t, {20000});
  REQUIRE(p.extents.size() == 1u);
  CHECK_EQ(p.extents[0].frame_offset, kIoAlign);
  CHECK(plan_is_consistent(p, t));
}

TEST_CASE("layout: a tensor outside its file cannot be planned") {
  std::vector<TensorSource> t = {{"w", 0, 4000, 200, 4}};
  CHECK_THROWS_WITH(plan_in_place(t, {4096}), "[plan_in_place] tensor 'w' lies past the end");
}

TEST_CASE("layout: swap pages pack tensors at kTensorAlign, padded to kIoAlign") {
  auto l = plan_swap_page({10, 300, 0, 4096});
  CHECK_EQ(l.offsets[0], 0u);
  CHECK_EQ(l.offsets[1], 256u);
  CHECK_EQ(l.offsets[2], 768u);
  CHECK_EQ(l.offsets[3], 768u);
  CHECK_EQ(l.bytes, 8192u);
  auto p = plan_from_swap(3, 8192, {"a", "b", "c", "d"}, {10, 300, 0, 4096});
  CHECK_EQ(p.extents.size(), 1u);
  CHECK_EQ(p.extents[0].file_offset, 8192u);
  CHECK_EQ(p.frame_bytes, 8192u);
}
