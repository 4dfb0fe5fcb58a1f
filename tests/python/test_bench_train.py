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


def test_min_pages_follow_each_steps_budget_averaged_as_the_reads_are():
    acc, fp = palindrome(8), [100] * 8
    small, large = 650, 750  # 6 and 7 pages
    at_small = simulate.min_pages_per_step(acc, fp, small, steps=8, warmup=2)
    at_large = simulate.min_pages_per_step(acc, fp, large, steps=8, warmup=2)
    assert at_small > at_large
    got = bench_train.min_pages_over_steps(acc, fp, [small, large, large, large])
    # The mean, as a row's reads are averaged: the step at the smaller budget
    # counts (a median would give at_large and blame the policy for it).
    assert got == (at_small + 3 * at_large) / 4
    assert bench_train.min_pages_over_steps(acc, fp, [large] * 3) == at_large
