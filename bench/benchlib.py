"""What the benchmarks share: running one configuration in its own process
(so its peak RSS is its own, with OpenBLAS preloaded as the CLI does), and
the direct-read rate of files with dd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_worker(script: str, cfg: dict) -> dict:
    """Runs `script --worker CFG` and returns the JSON after its RESULT line."""
    from mlx_pager.blas import openblas_path

    env = dict(os.environ)
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = lib
    out = subprocess.run(
        [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker {cfg.get('name', cfg)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def dd_rate(files) -> float:
    """Bytes/s of `dd iflag=direct` over `files`, one after another."""
    total, t = 0, time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True, capture_output=True)
        total += f.stat().st_size
    return total / (time.perf_counter() - t)
