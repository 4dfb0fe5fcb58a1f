"""The paged step's targets (issue 9), read from one bench_train run.

    check(summary) -> list[Target]

`summary` is bench_train's results.json: per shape, its rows, the default
rows' two runs ('twice': each ratio of 'pager X%' and 'pager X% again' and
their mean, the figure a target is read from) and the nothing-paged
pairs (in lockstep: the median of their steps' ratios). Each target says
what it asks, the figure this run gave, and whether it was met; a target
whose shape or rows did not run says so ('not run'), never 'met'. Where a
step-time target against the bound is missed and the fastest step any
eviction schedule gets under that budget (`opt s`, simulate.offline_best)
is itself over it, the line says so: no policy reaches the target there,
at that budget and read rate. Where blocks are paged in parts the search
is not exhaustive: its best is a schedule that exists, so the line gives
it as what a schedule reaches, never as what none can.

The targets are goals, not assertions: a missed one is printed, and the run
still succeeds (a row under its bound is what fails a run: bench_train).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

COMPUTE_VS_RESIDENT = 0.98  # nothing paged, against resident mlx-lm
COMPUTE_VS_NAIVE = 1.3  # every budget, compute-bound shape
READ_VS_BOUND = 1.10  # read-bound shape at 50, 25 and 10%
READ_VS_NAIVE = 1.2  # read-bound shape at 10%
BYTES_VS_MIN = 1.10  # wherever the policy chooses its reads
READ_BUDGETS = ("50%", "25%", "10%")


@dataclass
class Target:
    name: str  # what is asked, with its threshold
    status: str  # "met", "MISSED" or "not run"
    figure: str  # what this run gave, and from which rows

    def line(self) -> str:
        return f"   {self.status:<7} {self.name}: {self.figure}"


def _mean(shape: dict, config: str, key: str):
    """The mean of a default row's two runs, or None where either is missing."""
    fig = shape.get("twice", {}).get(config, {}).get(key)
    return fig["mean"] if fig else None


def _runs(shape: dict, config: str, key: str) -> str:
    fig = shape["twice"][config][key]
    return " / ".join(f"{x:.2f}" for x in fig["runs"])


def _budgets(shape: dict) -> list[str]:
    """The default rows' budgets that ran twice ('100%', '50%', ...)."""
    return [c.removeprefix("pager ") for c in shape.get("twice", {}) if c.startswith("pager ") and c.endswith("%")]


def compute_nothing_paged(summary: dict) -> Target:
    name = f"compute-bound, nothing paged >= {COMPUTE_VS_RESIDENT}x resident mlx-lm"
    shape = summary.get("compute", {})
    pairs = shape.get("nothing_paged_pairs") or {}
    if not pairs:
        return Target(name, "not run", "no (mlx-lm, pager 100%) pairs in the compute shape")
    m = pairs["median"]
    each = " / ".join(f"{x:.2f}" for x in pairs["ratios"])
    twice = _mean(shape, "pager 100%", "vs_resident")
    also = f"; 'pager 100%' two runs' mean {twice:.2f}x" if twice is not None else ""
    status = "met" if m >= COMPUTE_VS_RESIDENT else "MISSED"
    if pairs.get("lockstep"):
        how = f"median of {len(pairs['steps'])} steps in {len(pairs['ratios'])} lockstep pairs, the pairs {each}"
        if pairs.get("interval"):
            lo, hi = pairs["interval"]
            how += f"; 90% bootstrap interval {lo:.3f}-{hi:.3f}x"
    else:
        how = f"median of {len(pairs['ratios'])} adjacent pairs, {each}"
    # (three decimals from many steps: the median of a few pairs has two)
    digits = 3 if pairs.get("lockstep") else 2
    return Target(name, status, f"{m:.{digits}f}x ({how}){also}")


