"""The paging set-up (session.py): the budget's minimum is a property of the
model, the data and the flags, not of whether this run just wrote the swap
file (writing it leaves heap behind, which the plan used to count as the
process's baseline)."""

import re
import subprocess
import sys

from conftest import SAMPLE


def minimum(model, tmp_path, cache):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_pager.cli",
            "lora",
            "--model",
            str(model),
            "--train",
            "--data",
            str(SAMPLE),
            "--iters",
            "1",
            "--num-layers",
            "2",
            "--store",
            "swap",
            "--memory-budget",
            "20MB",
            "--adapter-path",
            str(tmp_path / "a"),
            "--ssd-cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    m = re.search(r"needs at least ([\d.]+)MB", out.stderr)
    assert m, out.stderr
    return float(m.group(1))


def test_minimum_budget_does_not_depend_on_writing_the_swap_file(models, tmp_path):
    model = models("llama", None, hidden_size=512, intermediate_size=2048, num_hidden_layers=4)
    cache = tmp_path / "cache"
    fresh = minimum(model, tmp_path, cache)  # writes the swap file
    assert any(cache.rglob("*.swap"))
    warm = minimum(model, tmp_path, cache)  # reuses it
    assert abs(fresh - warm) <= 0.02 * warm, (fresh, warm)
