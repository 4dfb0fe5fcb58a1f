// landing_tests.cpp: what a page's read needs after its bytes arrive (moves,
// checksum), done as its chunks land, in any order and from any threads,
// gives the frame and the checksum that doing it after the read gives.
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "mm/checksum.h"
#include "mm/landing.h"
#include "mm/layout.h"
#include "test_files.h"

using namespace mlx_pager;

namespace {

struct Piece {
  std::uint64_t offset, length;
};

// [begin, end) cut into pieces of 1..max bytes.
void cut(
    std::uint64_t begin,
    std::uint64_t end,
    std::uint64_t max,
    std::mt19937_64& rng,
    std::vector<Piece>& out) {
  for (std::uint64_t at = begin; at < end;) {
    std::uint64_t len = std::min<std::uint64_t>(end - at, 1 + rng() % max);
    out.push_back({at, len});
    at += len;
  }
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

// Lands `pieces` from `threads` threads, each piece's bytes copied from
// `source` into `frame` just before it is reported.
void land(
    Landing& l,
    std::vector<char>& frame,
    const std::vector<char>& source,
    const std::vector<Piece>& pieces,
    int threads) {
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (std::size_t i = t; i < pieces.size(); i += threads) {
        std::memcpy(
            frame.data() + pieces[i].offset, source.data() + pieces[i].offset, pieces[i].length);
        l.landed(pieces[i].offset, pieces[i].length);
      }
    });
  }
  for (auto& t : ts)
    t.join();
}

}  // namespace

TEST_CASE("landing: any landing order, from any threads, gives frame_checksum") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 40; ++round) {
    std::uint64_t n = 1 + rng() % (1 << 20);
    std::vector<char> source(n);
    for (auto& c : source)
      c = static_cast<char>(rng());
    auto ranges = ranges_of(n, rng);
    std::vector<Piece> pieces;
    cut(0, n, 1 + rng() % (n / 3 + 1), rng, pieces);
    if (round % 2) {
      std::shuffle(pieces.begin(), pieces.end(), rng);
    }
    std::vector<char> frame(n, 0);
    Landing l(frame.data(), {{0, n}}, {}, ranges, true);
    land(l, frame, source, pieces, 1 + round % 4);
    auto got = l.finish();
    REQUIRE(got.has_value());
    CHECK_EQ(*got, frame_checksum(frame.data(), ranges));
  }
}

TEST_CASE("landing: moves done as the read lands leave every tensor where the plan puts it") {
  // Plans of MLX-written files (tensors at odd offsets, odd sizes, runs with
  // gaps and in two files), read in chunks landing in order or shuffled,
  // from 1-4 threads: the frame after finish() holds each tensor's file
  // bytes at its planned place, the checksum (taken at the tensors' sources)
  // is the frame's, and in order most moves run before the read ends.
  std::mt19937_64 rng(11);
  for (int round = 0; round < 60; ++round) {
    std::vector<TensorSource> t;
    std::uint64_t sizes[2] = {0, 0};
    for (int f = 0; f < 2; ++f) {
      std::uint64_t off = 8 + rng() % 300;
      int count = 1 + static_cast<int>(rng() % 12);
      for (int i = 0; i < count; ++i) {
        std::uint64_t n = rng() % 10 == 0 ? 0 : 1 + rng() % 20000;  // some empty tensors
        t.push_back(
            {"t" + std::to_string(f) + "_" + std::to_string(i), static_cast<FileId>(f), off, n, 2});
        off += n + (rng() % 3 == 0 ? rng() % 3000 : 0);
      }
      sizes[f] = off + rng() % 100;
    }
    PagePlan p = plan_in_place(t, {sizes[0], sizes[1]});
    // What the read puts in the frame, extent by extent.
    std::vector<char> source(p.frame_bytes, 0);
    std::vector<FrameRange> reads;
    std::vector<Piece> pieces;
    for (const Extent& x : p.extents) {
      for (std::uint64_t k = 0; k < x.length; ++k)
        source[x.frame_offset + k] =
            static_cast<char>(check::pattern_byte(x.file, x.file_offset + k));
      reads.push_back({x.frame_offset, x.length});
      cut(x.frame_offset, x.frame_offset + x.length, 1 + rng() % 9000, rng, pieces);
    }
    bool in_order = round % 3 != 0;
    if (!in_order) {
      std::shuffle(pieces.begin(), pieces.end(), rng);
    }
    // Checksum ranges where the read puts the tensors (their move's source).
    std::vector<FrameRange> final_ranges, read_ranges;
    for (std::size_t i = 0; i < t.size(); ++i) {
      final_ranges.push_back({p.tensors[i].frame_offset, t[i].nbytes});
      read_ranges.push_back({p.tensors[i].read_offset, t[i].nbytes});
    }
    std::vector<char> frame(p.frame_bytes, 0);
    Landing l(frame.data(), reads, p.moves, read_ranges, true);
    land(l, frame, source, pieces, 1 + round % 4);
    auto sum = l.finish();
    for (std::size_t i = 0; i < t.size(); ++i) {
      CHECK(p.tensors[i].frame_offset % kInPlaceAlign == 0);
      CHECK(check::matches_pattern(
          frame.data() + p.tensors[i].frame_offset, t[i].nbytes, t[i].file, t[i].offset));
    }
    REQUIRE(sum.has_value());
    CHECK_EQ(*sum, frame_checksum(frame.data(), final_ranges));
    // each move is one tensor's: it hashes that tensor as it moves it
    CHECK_EQ(l.hashing_moves(), p.moves.size());
    if (in_order && round % 4 == 1 && p.moves.size() > 1) {
      CHECK(l.moved_early() > 0);  // one thread, in order: moves follow the read
    }
  }
}

