"""`mlx-pager plot REPORT.jsonl`: a PNG of what a training run did, from the
JSON lines `--report` writes.

  top     memory by component over time (one sample per block): the pinned
          page, block pages, the rest of MLX's memory (activations, adapters,
          optimizer state), MLX's buffer cache, and the rest of the process
  bottom  each step's time split into waiting on I/O and everything else
"""

from __future__ import annotations

import json
from pathlib import Path


def load_report(path):
    blocks, steps = [], []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "block":
            blocks.append(rec)
        elif rec.get("type") == "step" or "step_s" in rec:
            steps.append(rec)
    return blocks, steps


def plot_report(path, out, budget=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks, steps = load_report(path)
    if not blocks and not steps:
        raise ValueError(f"{path} has no block or step records: write one with --report FILE")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), constrained_layout=True)
    if blocks:
        t = [b["t"] for b in blocks]
        mb = 1e6
        pinned = [b["pinned_bytes"] / mb for b in blocks]
        pages = [b["pages_bytes"] / mb for b in blocks]
        other_mlx = [max(0, (b["mlx_active_bytes"] - b["pinned_bytes"] - b["pages_bytes"])) / mb for b in blocks]
        cache = [b["mlx_cache_bytes"] / mb for b in blocks]
        rest = [max(0, b["rss_bytes"] / mb - p - q - o - c)
                for b, p, q, o, c in zip(blocks, pinned, pages, other_mlx, cache)]
        ax1.stackplot(t, pinned, pages, other_mlx, cache, rest,
                      labels=["pinned page (embeddings, head)", "block pages", "other MLX (activations, adapters, optimizer)",
                              "MLX buffer cache", "rest of process"])
        ax1.plot(t, [b["rss_bytes"] / mb for b in blocks], color="k", lw=1, label="process RSS")
        if budget:
            ax1.axhline(budget / mb, color="r", ls="--", lw=1, label="budget")
        ax1.set_xlabel("seconds")
        ax1.set_ylabel("MB")
        ax1.set_title("memory by component, sampled after every block")
        ax1.legend(loc="upper left", fontsize=8)
    if steps:
        it = [s["iteration"] for s in steps]
        io = [s["io_wait_s"] for s in steps]
        compute = [max(0.0, s["step_s"] - s["io_wait_s"]) for s in steps]
        ax2.bar(it, compute, label="compute and other work")
        ax2.bar(it, io, bottom=compute, label="waiting on I/O")
        ax2.set_xlabel("iteration")
        ax2.set_ylabel("seconds")
        ax2.set_title("step time: I/O wait vs the rest")
        ax2.legend(fontsize=8)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
