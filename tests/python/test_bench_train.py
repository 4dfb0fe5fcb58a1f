"""bench/bench_train.py's arithmetic that decides a printed ratio."""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_train  # noqa: E402

from mlx_pager import simulate  # noqa: E402


def palindrome(blocks):
    """A step that runs blocks forward and back, one page each."""
    order = list(range(blocks)) + list(reversed(range(blocks)))
    return [simulate.Access([p], 0.01, 0.0) for p in order]


def test_min_at_one_budget_is_its_steady_state():
    acc, fp = palindrome(8), [100] * 8
    for budget in (650, 750):  # 6 and 7 pages
        steady = simulate.min_pages_per_step(acc, fp, budget, steps=8, warmup=2)
        pages, nbytes = bench_train.min_over_steps(acc, fp, [budget] * 6, counted=[2, 3, 4, 5])
        assert pages == steady and nbytes == 100 * steady


def test_min_lives_through_the_budgets_the_plan_moved():
    """MIN runs through each step's budget in order: right after the budget
    grew it reads to fill the room (a steady state at the larger budget
    never pays that), and where it shrank it evicts."""
    acc, fp = palindrome(8), [100] * 8
    small, large = 650, 750
    at_small = simulate.min_pages_per_step(acc, fp, small, steps=8, warmup=2)
    at_large = simulate.min_pages_per_step(acc, fp, large, steps=8, warmup=2)
    assert at_small > at_large
    per = simulate.min_reads_by_step([p for a in acc for p in a.pages], fp, [small, small, large, large, large], 7)
    assert per[2] > at_large and per[3:5] == [at_large] * 2  # the step after it grew fills the room
    pages, _ = bench_train.min_over_steps(acc, fp, [small, small, large, large, large], counted=[2, 3, 4])
    assert pages == (per[2] + 2 * at_large) / 3
    down = simulate.min_reads_by_step([p for a in acc for p in a.pages], fp, [large, large, small, small], 6)
    assert down[2:4] == [at_small] * 2  # it shrank: MIN's steady state at the smaller one from then on


def test_min_through_the_budgets_of_the_compute_shapes_pager_at_mlx_lm():
    """The row that showed it (77e86ba's full run): `pager @mlx-lm`, the
    compute shape's 8 blocks forward and back, its budget 89 / 90 / 142 /
    118 / 116 / 116 MB a step. It read 50.4 / 69.3 / 69.3 / 69.3 MB in the
    four steps counted; MIN at each one's budget in a steady state, 51.7 MB
    a step (1.25x); MIN through those budgets reads what the pager did."""
    fp = [17883136, 17887232, 16850944, 18915328, 17903616, 16842752, 16846848, 16822272]
    budgets = [88795398, 90207444, 141791844, 117991772, 115841055, 115841055]
    _, nbytes = bench_train.min_over_steps(palindrome(8), fp, budgets, counted=[2, 3, 4, 5])
    read = (50423787 + 3 * 69322731) / 4
    assert 0.99 <= read / nbytes <= 1.01


def test_min_bytes_are_the_pages_min_reads_at_what_a_read_transfers():
    # Page 2 is used every other access and stays: MIN reads pages 0 and 1.
    acc = [simulate.Access([p], 0.01, 0.0) for p in (0, 2, 1, 2)]
    fp = [1000, 1000, 100]
    pages, nbytes = bench_train.min_over_steps(acc, fp, [2000] * 4, [990, 980, 90], counted=[1, 2, 3])
    assert pages == 2 and nbytes == 990 + 980


def test_min_bytes_count_the_page_min_reads_in_the_window_the_row_counted():
    """q4 at 100% (bcb9ee4's full run, again at this commit): 4-bit blocks of
    different sizes, the frozen prefix (pages 0-3) once a window of 8 steps,
    the trained blocks (4-7) every step. Over budget by less than any page:
    one page a window is read, and which one turns from window to window.
    The row counted its second window and read page 2 there (8990720
    bytes), as MIN does; priced per footprint byte over the pages a replay
    read, MIN came out 0.89x that and the row 1.12x MIN."""
    fp = [12042240, 11341824, 9043968, 9494528, 9330688, 9494528, 10244096, 8552448]
    rb = [12009472, 11296768, 8990720, 9445376, 9281536, 9457831, 10203136, 8507392]  # page_read_bytes
    acc = [simulate.Access([p], 0.2, 0.0) for p in range(4)] + [simulate.Access([4, 5, 6, 7], 1.0, 0.0)] * 8
    pages, nbytes = bench_train.min_over_steps(acc, fp, [72188906] * 3, rb, counted=[2])
    assert pages == 1 and nbytes == 8990720


