// thread_name.cpp: the one place that knows how each platform names a thread.
#include "mm/thread_name.h"

#include <cstring>

#if defined(__APPLE__) || defined(__linux__)
#include <pthread.h>
#endif

namespace mlx_pager {

void name_this_thread(const char* name) {
#if defined(__APPLE__)
  pthread_setname_np(name);  // macOS names only the calling thread
#elif defined(__linux__)
  char cut[16] = {};  // the kernel's TASK_COMM_LEN, the terminator included
  std::strncpy(cut, name, sizeof(cut) - 1);
  pthread_setname_np(pthread_self(), cut);
#else
  (void)name;
#endif
}

}  // namespace mlx_pager
