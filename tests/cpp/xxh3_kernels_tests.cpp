// xxh3_kernels_tests.cpp: every XXH3 build gives XXH3's digests, one-shot and
// streamed in any pieces, and the pager hashes with the best one the CPU runs.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "mm/checksum.h"
#include "mm/xxh3_kernels.h"

namespace {

std::vector<const MlxpXxh3Kernels*> builds() {
  std::vector<const MlxpXxh3Kernels*> b = {mlxp_xxh3_portable()};
  if (mlxp_xxh3_avx2() != nullptr && mlxp_cpu_runs_avx2()) {
    b.push_back(mlxp_xxh3_avx2());
  }
  return b;
}

std::uint64_t streamed(
    const MlxpXxh3Kernels& k, const char* data, std::size_t n, std::mt19937_64& rng) {
  void* s = mlxp_xxh3_create_state();
  REQUIRE(s != nullptr);
  std::size_t at = 0;
  while (at < n) {
    std::size_t piece = std::min<std::size_t>(n - at, 1 + rng() % 700);
    k.update(s, data + at, piece);
    at += piece;
  }
  std::uint64_t d = k.digest(s);
  mlxp_xxh3_free_state(s);
  return d;
}

}  // namespace

TEST_CASE("xxh3_kernels: x86-64 builds have the AVX2 build") {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  REQUIRE(mlxp_xxh3_avx2() != nullptr);
  CHECK_EQ(std::string(mlxp_xxh3_avx2()->name), std::string("avx2"));
#else
  CHECK(mlxp_xxh3_avx2() == nullptr);
#endif
  CHECK_EQ(std::string(mlxp_xxh3_portable()->name), std::string("portable"));
}

TEST_CASE("xxh3_kernels: every build gives XXH3's digests, one-shot and streamed") {
  // XXH3-64 of nothing, from the XXH3 specification's test vectors.
  for (const MlxpXxh3Kernels* k : builds()) {
    CHECK_EQ(k->hash("", 0), std::uint64_t{0x2D06800538D394C2ull});
  }
  std::mt19937_64 rng(7);
  std::vector<char> data((1u << 20) + 4096);
  for (char& c : data) {
    c = static_cast<char>(rng());
  }
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 2100; n += (n < 260 ? 1 : 37)) {
    lengths.push_back(n);  // every short-input path, then the stripes
  }
  lengths.insert(lengths.end(), {4095, 4096, 65537, (1u << 20) + 1});
  const MlxpXxh3Kernels& ref = *mlxp_xxh3_portable();
  for (std::size_t n : lengths) {
    const char* p = data.data() + (n % 61);  // odd alignments
    std::uint64_t want = ref.hash(p, n);
    for (const MlxpXxh3Kernels* k : builds()) {
      CHECK_EQ(k->hash(p, n), want);
      if (n % 5 == 0 || n > 4096) {
        CHECK_EQ(streamed(*k, p, n, rng), want);
      }
    }
  }
}

TEST_CASE("xxh3_kernels: the pager hashes with the best build the CPU runs") {
  const char* env = std::getenv("MLX_PAGER_XXH3");
  std::string forced = env == nullptr ? "" : env;
  std::string want = forced == "portable"                     ? "portable"
      : (mlxp_xxh3_avx2() != nullptr && mlxp_cpu_runs_avx2()) ? "avx2"
                                                              : "portable";
  CHECK_EQ(std::string(mlx_pager::xxh3_build()), want);
  std::vector<char> a(5000, 3);
  CHECK_EQ(mlx_pager::xxh3(a.data(), a.size()), mlxp_xxh3_portable()->hash(a.data(), a.size()));
}
