"""Data-parallel paged training over mx.distributed (mlx.launch), against
`mlx.launch -- mlx_lm.lora` on the same flags: 2 ranks over the ring
backend on this machine."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import SAMPLE

BUDGET = 700 * 10**6

# Runs a command and prints its peak RSS (children) to stderr: one line per rank.
PEAK_RSS = """
import resource, subprocess, sys
p = subprocess.run(sys.argv[1:])
print(f"peak_rss_bytes={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}", file=sys.stderr)
sys.exit(p.returncode)
"""


def launcher():
    exe = Path(sys.executable).parent / "mlx.launch"
    return str(exe) if exe.exists() else shutil.which("mlx.launch")


def launch(n, *cmd, timeout=900, env=None):
    return subprocess.run(
        [launcher(), "-n", str(n), "--backend", "ring", "--", *map(str, cmd)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# The BLAS thread count of every rank, mlx_lm's and mlx-pager's alike. Left
# alone, mlx-pager gives ranks that share a machine a share of its cores
# each (blas.share_cores) while mlx_lm's keep a thread per core, and
# OpenBLAS's float32 sums depend on its thread count on some CPUs: on an
# AMD EPYC VM all 28 adapters then differed after 4 Adam steps (up to 5e-3;
# bit for bit on the same count), where an Intel VM had given the same bits.
SAME_THREADS = dict(os.environ, OPENBLAS_NUM_THREADS="1")


@pytest.fixture(scope="module")
def ring():
    if launcher() is None:
        pytest.skip("mlx.launch is not installed")
    out = launch(
        2,
        sys.executable,
        "-c",
        "import mlx.core as mx; g = mx.distributed.init(); print(mx.distributed.all_sum(mx.array(1)).item())",
        timeout=120,
    )
    if out.returncode != 0 or out.stdout.split() != ["2", "2"]:
        pytest.skip(f"the ring backend does not start on localhost here: {out.stderr[-500:]}")


def test_two_ranks_train_the_adapters_mlx_lm_trains(ring, models, tmp_path):
    model = models("qwen2", 4, dtype="float32")  # float32 scales: see test_prefix.py
    wrapper = tmp_path / "peak_rss.py"
    wrapper.write_text(PEAK_RSS)
    flags = [
        "--model",
        model,
        "--train",
        "--data",
        SAMPLE,
        "--iters",
        4,
        "--batch-size",
        4,
        "--num-layers",
        2,
        "--learning-rate",
        1e-3,
        "--steps-per-report",
        2,
        "--steps-per-eval",
        2,
        "--val-batches",
        2,
        "--grad-accumulation-steps",
        2,
        "--seed",
        0,
    ]
    ref = launch(
        2, sys.executable, "-m", "mlx_lm", "lora", *flags, "--adapter-path", tmp_path / "ref", env=SAME_THREADS
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = launch(
        2,
        sys.executable,
        wrapper,
        sys.executable,
        "-m",
        "mlx_pager.cli",
        "lora",
        *flags,
        "--adapter-path",
        tmp_path / "paged",
        "--memory-budget",
        BUDGET,
        "--ssd-cache-dir",
        tmp_path / "c",
        "--report",
        tmp_path / "r.jsonl",
        env=SAME_THREADS,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = mx.load(str(tmp_path / "ref" / "adapters.safetensors"))
    g = mx.load(str(tmp_path / "paged" / "adapters.safetensors"))
    assert set(r) == set(g)
    for k in r:
        assert mx.allclose(g[k], r[k], rtol=1e-5, atol=1e-7).item(), k
    peaks = [int(l.split("=")[1]) for l in out.stderr.splitlines() if l.startswith("peak_rss_bytes=")]
    assert len(peaks) == 2 and all(0 < p <= BUDGET for p in peaks), peaks
    # Rank 0 alone reports and saves.
    assert out.stdout.count("Saved final weights") == 1
    assert "per rank · 2 ranks" in out.stdout
