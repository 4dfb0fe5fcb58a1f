// readahead.cpp: reading the schedule's next pages before they are asked for
// (cf. Linux mm/readahead.c and swap_state.c's swap-in readahead).
//
// After every acquire and release, the pager looks at the next
// `readahead_pages` distinct pages of the schedule. For each one on disk,
// in order of need, it starts a background read if the budget has room, or
// if it can evict a page that is needed LATER than the one it reads (the
// Belady-safe rule: readahead never throws out a page that will be wanted
// first). The victim is the one MIN would pick among all pages in memory; when
// that is a page still in use, readahead waits for its release instead of
// evicting another, so readahead adds no reads over the optimal count on the
// step's schedule. It stops at the first page it cannot start: later pages
// are needed later still.
//
// Readahead also stops when the budget is full of memory the pager has let
// go of but an array still views (an evicted page that MLX's stream still
// computes with). That memory is freed on whichever thread drops the view,
// where the pager cannot run; so the pager's readahead thread waits for the
// charge to drop below what readahead saw and runs it again. The next read
// then starts as soon as compute lets go of a page, not at the next acquire.
//
// That conservative rule can serialise reads and compute when the budget is
// small: MIN streams the pages it does not keep through ONE slot, so the
// next page's read cannot start before the current page is released. In
// aggressive mode readahead then evicts the next-best page instead (one not
// needed before the page it reads): more reads than MIN, more overlap.
#include <algorithm>
#include <limits>
#include <queue>
#include <utility>

#include "mm/bug.h"
#include "mm/pager.h"
#include "mm/thread_name.h"

namespace mlx_pager {

bool Pager::set_readahead_aggressive(bool on) {
  bool old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::exchange(readahead_aggressive_, on);
  }
  readahead();
  return old;
}

int Pager::readahead_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return readahead_pages_;
}

bool Pager::readahead_aggressive() const {
  std::lock_guard<std::mutex> lock(mu_);
  return readahead_aggressive_;
}

void Pager::readahead() {
  std::unique_lock<std::mutex> lock(mu_);
  if (readahead_pages_ <= 0 || schedule_.empty()) {
    return;
  }
  int seen = 0;
  std::vector<bool> visited(table_.size(), false);
  std::size_t from = cursor_;
  for (std::size_t k = 0; k < schedule_.horizon(from) && seen < readahead_pages_; ++k) {
    if (cursor_ != from) {
      // An acquire moved the cursor while a read was being started (the
      // lock is dropped to submit): look again from there. Going on at
      // cursor_ + k would skip the pages the cursor moved by (the next
      // page, typically: read then as a fault).
      from = cursor_;
      k = 0;
      seen = 0;
      std::fill(visited.begin(), visited.end(), false);
      if (schedule_.horizon(from) == 0) {
        break;
      }
    }
    PageId id = schedule_.at(from + k);
    if (visited[id]) {
      continue;
    }
    visited[id] = true;
    ++seen;
    const PageEntry& e = table_.at(id);
    if (e.state != PageState::on_disk) {
      continue;
    }
    if (!readahead_one_locked(lock, id)) {
      break;
    }
  }
}

void Pager::readahead_on_free() {
  name_this_thread("mlxp-readahead");
  Accounting& a = *accounting_;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(a.mu);
      a.cv.wait(lock, [&] {
        return a.stop || a.kick || (a.wake_below > 0 && a.charged.load() < a.wake_below);
      });
      if (a.stop) {
        return;
      }
      a.wake_below = 0;
      a.kick = false;
    }
    try {
      readahead();
    } catch (...) {
      // Readahead is best effort: the acquire that needs the page reads it
      // itself and reports what failed.
    }
  }
}

bool Pager::wait_off_disk(PageId id, const std::atomic<bool>& done) {
  std::unique_lock<std::mutex> lock(mu_);
  const PageEntry& e = table_.at(id);
  for (;;) {
    if (e.state != PageState::on_disk) {
      return true;
    }
    if (done.load()) {
      return false;
    }
    cv_.wait_for(lock, kDonePoll);
  }
}

