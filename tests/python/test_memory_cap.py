"""Fits where mlx-lm does not: under a hard cgroup memory cap, mlx-pager
trains a model whose frozen weights are over 4x the cap, with finite,
decreasing loss, while mlx_lm.lora on the same model and data is killed.

The cap covers the whole process: RSS, MLX's memory, page cache charged to
the cgroup (pager reads bypass it), staging buffers."""

import json
import sys

import pytest
from cgroup import run_capped, unavailable_reason
from conftest import SAMPLE, write_jsonl

from mlx_pager import modelgen

CAP = 450 * 10**6

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"hard memory cap unavailable: {unavailable_reason()}"
)


@pytest.fixture
def one_batch_data(tmp_path):
    # Every batch is the same 2 records: the loss must fall step after step.
    text = json.loads((SAMPLE / "train.jsonl").read_text().splitlines()[0])["text"]
    write_jsonl(tmp_path / "data" / "train.jsonl", [{"text": text}] * 2)
    return tmp_path / "data"


def test_pager_trains_under_cap_where_mlx_lm_is_killed(big_model, one_batch_data, tmp_path):
    assert modelgen.weight_bytes(big_model) >= 4 * CAP
    pager_cmd = [
        sys.executable,
        "-m",
        "mlx_pager.cli",
        "lora",
        "--model",
        str(big_model),
        "--train",
        "--data",
        str(one_batch_data),
        "--iters",
        "5",
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--learning-rate",
        "3e-4",
        "--steps-per-report",
        "1",
        "--memory-budget",
        str(CAP),
        "--adapter-path",
        str(tmp_path / "ad"),
        "--ssd-cache-dir",
        str(tmp_path / "c"),
        "--report",
        str(tmp_path / "steps.jsonl"),
    ]
    proc, peak = run_capped(pager_cmd, CAP, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "steps.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    losses = [s["loss"] for s in steps]
    assert len(losses) == 5
    assert all(l == l and abs(l) < 1e6 for l in losses), losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert 0 < peak <= CAP
    print(
        f"\nmlx-pager under a {CAP / 1e6:.0f}MB cap: model {modelgen.weight_bytes(big_model) / 1e9:.2f}GB, "
        f"cgroup peak {peak / 1e6:.0f}MB, losses {[round(l, 3) for l in losses]}"
    )

    lm_cmd = [
        sys.executable,
        "-m",
        "mlx_lm",
        "lora",
        "--model",
        str(big_model),
        "--train",
        "--data",
        str(one_batch_data),
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--adapter-path",
        str(tmp_path / "lm_ad"),
    ]
    lm, lm_peak = run_capped(lm_cmd, CAP, timeout=900)
    assert lm.returncode != 0, "mlx_lm.lora fit under the cap: the test model is too small"
    print(f"mlx_lm.lora under the same cap: exit code {lm.returncode} (peak {lm_peak / 1e6:.0f}MB)")
