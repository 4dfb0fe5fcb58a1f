// test_files.h: files with known contents for I/O tests.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "check.h"

namespace check {

// The byte at offset i of every pattern file: depends on the file's seed so
// that bytes read from the wrong file or offset are caught.
inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xC2B2AE3D27D4EB4Full);
  x ^= x >> 29;
  return static_cast<std::uint8_t>(x * 0xBF58476D1CE4E5B9ull >> 56);
}

// Writes `n` pattern bytes to a new file in the test directory.
inline std::string pattern_file(const std::string& name, std::uint64_t n, std::uint64_t seed) {
  std::string path = temp_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  std::vector<char> buf(1 << 16);
  for (std::uint64_t off = 0; off < n; off += buf.size()) {
    std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), n - off));
    for (std::size_t i = 0; i < k; ++i) {
      buf[i] = static_cast<char>(pattern_byte(seed, off + i));
    }
    out.write(buf.data(), static_cast<std::streamsize>(k));
  }
  return path;
}

// True when [data, data + n) holds the pattern bytes of `seed` from `offset`.
inline bool matches_pattern(
    const char* data, std::uint64_t n, std::uint64_t seed, std::uint64_t offset) {
  for (std::uint64_t i = 0; i < n; ++i) {
    if (static_cast<std::uint8_t>(data[i]) != pattern_byte(seed, offset + i)) {
      return false;
    }
  }
  return true;
}

}  // namespace check
