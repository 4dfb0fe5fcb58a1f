"""The governor degrades before the process overruns its budget."""

import mlx.core as mx
import pytest
from test_heap import fragmented_free_heap, free_all, glibc_only

from mlx_pager import heap
from mlx_pager.budget import MemoryPlan, format_size
from mlx_pager.governor import Governor, MemoryPressure, process_rss, release_heap


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


def test_lets_go_of_other_shapes_graphs_before_it_takes_pages():
    """The `graphs` rung (compiled.py): memory outside MLX that the
    compiled graphs of other input shapes hold goes back before any page
    does; where there is none left to let go of, the pages give."""
    import numpy as np

    held = [np.ones(96 << 20, dtype=np.uint8)]  # what the stale graphs hold, touched
    rss = process_rss()
    p = plan(budget=rss - (8 << 20), page_budget=(rss - (8 << 20)) // 2, max_page=1 << 20)
    pager = FakePager()
    gov = Governor(p, pager, pinned_bytes=0, margin=1 << 20)
    gov.drop_stale_graphs = lambda: bool(held) and held.pop() is not None
    gov.check()
    assert [r["rung"] for r in gov.rungs] == ["graphs"]
    assert pager.budget == p.page_budget and process_rss() <= p.budget - (1 << 20)
    gov.lower_budget(process_rss() - (8 << 20))
    gov.check()  # no other shape held: the pages give
    assert [r["rung"] for r in gov.rungs] == ["graphs", "budget", "page_budget"]


def test_quiet_when_under_budget():
    p = plan(budget=process_rss() + (1 << 30), page_budget=256 << 20)
    pager = FakePager()
    gov = Governor(p, pager, pinned_bytes=0)
    gov.check()
    assert gov.events == [] and pager.budget == p.page_budget


@glibc_only
def test_gives_back_the_heap_a_graph_left():
    """Between blocks, free heap a graph left resident (heap.py; here 64 MB
    of 1 KB allocations freed among live ones) goes back to the OS, with no
    rung taken: the process is far under its budget."""

    p = plan(budget=process_rss() + (2 << 30), page_budget=256 << 20)
    pager = FakePager()
    gov = Governor(p, pager, pinned_bytes=0, margin=16 << 20)
    gov.check()  # the memory outside MLX now: the floor
    kept = fragmented_free_heap(64)
    held = process_rss()
    gov.check()
    assert held - process_rss() > 32 << 20
    assert gov.events == [] and pager.budget == p.page_budget
    free_all(kept)


def test_leaves_the_heap_be_where_it_holds_nothing_free(monkeypatch):
    """Memory outside MLX that grew but is not free heap (a page frame MLX
    counts before its read lands, Python's objects) is not trimmed for."""
    import numpy as np

    trims = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    monkeypatch.setattr(heap, "free", lambda: 0)
    gov = Governor(plan(budget=process_rss() + (2 << 30), page_budget=256 << 20), FakePager(), 0, margin=16 << 20)
    gov.check()
    grown = np.ones(64 << 20, dtype=np.uint8)
    gov.check()
    assert trims == [] and grown.sum() == 64 << 20
    monkeypatch.setattr(heap, "free", lambda: 64 << 20)
    gov.check()
    assert trims == [1]


# ------------------------------------------------------------------ ladder --
# Each rung of the ladder, forced in a real run by lowering the budget of the
# running process (Governor.lower_budget, from a callback) before a step, and
# the adapters compared with an unforced run's: a rung changes where memory
# goes, never the math (a split batch sums the same terms in another order).

import copy  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402

from conftest import SAMPLE, write_jsonl  # noqa: E402

from mlx_pager import placement  # noqa: E402
from mlx_pager.budget import BudgetError  # noqa: E402
from mlx_pager.callbacks import PagerCallback  # noqa: E402
from mlx_pager.trainer import DEFAULTS  # noqa: E402
from mlx_pager.trainer import run as paged_run  # noqa: E402

LADDER_SPEC = dict(hidden_size=512, num_hidden_layers=6, intermediate_size=1536, vocab_size=1024, dtype="float32")


class Squeeze(PagerCallback):
    """Lowers the running process's budget to target(session) at the start
    of iteration `at`."""

    def __init__(self, at, target):
        self.at, self.target, self.session = at, target, None

    def on_session(self, session):
        self.session = session

    def on_step_begin(self, iteration, stats):
        if iteration == self.at:
            self.session.gov.lower_budget(int(self.target(self.session)))


@pytest.fixture(scope="module")
def ladder_model(tmp_path_factory):
    from mlx_pager import modelgen

    spec = modelgen.ModelSpec(arch="llama", bits=None, seed=4, **LADDER_SPEC)
    return modelgen.generate_model(tmp_path_factory.mktemp("ladder") / "model", spec)


@pytest.fixture(scope="module")
def ladder_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ladder_data")
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    write_jsonl(d / "train.jsonl", recs[:40])
    return d


def ladder_run(model, data, path, iters=4, cb=None, **kw):
    path.mkdir(parents=True, exist_ok=True)
    a = dict(
        DEFAULTS,
        model=str(model),
        data=str(data),
        train=True,
        iters=iters,
        batch_size=4,
        num_layers=4,
        learning_rate=1e-3,
        steps_per_report=1,
        steps_per_eval=1000,
        save_every=1000,
        seed=0,
        adapter_path=str(path / "ad"),
        memory_budget="3GB",
        ssd_cache_dir=str(path / "cache"),
        report=str(path / "report.jsonl"),
        quiet=True,
    )
    a.update(kw)
    res = paged_run(types.SimpleNamespace(**copy.deepcopy(a)), training_callback=cb)
    return res, mx.load(str(path / "ad" / "adapters.safetensors"))


@pytest.fixture(scope="module")
def unforced(ladder_model, ladder_data, tmp_path_factory):
    res, ad = ladder_run(ladder_model, ladder_data, tmp_path_factory.mktemp("unforced"))
    assert res.governor_rungs == [] and res.steps[-1]["recomputed_blocks"] == 0
    return ad


def same(ref, got, exact):
    assert set(ref) == set(got)
    for k in ref:
        if exact:
            assert mx.array_equal(ref[k], got[k]).item(), k
        else:
            assert mx.allclose(ref[k], got[k], rtol=1e-4, atol=1e-6).item(), (k, mx.abs(ref[k] - got[k]).max())


ORDER = ["cache", "readahead", "page_budget"]


def rung_names(res):
    return [r["rung"] for r in res.governor_rungs if r["rung"] != "budget"]


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """Mostly pages: 16 blocks, adapters on the last 2."""
    from mlx_pager import modelgen

    spec = modelgen.ModelSpec(arch="llama", bits=None, seed=5, **dict(LADDER_SPEC, num_hidden_layers=16))
    return modelgen.generate_model(tmp_path_factory.mktemp("deep") / "model", spec)


def test_cheap_rungs_come_first_and_change_nothing(deep_model, ladder_data, tmp_path):
    """Over budget by half the cached pages: MLX's cache is freed, readahead
    stops and the page budget shrinks, in that order, before anything else;
    training goes on and the adapters are the unforced run's."""
    _, unforced = ladder_run(deep_model, ladder_data, tmp_path / "unforced", num_layers=2)

    def target(s):
        mx.clear_cache()  # what MLX's cache holds varies; the pages do not
        st = s.weights.pager.stats()
        cached = st["resident_bytes"] - st["pinned_bytes"]
        over = process_rss() + s.gov.margin_for(process_rss()) - cached // 2
        # never below what the least placement needs: that is the last rung's test
        least = s.plan.fixed_without_activations + placement.smallest(s.shape, s.sizes).need
        return max(over, least)

    res, ad = ladder_run(deep_model, ladder_data, tmp_path, cb=Squeeze(3, target), num_layers=2)
    names = rung_names(res)
    assert "page_budget" in names, names
    cheap = [n for n in names if n in ORDER]
    assert cheap == sorted(cheap, key=ORDER.index)[: len(cheap)] or cheap[0] in ORDER
    assert names.index("page_budget") < min(
        (names.index(n) for n in ("recompute", "spill", "split") if n in names), default=len(names)
    )
    same(unforced, ad, exact="split" not in names)
    report = [json.loads(l) for l in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert [r["rung"] for r in report if r["type"] == "governor" and r["rung"] != "budget"] == names


def test_other_shapes_graphs_go_before_any_page(ladder_model, tmp_path):
    """Batches of several lengths, each length's compiled graphs kept
    (compiled.py), then a budget a few MB under the process: the graphs of
    the shapes not in use go back first (`graphs`), before readahead or any
    page, and the adapters are the unforced run's bits."""
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    varied = [{"text": " ".join(r["text"] for r in recs[i : i + 1 + i % 4])} for i in range(40)]  # 1-4 records each
    data = tmp_path / "data"
    write_jsonl(data / "train.jsonl", varied)
    kw = dict(batch_size=1, num_layers=2, iters=6)
    _, unforced = ladder_run(ladder_model, data, tmp_path / "unforced", **kw)

    def target(s):
        assert len(s.blocks.fns.shapes()) > 1, "several lengths met"
        release_heap()  # the free heap is given back before any rung (Governor._trim_heap)
        rss = process_rss()
        return rss + s.gov.margin_for(rss) - (4 << 20)

    res, ad = ladder_run(ladder_model, data, tmp_path / "squeezed", cb=Squeeze(5, target), **kw)
    names = rung_names(res)
    assert "graphs" in names, names
    assert names.index("graphs") < min((names.index(n) for n in ("readahead", "page_budget") if n in names), default=99)
    assert not {"recompile", "recompute", "spill", "split", "uncompile"} & set(names), names
    same(unforced, ad, exact=True)


def _need(s, **kw):
    p = placement.evaluate(s.shape, s.sizes, **kw)
    return s.plan.fixed_without_activations + p.need


def test_spill_rung_writes_checkpoints_and_reads_them_back(ladder_model, ladder_data, tmp_path):
    """A budget where the cheapest placement that fits spills checkpoints
    (every block trained, so every one is checkpointed below a short tail;
    batches of one sequence: splitting is no option): the checkpoints are
    spilled and read back, and the adapters are the same bits."""
    L = LADDER_SPEC["num_hidden_layers"]
    _, unforced = ladder_run(ladder_model, ladder_data, tmp_path / "unforced", batch_size=1, num_layers=L)

    def target(s):
        # The planner's own answer: the smallest pool at which its choice
        # (below today's placement) spills.
        for p in sorted(placement.candidates(s.shape, s.sizes), key=lambda p: p.need):
            q = placement.choose(s.shape, s.sizes, p.need, s.page_cap, at_most=s.placement)
            if q is not None and q.spilled:
                return s.plan.fixed_without_activations + p.need
        raise AssertionError("no budget makes this model spill")

    res, ad = ladder_run(ladder_model, ladder_data, tmp_path, cb=Squeeze(2, target), batch_size=1, num_layers=L)
    names = rung_names(res)
    assert "spill" in names, names
    spilled = [st for st in res.steps if st["spilled_blocks"]]
    assert spilled and all(st["spilled_bytes"] == st["spill_read_bytes"] > 0 for st in spilled)
    same(unforced, ad, exact="split" not in names)
    assert not list((tmp_path / "cache").glob("activations-*.swap"))  # removed at the end


def test_split_rung_splits_the_batch_with_the_same_math(ladder_model, ladder_data, tmp_path, unforced):
    """A budget that holds one micro-batch of 2 rows but not the batch of 4,
    whatever else is spilled or recomputed: the batch is split, and the
    adapters equal the unforced run's up to float rounding."""
    L = LADDER_SPEC["num_hidden_layers"]

    def target(s):
        first = s.first_trained
        return (
            _need(s, tail_start=L, parts=2, spilled=L - first) + _need(s, tail_start=L, parts=1, spilled=L - first)
        ) // 2

    res, ad = ladder_run(ladder_model, ladder_data, tmp_path, cb=Squeeze(2, target))
    names = rung_names(res)
    assert "split" in names, names
    assert max(st["batch_parts"] for st in res.steps) >= 2
    same(unforced, ad, exact=False)


def test_last_rung_saves_the_adapters_and_names_what_would_fit(ladder_model, ladder_data, tmp_path):
    """Nothing fits any more: the run stops with the adapters of the last
    finished step saved, and says what budget would do."""
    ref_res, ref = ladder_run(ladder_model, ladder_data, tmp_path / "two", iters=2)
    with pytest.raises(BudgetError, match="Raise --memory-budget to at least") as e:
        ladder_run(ladder_model, ladder_data, tmp_path / "stop", cb=Squeeze(3, lambda s: s.plan.baseline // 2))
    assert "iteration 3 does not fit" in str(e.value) and "iteration 2 are saved" in str(e.value)
    same(ref, mx.load(str(tmp_path / "stop" / "ad" / "adapters.safetensors")), exact=True)
    report = [json.loads(l) for l in (tmp_path / "stop" / "report.jsonl").read_text().splitlines()]
    # before stopping, the compiled graphs were let go of, then the blocks
    # ran uncompiled once more (mx.compile's graphs are memory outside MLX's
    # arrays that no placement gives back)
    assert [r["rung"] for r in report if r["type"] == "governor"][-3:] == ["recompile", "uncompile", "stop"]


class Hog(PagerCallback):
    """From the start of iteration `at` on, holds memory outside MLX
    (touched), as a library's buffers would: `over` bytes more than the room
    the plan's prediction leaves above the run's peak so far."""

    def __init__(self, at, over):
        self.at, self.over, self.session, self.held, self.pages = at, over, None, None, {}

    def on_session(self, session):
        self.session = session

    def on_step_begin(self, iteration, stats):
        s = self.session
        self.pages[iteration] = (s.gov.page_budget, s.plan.slack)
        if iteration == self.at:
            self.held = bytearray(b"\x01" * self.amount(s))

    def amount(self, s) -> int:
        return max(0, s.predicted_peak() - s.gov.peak_rss) + self.over


class FixedHog(Hog):
    """Holds `nbytes` outside MLX (touched) from iteration `at` on, whatever
    the room."""

    def __init__(self, at, nbytes):
        super().__init__(at, 0)
        self.nbytes = nbytes

    def amount(self, s) -> int:
        return self.nbytes


def test_memory_the_plan_did_not_count_joins_its_slack(ladder_model, ladder_data, tmp_path):
    """A step whose peak RSS held more than the plan predicted (64 MB more,
    outside MLX, from iteration 2 on): the slack grows by what went over, the
    pages give it room, and the next steps' predictions hold."""
    hog = Hog(2, 64 << 20)
    res, _ = ladder_run(ladder_model, ladder_data, tmp_path, iters=4, cb=hog)
    steps = res.steps
    over = steps[1]["step_peak_rss_bytes"] - steps[1]["predicted_peak_bytes"]
    assert over > 32 << 20  # the hog was not planned
    (pages2, slack2), (pages3, slack3) = hog.pages[2], hog.pages[3]
    grown = slack3 - slack2
    assert grown >= over - (8 << 20)
    assert pages3 <= pages2 - grown + (8 << 20)  # the pages made room
    for s in steps[2:]:
        assert s["step_peak_rss_bytes"] <= s["predicted_peak_bytes"], s
    # each step's record names the page budget it ran with
    assert [s["page_budget_bytes"] for s in steps] == [hog.pages[i][0] for i in range(1, len(steps) + 1)]


def test_steps_that_peaked_over_the_budget_move_the_next_down_the_ladder(ladder_model, ladder_data, tmp_path):
    """A step's peak over the budget inside a block's graph, between the
    governor's samples (a DoRA run at 1.05x its least budget peaked 7% over
    it every step): the run went on as it was, its plan predicting more than
    the budget, and said nothing. After two such steps in a row (one may be
    a one-off) the next run with a placement that needs less: one that fits,
    else the one that needs the least, and then the run is told once what
    budget its plan needs. Here the budget is lowered after step 1 under
    what the least placement needs, and the peaks of two steps over it are
    taken in."""

    class Under(PagerCallback):
        def on_session(self, session):
            self.s = session

        def on_step(self, record):
            s = self.s
            self.ran = s.placement
            s.gov.lower_budget(s.plan.fixed_without_activations)
            peak = record["step_peak_rss_bytes"]
            s.after_step(s.plan.budget - 1)  # under: no step in a row
            s.after_step(peak)
            self.once = s.placement  # one step over: a one-off, maybe
            s.after_step(peak)
            self.need = s.plan.fixed_without_activations + s.placement.need
            # (the loop then takes in this step's peak: a third over)

    cb = Under()
    res, _ = ladder_run(ladder_model, ladder_data, tmp_path, iters=1, cb=cb)
    s, names = cb.s, rung_names(res)
    least = placement.least(s.shape, s.sizes)
    assert cb.once == cb.ran and cb.ran.need > least.need
    assert s.placement == s.ceiling == least, (cb.ran, s.placement, least)
    assert {"recompute", "split", "spill"} & set(names), names
    need = cb.need  # when told (the loop learns the step's peak after)
    # the loop's own look at the step: nothing needs less, so uncompiled
    assert names[-3:] == [names[-3], "over", "uncompile"] and names.count("over") == 1, names
    over = next(r for r in res.governor_rungs if r["rung"] == "over")
    assert f"--memory-budget {format_size(need, up=True)} or more" in over["what"]


def test_the_slack_holds_a_full_cache_beside_the_memory_outside_mlx(ladder_model, ladder_data, tmp_path):
    """Memory outside MLX that grew after the baseline (32 MB from iteration
    2 on, less than the slack's room for MLX's cache, so no step's peak goes
    over): the slack still grows by it, since a later step's cache may be
    full beside it (a freed page frame there at one step's peak and not at
    another's)."""
    from mlx_pager.budget import CACHE_SLACK

    hog_bytes = 32 << 20
    hog = FixedHog(2, hog_bytes)
    res, _ = ladder_run(ladder_model, ladder_data, tmp_path, iters=4, cb=hog)
    slack3 = hog.pages[3][1]  # learned from steps 1 and 2
    grown = hog.session.outside_grown  # memory outside MLX after each step
    # The measure sees the hog (step to step: from the baseline, the rest of
    # the memory outside MLX grew by 9 MB here, and by less in a clean
    # clone's CI run, where 32 MB + 48 MB - 4 MB failed)...
    assert grown[1] - grown[0] >= hog_bytes // 2, grown
    # ...and the slack holds a full cache beside it, though no step needed
    # that (the old rule left it at CACHE_SLACK and 2%: 56.7 MB here).
    assert slack3 >= CACHE_SLACK + grown[1], (slack3, grown, hog.pages)
    for s in res.steps[2:]:
        assert s["step_peak_rss_bytes"] <= s["predicted_peak_bytes"], s


class PagesCut(PagerCallback):
    """Cuts the page budget to `fraction` of the held tail's need at the
    start of iteration `at` (as the governor's page_budget rung does)."""

    def __init__(self, at, fraction):
        self.at, self.fraction, self.session = at, fraction, None

    def on_session(self, session):
        self.session = session

    def on_step_begin(self, iteration, stats):
        if iteration == self.at:
            from mlx_pager import step

            s = self.session
            L = len(s.model.layers)
            need = sum(s.weights.block_charge_bound(i) for i in range(s.tail_start, L))
            need += max((s.weights.block_charge_bound(i) for i in range(s.tail_start)), default=0)
            assert step.holds_tail(s.weights, s.tail_start, need)
            s.gov.set_page_budget(int(need * self.fraction))


def test_a_held_tail_streams_once_its_pages_no_longer_fit(ladder_model, ladder_data, tmp_path, unforced):
    """The trained blocks run as a held tail (pages bound, vjp compiled)
    while the page budget holds them; cut below that mid-run, the step
    streams the tail instead (the pager's schedule follows, both ways: the
    plan gives the pages their budget back after the step), and the
    adapters are the unforced run's, bit for bit."""
    res, ad = ladder_run(ladder_model, ladder_data, tmp_path, cb=PagesCut(3, 0.6))
    held = [s["tail_held"] for s in res.steps]
    assert held[:3] == [True, True, False], held
    assert res.steps[2]["page_budget_bytes"] < res.steps[1]["page_budget_bytes"]
    # streamed: each tail page acquired forward and again backward
    assert res.steps[2]["acquires"] > res.steps[1]["acquires"]
    assert all(s["recomputed_blocks"] == 0 for s in res.steps)
    same(unforced, ad, exact=True)


class OverOnce(PagerCallback):
    """Makes the governor's first check of iteration `at` see the process
    far over its budget (twice: before and after its cheap rungs), so its
    page_budget rung cuts the page budget to its floor mid-step, as memory
    outside the plan would."""

    def __init__(self, at, monkeypatch):
        from mlx_pager import governor

        self.at, self.over = at, 0
        real = governor.process_rss

        def rss():
            if self.over > 0:
                self.over -= 1
                return 1 << 50
            return real()

        monkeypatch.setattr(governor, "process_rss", rss)

    def on_step_begin(self, iteration, stats):
        if iteration == self.at:
            self.over = 2


def test_a_page_budget_cut_to_its_floor_mid_step_holds_a_block_in_parts(models, train_only_data, tmp_path, monkeypatch):
    """The floor the governor cuts the page budget to holds one block's
    pages at once however their frames were reused. The small llama's parts
    differ by one 4 KB page, so a part's read reuses another's free frame,
    charged a page over its own footprint (Pager::charge_bound): counted at
    the bare footprints, the block's last part found the budget full of its
    other parts, in use, and the step failed with PagerBudgetError."""
    kw = dict(page_parts=4, page_budget=1 << 20, num_layers=2, batch_size=2, store="swap")
    model = models("llama", None)
    _, unforced = ladder_run(model, train_only_data, tmp_path / "unforced", iters=3, **kw)
    res, ad = ladder_run(model, train_only_data, tmp_path / "cut", iters=3, cb=OverOnce(1, monkeypatch), **kw)
    cut = [r for r in res.governor_rungs if r["rung"] == "page_budget"]
    assert len(cut) == 1, rung_names(res)
    assert len(res.steps) == 3
    same(unforced, ad, exact="split" not in rung_names(res))


def test_memory_pressure_in_validation_stops_with_its_message_and_the_adapters_saved(
    ladder_model, tmp_path, monkeypatch
):
    """Evaluation has no smaller placement: MemoryPressure there, once the
    compiled graphs are let go of and the blocks run uncompiled (the test
    below), stops the run. The stop appends where the adapters were saved to the
    message of the same exception (made again from its message alone,
    MemoryPressure, which also takes rss and over, raised a TypeError
    instead: the sweep found it at a validation under the least budget)."""
    from mlx_pager import loop

    real = loop.evaluate
    calls = []

    def squeezed(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryPressure("the process uses too much", 123, 4)
        return real(*args, **kw)

    monkeypatch.setattr(loop, "evaluate", squeezed)
    data = tmp_path / "data"
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    write_jsonl(data / "train.jsonl", recs[:20])
    write_jsonl(data / "valid.jsonl", recs[20:24])
    with pytest.raises(MemoryPressure) as e:
        ladder_run(ladder_model, data, tmp_path / "v", iters=3, steps_per_eval=2, val_batches=1)
    assert str(e.value).startswith("the process uses too much The adapters and resume state of iteration 1 are saved")
    assert (e.value.rss, e.value.over) == (123, 4)
    assert (tmp_path / "v" / "ad" / "adapters.safetensors").exists()


def test_a_validation_over_the_budget_lets_go_of_compiled_graphs_and_runs_again(ladder_model, tmp_path, monkeypatch):
    """MemoryPressure in a validation's sweep (the pages at their least):
    the compiled graphs are let go of and the group runs again, then the
    blocks run uncompiled; the losses are the unsqueezed run's. Only a third
    time does the run stop."""
    from mlx_pager import step as S

    data = tmp_path / "data"
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    write_jsonl(data / "train.jsonl", recs[:20])
    write_jsonl(data / "valid.jsonl", recs[20:24])
    kw = dict(iters=3, steps_per_eval=2, val_batches=1)
    ref, ref_ad = ladder_run(ladder_model, data, tmp_path / "ref", **kw)

    real, calls = S.paged_loss, []

    def squeezed(fail):
        def f(*args, **k):
            calls.append(1)
            if len(calls) in fail:  # the second validation's first and second sweeps
                raise MemoryPressure("over", 1, 1)
            return real(*args, **k)

        return f

    monkeypatch.setattr(S, "paged_loss", squeezed({2, 3}))
    res, ad = ladder_run(ladder_model, data, tmp_path / "v", **kw)
    assert rung_names(res) == ["recompile", "uncompile"]
    assert res.val_losses == ref.val_losses
    same(ref_ad, ad, exact=True)
    calls.clear()
    monkeypatch.setattr(S, "paged_loss", squeezed({2, 3, 4}))
    with pytest.raises(MemoryPressure):
        ladder_run(ladder_model, data, tmp_path / "w", **kw)
