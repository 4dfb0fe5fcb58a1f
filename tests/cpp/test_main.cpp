// test_main.cpp: runs every TEST_CASE (or those whose name contains argv[1]).
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>

#include "check.h"

namespace check {

namespace {
int g_failures = 0;
bool g_case_failed = false;
}  // namespace

std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}

void fail(const char* file, int line, const std::string& what) {
  ++g_failures;
  g_case_failed = true;
  std::cerr << "  FAIL " << file << ":" << line << ": " << what << "\n";
}

std::string temp_dir() {
  static std::string dir = [] {
    const char* base = std::getenv("MLX_PAGER_TEST_DIR");
    auto root = std::filesystem::path(base ? base : "/var/tmp") /
        ("mlx_pager_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(root);
    return root.string();
  }();
  return dir;
}

}  // namespace check

int main(int argc, char** argv) {
  std::string filter = argc > 1 ? argv[1] : "";
  int ran = 0, failed_cases = 0;
  for (auto& c : check::registry()) {
    if (!filter.empty() && std::string(c.name).find(filter) == std::string::npos) {
      continue;
    }
    ++ran;
    check::g_case_failed = false;
    auto t0 = std::chrono::steady_clock::now();
    try {
      c.fn();
    } catch (const check::Abort&) {
    } catch (const std::exception& e) {
      check::fail(__FILE__, __LINE__, std::string("uncaught exception: ") + e.what());
    }
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << (check::g_case_failed ? "[FAIL] " : "[ ok ] ") << c.name << " ("
              << static_cast<int>(ms) << " ms)\n";
    failed_cases += check::g_case_failed;
  }
  std::error_code ec;
  std::filesystem::remove_all(check::temp_dir(), ec);
  std::cerr << ran << " test cases, " << failed_cases << " failed, " << check::g_failures
            << " failed checks\n";
  return (failed_cases == 0 && ran > 0) ? 0 : 1;
}
