// swapfile_tests.cpp: what the writer writes is what a page read returns.
#include <vector>

#include "check.h"
#include "mm/direct_io.h"
#include "mm/layout.h"
#include "mm/swapfile.h"
#include "test_files.h"

using namespace mlx_pager;

TEST_CASE("swapfile: pages written through the staging pool read back exactly") {
  std::string path = check::temp_dir() + "/swap.bin";
  std::vector<std::vector<std::uint64_t>> pages = {{10, 70000, 3}, {1 << 20}, {4096, 1}};
  std::vector<std::uint64_t> page_offsets;
  {
    SwapWriter w(path, 4 << 20, /*staging_bytes=*/64 << 10);
    std::uint64_t seed = 100;
    for (auto& sizes : pages) {
      std::uint64_t start = w.begin_page();
      page_offsets.push_back(start);
      auto layout = plan_swap_page(sizes);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        w.pad_to(kTensorAlign);
        CHECK_EQ(w.position() - start, layout.offsets[i]);
        std::vector<char> data(sizes[i]);
        for (std::size_t k = 0; k < data.size(); ++k)
          data[k] = check::pattern_byte(seed, k);
        w.write(data.data(), data.size());
        ++seed;
      }
    }
    std::uint64_t size = w.finish();
    CHECK_EQ(size % kIoAlign, 0u);
  }
  auto f = DirectFile::open_read(path);
  std::uint64_t seed = 100;
  for (std::size_t p = 0; p < pages.size(); ++p) {
    auto layout = plan_swap_page(pages[p]);
    char* buf = static_cast<char*>(aligned_alloc_io(layout.bytes));
    CHECK_EQ(f.pread_full(buf, layout.bytes, page_offsets[p]), layout.bytes);
    for (std::size_t i = 0; i < pages[p].size(); ++i) {
      CHECK(check::matches_pattern(buf + layout.offsets[i], pages[p][i], seed, 0));
      ++seed;
    }
    aligned_free_io(buf);
  }
}

TEST_CASE("swapfile: fill_to pads with zeros and refuses to go back") {
  std::string path = check::temp_dir() + "/fill.bin";
  SwapWriter w(path, 1 << 20, /*staging_bytes=*/kIoAlign);
  w.write("ab", 2);
  w.fill_to(kTensorAlign);
  CHECK_EQ(w.position(), kTensorAlign);
  CHECK_THROWS_WITH(w.fill_to(1), "[SwapWriter::fill_to]");
  CHECK_EQ(w.finish(), kIoAlign);
}
