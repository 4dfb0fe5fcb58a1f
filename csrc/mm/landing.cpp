// landing.cpp: see landing.h.
#include "mm/landing.h"

#include <algorithm>
#include <cstring>
#include <iterator>

namespace mlx_pager {

Landing::Landing(
    char* frame,
    std::vector<FrameRange> reads,
    std::vector<FrameMove> moves,
    const std::vector<FrameRange>& ranges,
    bool checked)
    : frame_(frame), reads_(std::move(reads)), moves_(std::move(moves)), checked_(checked) {
  ranges_.reserve(ranges.size());
  for (const FrameRange& r : ranges) {
    ranges_.push_back(Range{r.offset, r.length, 0, std::make_unique<Hasher>()});
  }
}

Landing::~Landing() = default;

std::uint64_t Landing::landed_end(std::uint64_t pos) const {
  auto it = landed_.upper_bound(pos);  // first run starting after pos
  if (it == landed_.begin()) {
    return pos;
  }
  --it;
  return it->second > pos ? it->second : pos;
}

bool Landing::all_landed(std::uint64_t begin, std::uint64_t end) const {
  return begin >= end || landed_end(begin) >= end;
}

bool Landing::move_ready(const FrameMove& m) const {
  if (!all_landed(m.from, m.from + m.length)) {
    return false;
  }
  // The bytes the read fills under the destination have landed.
  for (const FrameRange& r : reads_) {
    std::uint64_t b = std::max(m.to, r.offset), e = std::min(m.to + m.length, r.offset + r.length);
    if (b < e && !all_landed(b, e)) {
      return false;
    }
  }
  // Every checksum range the move reads or writes is hashed.
  std::uint64_t lo = std::min(m.from, m.to), hi = std::max(m.from, m.to) + m.length;
  for (const Range& r : ranges_) {
    if (r.offset < hi && lo < r.offset + r.length && r.hashed != r.length) {
      return false;
    }
  }
  return true;
}

void Landing::landed(std::uint64_t offset, std::uint64_t length) {
  std::unique_lock<std::mutex> lock(mu_);
  if (length > 0) {
    std::uint64_t start = offset, end = offset + length;
    // Merge with the runs it touches.
    auto it = landed_.upper_bound(start);
    if (it != landed_.begin()) {
      auto prev = std::prev(it);
      if (prev->second >= start) {
        start = prev->first;
        end = std::max(end, prev->second);
        it = landed_.erase(prev);
      }
    }
    while (it != landed_.end() && it->first <= end) {
      end = std::max(end, it->second);
      it = landed_.erase(it);
    }
    landed_[start] = end;
  }
  if (working_) {
    return;  // the thread at work picks these bytes up before it stops
  }
  work(lock);
  if (next_move_ > moved_early_) {
    moved_early_ = next_move_;
  }
}

void Landing::work(std::unique_lock<std::mutex>& lock) {
  working_ = true;
  for (bool more = true; more;) {
    more = false;
    for (Range& r : ranges_) {
      std::uint64_t from = r.offset + r.hashed;
      std::uint64_t to = std::min(landed_end(from), r.offset + r.length);
      if (to <= from) {
        continue;
      }
      // Only the working thread touches ranges, moves and the frame's
      // landed bytes; landed() calls meanwhile only add runs.
      lock.unlock();
      r.hasher->update(frame_ + from, to - from);
      lock.lock();
      r.hashed += to - from;
      more = true;
    }
    while (next_move_ < moves_.size() && move_ready(moves_[next_move_])) {
      const FrameMove& m = moves_[next_move_];
      lock.unlock();
      std::memmove(frame_ + m.to, frame_ + m.from, m.length);
      lock.lock();
      ++next_move_;
      more = true;
    }
  }
  working_ = false;
  cv_.notify_all();
}

std::optional<std::uint64_t> Landing::finish() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !working_; });
  work(lock);
  // Nothing more lands: the moves left (after a failed chunk) run anyway,
  // in order, as a read would have left them.
  for (; next_move_ < moves_.size(); ++next_move_) {
    const FrameMove& m = moves_[next_move_];
    std::memmove(frame_ + m.to, frame_ + m.from, m.length);
  }
  if (!checked_) {
    return std::nullopt;
  }
  std::vector<std::uint64_t> digests;
  digests.reserve(ranges_.size());
  for (const Range& r : ranges_) {
    if (r.hashed != r.length) {
      return std::nullopt;
    }
    digests.push_back(r.hasher->digest());
  }
  return combine_digests(digests);
}

}  // namespace mlx_pager
