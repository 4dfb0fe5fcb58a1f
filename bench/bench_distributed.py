"""Data-parallel paged training: 2 ranks against 1, side by side in one run.

    python bench/bench_distributed.py [--steps 6] [--budget 600MB]

Same generated model (float32 Llama), data and per-rank batch: one rank with
batch B, then `mlx.launch -n 2 --backend ring` with batch 2B (each rank B).
Each rank pages from its own cache directory under the same per-rank budget.
Prints step time (median after the first step), tokens/s and the 2-rank /
1-rank throughput ratio.

What it shows on one machine: whether the data-parallel path (sharded batches,
one all-reduce of the adapter gradients per optimizer step over the ring
backend, rank-0 reporting) costs more than the work it splits. Both ranks here
share the machine's cores and disk, so the ratio is NOT the scaling of two
Macs: on two machines each rank has its own cores, memory and SSD, and the
ratio approaches 2x minus the all-reduce time (adapter gradients only: MBs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlx_pager import modelgen


def run(n: int, model: Path, data: Path, batch: int, steps: int, budget: str, work: Path) -> dict:
    report = work / f"report-{n}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "mlx_pager.cli",
        "lora",
        "--model",
        str(model),
        "--train",
        "--data",
        str(data),
        "--iters",
        str(steps),
        "--batch-size",
        str(batch),
        "--num-layers",
        "4",
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        str(10**6),
        "--max-seq-length",
        "256",
        "--memory-budget",
        budget,
        "--ssd-cache-dir",
        str(work / f"cache-{n}"),
        "--adapter-path",
        str(work / f"ad-{n}"),
        "--report",
        str(report),
    ]
    if n > 1:
        launch = Path(sys.executable).parent / "mlx.launch"
        cmd = [str(launch), "-n", str(n), "--backend", "ring", "--", *cmd]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.exit(f"{n} rank(s) failed:\n{out.stderr[-3000:]}")
    steps_ = [json.loads(l) for l in report.read_text().splitlines() if '"type": "step"' in l]
    step_s = statistics.median(s["step_s"] for s in steps_[1:])
    # tokens in a step record are rank 0's; every rank trains as many.
    tokens = statistics.median(s["tokens"] for s in steps_[1:]) * n
    return {"ranks": n, "batch": batch, "step_s": step_s, "tokens_per_s": tokens / step_s, "wall_s": wall}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--budget", default="600MB", help="Per-rank memory budget.")
    p.add_argument("--work", default=None, help="Work directory (default: a temporary one).")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-dist-"))
    spec = modelgen.ModelSpec(
        arch="llama",
        hidden_size=1024,
        num_hidden_layers=12,
        intermediate_size=4096,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        dtype="float32",
        bits=None,
        seed=0,
    )
    model = modelgen.generate_model(work / "model", spec)
    print(
        f"model {modelgen.weight_bytes(model) / 1e9:.2f} GB, per-rank budget {a.budget}, "
        f"batch {a.batch_per_rank} per rank, {a.steps} steps"
    )
    rows = [
        run(1, model, modelgen.SAMPLE_DATA, a.batch_per_rank, a.steps, a.budget, work),
        run(2, model, modelgen.SAMPLE_DATA, 2 * a.batch_per_rank, a.steps, a.budget, work),
    ]
    print(f"{'ranks':>5} {'batch':>5} {'step s':>8} {'tokens/s':>9} {'vs 1 rank':>9}")
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['batch']:>5} {r['step_s']:>8.2f} {r['tokens_per_s']:>9.1f} "
            f"{r['tokens_per_s'] / rows[0]['tokens_per_s']:>8.2f}x"
        )
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
