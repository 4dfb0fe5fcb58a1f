// check.h: a minimal test harness (no dependency to install).
//
//   TEST_CASE("pager evicts the page used furthest in the future") { ... }
//   CHECK(cond);            record a failure, keep going
//   REQUIRE(cond);          record a failure, end this test case
//   CHECK_EQ(a, b);         as CHECK, printing both values
//   CHECK_THROWS_WITH(expr, "substring of the message");
//
// Run the binary with a substring to run only matching test cases.
#pragma once

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> fn;
};
std::vector<Case>& registry();
struct Register {
  Register(const char* name, std::function<void()> fn) {
    registry().push_back({name, std::move(fn)});
  }
};
struct Abort {};
void fail(const char* file, int line, const std::string& what);
std::string temp_dir();  // a fresh directory for this process

}  // namespace check

#define CHECK_CAT2(a, b) a##b
#define CHECK_CAT(a, b) CHECK_CAT2(a, b)
#define TEST_CASE(name)                                                                           \
  static void CHECK_CAT(check_case_, __LINE__)();                                                 \
  static check::Register CHECK_CAT(check_reg_, __LINE__)(name, CHECK_CAT(check_case_, __LINE__)); \
  static void CHECK_CAT(check_case_, __LINE__)()

#define CHECK(cond)                           \
  do {                                        \
    if (!(cond))                              \
      check::fail(__FILE__, __LINE__, #cond); \
  } while (0)
#define REQUIRE(cond)                         \
  do {                                        \
    if (!(cond)) {                            \
      check::fail(__FILE__, __LINE__, #cond); \
      throw check::Abort{};                   \
    }                                         \
  } while (0)
#define CHECK_EQ(a, b)                                                         \
  do {                                                                         \
    auto&& check_a_ = (a);                                                     \
    auto&& check_b_ = (b);                                                     \
    if (!(check_a_ == check_b_)) {                                             \
      std::ostringstream check_os_;                                            \
      check_os_ << #a " == " #b " (" << check_a_ << " vs " << check_b_ << ")"; \
      check::fail(__FILE__, __LINE__, check_os_.str());                        \
    }                                                                          \
  } while (0)
#define CHECK_THROWS_WITH(expr, substr)                                                 \
  do {                                                                                  \
    bool check_threw_ = false;                                                          \
    try {                                                                               \
      (void)(expr);                                                                     \
    } catch (const std::exception& check_e_) {                                          \
      check_threw_ = true;                                                              \
      if (std::string(check_e_.what()).find(substr) == std::string::npos)               \
        check::fail(                                                                    \
            __FILE__, __LINE__,                                                         \
            std::string("message '") + check_e_.what() + "' lacks '" + (substr) + "'"); \
    }                                                                                   \
    if (!check_threw_)                                                                  \
      check::fail(__FILE__, __LINE__, #expr " did not throw");                          \
  } while (0)
