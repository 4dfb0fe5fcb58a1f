// landing.cpp: see landing.h.
#include "mm/landing.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <unordered_map>

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
  // A left move (the plan's kind) over exactly one range hashes it: piece by
  // piece, each piece's destination ends before the next piece's source.
  fused_.assign(moves_.size(), -1);
  if (!checked_) {
    return;
  }
  std::unordered_map<std::uint64_t, std::size_t> at;  // a range's offset -> its index
  at.reserve(ranges_.size());
  for (std::size_t k = 0; k < ranges_.size(); ++k) {
    if (ranges_[k].length > 0) {  // an empty tensor shares its offset with the next
      at.emplace(ranges_[k].offset, k);
    }
  }
  for (std::size_t i = 0; i < moves_.size(); ++i) {
    const FrameMove& m = moves_[i];
    auto it = m.to < m.from && m.length > 0 ? at.find(m.from) : at.end();
    if (it == at.end()) {
      continue;
    }
    Range& r = ranges_[it->second];
    if (r.length == m.length && !r.by_move) {
      r.by_move = true;
      fused_[i] = static_cast<int>(it->second);
    }
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

bool Landing::move_ready(std::size_t i) const {
  const FrameMove& m = moves_[i];
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
  // Every checksum range the move reads or writes is hashed (but the one the
  // move hashes itself).
  std::uint64_t lo = std::min(m.from, m.to), hi = std::max(m.from, m.to) + m.length;
  for (std::size_t k = 0; k < ranges_.size(); ++k) {
    const Range& r = ranges_[k];
    if (static_cast<int>(k) != fused_[i] && r.offset < hi && lo < r.offset + r.length &&
        r.hashed != r.length) {
      return false;
    }
  }
  return true;
}

void Landing::apply_move(std::size_t i, std::unique_lock<std::mutex>* lock) {
  const FrameMove& m = moves_[i];
  Range* r = fused_[i] >= 0 ? &ranges_[fused_[i]] : nullptr;
  if (lock != nullptr) {
    lock->unlock();
  }
  if (r == nullptr) {
    std::memmove(frame_ + m.to, frame_ + m.from, m.length);
  } else {
    for (std::uint64_t at = 0; at < m.length; at += kFusedPiece) {
      std::uint64_t n = std::min(kFusedPiece, m.length - at);
      r->hasher->update(frame_ + m.from + at, n);
      std::memmove(frame_ + m.to + at, frame_ + m.from + at, n);
    }
  }
  if (lock != nullptr) {
    lock->lock();
  }
  if (r != nullptr) {
    r->hashed = r->length;
  }
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
      if (r.by_move) {
        continue;  // its move hashes it
      }
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
    while (next_move_ < moves_.size() && move_ready(next_move_)) {
      apply_move(next_move_, &lock);
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
  // in order, as a read would have left them; one that hashes its range
  // hashes it only where all of its source landed.
  for (; next_move_ < moves_.size(); ++next_move_) {
    const FrameMove& m = moves_[next_move_];
    if (fused_[next_move_] >= 0 && !all_landed(m.from, m.from + m.length)) {
      fused_[next_move_] = -1;
    }
    apply_move(next_move_, nullptr);
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
