// landing.h: the work a page's read needs after its bytes arrive, done while
// they arrive.
//
// After a read, a page's tensors that MLX wrote at odd file offsets are moved
// into alignment (layout.h), and a checked page is verified (checksum.h).
// Done after the last chunk, both sat between the read and the block waiting
// for it, while the CPU had waited idle for the disk: for a 207 MB page,
// 38 ms of XXH3 and 15 ms of memmove, a quarter of its read at 1.3 GB/s.
// Here the I/O thread that finished a chunk (page_io.h's on_chunk) does
// what that chunk made possible:
//  - hashes every checksum range's next bytes now in the frame into that
//    range's streaming XXH3, in order;
//  - applies the next moves, in the plan's order, each once its source has
//    landed and been hashed and the bytes its destination covers that the
//    read fills have landed (a move never writes where a chunk still will).
// What is left after the last chunk is the part of the page it brought.
//
// The checksum ranges are given where the READ puts their bytes: a tensor
// the plan moves is hashed at its source, before the move, which only
// shifts the same bytes. The result equals frame_checksum() of the page
// after its moves.
//
// A range that is exactly a left move's source is hashed by that move, piece
// by piece, each piece hashed and moved while it is in cache: one pass over
// memory where hashing as it landed and moving later took two (a fused pass
// 0.18 s a GB against 0.26 here, 2-vCPU AMD EPYC; MLX-written files move
// nearly every tensor).
//
// Thread safety: landed() from any number of threads at once (one of them
// works at a time; the others return at once, leaving their bytes to it);
// finish() after the last landed() has returned.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "mm/checksum.h"
#include "mm/page_table.h"

namespace mlx_pager {

class Landing {
 public:
  // `frame`: where the read lands; `reads`: the frame ranges it fills;
  // `moves`: to apply in this order (layout.h: each reads only bytes no
  // earlier move wrote); `ranges`: the checksum's ranges, in its order, at
  // the frame offsets the read fills them at (empty and `checked` false: no
  // checksum).
  Landing(
      char* frame,
      std::vector<FrameRange> reads,
      std::vector<FrameMove> moves,
      const std::vector<FrameRange>& ranges,
      bool checked);
  ~Landing();
  Landing(const Landing&) = delete;
  Landing& operator=(const Landing&) = delete;

  // Bytes [offset, offset + length) of the frame have landed (a chunk read
  // succeeded). May hash and move, on the calling thread.
  void landed(std::uint64_t offset, std::uint64_t length);

  // Once no more bytes will land: hashes what landed and is left, applies
  // every move not yet applied, and returns the page's checksum
  // (combine_digests of the ranges' XXH3s, in order); nullopt for an
  // unchecked page, or when some range's bytes never landed (a chunk failed).
  std::optional<std::uint64_t> finish();

  // Moves applied before finish() (while the read landed).
  std::size_t moved_early() const { return moved_early_; }
  // Moves that hash their source range as they move it.
  std::size_t hashing_moves() const {
    return static_cast<std::size_t>(
        std::count_if(fused_.begin(), fused_.end(), [](int k) { return k >= 0; }));
  }

 private:
  struct Range {
    std::uint64_t offset = 0;
    std::uint64_t length = 0;
    std::uint64_t hashed = 0;  // bytes fed to `hasher`, from `offset` on
    std::unique_ptr<Hasher> hasher;
    bool by_move = false;  // hashed by the move whose source it is
  };
  // Bytes hashed and then moved at a time by a fused move (fits L2).
  static constexpr std::uint64_t kFusedPiece = 256u << 10;
  // Hashes and moves what has become possible, until nothing more is.
  // Takes and drops `lock` around each piece of work.
  void work(std::unique_lock<std::mutex>& lock);
  bool move_ready(std::size_t i) const;
  // Applies move i (with the lock released); hashes its source as it goes
  // where the move hashes a range (fused_), and marks that range hashed.
  void apply_move(std::size_t i, std::unique_lock<std::mutex>* lock);
  // The end of the landed run of bytes that contains `pos` (pos itself if none).
  std::uint64_t landed_end(std::uint64_t pos) const;
  bool all_landed(std::uint64_t begin, std::uint64_t end) const;

  char* frame_;
  std::vector<FrameRange> reads_;
  std::vector<FrameMove> moves_;
  std::vector<int> fused_;  // per move: the range it hashes, or -1
  std::size_t next_move_ = 0;
  std::size_t moved_early_ = 0;
  std::vector<Range> ranges_;  // in the checksum's order
  bool checked_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::uint64_t, std::uint64_t> landed_;  // start -> end, merged
  bool working_ = false;
};

}  // namespace mlx_pager
