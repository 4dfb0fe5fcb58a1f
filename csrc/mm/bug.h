// bug.h: run-time checks of the pager's own invariants and preconditions
// (cf. Linux VM_BUG_ON and lockdep_assert_held).
//
// A failed check is a bug in mlx-pager, never a user error: it prints the
// condition with file and line and aborts, so that a sanitizer or a debugger
// shows the stack. Checks are on in debug builds (NDEBUG unset) and in the
// sanitizer builds (CMakeLists.txt defines MLX_PAGER_CHECKS there), and
// compiled out otherwise: the condition is then not evaluated.
// Pager methods named `_locked` check the lock they are given with
// MLX_PAGER_ASSERT_HELD (pager.h states the locking rules).
#pragma once

#include <cstdio>
#include <cstdlib>

#if !defined(NDEBUG) || defined(MLX_PAGER_CHECKS)
#define MLX_PAGER_CHECKS_ON 1
#else
#define MLX_PAGER_CHECKS_ON 0
#endif

namespace mlx_pager::detail {

[[noreturn]] inline void bug(const char* cond, const char* file, int line) {
  std::fprintf(stderr, "[mlx_pager] BUG at %s:%d: %s\n", file, line, cond);
  std::abort();
}

}  // namespace mlx_pager::detail

#if MLX_PAGER_CHECKS_ON
// Aborts when `cond` is false.
#define MLX_PAGER_ASSERT(cond) \
  ((cond) ? (void)0 : ::mlx_pager::detail::bug(#cond, __FILE__, __LINE__))
#else
// Not evaluated (sizeof), but still compiled, so names it uses stay used.
#define MLX_PAGER_ASSERT(cond) ((void)sizeof(cond))
#endif

// Aborts unless `lock` (a std::unique_lock) holds the mutex `mu`.
#define MLX_PAGER_ASSERT_HELD(lock, mu) \
  MLX_PAGER_ASSERT((lock).owns_lock() && (lock).mutex() == &(mu))