bool Pager::readahead_one_locked(Lock& lock, PageId id) {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  PageEntry& e = table_.at(id);
  std::uint64_t need = allocator_->footprint(e.spec.frame_bytes);
  if (need > budget_) {
    return false;
  }
  std::uint64_t when = schedule_.next_use(id, cursor_);
  for (;;) {
    if (e.state != PageState::on_disk) {
      return true;  // someone else started it while the lock was dropped
    }
    // Room a fault is making for its own read is taken (fault.cpp).
    std::uint64_t charged = charged_now();
    if (charged + fault_room_ + need <= budget_ ||
        (fault_room_ == 0 && free_frame_for_locked(lock, e.spec.frame_bytes, need) >= 0)) {
      // Started (it may have landed, or failed, before this returns), or
      // started by another thread meanwhile: go on to the next page. Not
      // started and still on disk: the frame did not fit.
      return start_read_locked(lock, id, /*urgent=*/false) != 0 || e.state != PageState::on_disk;
    }
    if (drop_free_frame_locked(lock)) {
      drop_graveyard_unlocked(lock);  // free memory: dropping it costs no read
      continue;
    }
    if (charged > held_bytes_) {
      // Evicted memory not yet freed: do not wait here; the readahead
      // thread runs this again once some of it is.
      accounting_->wake_readahead_below(charged);
      return false;
    }
    // Evict only what MIN would evict when this page is accessed. MIN
    // decides then, among every page in memory (including pages in use or in
    // flight), by next use AFTER that access. If its choice cannot be evicted
    // now (in use, in flight, or still needed before this page), wait:
    // readahead runs again on every acquire and release.
    auto cands = evictable_locked(lock);
    std::size_t evictable = cands.size();
    if (policy_ == Policy::optimal) {
      for (PageId other = 0; other < table_.size(); ++other) {
        const PageEntry& o = table_.at(other);
        bool busy = o.state == PageState::in_flight || (o.state == PageState::resident && o.held());
        if (busy && !o.pinned && other != id) {
          cands.push_back(Candidate{other, o.spec.priority, o.last_access, 0});
        }
      }
      std::size_t after = cursor_ + static_cast<std::size_t>(when) + 1;
      for (Candidate& c : cands) {
        c.next_use = schedule_.next_use(c.id, after);
      }
    }
    if (cands.empty()) {
      return false;
    }
    std::size_t pick = choose_victim(policy_, cands);
    if (pick >= evictable || schedule_.next_use(cands[pick].id, cursor_) <= when) {
      // MIN's choice is busy, or needed no later than this page. The idle
      // pages not needed before it:
      std::vector<Candidate> idle;
      for (std::size_t c = 0; c < evictable; ++c) {
        if (schedule_.next_use(cands[c].id, cursor_) > when) {
          idle.push_back(cands[c]);
        }
      }
      if (readahead_aggressive_) {
        // Aggressive mode: the best of them. It may cost a read MIN would
        // not make, and buys overlap when the budget is small.
        if (idle.empty()) {
          return false;
        }
        evict_locked(lock, idle[choose_victim(policy_, idle)].id);
        drop_graveyard_unlocked(lock);
        continue;
      }
      // Conservative: one that MIN evicts before its next use anyway can go
      // instead: its read is one MIN makes too, and this read need not
      // wait. (A block read in parts: the parts of the block in use are
      // MIN's choices, the previous block's idle parts go before their next
      // use all the same.) Else wait.
      bool evicted = false;
      for (int tries = 0; policy_ == Policy::optimal && tries < kIdleVictimTries && !idle.empty();
           ++tries) {
        std::size_t i = choose_victim(policy_, idle);
        if (min_evicts_before_next_use_locked(lock, idle[i].id)) {
          evict_locked(lock, idle[i].id);
          ++stat_.readahead_idle_evictions;
          evicted = true;
          break;
        }
        idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (!evicted) {
        return false;
      }
      drop_graveyard_unlocked(lock);
      continue;
    }
    evict_locked(lock, cands[pick].id);
    drop_graveyard_unlocked(lock);
  }
}

bool Pager::min_evicts_before_next_use_locked(const Lock& lock, PageId q) const {
  MLX_PAGER_ASSERT_HELD(lock, mu_);
  std::uint64_t until = schedule_.next_use(q, cursor_);
  if (until == Schedule::kNever) {
    return true;  // never used again: no read to save
  }
  // MIN over the schedule from the cursor: the pages charged now (any state
  // but on disk), each access of a page not among them evicting, until it
  // fits, the page used furthest ahead (lower priority first; ties to the
  // lower id), pinned pages never. The candidates sit in a heap by their
  // next access (an absolute position; entries go stale when their page is
  // accessed or evicted): O(accesses x log pages) for the whole run.
  constexpr std::uint64_t kFar = std::numeric_limits<std::uint64_t>::max();
  auto next_at = [&](PageId id, std::size_t pos) {  // id's next access at or after pos
    std::uint64_t d = schedule_.next_use(id, pos);
    return d == Schedule::kNever ? kFar : static_cast<std::uint64_t>(pos) + d;
  };
  struct Entry {
    int priority;
    std::uint64_t next;
    PageId id;
  };
  auto later = [](const Entry& a, const Entry& b) {  // a is evicted after b
    if (a.priority != b.priority) {
      return a.priority > b.priority;
    }
    if (a.next != b.next) {
      return a.next < b.next;
    }
    return a.id > b.id;
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(later)> heap(later);
  std::vector<std::uint64_t> charge(table_.size(), 0);  // 0: not in MIN's memory
  std::vector<std::uint64_t> next(table_.size(), 0);
  std::uint64_t used = 0;
  auto admit = [&](PageId id, std::size_t pos) {
    const PageEntry& e = table_.at(id);
    if (!e.pinned) {
      next[id] = next_at(id, pos);
      heap.push(Entry{e.spec.priority, next[id], id});
    }
  };
  for (PageId id = 0; id < table_.size(); ++id) {
    const PageEntry& e = table_.at(id);
    if (e.state != PageState::on_disk) {
      charge[id] = std::max<std::uint64_t>(
          1, e.charged != 0 ? e.charged : allocator_->footprint(e.spec.frame_bytes));
      used += charge[id];
      admit(id, cursor_);
    }
  }
  for (std::uint64_t k = 0; k < until; ++k) {
    std::size_t pos = cursor_ + static_cast<std::size_t>(k);
    PageId p = schedule_.at(pos);
    if (charge[p] != 0) {
      admit(p, pos + 1);  // a hit: its next access moves on
      continue;
    }
    std::uint64_t need =
        std::max<std::uint64_t>(1, allocator_->footprint(table_.at(p).spec.frame_bytes));
    while (used + need > budget_) {
      while (!heap.empty() &&
             (charge[heap.top().id] == 0 || heap.top().next != next[heap.top().id])) {
        heap.pop();  // stale
      }
      if (heap.empty()) {
        return false;  // nothing MIN could evict: it keeps q
      }
      PageId v = heap.top().id;
      heap.pop();
      if (v == q) {
        return true;
      }
      used -= charge[v];
      charge[v] = 0;
    }
    charge[p] = need;
    used += need;
    admit(p, pos + 1);
  }
  return false;
}

}  // namespace mlx_pager
