"""`mlx-pager plot REPORT.jsonl`: a PNG of what training runs did, from the
JSON lines `mlx-pager lora --report FILE` appends.

It reads the file's run, step and block records and draws one column per
run (a report file appended to by several runs is split at each run's
header record, or where the iteration count starts again):

  top     memory by component over time (one sample per block): the pinned
          page, block pages, checkpoints held in memory, the rest of MLX's
          memory (working set, adapters, optimizer state), MLX's buffer
          cache, and the rest of the process, with the process's RSS, the
          checkpoints spilled to the SSD and the budget (--budget) as lines,
          and each rung the memory governor took as a dotted line
  bottom  each optimizer step's time split into waiting on I/O and the rest

`mlx-pager plot --trace TRACE.json [--step N]`: one optimizer step's timeline
from the file `mlx-pager lora --trace FILE` writes (trace.py): a row per
thread. compute: each block's forward, no-recompute tail and backward, the
optimizer update, and (in red, below) the time acquire() waited for a page;
io-0..N: the chunk reads of each I/O thread (one colour per page) and the
checksum verification after them; pager: evictions. Default: the last step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List


class Run:
    def __init__(self, header: dict | None = None):
        self.header = header or {}
        self.blocks: List[dict] = []
        self.steps: List[dict] = []
        self.rungs: List[dict] = []  # the memory governor's ladder (governor.py)

    def empty(self) -> bool:
        return not self.blocks and not self.steps


def load_runs(path) -> List[Run]:
    """The runs in a report file, in order."""
    runs = [Run()]
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e}): is it a --report file?") from None
        kind = rec.get("type")
        if kind == "run":
            runs.append(Run(rec))
        elif kind == "step" or "step_s" in rec:
            cur = runs[-1]
            if cur.steps and rec.get("iteration", 0) <= cur.steps[-1].get("iteration", 0):
                runs.append(Run())  # an older file without run headers: a new run began
            runs[-1].steps.append(rec)
        elif kind == "block":
            runs[-1].blocks.append(rec)
        elif kind == "governor":
            runs[-1].rungs.append(rec)
    return [r for r in runs if not r.empty()]


def load_report(path):
    """(blocks, steps) of every run in the file, concatenated."""
    runs = load_runs(path)
    return [b for r in runs for b in r.blocks], [s for r in runs for s in r.steps]


def memory_by_component(ax, blocks, budget, rungs=()):
    """Stacks the memory components of `blocks` (--report block records)
    on `ax`, with RSS, spilled checkpoints, the budget and the rungs."""
    t = [b["t"] for b in blocks]
    mb = 1e6
    pinned = [b["pinned_bytes"] / mb for b in blocks]
    pages = [b["pages_bytes"] / mb for b in blocks]
    ckpt = [b.get("checkpoint_bytes", 0) / mb for b in blocks]
    other_mlx = [
        max(0, (b["mlx_active_bytes"] - b["pinned_bytes"] - b["pages_bytes"])) / mb - c for b, c in zip(blocks, ckpt)
    ]
    other_mlx = [max(0.0, o) for o in other_mlx]
    cache = [b["mlx_cache_bytes"] / mb for b in blocks]
    rest = [
        max(0, b["rss_bytes"] / mb - p - q - k - o - c)
        for b, p, q, k, o, c in zip(blocks, pinned, pages, ckpt, other_mlx, cache)
    ]
    ax.stackplot(
        t,
        pinned,
        pages,
        ckpt,
        other_mlx,
        cache,
        rest,
        labels=[
            "pinned page (embeddings, head)",
            "block pages",
            "checkpoints in memory",
            "other MLX (working set, adapters, optimizer)",
            "MLX buffer cache",
            "rest of process",
        ],
    )
    ax.plot(t, [b["rss_bytes"] / mb for b in blocks], color="k", lw=1, label="process RSS")
    spilled = [b.get("spilled_now_bytes", 0) / mb for b in blocks]
    if any(spilled):
        ax.plot(t, spilled, color="tab:purple", ls="--", lw=1.2, label="checkpoints spilled to the SSD (not in RAM)")
    if budget:
        ax.axhline(budget / mb, color="r", ls="--", lw=1, label="budget")
    for r in rungs:
        if r.get("rung") != "cache" and "t" in r:
            ax.axvline(r["t"], color="tab:red", lw=0.8, ls=":")
            ax.annotate(r["rung"], (r["t"], ax.get_ylim()[1]), rotation=90, fontsize=6, va="top", color="tab:red")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax.legend(loc="upper left", fontsize=6, ncol=2, framealpha=0.85)


def _steps(ax, steps):
    it = [s["iteration"] for s in steps]
    io = [s["io_wait_s"] for s in steps]
    compute = [max(0.0, s["step_s"] - s["io_wait_s"]) for s in steps]
    ax.bar(it, compute, label="compute and other work")
    ax.bar(it, io, bottom=compute, label="waiting on I/O")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)


def _header_budget(header: dict):
    from .budget import BudgetError, parse_size

    try:
        return parse_size(header["memory_budget"]) if header.get("memory_budget") else None
    except BudgetError:
        return None


def plot_report(path, out, budget=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(path)
    if not runs:
        raise ValueError(f"{path} has no block or step records: write one with `mlx-pager lora --report FILE`")
    fig, axes = plt.subplots(2, len(runs), figsize=(10 * len(runs), 7), constrained_layout=True, squeeze=False)
    for k, run in enumerate(runs):
        h = run.header
        name = f"run {k + 1}" + (f": {Path(str(h['model'])).name}" if h.get("model") else "")
        name += f", budget {h['memory_budget']}" if h.get("memory_budget") else ""
        top, bottom = axes[0][k], axes[1][k]
        if run.blocks:
            memory_by_component(top, run.blocks, budget or _header_budget(h), run.rungs)
        top.set_title(f"{name}\nmemory by component, sampled after every block", fontsize=9)
        if run.steps:
            _steps(bottom, run.steps)
        bottom.set_title(f"{name}: step time, I/O wait vs the rest", fontsize=9)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ trace --

_PHASE_COLORS = {
    "forward": "tab:blue",
    "tail": "tab:purple",
    "backward": "tab:orange",
    "eval": "tab:cyan",
    "update": "tab:green",
    "validation": "lightgrey",
}


def trace_step(events, step=None):
    """(the step's span, the events of that step's window) of a trace: step
    `step` (its iteration), or the last one. The window starts early enough
    to hold the reads counted in the step (readahead starts some in the
    step before)."""
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "step"]
    if not steps:
        raise ValueError("the trace has no optimizer steps: was it written by `mlx-pager lora --train --trace FILE`?")
    if step is None:
        span = steps[-1]
    else:
        found = [e for e in steps if e["args"].get("iteration") == step]
        if not found:
            its = [e["args"].get("iteration") for e in steps]
            raise ValueError(f"the trace has no step {step}; its steps are {its}")
        span = found[0]
    k = span["args"].get("iteration")
    lo, hi = span["ts"], span["ts"] + span["dur"]
    for e in events:
        if e.get("ph") == "X" and e.get("args", {}).get("step") == k and e.get("cat") in ("chunk", "read"):
            lo = min(lo, e["ts"])
    inside = []
    for e in events:
        if e.get("ph") not in ("X", "i"):
            continue
        end = e["ts"] + e.get("dur", 0)
        if end >= lo and e["ts"] <= hi:
            inside.append(e)
    return span, lo, hi, inside


def plot_trace(path, out, step=None):
    """Draws one optimizer step of a --trace file into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from .trace import load_trace, thread_names

    events = load_trace(path)
    names = thread_names(events)
    span, lo, hi, inside = trace_step(events, step)
    io_tids = sorted(t for t, n in names.items() if n.startswith("io-"))
    compute = next((t for t, n in names.items() if n == "compute"), 1)
    pager = next((t for t, n in names.items() if n == "pager"), 2)
    rows = [compute] + io_tids + [pager]  # top to bottom
    y = {tid: len(rows) - 1 - r for r, tid in enumerate(rows)}
    t0 = span["ts"]

    def ms(us):
        return (us - t0) / 1000.0

    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.55 * len(rows)), constrained_layout=True)
    page_colors, palette = {}, plt.get_cmap("tab20b").colors
    wait_total = 0.0
    for e in inside:
        tid, cat = e["tid"], e.get("cat")
        if tid not in y:
            continue
        row = y[tid]
        if e["ph"] == "i":
            if cat == "evict":
                ax.vlines(ms(e["ts"]), row - 0.35, row + 0.35, color="crimson", lw=1.2)
            continue
        x, w = ms(e["ts"]), e["dur"] / 1000.0
        if tid == compute:
            if cat in _PHASE_COLORS and cat != "validation":
                ax.broken_barh([(x, w)], (row - 0.05, 0.4), color=_PHASE_COLORS[cat], edgecolor="white", lw=0.5)
                if w > (hi - lo) / 1000.0 / 60:
                    label = e["name"].split(" ", 1)[-1] if cat != "update" else "upd"
                    ax.text(x + w / 2, row + 0.15, label, ha="center", va="center", fontsize=6, color="white")
            elif cat in ("wait", "reclaim"):
                wait_total += w
                color = "red" if cat == "wait" else "darkred"
                ax.broken_barh([(x, max(w, 1e-3))], (row - 0.4, 0.3), color=color)
        elif tid in io_tids:
            if cat in ("chunk", "reread"):
                page = e["args"].get("page", "")
                color = page_colors.setdefault(page, palette[len(page_colors) % len(palette)])
                ax.broken_barh([(x, w)], (row - 0.35, 0.7), color=color, edgecolor="white", lw=0.3)
            elif cat == "verify":
                ax.broken_barh([(x, w)], (row - 0.35, 0.2), color="dimgrey")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([names.get(t, str(t)) for t in reversed(rows)])
    ax.set_xlim(ms(lo), ms(hi))
    ax.set_xlabel("ms from the start of the step")
    a = span["args"]
    title = f"{Path(str(path)).name}: step {a.get('iteration')}, {span['dur'] / 1000:.1f} ms"
    if "bytes_read" in a:
        title += f", {a['bytes_read'] / 1e6:.1f} MB read"
    title += f", acquire waits {wait_total:.1f} ms"
    ax.set_title(title, fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in _PHASE_COLORS.items() if k not in ("eval", "validation")]
    handles += [
        Patch(color="red", label="acquire wait"),
        Patch(color="darkred", label="reclaim wait"),
        Patch(color="dimgrey", label="verify"),
        Patch(color=palette[0], label="chunk reads (a colour per page)"),
        Patch(color="crimson", label="eviction"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
