// smaps.h: what the kernel says about this process's mappings (Linux
// /proc/self/smaps), for tests that check advice given to memory.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace check {

// The VmFlags of the mapping holding `addr`, space-separated with a space
// at both ends ("" where there is none, or no /proc/self/smaps).
inline std::string vm_flags(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  const auto a = reinterpret_cast<std::uintptr_t>(addr);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    // A mapping's first line: "lo-hi perms offset dev inode [path]" (a
    // field line is "Name:   value", its colon before any space).
    if (head >> std::hex >> lo >> dash >> hi && dash == '-' && line.find(':') > line.find(' ')) {
      inside = lo <= a && a < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line.substr(8) + " ";
    }
  }
  return "";
}

// The first `huge`-aligned address at or after `p` (the first whole huge
// page of memory starting at p).
inline const char* first_huge_page(const void* p, std::uint64_t huge) {
  return reinterpret_cast<const char*>(
      (reinterpret_cast<std::uintptr_t>(p) + huge - 1) & ~(huge - 1));
}

// The memory at `addr` is advised MADV_HUGEPAGE ("hg").
inline bool huge_page_advised(const void* addr) {
  return vm_flags(addr).find(" hg ") != std::string::npos;
}

}  // namespace check
