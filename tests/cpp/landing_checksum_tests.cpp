// landing_checksum_tests.cpp: a page's checksum taken as its chunks land,
// in any order and from any threads, equals the checksum taken after.
#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "mm/checksum.h"
#include "mm/landing_checksum.h"

using namespace mlx_pager;

namespace {

struct Piece {
  std::uint64_t offset, length;
};

// [0, n) cut into pieces of 1..max bytes.
std::vector<Piece> cut(std::uint64_t n, std::uint64_t max, std::mt19937_64& rng) {
  std::vector<Piece> out;
  for (std::uint64_t at = 0; at < n;) {
    std::uint64_t len = std::min<std::uint64_t>(n - at, 1 + rng() % max);
    out.push_back({at, len});
    at += len;
  }
  return out;
}

// Non-overlapping ranges of [0, n), some adjacent, some with gaps, in a
// shuffled checksum order.
std::vector<FrameRange> ranges_of(std::uint64_t n, std::mt19937_64& rng) {
  std::vector<FrameRange> out;
  for (std::uint64_t at = rng() % 64; at < n;) {
    std::uint64_t len = std::min<std::uint64_t>(n - at, 1 + rng() % (n / 6));
    out.push_back({at, len});
    at += len + (rng() % 2 ? 0 : rng() % 512);
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

}  // namespace

TEST_CASE("landing checksum: any landing order, from any threads, gives frame_checksum") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 40; ++round) {
    std::uint64_t n = 1 + rng() % (1 << 20);
    std::vector<char> frame(n);
    for (auto& c : frame)
      c = static_cast<char>(rng());
    auto ranges = ranges_of(n, rng);
    auto pieces = cut(n, 1 + rng() % (n / 3 + 1), rng);
    if (round % 2) {
      std::shuffle(pieces.begin(), pieces.end(), rng);
    }
    LandingChecksum lc(frame.data(), ranges);
    int threads = 1 + round % 4;
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        for (std::size_t i = t; i < pieces.size(); i += threads)
          lc.landed(pieces[i].offset, pieces[i].length);
      });
    }
    for (auto& t : ts)
      t.join();
    auto got = lc.finish();
    REQUIRE(got.has_value());
    CHECK_EQ(*got, frame_checksum(frame.data(), ranges));
  }
}

TEST_CASE("landing checksum: a range some of whose bytes never landed gives no checksum") {
  std::vector<char> frame(10000, 3);
  std::vector<FrameRange> ranges = {{100, 5000}, {6000, 100}};
  LandingChecksum lc(frame.data(), ranges);
  lc.landed(0, 3000);
  lc.landed(3001, 7000);  // byte 3000 never arrives
  CHECK(!lc.finish().has_value());
  LandingChecksum gaps(frame.data(), ranges);
  gaps.landed(100, 5000);  // bytes outside the ranges need not land
  gaps.landed(6000, 100);
  auto sum = gaps.finish();
  REQUIRE(sum.has_value());
  CHECK_EQ(*sum, frame_checksum(frame.data(), ranges));
}
