"""bench/resimulate.py: a run's pager rows simulated again from raw-SHAPE.json."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import resimulate  # noqa: E402

PAGE = 100 << 20


def step_marks(blocks, hold, t0):
    """One step's on_block marks: blocks forward, then backward, one page
    each, `hold` seconds of compute per block and no waits."""
    marks, t = [], t0
    for phase, order in (("forward", range(blocks)), ("backward", reversed(range(blocks)))):
        for b in order:
            t += hold
            marks.append((phase, b, t, 0.0))
    return dict(marks=marks, start=(t0, 0.0), end=(t, 0.0), held=False)


def row(blocks=6, budget_pages=2, hold=0.01, rate=1e9, steps=5, window=1):
    """A pager row as bench_train's worker returns it: `steps` steps (or
    windows of `window` steps) of a palindrome of one-page blocks, whose
    reads got `rate` bytes/s while in flight."""
    each = [step_marks(blocks, hold, 100.0 * i) for i in range(steps * window)]
    read = (2 * blocks - budget_pages) * PAGE  # bytes a step reads, about
    if window == 1:
        recs = [dict(marks=m, readahead=[1.0, "conservative"], window=[1, 0]) for m in each]
        marks = each
    else:
        recs = [
            dict(marks=each[w * window : (w + 1) * window], readahead=[1.0, "conservative"], window=[window, 0])
            for w in range(steps)
        ]
        marks = each
    for s in recs:
        # a window's figures are its steps' means (bench_train.by_window)
        s.update(step_s=2 * blocks * hold, io_wait_s=0.0, bytes_read=read, bytes_landed=read, read_busy_s=read / rate)
    return dict(
        steps=recs,
        marks=marks,
        window=window,
        block_pages=[[b] for b in range(blocks)],
        tail_back_pages=[[b] for b in range(blocks)],
        page_footprints=[PAGE] * blocks,
        page_read_bytes=[PAGE] * blocks,
        page_budget=budget_pages * PAGE + PAGE // 2,
        settings=[1.0, "conservative", "optimal"],
    )


def test_a_windowed_row_is_given_per_step():
    """A row recorded as windows of 3 steps gives, per step, what the same
    steps recorded one by one give (the window's figures are its share)."""
    one = resimulate.resimulate_row(row(window=1), R=2e9)
    three = resimulate.resimulate_row(row(window=3), R=2e9)
    for a, b in (
        (one.predicted_s, three.predicted_s),
        (one.choice_at_R.step_s, three.choice_at_R.step_s),
        (one.choice_at_rate.step_s, three.choice_at_rate.step_s),
        (one.best_s, three.best_s),
        (one.room_s, three.room_s),
        (one.step_s, three.step_s),
    ):
        assert abs(a - b) <= 0.02 * a, (a, b)
    # per step, not per window: one step's reads (10 pages of 100 MB) at 1 GB/s
    assert 0.5 < three.predicted_s < 1.5


def test_the_prediction_reads_at_the_rate_the_rows_reads_got():
    fast = resimulate.resimulate_row(row(rate=2e9), R=4e9)
    slow = resimulate.resimulate_row(row(rate=0.5e9), R=4e9)
    assert abs(fast.rate - 2e9) < 1e3 and abs(slow.rate - 0.5e9) < 1e3
    # read-bound: a quarter the rate, about four times the step
    assert 3.0 < slow.predicted_s / fast.predicted_s < 4.5
    assert slow.best_s > fast.best_s
    # the choice made at the rate the reads got is the fastest at that rate
    for r in (fast, slow):
        assert r.choice_at_rate.step_s <= r.choice_at_R.step_s * 1.001
        assert r.best_s <= r.choice_at_rate.step_s * 1.001
        # no schedule beats the room bound, at that rate too
        assert r.room_s <= r.best_s * (1 + 1e-6)
    assert slow.room_s > fast.room_s


def test_only_pager_rows_that_recorded_steps_are_simulated(tmp_path, capsys):
    raw = {
        "R": 2e9,
        "results": {
            "mlx-lm": {"steps": [{"step_s": 1.0}]},  # not a pager row
            "pager 25%": row(),
            "pager 10%": row(budget_pages=1),
            "pager 50%": dict(row(), marks=[]),  # no step recorded
        },
    }
    assert [r.config for r in resimulate.resimulate(raw)] == ["pager 25%", "pager 10%"]
    assert [r.config for r in resimulate.resimulate(raw, rows=["pager 10"])] == ["pager 10%"]
    path = tmp_path / "raw-read.json"
    path.write_text(json.dumps(raw))
    resimulate.main([str(path)])
    out = capsys.readouterr().out
    assert "pager 25%" in out and "pager 10%" in out and "mlx-lm" not in out and "pager 50%" not in out


def test_a_file_that_is_not_a_raw_dump_is_named_in_one_line(tmp_path, capsys):
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"read": {}}))
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            resimulate.main([str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert str(path) in err and "raw-SHAPE.json" in err and "Traceback" not in err
