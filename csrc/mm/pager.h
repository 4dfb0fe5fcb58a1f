// pager.h: the pager, the contract every other part serves.
//
// The pager keeps named pages (page_table.h) either on disk or resident in
// frames (frame.h) under a byte budget that is never exceeded, the way an OS
// keeps process pages in RAM or swap:
//
//   acquire(p)  the fault path (fault.cpp). Resident: returns at once (a hit).
//               In flight (readahead started it): waits for the rest of the
//               read. On disk: makes room (reclaim.cpp), reads, waits.
//   release(p)  the page may be evicted again once nobody holds it.
//   schedule    the known access order of a step (schedule.h); it drives the
//               optimal policy and readahead (readahead.cpp), which reads the
//               next pages on I/O threads (page_io.h) while the caller
//               computes, evicting only pages needed later than the one read.
//               It runs after every acquire and release, and on its own
//               thread when memory it was waiting for is freed (an evicted
//               page's frame that an array still viewed).
//   pin(p)      resident for good and mlock'ed (mlock.h); never evicted.
//
// Integrity: a page registered with a checksum (PageSpec::checked) is
// verified on every read, hashed as its chunks land on the I/O threads
// (landing.h) and compared on the one that completed it, with mu_ released
// (checksum.h). A mismatch reads the page once more, synchronously
// on that thread; a second mismatch fails the read as corrupt. The acquire
// waiting for it then calls the rebuild hook (set_rebuild_hook) on its own
// thread, without mu_: a hook that rewrote the page's bytes (a swap page,
// from the model's files) returns true and the read is tried once more;
// otherwise acquire throws PageReadError naming the page and its files.
//
// Budget accounting counts what is really allocated: a frame is charged from
// the moment its read is planned until its memory is freed, which can be
// after eviction when someone still holds an array viewing it. The
// allocator's page pool (page_pool.h: freed frames' pages for the next
// frames) is not charged: the pager bounds it by the budget's room
// (budget less charged, Accounting::budget), so charged + pool <= budget.
//
// All public methods are thread-safe. acquire() blocks; it may be called
// from several threads at once, also for the same page.
//
// Locking (the rules the private methods follow; bug.h checks them in debug
// and sanitizer builds):
//  - mu_ guards every non-const member below it: the page table's entries,
//    the schedule and cursor, budget_, the policy and readahead settings,
//    the access clock, held_bytes_, graveyard_, the free frames and stat_. config_,
//    allocator_ and io_ are set once; accounting_->charged is atomic;
//    trace_ has its own lock.
//  - The readahead thread holds Accounting::mu only while it waits; it
//    calls readahead() with no lock held. release_lease() (any thread) takes
//    mu_, then Accounting::mu, never both at once.
//  - Lock order: mu_ -> Accounting::mu -> IoBatch::mu_. Accounting::mu and
//    IoBatch::mu_ are leaves (nothing is locked under them), and so is the
//    trace recorder's lock (trace.h), taken under any of them. mu_ is NEVER held
//    while calling into the FrameAllocator (allocate may run MLX code;
//    unshared, a pure query, and the page pool's trim_to_room, whose lock is
//    a leaf and whose room reads only atomics, are the exceptions),
//    while dropping a frame's last reference (its on_free takes
//    Accounting::mu and MLX's allocator lock), or while submitting I/O (a
//    completion runs complete_read, which takes mu_, possibly before
//    submit() returns). PageIO's own lock is never held when it calls back.
//  - A `_locked` method is called with mu_ held and returns with it held. One
//    that takes the lock as a parameter may drop and retake it (to wait, to
//    allocate, to free frames, to submit reads): every page state it or its
//    caller read before may have changed, so callers re-check state (the page
//    may be in flight or resident by now) instead of trusting what they saw.
//  - `_unlocked` in a name (drop_graveyard_unlocked) says the method does its
//    work with mu_ released, and retakes it before returning.
//
// Accounting invariant, under mu_:
//     charged (accounting_->charged) >= held_bytes_ + free_frame_bytes_
//     held_bytes_ = sum of pages' `charged`
//     free_frame_bytes_ = the kept free frames' charges (free_frames_)
//     the rest = memory of frames the pager let go of (evicted, or failed
//                reads) that is still referenced, by the graveyard or by
//                arrays outside the pager.
// Every charge is made under mu_; memory is credited back only when it is
// really freed (on_free), which can happen on any thread at any time.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mm/frame.h"
#include "mm/landing.h"
#include "mm/lifetime_gate.h"
#include "mm/page_io.h"
#include "mm/page_table.h"
#include "mm/reclaim.h"
#include "mm/schedule.h"
#include "mm/trace.h"
#include "mm/vmstat.h"

