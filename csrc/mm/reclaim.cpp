// reclaim.cpp: victim selection, and the pager's make-room/evict paths.
#include "mm/reclaim.h"

#include <atomic>
#include <chrono>
#include <stdexcept>

#include "mm/bug.h"
#include "mm/direct_io.h"
#include "mm/pager.h"

namespace mlx_pager {

namespace {

// How long make_room waits between looks while reads are in flight (they
// become evictable when they land; completions also notify).
constexpr std::chrono::milliseconds kInFlightPoll{50};
// How long it waits at a time for evicted memory still referenced outside
// the pager to be freed.
constexpr std::chrono::milliseconds kZombiePoll{10};

}  // namespace

const char* to_string(Policy p) {
  switch (p) {
    case Policy::lru:
      return "lru";
    case Policy::optimal:
      return "optimal";
  }
  return "?";
}

Policy policy_from_string(const std::string& s) {
  if (s == "lru") {
    return Policy::lru;
  }
  if (s == "optimal" || s == "belady" || s == "min") {
    return Policy::optimal;
  }
  throw std::invalid_argument(
      "[policy_from_string] unknown eviction policy '" + s + "': use 'lru' or 'optimal'");
}

// True when `a` should be evicted before `b`.
static bool evict_before(Policy policy, const Candidate& a, const Candidate& b) {
  if (a.priority != b.priority) {
    return a.priority < b.priority;
  }
  if (policy == Policy::optimal && a.next_use != b.next_use) {
    return a.next_use > b.next_use;
  }
  return a.last_access < b.last_access;
}

std::size_t choose_victim(Policy policy, const std::vector<Candidate>& c) {
  if (c.empty()) {
    throw std::logic_error("[choose_victim] no candidates");
  }
  std::size_t best = 0;
  for (std::size_t i = 1; i < c.size(); ++i) {
    if (evict_before(policy, c[i], c[best])) {
      best = i;
    }
  }
  return best;
}

// ---------------------------------------------------------------- Pager ----

std::vector<Candidate> Pager::evictable_locked(const Lock& lock) const {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  std::vector<Candidate> out;
  for (PageId id = 0; id < table_.size(); ++id) {
    const PageEntry& e = table_.at(id);
    if (e.evictable()) {
      out.push_back(Candidate{id, e.spec.priority, e.last_access, schedule_.next_use(id, cursor_)});
    }
  }
  return out;
}

void Pager::evict_locked(const Lock& lock, PageId id) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  PageEntry& e = table_.at(id);
  MLX_PAGER_ASSERT(e.evictable());
  std::uint64_t charged = e.charged;
  if (config_.keep_free_frames && allocator_->unshared(e.frame)) {
    // unshared() reads a use count (a relaxed load): order the last holder's
    // accesses to the memory before the next read writes into it, as the
    // deleter's decrement would have.
    std::atomic_thread_fence(std::memory_order_acquire);
    free_frame_bytes_ += charged;
    free_frames_.push_back(FreeFrame{std::move(e.frame), charged});
  } else {
    graveyard_.push_back(std::move(e.frame.owner));
  }
  e.frame = Frame{};
  held_bytes_ -= e.charged;
  e.charged = 0;
  e.state = PageState::on_disk;
  e.prefetched = false;
  ++stat_.evictions;
  if (trace_.enabled()) {
    TraceEvent te;
    te.kind = TraceKind::evict;
    te.page = id;
    te.bytes = charged;
    te.start_ns = te.end_ns = TraceRecorder::now_ns();
    trace_.record(te);
  }
}

