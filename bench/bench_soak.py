"""Soak: a long run at a small page budget, watching for leaks (not CI).

    python bench/bench_soak.py [--steps 300] [--fraction 0.25] [--num-layers N] [--out DIR]

Generates a model (once, under --out), LoRA-trains it for --steps steps with
the swap store (checksummed pages) and a page budget of --fraction of the
paged weights, so that blocks are read from the swap file every step, with
LoRA on the last --num-layers blocks (default: half of them, as mlx-lm's
default of 16 is of most models, so that the frozen prefix runs ahead of the
steps in windows, prefix.py), and prints:

  - the RSS slope: a least-squares line through the RSS after each step
    (the first 10 steps, warm-up, left out), in bytes per step and MB per
    100 steps; a leak shows as a steady positive slope;
  - open file descriptors and OS threads before the run and after it (the
    pager, its I/O threads and its files gone), and after a second, short
    run in the same process (nothing accumulates from run to run);
  - the pager's counters: pages and bytes read, retries, checksum errors.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from mlx_pager import modelgen
from mlx_pager.trainer import DEFAULTS
from mlx_pager.trainer import run as paged_run


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def slope(xs, ys):
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--out", default="bench_out/soak")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=None, help="trained blocks (default: half of --layers)")
    a = ap.parse_args()
    trained = a.num_layers if a.num_layers is not None else max(1, a.layers // 2)
    out = Path(a.out).resolve()
    spec = modelgen.ModelSpec(
        arch="llama",
        bits=None,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=4 * a.hidden,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = modelgen.generate_model(out / f"model-{spec.key()}", spec)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text((modelgen.SAMPLE_DATA / "train.jsonl").read_text())

    # The paged bytes: every tensor of the blocks (the swap pages).
    from mlx_pager._core import read_safetensors_index

    paged = 0
    for f in model.glob("model*.safetensors"):
        tensors = read_safetensors_index(str(f))[0]
        paged += sum(t[3] for n, t in tensors.items() if ".layers." in n)

    def run(steps, adapters):
        args = dict(
            DEFAULTS,
            model=str(model),
            data=str(data),
            train=True,
            iters=steps,
            batch_size=2,
            num_layers=trained,
            learning_rate=1e-4,
            steps_per_report=50,
            steps_per_eval=10**9,
            save_every=10**9,
            seed=0,
            adapter_path=str(out / adapters),
            ssd_cache_dir=str(out / "cache"),
            store="swap",
            page_budget=int(paged * a.fraction),
            quiet=True,
        )
        return paged_run(types.SimpleNamespace(**args))

    gc.collect()
    before = (fds(), threads())
    res = run(a.steps, "adapters")
    gc.collect()
    after = (fds(), threads())
    run(5, "adapters2")
    gc.collect()
    again = (fds(), threads())

    steps = res.steps[10:] if len(res.steps) > 20 else res.steps
    xs = [s["iteration"] for s in steps]
    rss = [s["rss_bytes"] for s in steps]
    k = slope(xs, rss)
    st = res.pager_stats
    report = {
        "steps": len(res.steps),
        "paged_bytes": paged,
        "page_budget": int(paged * a.fraction),
        "rss_first_mb": rss[0] / 2**20,
        "rss_last_mb": rss[-1] / 2**20,
        "rss_slope_bytes_per_step": k,
        "rss_slope_mb_per_100_steps": k * 100 / 2**20,
        "peak_rss_mb": res.peak_rss / 2**20,
        "fds_before_after_again": [before[0], after[0], again[0]],
        "threads_before_after_again": [before[1], after[1], again[1]],
        "pages_read": st["pages_read"],
        "bytes_read_gb": st["bytes_read"] / 1e9,
        "io_retries": st["io_retries"],
        "checksum_errors": st["checksum_errors"],
        "loss_first_last": [res.steps[0]["loss"], res.steps[-1]["loss"]],
        "step_s_median": sorted(s["step_s"] for s in res.steps)[len(res.steps) // 2],
        "trained_blocks": trained,
        # steps that ran in a window of the frozen prefix (more than one step)
        "windowed_steps": sum(1 for s in res.steps if s.get("window", (1, 0))[0] > 1),
        "widest_window": max((s.get("window", (1, 0))[0] for s in res.steps), default=1),
    }
    for key, v in report.items():
        print(f"{key:28s} {v:.4g}" if isinstance(v, float) else f"{key:28s} {v}")
    (out / "soak.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
