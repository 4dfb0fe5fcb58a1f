"""A bench_train run's pager rows simulated again, from its raw-SHAPE.json.

    python bench/resimulate.py bench_out/raw-read.json [--rows "pager 25%,pager 10%"]

For each pager row (its steps, per-access compute and page sizes as the
worker returned them), per step:
  step s      as measured (the median of the steps its figures come from)
  got GB/s    the rate its reads got while in flight (busy_read_rate)
  pred s      the simulator's step at that rate with the settings it ran
  choice      the automatic choice (simulate.choose_readahead) at the
              shape's R and at the rate the reads got, and the simulator's
              step for each at the latter: whether the rate the reads get
              while training would change what the trainer picks
  best s      the fastest schedule the search finds (simulate.offline_best)
              at the rate the reads got, where the search is feasible
              (blocks whole, or up to bench_train.OPT_PARTS_MAX_PAGES pages)
  room s      the bound counting the room (bound.room_bound) at the rate
              the reads got: no schedule of the row's accesses under its
              budget is faster (best s is one found, room s none beats)

What a row's measured step, its prediction, the pager's choice and the
search's best say side by side is where its time goes: the row against its
prediction is what the simulator does not model; the prediction against
the best, what the pager's policy leaves; the best against the room bound,
what the search may leave; the room bound against the bound, what the
budget and the plan's structure allow no schedule to hide. Rows whose
prefix runs ahead are simulated per window and given per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import bench_train  # noqa: E402

from mlx_pager import simulate  # noqa: E402


@dataclass
class Choice:
    settings: simulate.Settings
    step_s: float  # per step, simulated at the rate the row's reads got


@dataclass
class Row:
    config: str
    ran: simulate.Settings  # the settings its figures' steps ran with
    step_s: float
    rate: float  # bytes/s its reads got while in flight
    predicted_s: float
    choice_at_R: Choice
    choice_at_rate: Choice
    best_s: Optional[float]  # None where the search is not run
    room_s: float  # the bound counting the room, at the rate the reads got


def resimulate_row(r: dict, R: float, config: str = "") -> Row:
    """One pager row of a raw-SHAPE.json (a worker's result, named `config`)
    at the shape's R; every time is per step (a window's share where the
    prefix runs ahead). The prediction and the search's best are the
    bench's own (bench_train.pager_figures), here both at the rate the row's
    reads got."""
    rate = bench_train.busy_read_rate(r, steady=True) or R
    fig = bench_train.pager_figures(r, rate, rate, None)
    acc, per, unit = fig["accesses"], r.get("window", 1), bench_train.pages_per_block(r)
    fp, rb, budget = r["page_footprints"], r["page_read_bytes"], r["page_budget"]
    depth, mode, policy = r["settings"]
    disk = simulate.Disk(rate, bench_train.IO_THREADS)

    def choice(at):
        c = simulate.choose_readahead(
            acc, fp, budget, simulate.Disk(at, bench_train.IO_THREADS), policy, unit=unit, read_bytes=rb
        )
        if at != rate:
            c = simulate.simulate(acc, fp, budget, disk, c.settings, read_bytes=rb)
        return Choice(c.settings, c.step_s / per)

    return Row(
        config=config,
        ran=simulate.Settings(round(depth * unit), mode, policy),
        step_s=statistics.median(s["step_s"] for s in bench_train.steady_steps(r["steps"])),
        rate=rate,
        predicted_s=fig["predicted"].step_s,
        choice_at_R=choice(R),
        choice_at_rate=choice(rate),
        best_s=fig["optimum"].step_s if fig["optimum"] is not None else None,
        room_s=fig["room"],
    )


def resimulate(raw: dict, rows=None):
    """The pager rows of a raw-SHAPE.json (those named in `rows`, by prefix,
    where given), in the run's order."""
    out = []
    for name, r in raw["results"].items():
        if "page_budget" not in r or not r.get("marks"):
            continue  # not a pager row, or no step recorded
        if rows and not any(name.startswith(x) for x in rows):
            continue
        out.append(resimulate_row(r, raw["R"], config=name))
    return out


def _label(s: simulate.Settings, unit: int) -> str:
    return f"ra {s.readahead / unit:g} {s.mode[:4]}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", nargs="+", help="bench_train's raw-SHAPE.json files")
    ap.add_argument("--rows", default=None, help="only rows whose names start with one of these (comma-separated)")
    a = ap.parse_args(argv)
    rows = [x.strip() for x in a.rows.split(",")] if a.rows else None
    for path in a.raw:
        try:
            raw = json.loads(Path(path).read_text())
            if not isinstance(raw, dict) or not {"R", "results"} <= raw.keys():
                raise ValueError("no 'R' and 'results'")
        except (OSError, ValueError) as e:
            ap.exit(
                2,
                f"resimulate: {path}: not a bench_train raw-SHAPE.json ({e}); pass one that a run wrote to its --out\n",
            )
        units = {n: bench_train.pages_per_block(r) for n, r in raw["results"].items() if "block_pages" in r}
        print(f"== {path}: R {raw['R'] / 1e9:.2f}GB/s")
        print(
            f"   {'config':<18} {'ran':<12} {'step s':>7} {'got GB/s':>8} {'pred s':>7} "
            f"{'choice at R':<12} {'its s':>6} {'choice at got':<13} {'its s':>6} {'best s':>7} {'room s':>7}"
        )
        for row in resimulate(raw, rows):
            u = units[row.config]
            best = f"{row.best_s:7.3f}" if row.best_s is not None else f"{'':7}"
            print(
                f"   {row.config:<18} {_label(row.ran, u):<12} {row.step_s:7.3f} {row.rate / 1e9:8.2f} "
                f"{row.predicted_s:7.3f} {_label(row.choice_at_R.settings, u):<12} {row.choice_at_R.step_s:6.3f} "
                f"{_label(row.choice_at_rate.settings, u):<13} {row.choice_at_rate.step_s:6.3f} {best} "
                f"{row.room_s:7.3f}"
            )


if __name__ == "__main__":
    main()
