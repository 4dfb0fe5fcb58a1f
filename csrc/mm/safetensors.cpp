// safetensors.cpp: a header parser with the small JSON subset the format uses
// (objects, arrays, strings, integers; metadata values are strings).
#include "mm/safetensors.h"

#include <cstring>
#include <fstream>
#include <stdexcept>

namespace mlx_pager {

namespace {

// Longest JSON header accepted: real headers are kilobytes; a larger length
// field means a corrupt or foreign file, not a header to allocate for.
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

class Json {
 public:
  Json(const std::string& text, const std::string& path) : s_(text), path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(
        "[read_safetensors_index] " + path_ + ": bad header at byte " + std::to_string(pos_) +
        ": " + what);
  }
  void ws() {
    while (pos_ < s_.size() && std::strchr(" \t\r\n", s_[pos_]) && s_[pos_]) {
      ++pos_;
    }
  }
  bool peek(char c) {
    ws();
    return pos_ < s_.size() && s_[pos_] == c;
  }
  void expect(char c) {
    ws();
    if (pos_ >= s_.size() || s_[pos_] != c) {
      fail(std::string("expected '") + c + "'");
    }
    ++pos_;
  }
  std::string str() {
    expect('"');
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\\') {
        if (pos_ >= s_.size()) {
          fail("unterminated escape");
        }
        char e = s_[pos_++];
        switch (e) {
          case 'n':
            out += '\n';
            break;
          case 't':
            out += '\t';
            break;
          case 'r':
            out += '\r';
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'u': {
            if (pos_ + 4 > s_.size()) {
              fail("short \\u escape");
            }
            unsigned cp = hex4(s_.substr(pos_, 4));
            pos_ += 4;
            // UTF-8 encode (surrogate pairs are kept as two code points).
            if (cp < 0x80) {
              out += static_cast<char>(cp);
            } else if (cp < 0x800) {
              out += static_cast<char>(0xC0 | (cp >> 6));
              out += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              out += static_cast<char>(0xE0 | (cp >> 12));
              out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              out += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default:
            out += e;
        }
      } else {
        out += c;
      }
    }
    expect('"');
    return out;
  }
  std::int64_t integer() {
    ws();
    std::size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') {
      ++pos_;
    }
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      ++pos_;
    }
    if (start == pos_) {
      fail("expected an integer");
    }
    try {
      return std::stoll(s_.substr(start, pos_ - start));
    } catch (const std::out_of_range&) {
      pos_ = start;
      fail("integer out of range");
    }
  }
  std::vector<std::int64_t> int_array() {
    std::vector<std::int64_t> out;
    expect('[');
    if (peek(']')) {
      ++pos_;
      return out;
    }
    for (;;) {
      out.push_back(integer());
      if (peek(',')) {
        ++pos_;
        continue;
      }
      expect(']');
      return out;
    }
  }
  // Skips any JSON value (used for unknown keys).
  void skip() {
    ws();
    if (peek('"')) {
      str();
    } else if (peek('{')) {
      ++pos_;
      if (peek('}')) {
        ++pos_;
        return;
      }
      for (;;) {
        str();
        expect(':');
        skip();
        if (peek(',')) {
          ++pos_;
          continue;
        }
        expect('}');
        return;
      }
    } else if (peek('[')) {
      ++pos_;
      if (peek(']')) {
        ++pos_;
        return;
      }
      for (;;) {
        skip();
        if (peek(',')) {
          ++pos_;
          continue;
        }
        expect(']');
        return;
      }
    } else {
      while (pos_ < s_.size() && !std::strchr(",}] \t\r\n", s_[pos_])) {
        ++pos_;
      }
    }
  }
  // The code point of a \\u escape's four hex digits (std::stoul would
  // accept fewer, and its errors would not name the file).
  unsigned hex4(const std::string& digits) const {
    unsigned cp = 0;
    for (char c : digits) {
      int v = c >= '0' && c <= '9' ? c - '0'
          : c >= 'a' && c <= 'f'   ? c - 'a' + 10
          : c >= 'A' && c <= 'F'   ? c - 'A' + 10
                                   : -1;
      if (v < 0) {
        fail("bad \\u escape");
      }
      cp = cp * 16 + static_cast<unsigned>(v);
    }
    return cp;
  }
  bool at_end() {
    ws();
    return pos_ >= s_.size();
  }
  std::size_t pos_ = 0;

 private:
  const std::string& s_;
  const std::string& path_;
};

}  // namespace