namespace mlx_pager {

// The budget cannot hold what was asked of it.
class BudgetError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A page's bytes could not be read; the message names the page and file.
class PageReadError : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct PagerConfig {
  std::uint64_t budget_bytes = 0;  // resident + in-flight frames, at most
  Policy policy = Policy::optimal;
  int readahead_pages = 2;  // pages read ahead of the schedule; 0 = off
  // Readahead may evict pages MIN would keep, to overlap reads with compute
  // (readahead.cpp); false: never more reads than MIN on the schedule.
  bool readahead_aggressive = false;
  int io_threads = 4;
  std::size_t io_chunk_bytes = kDefaultIoChunkBytes;
  bool direct_io = true;  // false: buffered reads + cache drop (tests)
  // Keep the frame of an evicted page that nothing else references
  // (FrameAllocator::unshared), still charged, and read the next page it
  // fits into it: a page streamed through a small budget then lands in
  // memory already mapped, where a fresh frame costs page faults and zeroing
  // inside the read (read shape at one block, in parts: 1.5 s a step against
  // 1.9 s). Free frames are dropped first whenever room is needed.
  bool keep_free_frames = false;
  // Hand freed frames' pages to the next frames through the allocator's page
  // pool where it has one (FrameAllocator::pool, page_pool.h), bounded by
  // the budget: read by the allocator's owner (TensorPager), which builds
  // the allocator with or without it.
  bool page_pool = true;
};

class Pager {
 public:
  Pager(PagerConfig config, std::shared_ptr<FrameAllocator> allocator);
  // Waits for reads in flight; frames still referenced elsewhere stay valid.
  ~Pager();
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  // ---- registry (before or between steps) ----
  FileId add_file(const std::string& path);
  PageId add_page(PageSpec spec);
  PageId lookup(const std::string& name) const;
  std::size_t num_pages() const;
  const PageSpec& spec(PageId id) const;
  // Bytes one read of the page transfers: its extents, each up to its
  // file's end when it was registered (a direct read stops there). What stats().bytes_read grows by
  // for each read of the page, re-reads after a failed check aside; less
  // than spec.frame_bytes, which also holds the alignment padding.
  std::uint64_t read_bytes(PageId id) const;
  // The most the page may be charged while resident: its frame's footprint,
  // or more where the allocator hands out a larger buffer or the pager reuses
  // a free frame up to reuse_slack larger (keep_free_frames). A budget that
  // must hold several pages at once (a block's parts) counts this.
  std::uint64_t charge_bound(PageId id) const;
  // The same for a page whose frame holds `frame_bytes` (PageSpec::frame_bytes).
  std::uint64_t frame_charge_bound(std::uint64_t frame_bytes) const;
  PageState state(PageId id) const;
  IoMode file_mode(FileId id) const;

  // ---- the fault path ----
  // Returns the page's frame, reading it first if needed. Throws
  // PageReadError (naming page and file) if the read fails, BudgetError if
  // the page cannot fit.
  Frame acquire(PageId id);
  // Ends one acquire(); the page becomes evictable when no acquire is left.
  void release(PageId id);
  // acquire() for a holder that lets go of the page on whatever thread frees
  // it (MLX arrays viewing the frame: tensor_pager.h's acquire_leased), by
  // release_lease(). A fault that needs room while the budget is full of
  // leased pages waits for them (up to kZombieTimeout), as for evicted
  // memory still referenced: their holders are computing with them.
  Frame acquire_lease(PageId id);
  // Ends one acquire_lease(). Callable from any thread, including one that
  // frees an MLX buffer, with no lock held: it takes mu_ only to count, and
  // leaves readahead to the readahead thread (woken, never run inline).
  void release_lease(PageId id);
  // release_lease(id) as a callable a lease's holder may run at any time, on
  // any thread, also after the pager is gone (then it does nothing: the page
  // table went with the pager, and the frame's memory is the holder's own).
  // What an MLX buffer's deleter holds (tensor_pager.h's acquire_leased).
  std::function<void()> lease_releaser(PageId id);
  // Reads the page if needed and keeps it resident until unpin(); locks it
  // in RAM where the OS allows.
  void pin(PageId id);
  void unpin(PageId id);
  // Drops every resident page nobody holds (pinned pages stay), and every
  // kept free frame. Readahead reads in flight are waited for and dropped
  // too; readahead may start new ones afterwards (set_readahead(0) first
  // for a cold start that stays cold).
  void evict_all();
  // Frees the kept free frames (PagerConfig::keep_free_frames); returns
  // their bytes.
  std::uint64_t drop_free_frames();
  // The page's bytes on disk were rewritten (a spilled activation page,
  // spill.py): drops any copy in memory, waiting for a read in flight, so
  // that the next acquire reads the new bytes. Throws std::logic_error if
  // the page is held or pinned.
  void discard(PageId id);

