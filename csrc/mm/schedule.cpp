// schedule.cpp: next-use lookups over a repeating access order.
#include "mm/schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mlx_pager {

Schedule::Schedule(std::vector<PageId> order, std::size_t num_pages, bool repeat)
    : order_(std::move(order)), repeat_(repeat), positions_(num_pages) {
  for (std::size_t i = 0; i < order_.size(); ++i) {
    if (order_[i] >= num_pages) {
      throw std::invalid_argument(
          "[Schedule] access " + std::to_string(i) + " names page id " + std::to_string(order_[i]) +
          " but only " + std::to_string(num_pages) + " pages are registered");
    }
    positions_[order_[i]].push_back(static_cast<std::uint32_t>(i));
  }
}

std::uint64_t Schedule::next_use(PageId page, std::size_t pos) const {
  if (order_.empty() || page >= positions_.size() || positions_[page].empty()) {
    return kNever;
  }
  if (repeat_) {
    pos %= order_.size();
  } else if (pos >= order_.size()) {
    return kNever;
  }
  const auto& p = positions_[page];
  auto it = std::lower_bound(p.begin(), p.end(), static_cast<std::uint32_t>(pos));
  if (it != p.end()) {
    return *it - pos;
  }
  return repeat_ ? p.front() + order_.size() - pos : kNever;
}

std::size_t Schedule::next_position(PageId page, std::size_t pos) const {
  std::uint64_t d = next_use(page, pos);
  if (d == kNever) {
    return npos;
  }
  return repeat_ ? (pos + d) % order_.size() : pos + d;
}

}  // namespace mlx_pager
