// paged_tensor_tests.cpp: lazy pages read when MLX evaluates them, and what
// happens when their arrays outlive the pager.
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>

#include <mlx/mlx.h>

#include "check.h"
#include "mlx/paged_tensor.h"
#include "mlx/tensor_pager.h"
#include "mm/safetensors.h"

using namespace mlx_pager;
namespace mx = mlx::core;

namespace {

PagerConfig small_config() {
  PagerConfig c;
  c.budget_bytes = 16 << 20;
  c.readahead_pages = 0;
  return c;
}

// One page "w" of tensors a (256 x 256 ones) and b (256 twos) in a file.
PageId add_page(TensorPager& tp, const std::string& file) {
  std::unordered_map<std::string, mx::array> w = {
      {"a", mx::ones({256, 256})}, {"b", mx::full({256}, 2.0f)}};
  mx::eval(w.at("a"), w.at("b"));
  std::string path = check::temp_dir() + "/" + file;
  mx::save_safetensors(path, w);
  SafetensorsIndex idx = read_safetensors_index(path);
  std::vector<FileTensor> tensors;
  for (const char* name : {"a", "b"}) {
    const auto& e = idx.tensors.at(name);
    tensors.push_back(FileTensor{
        {name, dtype_from_safetensors(e.dtype), mx::Shape(e.shape.begin(), e.shape.end())},
        path,
        e.offset,
        e.nbytes});
  }
  return tp.add_page_in_place("w", tensors);
}

}  // namespace

TEST_CASE("paged_tensor: a lazy page is read when evaluated, as views of its frame") {
  TensorPager tp(small_config());
  PageId id = add_page(tp, "lazy_basic.safetensors");
  auto arrays = paged_tensors(tp, id, mx::array(0.0f), {});
  CHECK(tp.pager().state(id) == PageState::on_disk);  // nothing read yet
  mx::array s = mx::sum(arrays[0]) + mx::sum(arrays[1]);
  mx::eval(s);
  CHECK_EQ(s.item<float>(), 256.0f * 256.0f + 512.0f);
  CHECK(arrays[0].buffer().ptr() == arrays[1].buffer().ptr());  // one frame
  tp.pager().evict_all();
  CHECK(tp.pager().state(id) == PageState::resident);  // leased by the views
  arrays.clear();
  tp.pager().evict_all();
  CHECK(tp.pager().state(id) == PageState::on_disk);
}

TEST_CASE("paged_tensor: views outlive their pager; their lease ends harmlessly") {
  std::vector<mx::array> arrays;
  {
    TensorPager tp(small_config());
    PageId id = add_page(tp, "lazy_outlive.safetensors");
    arrays = paged_tensors(tp, id, mx::array(0.0f), {});
    mx::eval(arrays);
  }
  // The frame is the views' own; the lease's release finds no pager (under
  // AddressSanitizer, a use after free if it reached the page table).
  CHECK_EQ(mx::sum(arrays[0]).item<float>(), 256.0f * 256.0f);
  arrays.clear();
}

TEST_CASE("paged_tensor: a lazy page evaluated after its pager is gone throws, naming it") {
  std::vector<mx::array> arrays;
  {
    TensorPager tp(small_config());
    PageId id = add_page(tp, "lazy_late.safetensors");
    arrays = paged_tensors(tp, id, mx::array(0.0f), {});
  }
  CHECK_THROWS_WITH(mx::eval(arrays), "page 'w' is evaluated after its Pager was destroyed");
}
