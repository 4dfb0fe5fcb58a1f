"""Predicting a paged step's time.

A training step uses the blocks' pages in an order known in advance (the
schedule: forward, then backward), holding each while it computes. How long
the step takes depends on which pages the budget keeps, on when readahead
starts each read, and on how reads and compute overlap. ``simulate`` replays
the pager's own decisions, rule for rule, against a model of the disk and of
the step's compute, and returns the step time, I/O wait and bytes read in
steady state (several steps, so that reads started across the step boundary,
during the head, the optimizer update and the next embedding, count):

  the pager    csrc/mm: the fault path (fault.cpp: acquire, release, the
               cursor), reclaim (reclaim.cpp: make_room, choose_victim with
               priorities, MIN or LRU, ties to the least recently used) and
               readahead (readahead.cpp: the next `readahead` distinct pages
               of the schedule; in conservative mode MIN's victim, else an
               idle page MIN evicts before its next use anyway, else a wait;
               the next-best victim in aggressive mode; never into the room
               a fault is making, nor the page an acquire waits for: here
               readahead runs only on the training thread, between them).
               Pinned pages are outside the page budget and not modelled.
  the disk     page_io.cpp: a read is split into chunks; `threads` I/O
               threads take chunks in order, demand reads before readahead,
               and share the device's rate (R, measured at the pager's own
               I/O shape: read_rate_for_session, benchlib.read_rate): while
               any chunk is being read the device gives `rate` bytes/s.
  the compute  one Access per bound group of pages: `gap_s` of compute with
               no page held (the head, the optimizer update), then its pages
               acquired in order, `hold_s` of compute, released in reverse;
               a lazy read's page (`overlaps`) is acquired before the page
               of the access before it is released, as MLX reaches it.

``best_settings`` is the simulator's best over the policy space (readahead
depth, conservative or aggressive); ``choose_readahead`` is the pager's own
cheap choice (a few depths), which ``tune_readahead`` applies to a running
pager from a measured step. ``min_pages_per_step`` is MIN's read count, the
bound every policy is measured against.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# Page states (page_table.h).
ON_DISK, IN_FLIGHT, RESIDENT = 0, 1, 2
NEVER = (1 << 64) - 1  # Schedule::kNever
DEFAULT_CHUNK_BYTES = 8 << 20  # kDefaultIoChunkBytes (page_io.h)
MODES = ("conservative", "aggressive")
# Bytes read may exceed MIN's by this fraction where a policy reads more to
# overlap (the automatic choice's default cap).
DEFAULT_EXTRA_READS = 0.10
IDLE_VICTIM_TRIES = 2  # Pager::kIdleVictimTries


class SimBudgetError(MemoryError):
    """The simulated pager could not fit a page (the pager's BudgetError)."""


@dataclass
class Access:
    """One use of pages by the training thread (a `weights.bound(...)`)."""

    pages: Tuple[int, ...]  # acquired in this order, released in reverse
    hold_s: float = 0.0  # compute while they are held
    gap_s: float = 0.0  # compute before they are acquired, with no page held
    # Acquired while the access before still holds its pages, which go only
    # once these are in: the next lazy read of one graph (stream.py, a
    # forward block read in parts). MLX reaches a lazy read before the ops
    # using the page before it have finished, so a fault there makes room
    # around that page, not with it (seen in traces: a forward part's fault
    # evicting a tail page while the part before was still held). Where the
    # budget has no room beside that page, it goes first (the read waits
    # for it, as the pager's acquire waits for room).
    overlaps: bool = False


@dataclass(frozen=True)
class Settings:
    """The pager's policy settings (PagerConfig)."""

    readahead: int = 2
    mode: str = "conservative"
    policy: str = "optimal"

    def label(self) -> str:
        if self.readahead == 0:
            return f"{self.policy}, no readahead"
        return f"{self.policy}, readahead {self.readahead} {self.mode}"


@dataclass
class Disk:
    rate: float  # bytes/s while any read is under way
    threads: int = 4
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


@dataclass
class Read:
    page: int
    urgent: bool  # a fault's read (else readahead's)
    submitted: float
    done: float = -1.0


@dataclass
class Prediction:
    settings: Settings
    step_s: float  # mean over the measured steps
    io_wait_s: float  # per step: acquires waiting for reads
    reclaim_wait_s: float  # per step: faults waiting for room
    bytes_read: float  # per step
    pages_read: float  # per step
    steps: List[dict] = field(default_factory=list)  # every simulated step
    reads: List[Read] = field(default_factory=list)  # every read, in submission order
    counters: Dict[str, int] = field(default_factory=dict)  # as the pager's stats


# ------------------------------------------------------------------ MIN ----
def min_reads_by_step(order: Sequence[int], footprints, budget, steps: int, weights=None) -> List[float]:
    """Pages Belady's MIN reads in each of `steps` repetitions of `order`
    (the page of each access of one step), pages charged their own
    footprints against a byte budget (evict the furthest next use until the
    page fits), as the pager charges them. Pages not used again are evicted
    first, as the pager's cyclic schedule never says "never"; the last step
    sees no future beyond itself. `weights`: each page's read counts its
    weight instead of 1 (its read bytes: the bytes of the pages MIN reads).
    `budget`: bytes, or one per step (the plan may move it between steps;
    the last holds for the steps after): where it shrinks, MIN evicts the
    furthest next uses first; where it grows, the room fills as MIN reads."""
    budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget]
    seq = list(order) * steps
    nxt, last = [0] * len(seq), {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], 10**9 + t)
        last[seq[t]] = t
    cache, used, per = {}, 0, [0] * steps
    S = max(1, len(order))
    for t, pg in enumerate(seq):
        cap = budgets[min(t // S, len(budgets) - 1)]
        if pg not in cache:
            per[t // S] += 1 if weights is None else weights[pg]
            while cache and used + footprints[pg] > cap:
                victim = max(cache, key=cache.get)
                used -= footprints[victim]
                del cache[victim]
            used += footprints[pg]
        else:
            while used > cap and len(cache) > 1:  # the budget shrank: room, keeping the page in use
                victim = max((p for p in cache if p != pg), key=cache.get)
                used -= footprints[victim]
                del cache[victim]
        cache[pg] = nxt[t]
    return per


def min_pages_per_step(accesses: Sequence[Access], footprints, budget, steps: int = 6, warmup: int = 2) -> float:
    """MIN's pages read per step for a step of `accesses`, averaged over the
    steps a simulation of `steps` steps measures (after `warmup`), with two
    more steps of future (on a cyclic order MIN's reads can alternate from
    step to step, so one step's difference is not its mean)."""
    return _min_per_step(accesses, footprints, budget, steps, warmup)


def _min_per_step(accesses, footprints, budget, steps: int, warmup: int, weights=None) -> float:
    """min_reads_by_step's mean over the measured steps (after `warmup`, with
    two more steps of future), reads counted 1 each or by `weights`."""
    order = [p for a in accesses for p in a.pages]
    per = min_reads_by_step(order, footprints, budget, steps + 2, weights)[min(warmup, steps - 1) : steps]
    return sum(per) / len(per)


# ------------------------------------------------------------ the pager ----
class _Cand:
    __slots__ = ("id", "priority", "last_access", "next_use")

    def __init__(self, id, priority, last_access, next_use):
        self.id, self.priority, self.last_access, self.next_use = id, priority, last_access, next_use


def _choose_victim(optimal: bool, cands: List[_Cand]) -> int:
    """reclaim.cpp's choose_victim: lower priority first, then (optimal) the
    furthest next use, then the least recently used; ties keep the first."""
    best = 0
    for i in range(1, len(cands)):
        a, b = cands[i], cands[best]
        if a.priority != b.priority:
            before = a.priority < b.priority
        elif optimal and a.next_use != b.next_use:
            before = a.next_use > b.next_use
        else:
            before = a.last_access < b.last_access
        if before:
            best = i
    return best


_TABLES: Dict[tuple, list] = {}  # _next_use_table's last two, by (order, n)
TABLE_MAX_ENTRIES = 1 << 20  # 8 MB of table at most; past it, bisect


def _next_use_table(order: Sequence[int], n: int) -> Optional[list]:
    """schedule.cpp's next use, tabled: for each page, the distance from
    each position of the cyclic `order` to the page's next use there or
    after (0 at a use; wrapping to the next cycle), or None for a page the
    order never uses. O(pages x positions) once, then O(1) a query: the
    automatic readahead choice for a 64-block model in 4 parts a block took
    13.5 s with it, 16.0 s bisecting each query (2-vCPU AMD EPYC). The choice
    simulates one order a dozen times: the last two tables are kept. None
    where a table would pass TABLE_MAX_ENTRIES (the simulator runs inside
    the training's memory budget): the caller bisects."""
    S = len(order)
    if n * S > TABLE_MAX_ENTRIES:
        return None
    key = (tuple(order), n)
    table = _TABLES.get(key)
    if table is not None:
        return table
    firsts: Dict[int, int] = {}
    for i, p in enumerate(order):
        firsts.setdefault(p, i)
    table = [None] * n
    for p, first in firsts.items():
        row = [0] * S
        nxt = first + S  # the next use after the last position: the next cycle's first
        for i in range(S - 1, -1, -1):
            if order[i] == p:
                nxt = i
            row[i] = nxt - i
        table[p] = array("q", row)
    if len(_TABLES) >= 2:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = table
    return table


_MIN_MEMOS: Dict[tuple, dict] = {}  # _Sim's MIN answers, the last by (order, footprints, budget, priorities)
MIN_MEMO_MAX_ENTRIES = 1 << 14  # ~4 MB at most (the simulator runs inside the training's budget)


def _min_memo(order, footprints, budget, priorities) -> dict:
    """A memo of min_evicts_before_next_use's answers, shared by every
    simulation of one schedule under one budget: the automatic choice
    simulates a dozen settings whose states meet (a 64-block model in 4
    parts a block: 7759 MIN runs, 1773 once shared; 9.1 s against 6.2).
    choose_readahead lets it go when it returns."""
    key = (tuple(order), tuple(footprints), budget, tuple(priorities))
    memo = _MIN_MEMOS.get(key)
    if memo is None:
        _MIN_MEMOS.clear()
        memo = _MIN_MEMOS[key] = {}
    return memo


class _Bisected:
    """One page's next uses where the order is too long to table: what
    _next_use_table's row gives at a position, by bisecting the page's
    positions (sorted, not empty) in the cyclic order of length S."""

    __slots__ = ("p", "S")

    def __init__(self, positions: List[int], S: int):
        self.p, self.S = positions, S

    def __getitem__(self, pos: int) -> int:
        p = self.p
        i = bisect.bisect_left(p, pos)
        return p[i] - pos if i < len(p) else p[0] + self.S - pos


class _Sim:
    def __init__(self, order, footprints, read_bytes, budget, disk: Disk, settings: Settings, priorities=None):
        if settings.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {settings.mode!r}")
        if settings.policy not in ("optimal", "lru"):
            raise ValueError(f"policy must be 'optimal' or 'lru', not {settings.policy!r}")
        n = len(footprints)
        self.n, self.fp, self.rb, self.budget = n, list(footprints), list(read_bytes), budget
        self.prio = list(priorities) if priorities is not None else [0] * n
        self.optimal = settings.policy == "optimal"
        self.depth = max(0, settings.readahead)
        self.aggressive = settings.mode == "aggressive"
        self.order = list(order)
        self.S = len(self.order)
        table = _next_use_table(self.order, n)
        if table is None:
            # Too long an order to table: each page's positions, bisected.
            positions: List[List[int]] = [[] for _ in range(n)]
            for i, p in enumerate(self.order):
                positions[p].append(i)
            table = [_Bisected(p, self.S) if p else None for p in positions]
        self.nu = table
        self.state = [ON_DISK] * n
        # The pages not ON_DISK (charged: in flight or resident), in id
        # order, and as a bitmask: the candidates' scans walk these, not
        # every page, and the bitmask keys the MIN memo.
        self.charged_ids: List[int] = []
        self.charged_mask = 0
        self.refs = [0] * n
        self.last = [0] * n
        self.prefetched = [False] * n
        self.clock = 0
        self.cursor = 0
        self.charged = 0
        self.t = 0.0
        self.c = dict(
            acquires=0,
            hits=0,
            readahead_hits=0,
            faults=0,
            readahead_reads=0,
            readahead_idle_evictions=0,
            evictions=0,
            pages_read=0,
            bytes_read=0,
        )
        self.io_wait = 0.0
        self.reclaim_wait = 0.0
        self.reads: List[Read] = []
        self._read_of: Dict[int, Read] = {}
        self._min_memo = _min_memo(self.order, self.fp, budget, self.prio)
        self._ahead_memo: Dict[int, List[int]] = {}
        self._ahead_entries = 0
        # the disk
        self.disk = disk
        self.urgent_q: deque = deque()
        self.background_q: deque = deque()
        self.active: List[list] = []  # [page, bytes left]
        self.pending = [0] * n  # chunks of the page's read not yet done

    # ---- schedule.cpp ----
    def next_use(self, page: int, pos: int) -> int:
        row = self.nu[page] if page < self.n else None
        return NEVER if row is None else row[pos % self.S]

    # ---- fault.cpp ----
    def advance_cursor(self, page: int):
        d = self.next_use(page, self.cursor)
        if d != NEVER:
            self.cursor = (self.cursor + d + 1) % self.S

    def acquire(self, p: int):
        self.c["acquires"] += 1
        self.advance_cursor(p)
        counted = False
        while True:
            st = self.state[p]
            if st == RESIDENT:
                if not counted:
                    self.c["readahead_hits" if self.prefetched[p] else "hits"] += 1
                self.prefetched[p] = False
                self.refs[p] += 1
                self.clock += 1
                self.last[p] = self.clock
                self.readahead()
                return
            if st == IN_FLIGHT:
                if not counted:
                    counted = True
                    self.c["readahead_hits" if self.prefetched[p] else "faults"] += 1
                self.prefetched[p] = False
                t0 = self.t
                yield ("page", p)
                self.io_wait += self.t - t0
                continue
            yield from self.make_room(self.fp[p], p)
            self.start_read(p, urgent=True)
            if self.state[p] == IN_FLIGHT and not counted:
                counted = True
                self.c["faults"] += 1

    def release(self, p: int):
        if self.refs[p] <= 0:
            raise RuntimeError(f"page {p} is not acquired")
        self.refs[p] -= 1
        self.readahead()

    def start_read(self, p: int, urgent: bool):
        if self.state[p] != ON_DISK:
            return
        self.charged += self.fp[p]
        self.state[p] = IN_FLIGHT
        self._index_charged(p)
        self.prefetched[p] = not urgent
        if not urgent:
            self.c["readahead_reads"] += 1
        r = Read(p, urgent, self.t)
        self.reads.append(r)
        self._read_of[p] = r
        self.submit(p, urgent)

    def complete_read(self, p: int):
        self.state[p] = RESIDENT
        self.clock += 1
        self.last[p] = self.clock
        self.c["pages_read"] += 1
        self.c["bytes_read"] += self.rb[p]
        self._read_of.pop(p).done = self.t

    def _index_charged(self, p: int):
        """p left ON_DISK: into charged_ids and charged_mask."""
        bisect.insort(self.charged_ids, p)
        self.charged_mask |= 1 << p

    def _index_on_disk(self, p: int):
        """p is ON_DISK again: out of charged_ids and charged_mask."""
        del self.charged_ids[bisect.bisect_left(self.charged_ids, p)]
        self.charged_mask &= ~(1 << p)

    # ---- reclaim.cpp ----
    def held_bytes(self) -> int:
        """Bytes of the pages acquired and not released."""
        return sum(self.fp[i] for i in self.charged_ids if self.refs[i] > 0)

    def evictable(self) -> List[_Cand]:
        at, nu, state, refs = self.cursor % self.S if self.S else 0, self.nu, self.state, self.refs
        return [
            _Cand(i, self.prio[i], self.last[i], NEVER if nu[i] is None else nu[i][at])
            for i in self.charged_ids
            if state[i] == RESIDENT and refs[i] == 0
        ]

    def evict(self, p: int):
        self.state[p] = ON_DISK
        self._index_on_disk(p)
        self.charged -= self.fp[p]
        self.prefetched[p] = False
        self.c["evictions"] += 1

    def make_room(self, need: int, p: int):
        if need > self.budget:
            raise SimBudgetError(f"page {p} needs {need} bytes, the page budget is {self.budget}")
        while True:
            if self.charged + need <= self.budget:
                return
            cands = self.evictable()
            if cands:
                self.evict(cands[_choose_victim(self.optimal, cands)].id)
                continue
            if any(self.state[i] == IN_FLIGHT for i in self.charged_ids if i != p):
                t0 = self.t
                yield ("completion", None)
                self.reclaim_wait += self.t - t0
                continue
            raise SimBudgetError(f"page {p}: every resident page is in use")

    # ---- readahead.cpp ----
    def readahead(self):
        if self.depth <= 0 or not self.S:
            return
        state = self.state
        for pid in self._ahead(self.cursor % self.S):
            if state[pid] != ON_DISK:
                continue
            if not self.readahead_one(pid):
                break

    def _ahead(self, at: int) -> List[int]:
        """The first `depth` distinct pages of the schedule from position
        `at`, in order: what readahead looks at. Kept per position (the
        cursor comes back to each every step) while the table stays under
        TABLE_MAX_ENTRIES."""
        got = self._ahead_memo.get(at)
        if got is not None:
            return got
        out, visited = [], set()
        for k in range(self.S):
            if len(out) >= self.depth:
                break
            pid = self.order[(at + k) % self.S]
            if pid not in visited:
                visited.add(pid)
                out.append(pid)
        self._ahead_entries += len(out)
        if self._ahead_entries <= TABLE_MAX_ENTRIES:
            self._ahead_memo[at] = out
        return out

    def _nu_at(self, page: int, at: int) -> int:
        """next_use from position `at` (already taken modulo S)."""
        row = self.nu[page]
        return NEVER if row is None else row[at]

    def readahead_one(self, pid: int) -> bool:
        # Candidates are page ids, chosen by the key _choose_victim orders
        # them by (min() keeps the first of equals, as it does): lower
        # priority, then (optimal) the furthest next use after this page's,
        # then the least recently used.
        need = self.fp[pid]
        if need > self.budget:
            return False
        when = self.next_use(pid, self.cursor)
        state, refs, prio, last, nu = self.state, self.refs, self.prio, self.last, self.nu
        while True:
            if state[pid] != ON_DISK:
                return True
            if self.charged + need <= self.budget:
                self.start_read(pid, urgent=False)
                return state[pid] != ON_DISK
            cur = self.cursor % self.S
            # Every page but pid (on disk) that is charged: idle (resident,
            # not acquired) or busy (in flight, or acquired), in id order.
            idle, busy = [], []
            for i in self.charged_ids:
                (idle if state[i] == RESIDENT and refs[i] == 0 else busy).append(i)
            if not idle:
                # Nothing may be evicted for it (MIN's choice is busy, no
                # idle page is left to take instead): wait, in either mode.
                return False
            if self.optimal:
                cands = idle + busy
                at = (self.cursor + when + 1) % self.S

                def key(c, at=at):
                    return (prio[c], -(NEVER if nu[c] is None else nu[c][at]), last[c])

                # The first of the least keys (the index breaks ties, as
                # min over the list in order does).
                pick = min(
                    (prio[c], -(NEVER if nu[c] is None else nu[c][at]), last[c], j) for j, c in enumerate(cands)
                )[3]
            else:
                cands = idle

                def key(c):
                    return (prio[c], last[c])

                pick = min((prio[c], last[c], j) for j, c in enumerate(cands))[2]
            if pick >= len(idle) or self._nu_at(cands[pick], cur) <= when:
                # MIN's choice is busy, or needed no later than this page: the
                # idle pages not needed before it. Aggressive: the best of
                # them. Conservative: the first (of IDLE_VICTIM_TRIES, in
                # victim order) that MIN evicts before its next use anyway,
                # else wait.
                ok = [c for c in idle if (NEVER if nu[c] is None else nu[c][cur]) > when]
                if self.aggressive:
                    if not ok:
                        return False
                    self.evict(min(ok, key=key))
                    continue
                evicted = False
                # In victim order, the first of equals first (the index in
                # the tuple: what taking the min again and again gives).
                ranked = [(*key(c), j, c) for j, c in enumerate(ok)] if self.optimal else []
                heapq.heapify(ranked)
                for _ in range(min(IDLE_VICTIM_TRIES, len(ranked))):
                    q = heapq.heappop(ranked)[-1]
                    if self.min_evicts_before_next_use(q):
                        self.evict(q)
                        self.c["readahead_idle_evictions"] += 1
                        evicted = True
                        break
                if not evicted:
                    return False
                continue
            self.evict(cands[pick])

    def min_evicts_before_next_use(self, q: int) -> bool:
        """readahead.cpp's min_evicts_before_next_use_locked: MIN over the
        schedule from the cursor, on the pages charged now, evicts q before
        q's next use. Candidates in a heap by next access (absolute
        positions; stale entries skipped), evicted lower priority first, then
        furthest next access, then lower id."""
        until = self.next_use(q, self.cursor)
        if until == NEVER:
            return True
        # Steps repeat their states: the answer for a state seen before.
        key = (self.cursor, q, self.charged_mask)
        got = self._min_memo.get(key)
        if got is None:
            got = self._min_evicts(q, until)
            if len(self._min_memo) < MIN_MEMO_MAX_ENTRIES:
                self._min_memo[key] = got
        return got

    def _min_evicts(self, q: int, until: int) -> bool:
        # The hot loop of the readahead choice: next_at and admit inlined.
        far = 1 << 62
        nu, order, prio, fp, budget, S = self.nu, self.order, self.prio, self.fp, self.budget, self.S
        push, pop = heapq.heappush, heapq.heappop
        heap: list = []
        charge = [0] * self.n
        nxt = [0] * self.n  # each page's next access, absolute; stale heap entries differ
        used = 0
        cur = self.cursor
        for i in self.charged_ids:
            charge[i] = c = max(1, fp[i])
            used += c
            row = nu[i]
            d = NEVER if row is None else row[cur % S]
            nxt[i] = x = far if d == NEVER else cur + d
            push(heap, (prio[i], -x, i))
        for pos in range(cur, cur + until):
            p = order[pos % S]
            if not charge[p]:
                need = max(1, fp[p])
                while used + need > budget:
                    while heap and (charge[heap[0][2]] == 0 or -heap[0][1] != nxt[heap[0][2]]):
                        pop(heap)
                    if not heap:
                        return False
                    v = pop(heap)[2]
                    if v == q:
                        return True
                    used -= charge[v]
                    charge[v] = 0
                charge[p] = need
                used += need
            row = nu[p]
            d = NEVER if row is None else row[(pos + 1) % S]
            nxt[p] = x = far if d == NEVER else pos + 1 + d
            push(heap, (prio[p], -x, p))
        return False

    # ---- page_io.cpp ----
    def submit(self, p: int, urgent: bool):
        q = self.urgent_q if urgent else self.background_q
        left, chunk, n = self.rb[p], self.disk.chunk_bytes, 0
        while left > 0 or n == 0:
            q.append((p, min(chunk, left) if left > 0 else 0))
            left -= chunk
            n += 1
        self.pending[p] = n
        self._fill()

    def _fill(self):
        while len(self.active) < self.disk.threads and (self.urgent_q or self.background_q):
            q = self.urgent_q if self.urgent_q else self.background_q
            p, nbytes = q.popleft()
            self.active.append([p, float(nbytes)])

    def _next_chunk_s(self) -> float:
        if not self.active:
            return float("inf")
        return max(0.0, min(a[1] for a in self.active)) * len(self.active) / self.disk.rate

    def advance(self, until: float, stop=None):
        """Runs the disk to time `until`, or until `stop()` holds after a
        read completes (then returns True). The active chunks share the
        device's rate equally."""
        while True:
            dt = self._next_chunk_s()
            if self.t + dt > until:
                if self.active and until > self.t:
                    moved = (until - self.t) * self.disk.rate / len(self.active)
                    for a in self.active:
                        a[1] -= moved
                self.t = max(self.t, until)
                return False
            self.t += dt
            moved = dt * self.disk.rate / len(self.active)
            done, still = [], []
            for a in self.active:
                a[1] -= moved
                (done if a[1] <= 1e-6 * self.disk.chunk_bytes else still).append(a)
            self.active = still
            self._fill()
            completed = False
            for p, _ in done:
                self.pending[p] -= 1
                if self.pending[p] == 0:
                    self.complete_read(p)
                    completed = True
            if completed and stop is not None and stop():
                return True


def _program(sim: _Sim, accesses: Sequence[Access], steps: int, marks: List[float], events: Optional[list]):
    def note(kind, p):
        if events is not None:
            events.append((kind, p, frozenset(i for i in range(sim.n) if sim.state[i] != ON_DISK)))

    def release(pages):
        for p in reversed(pages):
            sim.release(p)
            note("release", p)

    sim.readahead()  # set_schedule looks ahead at once
    note("schedule", None)
    for _ in range(steps):
        marks.append(sim.t)
        before = ()  # the access before's pages, where the next one overlaps them
        for a in accesses:
            if not a.overlaps:
                release(before)
                before = ()
            if a.gap_s > 0:
                yield ("compute", a.gap_s)
            for p in a.pages:
                if before and sim.state[p] == ON_DISK and sim.held_bytes() + sim.fp[p] > sim.budget:
                    # No room beside the page before: the read waits until
                    # the graph is done with it (the pager's reclaim wait).
                    release(before)
                    before = ()
                yield from sim.acquire(p)
                note("acquire", p)
            release(before)
            if a.hold_s > 0:
                yield ("compute", a.hold_s)
            before = a.pages
        release(before)
    marks.append(sim.t)


def simulate(
    accesses: Sequence[Access],
    footprints: Sequence[int],
    budget: int,
    disk: Disk,
    settings: Settings = Settings(),
    steps: int = 6,
    warmup: int = 2,
    read_bytes: Optional[Sequence[int]] = None,
    priorities: Optional[Sequence[int]] = None,
    events: Optional[list] = None,
) -> Prediction:
    """The pager with `settings` and a page budget of `budget` bytes, running
    `steps` steps of `accesses` against `disk`; the step figures are means
    over the steps after the first `warmup`. `footprints`: bytes each page
    is charged (PagedWeights.page_footprint); `read_bytes`: bytes each
    page's read transfers (default: its footprint). `events`: a list that
    gets (kind, page, pages charged) after set_schedule and every acquire
    and release (the pages charged: resident or in flight)."""
    order = [p for a in accesses for p in a.pages]
    rb = list(read_bytes) if read_bytes is not None else list(footprints)
    sim = _Sim(order, footprints, rb, budget, disk, settings, priorities)
    marks: List[float] = []
    per_step = []
    gen = _program(sim, accesses, steps, marks, events)
    waits_at, bytes_at, pages_at = [], [], []

    def snapshot():
        waits_at.append((sim.io_wait, sim.reclaim_wait))
        bytes_at.append(sim.c["bytes_read"])
        pages_at.append(sim.c["pages_read"])

    try:
        req = next(gen)
        while True:
            while len(waits_at) < len(marks):
                snapshot()
            kind, arg = req
            if kind == "compute":
                sim.advance(sim.t + arg)
            elif kind == "page":
                if sim.state[arg] == IN_FLIGHT and not sim.advance(
                    float("inf"), lambda p=arg: sim.state[p] != IN_FLIGHT
                ):
                    raise RuntimeError("a read never completed")  # unreachable: the disk drains
            else:  # any read completing
                sim.advance(float("inf"), lambda: True)
            req = gen.send(None)
    except StopIteration:
        pass
    while len(waits_at) < len(marks):
        snapshot()
    while sim.active:  # reads the last release started land after the last step
        sim.advance(float("inf"), lambda: not sim.active)
    for s in range(steps):
        per_step.append(
            dict(
                step_s=marks[s + 1] - marks[s],
                io_wait_s=waits_at[s + 1][0] - waits_at[s][0],
                reclaim_wait_s=waits_at[s + 1][1] - waits_at[s][1],
                bytes_read=bytes_at[s + 1] - bytes_at[s],
                pages_read=pages_at[s + 1] - pages_at[s],
            )
        )
    measured = per_step[min(warmup, steps - 1) :]

    def mean(k):
        return sum(s[k] for s in measured) / len(measured)

    return Prediction(
        settings=settings,
        step_s=mean("step_s"),
        io_wait_s=mean("io_wait_s"),
        reclaim_wait_s=mean("reclaim_wait_s"),
        bytes_read=mean("bytes_read"),
        pages_read=mean("pages_read"),
        steps=per_step,
        reads=sim.reads,
        counters=dict(sim.c),
    )


# ------------------------------------------------------- choosing a policy --
def _space(num_pages: int, depths: Optional[Iterable[int]], policies: Sequence[str]) -> List[Settings]:
    ds = sorted(set(depths)) if depths is not None else list(range(0, num_pages + 1))
    out = []
    for pol in policies:
        for d in ds:
            for m in MODES if d > 0 else MODES[:1]:
                out.append(Settings(readahead=d, mode=m, policy=pol))
    return out


def _pick(preds: List[Prediction], min_bytes: float, max_extra: Optional[float]) -> Prediction:
    """The fastest prediction whose bytes stay within (1 + max_extra) of
    MIN's; ties (within 0.1%) go to fewer bytes, then to the earlier entry."""
    ok = [p for p in preds if max_extra is None or p.bytes_read <= (1 + max_extra) * min_bytes + 1]
    ok = ok or [min(preds, key=lambda p: p.bytes_read)]
    best = min(p.step_s for p in ok)
    near = [p for p in ok if p.step_s <= best * 1.001]
    return min(near, key=lambda p: p.bytes_read)


@dataclass
class Offline:
    """The fastest schedule offline_best found (per step, after warmup)."""

    step_s: float
    bytes_read: float
    pages_read: float


def offline_best(
    accesses: Sequence[Access],
    footprints: Sequence[int],
    budget: int,
    rate: float,
    read_bytes: Optional[Sequence[int]] = None,
    steps: int = 6,
    warmup: int = 2,
    width: int = 1000,
    max_bytes: Optional[float] = None,
) -> Optional[Offline]:
    """How fast a step can run under the budget with ANY choice of what to
    evict and when, not only the pager's rules: a beam search over eviction
    schedules, the yardstick the bound max(MIN's bytes / R, compute) is not.
    That bound assumes the disk never idles, but the budget can force it to:
    while every page it holds is still needed before the next read's, no
    read can start.

    The model, the simulator's without its policy: accesses run in order,
    each after its `gap_s`, once its pages are in, for `hold_s`, holding
    them; the disk reads one page at a time at `rate` bytes/s (sharing it
    among several reads ends none sooner), a page only when an access needs
    it and it is not in memory (in the order of need), starting as soon as
    the disk is free and the room is (a victim's room frees when its last
    access so far ends). An access that overlaps the one before (a lazy
    read of one graph, Access.overlaps) holds that one's pages until its
    own are in, as _program does; where there is no room beside them, they
    go first. The choice, at every read: which pages to evict for it, any
    not held, even one needed again soon (then read again). Every policy of
    this simulator is such a schedule; the search keeps, per set of pages in
    memory, the schedules no other is ahead of in every respect, the `width`
    earliest. Steady state: the mean over the steps after `warmup` of the
    fastest run of `steps` steps. With one page per access a wider beam
    finds nothing faster (tests/python/test_simulate.py); with several
    (blocks in parts) victims combine and the beam cuts: the best found,
    not the best (random instances of 20 pages in parts: a beam of 200
    found up to 1.06x the simulator's best policy, one of 1000 0.98x).

    `max_bytes`: only schedules that read at most that many bytes a step
    (the mean over the steps after `warmup`), e.g. (1 + DEFAULT_EXTRA_READS)
    x MIN's, the most the pager's own choice may read. A schedule is then
    also kept beside a faster one that reads more; None where the beam
    holds no schedule within it."""
    rb = list(read_bytes) if read_bytes is not None else list(footprints)
    seq = [a for _ in range(steps) for a in accesses]
    per_step = len(accesses)
    uses: Dict[int, List[int]] = {}  # each page's accesses, in order
    for k, a in enumerate(seq):
        for q in a.pages:
            uses.setdefault(q, []).append(k)

    def next_uses(res, k):
        """The next accesses (after the k-th) of the pages in `res`, the
        furthest first (none again: after every access)."""
        nxt = []
        for q, _ in res:
            i = bisect.bisect_right(uses[q], k)
            nxt.append(uses[q][i] if i < len(uses[q]) else len(seq))
        return sorted(nxt, reverse=True)

    # The bytes the counted steps may read in all (a little slack for sums).
    cap = None if max_bytes is None else max_bytes * max(1, steps - warmup) * (1 + 1e-9) + 1
    # A schedule so far: (time its last access ended, time the disk is free,
    # bytes charged, ((page, end of its last access), ...) sorted, reads,
    # bytes read, latest read of the current access, (time, reads, bytes)
    # when the warmup ended).
    beam = [(0.0, 0.0, 0, (), 0, 0, 0.0, (0.0, 0, 0))]
    for k, a in enumerate(seq):
        # The access before's pages, held until this one's are in where it
        # overlaps them (Access.overlaps, as _program): per schedule, since
        # one with no room beside them lets them go first.
        overlaps = a.overlaps and k % per_step > 0  # (a step starts with nothing held)
        before = tuple(q for q in seq[k - 1].pages if q not in a.pages) if overlaps else ()
        befores = [before] * len(beam)
        for j, p in enumerate(a.pages):
            grown, grown_befores = [], []
            for (end, disk, charged, res, n, nb, ready, mark), bef in zip(beam, befores):
                mem = dict(res)
                if p in mem:
                    grown.append((end, disk, charged, res, n, nb, ready, mark))
                    grown_befores.append(bef)
                    continue
                if footprints[p] > budget:
                    raise SimBudgetError(f"page {p} needs {footprints[p]} bytes, the page budget is {budget}")
                held = set(a.pages[:j]) | set(bef)
                if bef and sum(footprints[q] for q in held) + footprints[p] > budget:
                    bef = ()  # no room beside the page before: it goes first
                    held = set(a.pages[:j])
                # Every set of victims that makes room (each set once: taken
                # in the order of `res`; a set that fits is not grown).
                free = [v for v, _ in res if v not in held]
                ways = [(mem, charged, 0.0, 0)]
                while ways:
                    m, ch, freed_at, i = ways.pop()
                    if ch + footprints[p] <= budget:
                        done = max(disk, freed_at) + rb[p] / rate
                        m2 = dict(m)
                        m2[p] = 0.0
                        grown.append(
                            (
                                end,
                                done,
                                ch + footprints[p],
                                tuple(sorted(m2.items())),
                                n + 1,
                                nb + rb[p],
                                max(ready, done),
                                mark,
                            )
                        )
                        grown_befores.append(bef)
                        continue
                    for c in range(i, len(free)):
                        v = free[c]
                        m2 = dict(m)
                        del m2[v]
                        ways.append((m2, ch - footprints[v], max(freed_at, m[v]), c + 1))
            beam, befores = grown, grown_befores
            if not beam:
                raise SimBudgetError(f"page {p}: the pages held with it do not leave room for it")
        fin = []
        for (end, disk, charged, res, n, nb, ready, mark), bef in zip(beam, befores):
            start = max(end + a.gap_s, ready)
            t = start + a.hold_s
            mem = dict(res)
            for q in bef:  # let go once this access's pages are in
                mem[q] = max(mem[q], start)
            for q in a.pages:
                mem[q] = t
            if k + 1 == warmup * per_step:
                mark = (t, n, nb)
            if cap is not None and k + 1 > warmup * per_step and nb - mark[2] > cap:
                continue  # read more over the counted steps than they may
            fin.append((t, disk, charged, tuple(sorted(mem.items())), n, nb, 0.0, mark))
        fin.sort(key=lambda s: (s[0], s[1]))
        kept: Dict[tuple, list] = {}
        beam = []
        for s in fin:
            key = tuple(q for q, _ in s[3])
            lasts = [t for _, t in s[3]]
            # Under a cap on bytes, fewer bytes read is one more way to be ahead.
            spent = s[5] - s[7][2] if cap is not None else 0
            group = kept.setdefault(key, [])
            if any(
                e <= s[0] and d <= s[1] and b <= spent and all(x <= y for x, y in zip(ls, lasts))
                for e, d, b, ls in group
            ):
                continue
            group.append((s[0], s[1], spent, lasts))
            beam.append(s)
            if len(beam) >= width and cap is None:
                break
        if cap is not None and len(beam) > width:
            # Half the beam the earliest, half the cheapest: the fastest
            # schedules alone can all end up over the cap, with the ones
            # that keep it cut long before. Among as cheap, those whose
            # pages are wanted soonest (MIN's choice: its furthest next use
            # evicted) first, then the earliest: cheapness alone ties many
            # (every schedule reads the same in the first step) and the
            # earliest of them cut MIN's own, which keeps any cap over MIN
            # (the big shape at 25%, 20 blocks: none within 1.10x MIN at a
            # width of 500 before, though the pager's policy reads 1.00x).
            cheap = sorted(beam, key=lambda s: (s[5] - s[7][2], next_uses(s[3], k), s[0]))
            picked = {id(s): s for s in beam[: width - width // 2]}
            for s in cheap:
                if len(picked) >= width:
                    break
                picked.setdefault(id(s), s)
            beam = sorted(picked.values(), key=lambda s: (s[0], s[1]))
        if not beam:
            return None  # every schedule the beam held read more than max_bytes
    best = min(beam, key=lambda s: s[0])
    t0, n0, b0 = best[7]
    m = max(1, steps - warmup)
    return Offline((best[0] - t0) / m, (best[5] - b0) / m, (best[4] - n0) / m)


def min_bytes_per_step(accesses, footprints, budget, read_bytes=None, steps: int = 6, warmup: int = 2) -> float:
    """MIN's bytes per step: the pages min_pages_per_step counts, each priced
    at its own read (`read_bytes`, default its footprint), not as many mean
    pages: where MIN keeps the small pages and rereads the large ones, the
    mean page prices it under what it reads, and the cap on extra reads
    (DEFAULT_EXTRA_READS) would let a schedule read more than MIN does and
    still count as 'within 10%'. A 4-bit model's pages differ by up to 40%."""
    rb = list(read_bytes) if read_bytes is not None else list(footprints)
    return _min_per_step(accesses, footprints, budget, steps, warmup, weights=rb)


def best_settings(
    accesses: Sequence[Access],
    footprints: Sequence[int],
    budget: int,
    disk: Disk,
    max_extra: Optional[float] = DEFAULT_EXTRA_READS,
    policies: Sequence[str] = ("optimal",),
    depths: Optional[Iterable[int]] = None,
    read_bytes: Optional[Sequence[int]] = None,
    **sim_kw,
) -> Prediction:
    """The simulator's best over the whole policy space (every readahead
    depth from 0 to the number of pages, both modes, `policies`), with bytes
    read at most (1 + max_extra) x MIN's (None: no cap)."""
    n = len({p for a in accesses for p in a.pages})
    preds = [
        simulate(accesses, footprints, budget, disk, s, read_bytes=read_bytes, **sim_kw)
        for s in _space(n, depths, policies)
    ]
    mn = min_bytes_per_step(accesses, footprints, budget, read_bytes, sim_kw.get("steps", 6), sim_kw.get("warmup", 2))
    return _pick(preds, mn, max_extra)


def candidate_depths(num_pages: int, unit: int = 1) -> List[int]:
    """The depths the automatic choice tries: `unit` (a block's pages: the
    depth counts whole blocks) times 1, 2, 4, ..., and every page."""
    ds, d = {num_pages}, max(1, unit)
    while d < num_pages:
        ds.add(d)
        d *= 2
    return sorted(ds)


def choose_readahead(
    accesses: Sequence[Access],
    footprints: Sequence[int],
    budget: int,
    disk: Disk,
    policy: str = "optimal",
    max_extra: Optional[float] = DEFAULT_EXTRA_READS,
    read_bytes: Optional[Sequence[int]] = None,
    steps: int = 6,
    warmup: int = 2,
    unit: int = 1,
) -> Prediction:
    """The pager's own choice of readahead depth and mode for a step of
    `accesses` (per-block compute as measured) on a disk of measured rate:
    the fastest of a few candidates (depths of 1, 2, 4, ... blocks of `unit`
    pages, all pages; both modes) whose bytes stay within (1 + max_extra) x
    MIN's. Aggressive mode (reads over MIN) is chosen only where the
    simulator says it pays. (Whole blocks: a shallower depth than a block
    reads a block's later parts just in time, which the simulator, holding
    one page per access, sees as overlap it is not.)"""
    n = len({p for a in accesses for p in a.pages})
    try:
        preds = [
            simulate(accesses, footprints, budget, disk, s, steps=steps, warmup=warmup, read_bytes=read_bytes)
            for s in _space(n, candidate_depths(n, unit), (policy,))
        ]
    finally:
        _MIN_MEMOS.clear()  # training goes on: its memory back
    return _pick(preds, min_bytes_per_step(accesses, footprints, budget, read_bytes, steps, warmup), max_extra)


# ------------------------------------------------ a measured step's compute --
def waited(stats) -> float:
    """A pager's cumulative waits (its stats()): for reads and for room. What
    a measured step less its waits leaves is its compute."""
    return stats["io_wait_s"] + stats["reclaim_wait_s"]


@dataclass
class BlockMark:
    """One on_block call of a training step: the pages of `block` (or of the
    tail, phase "tail") were released at perf_counter `t`, when the time
    that was not compute (waited: the pager's cumulative io_wait_s +
    reclaim_wait_s) was `wait_s`."""

    phase: str  # "forward", "tail" or "backward"
    block: int
    t: float
    wait_s: float


def accesses_from_marks(
    marks: Sequence[BlockMark],
    start: Tuple[float, float],
    end: Tuple[float, float],
    block_pages: Sequence[Sequence[int]],
    tail_back_pages: Optional[Sequence[Sequence[int]]] = None,
    held: bool = False,
    whole: Iterable[int] = (),
) -> List[Access]:
    """The accesses of one measured step, with their compute: each block's
    time since the previous mark less the pager's waits in between. `start`
    and `end`: (t, wait_s) at the step's start and end (after the optimizer
    update); `block_pages[i]`: block i's pages (a bare page id: its one
    page), in use order; `tail_back_pages[i]`: those a streamed tail reads
    again for block i's backward, in that order (default: block i's pages
    in reverse); `held`: the tail held its pages instead (step.holds_tail,
    the step record's tail_held); `whole`: forward blocks of several pages
    that ran bound whole (step.Blocks.bound_whole, the step record's
    forward_whole: several micro-batches, the block's pages all
    acquired before its graphs and held to their end), each one access of
    all its pages. (Taken as lazy reads, part by part, the read shape's
    prefix sweep at 10% was predicted 1.10x fast: its parts, held to each
    block's end, leave the disk idle through the block's compute, 0.73 s of
    the window's 1.33 s first step.)

    A block bound whole (the backward sweep, a one-page block) is one access
    of its pages; a block whose pages are lazy reads (a forward block of
    several pages, the tail) is one access per page, the block's compute
    shared among them, each after the first of its graph overlapping the
    one before (Access.overlaps). What a mark cannot tell apart is split by rule: the
    time after the last block (the optimizer update) and before the first
    (embedding) is the first access's gap; the first backward block after a
    forward sweep without a tail also carries the head, so its hold is the
    median of the other backward blocks and the rest is its gap."""
    pages_of = [tuple(p) if isinstance(p, (tuple, list)) else (p,) for p in block_pages]
    back_of = (
        [tuple(p) for p in tail_back_pages] if tail_back_pages is not None else [tuple(reversed(p)) for p in pages_of]
    )
    whole_set = set(whole)
    marks = [m for m in marks if m.phase in ("forward", "tail", "backward")]
    groups: List[List[BlockMark]] = []
    for m in marks:
        if m.phase == "tail" and groups and groups[-1][0].phase == "tail":
            groups[-1].append(m)
        else:
            groups.append([m])
    out: List[Access] = []
    phases: List[str] = []

    def each_page(pages, hold, phase, chained=False):
        # Lazy reads of one graph: each page acquired while the one before
        # is held (Access.overlaps); `chained`: the first one too (the
        # graph's pages before these).
        out.extend(Access(pages=(p,), hold_s=hold / len(pages), overlaps=chained or k > 0) for k, p in enumerate(pages))
        phases.extend([phase] * len(pages))

    t_prev, w_prev = start
    for g in groups:
        last = g[-1]
        busy = max(0.0, (last.t - t_prev) - (last.wait_s - w_prev))
        t_prev, w_prev = last.t, last.wait_s
        if g[0].phase == "tail" and held:
            # A held tail (step.holds_tail): its blocks' pages bound together
            # for the whole of its one graph.
            out.append(Access(pages=tuple(p for b in sorted(m.block for m in g) for p in pages_of[b]), hold_s=busy))
            phases.append("tail")
            continue
        if g[0].phase == "tail":
            # The tail streams its pages (stream.py): each block read for its
            # forward, then again, in reverse, for its backward (about twice
            # the forward's compute). One graph: the marks give its total only.
            blocks = sorted(m.block for m in g)
            share = busy / (3 * len(blocks))
            for k, b in enumerate(blocks):
                each_page(pages_of[b], share, "tail", chained=k > 0)
            for b in reversed(blocks):
                if back_of[b]:
                    each_page(back_of[b], 2 * share, "tail", chained=True)
            continue
        pages = pages_of[g[0].block]
        if g[0].phase == "forward" and len(pages) > 1 and g[0].block not in whole_set:
            each_page(pages, busy, "forward")  # read lazily (step.py)
        else:
            out.append(Access(pages=pages, hold_s=busy))
            phases.append(g[0].phase)
    if not out:
        return out
    after = max(0.0, (end[0] - t_prev) - (end[1] - w_prev))

    holds = [a.hold_s for a in out]

    def median_of(phase, skip):
        xs = [b for i, (b, ph) in enumerate(zip(holds, phases)) if ph == phase and i != skip]
        return statistics.median(xs) if xs else None

    # The first access: embedding (and the previous step's update) before it.
    hold0 = median_of(phases[0], 0)
    if hold0 is not None and hold0 < out[0].hold_s:
        out[0].gap_s, out[0].hold_s = out[0].hold_s - hold0, hold0
    out[0].gap_s += after
    # The head, before the first backward block when there is no tail.
    if "backward" in phases and "tail" not in phases:
        i = phases.index("backward")
        h = median_of("backward", i)
        if h is not None and h < out[i].hold_s:
            out[i].gap_s, out[i].hold_s = out[i].hold_s - h, h
    return out


def tune_readahead(
    pager,
    accesses: Sequence[Access],
    footprints: Sequence[int],
    page_budget: int,
    rate: float,
    io_threads: int,
    policy: str = "optimal",
    max_extra: Optional[float] = DEFAULT_EXTRA_READS,
    unit: int = 1,
) -> Prediction:
    """Sets the readahead depth and mode of a running `pager` (a
    mlx_pager.Pager) to choose_readahead's choice for a measured step
    (`accesses`, e.g. from accesses_from_marks) at read rate `rate`
    (bytes/s, e.g. read_rate_for_session), depths in blocks of `unit` pages.
    Returns the chosen prediction."""
    chosen = choose_readahead(accesses, footprints, page_budget, Disk(rate, io_threads), policy, max_extra, unit=unit)
    pager.set_readahead(chosen.settings.readahead)
    pager.set_readahead_mode(chosen.settings.mode)
    return chosen


def read_rate_for_session(paths: Sequence[str], page_bytes: int, io_threads: int, max_seconds: float = 0.5) -> float:
    """A quick measure of the direct-read rate of the model's own files at
    the pager's own I/O shape (its threads and chunk size, page-sized reads):
    one setting, at most `max_seconds` (benchlib.read_rate tries several)."""
    from ._core import measure_read_rate

    r = measure_read_rate(
        [str(p) for p in paths],
        threads=io_threads,
        # at most 2 x 16 MB in flight: the measurement's buffers are outside
        # the pager's budget, so they stay small beside it
        batch_bytes=min(16 << 20, max(1 << 20, int(page_bytes))),
        max_bytes=1 << 30,
        max_seconds=max_seconds,
    )
    return float(r["bytes_per_s"])


class AutoReadahead:
    """The automatic readahead choice of a training run (no --readahead):
    after the `after`-th optimizer step (the first measures the tail and
    reads cold), picks the readahead depth and mode from that step's
    per-block compute (on_block marks less the pager's waits), the page
    budget, and the read rate of the files the pager reads (measured once,
    read_rate_for_session), and sets them on the pager (tune_readahead). It
    chooses again after a later step when the step's schedule changed (the
    tail's placement) or the page budget moved by more than BUDGET_MOVE
    since the last choice (the plan moves it a little after most steps as
    it learns; each choice simulates the step a few dozen times, seconds on
    a large model); never once the governor has degraded, nor while
    checkpoints are spilled through the pager. Where the frozen prefix runs
    ahead (prefix.py), the steps of a window differ (its first runs the
    prefix for all): the choice is made at a window's end, from all its
    steps, the first of which is at least the `after`-th.

    A callback object for the trainer's Callbacks (it has the hooks it needs:
    on_session, on_step_begin, on_block, on_step). `say(text)`: told each
    choice that differs from the last one told. `rate`: bytes/s, to skip the
    measurement (tests)."""

    BUDGET_MOVE = 0.02

    def __init__(self, after: int = 2, say=None, rate: Optional[float] = None, max_extra=DEFAULT_EXTRA_READS):
        self.after, self.say, self.rate, self.max_extra = after, say, rate, max_extra
        self.session = None
        self.steps = 0
        self.chosen: Optional[Prediction] = None
        self._start = None
        self._marks: List[BlockMark] = []
        self._key = None  # (page budget, schedule) of the last choice
        self._said: Optional[Settings] = None
        self._window: List[List[Access]] = []  # the accesses of the window's steps so far
        self._window_first = 0  # the step number of the window's first step

    def needs_choice(self, budget: int, schedule: tuple) -> bool:
        """Whether a step with this page budget and schedule (its accesses'
        pages) calls for a new choice; remembers them when it does."""
        if self._key is not None:
            last_budget, last_schedule = self._key
            if schedule == last_schedule and abs(budget - last_budget) <= self.BUDGET_MOVE * last_budget:
                return False
        self._key = (budget, schedule)
        return True

    def choose(self, pager, accesses, footprints, budget: int, io_threads: int, policy: str, unit: int):
        """tune_readahead for a measured step at `budget` (at self.rate), or
        None, the pager left as it is, where the step as measured does not
        fit that budget (SimBudgetError): the governor lowered the budget
        after the step, and the plan changes the next step to fit (seen: a
        held tail of two blocks, 122 MB, measured under a 188 MB budget that
        the step lowered to 119 MB, stopped a run at its last step). The
        choice is then made after a step under the new budget."""
        try:
            return tune_readahead(
                pager, accesses, footprints, budget, self.rate, io_threads, policy, self.max_extra, unit=unit
            )
        except SimBudgetError:
            self._key = None  # the next step calls for a choice
            return None

    def on_session(self, session):
        self.session = session

    def on_step_begin(self, iteration, stats):
        import time

        self.steps += 1
        self._start = (time.perf_counter(), waited(stats))
        self._marks = []

    def on_block(self, weights, phase, block):
        import time

        if self._start is not None and phase in ("forward", "tail", "backward"):
            self._marks.append(BlockMark(phase, block, time.perf_counter(), waited(weights.pager.stats())))

    def on_step(self, record):
        import time

        s, start = self.session, self._start
        self._start = None
        if s is None or start is None or self.steps < self.after or not self._marks:
            return
        if getattr(s.gov, "events", None) or getattr(getattr(s, "placement", None), "spilled", 0):
            # The governor degraded (it may have turned readahead off), or
            # checkpoints are spilled through the pager (pages the simulator
            # does not model): leave the pager as it is.
            return
        pager = s.weights.pager
        end = (time.perf_counter(), waited(pager.stats()))
        acc = accesses_from_marks(
            self._marks,
            start,
            end,
            s.block_pages,
            s.tail_back_pages,
            bool(record.get("tail_held")),
            record.get("forward_whole", ()),
        )
        steps, at = record.get("window", (1, 0))
        if steps > 1:
            if at == 0:
                self._window, self._window_first = [], self.steps
            self._window.append(acc)
            if at < steps - 1 or len(self._window) != steps or self._window_first < self.after:
                return
            acc = [a for one in self._window for a in one]
            self._window = []
        budget = int(s.gov.page_budget)
        if not self.needs_choice(budget, tuple(a.pages for a in acc)):
            return
        if self.rate is None:
            files = sorted(Path(s.weights.model_path).glob("model*.safetensors"))
            if getattr(s.weights, "swap_path", None):
                files.insert(0, Path(s.weights.swap_path))
            self.rate = read_rate_for_session(files, max(s.page_footprints), s.args.io_threads)
        unit = s.weights.pages_per_block
        chosen = self.choose(pager, acc, s.page_footprints, budget, s.args.io_threads, s.args.policy, unit)
        if chosen is None:
            return
        self.chosen = chosen
        if self.say is not None and self.chosen.settings != self._said:
            self._said = self.chosen.settings
            p = self.chosen
            depth = p.settings.readahead / unit
            self.say(
                f"Readahead: {depth:g} blocks, {p.settings.mode} (predicted {p.step_s / steps:.2f}s/step, "
                f"{p.bytes_read / steps / 1e9:.2f}GB read/step at {self.rate / 1e9:.2f}GB/s)"
            )
