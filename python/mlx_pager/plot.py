"""`mlx-pager plot REPORT.jsonl`: a PNG of what training runs did, from the
JSON lines `mlx-pager lora --report FILE` appends.

It reads the file's run, step and block records and draws one column per
run (a report file appended to by several runs is split at each run's
header record, or where the iteration count starts again):

  top     memory by component over time (one sample per block): the pinned
          page, block pages, the rest of MLX's memory (activations, adapters,
          optimizer state), MLX's buffer cache, and the rest of the process,
          with the process's RSS and the budget (--budget) as lines
  bottom  each optimizer step's time split into waiting on I/O and the rest
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
    return [r for r in runs if not r.empty()]


def load_report(path):
    """(blocks, steps) of every run in the file, concatenated."""
    runs = load_runs(path)
    return [b for r in runs for b in r.blocks], [s for r in runs for s in r.steps]


def _memory(ax, blocks, budget):
    t = [b["t"] for b in blocks]
    mb = 1e6
    pinned = [b["pinned_bytes"] / mb for b in blocks]
    pages = [b["pages_bytes"] / mb for b in blocks]
    other_mlx = [max(0, (b["mlx_active_bytes"] - b["pinned_bytes"] - b["pages_bytes"])) / mb for b in blocks]
    cache = [b["mlx_cache_bytes"] / mb for b in blocks]
    rest = [
        max(0, b["rss_bytes"] / mb - p - q - o - c) for b, p, q, o, c in zip(blocks, pinned, pages, other_mlx, cache)
    ]
    ax.stackplot(
        t,
        pinned,
        pages,
        other_mlx,
        cache,
        rest,
        labels=[
            "pinned page (embeddings, head)",
            "block pages",
            "other MLX (activations, adapters, optimizer)",
            "MLX buffer cache",
            "rest of process",
        ],
    )
    ax.plot(t, [b["rss_bytes"] / mb for b in blocks], color="k", lw=1, label="process RSS")
    if budget:
        ax.axhline(budget / mb, color="r", ls="--", lw=1, label="budget")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax.legend(loc="upper left", fontsize=7)


def _steps(ax, steps):
    it = [s["iteration"] for s in steps]
    io = [s["io_wait_s"] for s in steps]
    compute = [max(0.0, s["step_s"] - s["io_wait_s"]) for s in steps]
    ax.bar(it, compute, label="compute and other work")
    ax.bar(it, io, bottom=compute, label="waiting on I/O")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)


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
            _memory(top, run.blocks, budget)
        top.set_title(f"{name}\nmemory by component, sampled after every block", fontsize=9)
        if run.steps:
            _steps(bottom, run.steps)
        bottom.set_title(f"{name}: step time, I/O wait vs the rest", fontsize=9)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
