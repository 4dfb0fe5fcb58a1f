// reclaim_tests.cpp: victim choice by policy and priority class.
#include "check.h"
#include "mm/reclaim.h"

using namespace mlx_pager;

TEST_CASE("reclaim: lru evicts the least recently used page") {
  std::vector<Candidate> c = {{0, 0, 5, 1}, {1, 0, 2, 100}, {2, 0, 9, 50}};
  CHECK_EQ(c[choose_victim(Policy::lru, c)].id, 1u);
}

TEST_CASE("reclaim: optimal evicts the page used furthest in the future") {
  std::vector<Candidate> c = {{0, 0, 5, 1}, {1, 0, 2, 3}, {2, 0, 9, 50}};
  CHECK_EQ(c[choose_victim(Policy::optimal, c)].id, 2u);
  c.push_back({3, 0, 7, Schedule::kNever});  // never used again: first out
  CHECK_EQ(c[choose_victim(Policy::optimal, c)].id, 3u);
}

TEST_CASE("reclaim: a lower priority class is always evicted first") {
  std::vector<Candidate> c = {{0, 1, 0, Schedule::kNever}, {1, 0, 99, 1}};
  CHECK_EQ(c[choose_victim(Policy::optimal, c)].id, 1u);
  CHECK_EQ(c[choose_victim(Policy::lru, c)].id, 1u);
}

TEST_CASE("reclaim: policy names parse, and a bad one says what is allowed") {
  CHECK(policy_from_string("lru") == Policy::lru);
  CHECK(policy_from_string("optimal") == Policy::optimal);
  CHECK_THROWS_WITH(policy_from_string("fifo"), "'lru' or 'optimal'");
}
