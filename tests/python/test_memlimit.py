"""What the process may be charged before it is killed (memlimit.py): the
cgroup's limit (v1 and v2, the tightest of its ancestors) or RAM, the
lesser, and the default budget drawn from it."""

import pytest

from mlx_pager import checks, memlimit
from mlx_pager.budget import BudgetError, MemoryPlan


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_v2_limit_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/a/b\n")
    root = tmp_path / "cg"
    write(root / "a" / "b" / "memory.max", "max\n")
    write(root / "a" / "memory.max", "1000000000\n")
    write(root / "memory.max", "3000000000\n")
    assert memlimit.cgroup_limit(proc, root) == 1_000_000_000
    write(root / "a" / "b" / "memory.max", "500000000\n")
    assert memlimit.cgroup_limit(proc, root) == 500_000_000


def test_the_v1_limit_skips_the_unlimited_value(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "5:cpu:/\n4:memory:/x/y\n0::/\n")
    root = tmp_path / "cg"
    write(root / "memory" / "x" / "y" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory" / "x" / "memory.limit_in_bytes", "700000000\n")
    assert memlimit.cgroup_limit(proc, root) == 700_000_000
    write(root / "memory" / "x" / "memory.limit_in_bytes", "9223372036854771712\n")
    assert memlimit.cgroup_limit(proc, root) is None  # v1's "no limit" is no limit


def test_no_cgroup_no_limit(tmp_path):
    assert memlimit.cgroup_limit(tmp_path / "missing", tmp_path) is None
    write(tmp_path / "proc_cgroup", "0::/\n")
    assert memlimit.cgroup_limit(tmp_path / "proc_cgroup", tmp_path / "cg") is None


def limits(monkeypatch, cgroup, ram):
    monkeypatch.setattr(memlimit, "cgroup_limit", lambda: cgroup)
    monkeypatch.setattr(memlimit, "physical_memory", lambda: ram)


def test_the_default_budget_is_80_percent_of_the_cgroup_limit_where_it_is_below_ram(monkeypatch):
    limits(monkeypatch, cgroup=1_000_000_000, ram=24_000_000_000)
    assert memlimit.memory_limit() == 1_000_000_000
    assert memlimit.default_budget() == 800_000_000
    assert memlimit.default_budget_text() == "80% of the memory cgroup's 1.00GB limit"
    limits(monkeypatch, cgroup=32_000_000_000, ram=24_000_000_000)  # a cgroup above RAM: RAM bounds
    assert memlimit.default_budget() == 19_200_000_000
    assert memlimit.default_budget_text() == "80% of RAM"
    limits(monkeypatch, cgroup=None, ram=24_000_000_000)  # no cgroup (macOS): RAM
    assert memlimit.default_budget() == 19_200_000_000
    limits(monkeypatch, cgroup=None, ram=None)
    with pytest.raises(RuntimeError, match="pass --memory-budget"):
        memlimit.default_budget()


def test_a_budget_above_the_cgroup_limit_is_refused_and_above_ram_warned(monkeypatch, capsys):
    limits(monkeypatch, cgroup=700_000_000, ram=24_000_000_000)
    with pytest.raises(BudgetError) as e:
        checks.check_budget_fits(1_000_000_000)
    assert "more than this process's memory cgroup limit 700.00MB" in str(e.value)
    assert "--memory-budget 560.00MB or less" in str(e.value)
    checks.check_budget_fits(700_000_000)  # at the limit: the user's call
    limits(monkeypatch, cgroup=700_000_000 - 1000, ram=24_000_000_000)
    checks.check_budget_fits(700_000_000)  # a cap set to the budget reads back in whole pages
    limits(monkeypatch, cgroup=None, ram=24_000_000_000)
    checks.check_budget_fits(30_000_000_000)
    assert "warning" in capsys.readouterr().err


def test_a_budget_too_small_is_named_as_given_and_the_advice_stays_under_the_limit(monkeypatch):
    """A budget the user did not pass is named as the default; advice to
    raise it past the memory limit would have the kernel kill the run, so
    there it says to raise the limit."""
    limits(monkeypatch, cgroup=346_000_000, ram=24_000_000_000)
    assert memlimit.budget_named(276_800_000, given=False) == (
        "the default memory budget 276.80MB (80% of the memory cgroup's 346.00MB limit)"
    )
    assert memlimit.budget_named(276_800_000, given=True) == "--memory-budget 276.80MB"
    assert memlimit.raise_advice(300_000_000, given=True) == "Raise it to 300.00MB or more"
    assert memlimit.raise_advice(300_000_000, given=False) == "Pass --memory-budget 300.00MB or more (up to 346.00MB)"
    past = memlimit.raise_advice(356_210_000, given=False)
    assert past.startswith("This process may use at most 346.00MB (the memory cgroup's limit): raise that to 356.21MB")
    plan = MemoryPlan(
        budget=276_800_000,
        baseline=110 << 20,
        resident=8 << 20,
        trainable=7 << 20,
        activations=100 << 20,
        slack=67 << 20,
        max_page=62 << 20,
        given=False,
    )
    with pytest.raises(BudgetError) as e:
        plan.check()
    assert str(e.value).startswith("the default memory budget 276.80MB (80% of the memory cgroup's 346.00MB limit)")
    assert "This process may use at most 346.00MB" in str(e.value)
