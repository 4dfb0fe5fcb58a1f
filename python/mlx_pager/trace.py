"""``--trace FILE``: a timeline of a training run that a person can read, in
the Chrome Trace Event Format that https://ui.perfetto.dev (and
chrome://tracing) opens.

The pager records its side in C++ (csrc/mm/trace.h): each chunk read on each
I/O thread, each page read from submission to completion, the checksum
verification, acquire() waits and evictions. ``TraceCallback`` adds the
training loop's side through the callback hooks (callbacks.py): each optimizer
step, each block's forward, backward and no-recompute tail, the optimizer
update, validation and checkpoints, timed on the same clock
(``_core.trace_now_ns``). A block's span runs from where the previous one
ended to the ``on_block`` call after it; the tail's blocks run as one graph,
so they are one span.

Rows (threads of one process):

  compute     steps, blocks, the update, validation; acquire waits nested in
              the block that waited ("wait <page>": for a read readahead
              started too late, or a fault's own read; "reclaim <page>":
              waiting for memory to free)
  pager       evictions (instants)
  io-0..N     the chunk reads of each I/O thread, and each page's
              verification on the thread that completed its read
  reads-0..M  each page read from submission to completion, one lane per
              read in flight at once

Every read carries the step it is counted in (``args.step``): reads are
matched to the step records of ``--report`` exactly, through the pager's
bytes_read counter that each read event carries.

The file is written atomically (files.py) when the run ends, also when it
stops on an error or a signal; until then events are spooled to a temporary
file, so a long run holds no more than a step's events in memory.
"""

from __future__ import annotations

import bisect
import json
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import files
from .callbacks import PagerCallback

PID = 1
COMPUTE, PAGER = 1, 2
IO_BASE, LANE_BASE = 100, 1000  # tids of io-0.. and reads-0..


def _now_ns() -> int:
    from ._core import trace_now_ns

    return trace_now_ns()


