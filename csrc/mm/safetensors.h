// safetensors.h: reading the table of contents of a .safetensors file.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of
// JSON mapping tensor names to {dtype, shape, data_offsets}, then the data.
// Only the header is read here; the pager reads the data itself, in place.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mlx_pager {

struct SafetensorsEntry {
  std::string dtype;  // as written: "BF16", "F32", "U32", ...
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;  // absolute byte offset of the data in the file
  std::uint64_t nbytes = 0;
};

struct SafetensorsIndex {
  std::string path;
  std::uint64_t file_size = 0;
  std::uint64_t data_start = 0;  // 8 + header length
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__", if any
};

// Parses the header of `path`. Throws std::runtime_error naming the file and
// the problem when it is not a well-formed safetensors file (truncated,
// header past the end, bad JSON, offsets outside the data, wrong sizes).
SafetensorsIndex read_safetensors_index(const std::string& path);

// The element types a safetensors dtype name stands for, in MLX's terms (the
// MLX layer maps each to its mx::Dtype with an exhaustive switch). The FP8
// formats, which MLX has no type for, are raw bytes (uint8).
enum class ScalarType {
  bool_,
  uint8,
  int8,
  uint16,
  int16,
  uint32,
  int32,
  uint64,
  int64,
  float16,
  bfloat16,
  float32,
  float64,
  complex64,
};

// One row of the dtype table: the name as written in headers, its element
// type and size in bytes.
struct SafetensorsDtype {
  const char* name;
  ScalarType type;
  std::uint32_t itemsize;
};

// The table's row for a dtype name; nullptr if unknown. The one list of
// safetensors dtypes mlx-pager knows.
const SafetensorsDtype* find_safetensors_dtype(const std::string& dtype);

// Bytes per element of a safetensors dtype name; 0 if unknown.
std::uint32_t safetensors_itemsize(const std::string& dtype);

}  // namespace mlx_pager
