// safetensors_tests.cpp: header parsing, and clear errors for broken files.
#include <fstream>

#include "check.h"
#include "mm/safetensors.h"

using namespace mlx_pager;

static std::string write_raw(
    const std::string& name,
    const std::string& header,
    std::size_t data_bytes,
    std::int64_t claimed_len = -1) {
  std::string path = check::temp_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  std::uint64_t n = claimed_len >= 0 ? claimed_len : header.size();
  for (int i = 0; i < 8; ++i)
    out.put(static_cast<char>((n >> (8 * i)) & 0xFF));
  out << header;
  out << std::string(data_bytes, '\x01');
  return path;
}

TEST_CASE("safetensors: tensors, offsets and metadata are read from the header") {
  std::string h =
      R"({"__metadata__":{"format":"mlx"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("q":{"dtype":"U32","shape":[4],"data_offsets":[16,32]}, "e":{"dtype":"F32","shape":[0],"data_offsets":[32,32]}})";
  auto path = write_raw("ok.safetensors", h, 32);
  auto idx = read_safetensors_index(path);
  CHECK_EQ(idx.tensors.size(), 3u);
  CHECK_EQ(idx.metadata["format"], std::string("mlx"));
  CHECK_EQ(idx.data_start, 8 + h.size());
  CHECK_EQ(idx.tensors["w"].offset, 8 + h.size());
  CHECK_EQ(idx.tensors["w"].nbytes, 12u);
  CHECK_EQ(idx.tensors["q"].offset, 8 + h.size() + 16);
  CHECK_EQ(idx.tensors["q"].shape.size(), 1u);
  CHECK_EQ(safetensors_itemsize("BF16"), 2u);
}

TEST_CASE("safetensors: a truncated file is named as truncated") {
  std::string h = R"({"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}})";
  auto path = write_raw("trunc.safetensors", h, 100);
  CHECK_THROWS_WITH(read_safetensors_index(path), "truncated");
  auto path2 = write_raw("trunc2.safetensors", h, 0, 1 << 20);
  CHECK_THROWS_WITH(read_safetensors_index(path2), "runs past the end");
  auto path3 = write_raw("tiny.safetensors", "", 0);
  CHECK_THROWS_WITH(read_safetensors_index(path3), "tiny.safetensors");
}

TEST_CASE("safetensors: bad JSON, sizes and dtypes are errors naming the file") {
  auto p1 =
      write_raw("json.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 4);
  CHECK_THROWS_WITH(read_safetensors_index(p1), "json.safetensors");
  auto p2 =
      write_raw("size.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4);
  CHECK_THROWS_WITH(read_safetensors_index(p2), "need 8");
  auto p3 =
      write_raw("dtype.safetensors", R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", 4);
  CHECK_THROWS_WITH(read_safetensors_index(p3), "unknown dtype 'Q7'");
}

TEST_CASE("safetensors: bad escapes and huge integers name the file, not stoul") {
  auto p1 = write_raw(
      "esc.safetensors", R"({"w\uZZZZ":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4);
  CHECK_THROWS_WITH(read_safetensors_index(p1), "esc.safetensors");
  CHECK_THROWS_WITH(read_safetensors_index(p1), "bad \\u escape");
  auto p2 = write_raw(
      "big.safetensors",
      R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,4]}})", 4);
  CHECK_THROWS_WITH(read_safetensors_index(p2), "big.safetensors");
  CHECK_THROWS_WITH(read_safetensors_index(p2), "[read_safetensors_index]");
}

TEST_CASE("safetensors: one dtype table gives names, types and sizes") {
  CHECK(find_safetensors_dtype("Q7") == nullptr);
  CHECK(find_safetensors_dtype("F8_E4M3")->type == ScalarType::uint8);
  CHECK_EQ(find_safetensors_dtype("C64")->itemsize, 8u);
}
