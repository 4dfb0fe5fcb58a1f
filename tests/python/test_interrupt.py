"""Ctrl-C / SIGTERM mid-training: stop at a block boundary, adapters and
resume state saved, one line, exit 128 + signal, no partial files."""

import json
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from conftest import SAMPLE


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_and_exits_with_one_line(models, tmp_path, sig, code):
    report = tmp_path / "r.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "mlx_pager.cli",
        "lora",
        "--model",
        str(models("llama", None)),
        "--train",
        "--data",
        str(SAMPLE),
        "--iters",
        "1000",
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--steps-per-eval",
        "1000000",
        "--adapter-path",
        str(tmp_path / "a"),
        "--memory-budget",
        "2GB",
        "--ssd-cache-dir",
        str(tmp_path / "c"),
        "--report",
        str(report),
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if report.exists() and sum('"type": "step"' in l for l in report.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    p.send_signal(sig)
    err = p.communicate(timeout=300)[1]
    assert p.returncode == code, err[-2000:]
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert lines[-1].startswith(f"mlx-pager: interrupted by {signal.Signals(sig).name}") and "--resume" in lines[-1]
    assert "Traceback" not in err
    adapters = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    assert adapters and all(mx.isfinite(v).all().item() for v in adapters.values())
    assert (tmp_path / "a" / "resume_state.safetensors").exists()
    assert not [f for f in (tmp_path / "a").iterdir() if f.name.startswith(".")]  # no temporaries
    steps = [json.loads(l) for l in report.read_text().splitlines() if '"type": "step"' in l]
    assert 2 <= len(steps) < 1000