void Pager::evict_all() {
  std::unique_lock<std::mutex> lock(mu_);
  // A readahead in flight lands resident after this returns unless it is
  // waited for: the caller would find a page in memory that it dropped.
  // (A fault's read is held by its waiter and stays.)
  cv_.wait(lock, [&] {
    for (PageId id = 0; id < table_.size(); ++id) {
      const PageEntry& e = table_.at(id);
      if (e.state == PageState::in_flight && !e.held()) {
        return false;
      }
    }
    return true;
  });
  for (PageId id = 0; id < table_.size(); ++id) {
    const PageEntry& e = table_.at(id);
    if (e.evictable()) {
      evict_locked(lock, id);
    }
  }
  while (drop_free_frame_locked(lock)) {
  }
  drop_graveyard_unlocked(lock);
}

std::uint64_t Pager::drop_free_frames() {
  std::unique_lock<std::mutex> lock(mu_);
  std::uint64_t n = free_frame_bytes_;
  while (drop_free_frame_locked(lock)) {
  }
  drop_graveyard_unlocked(lock);
  return n;
}

std::ptrdiff_t Pager::free_frame_for_locked(
    const Lock& lock, std::uint64_t frame_bytes, std::uint64_t need) const {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  // One of the page's own size (a block's parts come in a few sizes, the
  // same in every block): a page charged more than a fresh frame would cost
  // leaves less of the budget to the others, and a block must still fit in
  // its own footprint. MLX rounds a buffer up by a few pages at most
  // (reuse_slack).
  for (std::size_t i = 0; i < free_frames_.size(); ++i) {
    const FreeFrame& f = free_frames_[i];
    if (f.frame.size >= frame_bytes && f.charged <= need + reuse_slack(need)) {
      return static_cast<std::ptrdiff_t>(i);
    }
  }
  return -1;
}

bool Pager::drop_free_frame_locked(const Lock& lock) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  if (free_frames_.empty()) {
    return false;
  }
  free_frame_bytes_ -= free_frames_.front().charged;
  graveyard_.push_back(std::move(free_frames_.front().frame.owner));
  free_frames_.erase(free_frames_.begin());
  return true;
}

void Pager::discard(PageId id) {
  std::unique_lock<std::mutex> lock(mu_);
  PageEntry& e = table_.at(id);
  // A read in flight may have started before the rewrite: wait for it, then
  // drop what it read.
  cv_.wait(lock, [&] { return e.state != PageState::in_flight; });
  if (e.held() || e.pinned) {
    throw std::logic_error(
        "[Pager::discard] page '" + e.spec.name + "' is held or pinned; release it first");
  }
  if (e.state == PageState::resident) {
    e.prefetched = false;
    evict_locked(lock, id);
  }
  drop_graveyard_unlocked(lock);
}

void Pager::drop_graveyard_unlocked(Lock& lock) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  if (graveyard_.empty()) {
    return;
  }
  // Frames are dropped without the lock: freeing one runs the allocator's
  // on_free, which takes the accounting lock and may run MLX code.
  std::vector<std::shared_ptr<void>> dead;
  dead.swap(graveyard_);
  lock.unlock();
  dead.clear();
  lock.lock();
}

