"""The room bound (mlx_pager.bound): never above any schedule of the
simulator's model, exact where the step can be worked out by hand, and
above max(MIN's bytes / R, compute) where the budget leaves the disk idle
through a long compute."""

import random

import pytest

from mlx_pager import simulate as sim
from mlx_pager.bound import room_bound


def plain_bound(accesses, footprints, budget, rate, read_bytes=None):
    """The bench's bound: max(MIN's bytes / R, compute)."""
    compute = sum(a.hold_s + a.gap_s for a in accesses)
    return max(sim.min_bytes_per_step(accesses, footprints, budget, read_bytes) / rate, compute)


def test_room_for_one_page_serialises_the_reads():
    # Two pages of 100 bytes used in turn for 0.1 s each, room for one, 1000
    # bytes/s: no read can start while a page is held, and each step reads
    # both (0.1 s each), so a step is 0.2 s of compute and 0.2 s of reads.
    acc = [sim.Access((0,), 0.1), sim.Access((1,), 0.1)]
    b = room_bound(acc, [100, 100], 100, 1000.0)
    assert b.compute_s == pytest.approx(0.2)
    assert b.stall_s == pytest.approx(0.2)
    assert b.step_s == pytest.approx(sim.offline_best(acc, [100, 100], 100, 1000.0).step_s)
    # The bound without the room: the reads would hide under the compute.
    assert plain_bound(acc, [100, 100], 100, 1000.0) == pytest.approx(0.2)


def test_an_ample_budget_leaves_the_compute():
    acc = [sim.Access((0,), 0.1, gap_s=0.03), sim.Access((1,), 0.1)]
    b = room_bound(acc, [100, 100], 200, 1000.0)
    assert b.stall_s == pytest.approx(0.0, abs=1e-9)
    assert b.step_s == pytest.approx(0.23)


def test_a_long_compute_beside_little_room_idles_the_disk():
    # The read shape's window in small: one page computed for long (the
    # frozen prefix for a window's batches), then three used briefly; room
    # for three of the four pages, a read as long as the long compute. The
    # bound without the room (one read and a quarter a step beside 1.15 s
    # of compute) is far under what any schedule gets: while the long page
    # is held only two frames are left for the three pages after it.
    acc = [sim.Access((0,), 1.0)] + [sim.Access((p,), 0.05) for p in (1, 2, 3)]
    fp, budget, rate = [100] * 4, 300, 100.0
    plain = plain_bound(acc, fp, budget, rate)
    b = room_bound(acc, fp, budget, rate)
    opt = sim.offline_best(acc, fp, budget, rate).step_s
    best_policy = sim.best_settings(acc, fp, budget, sim.Disk(rate, 1), max_extra=None).step_s
    assert plain == pytest.approx(1.25)
    assert b.step_s > 1.5 * plain
    assert b.step_s <= opt * (1 + 1e-9) and b.step_s <= best_policy * (1 + 1e-9)
    assert opt <= 1.05 * b.step_s  # the search's best is near it here


def random_step(rnd):
    """A step of whole or split blocks (lazy forward parts: Access.overlaps),
    a backward sweep over some of them, gaps, and reads that transfer other
    bytes than the pages' footprints, with a budget between the largest
    block plus a page and everything."""
    parts = rnd.choice([1, 1, 2, 3])
    blocks = rnd.randint(2, 12 // parts)  # at most 12 pages: the search's victim sets grow fast
    n = blocks * parts
    fp = [rnd.randint(50, 150) for _ in range(n)]
    rb = [max(1, int(f * rnd.uniform(0.8, 1.1))) for f in fp]

    def pages(b):
        return tuple(range(b * parts, (b + 1) * parts))

    acc = []
    for b in range(blocks):
        for k, p in enumerate(pages(b)):
            gap = rnd.choice([0.0, 0.0, rnd.uniform(0, 0.05)])
            acc.append(sim.Access((p,), rnd.uniform(0, 0.2) / parts, gap_s=gap, overlaps=k > 0))
    for b in reversed(range(rnd.randint(0, blocks - 1), blocks)):
        acc.append(sim.Access(tuple(reversed(pages(b))), rnd.uniform(0, 0.3)))
    least = max(sum(fp[p] for p in pages(b)) for b in range(blocks)) + max(fp)
    budget = rnd.randint(min(least, sum(fp)), sum(fp))
    return acc, fp, rb, budget, rnd.uniform(500, 3000)


def test_never_above_any_schedule_on_random_steps():
    # Every policy the simulator runs, and the fastest schedule the search
    # finds (any eviction, any time), take at least the bound; and where the
    # budget idles the disk it says more than the bound without the room.
    rnd = random.Random(7)
    above_plain = 0
    for _ in range(40):
        acc, fp, rb, budget, rate = random_step(rnd)
        b = room_bound(acc, fp, budget, rate, read_bytes=rb).step_s
        opt = sim.offline_best(acc, fp, budget, rate, read_bytes=rb, width=100).step_s
        policies = sim.best_settings(acc, fp, budget, sim.Disk(rate, rnd.choice([1, 4])), max_extra=None, read_bytes=rb)
        assert b <= opt * (1 + 1e-7) + 1e-9
        assert b <= policies.step_s * (1 + 1e-7) + 1e-9
        above_plain += b > 1.01 * plain_bound(acc, fp, budget, rate, rb)
    assert above_plain >= 5


def test_one_step_bounds_longer_runs():
    # The default program (one step counted after one) is at most the one
    # over the simulator's own horizon (four counted after two).
    rnd = random.Random(3)
    for _ in range(15):
        acc, fp, rb, budget, rate = random_step(rnd)
        one = room_bound(acc, fp, budget, rate, read_bytes=rb).step_s
        four = room_bound(acc, fp, budget, rate, read_bytes=rb, steps=6, warmup=2).step_s
        assert one <= four * (1 + 1e-7) + 1e-9


def test_bad_input_is_named():
    acc = [sim.Access((0, 1), 0.1)]
    with pytest.raises(sim.SimBudgetError, match="access 0: its pages need 200 bytes, the page budget is 150"):
        room_bound(acc, [100, 100], 150, 1000.0)
    with pytest.raises(ValueError, match="steps"):
        room_bound(acc, [100, 100], 300, 1000.0, steps=1, warmup=1)
    with pytest.raises(ValueError, match="rate"):
        room_bound(acc, [100, 100], 300, 0.0)
    with pytest.raises(ValueError, match="at least one access"):
        room_bound([], [100], 300, 1000.0)