TEST_CASE("landing: a range some of whose bytes never landed gives no checksum") {
  std::vector<char> frame(10000, 3);
  std::vector<FrameRange> ranges = {{100, 5000}, {6000, 100}};
  Landing l(frame.data(), {{0, 10000}}, {}, ranges, true);
  l.landed(0, 3000);
  l.landed(3001, 7000);  // byte 3000 never arrives
  CHECK(!l.finish().has_value());
  Landing gaps(frame.data(), {{100, 5000}, {6000, 100}}, {}, ranges, true);
  gaps.landed(100, 5000);  // bytes the read does not fill need not land
  gaps.landed(6000, 100);
  auto sum = gaps.finish();
  REQUIRE(sum.has_value());
  CHECK_EQ(*sum, frame_checksum(frame.data(), ranges));
  Landing unchecked(frame.data(), {{0, 10000}}, {}, {}, false);
  unchecked.landed(0, 10000);
  CHECK(!unchecked.finish().has_value());
}

TEST_CASE("landing: a moved tensor whose bytes did not all land is moved, and gives no checksum") {
  // Three tensors of 2-byte items at odd offsets: each moves left. A chunk
  // inside the second never lands (a failed read): finish() still moves
  // every tensor, the ones that landed to their planned bytes, and the page
  // has no checksum.
  std::vector<TensorSource> t = {
      {"a", 0, 9, 5000, 2}, {"b", 0, 5009, 7000, 2}, {"c", 0, 12009, 3001, 2}};
  PagePlan p = plan_in_place(t, {15010 + 7});
  REQUIRE(p.moves.size() == 3);
  std::vector<char> source(p.frame_bytes, 0);
  std::vector<FrameRange> reads, read_ranges;
  for (const Extent& x : p.extents) {
    for (std::uint64_t k = 0; k < x.length; ++k)
      source[x.frame_offset + k] =
          static_cast<char>(check::pattern_byte(x.file, x.file_offset + k));
    reads.push_back({x.frame_offset, x.length});
  }
  for (std::size_t i = 0; i < t.size(); ++i)
    read_ranges.push_back({p.tensors[i].read_offset, t[i].nbytes});
  std::vector<char> frame(p.frame_bytes, 0);
  Landing l(frame.data(), reads, p.moves, read_ranges, true);
  std::uint64_t hole = p.tensors[1].read_offset + 1000, hole_len = 512;
  std::uint64_t begin = reads.front().offset, end = reads.back().offset + reads.back().length;
  std::memcpy(frame.data() + begin, source.data() + begin, hole - begin);
  l.landed(begin, hole - begin);
  std::memcpy(
      frame.data() + hole + hole_len, source.data() + hole + hole_len, end - hole - hole_len);
  l.landed(hole + hole_len, end - hole - hole_len);
  CHECK(!l.finish().has_value());
  for (std::size_t i : {0u, 2u}) {
    CHECK(check::matches_pattern(
        frame.data() + p.tensors[i].frame_offset, t[i].nbytes, t[i].file, t[i].offset));
  }
}