def lockstep_row(config, tps, steady):
    return {
        "config": config,
        "tokens_per_s": statistics.median(tps[k] for k in steady),
        "steps_tokens_per_s": tps,
        "steady": steady,
        "lockstep": True,
    }


def test_lockstep_pairs_compare_each_step_with_the_others_same_step():
    # The machine slows down within each pair (both rows alike): the ratio
    # per step stays at 1.0, which the rows' medians (taken over different
    # steps: the pager's first two ran another readahead) would not show.
    rows = []
    for i in (1, 2, 3):
        res = [400.0, 390.0, 380.0, 300.0, 290.0, 280.0]
        rows.append(lockstep_row(f"mlx-lm pair {i}", res, [1, 2, 3, 4, 5]))
        rows.append(lockstep_row(f"pager 100% pair {i}", res, [2, 3, 4, 5]))
    p = bench_train.pairs_summary(rows)
    assert p["lockstep"] and p["ratios"] == [1.0, 1.0, 1.0] and len(p["steps"]) == 12 and p["median"] == 1.0
    assert "3 pairs in lockstep, 12 steps" in p["line"]
    # the rows' own medians over their steady steps: 335 against 300
    assert rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] != 1.0


def test_pairs_run_one_after_the_other_keep_their_rows_ratio():
    rows = [{"config": "mlx-lm pair 1", "tokens_per_s": 400.0}, {"config": "pager 100% pair 1", "tokens_per_s": 380.0}]
    p = bench_train.pairs_summary(rows)
    assert not p["lockstep"] and p["ratios"] == [0.95] and p["median"] == 0.95


def test_the_bootstrap_interval_holds_the_median_and_narrows_with_more_steps():
    few = [0.9, 1.1, 0.95, 1.05, 1.0]
    lo, hi = bench_train.bootstrap_interval(few)
    assert lo <= statistics.median(few) <= hi and lo >= min(few) and hi <= max(few)
    lo_many, hi_many = bench_train.bootstrap_interval(few * 12)
    assert hi_many - lo_many < hi - lo
    assert bench_train.bootstrap_interval(few) == (lo, hi)  # a fixed seed: the same run prints the same


def test_a_rows_figures_are_per_window_where_the_prefix_runs_ahead():
    def st(t, n, at, b):
        return dict(
            step_s=t,
            tokens=10,
            bytes_read=b,
            io_wait_s=0.0,
            read_busy_s=0.1,
            pages_read=1,
            mlx_peak=5,
            page_budget_bytes=100,
            readahead=[1, "c"],
            window=[n, at],
        )

    # the first step alone, then two windows of three (the first runs the
    # prefix for all three: slower, more reads) and an incomplete one
    steps = [st(2.0, 1, 0, 9)] + [st(t, 3, i, b) for _ in range(2) for i, (t, b) in enumerate([(3, 6), (1, 3), (1, 3)])]
    steps.append(st(3.0, 3, 0, 6))
    marks = [{"m": i} for i in range(len(steps))]
    out, width = bench_train.by_window(steps, marks)
    assert width == 3 and len(out) == 3
    assert out[1]["step_s"] == 5 / 3 and out[1]["tokens_per_s"] == 30 / 5 and out[1]["bytes_read"] == 4
    assert out[1]["marks"] == marks[1:4] and out[0]["window"] == [1, 0]
    assert out[2]["indices"] == [4, 5, 6]
    # a window cut short by the run's end is another cycle: not counted
    cut = steps[:7] + [st(3.0, 2, 0, 6), st(1.0, 2, 1, 3)]
    out, width = bench_train.by_window(cut, marks[:9])
    assert width == 3 and [w["indices"] for w in out] == [[0], [1, 2, 3], [4, 5, 6]]
    # no window of several: the steps as they are
    alone = [st(1.0, 1, 0, 1) for _ in range(3)]
    assert bench_train.by_window(alone, marks[:3]) == (alone, 1)


