// layout_tests.cpp: in-place plans coalesce, stay aligned and never overlap;
// swap pages pack tensors at kTensorAlign.
#include "check.h"
#include "mm/direct_io.h"
#include "mm/layout.h"

using namespace mlx_pager;

static bool plan_is_consistent(const PagePlan& p, const std::vector<TensorSource>& src) {
  // Frame windows are aligned and disjoint; every tensor sits inside the
  // window of its extent at the right distance from the window's file start.
  for (std::size_t i = 0; i < p.extents.size(); ++i) {
    const Extent& a = p.extents[i];
    if (a.file_offset % kIoAlign || a.length % kIoAlign || a.frame_offset % kIoAlign) return false;
    if (a.frame_offset + a.length > p.frame_bytes) return false;
    for (std::size_t j = i + 1; j < p.extents.size(); ++j) {
      const Extent& b = p.extents[j];
      if (a.frame_offset < b.frame_offset + b.length && b.frame_offset < a.frame_offset + a.length) return false;
    }
  }
  for (std::size_t t = 0; t < src.size(); ++t) {
    bool inside = false;
    for (const Extent& x : p.extents) {
      if (x.file == src[t].file && src[t].offset >= x.file_offset &&
          src[t].offset + src[t].nbytes <= x.file_offset + x.required) {
        inside |= p.tensors[t].frame_offset == x.frame_offset + (src[t].offset - x.file_offset);
      }
    }
    if (!inside || p.tensors[t].frame_offset % src[t].itemsize) return false;
  }
  return true;
}

TEST_CASE("layout: adjacent tensors of a block become one aligned read") {
  std::vector<TensorSource> t = {
      {"b", 0, 1000 + 4096, 8192, 2},
      {"a", 0, 1000, 4096, 4},  // given out of file order
      {"c", 0, 1000 + 4096 + 8192 + 64, 100, 4},  // a small gap
  };
  auto p = plan_in_place(t, {1 << 20});
  REQUIRE(p.ok);
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
  REQUIRE(p.ok);
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

TEST_CASE("layout: a tensor misaligned for its dtype cannot be read in place") {
  std::vector<TensorSource> t = {{"w", 0, 10, 64, 4}};
  auto p = plan_in_place(t, {4096});
  CHECK(!p.ok);
  CHECK(p.why_not.find("'w'") != std::string::npos);
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
