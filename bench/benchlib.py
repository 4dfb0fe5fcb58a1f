"""What the benchmarks share: running one configuration in its own process
(so its peak RSS is its own, with OpenBLAS preloaded as the CLI does), and
the direct-read rate of files: the device's best at the pager's own I/O
shape (read_rate, the rate an honest bound divides by), and one `dd` stream
for comparison (dd_rate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run_worker(script: str, cfg: dict, cap: int = None) -> dict:
    """Runs `script --worker CFG` and returns the JSON after its RESULT line.
    `cap`: under a hard memory cgroup of that many bytes (the tests' own
    tests/python/cgroup.py), adding "cgroup_peak" (bytes charged at most)
    and "cap"; where no cgroup can be made, uncapped with "cap_unavailable"
    saying why."""
    from mlx_pager.blas import openblas_path

    env = dict(os.environ)
    lib = openblas_path()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = lib
    cmd = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(cfg)]
    extra = {}
    if cap:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
        from cgroup import run_capped, unavailable_reason

        why = unavailable_reason()
        if why is None:
            out, peak = run_capped(cmd, cap, timeout=3600, env=env)
            extra = {"cap": cap, "cgroup_peak": peak}
        else:
            extra = {"cap_unavailable": why}
    if not extra.get("cap"):
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]), **extra)
    raise RuntimeError(
        f"worker {cfg.get('name', cfg)} failed (exit {out.returncode}{', capped' if extra.get('cap') else ''}):\n"
        f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )


def dd_rate(files) -> float:
    """Bytes/s of `dd iflag=direct` over `files`, one after another."""
    total, t = 0, time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=8M", "iflag=direct"], check=True, capture_output=True)
        total += f.stat().st_size
    return total / (time.perf_counter() - t)


# (I/O threads, chunk bytes) tried by read_rate: the pager's own (4, 8 MiB)
# and its neighbours; the best is the device's rate at the pager's shape.
READ_SETTINGS = [(4, 8 << 20), (2, 8 << 20), (8, 8 << 20), (4, 2 << 20), (4, 32 << 20), (1, 32 << 20)]


def read_rate(
    files, page_bytes: int = 64 << 20, settings=READ_SETTINGS, max_seconds: float = 1.0, max_bytes: int = 1 << 30
):
    """The best direct-read rate (bytes/s) of `files` read as the pager reads
    them (mlx_pager._core.measure_read_rate: page_bytes batches, two in
    flight, chunks over several I/O threads, O_DIRECT), over `settings`.
    Returns (best, tried): tried has one dict per setting."""
    from mlx_pager._core import measure_read_rate

    tried = []
    for threads, chunk in settings:
        r = measure_read_rate(
            [str(f) for f in files],
            threads=threads,
            chunk_bytes=chunk,
            batch_bytes=max(1 << 20, int(page_bytes)),
            max_bytes=max_bytes,
            max_seconds=max_seconds,
        )
        if not r["direct"]:
            raise RuntimeError(
                f"{files[0]}: the file system refuses direct I/O, so a read rate would measure the page cache"
            )
        tried.append(r)
    return max(r["bytes_per_s"] for r in tried), tried
