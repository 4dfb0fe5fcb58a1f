"""The memory governor: keeps the process under its budget while it trains.

The plan (budget.py) is an estimate; the governor watches what the process
really uses (resident set size, which is what a cgroup or the OS charges)
after every block, and degrades instead of letting the process be killed:

  1. free MLX's buffer cache (memory MLX keeps for reuse);
  2. shrink the page budget: evicts pages nobody holds, and readahead,
     bounded by the page budget, reads less ahead;
  3. if even one block page no longer fits, stop with an error that says how
     much memory the run needs.

It also caps MLX's own buffer cache and memory limit at the start, and
(on glibc) makes freed large buffers go back to the OS at once.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass, field
from typing import List

import mlx.core as mx

from .budget import BudgetError, MemoryPlan, format_size


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def return_freed_memory_to_os(threshold: int = 256 << 10) -> bool:
    """On glibc, serve allocations over `threshold` with mmap, so that freeing
    one returns it to the OS at once. By default glibc raises this threshold
    each time a large block is freed (up to 32 MB), after which MLX's freed
    activation buffers stay in the heap: the process's RSS (what a cgroup
    charges) grew ~1.8x over MLX's own memory in a measured run. Returns
    True if the setting was applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc (e.g. musl): nothing to tune
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def release_heap() -> None:
    """Gives freed memory back to the OS: MLX's buffer cache, and on glibc
    the free heap (malloc_trim), e.g. after a swap file was written."""
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass  # not glibc


@dataclass
class Governor:
    plan: MemoryPlan
    pager: object  # mlx_pager.Pager
    pinned_bytes: int  # charged to the pager outside the page budget
    margin: int = 0
    events: List[str] = field(default_factory=list)
    peak_rss: int = 0

    def __post_init__(self):
        if self.margin == 0:
            self.margin = max(16 << 20, self.plan.budget // 50)
        # MLX's cache of freed buffers: room to recycle a page frame, so that
        # the next read lands in memory already mapped (see the plan's slack).
        mx.set_cache_limit(int(self.plan.slack))
        mx.set_memory_limit(int(self.plan.budget))
        self.pager.set_budget(int(self.pinned_bytes + self.plan.page_budget))

    @property
    def page_budget(self) -> int:
        """The page budget now (the plan's, less what the governor took)."""
        return int(self.pager.budget - self.pinned_bytes)

    def check(self) -> None:
        """Call between blocks. Degrades when the process is near its budget."""
        rss = process_rss()
        self.peak_rss = max(self.peak_rss, rss)
        limit = self.plan.budget - self.margin
        if rss <= limit:
            return
        mx.clear_cache()
        rss = process_rss()
        if rss <= limit:
            self.events.append(f"cleared MLX cache at {format_size(rss)}")
            return
        over = rss - limit
        page_budget = self.pager.budget - self.pinned_bytes
        new = page_budget - over
        if new < self.plan.max_page:
            raise BudgetError(
                f"the process uses {format_size(rss)}, over its --memory-budget of "
                f"{format_size(self.plan.budget)}, and one block page "
                f"({format_size(self.plan.max_page)}) no longer fits beside it. "
                f"Raise --memory-budget to at least {format_size(rss + self.plan.max_page)}, "
                "or lower --batch-size / --max-seq-length."
            )
        self.pager.set_budget(int(self.pinned_bytes + new))
        self.events.append(
            f"process at {format_size(rss)}: page budget {format_size(page_budget)} -> {format_size(new)}"
        )