class TraceCallback(PagerCallback):
    """Records a run's timeline and writes it to `path` on close()."""

    def __init__(self, path, io_threads: int = 4, run_info: Optional[dict] = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)  # now, not after the run
        self.io_threads = io_threads
        self.run_info = dict(run_info or {})
        self.t0 = _now_ns()
        self.spool = tempfile.TemporaryFile("w+")
        self.pager = None
        self.names: Dict[int, str] = {}
        self.mark = self.t0  # where the compute row's next span starts
        self.step: Optional[dict] = None
        self.steps: List[Tuple[int, int, int]] = []  # (iteration, bytes_read before, after)
        self.tail: Optional[dict] = None  # the tail's span, while its blocks report
        self.update_start: Optional[int] = None
        self.val_start: Optional[int] = None
        self.closed = False

    # ---- spooling ----

    def _span(self, name: str, cat: str, start: int, end: int, tid: int = COMPUTE, **args):
        self.spool.write(json.dumps(["X", name, cat, start, end, tid, args]) + "\n")

    def _instant(self, name: str, cat: str, t: int, tid: int, **args):
        self.spool.write(json.dumps(["i", name, cat, t, t, tid, args]) + "\n")

    def _drain(self):
        if self.pager is None:
            return
        for e in self.pager.take_trace():
            self._page(e[2])  # its name, while the pager is here to tell
            self.spool.write(json.dumps(["p", *e]) + "\n")

    def _page(self, pid: int) -> str:
        if pid not in self.names:
            self.names[pid] = self.pager.page_name(pid)
        return self.names[pid]

    def _flush_tail(self):
        if self.tail is not None:
            t = self.tail
            lo, hi = min(t["blocks"]), max(t["blocks"])
            name = f"tail {lo}" if lo == hi else f"tail {lo}-{hi}"
            self._span(name, "tail", t["start"], t["end"], blocks=sorted(t["blocks"]))
            self.tail = None

    # ---- hooks ----

    def on_session(self, session):
        self.pager = session.weights.pager
        self.run_info.setdefault("blocks", len(session.model.layers))
        self.run_info.setdefault("first_trained_block", session.first_trained)
        self.pager.enable_trace(True)
        self.mark = _now_ns()
        self._instant("session open", "run", self.mark, COMPUTE)

    def on_step_begin(self, iteration, stats):
        self._flush_tail()
        now = _now_ns()
        self.step = {"iteration": iteration, "start": now, "bytes_before": stats["bytes_read"]}
        self.mark = now

    def on_block(self, weights, phase, block):
        now = _now_ns()
        if phase == "tail":
            # The tail's blocks ran as one graph; they report one after another.
            if self.tail is None:
                self.tail = {"start": self.mark, "end": now, "blocks": []}
            self.tail["blocks"].append(block)
            self.tail["end"] = now
            self.mark = now
            return
        self._flush_tail()
        if phase == "eval" and self.step is None and self.val_start is None:
            self.val_start = self.mark
        self._span(f"{phase} {block}", phase, self.mark, now, block=block)
        self.mark = now

    def on_update_begin(self):
        self._flush_tail()
        self.update_start = _now_ns()

    def on_update_end(self):
        now = _now_ns()
        if self.update_start is not None:
            self._span("update", "update", self.update_start, now)
        self.update_start = None
        self.mark = now

    def on_step(self, record):
        self._flush_tail()
        now = _now_ns()
        st = self.step or {"iteration": record.get("iteration"), "start": self.mark, "bytes_before": None}
        keep = ("loss", "tokens", "step_s", "io_wait_s", "bytes_read", "pages_read", "faults", "readahead_hits")
        self._span(
            f"step {record['iteration']}",
            "step",
            st["start"],
            now,
            iteration=record["iteration"],
            **{k: record[k] for k in keep if k in record},
        )
        if st["bytes_before"] is not None:
            self.steps.append((record["iteration"], st["bytes_before"], st["bytes_before"] + record["bytes_read"]))
        self.step = None
        self.mark = now
        self._drain()

    def on_val_loss_report(self, info):
        self._flush_tail()
        now = _now_ns()
        start = self.val_start if self.val_start is not None else self.mark
        self._span("validation", "validation", start, now, **info)
        self.val_start = None
        self.mark = now
        self._drain()

    def on_train_loss_report(self, info):
        self.mark = _now_ns()  # what follows (a validation, a save) starts here

    def on_save(self, path, iteration):
        now = _now_ns()
        self._instant("save", "save", now, COMPUTE, path=str(path), iteration=iteration)
        self.mark = now

    def close(self):
        if self.closed:
            return
        self.closed = True
        self._flush_tail()
        dropped = 0
        if self.pager is not None:
            self.pager.enable_trace(False)
            self._drain()
            dropped = self.pager.trace_dropped
            self.pager = None  # the run's pager may go now
        try:
            write_trace(self.path, self.spool, self.t0, self.steps, self.names, self.io_threads, self.run_info, dropped)
        finally:
            self.spool.close()


# ---------------------------------------------------------------- writing --

# Raw pager events in the spool: ["p", kind, thread, page, read, bytes, total,
# start_ns, end_ns, readahead, failed] (Pager.take_trace's tuples).


def _us(ns: int, t0: int) -> float:
    return round((ns - t0) / 1000.0, 3)


