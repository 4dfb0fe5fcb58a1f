"""The memory governor: keeps the process under its budget while it runs.

The plan (budget.py, placement.py) is a prediction; the governor watches
what the process really uses (resident set size, which is what a cgroup or
the OS charges) after every block and, when it nears the budget, climbs a
ladder of remedies, cheapest first, the way an OS reclaims before it kills:

  1. cache        free MLX's buffer cache (memory MLX keeps for reuse);
  2. graphs       let go of the compiled graphs of input shapes other than
                  the one in use (compiled.py: a shape met again is traced
                  again), and give the heap back;
  3. readahead    stop reading ahead (no new frames for pages not yet due);
  4. page budget  shrink the page budget: evicts pages nobody holds;
  5. (training)   raise MemoryPressure: the step is abandoned and run again
                  with what needs less (loop.py): no compiled graphs held,
                  a shorter no-recompute tail, the batch split into more
                  parts, the blocks uncompiled;
  6. stop         nothing smaller fits: the run saves its adapters and stops,
                  naming the budget that would fit.

Steps whose peak (the kernel's high-water mark) went over the budget
between the governor's samples, inside one block's graph, two in a row,
move the next steps down the ladder (Session.after_step): a placement that needs less, or
the blocks uncompiled; where the plan then needs more than the budget, an
``over`` event names the budget it needs, and the run goes on under the
ladder above.

Every rung taken is recorded (``rungs``: what, when, the RSS) and shown by
``--report`` and ``mlx-pager plot``. ``lower_budget`` lowers the budget of
a running process (the test hook that forces each rung).

It also caps MLX's own buffer cache and memory limit at the start, and
between blocks gives the C heap's free pages back where a graph left many
(heap.py: a Python loop over the tokens builds graph nodes per token, freed
but resident until trimmed, under the next block's buffers).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

from . import heap
from .budget import CACHE_SLACK, BudgetError, MemoryPlan, format_size


def process_rss() -> int:
    """Resident set size of this process, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def outside_mlx(rss: int) -> int:
    """Of a resident set of `rss` bytes, what MLX's buffers do not hold
    (its active and cached bytes): the process's own memory outside MLX."""
    return rss - mx.get_active_memory() - mx.get_cache_memory()


def reset_peak_rss() -> None:
    """Restarts the kernel's count of this process's peak RSS (VmHWM), where
    the OS allows it (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    """The process's peak RSS since it started or since reset_peak_rss: the
    kernel's own high-water mark, which also sees the peaks between the
    governor's samples (inside the tail segment's one graph). Where the OS
    has none, the RSS now."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return process_rss()


def release_heap() -> None:
    """Gives freed memory back to the OS: MLX's buffer cache, and on glibc
    the free heap (heap.trim), e.g. after a swap file was written."""
    mx.clear_cache()
    heap.trim()


class MemoryPressure(BudgetError):
    """The process is over its budget and the page budget cannot shrink
    further: the step in progress must be run with less memory, or the run
    must stop. `over`: bytes over the governor's limit."""

    def __init__(self, message: str, rss: int, over: int):
        super().__init__(message)
        self.rss, self.over = rss, over