  // ---- planning ----
  // The access order of one step, repeated (or, `repeat` = false, run once).
  // Resets the position to its start.
  void set_schedule(std::vector<PageId> order, bool repeat = true);
  // Returns the previous budget (MLX style). Lowering the budget evicts down
  // to it where possible.
  std::uint64_t set_budget(std::uint64_t bytes);
  // Pages read ahead of the schedule (0: off); returns the previous value.
  int set_readahead(int pages);
  // Aggressive (true) or conservative readahead (readahead.cpp); returns the
  // previous mode.
  bool set_readahead_aggressive(bool on);
  // The readahead depth (pages) and mode in force now.
  int readahead_pages() const;
  bool readahead_aggressive() const;
  std::uint64_t budget() const;

  // ---- counters ----
  VmStat stats() const;
  // Starts peak_resident_bytes over from what is charged now.
  void reset_peak();
  // Blocks while page `id` is on disk, until `done` is true: returns true
  // once the page is in memory or on its way (readahead read it, e.g. when
  // memory it waited for was freed), false once `done` came first. Whoever
  // sets `done` (any thread) needs no call into the pager: it is seen within
  // kDonePoll. (paged_tensor.cpp waits here for MLX's stream to free the
  // pages it computes with, or to drain, before faulting a page in.)
  bool wait_off_disk(PageId id, const std::atomic<bool>& done);
  // Test hook: see page_io.h.
  void set_fault_injector(FaultInjector f) { io_.set_fault_injector(std::move(f)); }
  // Called as hook(page) when a page's bytes on disk fail their checksum
  // twice (see Integrity above); returns whether it rewrote them. May throw.
  using RebuildHook = std::function<bool(PageId)>;
  void set_rebuild_hook(RebuildHook hook);

  // ---- tracing (trace.h) ----
  // Starts (true) or stops recording reads, waits and evictions.
  void set_tracing(bool on) { trace_.enable(on); }
  // The events recorded since the last call, in the order recorded.
  std::vector<TraceEvent> take_trace() { return trace_.take(); }
  std::uint64_t trace_dropped() const { return trace_.dropped(); }

 private:
  // Shared with frames' on_free callbacks, which may outlive the pager.
  struct Accounting {
    std::atomic<std::uint64_t> charged{0};
    // A copy of budget_ for the page pool's bound (page_pool.h), which is
    // read on whatever thread frees a frame, without mu_.
    std::atomic<std::uint64_t> budget{0};
    std::mutex mu;
    std::condition_variable cv;
    // Guarded by mu: the readahead thread runs readahead once charged drops
    // below wake_below (0: it sleeps), and returns on stop.
    std::uint64_t wake_below = 0;
    bool kick = false;  // run readahead once now (a lease was released)
    bool stop = false;
    void add(std::uint64_t n) { charged += n; }
    void sub(std::uint64_t n);
    void wait_for_free(std::uint64_t seen, std::chrono::milliseconds timeout);
    // Wakes the readahead thread once `seen` is no longer all charged.
    void wake_readahead_below(std::uint64_t seen);
    // Wakes the readahead thread now.
    void wake_readahead();
  };

  using Lock = std::unique_lock<std::mutex>;