void Pager::make_room_locked(Lock& lock, std::uint64_t need, PageId for_page, bool or_free_frame) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  check_accounting_locked(lock);
  if (need > budget_) {
    throw BudgetError(
        "[Pager::acquire] page '" + table_.at(for_page).spec.name + "' needs " +
        std::to_string(need) + " bytes but the page budget is " + std::to_string(budget_) +
        " bytes: raise the budget to at least " + std::to_string(need + pinned_bytes_locked(lock)) +
        " bytes");
  }
  auto zombie_deadline = std::chrono::steady_clock::time_point::max();
  std::int64_t waited_from = -1;  // the first wait, for the trace
  for (;;) {
    if (or_free_frame && table_.at(for_page).state != PageState::on_disk) {
      // Room for a fault's read, and a wait below let readahead start that
      // very read: it needs no more room (the caller sees the read started
      // and waits for it). Making room on would evict for nothing, or fail
      // with nothing evictable while the read's own charge holds the room.
      return;
    }
    std::uint64_t charged = charged_now();
    if (charged + need <= budget_) {
      if (waited_from >= 0 && trace_.enabled()) {
        TraceEvent te;
        te.kind = TraceKind::reclaim;
        te.page = for_page;
        te.start_ns = waited_from;
        te.end_ns = TraceRecorder::now_ns();
        trace_.record(te);
      }
      return;
    }
    if (or_free_frame &&
        free_frame_for_locked(lock, table_.at(for_page).spec.frame_bytes, need) >= 0) {
      return;  // the read reuses it
    }
    // Kept free frames (none fits) first: dropping one costs no read.
    if (drop_free_frame_locked(lock)) {
      drop_graveyard_unlocked(lock);
      continue;
    }
    auto cands = evictable_locked(lock);
    if (!cands.empty()) {
      evict_locked(lock, cands[choose_victim(policy_, cands)].id);
      drop_graveyard_unlocked(lock);
      continue;
    }
    bool any_in_flight = false;
    bool any_leased = false;  // in use by arrays that release it when freed
    for (PageId id = 0; id < table_.size(); ++id) {
      const PageEntry& o = table_.at(id);
      // A page that has landed for an acquire still waking (waiters) is as
      // good as in flight: in a moment it is that acquire's.
      if (id != for_page &&
          (o.state == PageState::in_flight || (o.state == PageState::resident && o.waiters > 0))) {
        any_in_flight = true;
      }
      any_leased = any_leased || (id != for_page && table_.at(id).leases > 0);
    }
    auto t0 = std::chrono::steady_clock::now();
    if (waited_from < 0) {
      waited_from = TraceRecorder::ns(t0);
    }
    if (any_in_flight) {
      // Reads in flight become evictable pages when they land (or, landed
      // for a waiting acquire, pages it holds and releases).
      cv_.wait_for(lock, kInFlightPoll);
      stat_.reclaim_wait_ns += elapsed_ns(t0);
      continue;
    }
    if (charged > held_bytes_ || any_leased) {
      // Memory of evicted pages that someone still references (an array not
      // yet freed by MLX), or pages leased to arrays MLX still computes
      // with. Either is let go of when the last reference goes; wait a
      // little for that, then give up with a clear message.
      if (zombie_deadline == std::chrono::steady_clock::time_point::max()) {
        zombie_deadline = t0 + kZombieTimeout;
      }
      if (t0 < zombie_deadline) {
        if (any_leased) {
          cv_.wait_for(lock, kZombiePoll);  // release_lease notifies cv_
        } else {
          lock.unlock();
          accounting_->wait_for_free(charged, kZombiePoll);
          lock.lock();
        }
        stat_.reclaim_wait_ns += elapsed_ns(t0);
        continue;
      }
      if (charged <= held_bytes_) {
        throw BudgetError(
            "[Pager::acquire] page '" + table_.at(for_page).spec.name + "' needs " +
            std::to_string(need) + " bytes; the budget is " + std::to_string(budget_) +
            " and every resident page is still in use by arrays viewing it (lazily read "
            "pages, paged_tensor.h): raise the budget");
      }
      throw BudgetError(
          "[Pager::acquire] page '" + table_.at(for_page).spec.name + "' needs " +
          std::to_string(need) + " bytes; the budget is " + std::to_string(budget_) + " and " +
          std::to_string(charged - held_bytes_) +
          " bytes of evicted pages are still referenced outside the pager: "
          "drop the arrays acquire() returned once release() is called");
    }
    throw BudgetError(
        "[Pager::acquire] page '" + table_.at(for_page).spec.name + "' needs " +
        std::to_string(need) + " bytes but only " +
        std::to_string(budget_ - std::min(budget_, charged)) + " of the budget's " +
        std::to_string(budget_) +
        " bytes are free and every resident page is acquired or pinned "
        "(pinned " +
        std::to_string(pinned_bytes_locked(lock)) +
        " bytes): release pages first or raise the budget");
  }
}

}  // namespace mlx_pager
