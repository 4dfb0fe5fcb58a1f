// mlock.cpp: the platform half of pinning (POSIX mlock on Linux and macOS).
#include "mm/mlock.h"

#include <sys/mman.h>

namespace mlx_pager {

bool lock_memory(const void* addr, std::size_t n) {
  if (addr == nullptr || n == 0) {
    return false;
  }
  return ::mlock(addr, n) == 0;
}

void unlock_memory(const void* addr, std::size_t n) {
  if (addr != nullptr && n > 0) {
    (void)::munlock(addr, n);
  }
}

}  // namespace mlx_pager
