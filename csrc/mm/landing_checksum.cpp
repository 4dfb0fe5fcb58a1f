// landing_checksum.cpp: see landing_checksum.h.
#include "mm/landing_checksum.h"

#include <algorithm>
#include <iterator>

namespace mlx_pager {

LandingChecksum::LandingChecksum(const char* frame, const std::vector<FrameRange>& ranges)
    : frame_(frame) {
  ranges_.reserve(ranges.size());
  for (const FrameRange& r : ranges) {
    ranges_.push_back(Range{r.offset, r.length, 0, std::make_unique<Hasher>()});
  }
}

LandingChecksum::~LandingChecksum() = default;

std::uint64_t LandingChecksum::landed_end(std::uint64_t pos) const {
  auto it = landed_.upper_bound(pos);  // first run starting after pos
  if (it == landed_.begin()) {
    return pos;
  }
  --it;
  return it->second > pos ? it->second : pos;
}

void LandingChecksum::landed(std::uint64_t offset, std::uint64_t length) {
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
  if (hashing_) {
    return;  // the thread hashing picks these bytes up before it stops
  }
  hash_landed(lock);
}

void LandingChecksum::hash_landed(std::unique_lock<std::mutex>& lock) {
  hashing_ = true;
  for (bool more = true; more;) {
    more = false;
    for (Range& r : ranges_) {
      std::uint64_t from = r.offset + r.hashed;
      std::uint64_t to = std::min(landed_end(from), r.offset + r.length);
      if (to <= from) {
        continue;
      }
      // Only this thread touches r.hasher and r.hashed while hashing_.
      lock.unlock();
      r.hasher->update(frame_ + from, to - from);
      lock.lock();
      r.hashed += to - from;
      more = true;
    }
  }
  hashing_ = false;
  cv_.notify_all();
}

std::optional<std::uint64_t> LandingChecksum::finish() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !hashing_; });
  hash_landed(lock);
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
