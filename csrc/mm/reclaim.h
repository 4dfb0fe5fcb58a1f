// reclaim.h: choosing which page to evict (cf. Linux mm/vmscan.c).
//
// Eviction is needed when a read must start and the budget is spent. Among
// the evictable pages (resident, not acquired, not pinned) a policy picks the
// victim. Priority classes come first: a page of a lower class is always
// evicted before one of a higher class; within a class the policy decides:
//  - lru:     the least recently used page (the seed's policy);
//  - optimal: the page whose next use is furthest in the future (Belady's
//             MIN, computable because the step's access order is known);
//             pages never used again go first, ties go to LRU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mm/schedule.h"

namespace mlx_pager {

enum class Policy { lru, optimal };
const char* to_string(Policy p);
// Parses "lru" or "optimal"; throws std::invalid_argument naming the choices.
Policy policy_from_string(const std::string& s);

// What a policy sees of an evictable page.
struct Candidate {
  PageId id = 0;
  int priority = 0;
  std::uint64_t last_access = 0;              // larger = more recent
  std::uint64_t next_use = Schedule::kNever;  // accesses until used again
};

// Index into `candidates` of the page to evict (candidates must be non-empty).
std::size_t choose_victim(Policy policy, const std::vector<Candidate>& candidates);

}  // namespace mlx_pager