def test_lockstep_pairs_compare_a_window_with_mlx_lms_same_steps():
    a = dict(
        config="mlx-lm pair 1",
        lockstep=True,
        steady=[1, 2, 3, 4, 5, 6],
        steps_s=[9, 1, 1, 1, 1, 1, 1],
        steps_tokens_per_s=[1] * 7,
    )
    # the pager's windows of three: 2 + 0.5 + 0.5 s against mlx-lm's 3 x 1 s
    b = dict(
        config="pager 100% pair 1",
        lockstep=True,
        steady=[1, 2],
        windows=[[1, 2, 3], [4, 5, 6]],
        steps_s=[9, 2, 0.5, 0.5, 2, 0.5, 0.5],
        steps_tokens_per_s=[1, 1, 1],
    )
    out = bench_train.pairs_summary([a, b])
    assert out["steps"] == [1.0, 1.0] and out["lockstep"] and "windows of steps" in out["line"]


def test_a_rows_read_rate_for_its_figures_leaves_out_its_first_step():
    # The big shape's first 25% row: 8.2 GB at 88 MB/s in its first step,
    # then ~2 GB/s. Its figures (and the prediction) come from the later
    # steps; the shape's R may still count every step a row ran.
    def st(b, busy):
        return dict(bytes_read=b, read_busy_s=busy, readahead=[1, "a"])

    r = {"steps": [st(8.2e9, 93.0), st(7.2e9, 3.6), st(7.2e9, 3.6)]}
    assert abs(bench_train.busy_read_rate(r, steady=True) - 2e9) < 1
    assert bench_train.busy_read_rate(r) < 0.3e9


def test_a_rows_figures_come_from_the_steps_after_the_first_that_ran_the_last_readahead():
    ra = [2, "conservative"]
    assert bench_train.steady_indices([dict(readahead=ra)] * 3) == [1, 2]
    other = [dict(readahead=ra), dict(readahead=[1, "aggressive"]), dict(readahead=ra)]
    assert bench_train.steady_indices(other) == [2]
    assert bench_train.steady_indices([dict(readahead=ra)]) == [0]  # one step: that one


def test_a_row_that_reads_nothing_after_its_first_step_is_held_to_the_shapes_rate():
    # A lockstep pair at 100%: no disk samples around it, and its steps
    # after the first read nothing (b669623 divided by a rate of 0).
    def st(b, busy):
        return dict(bytes_read=b, read_busy_s=busy, readahead=[1, "c"])

    pair = {"steps": [st(1.6e9, 1.0), st(0, 0.0), st(0, 0.0)]}
    assert bench_train.row_rate(pair, 2e9) == 2e9
    sampled = dict(pair, disk_near=1.5e9)
    assert bench_train.row_rate(sampled, 2e9) == 1.5e9
    fast = {"steps": [st(1e9, 1.0), st(3e9, 1.0)], "disk_near": 1.5e9}
    assert bench_train.row_rate(fast, 2e9) == 2e9  # never above the shape's R


def test_the_rows_are_sampled_at_the_setting_best_over_all_the_shapes_samples():
    # Setting 1 is the luckiest in the last sample, setting 0 the best over
    # all: the rows' rate is read at setting 0 (not the highest of each row's
    # noisy samples).
    samples = [[1.6e9, 1.4e9, 1.2e9], [1.7e9, 1.5e9, 1.3e9], [1.5e9, 1.9e9, 1.1e9]]
    assert bench_train.near_setting(samples) == 0
    assert bench_train.near_setting(samples[2:]) == 1