def compute_vs_naive(summary: dict) -> Target:
    name = f"compute-bound, every budget >= {COMPUTE_VS_NAIVE}x naive streaming"
    shape = summary.get("compute", {})
    got = {b: _mean(shape, f"pager {b}", "vs_naive") for b in _budgets(shape)}
    got = {b: v for b, v in got.items() if v is not None}
    if not got:
        return Target(name, "not run", "no 'pager X%' rows run twice beside a naive row in the compute shape")
    worst = min(got, key=got.get)
    status = "met" if got[worst] >= COMPUTE_VS_NAIVE else "MISSED"
    each = ", ".join(f"{b} {v:.2f}x" for b, v in got.items())
    return Target(name, status, f"least {got[worst]:.2f}x at {worst} ({each}; means of two runs)")


def read_vs_bound(summary: dict, budget: str) -> Target:
    name = f"read-bound, {budget} <= {READ_VS_BOUND}x the bound"
    shape = summary.get("read", {})
    config = f"pager {budget}"
    v = _mean(shape, config, "vs_bound")
    if v is None:
        return Target(name, "not run", f"no '{config}' row run twice in the read shape")
    figure = f"{v:.2f}x (two runs {_runs(shape, config, 'vs_bound')})"
    if v <= READ_VS_BOUND:
        return Target(name, "met", figure)
    opt = _mean(shape, config, "optimum_vs_bound")
    vs_opt = _mean(shape, config, "vs_optimum")
    capped = _mean(shape, config, "optimum_capped_vs_bound")
    # Blocks in parts: the search's best is what it found, not the best
    # there is, so it shows what a schedule reaches, never what none can.
    exhaustive = not any(
        r.get("optimum_exhaustive") is False
        for r in shape.get("rows", [])
        if r["config"] in (config, f"{config} again")
    )
    fastest = "the fastest eviction schedule" if exhaustive else "the fastest schedule the search finds"
    parts = "" if exhaustive else " (blocks in parts: the search is not exhaustive)"
    if capped is not None:
        # The fastest schedule reads more than the bytes target lets a
        # policy: the step time target is read against the fastest within it.
        over = _mean(shape, config, "optimum_bytes_vs_min")
        reads = f", reading {over:.2f}x MIN's bytes" if over is not None else ", reading over the bytes target"
        figure += (
            f"; {fastest} (opt s) is {opt:.2f}x the bound{reads}{parts}; within the bytes "
            f"target (<= {BYTES_VS_MIN}x MIN) the fastest the search finds is {capped:.2f}x the bound"
            + (" (out of reach for the schedules that keep it)" if exhaustive and capped > READ_VS_BOUND else "")
            + f", and the row {_mean(shape, config, 'vs_optimum_capped'):.2f}x it"
        )
    elif opt is not None and opt > READ_VS_BOUND and exhaustive:
        figure += (
            f"; out of reach for any eviction schedule at this budget and R: the fastest one "
            f"(opt s) is {opt:.2f}x the bound, and the row {vs_opt:.2f}x it"
        )
    elif opt is not None:
        figure += f"; {fastest} (opt s) is {opt:.2f}x the bound{parts}, the row {vs_opt:.2f}x it"
    else:
        figure += "; blocks paged in parts, too many pages for the search (opt s) to compare with"
    room, vs_room = _mean(shape, config, "room_vs_bound"), _mean(shape, config, "vs_room")
    if room is not None and vs_room is not None:
        # A lower bound, where opt s is a schedule found: what no schedule
        # of the plan beats, whatever a search finds.
        figure += (
            f"; counting the room the budget leaves beside what the step holds, no schedule is faster "
            f"than {room:.2f}x the bound (room s), and the row is {vs_room:.2f}x that"
        )
    return Target(name, "MISSED", figure)


