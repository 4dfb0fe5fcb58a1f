"""bench/bench_train.py's arithmetic that decides a printed ratio."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_train  # noqa: E402

from mlx_pager import simulate  # noqa: E402


def palindrome(blocks):
    """A step that runs blocks forward and back, one page each."""
    order = list(range(blocks)) + list(reversed(range(blocks)))
    return [simulate.Access([p], 0.01, 0.0) for p in order]


def test_min_follows_each_steps_budget_averaged_as_the_reads_are():
    acc, fp = palindrome(8), [100] * 8
    small, large = 650, 750  # 6 and 7 pages
    at_small = simulate.min_pages_per_step(acc, fp, small, steps=8, warmup=2)
    at_large = simulate.min_pages_per_step(acc, fp, large, steps=8, warmup=2)
    assert at_small > at_large
    pages, nbytes = bench_train.min_over_steps(acc, fp, [small, large, large, large])
    # The mean, as a row's reads are averaged: the step at the smaller budget
    # counts (a median would give at_large and blame the policy for it).
    assert pages == (at_small + 3 * at_large) / 4
    assert nbytes == 100 * pages
    assert bench_train.min_over_steps(acc, fp, [large] * 3) == (at_large, 100 * at_large)


def test_min_bytes_are_the_pages_min_reads_at_what_a_read_transfers():
    # Page 2 is used every other access and stays: MIN reads pages 0 and 1.
    acc = [simulate.Access([p], 0.01, 0.0) for p in (0, 2, 1, 2)]
    fp = [1000, 1000, 100]
    pages, nbytes = bench_train.min_over_steps(acc, fp, [2000], price=0.99)
    assert pages == 2 and nbytes == 2 * 1000 * 0.99


def test_the_read_price_is_per_page_of_the_schedule_the_row_ran():
    # The same step: the row's reads transferred 0.99 of the footprints of the
    # pages the schedule reads (0 and 1), whatever the mean page is.
    acc = [simulate.Access([p], 0.01, 0.0) for p in (0, 2, 1, 2)]
    r = dict(
        page_footprints=[1000, 1000, 100],
        page_budget=2000,
        steps=[dict(pages_read=2, bytes_read=1980, readahead=[1, "conservative"])] * 4,
    )
    price = bench_train.read_price(r, acc, simulate.Settings(1, "conservative", "optimal"))
    assert abs(price - 0.99) < 1e-12