const SafetensorsDtype* find_safetensors_dtype(const std::string& d) {
  static constexpr SafetensorsDtype kTable[] = {
      {"BOOL", ScalarType::bool_, 1},    {"U8", ScalarType::uint8, 1},
      {"I8", ScalarType::int8, 1},       {"F8_E4M3", ScalarType::uint8, 1},
      {"F8_E5M2", ScalarType::uint8, 1}, {"F8_E8M0", ScalarType::uint8, 1},
      {"U16", ScalarType::uint16, 2},    {"I16", ScalarType::int16, 2},
      {"F16", ScalarType::float16, 2},   {"BF16", ScalarType::bfloat16, 2},
      {"U32", ScalarType::uint32, 4},    {"I32", ScalarType::int32, 4},
      {"F32", ScalarType::float32, 4},   {"U64", ScalarType::uint64, 8},
      {"I64", ScalarType::int64, 8},     {"F64", ScalarType::float64, 8},
      {"C64", ScalarType::complex64, 8},
  };
  for (const SafetensorsDtype& row : kTable) {
    if (d == row.name) {
      return &row;
    }
  }
  return nullptr;
}

std::uint32_t safetensors_itemsize(const std::string& d) {
  const SafetensorsDtype* row = find_safetensors_dtype(d);
  return row ? row->itemsize : 0;
}

SafetensorsIndex read_safetensors_index(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("[read_safetensors_index] cannot open " + path);
  }
  in.seekg(0, std::ios::end);
  SafetensorsIndex idx;
  idx.path = path;
  idx.file_size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  unsigned char len_bytes[8];
  if (idx.file_size < 8 || !in.read(reinterpret_cast<char*>(len_bytes), 8)) {
    throw std::runtime_error(
        "[read_safetensors_index] " + path + " is too short to be a safetensors file (" +
        std::to_string(idx.file_size) + " bytes)");
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) {
    n = (n << 8) | len_bytes[i];
  }
  if (n > idx.file_size - 8 || n > kMaxHeaderBytes) {
    throw std::runtime_error(
        "[read_safetensors_index] " + path + ": header length " + std::to_string(n) +
        " runs past the end of the file (" + std::to_string(idx.file_size) +
        " bytes); the file is truncated or not safetensors");
  }
  std::string text(n, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(n))) {
    throw std::runtime_error("[read_safetensors_index] " + path + ": cannot read header");
  }
  idx.data_start = 8 + n;
  Json j(text, path);
  j.expect('{');
  if (j.peek('}')) {
    return idx;
  }
  for (;;) {
    std::string name = j.str();
    j.expect(':');
    if (name == "__metadata__" && !j.peek('{')) {
      j.skip();  // MLX's C++ writer stores `null` when there is none
    } else if (name == "__metadata__") {
      j.expect('{');
      if (!j.peek('}')) {
        for (;;) {
          std::string k = j.str();
          j.expect(':');
          idx.metadata[k] = j.str();
          if (j.peek(',')) {
            ++j.pos_;
            continue;
          }
          break;
        }
      }
      j.expect('}');
    } else {
      SafetensorsEntry e;
      bool have_offsets = false;
      j.expect('{');
      for (;;) {
        std::string key = j.str();
        j.expect(':');
        if (key == "dtype") {
          e.dtype = j.str();
        } else if (key == "shape") {
          e.shape = j.int_array();
        } else if (key == "data_offsets") {
          auto o = j.int_array();
          if (o.size() != 2 || o[0] < 0 || o[1] < o[0]) {
            j.fail("tensor '" + name + "' has bad data_offsets");
          }
          e.offset = idx.data_start + static_cast<std::uint64_t>(o[0]);
          e.nbytes = static_cast<std::uint64_t>(o[1] - o[0]);
          have_offsets = true;
        } else {
          j.skip();
        }
        if (j.peek(',')) {
          ++j.pos_;
          continue;
        }
        break;
      }
      j.expect('}');
      std::uint32_t item = safetensors_itemsize(e.dtype);
      if (item == 0) {
        j.fail("tensor '" + name + "' has unknown dtype '" + e.dtype + "'");
      }
      if (!have_offsets) {
        j.fail("tensor '" + name + "' has no data_offsets");
      }
      std::uint64_t count = 1;
      for (auto d : e.shape) {
        if (d < 0) {
          j.fail("tensor '" + name + "' has a negative dimension");
        }
        count *= static_cast<std::uint64_t>(d);
      }
      if (count * item != e.nbytes) {
        j.fail(
            "tensor '" + name + "' holds " + std::to_string(e.nbytes) +
            " bytes but its shape and dtype need " + std::to_string(count * item));
      }
      if (e.offset + e.nbytes > idx.file_size) {
        throw std::runtime_error(
            "[read_safetensors_index] " + path + ": tensor '" + name + "' ends at byte " +
            std::to_string(e.offset + e.nbytes) + " but the file has " +
            std::to_string(idx.file_size) +
            " bytes; the file is truncated (download or copy it again)");
      }
      idx.tensors.emplace(name, std::move(e));
    }
    if (j.peek(',')) {
      ++j.pos_;
      continue;
    }
    j.expect('}');
    break;
  }
  return idx;
}

}  // namespace mlx_pager
