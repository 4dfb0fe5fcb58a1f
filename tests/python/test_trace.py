"""`--trace FILE`: a Chrome trace / Perfetto timeline of a paged training run
(trace.py, csrc/mm/trace.h), checked against the run's own --report, and
`mlx-pager plot --trace` drawing one step of it."""

import json
import signal
import subprocess
import sys
from collections import defaultdict

import pytest
from conftest import SAMPLE

from mlx_pager import PagedTrainer, cli, interrupt
from mlx_pager.callbacks import PagerCallback

PAGES = 1 << 20  # a page budget of about two blocks: pages are read and evicted every step
ITERS = 3


def x_events(events, **match):
    return [e for e in events if e["ph"] == "X" and all(e.get(k) == v for k, v in match.items())]


def start(e):
    """In integer nanoseconds, as Perfetto reads the microseconds written."""
    return round(e["ts"] * 1000)


def end(e):
    return start(e) + round(e.get("dur", 0) * 1000)


def within(inner, outer):
    return start(outer) <= start(inner) and end(inner) <= end(outer)


def check_format(doc):
    """Chrome Trace Event Format as Perfetto reads it: complete events with
    name/ph/ts/dur/pid/tid, thread-scoped instants, thread names; and on each
    thread, complete events strictly nested (no partial overlaps)."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    events = doc["traceEvents"]
    assert {e["ph"] for e in events} == {"X", "i", "M"}
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        elif e["ph"] == "i":
            assert isinstance(e["ts"], (int, float)) and e["s"] == "t", e
        else:
            assert e["name"] in ("thread_name", "thread_sort_index", "process_name"), e
    per_tid = defaultdict(list)
    for e in x_events(events):
        per_tid[e["tid"]].append(e)
    for spans in per_tid.values():
        stack = []
        for e in sorted(spans, key=lambda e: (start(e), -e["dur"])):
            while stack and end(stack[-1]) <= start(e):
                stack.pop()
            assert not stack or end(e) <= end(stack[-1]), f"{e} overlaps {stack[-1]}"
            stack.append(e)
    return events


@pytest.fixture(scope="module")
def traced_run(models, tmp_path_factory):
    """`mlx-pager lora --trace --report` on a small llama under a page budget
    of two blocks (set through -c, as a config file may), validating at
    iterations 1, 2 and 3."""
    tmp = tmp_path_factory.mktemp("traced")
    model = models("llama", None)
    cfg = tmp / "cfg.yaml"
    cfg.write_text(f"page_budget: {PAGES}\n")
    # (in directories not made yet: the run makes them, as --adapter-path's)
    trace, report = tmp / "traces" / "run.trace.json", tmp / "reports" / "report.jsonl"
    rc = cli.lora_main(
        [
            *("--model", str(model), "--train", "--data", str(SAMPLE)),
            *("--iters", str(ITERS), "--batch-size", "2", "--num-layers", "2", "--learning-rate", "1e-3"),
            *("--steps-per-eval", "2", "--val-batches", "2", "--steps-per-report", "1"),
            *("--adapter-path", str(tmp / "adapters"), "--ssd-cache-dir", str(tmp / "cache")),
            *("--trace", str(trace), "--report", str(report), "-c", str(cfg)),
        ]
    )
    assert rc == 0
    doc = json.loads(trace.read_text())
    steps = [r for r in map(json.loads, report.read_text().splitlines()) if r.get("type") == "step"]
    return doc, steps, trace, tmp


def test_trace_is_valid_chrome_trace_json_with_named_rows(traced_run):
    doc, steps, _, _ = traced_run
    events = check_format(doc)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "pager", "io-0", "io-1", "io-2", "io-3", "reads-0"} <= names
    assert doc["otherData"]["dropped_events"] == 0
    assert (
        [e["args"]["iteration"] for e in x_events(events, cat="step")] == [1, 2, 3] == [s["iteration"] for s in steps]
    )


def test_each_step_runs_its_blocks_in_order_then_the_update(traced_run):
    doc, steps, _, _ = traced_run
    events = doc["traceEvents"]
    L, first = doc["otherData"]["blocks"], doc["otherData"]["first_trained_block"]
    assert (L, first) == (4, 2)
    tid = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    for step in x_events(events, cat="step"):
        spans = sorted(
            (
                e
                for e in x_events(events, tid=tid["compute"])
                if e["cat"] in ("forward", "tail", "backward", "update") and within(e, step)
            ),
            key=lambda e: e["ts"],
        )
        got = [(e["cat"], e["args"].get("blocks", e["args"].get("block"))) for e in spans]
        tail = [b for c, b in got if c == "tail"]
        s = tail[0][0] if tail else L  # where the no-recompute tail starts
        expect = [("forward", i) for i in range(s)]
        expect += [("tail", list(range(s, L)))] if tail else []
        expect += [("backward", i) for i in range(min(s, L) - 1, first - 1, -1)] + [("update", None)]
        assert got == expect, step["name"]
        # Each span starts where the one before ended, from the step's start.
        assert start(spans[0]) == start(step)
        for a, b in zip(spans[:-2], spans[1:-1]):
            assert start(b) == end(a)


def test_reads_on_io_threads_add_up_to_each_steps_bytes_read(traced_run):
    doc, steps, _, _ = traced_run
    events = doc["traceEvents"]
    io = {e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"].startswith("io-")}
    chunks = x_events(events, cat="chunk")
    assert chunks and {e["tid"] for e in chunks} <= io
    for rec in steps:
        k = rec["iteration"]
        assert rec["bytes_read"] > 0, "the budget of two blocks makes every step read"
        assert sum(e["args"]["bytes"] for e in chunks if e["args"]["step"] == k) == rec["bytes_read"]
        reads = [e for e in x_events(events, cat="read") if e["args"]["step"] == k]
        assert sum(e["args"]["bytes"] for e in reads) == rec["bytes_read"]
        assert len(reads) == rec["pages_read"]
        # A page's chunks are read between its submission and completion.
        for c in (c for c in chunks if c["args"]["step"] == k):
            (r,) = [
                r
                for r in reads
                if (r["args"]["page_id"], r["args"]["read"]) == (c["args"]["page_id"], c["args"]["read"])
            ]
            assert within(c, r)


def test_acquire_waits_nest_in_the_blocks_that_waited_and_sum_to_io_wait(traced_run):
    doc, steps, _, _ = traced_run
    events = doc["traceEvents"]
    waits = x_events(events, cat="wait")
    assert waits
    blocks = [e for e in x_events(events) if e["cat"] in ("forward", "tail", "backward", "eval")]
    for w in waits:
        assert w["tid"] == blocks[0]["tid"]  # the compute row
        assert any(within(w, b) for b in blocks), w
    for step in x_events(events, cat="step"):
        rec = next(s for s in steps if s["iteration"] == step["args"]["iteration"])
        in_step = [w["dur"] for w in waits if within(w, step)]
        assert sum(in_step) / 1e6 == pytest.approx(rec["io_wait_s"], abs=1e-5 * (1 + len(in_step)))


def test_evictions_are_instants_on_the_pager_row(traced_run):
    doc, _, _, _ = traced_run
    events = doc["traceEvents"]
    pager = next(e["tid"] for e in events if e["name"] == "thread_name" and e["args"]["name"] == "pager")
    evictions = [e for e in events if e["ph"] == "i" and e["cat"] == "evict"]
    assert evictions, "a budget of two blocks evicts"
    assert all(e["tid"] == pager and e["args"]["bytes"] > 0 for e in evictions)
    for step in x_events(events, cat="step"):
        assert any(start(step) <= start(e) <= end(step) for e in evictions)


def test_plot_draws_one_step_of_the_trace(traced_run):
    _, _, trace, tmp = traced_run
    out = tmp / "step2.png"

    def plot(*args):
        return subprocess.run(
            [sys.executable, "-m", "mlx_pager.cli", "plot", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = plot("--trace", trace, "--step", 2, "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    r = plot(trace)  # a trace given where a report goes is recognised; the last step
    assert r.returncode == 0, r.stderr
    assert trace.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    r = plot("--trace", trace, "--step", 99)
    assert r.returncode == 2 and "no step 99" in r.stderr and "[1, 2, 3]" in r.stderr


class StopInStep(PagerCallback):
    """Raises as a SIGINT would, after the forward pass of iteration 2."""

    def __init__(self):
        self.it = 0

    def on_step_begin(self, iteration, stats):
        self.it = iteration

    def on_block(self, weights, phase, block):
        if self.it == 2 and phase in ("tail", "backward"):
            raise interrupt.Interrupted(signal.SIGINT)


def test_trace_is_written_when_the_run_stops(models, tmp_path):
    model = models("llama", None)
    trace = tmp_path / "stopped.json"
    t = PagedTrainer(str(model), ssd_cache_dir=str(tmp_path / "c"), quiet=True, page_budget=PAGES, trace=str(trace))
    with pytest.raises(interrupt.Interrupted):
        t.lora(
            SAMPLE,
            iters=5,
            batch_size=2,
            num_layers=2,
            steps_per_eval=1000,
            val_batches=1,
            adapter_path=str(tmp_path / "a"),
            training_callback=StopInStep(),
        )
    events = check_format(json.loads(trace.read_text()))
    assert [e["args"]["iteration"] for e in x_events(events, cat="step")] == [1]  # step 2 never finished
    after = [e for e in x_events(events, cat="forward") if start(e) >= end(x_events(events, cat="step")[0])]
    assert [e["args"]["block"] for e in after] == [0, 1, 2, 3][: len(after)] and after  # step 2's forward
    assert not list(tmp_path.glob(".stopped.*"))  # no temporary file left
