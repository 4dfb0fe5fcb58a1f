"""Exact resume: the state of the last finished optimizer step, on disk.

mlx-lm's ``--resume-adapter-file`` restores the adapter weights only: the
optimizer's moments, the learning-rate schedule's position and the data
order start again. mlx-pager also writes ``resume_state.safetensors`` in the
adapter directory (atomically, next to every checkpoint and when a run is
interrupted) holding:

  adapters       every trainable array
  optimizer      the optimizer's whole state (moments, step count, learning rate)
  metadata       the iteration reached, the report sums since the last report,
                 a key of the options that decide the trajectory, and the
                 draws LoRA dropout took from MLX's global key sequence
                 (dropout.py: the resumed run advances past them)

``mlx-pager lora --resume`` (``PagedTrainer.lora(resume=True)``) loads it and
continues with iteration + 1. The data order is replayed, not stored: batches
and validation batches are drawn from NumPy's global generator (seeded by
--seed), so drawing the same batches in the same order up to the iteration
reached puts the generator where the interrupted run had it. The replay
draws as this run's schedule does: a finished run continued with a larger
--iters becomes one run of that many iterations (without the validation
the shorter run made at its end). On the CPU the losses after a resume are
then bit for bit those of an uninterrupted run. A state past --iters is
refused (check(), before anything is loaded or written).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from . import dropout, files

STATE_FILE = "resume_state.safetensors"
# The options whose change makes a resumed run a different run.
TRAJECTORY_OPTIONS = (
    "model",
    "data",
    "fine_tune_type",
    "optimizer",
    "optimizer_config",
    "seed",
    "num_layers",
    "batch_size",
    "learning_rate",
    "lr_schedule",
    "lora_parameters",
    "mask_prompt",
    "grad_accumulation_steps",
    "max_seq_length",
    "steps_per_eval",
    "val_batches",
)


def trajectory_key(args) -> dict:
    return {k: getattr(args, k, None) for k in TRAJECTORY_OPTIONS}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save(adapter_path: Path, model, optimizer, iteration: int, args, reports: dict) -> Path:
    arrays = {f"adapters.{k}": v for k, v in tree_flatten(model.trainable_parameters())}
    arrays.update({f"optimizer.{k}": v for k, v in tree_flatten(optimizer.state)})
    meta = {
        "iteration": iteration,
        "key": _digest(trajectory_key(args)),
        "options": trajectory_key(args),
        "reports": reports,
        # MLX's global key draws the steps made (LoRA dropout's masks,
        # dropout.py): a resumed run advances past them
        "dropout_draws": dropout.drawn(),
    }
    return files.save_safetensors(
        Path(adapter_path) / STATE_FILE, arrays, metadata={"mlx_pager_resume": json.dumps(meta, default=str)}
    )


class ResumeError(ValueError):
    """The resume state cannot be used for this run; the message says why."""


def _read_metadata(path: Path) -> dict:
    """The resume metadata of `path`, from the safetensors header alone (8
    bytes of length, then JSON): no array is read."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= 100 << 20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
        meta = json.loads(header["__metadata__"]["mlx_pager_resume"])
        meta["iteration"] = int(meta["iteration"])
        if not {"key", "options"} <= meta.keys():
            raise KeyError("key or options")
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ResumeError(
            f"--resume: {path} is not a readable resume state ({e!r}); delete it to start afresh"
        ) from None


def check(adapter_path, args) -> dict:
    """The metadata of adapter_path's resume state, where this run can
    continue it (checks.check_args, before anything is loaded or written);
    a ResumeError naming the problem and the fix where it cannot."""
    path = Path(adapter_path) / STATE_FILE
    if not path.exists():
        raise ResumeError(
            f"--resume: {path} does not exist: resume needs the --adapter-path of a run that saved "
            "a checkpoint (--save-every) or was interrupted"
        )
    meta = _read_metadata(path)
    if meta["key"] != _digest(trajectory_key(args)):
        now = trajectory_key(args)
        changed = [k for k in TRAJECTORY_OPTIONS if str(meta["options"].get(k)) != str(now.get(k))]
        raise ResumeError(
            f"--resume: {path} was saved with other options ({', '.join(changed)} differ): "
            "resume with the same options, or train afresh without --resume"
        )
    if meta["iteration"] > args.iters:
        raise ResumeError(
            f"--resume: {path} holds iteration {meta['iteration']}, past --iters {args.iters}: "
            f"pass --iters {meta['iteration']} or more to continue it, or train afresh in another --adapter-path"
        )
    return meta


def load(adapter_path: Path, model, optimizer, args) -> dict:
    """Puts the saved adapters and optimizer state into `model` and
    `optimizer`; returns the metadata (iteration, reports). Refuses as
    check() does."""
    path = Path(adapter_path) / STATE_FILE
    meta = check(adapter_path, args)
    try:
        arrays = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise ResumeError(f"--resume: {path} is not a readable resume state ({e}); delete it to start afresh") from None
    adapters = [(k[len("adapters.") :], v) for k, v in arrays.items() if k.startswith("adapters.")]
    model.load_weights(adapters, strict=False)
    state = [(k[len("optimizer.") :], v) for k, v in arrays.items() if k.startswith("optimizer.")]
    optimizer.state = tree_unflatten(state)
    mx.eval(model.trainable_parameters(), optimizer.state)
    dropout.advance(int(meta.get("dropout_draws", 0)))
    return meta


def exists(adapter_path: Optional[str]) -> bool:
    return adapter_path is not None and (Path(adapter_path) / STATE_FILE).exists()
