// thread_name_tests.cpp: the calling thread takes the name it is given, cut
// to the platform's length; the pager's I/O workers carry theirs.
#include <pthread.h>

#include <dirent.h>
#include <chrono>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "check.h"
#include "mm/page_io.h"
#include "mm/thread_name.h"

using namespace mlx_pager;

namespace {

std::string own_name() {
  char buf[64] = {};
  pthread_getname_np(pthread_self(), buf, sizeof(buf));
  return buf;
}

// The names of this process's threads (Linux: /proc/self/task/*/comm).
std::set<std::string> thread_names() {
  std::set<std::string> names;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) {
    return names;
  }
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') {
      continue;
    }
    std::ifstream comm(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(comm, name);
    names.insert(name);
  }
  ::closedir(d);
  return names;
}

}  // namespace

TEST_CASE("thread_name: the calling thread takes its name, cut to 15 characters") {
  std::thread([] {
    name_this_thread("mlxp-test");
    CHECK_EQ(own_name(), std::string("mlxp-test"));
    name_this_thread("mlxp-a-name-longer-than-the-limit");
#if defined(__linux__)
    CHECK_EQ(own_name(), std::string("mlxp-a-name-lon"));
#endif
  }).join();
}

#if defined(__linux__)
TEST_CASE("thread_name: PageIO's workers are named mlxp-io-N") {
  PageIO io(3, 1 << 20);
  std::set<std::string> names;
  for (int tries = 0; tries < 200; ++tries) {
    names = thread_names();
    if (names.count("mlxp-io-0") && names.count("mlxp-io-1") && names.count("mlxp-io-2")) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(names.count("mlxp-io-0") == 1);
  CHECK(names.count("mlxp-io-1") == 1);
  CHECK(names.count("mlxp-io-2") == 1);
}
#endif
