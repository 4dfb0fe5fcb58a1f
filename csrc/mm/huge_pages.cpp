// huge_pages.cpp: the platform half of huge-page frames (Linux madvise).
#include "mm/huge_pages.h"

#if defined(__linux__)
#include <sys/mman.h>

#include <fstream>
#include <string>
#endif

namespace mlx_pager {

#if defined(__linux__) && defined(MADV_HUGEPAGE)

namespace {

std::uint64_t read_huge_page_bytes() {
  std::ifstream enabled("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes;
  if (!enabled || !std::getline(enabled, modes) || modes.find("[never]") != std::string::npos) {
    return 0;  // no THP in this kernel, or switched off
  }
  std::uint64_t n = 0;
  std::ifstream size("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
  if (!(size >> n) || n == 0 || (n & (n - 1)) != 0) {
    n = 2u << 20;  // older kernels lack the file: x86-64's PMD size
  }
  return n;
}

}  // namespace

std::uint64_t huge_page_bytes() {
  static const std::uint64_t n = read_huge_page_bytes();
  return n;
}

std::uint64_t advise_huge_pages(void* p, std::uint64_t n) {
  const std::uint64_t h = huge_page_bytes();
  if (h == 0 || p == nullptr) {
    return 0;
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t a = (begin + h - 1) & ~(h - 1);
  const std::uintptr_t z = (begin + n) & ~(h - 1);
  if (z <= a) {
    return 0;
  }
  if (::madvise(reinterpret_cast<void*>(a), z - a, MADV_HUGEPAGE) != 0) {
    return 0;  // e.g. EINVAL: a kernel built without transparent huge pages
  }
  return z - a;
}

#else

std::uint64_t huge_page_bytes() {
  return 0;
}

std::uint64_t advise_huge_pages(void*, std::uint64_t) {
  return 0;
}

#endif

}  // namespace mlx_pager
