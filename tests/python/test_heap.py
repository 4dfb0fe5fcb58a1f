"""The C heap (heap.py): a lazy graph's nodes are counted where they live,
and freed heap goes back to the OS when trimmed."""

import ctypes
import sys

import mlx.core as mx
import pytest

from mlx_pager import heap
from mlx_pager.governor import process_rss

glibc_only = pytest.mark.skipif(heap.in_use() is None or not sys.platform.startswith("linux"), reason="glibc's heap")


def test_mallopt_applies_on_glibc():
    assert heap.serve_large_by_mmap() == sys.platform.startswith("linux")


@glibc_only
def test_a_built_graph_is_in_the_heap_until_it_runs():
    """A chain of 20,000 lazy adds (what a Python loop over tokens builds)
    holds its nodes in the heap, not in MLX's counters, until it is run."""
    x = mx.zeros((4,))
    mx.eval(x)
    start, active = heap.in_use(), mx.get_active_memory()
    for _ in range(20_000):
        x = x + 1
    built = heap.grown_since(start)
    assert built > 20_000 * 100, built  # at least 100 bytes a node
    assert mx.get_active_memory() - active < built // 10  # MLX counts buffers, not nodes
    mx.eval(x)
    assert x.tolist() == [20_000.0] * 4
    del x
    assert heap.grown_since(start) < built // 10


def fragmented_free_heap(mb: int):
    """`mb` MB of 1 KB allocations, written to (resident), then freed but
    one in 256: free heap among live allocations (a graph's nodes among the
    buffers that outlive it), which free() alone does not give back (it
    trims only the heap's top). Returns the kept allocations."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(1024) for _ in range(mb * 1024)]
    for c in chunks:
        ctypes.memset(c, 1, 1024)
    for i, c in enumerate(chunks):
        if i % 256:
            libc.free(c)
    return chunks[::256]


def free_all(kept):
    libc = ctypes.CDLL("libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    for c in kept:
        libc.free(c)


@glibc_only
def test_trim_gives_the_free_heap_back():
    heap.trim()
    before = process_rss()
    kept = fragmented_free_heap(64)
    held = process_rss()
    assert held - before > 32 << 20, (before, held)  # resident though free
    assert heap.free() > 32 << 20
    heap.trim()
    assert held - process_rss() > 32 << 20
    free_all(kept)
