"""The governor degrades before the process overruns its budget."""

import mlx.core as mx
import pytest

from mlx_pager.budget import MemoryPlan
from mlx_pager.governor import Governor, MemoryPressure, process_rss, return_freed_memory_to_os


class FakePager:
    def __init__(self):
        self.budget = 0

    def set_budget(self, b):
        old, self.budget = self.budget, b
        return old


@pytest.fixture(autouse=True)
def restore_mlx_limits():
    cache, memory = mx.set_cache_limit(0), mx.set_memory_limit(0)
    mx.set_cache_limit(cache)
    mx.set_memory_limit(memory)
    yield
    mx.set_cache_limit(cache)
    mx.set_memory_limit(memory)


def plan(budget, page_budget, max_page=8 << 20):
    fixed = budget - page_budget
    return MemoryPlan(budget=budget, baseline=fixed, resident=0, trainable=0, activations=0, slack=0, max_page=max_page)


def test_shrinks_the_page_budget_when_the_process_runs_over():
    rss = process_rss()
    p = plan(budget=rss - (4 << 20), page_budget=(rss - (4 << 20)) // 2, max_page=1 << 20)  # just over
    pager = FakePager()
    gov = Governor(p, pager, pinned_bytes=1 << 20, margin=1 << 20)
    assert pager.budget == (1 << 20) + p.page_budget
    gov.check()
    assert pager.budget < (1 << 20) + p.page_budget
    assert any("page budget" in e for e in gov.events)
    assert gov.peak_rss >= rss - (16 << 20)


def test_stops_with_the_memory_needed_when_no_page_fits():
    rss = process_rss()
    p = plan(budget=rss // 2, page_budget=16 << 20, max_page=12 << 20)
    gov = Governor(p, FakePager(), pinned_bytes=0, margin=1 << 20)
    gov.check()  # shrinks the page budget to one page: that is all it can give
    assert gov.page_budget == 12 << 20
    with pytest.raises(MemoryPressure, match="Raise --memory-budget to at least"):
        gov.check()
    assert [r["rung"] for r in gov.rungs] == ["page_budget"]


def test_quiet_when_under_budget():
    p = plan(budget=process_rss() + (1 << 30), page_budget=256 << 20)
    pager = FakePager()
    gov = Governor(p, pager, pinned_bytes=0)
    gov.check()
    assert gov.events == [] and pager.budget == p.page_budget


def test_mallopt_applies_on_glibc():
    import sys

    assert return_freed_memory_to_os() == sys.platform.startswith("linux")
