"""The memory budget: parsing it, and splitting it between what must stay
resident and the pages.

The budget covers the whole process (what a cgroup or the OS would charge):

    budget = process baseline (Python, libraries, tokenizer, data)
           + resident set   (pinned page: embeddings, final norm, LM head)
           + trainable state (adapters, their gradients, optimizer state)
           + activations    (block checkpoints, one block's forward+backward
                              working set, one chunk of head logits)
           + slack          (MLX's buffer cache, allocator rounding; grown to
                             what the steps measure beyond the other terms)
           + page budget    (block pages resident or in flight; at least one)

The page budget is what is left; it must hold the largest block's page.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_FORMAT = "a number and a unit with no space, e.g. 12GB, 512MB or 1.5GiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"


# What MLX's buffer cache and allocator rounding may hold beside everything
# else, before a step has measured more (the plan's first slack, and the
# cache limit's floor). No page frame: the frame the pager keeps for its next
# read (mlx_frames.h) is one whose free lowered the pager's charge, so it
# stays within the page budget.
CACHE_SLACK = 48 << 20


def baseline_spread(baseline: int) -> int:
    """How far the process's baseline (its RSS as the session opens) moves
    between runs of one command: the least budget a refusal names holds it,
    so that the same command given that budget is not refused again (a
    sweep: "at least 183.20MB", then given it, "at least 183.46MB", then
    183.75MB; baselines of one command measured 95.9-97.0 MB)."""
    return max(2 << 20, int(baseline) // 100)


class BudgetError(ValueError):
    """A memory budget that cannot be used; the message says what would."""


def parse_size(text, what: str = "--memory-budget") -> int:
    """Bytes in `text` ("12GB", "512MiB", "1.5GB" or a plain byte count).

    Raises BudgetError naming the input and the expected form for anything
    else, including "12 GB", "12gb", "0", "-1" and "lots"."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise BudgetError(f"{what} must be positive, got {text}")
        return text
    s = str(text)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", s)
    if m is None:
        hint = ""
        m2 = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", s)
        if m2 and m2.group(1).startswith("-"):
            hint = " A budget must be positive."
        elif m2:
            unit = _canonical_unit(m2.group(2))
            if unit:
                hint = f" Did you mean {m2.group(1)}{unit}?"
        raise BudgetError(f"invalid {what} '{s}': write {_FORMAT}.{hint}")
    number, unit = m.group(1), m.group(2) or "B"
    if unit not in _UNITS:
        canon = _canonical_unit(unit)
        hint = f" Did you mean {number}{canon}? (units are case-sensitive)" if canon else ""
        raise BudgetError(f"invalid {what} '{s}': unknown unit '{unit}'; write {_FORMAT}.{hint}")
    value = int(float(number) * _UNITS[unit])
    if value <= 0:
        raise BudgetError(f"invalid {what} '{s}': it must be more than zero bytes")
    return value


def _canonical_unit(unit: str):
    for u in _UNITS:
        if u.lower() == unit.lower() or u.lower() == unit.lower() + "b":
            return u
    return None


def format_size(n: float, up: bool = False) -> str:
    """Decimal units, as budgets are usually written: 1.23GB, 456MB.

    `up`: rounded up, for a least value a message tells the user to give:
    parse_size of the text is then at least `n` (rounded to nearest, a
    suggested "at least 192.51KB" parsed to 192510 bytes, 2 under the least,
    and the same message came back when the user gave it)."""
    n = float(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            if not up:
                return f"{n / scale:.2f}{unit}"
            hundredths = math.ceil(n / scale * 100)
            while int(float(f"{hundredths / 100:.2f}") * _UNITS[unit]) < n:  # as parse_size reads it back
                hundredths += 1
            return f"{hundredths / 100:.2f}{unit}"
    return f"{math.ceil(n) if up else int(n)}B"


@dataclass
class MemoryPlan:
    budget: int
    baseline: int
    resident: int
    trainable: int
    activations: int
    slack: int
    max_page: int
    margin: int = 0  # kept free: the governor acts when the process nears budget - margin
    given: bool = True  # the user's --memory-budget (False: the default, memlimit.default_budget)
    # The pages the least placement holds at once, where more than one
    # block's: a block's and its spilled checkpoints read back (placement.py).
    least_pages: int = 0

    @property
    def fixed_without_activations(self) -> int:
        return self.baseline + self.resident + self.trainable + self.slack + self.margin

    @property
    def fixed(self) -> int:
        """Everything but the pages."""
        return self.fixed_without_activations + self.activations

    @property
    def page_budget(self) -> int:
        return self.budget - self.fixed

    @property
    def least_page_budget(self) -> int:
        """What the pages need at least: one block's, or the least
        placement's pages where it spills checkpoints."""
        return max(self.max_page, self.least_pages)

    @property
    def minimum(self) -> int:
        """The smallest budget that holds the least pages besides the rest."""
        return self.fixed + self.least_page_budget

    @property
    def least(self) -> int:
        """The least budget a message names: the minimum, and the baseline's
        spread from run to run (breakdown lists both)."""
        return self.minimum + baseline_spread(self.baseline)

    def breakdown(self) -> str:
        spilled = self.least_pages - self.max_page
        pages = f"one block page {format_size(self.max_page)}"
        if spilled > 0:
            pages += f" + spilled checkpoints read back {format_size(spilled)}"
        return (
            f"{pages} + resident set "
            f"(embeddings, norm, head) {format_size(self.resident)} + adapters and "
            f"optimizer state {format_size(self.trainable)} + activations "
            f"{format_size(self.activations)} + process {format_size(self.baseline)} "
            f"+ its spread from run to run {format_size(baseline_spread(self.baseline))} "
            f"+ slack {format_size(self.slack + self.margin)}"
        )

    def check(self) -> None:
        """Raises BudgetError naming the minimum when the budget cannot hold
        one block page besides everything else."""
        if self.page_budget < self.least_page_budget:
            from .memlimit import budget_named, raise_advice

            raise BudgetError(
                f"{budget_named(self.budget, self.given)} is too small for this "
                f"model and batch: it needs at least {format_size(self.least, up=True)} "
                f"({self.breakdown()}). {raise_advice(int(self.least * 1.05), self.given)}, "
                "or lower --max-seq-length (batches are already split down to one sequence)."
            )
