// schedule_tests.cpp: next-use distances over a repeating order.
#include "check.h"
#include "mm/schedule.h"

using namespace mlx_pager;

TEST_CASE("schedule: next use counts forward and wraps around") {
  // forward 0,1,2 then backward 2,1,0
  Schedule s({0, 1, 2, 2, 1, 0}, 4);
  CHECK_EQ(s.next_use(0, 0), 0u);
  CHECK_EQ(s.next_use(0, 1), 4u);
  CHECK_EQ(s.next_use(2, 4), 4u);  // wraps into the next step
  CHECK_EQ(s.next_use(1, 5), 2u);
  CHECK(s.next_use(3, 0) == Schedule::kNever);  // never scheduled
  CHECK_EQ(s.next_position(1, 2), 4u);
  CHECK_EQ(s.next_position(0, 5), 5u);
}

TEST_CASE("schedule: an access to an unknown page is rejected") {
  CHECK_THROWS_WITH(Schedule({0, 5}, 3), "page id 5");
}
