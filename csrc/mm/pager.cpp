// pager.cpp: the pager's bookkeeping: memory accounting, construction, the
// page registry, pinning, the schedule and budget, and the counters. The
// fault path is fault.cpp, reclaim reclaim.cpp, readahead readahead.cpp.
#include <algorithm>
#include <utility>

#include "mm/bug.h"
#include "mm/mlock.h"
#include "mm/pager.h"

namespace mlx_pager {

// -------------------------------------------------------------- accounting --

void Pager::Accounting::sub(std::uint64_t n) {
  charged -= n;
  {
    // Taking the lock orders this notify after a waiter's predicate check.
    std::lock_guard<std::mutex> lock(mu);
  }
  cv.notify_all();
}

void Pager::Accounting::wait_for_free(std::uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, timeout, [&] { return charged.load() < seen; });
}

void Pager::Accounting::wake_readahead_below(std::uint64_t seen) {
  {
    std::lock_guard<std::mutex> lock(mu);
    wake_below = seen;
  }
  // The memory may have been freed before wake_below was set: the thread
  // checks its predicate now, so that free is not missed.
  cv.notify_all();
}

void Pager::Accounting::wake_readahead() {
  {
    std::lock_guard<std::mutex> lock(mu);
    kick = true;
  }
  cv.notify_all();
}

std::uint64_t Pager::elapsed_ns(std::chrono::steady_clock::time_point t0) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
}

std::uint64_t Pager::charged_now() const {
  return accounting_->charged.load();
}

void Pager::check_accounting_locked(const Lock& lock) const {
#if MLX_PAGER_CHECKS_ON
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  std::uint64_t held = 0;
  for (PageId id = 0; id < table_.size(); ++id) {
    held += table_.at(id).charged;
  }
  MLX_PAGER_ASSERT(held == held_bytes_);
  std::uint64_t kept = 0;
  for (const FreeFrame& f : free_frames_) {
    kept += f.charged;
  }
  MLX_PAGER_ASSERT(kept == free_frame_bytes_);
  MLX_PAGER_ASSERT(charged_now() >= held_bytes_ + free_frame_bytes_);
#else
  (void)lock;
#endif
}

// ------------------------------------------------------------ construction --

Pager::Pager(PagerConfig config, std::shared_ptr<FrameAllocator> allocator)
    : config_(config),
      gate_(std::make_shared<LifetimeGate<Pager>>(this)),
      allocator_(std::move(allocator)),
      accounting_(std::make_shared<Accounting>()),
      budget_(config.budget_bytes),
      policy_(config.policy),
      readahead_pages_(std::max(0, config.readahead_pages)),
      readahead_aggressive_(config.readahead_aggressive),
      io_(config.io_threads, config.io_chunk_bytes, &trace_) {
  if (!allocator_) {
    throw std::invalid_argument("[Pager] needs a frame allocator");
  }
  accounting_->budget = budget_;
  if (PagePool* pool = allocator_->pool()) {
    // The pool holds what the budget has room for beside the charged pages:
    // the frames it fills take its pages before any fresh memory.
    pool->set_room([acct = accounting_](std::uint64_t freeing) -> std::uint64_t {
      std::uint64_t charged = acct->charged.load();
      charged = charged > freeing ? charged - freeing : 0;
      std::uint64_t budget = acct->budget.load();
      return budget > charged ? budget - charged : 0;
    });
  }
  readahead_thread_ = std::thread([this] { readahead_on_free(); });
}

Pager::~Pager() {
  // Leases released from now on (arrays outliving the pager) do nothing.
  gate_->close();
  {
    std::lock_guard<std::mutex> lock(accounting_->mu);
    accounting_->stop = true;
  }
  accounting_->cv.notify_all();
  readahead_thread_.join();
  if (PagePool* pool = allocator_->pool()) {
    // Nothing bounds the pool once the pager is gone: it keeps nothing more.
    pool->set_room(nullptr);
    pool->trim(0);
  }
}

// ---------------------------------------------------------------- registry --

std::uint64_t Pager::charge_bound(PageId id) const {
  return frame_charge_bound(spec(id).frame_bytes);
}

std::uint64_t Pager::frame_charge_bound(std::uint64_t frame_bytes) const {
  std::uint64_t bound = allocator_->charge_bound(frame_bytes);
  if (config_.keep_free_frames) {
    std::uint64_t need = allocator_->footprint(frame_bytes);
    bound = std::max(bound, need + reuse_slack(need));
  }
  return bound;
}

FileId Pager::add_file(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  FileId id = table_.add_file(path, config_.direct_io);
  stat_.direct_files = stat_.buffered_files = 0;
  for (FileId f = 0; f < table_.num_files(); ++f) {
    if (table_.file(f).mode() == IoMode::buffered_drop) {
      ++stat_.buffered_files;
    } else {
      ++stat_.direct_files;
    }
  }
  return id;
}