def read_vs_naive(summary: dict) -> Target:
    name = f"read-bound, 10% >= {READ_VS_NAIVE}x naive streaming"
    shape = summary.get("read", {})
    v = _mean(shape, "pager 10%", "vs_naive")
    if v is None:
        return Target(name, "not run", "no 'pager 10%' row run twice beside a naive row in the read shape")
    status = "met" if v >= READ_VS_NAIVE else "MISSED"
    return Target(name, status, f"{v:.2f}x (two runs {_runs(shape, 'pager 10%', 'vs_naive')})")


# The rows that run as a user does, the trainer choosing its readahead:
# 'pager X%', 'pager @mlx-lm', their second runs and the nothing-paged pairs
# (not the capped row, which runs at a fixed readahead).
DEFAULT_ROW = re.compile(r"pager (\d+%|@mlx-lm)( again| pair \d+)?")


def _pager_rows(summary: dict, default_only: bool = True):
    """(shape, row) for each row that paged: the default rows, or all."""
    for shape_name, shape in summary.items():
        for row in shape.get("rows", []):
            if "page_budget" in row and (not default_only or DEFAULT_ROW.fullmatch(row["config"])):
                yield shape_name, row


def bytes_vs_min(summary: dict) -> Target:
    name = f"bytes read <= {BYTES_VS_MIN}x Belady's minimum where the policy chooses its reads ('pager' rows)"
    rows = [(s, r) for s, r in _pager_rows(summary) if r.get("belady_pages")]
    if not rows:
        return Target(name, "not run", "no 'pager' row read anything")
    s, worst = max(rows, key=lambda sr: sr[1]["vs_belady"])
    status = "met" if worst["vs_belady"] <= BYTES_VS_MIN else "MISSED"
    med = statistics.median(r["vs_belady"] for _, r in rows)
    return Target(
        name,
        status,
        f"at most {worst['vs_belady']:.2f}x ('{worst['config']}', shape '{s}'), "
        f"median {med:.2f}x over {len(rows)} rows",
    )


def predictions(summary: dict) -> Target:
    name = "every paged row: the simulator's step time beside the measured one"
    rows = list(_pager_rows(summary, default_only=False))
    if not rows:
        return Target(name, "not run", "no paged rows")
    missing = [f"'{r['config']}' ({s})" for s, r in rows if r.get("predicted_s") is None]
    if missing:
        return Target(name, "MISSED", f"no prediction for {', '.join(missing)}")
    s, worst = max(rows, key=lambda sr: abs(sr[1]["vs_predicted"] - 1))
    off = abs(worst["vs_predicted"] - 1) * 100
    return Target(name, "met", f"{len(rows)} rows, within {off:.1f}% ('{worst['config']}', shape '{s}', the farthest)")


def shapes(summary: dict) -> list[Target]:
    out = []
    q4 = summary.get("q4")
    out.append(
        Target(
            "a 4-bit (QLoRA) shape",
            "met" if q4 and q4.get("rows") else "not run",
            f"'q4', {q4['weights_bytes'] / 1e9:.2f} GB of weights" if q4 else "run with --shapes q4",
        )
    )
    big = summary.get("big")
    if not big:
        out.append(Target("a >= 8 GB shape, weights >= 6x the budget", "not run", "opt-in: --shapes big"))
    else:
        rows = [r for _, r in _pager_rows({"big": big})]
        most = max((big["weights_bytes"] / r["page_budget"] for r in rows), default=0.0)
        ok = big["weights_bytes"] >= 8e9 and most >= 6
        out.append(
            Target(
                "a >= 8 GB shape, weights >= 6x the budget",
                "met" if ok else "MISSED",
                f"'big', {big['weights_bytes'] / 1e9:.2f} GB of weights, up to {most:.1f}x the page budget",
            )
        )
    return out


def check(summary: dict) -> list[Target]:
    return [
        compute_nothing_paged(summary),
        compute_vs_naive(summary),
        *[read_vs_bound(summary, b) for b in READ_BUDGETS],
        read_vs_naive(summary),
        bytes_vs_min(summary),
        predictions(summary),
        *shapes(summary),
    ]