def write_trace(path, spool, t0, steps, names, io_threads, run_info, dropped=0) -> Path:
    """Writes the spooled events as Chrome trace JSON, atomically."""
    bounds = sorted(steps, key=lambda s: s[1])
    lows = [b[1] for b in bounds]

    def step_of(total: int) -> Optional[int]:
        k = bisect.bisect_left(lows, total) - 1  # the last step whose before < total
        if k >= 0 and bounds[k][1] < total <= bounds[k][2]:
            return bounds[k][0]
        return None

    # Pass 1: every page read's step, and a lane for each read (reads in
    # flight at once go on different lanes, so that spans never overlap).
    spool.seek(0)
    reads: Dict[Tuple[int, int], dict] = {}
    max_io = io_threads - 1
    for line in spool:
        r = json.loads(line)
        if r[0] != "p":
            continue
        kind, thread = r[1], r[2]
        if thread >= 0:
            max_io = max(max_io, thread)
        if kind == "read":
            reads[(r[3], r[4])] = {"start": r[7], "end": r[8], "step": step_of(r[6]) if not r[10] else None}
    lane_ends: List[int] = []
    for rd in sorted(reads.values(), key=lambda x: (x["start"], x["end"])):
        free = [k for k, busy_until in enumerate(lane_ends) if busy_until <= rd["start"]]
        if not free:
            lane_ends.append(0)
            free = [len(lane_ends) - 1]
        lane_ends[free[0]] = rd["end"]
        rd["lane"] = free[0]

    def page(pid):
        return names.get(pid, f"page {pid}")

    def chrome(r) -> Optional[dict]:
        if r[0] in ("X", "i"):
            _, name, cat, start, end, tid, args = r
            ev = {"name": name, "cat": cat, "ph": r[0], "ts": _us(start, t0), "pid": PID, "tid": tid, "args": args}
            if r[0] == "X":
                ev["dur"] = round((end - start) / 1000.0, 3)
            else:
                ev["s"] = "t"
            return ev
        _, kind, thread, pid, read, nbytes, total, start, end, readahead, failed = r
        args = {"page": page(pid), "page_id": pid}
        tid = IO_BASE + thread if thread >= 0 else COMPUTE
        if kind == "evict":
            return {
                "name": f"evict {page(pid)}",
                "cat": "evict",
                "ph": "i",
                "s": "t",
                "ts": _us(start, t0),
                "pid": PID,
                "tid": PAGER,
                "args": {**args, "bytes": nbytes},
            }
        rd = reads.get((pid, read))
        if kind in ("chunk", "reread", "verify", "read"):
            args.update(read=read, step=rd["step"] if rd else None)
        if kind in ("chunk", "reread", "read"):
            args["bytes"] = nbytes
        if failed:
            args["failed"] = True
        if kind == "read":
            args.update(readahead=bool(readahead), total_bytes_read=total)
            tid = LANE_BASE + rd["lane"]
            name = f"{page(pid)} ({'readahead' if readahead else 'fault'})"
        elif kind == "chunk":
            name = f"read {page(pid)}"
        elif kind == "wait":
            args["late_readahead"] = bool(readahead)
            name = f"wait {page(pid)}"
        else:
            name = f"{kind} {page(pid)}"
        return {
            "name": name,
            "cat": kind,
            "ph": "X",
            "ts": _us(start, t0),
            "dur": round((end - start) / 1000.0, 3),
            "pid": PID,
            "tid": tid,
            "args": args,
        }

    rows = [(COMPUTE, "compute"), (PAGER, "pager")]
    rows += [(IO_BASE + k, f"io-{k}") for k in range(max_io + 1)]
    rows += [(LANE_BASE + k, f"reads-{k}") for k in range(len(lane_ends))]
    meta = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": "mlx-pager"}}]
    for order, (tid, name) in enumerate(rows):
        meta.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid, "args": {"sort_index": order}})

    def write(tmp):
        with open(tmp, "w") as out:
            out.write('{"displayTimeUnit": "ms",\n')
            other = {**run_info, "clock": "steady, microseconds from the trace start", "dropped_events": dropped}
            out.write(f'"otherData": {json.dumps(other, default=str)},\n')
            out.write('"traceEvents": [\n')
            first = True
            for ev in meta:
                out.write(("" if first else ",\n") + json.dumps(ev))
                first = False
            spool.seek(0)
            for line in spool:
                ev = chrome(json.loads(line))
                if ev is not None:
                    out.write(",\n" + json.dumps(ev))
            out.write("\n]}\n")

    return files.atomic_write(path, write)


def load_trace(path) -> List[dict]:
    """The trace events of a --trace file."""
    try:
        doc = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}): is it a --trace file?") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} has no traceEvents: write one with `mlx-pager lora --trace FILE`")
    return doc["traceEvents"]


def is_trace(path) -> bool:
    """Whether `path` looks like a trace (JSON object) rather than a --report (JSON lines)."""
    try:
        with open(path) as f:
            head = f.read(64)
    except OSError:
        return False
    return head.lstrip().startswith('{"displayTimeUnit"') or head.lstrip().startswith('{"traceEvents"')


def thread_names(events) -> Dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