def test_a_windowed_rows_prediction_uses_the_windows_its_figures_do():
    """The simulator gets a windowed row's compute from the windows its step
    time comes from (steady_indices), not from the first window of several
    (before the readahead choice, and the first to compile)."""

    def step(hold, t0):
        # block 0 forward, block 1 forward, block 1 backward; no waits
        marks = [
            ("forward", 0, t0 + hold, 0.0),
            ("forward", 1, t0 + 2 * hold, 0.0),
            ("backward", 1, t0 + 3 * hold, 0.0),
        ]
        return dict(marks=marks, start=(t0, 0.0), end=(t0 + 3 * hold, 0.0), held=False)

    def window(hold, ra):
        return dict(marks=[step(hold, 0.0), step(hold, 10.0)], readahead=ra, window=[2, 0])

    r = dict(
        window=2,
        steps=[
            dict(marks=[step(1.0, 0.0)], readahead=[2, "c"], window=[1, 0]),
            window(3.0, [2, "c"]),
            window(1.0, [4, "a"]),
        ],
        block_pages=[[0], [1]],
        tail_back_pages=None,
    )
    acc = bench_train.measured_accesses(r)
    assert [a.pages for a in acc] == [(0,), (1,), (1,)] * 2
    assert all(abs(a.hold_s - 1.0) < 1e-9 for a in acc)
    # where every window ran as the last did: all of them but the first step
    r["steps"][1]["readahead"] = [4, "a"]
    acc = bench_train.measured_accesses(r)
    assert all(abs(a.hold_s - 2.0) < 1e-9 for a in acc)  # the median of 3 and 1


def test_ab_rows_give_the_mean_step_with_the_variables_over_without():
    def row(name, step, rate):
        return {"config": name, "step_s": step, "read_Bps": rate}

    rows = [
        row("pager 25%", 0.86, 1.6e9),
        row("env 25%", 0.78, 1.8e9),
        row("pager 10%", 1.0, 1.5e9),  # no 'env 10%' rows: no line for 10%
        row("cons 25%", 0.5, 1.0e9),
        row("env 25% again", 0.82, 1.7e9),
        row("pager 25% again", 0.90, 1.5e9),
    ]
    ab = bench_train.ab_summary(rows, {"OPENBLAS_THREAD_TIMEOUT": "4"})
    assert list(ab["fractions"]) == ["25%"]
    f = ab["fractions"]["25%"]
    assert f["without_s"] == [0.86, 0.90] and f["with_s"] == [0.78, 0.82]
    assert abs(f["ratio"] - 0.80 / 0.88) < 1e-12
    assert "OPENBLAS_THREAD_TIMEOUT=4" in ab["lines"][0] and "0.909x" in ab["lines"][1]
    assert "reads 1.55 -> 1.75GB/s" in ab["lines"][1]
    assert bench_train.ab_summary(rows, {}) == {}


def test_steal_gives_each_rows_host_steal_a_step_and_a_gb_read():
    rows = [
        {"config": "mlx-lm", "steal_s": 0.0},
        {"config": "pager 100%", "steal_s": 0.002, "bytes_per_step": 0.0},
        {"config": "pager 25%", "steal_s": 0.45, "bytes_per_step": 0.9e9},
        {"config": "naive"},  # measured nothing (no /proc/stat): left out
    ]
    st = bench_train.steal_summary(rows)
    assert st["per_step"] == {"mlx-lm": 0.0, "pager 100%": 0.002, "pager 25%": 0.45}
    assert list(st["per_gb"]) == ["pager 25%"] and abs(st["per_gb"]["pager 25%"] - 0.5) < 1e-12
    assert "pager 25% 0.45s (0.50s a GB read)" in st["line"] and "naive" not in st["line"]
    assert st["vs_steal_bound"] == {}  # no resident compute: no bound
    # Held to resident compute plus the steal over the CPUs (or MIN's bytes
    # at R, where that is longer).
    rows[2].update(step_s=1.2, belady_bytes=0.9e9, disk_Bps=3e9)
    rows[1].update(step_s=0.7, belady_bytes=0.0, disk_Bps=3e9)
    st = bench_train.steal_summary(rows, compute=0.7, cpus=2)
    assert abs(st["vs_steal_bound"]["pager 25%"] - 1.2 / (0.7 + 0.225)) < 1e-12
    assert abs(st["vs_steal_bound"]["pager 100%"] - 0.7 / 0.701) < 1e-12
    assert "pager 25% 1.30x" in st["line"]
    rows[2].update(belady_bytes=3.3e9)  # read-bound: 1.1 s at R
    assert abs(bench_train.steal_summary(rows, 0.7, 2)["vs_steal_bound"]["pager 25%"] - 1.2 / 1.1) < 1e-12
    # No row lost a hundredth of a second a step: no line.
    assert bench_train.steal_summary([dict(r, steal_s=0.001) for r in rows[:3]]) == {}
    assert bench_train.steal_summary(rows[3:]) == {}
