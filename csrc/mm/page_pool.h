// page_pool.h: a freed frame's memory handed to the next frame, moved, not
// copied.
//
// Memory mapped fresh costs a page fault per page on its first touch (the
// kernel zeroes it; on a VM guest that reports free pages to its host, the
// host faults it in too: 0.4-0.7 s per GB on the dev VM, as slow as its
// disk). A page frame freed to the OS and the next one mapped fresh pays
// that per read, and a direct read into unpopulated memory waits for it.
// Keeping a freed frame whole (MlxFrameAllocator's kept frame) helps only
// the next page of its size: the parts of a block (--page-parts) are of
// several sizes, and most of their frames went back to the OS.
//
// The pool takes the resident pages out of a frame that is being freed (the
// frame's range stays mapped, unpopulated) and moves them into the
// unpopulated pages of the next frames, of any size: the page tables move
// (Linux mremap), no byte is copied, nothing faults. Neither move leaves a
// hole in a frame, even for a moment (another thread's mmap could be given
// it): the pages leave with MREMAP_DONTUNMAP (Linux 5.7), and arrive over
// the frame's own unpopulated pages in one call. A bound (`room`) says
// how much it may hold: the pager's budget less what stays charged, so that
// the pages charged plus the pool never hold more than the budget.
//
// Platform: Linux 5.7 or later. Elsewhere supported() is false (on an older
// Linux put() keeps nothing), put() keeps nothing and
// fill() moves nothing: frames are mapped fresh as before. Only memory that
// is plain private anonymous memory of this process (malloc's) may be given
// to put() and fill(): not a GPU allocator's buffer.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace mlx_pager {

class PagePool {
 public:
  // Bytes the pool may hold once `freeing` more bytes are credited back to
  // the pager (the budget less what stays charged).
  using Room = std::function<std::uint64_t(std::uint64_t freeing)>;

  PagePool() = default;
  ~PagePool();  // unmaps what it holds
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Whether this platform can move pages between mappings.
  static bool supported();
  // The VM page size the pool moves in.
  static std::uint64_t page_size();

  // Sets the bound (none set: the pool keeps nothing).
  void set_room(Room room);
  // Moves the resident whole pages inside [p, p + len), at most the room
  // left once `freeing` bytes are credited back, into the pool; the range
  // stays mapped read/write (unpopulated where pages left). The memory must
  // not be in use. Returns the bytes taken.
  std::uint64_t put(void* p, std::uint64_t len, std::uint64_t freeing);
  // Moves pool pages into the unpopulated whole pages inside [p, p + len),
  // a frame the pager has charged already; then lets go of pool pages past
  // the room left (the frame may have taken fewer than it was charged).
  // Returns the bytes moved.
  std::uint64_t fill(void* p, std::uint64_t len);
  // Unmaps pooled pages until at most `keep` bytes are left. Returns the
  // bytes released.
  std::uint64_t trim(std::uint64_t keep);
  // Trims the pool to its room now.
  std::uint64_t trim_to_room();
  // Unmaps every pooled page, and keeps none that put() offers until the
  // next fill() (paging has stopped: a closed session's frames freed late
  // would otherwise wait in the pool). Returns the bytes released.
  std::uint64_t release();

  std::uint64_t bytes() const;
  // Counters since construction: bytes moved into frames by fill(), and
  // bytes taken from frames by put().
  std::uint64_t filled_bytes() const;
  std::uint64_t taken_bytes() const;

 private:
  struct Piece {
    char* addr;
    std::uint64_t len;
  };
  std::uint64_t trim_locked(std::uint64_t keep);
  // Moves [run, run + n) (resident, page aligned) into a new piece, or as
  // much of it from its start as the kernel moves. Returns the bytes moved.
  std::uint64_t move_out_locked(char* run, std::uint64_t n);

  mutable std::mutex mu_;
  Room room_;
  std::vector<Piece> pieces_;  // disjoint mappings of resident pages
  std::uint64_t bytes_ = 0;
  bool paused_ = false;  // release() until the next fill()
  std::uint64_t filled_ = 0;
  std::uint64_t taken_ = 0;
};

}  // namespace mlx_pager
