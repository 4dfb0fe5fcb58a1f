"""Exact resume: kill -9 at any point, then `--resume`, gives the losses and
adapters of the uninterrupted run, bit for bit (CPU)."""

import copy
import json
import signal
import subprocess
import sys
import time
import types

import mlx.core as mx
import pytest
from conftest import SAMPLE, write_jsonl

from mlx_pager.callbacks import PagerCallback
from mlx_pager.resume import ResumeError
from mlx_pager.trainer import DEFAULTS, run


def flags(model, data, tmp_path, name, iters=8):
    # 8 train records at batch 2: an epoch every 4 batches, so the resumed
    # run must replay the batch order across epochs; validation every 3
    # iterations draws from the same generator.
    return [
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
        str(iters),
        "--batch-size",
        "2",
        "--num-layers",
        "2",
        "--learning-rate",
        "1e-3",
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        "3",
        "--val-batches",
        "1",
        "--save-every",
        "1",
        "--grad-accumulation-steps",
        "2",
        "--seed",
        "0",
        "--adapter-path",
        str(tmp_path / name),
        "--memory-budget",
        "2GB",
        "--ssd-cache-dir",
        str(tmp_path / "c"),
        "--report",
        str(tmp_path / f"{name}.jsonl"),
    ]


def losses(report):
    return {r["iteration"]: r["loss"] for r in map(json.loads, open(report)) if r.get("type") == "step"}


@pytest.fixture
def data(tmp_path):
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", recs[:8])
    write_jsonl(d / "valid.jsonl", recs[8:12])
    return d


def test_kill_9_then_resume_is_bitwise_the_uninterrupted_run(models, data, tmp_path):
    model = models("llama", None)
    full = subprocess.run(flags(model, data, tmp_path, "full"), capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    ref = losses(tmp_path / "full.jsonl")
    assert sorted(ref) == [2, 4, 6, 8]

    p = subprocess.Popen(flags(model, data, tmp_path, "cut"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while (
        time.time() < deadline and len(losses(tmp_path / "cut.jsonl") if (tmp_path / "cut.jsonl").exists() else {}) < 2
    ):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)  # somewhere in step 3 (iterations 5-6), or in a save
    p.wait()
    cut = losses(tmp_path / "cut.jsonl")
    assert 2 <= len(cut) < 4
    print(f"\nkilled after steps {sorted(cut)}; uninterrupted losses {ref}")
    resumed = subprocess.run(
        flags(model, data, tmp_path, "cut") + ["--resume"], capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resuming after iteration" in resumed.stdout
    after = losses(tmp_path / "cut.jsonl")  # the report file holds both runs
    for it, loss in after.items():
        assert loss == ref[it], (it, loss, ref[it])
    assert set(after) == set(ref)
    a = mx.load(str(tmp_path / "full" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "cut" / "adapters.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_resume_with_other_options_is_refused(models, data, tmp_path):
    model = models("llama", None)
    first = subprocess.run(flags(model, data, tmp_path, "a", iters=2), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    other = [f if f != "1e-3" else "2e-3" for f in flags(model, data, tmp_path, "a", iters=4)]
    out = subprocess.run(other + ["--resume"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "learning_rate" in out.stderr and "Traceback" not in out.stderr
    missing = subprocess.run(
        flags(model, data, tmp_path, "none") + ["--resume"], capture_output=True, text=True, timeout=600
    )
    assert missing.returncode == 2 and "resume_state.safetensors does not exist" in missing.stderr


class Losses(PagerCallback):
    """Train and validation losses by iteration; stops at `stop_at`."""

    def __init__(self, stop_at=None):
        self.train, self.val, self.stop_at = {}, {}, stop_at

    def on_train_loss_report(self, info):
        self.train[info["iteration"]] = info["train_loss"]
        if info["iteration"] == self.stop_at:
            raise RuntimeError("stopped")

    def on_val_loss_report(self, info):
        self.val[info["iteration"]] = info["val_loss"]


def api_args(models, data, tmp_path, name, **kw):
    """PagedTrainer's run() arguments for the 8-record data set."""
    base = dict(
        DEFAULTS,
        train=True,
        model=str(models("llama", None)),
        data=str(data),
        batch_size=2,
        num_layers=2,
        learning_rate=1e-2,
        steps_per_report=1,
        val_batches=1,
        memory_budget="2GB",
        ssd_cache_dir=str(tmp_path / "c"),
        quiet=True,
        adapter_path=str(tmp_path / name),
    )
    return types.SimpleNamespace(**copy.deepcopy(dict(base, **kw)))


def test_resume_with_lora_dropout_draws_the_uninterrupted_run_s_masks(models, data, tmp_path):
    """LoRA dropout's masks come from MLX's global key sequence
    (dropout.py): the resume state keeps how many draws the steps took, and
    the resumed run moves the sequence past them (without that, its masks
    are those of the run's first steps again)."""

    def args(name, **kw):
        return api_args(
            models,
            data,
            tmp_path,
            name,
            iters=6,
            steps_per_eval=100,
            save_every=1,
            seed=0,
            lora_parameters={"rank": 8, "scale": 20.0, "dropout": 0.2},
            **kw,
        )

    full = Losses()
    run(args("full"), full)
    with pytest.raises(RuntimeError, match="stopped"):
        run(args("cut"), Losses(stop_at=3))
    resumed = Losses()
    run(args("cut", resume=True), resumed)
    assert sorted(resumed.train)[-3:] == [4, 5, 6]  # from the last state saved (at 2 or 3)
    assert all(resumed.train[i] == full.train[i] for i in resumed.train), (resumed.train, full.train)
    a = mx.load(str(tmp_path / "full" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "cut" / "adapters.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_a_finished_run_continued_is_the_longer_run_and_a_shorter_one_is_refused(models, data, tmp_path):
    """A run of 4 iterations continued with --iters 8 gives the train and
    validation losses and the adapters of one run of 8: the replay draws
    NumPy's generator as the run of 8 does, not the validation at the
    shorter run's end (which would shift the second epoch's batch order and
    the validation batches). Continuing with fewer iterations than the
    state holds is refused before anything is loaded or written."""

    def args(name, iters, **kw):
        # validations before 1, 3 and 6, and at the last iteration; (with
        # seed 0 one more validation's draw happens to leave the next
        # epoch's order and validation batch as they were; with 1 it does not)
        return api_args(models, data, tmp_path, name, iters=iters, steps_per_eval=3, seed=1, **kw)

    whole, first, rest = Losses(), Losses(), Losses()
    run(args("whole", 8), whole)
    run(args("parts", 4), first)
    assert 3 in first.val, "the shorter run validated at its end (iteration 4), where the longer one does not"
    run(args("parts", 8, resume=True), rest)
    assert {**first.train, **rest.train} == whole.train
    assert sorted(rest.val) == [5, 7] and all(rest.val[i] == whole.val[i] for i in rest.val)
    a = mx.load(str(tmp_path / "whole" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "parts" / "adapters.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)

    state = (tmp_path / "parts" / "resume_state.safetensors").read_bytes()
    config = (tmp_path / "parts" / "adapter_config.json").read_text()
    with pytest.raises(ResumeError, match="holds iteration 8, past --iters 6: pass --iters 8 or more"):
        run(args("parts", 6, resume=True))
    assert (tmp_path / "parts" / "resume_state.safetensors").read_bytes() == state
    assert (tmp_path / "parts" / "adapter_config.json").read_text() == config
