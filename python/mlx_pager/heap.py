"""The process's C heap: what malloc holds outside MLX's buffer counts.

MLX's lazy graph lives there: every op's array node, its primitive, its
shapes and strides are small allocations, freed when the graph has run.
MLX's memory counters (get_active_memory, get_peak_memory) count buffers,
not these. For a block of a few dozen ops they are noise; where mlx-lm runs
a Python loop over the tokens (Mamba's scan; gated delta in training on
every backend, as its Metal kernel has no vjp: Qwen3-Next, Qwen3.5,
Kimi-Linear) the graph has nodes per token, and a block's forward + vjp
graph is as large as its buffers
(measured: a Qwen3-Next linear-attention block on 2,048 tokens, 108 MB of
graph beside 253 MB of MLX's peak; 53 KB a token, at any width).

Freed, those nodes stay in the heap, resident, until it is trimmed. The
next block's large buffers (mapped apart from the heap: serve_large_by_mmap)
then stack on them: a step whose tail (full attention) ran after the
linear-attention blocks' backward peaked 100 MB over the one before it.

Each where the allocator allows it (glibc; macOS's malloc zones;
elsewhere nothing is measured or done):
  in_use()             the heap's bytes in use now: around a graph's
                       construction, what the graph holds (step.py's
                       measures add it to MLX's peak);
  free()               the heap's free bytes: whether a trim has anything
                       to give back;
  trim()               gives the heap's free pages back to the OS (the
                       governor, after a graph left many);
  serve_large_by_mmap  large allocations mapped apart, so that freeing one
                       returns it at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Optional, Tuple


class _Mallinfo2(ctypes.Structure):  # glibc >= 2.33, <malloc.h>
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


class _MallocStatistics(ctypes.Structure):  # macOS, <malloc/malloc.h>
    _fields_ = [
        ("blocks_in_use", ctypes.c_uint),
        ("size_in_use", ctypes.c_size_t),
        ("max_size_in_use", ctypes.c_size_t),
        ("size_allocated", ctypes.c_size_t),
    ]


def _load():
    """(libc, kind): kind "glibc", "darwin" or None (nothing to measure)."""
    try:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL("libc.so.6")
            if hasattr(libc, "mallinfo2"):
                libc.mallinfo2.restype = _Mallinfo2
                return libc, "glibc"
            return libc, None  # (musl, or a glibc before 2.33: trim only)
        if sys.platform == "darwin":
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            libc.malloc_zone_statistics.argtypes = [ctypes.c_void_p, ctypes.POINTER(_MallocStatistics)]
            libc.malloc_zone_statistics.restype = None
            return libc, "darwin"
    except (OSError, AttributeError):
        pass
    return None, None


def _glibc_allocates(libc) -> bool:
    """Whether malloc is glibc's own: another allocator put first (ASan's,
    tcmalloc, jemalloc by LD_PRELOAD) leaves glibc's counts still, and
    they would count nothing."""
    first = ctypes.CDLL(None)  # the process's malloc: the first loaded, as MLX's calls resolve
    first.malloc.restype = ctypes.c_void_p
    first.free.argtypes = [ctypes.c_void_p]
    before = libc.mallinfo2().uordblks
    chunks = [first.malloc(4096) for _ in range(64)]
    grown = libc.mallinfo2().uordblks - before
    for c in chunks:
        first.free(c)
    return grown >= 64 * 4096


_LIBC, _KIND = _load()
if _KIND == "glibc" and not (_glibc_allocates(_LIBC) or _glibc_allocates(_LIBC)):  # (twice: another thread's frees)
    _KIND = None


def _counts() -> Optional[Tuple[int, int]]:
    """(bytes in use, bytes held free), or None where the allocator does
    not say."""
    if _KIND == "glibc":
        info = _LIBC.mallinfo2()
        return int(info.uordblks), int(info.fordblks)
    if _KIND == "darwin":
        stats = _MallocStatistics()
        _LIBC.malloc_zone_statistics(None, ctypes.byref(stats))
        return int(stats.size_in_use), int(stats.size_allocated - stats.size_in_use)
    return None


def in_use() -> Optional[int]:
    """Bytes the heap has handed out and not had back; None where the
    allocator does not say (not glibc's or macOS's, e.g. ASan's). On glibc,
    large allocations mapped apart are not in it (MLX's buffers), once
    serve_large_by_mmap has run, as the trainer and generate do first.
    Costs a walk of the heap's free lists (glibc: ~2 ms after a 100 MB
    graph, microseconds after an ordinary block's)."""
    counts = _counts()
    return None if counts is None else counts[0]


def free() -> Optional[int]:
    """Bytes the heap holds free (glibc: in its free lists, resident or
    not; macOS: what its zones hold beyond what is in use); None where the
    allocator does not say."""
    counts = _counts()
    return None if counts is None else counts[1]


def grown_since(start: Optional[int]) -> int:
    """Heap bytes in use over `start` (an in_use() reading; 0 where there is
    none): taken when a lazy graph is built and not yet run, what it holds."""
    if start is None:
        return 0
    now = in_use()
    return 0 if now is None else max(0, now - start)


def trim() -> None:
    """Returns the heap's free pages to the OS (glibc's malloc_trim: the top
    of each arena and the whole free pages inside it; ~0.6 ms a MB given
    back). Nothing where the allocator has no such call."""
    if _LIBC is None:
        return
    try:
        if sys.platform.startswith("linux"):
            _LIBC.malloc_trim(ctypes.c_size_t(0))
        elif sys.platform == "darwin":
            _LIBC.malloc_zone_pressure_relief(None, ctypes.c_size_t(0))
    except AttributeError:
        pass  # (not glibc)


def serve_large_by_mmap(threshold: int = 256 << 10) -> bool:
    """On glibc, serve allocations over `threshold` with mmap, so that freeing
    one returns it to the OS at once. By default glibc raises this threshold
    each time a large block is freed (up to 32 MB), after which MLX's freed
    activation buffers stay in the heap: the process's RSS (what a cgroup
    charges) grew ~1.8x over MLX's own memory in a measured run. Returns
    True if the setting was applied."""
    if not sys.platform.startswith("linux") or _LIBC is None:
        return False
    M_MMAP_THRESHOLD = -3
    try:
        return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, threshold))
    except AttributeError:
        return False  # not glibc (e.g. musl): nothing to tune
