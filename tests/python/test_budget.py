"""Budget strings, and plans that say what would fit."""

import pytest

from mlx_pager.budget import BudgetError, MemoryPlan, baseline_spread, format_size, parse_size


@pytest.mark.parametrize(
    "text, value",
    [
        ("12GB", 12 * 10**9),
        ("512MB", 512 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("900MiB", 900 * 2**20),
        ("4096", 4096),
        ("2TB", 2 * 10**12),
    ],
)
def test_valid_budgets(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text, hint",
    [
        ("12 GB", "Did you mean 12GB?"),
        ("12gb", "Did you mean 12GB?"),
        ("0", "more than zero"),
        ("-1", "must be positive"),
        ("lots", "e.g. 12GB"),
        ("12XB", "unknown unit 'XB'"),
        ("", "e.g. 12GB"),
    ],
)
def test_bad_budgets_say_what_to_write(text, hint):
    with pytest.raises(BudgetError) as e:
        parse_size(text)
    assert hint in str(e.value)
    assert repr(text)[1:-1] in str(e.value)


def test_plan_too_small_names_the_minimum():
    plan = MemoryPlan(
        budget=10**8,
        baseline=5 * 10**7,
        resident=10**7,
        trainable=10**6,
        activations=2 * 10**7,
        slack=10**7,
        max_page=3 * 10**7,
    )
    assert plan.minimum == 5 * 10**7 + 10**7 + 10**6 + 2 * 10**7 + 10**7 + 3 * 10**7
    with pytest.raises(BudgetError) as e:
        plan.check()
    # the least named holds the baseline's spread from run to run
    assert plan.least == plan.minimum + baseline_spread(plan.baseline) > plan.minimum
    assert f"at least {format_size(plan.least, up=True)}" in str(e.value)
    assert "one block page" in str(e.value) and "its spread from run to run 2.10MB" in str(e.value)
    MemoryPlan(
        budget=plan.minimum,
        baseline=5 * 10**7,
        resident=10**7,
        trainable=10**6,
        activations=2 * 10**7,
        slack=10**7,
        max_page=3 * 10**7,
    ).check()


def test_a_least_placement_that_spills_needs_its_checkpoint_pages_too():
    """Where the least placement spills checkpoints, reading them back
    needs pages beside a block's: the least budget counts them (a budget
    holding one block page was taken, and the first backward stopped on a
    full page budget)."""
    sizes = dict(baseline=5 * 10**7, resident=10**7, trainable=10**6, activations=2 * 10**7, slack=10**7)
    one_block = MemoryPlan(budget=10**9, max_page=3 * 10**7, **sizes).minimum
    plan = MemoryPlan(budget=one_block, max_page=3 * 10**7, least_pages=5 * 10**7, **sizes)
    assert plan.minimum == one_block + 2 * 10**7
    with pytest.raises(BudgetError) as e:
        plan.check()
    assert "spilled checkpoints read back 20.00MB" in str(e.value)
    MemoryPlan(budget=plan.minimum, max_page=3 * 10**7, least_pages=5 * 10**7, **sizes).check()


def test_a_size_rounded_up_reads_back_as_at_least_itself():
    """format_size(n, up=True), the least a message tells the user to give:
    parse_size of it is n or more, and within a hundredth of its unit."""
    import random

    rng = random.Random(0)
    for _ in range(20000):
        n = rng.randrange(1, 10 ** rng.randrange(1, 14))
        text = format_size(n, up=True)
        unit = text.lstrip("0123456789.")
        assert n <= parse_size(text) <= n + {"B": 1, "KB": 10, "MB": 10**4, "GB": 10**7, "TB": 10**10}[unit], text
    assert format_size(192512, up=True) == "192.52KB" and format_size(192512) == "192.51KB"
    assert format_size(10**9, up=True) == "1.00GB" and format_size(999.5, up=True) == "1000B"