  // fault.cpp
  // Starts reading an on_disk page (urgent: a fault, which first makes room
  // and may wait; else readahead, which the caller made room for). Drops the
  // lock. Returns the read generation it started (the page may already have
  // landed, or failed with that failed_gen, by then: the I/O threads run
  // while the lock is dropped), or 0 when it started none: another thread
  // started the read meanwhile, or readahead gave it up (the frame cost more
  // than reserved and did not fit). The budget is reserved at
  // FrameAllocator::footprint before allocating, then charged at the frame's
  // exact footprint. Throws what the allocator or make_room throws.
  std::uint64_t start_read_locked(Lock& lock, PageId id, bool urgent);
  // The rest of a read once the in-flight page has its frame: submits its
  // extents (dropping the lock).
  void submit_read_locked(Lock& lock, PageId id, bool urgent);
  // Puts a page whose read was started but not submitted back on disk and
  // frees its frame (with the lock released).
  void abandon_read_locked(Lock& lock, PageId id);
  // The I/O completion of a read (takes mu_ itself).
  // `submitted_ns`: when the read was submitted (trace clock), `urgent`: a
  // fault's read (else readahead's); both for the trace.
  // `landing`: the moves and checksum done as the read landed (null: none).
  void complete_read(
      PageId id,
      std::uint64_t gen,
      IoBatch& batch,
      std::int64_t submitted_ns,
      bool urgent,
      Landing* landing);
  // Verifies a page's frame after its read (mu_ not held; the frame is the
  // read's alone). On a mismatch reads the page again once (`again`: its
  // reads, resolved under mu_). Returns "" when the bytes match, else why
  // not; counts into the last two arguments.
  std::string verify_unlocked(
      const PageSpec& spec,
      TraceTag tag,
      char* data,
      const std::vector<ReadOp>& again,
      std::uint64_t& mismatches,
      std::uint64_t& reread_bytes);
  void advance_cursor_locked(const Lock& lock, PageId id);
  // reclaim.cpp
  std::vector<Candidate> evictable_locked(const Lock& lock) const;
  // Takes a resident, unreferenced, unpinned page's frame out of the table
  // into the graveyard; the caller then calls drop_graveyard_unlocked.
  void evict_locked(const Lock& lock, PageId id);
  // Drops the graveyard's frames with the lock released.
  void drop_graveyard_unlocked(Lock& lock);
  // Evicts (and waits) until `need` more bytes fit in the budget, or, with
  // `or_free_frame` (a fault's read of `for_page`), until a kept free frame
  // fits `for_page` or another thread has started that read; drops the
  // lock. Throws BudgetError naming `for_page` when none of these can be had.
  void make_room_locked(
      Lock& lock, std::uint64_t need, PageId for_page, bool or_free_frame = false);
  // A kept free frame for a page of `frame_bytes` usable bytes (reserving
  // `need`): large enough, and not larger than MLX's own cache would hand
  // back. Returns its index in free_frames_, or -1.
  std::ptrdiff_t free_frame_for_locked(
      const Lock& lock, std::uint64_t frame_bytes, std::uint64_t need) const;
  // Moves the oldest kept free frame to the graveyard (the caller drops it);
  // false when none is kept.
  bool drop_free_frame_locked(const Lock& lock);
  // readahead.cpp
  void readahead();
  bool readahead_one_locked(Lock& lock, PageId id);
  // Whether MIN, run over the schedule from the cursor on the pages charged
  // now, evicts page `q` before its next use (so evicting it now costs no
  // read MIN does not make). Conservative readahead asks this of idle pages
  // when MIN's own choice is busy, at most kIdleVictimTries of them.
  bool min_evicts_before_next_use_locked(const Lock& lock, PageId q) const;
  static constexpr int kIdleVictimTries = 2;
  // The readahead thread's loop: readahead again whenever memory that
  // stopped it (evicted, still referenced) is freed.
  void readahead_on_free();
  // pager.cpp
  std::uint64_t charged_now() const;
  std::uint64_t pinned_bytes_locked(const Lock& lock) const;
  void note_peak_locked(const Lock& lock);
  // Checks the accounting invariant above (debug and sanitizer builds).
  void check_accounting_locked(const Lock& lock) const;
  static std::uint64_t elapsed_ns(std::chrono::steady_clock::time_point t0);

  PagerConfig config_;
  // Reaches the pager from lease_releaser()'s callables while it lives;
  // ~Pager closes it first.
  std::shared_ptr<LifetimeGate<Pager>> gate_;
  std::shared_ptr<FrameAllocator> allocator_;
  std::shared_ptr<Accounting> accounting_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // page state changes
  PageTable table_;
  Schedule schedule_;
  std::size_t cursor_ = 0;  // position of the next access in schedule_
  std::uint64_t budget_;
  Policy policy_;
  int readahead_pages_;
  bool readahead_aggressive_;
  std::uint64_t access_clock_ = 0;
  std::uint64_t fault_room_ = 0;  // room faults in make_room need for their reads
  std::uint64_t held_bytes_ = 0;  // charged to pages in the table
  // Page reads submitted and not yet completed, and since when there has
  // been at least one (VmStat::read_busy_ns).
  int reads_in_flight_ = 0;
  std::chrono::steady_clock::time_point busy_since_;
  std::vector<std::shared_ptr<void>> graveyard_;  // frames to drop unlocked
  struct FreeFrame {
    Frame frame;
    std::uint64_t charged = 0;
  };
  std::vector<FreeFrame> free_frames_;  // oldest first (keep_free_frames)
  std::uint64_t free_frame_bytes_ = 0;
  // How long make_room waits for evicted memory still referenced outside the
  // pager before it gives up with a BudgetError.
  static constexpr std::chrono::milliseconds kZombieTimeout{2000};
  static constexpr std::chrono::microseconds kDonePoll{500};
  VmStat stat_;
  std::shared_ptr<const RebuildHook> rebuild_hook_;
  // Its own lock (a leaf); outlives io_, whose threads record into it.
  TraceRecorder trace_;

  // Last members: destroyed first, so no I/O completion runs on a dead pager
  // (io_), and the readahead thread is stopped and joined by ~Pager before
  // anything it uses goes.
  PageIO io_;
  std::thread readahead_thread_;
};

}  // namespace mlx_pager
