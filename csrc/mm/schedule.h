// schedule.h: the known future of page accesses.
//
// A training step touches the blocks in an order known in advance (forward
// over the blocks, then backward in reverse), and the next step repeats it.
// The schedule is that order, taken as repeating forever (or, for a finite
// run, ending after one pass). It answers "how many accesses from now until
// page p is used again", which is all that the optimal (Belady MIN) policy
// and safe readahead need.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace mlx_pager {

using PageId = std::uint32_t;

class Schedule {
 public:
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  Schedule() = default;
  // `order`: the page of each access of one cycle; ids below `num_pages`.
  // `repeat`: the order starts over after its end (a training loop); if
  // false, nothing is scheduled after the last access.
  Schedule(std::vector<PageId> order, std::size_t num_pages, bool repeat = true);

  bool empty() const { return order_.empty(); }
  bool repeats() const { return repeat_; }
  std::size_t size() const { return order_.size(); }
  const std::vector<PageId>& order() const { return order_; }
  // Accesses left from `pos` that readahead may look at.
  std::size_t horizon(std::size_t pos) const {
    return repeat_ ? order_.size() : (pos < order_.size() ? order_.size() - pos : 0);
  }
  // The page of access `pos` (wrapping when the schedule repeats).
  PageId at(std::size_t pos) const { return order_[pos % order_.size()]; }

  // Accesses from position `pos` (the next access to happen) until `page` is
  // accessed: 0 if order[pos] == page. kNever if it is not accessed again.
  std::uint64_t next_use(PageId page, std::size_t pos) const;
  // Position of the next access of `page` at or after `pos`; npos if none.
  std::size_t next_position(PageId page, std::size_t pos) const;

 private:
  std::vector<PageId> order_;
  bool repeat_ = true;
  std::vector<std::vector<std::uint32_t>> positions_;  // per page, ascending
};

}  // namespace mlx_pager
