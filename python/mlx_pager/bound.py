"""A lower bound on a paged step's time that counts the page budget.

The bench's bound, max(MIN's bytes / R, compute), lets every read overlap
any compute. A read cannot: the page it brings is charged to the budget
from the moment the read starts until the access that needs it has run,
beside the pages the step holds meanwhile. Where the budget leaves little
room beside a long compute (a block computed for a whole window of batches
while a budget of two blocks holds it and the next), the disk idles through
that compute whatever the schedule, and reads the steps after it must wait
for (the read shape at 25%: docs/benchmark-history.md, *What the figures say*).

``room_bound`` is that bound with the room counted: the optimum of a linear
program every schedule of the simulator's model satisfies (the model of
``simulate.offline_best``, and so of every policy ``simulate.simulate``
runs). Each access runs its `gap_s` of compute, then waits (a stall, a
variable) until its pages are in, then holds them for `hold_s`. Between two
uses of a page (or from the start, for its first) the page is either kept
or read again; the program may keep a fraction and read the rest, spread
over the compute and stalls in between, and it charges a page's footprint
in proportion to what of it is kept or read so far. The constraints, at
the end of every gap, stall and hold:

  - room: the pages held (an access's own, during its hold) and what the
    pages not held have kept or read so far fit the budget;
  - disk: what is read during the interval is at most `rate` times its
    length (a stall's length is its variable);
  - need: a page is all in by the end of the stall before each use.

A schedule is such a point: a page kept between two uses is a fraction 1
kept, one read again is its read's bytes in the intervals it took, charged
whole from the read's start, so at least in proportion; reads of pages
evicted before their use, the order of reads and the rate's sharing among
threads only cost it more. Its step time is the compute plus its stalls,
so no schedule is faster than the program's least stalls: a lower bound,
where offline_best's search is an upper bound on the fastest schedule.

The program runs `steps` steps of the accesses from an empty memory and
takes the mean over those after `warmup`, whose stalls are free. One
counted step after one warmup step (the default) bounds any run of n
steps after a warmup: cut that run at its step boundaries, and each piece
is a point of the one-step program (its warmup reaches any state the run
is in at the cut, as a free stall reads anything that fits; reads for
later steps are dropped), so the run's mean is at least the one-step
optimum. On the bench's rows (session 38's raw files of the read, compute,
4-bit and 9 GB shapes) the one-step program and six steps after two gave
the same figure to 4 digits, in a tenth of the time (the read shape at
25%, a window of 272 accesses: 0.6 s against 7 s).

The program is fractional: it may keep part of a page and read the rest,
so it can read less than MIN's bytes (pages of different sizes), and it is
not always reached. With the budget ample it is the compute; with room for
one page and two used in turn, their compute plus both reads
(tests/python/test_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from .simulate import Access, SimBudgetError


@dataclass
class RoomBound:
    step_s: float  # per step, after warmup: compute + stall_s
    compute_s: float  # per step: the accesses' gaps and holds
    stall_s: float  # per step: the least waiting for reads any schedule has


def _linprog():
    try:
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix
    except ImportError as e:  # pragma: no cover - scipy comes with the test and bench extras
        raise ImportError(
            "room_bound solves a linear program with scipy, which is not installed: "
            "pip install 'mlx-pager[bench]' (or pip install scipy)"
        ) from e
    return linprog, coo_matrix


def room_bound(
    accesses: Sequence[Access],
    footprints: Sequence[int],
    budget: int,
    rate: float,
    read_bytes: Optional[Sequence[int]] = None,
    steps: int = 2,
    warmup: int = 1,
) -> RoomBound:
    """The least mean step time (over the steps after `warmup` of `steps`)
    any schedule of `accesses` gets under a page budget of `budget` bytes
    on a disk of `rate` bytes/s (module doc). `footprints`: bytes each page
    is charged; `read_bytes`: bytes its read transfers (default: its
    footprint). Raises SimBudgetError where an access's pages alone exceed
    the budget."""
    import numpy as np

    linprog, coo_matrix = _linprog()
    if not accesses:
        raise ValueError("room_bound needs at least one access")
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    if rate <= 0:
        raise ValueError(f"rate must be positive, not {rate}")
    # Bytes in units of the largest page, so the program's coefficients are
    # near 1 (HiGHS scales, but bytes and fractions differ by 1e8 here).
    unit = float(max(footprints))
    fp = [x / unit for x in footprints]
    rb = [x / unit for x in (read_bytes if read_bytes is not None else footprints)]
    room, rate_u = budget / unit, rate / unit
    seq = [a for _ in range(steps) for a in accesses]
    K = len(seq)
    counted_from = warmup * len(accesses)
    # Intervals: 3k the gap, 3k+1 the stall, 3k+2 the hold of access k.
    T = 3 * K
    dur = np.zeros(T)
    held = np.zeros(T)
    uses = {}  # each page's accesses, in order
    for k, a in enumerate(seq):
        pages = list(dict.fromkeys(a.pages))
        dur[3 * k] = a.gap_s
        dur[3 * k + 2] = a.hold_s
        held[3 * k + 2] = sum(fp[p] for p in pages)
        if held[3 * k + 2] > room * (1 + 1e-12):
            need = held[3 * k + 2] * unit
            raise SimBudgetError(
                f"access {k % len(accesses)}: its pages need {need:.0f} bytes, the page budget is {budget}"
            )
        for p in pages:
            uses.setdefault(p, []).append(k)
    # Variables: z_k (0..K-1), the stall of access k; O_u (K..K+T-1), what
    # is charged at the end of interval u and not held (pages kept or read
    # for a later use), at most the room the held pages leave; then per
    # span (a page between two uses, or before its first) the fraction kept
    # (none before a first use) and the fraction read in each interval.
    O = K
    n_var = K + T
    lo = [0.0] * n_var
    hi = [np.inf] * K + list(np.maximum(0.0, room - held))
    # Equalities: rows 0..T-1 O_u = O_{u-1} + kept and read at u - what
    # became held at u; then one row per span, kept + read = 1.
    eq_r, eq_c, eq_v = (
        list(range(T)) + list(range(1, T)),
        list(range(O, O + T)) + list(range(O, O + T - 1)),
        [1.0] * T + [-1.0] * (T - 1),
    )
    leaving = np.zeros(T)
    spans = 0
    disk_r, disk_c, disk_v = [], [], []
    for p, ks in uses.items():
        prev = None
        for b in ks:
            first = 0 if prev is None else 3 * prev + 3  # after the previous use's hold
            last = 3 * b + 1  # the stall before this use
            row = T + spans
            spans += 1
            if prev is not None:  # kept: charged from the span's start
                eq_r += [row, first]
                eq_c += [n_var, n_var]
                eq_v += [1.0, -fp[p]]
                lo.append(0.0)
                hi.append(1.0)
                n_var += 1
            t = list(range(first, last + 1))
            v = list(range(n_var, n_var + len(t)))
            n_var += len(t)
            lo += [0.0] * len(t)
            hi += [1.0] * len(t)
            eq_r += [row] * len(t) + t
            eq_c += v + v
            eq_v += [1.0] * len(t) + [-fp[p]] * len(t)
            disk_r += t
            disk_c += v
            disk_v += [rb[p]] * len(t)
            leaving[last + 1] += fp[p]  # held from its use's hold on
            prev = b
    for k in range(K):  # a stall reads at most rate x its length
        disk_r.append(3 * k + 1)
        disk_c.append(k)
        disk_v.append(-rate_u)
    A_eq = coo_matrix((eq_v, (eq_r, eq_c)), shape=(T + spans, n_var)).tocsr()
    b_eq = np.concatenate([-leaving, np.ones(spans)])
    A_ub = coo_matrix((disk_v, (disk_r, disk_c)), shape=(T, n_var)).tocsr()
    c = np.zeros(n_var)
    c[counted_from:K] = 1.0
    res = linprog(
        c, A_ub=A_ub, b_ub=rate_u * dur, A_eq=A_eq, b_eq=b_eq, bounds=np.column_stack([lo, hi]), method="highs"
    )
    if res.status != 0:
        raise RuntimeError(f"room_bound: the linear program failed ({res.message})")
    m = steps - warmup
    compute = float(sum(dur[3 * counted_from :])) / m
    stall = max(0.0, float(res.fun)) / m
    return RoomBound(step_s=compute + stall, compute_s=compute, stall_s=stall)
