// mlock.h: keeping pinned pages in RAM (the unevictable list).
//
// Pinned pages are never evicted by the pager; locking them also stops the OS
// from swapping them out. Locking is best effort: it fails without privilege
// or past RLIMIT_MEMLOCK, and on some backends the memory is not ours to lock.
// The result is reported (Pager counters), and a failure never fails a pin.
#pragma once

#include <cstddef>

namespace mlx_pager {

// Locks [addr, addr + n) into RAM. Returns true when the OS locked it.
bool lock_memory(const void* addr, std::size_t n);
// Unlocks a range locked with lock_memory. Safe to call on any range.
void unlock_memory(const void* addr, std::size_t n);

}  // namespace mlx_pager