@dataclass
class Governor:
    plan: MemoryPlan
    pager: object  # mlx_pager.Pager
    pinned_bytes: int  # charged to the pager outside the page budget
    margin: int = 0
    events: List[str] = field(default_factory=list)  # each rung, in words
    rungs: List[dict] = field(default_factory=list)  # each rung: {"rung", "rss_bytes", ...}
    peak_rss: int = 0
    on_rung: Optional[Callable[[dict], None]] = None  # told of each rung as it is taken
    min_page_budget: int = 0  # the pages the current placement must hold together
    # Lets go of the compiled graphs of shapes not in use (step.Blocks.drop_stale);
    # True where it let go of some.
    drop_stale_graphs: Optional[Callable[[], bool]] = None
    _readahead_off: bool = False
    # The least memory outside MLX's buffers and the page pool seen since the
    # heap was last trimmed (_trim_heap); None before the first check.
    _outside_floor: Optional[int] = None

    def __post_init__(self):
        if self.margin == 0:
            self.margin = self.plan.margin or self.margin_for(self.plan.budget)
        # MLX's cache of freed buffers (session.place raises the limit where
        # the step's own buffers may be cached).
        mx.set_cache_limit(CACHE_SLACK)
        mx.set_memory_limit(int(self.plan.budget))
        self.pager.set_budget(int(self.pinned_bytes + self.plan.page_budget))

    @staticmethod
    def margin_for(budget: int) -> int:
        """What the governor keeps free below the budget."""
        return max(16 << 20, int(budget) // 50)

    @property
    def page_budget(self) -> int:
        """The page budget now (the plan's, less what the governor took)."""
        return int(self.pager.budget - self.pinned_bytes)

    def set_page_budget(self, page_budget: int) -> None:
        self.pager.set_budget(int(self.pinned_bytes + max(0, page_budget)))

    def lower_budget(self, budget: int) -> None:
        """The process's budget is now `budget` (a test hook, or a user who
        needs memory back): the governor acts on it from its next check."""
        self.plan.budget = int(budget)
        self.margin = self.margin_for(budget)
        mx.set_memory_limit(int(budget))
        self._rung("budget", process_rss(), f"budget lowered to {format_size(budget)}")

    def _rung(self, rung: str, rss: int, what: str, **info) -> None:
        rec = {"rung": rung, "rss_bytes": int(rss), "what": what, **info}
        self.rungs.append(rec)
        self.events.append(what)
        if self.on_rung is not None:
            self.on_rung(rec)

    def record(self, rung: str, what: str, **info) -> None:
        """A rung taken by the loop (a new placement, a stop)."""
        self._rung(rung, process_rss(), what, **info)

    def _outside(self, rss: int) -> Tuple[int, bool]:
        """(of `rss`, what neither MLX's buffers nor the pager's page pool
        (mlx_frames.h: pages outside MLX's counts) hold; whether a read is
        in flight: MLX counts its frame whole, resident only as it lands)."""
        stats = getattr(self.pager, "stats", None)
        st = stats() if stats is not None else {}
        return outside_mlx(rss) - st.get("pool_bytes", 0), st.get("in_flight_bytes", 0) > 0

    def _trim_heap(self, rss: int) -> int:
        """Gives the heap back (release_heap: MLX's cache, then heap.trim)
        where the memory outside MLX's buffers grew by more than half the
        margin over the least seen since the last time, and the heap holds
        as much free: what a block's graph left in the heap (heap.py) would
        stack under the next block's buffers, which the plan counts one
        block at a time. The cache goes too: the small buffers it keeps (the
        CPU backend's are the heap's) sit among the graph's freed nodes and
        keep their pages resident (a Qwen3-Next step at 2,048 tokens: the
        heap alone gave back 26-47 MB, with the cache's 51-70 MB 155 MB).

        A frame MLX counts before the pager's read lands in it makes the
        outside memory look lower: the floor is not lowered while a read is
        in flight, or the next check would look grown (the demo did at ~90
        of 163 checks). The free heap is asked too (the demo: 2-4 MB, no
        trims). It stays high once a large graph was freed (glibc's trim
        gives the pages back but keeps the chunks in its free lists), so it
        is a filter for ordinary models, not a measure. A trim costs
        ~0.6 ms a MB given back (~60 ms after a linear-attention block whose
        vjp ran ~2 s) and the cache's buffers made anew; memory that stays
        (Python objects, compiled graphs) becomes the new floor, not trimmed
        for again. Returns the RSS after."""
        outside, reading = self._outside(rss)
        if self._outside_floor is None or (outside < self._outside_floor and not reading):
            self._outside_floor = outside
        elif outside - self._outside_floor > self.margin // 2 and (heap.free() or 0) > self.margin // 2:
            release_heap()
            rss = process_rss()
            self._outside_floor = self._outside(rss)[0]
        return rss

    def check(self) -> None:
        """Call between blocks. Degrades when the process is near its budget;
        raises MemoryPressure when the pages cannot give back enough."""
        rss = process_rss()
        self.peak_rss = max(self.peak_rss, rss)
        rss = self._trim_heap(rss)
        limit = self.plan.budget - self.margin
        if rss <= limit:
            return
        # Evicted pages' frames kept for the next reads, then what the
        # frame allocator keeps for them (the page pool, or one frame:
        # mlx_frames.h), go with MLX's cache.
        drop_free = getattr(self.pager, "drop_free_frames", None)
        if drop_free is not None:
            drop_free()
        drop_kept = getattr(self.pager, "drop_kept_frame", None)
        if drop_kept is not None:
            drop_kept()
        mx.clear_cache()
        rss = process_rss()
        if rss <= limit:
            self._rung("cache", rss, f"cleared MLX cache at {format_size(rss)}")
            return
        if self.drop_stale_graphs is not None and self.drop_stale_graphs():
            gc.collect()  # (what a cycle still holds)
            release_heap()
            after = process_rss()
            self._rung(
                "graphs",
                rss,
                f"process at {format_size(rss)}: let go of the compiled graphs of other shapes "
                f"({format_size(max(0, rss - after))} back)",
            )
            rss = after
            if rss <= limit:
                return
        set_readahead = getattr(self.pager, "set_readahead", None)
        if set_readahead is not None and not self._readahead_off:
            self._readahead_off = True
            if set_readahead(0) > 0:
                self._rung("readahead", rss, f"process at {format_size(rss)}: readahead off")
        over = rss - limit
        page_budget = self.page_budget
        floor = max(self.plan.least_page_budget, self.min_page_budget)
        # Shrink from what the pages use now (a generous budget may be far
        # above it), by what the process is over.
        stats = getattr(self.pager, "stats", None)
        used = page_budget
        if stats is not None:
            st = stats()
            used = min(page_budget, st["resident_bytes"] - st["pinned_bytes"])
        new = max(floor, used - over)
        if new < page_budget:
            self.set_page_budget(new)
            mx.clear_cache()
            self._rung(
                "page_budget",
                rss,
                f"process at {format_size(rss)}: page budget {format_size(page_budget)} -> {format_size(new)}",
            )
            return  # evicted pages are freed as the blocks using them finish
        raise MemoryPressure(
            f"the process uses {format_size(rss)}, over the {format_size(limit)} its --memory-budget of "
            f"{format_size(self.plan.budget)} leaves after the governor's margin, with the page budget at its least. "
            f"Raise --memory-budget to at least {format_size(rss + self.margin + self.plan.max_page, up=True)}, "
            "or lower --batch-size / --max-seq-length.",
            rss,
            over,
        )
