// huge_pages_tests.cpp: the whole huge pages inside a range, and only
// those, are advised; heap frames get the advice (MLX's frames:
// tensor_pager_tests.cpp; the read-rate buffers: read_rate_tests.cpp).
#include <sys/mman.h>

#include "check.h"
#include "mm/frame.h"
#include "mm/huge_pages.h"
#include "smaps.h"

using namespace mlx_pager;

using check::huge_page_advised;

TEST_CASE("huge_pages: the whole huge pages inside a range are advised, nothing outside it") {
  const std::uint64_t h = huge_page_bytes();
  CHECK_EQ(advise_huge_pages(nullptr, 8u << 20), 0u);
  // 6 huge pages of fresh memory; the range starts 1000 bytes past the
  // first huge page boundary in it and ends a little past the fourth after
  // that one.
  const std::uint64_t span = 6 * (h ? h : (2u << 20));
  void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(m != MAP_FAILED);
  char* p = static_cast<char*>(m);
  if (h == 0) {
    // No huge pages here (another platform, or THP off): nothing is asked.
    CHECK_EQ(advise_huge_pages(p, span), 0u);
    ::munmap(m, span);
    return;
  }
  const auto base = (reinterpret_cast<std::uintptr_t>(p) + h - 1) & ~(h - 1);
  char* from = reinterpret_cast<char*>(base) + 1000;
  const std::uint64_t n = 4 * h + 3000;  // to 4000 bytes past the fifth boundary
  // Whole huge pages inside [from, from + n): the second to the fourth.
  CHECK_EQ(advise_huge_pages(from, n), 3 * h);
  CHECK(huge_page_advised(reinterpret_cast<char*>(base) + h));
  CHECK(huge_page_advised(reinterpret_cast<char*>(base) + 4 * h - 1));
  // The partial huge pages at both ends stay as they were.
  CHECK(!huge_page_advised(from));
  CHECK(!huge_page_advised(reinterpret_cast<char*>(base) + 4 * h));
  // A range holding no whole huge page asks for nothing.
  CHECK_EQ(advise_huge_pages(from, h), 0u);
  CHECK_EQ(advise_huge_pages(reinterpret_cast<char*>(base) + 4 * h + 1, h), 0u);
  // Touched, the memory holds its bytes as before.
  for (std::uint64_t o = 0; o < n; o += 4096) {
    from[o] = static_cast<char>(o / 4096);
  }
  CHECK_EQ(from[3 * 4096], 3);
  ::munmap(m, span);
}

TEST_CASE("huge_pages: a heap frame's whole huge pages are advised before its read") {
  const std::uint64_t h = huge_page_bytes();
  if (h == 0) {
    return;  // nothing to advise on this platform
  }
  HeapFrameAllocator alloc(false);
  Frame f = alloc.allocate(4 * h, [] {});
  const char* first = check::first_huge_page(f.data, h);
  CHECK(huge_page_advised(first));
  CHECK(huge_page_advised(first + 2 * h));
}