PageId Pager::add_page(PageSpec spec) {
  std::lock_guard<std::mutex> lock(mu_);
  PageId id = table_.add_page(std::move(spec));
  // What a read of it transfers, once: its files' sizes are read here
  // (fstat), not under the lock each stats() holds.
  PageEntry& e = table_.at(id);
  for (const Extent& x : e.spec.extents) {
    std::uint64_t size = table_.file(x.file).size();
    e.read_bytes += x.file_offset < size ? std::min(x.length, size - x.file_offset) : 0;
  }
  // The schedule's per-page index must cover the new page.
  schedule_ = Schedule(schedule_.order(), table_.size(), schedule_.repeats());
  return id;
}

PageId Pager::lookup(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.lookup(name);
}

std::size_t Pager::num_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.size();
}

const PageSpec& Pager::spec(PageId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.at(id).spec;  // specs never change once registered
}

std::uint64_t Pager::read_bytes(PageId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.at(id).read_bytes;
}

PageState Pager::state(PageId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.at(id).state;
}

IoMode Pager::file_mode(FileId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return table_.file(id).mode();
}

// ----------------------------------------------------------------- pinning --

void Pager::pin(PageId id) {
  Frame f = acquire(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    PageEntry& e = table_.at(id);
    if (!e.pinned) {
      e.pinned = true;
      e.mlocked = lock_memory(f.data, f.size);
    }
    --e.refs;
  }
}

void Pager::unpin(PageId id) {
  std::lock_guard<std::mutex> lock(mu_);
  PageEntry& e = table_.at(id);
  if (e.pinned && e.mlocked && e.frame.data) {
    unlock_memory(e.frame.data, e.frame.size);
  }
  e.pinned = false;
  e.mlocked = false;
}

// ----------------------------------------------------- schedule and budget --

void Pager::set_schedule(std::vector<PageId> order, bool repeat) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    schedule_ = Schedule(std::move(order), table_.size(), repeat);
    cursor_ = 0;
  }
  readahead();
}

std::uint64_t Pager::set_budget(std::uint64_t bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  std::uint64_t old = budget_;
  budget_ = bytes;
  accounting_->budget = bytes;
  // Shrink: evict what nobody holds until the new budget holds (best effort;
  // pages in use and pinned pages stay and are evicted as they are released).
  while (charged_now() > budget_) {
    if (drop_free_frame_locked(lock)) {
      drop_graveyard_unlocked(lock);
      continue;
    }
    auto cands = evictable_locked(lock);
    if (cands.empty()) {
      break;
    }
    evict_locked(lock, cands[choose_victim(policy_, cands)].id);
    drop_graveyard_unlocked(lock);
  }
  if (PagePool* pool = allocator_->pool()) {
    pool->trim_to_room();
  }
  return old;
}

int Pager::set_readahead(int pages) {
  int old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::exchange(readahead_pages_, std::max(0, pages));
  }
  readahead();
  return old;
}

std::uint64_t Pager::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

// ---------------------------------------------------------------- counters --

std::uint64_t Pager::pinned_bytes_locked(const Lock& lock) const {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  std::uint64_t n = 0;
  for (PageId id = 0; id < table_.size(); ++id) {
    if (table_.at(id).pinned) {
      n += table_.at(id).charged;
    }
  }
  return n;
}

void Pager::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stat_.peak_resident_bytes = charged_now();
}

void Pager::note_peak_locked(const Lock& lock) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  stat_.peak_resident_bytes = std::max(stat_.peak_resident_bytes, charged_now());
}

void Pager::set_rebuild_hook(RebuildHook hook) {
  auto h = hook ? std::make_shared<const RebuildHook>(std::move(hook)) : nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  rebuild_hook_.swap(h);
  // The old hook goes with `h`, after the lock.
}

VmStat Pager::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  VmStat s = stat_;
  if (reads_in_flight_ > 0) {
    s.read_busy_ns += elapsed_ns(busy_since_);  // the busy spell under way
  }
  s.io_retries = io_.retries();
  s.resident_bytes_now = charged_now();
  s.free_frame_bytes_now = free_frame_bytes_;
  s.peak_resident_bytes = std::max(s.peak_resident_bytes, s.resident_bytes_now);
  for (PageId id = 0; id < table_.size(); ++id) {
    const PageEntry& e = table_.at(id);
    s.resident_pages_now += e.state == PageState::resident;
    if (e.state == PageState::in_flight) {
      ++s.in_flight_pages_now;
      s.in_flight_bytes_now += e.read_bytes;
    }
    if (e.pinned) {
      s.pinned_bytes_now += e.charged;
      if (e.mlocked) {
        s.mlocked_bytes_now += e.charged;
      }
    }
  }
  return s;
}

}  // namespace mlx_pager
