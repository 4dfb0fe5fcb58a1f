"""PagedTrainer: LoRA/DoRA fine-tuning of mlx-lm models under a memory budget.

It does what ``mlx_lm.lora`` does (same data pipeline, same LoRA layers,
same loss, same optimizers and update rule, same adapter files), except that
the frozen weights of the transformer blocks are paged from the SSD by the
C++ pager instead of held in memory (see store.py and step.py):

    from mlx_pager import PagedTrainer
    trainer = PagedTrainer(model="path/or/hub-id", memory_budget="12GB",
                           ssd_cache_dir="/tmp/mlx-pager-cache")
    trainer.lora(data="./train_data", lora_rank=16, learning_rate=1e-5)

A run is split as mlx_lm/lora.py splits it: ``run`` (check the arguments,
load, then train and/or test), ``train_model`` and ``evaluate_model``; the
paging set-up is session.py, the loop loop.py, and everything the run tells
the outside world goes through callbacks (callbacks.py).
"""

from __future__ import annotations

import copy
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from . import blas, checks, dropout, files, heap, interrupt, loop, memlimit, resume
from .budget import MemoryPlan, format_size
from .callbacks import Callbacks, ConsoleReport, JsonReport, PagerCallback
from .session import load_lazy, open_session

# mlx_lm.lora's defaults, plus mlx-pager's own options.
DEFAULTS = {
    "model": None,
    "train": False,
    "fine_tune_type": "lora",
    "optimizer": "adam",
    "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
    "data": None,
    "seed": 0,
    "num_layers": 16,
    "batch_size": 4,
    "iters": 1000,
    "val_batches": 25,
    "learning_rate": 1e-5,
    "steps_per_report": 10,
    "steps_per_eval": 200,
    "resume_adapter_file": None,
    "adapter_path": "adapters",
    "save_every": 100,
    "test": False,
    "test_batches": 500,
    "max_seq_length": 2048,
    "lr_schedule": None,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
    "mask_prompt": False,
    # The record keys of each data format (mlx-lm reads these from a config).
    "prompt_feature": "prompt",
    "completion_feature": "completion",
    "chat_feature": "messages",
    "text_feature": "text",
    "grad_accumulation_steps": 1,
    "trust_remote_code": False,
    "report_to": None,
    "project_name": None,
    # Accepted for mlx_lm.lora compatibility: blocks are always checkpointed.
    "grad_checkpoint": False,
    "clear_cache_threshold": 0,
    # mlx-pager
    "memory_budget": None,
    "ssd_cache_dir": str(Path.home() / ".cache" / "mlx-pager"),
    "store": "auto",
    "policy": "optimal",
    "readahead": None,  # None: chosen from the measured step (simulate.AutoReadahead)
    "readahead_mode": "conservative",
    "io_threads": 4,
    "page_parts": "auto",  # pages per block; "auto": by the page budget (session.page_parts)
    # Steps the frozen prefix (blocks below the first trained one) runs
    # ahead for, its blocks read once for all of them (prefix.py); "auto":
    # chosen by their size against the outputs' (1: off).
    "prefix_ahead": "auto",
    "direct_io": True,
    # The head's loss over chunks of tokens whose float32 logits hold at
    # most this many bytes; None: whole, as mlx-lm computes it, unless the
    # planner chunks it to fit (placement.py, head_chunk).
    "head_chunk_bytes": None,
    "report": None,
    # --trace FILE: a Chrome trace / Perfetto timeline of the run (trace.py).
    "trace": None,
    "quiet": False,
    # Continue from adapter_path's resume state (resume.py).
    "resume": False,
    # Benchmarks: a page budget, bytes or a size ("200MB"); the memory budget
    # is then the plan's fixed part plus this (memory_budget is ignored).
    "page_budget": None,
}


@dataclass
class TrainResult:
    """What a run did. Losses are as mlx-lm reports them; ``steps`` has one
    record per optimizer step (the ``--report`` step records)."""

    train_losses: List[float] = field(default_factory=list)  # one per report
    val_losses: List[float] = field(default_factory=list)  # one per validation
    test_loss: Optional[float] = None  # with test=True
    steps: List[dict] = field(default_factory=list)  # per optimizer step
    plan: Optional[MemoryPlan] = None  # how the budget was split
    peak_rss: int = 0  # the process's peak resident set, sampled per block
    pager_stats: dict = field(default_factory=dict)  # the pager's counters at the end
    adapter_file: Optional[Path] = None  # the final adapters
    governor_events: List[str] = field(default_factory=list)  # each degradation, in order
    governor_rungs: List[dict] = field(default_factory=list)  # the same, as --report records them
    # The pages as the simulator sees them (session.simulated_pages).
    page_footprints: List[int] = field(default_factory=list)  # bytes each page is charged
    page_read_bytes: List[int] = field(default_factory=list)  # bytes each page's read transfers
    block_pages: List[tuple] = field(default_factory=list)  # block i's pages, in use order
    tail_back_pages: List[tuple] = field(default_factory=list)  # those a tail's backward reads again


class PagedTrainer:
    """Fine-tunes `model` (a local mlx-lm model directory or a hub id) with
    its frozen weights paged from the SSD, keeping the whole process under
    `memory_budget` (e.g. "12GB"; default 80% of RAM, or of the memory
    cgroup's limit where that is lower).

    Options given here (any of ``DEFAULTS``: mlx_lm.lora's options by their
    Python names, plus mlx-pager's) apply to every ``lora()``/``dora()`` call.
    """

    def __init__(self, model: str, memory_budget=None, ssd_cache_dir: Optional[str] = None, **options):
        _check_names(options)
        self.options = dict(options)
        self.options["model"] = model
        self.options["memory_budget"] = memory_budget
        if ssd_cache_dir is not None:
            self.options["ssd_cache_dir"] = ssd_cache_dir

    def lora(self, data, lora_rank: Optional[int] = None, training_callback=None, **kwargs) -> TrainResult:
        """Trains LoRA adapters on `data` (a directory with train/valid/test
        .jsonl) and returns a TrainResult.

        Keyword arguments are mlx_lm.lora's options by their Python names
        (iters, batch_size, learning_rate, num_layers, lora_parameters,
        optimizer, optimizer_config, lr_schedule, mask_prompt, test, ...).
        ``lora_parameters`` is merged over mlx-lm's defaults (rank 8, scale
        20, dropout 0, every linear layer): e.g. {"rank": 16, "keys":
        ["self_attn.q_proj", "self_attn.v_proj"]}. ``lora_rank``,
        ``lora_scale``, ``lora_dropout`` and ``lora_keys`` are shortcuts for
        its entries. `training_callback`: an mlx-lm TrainingCallback (or a
        callbacks.PagerCallback) that receives the reports."""
        args = dict(DEFAULTS)
        args.update(copy.deepcopy(self.options))
        lora = dict(DEFAULTS["lora_parameters"])
        lora.update(args.get("lora_parameters") or {})
        lora.update(kwargs.pop("lora_parameters", None) or {})
        if lora_rank is not None:
            lora["rank"] = lora_rank
        for k in ("scale", "dropout", "keys"):
            if f"lora_{k}" in kwargs:
                lora[k] = kwargs.pop(f"lora_{k}")
        _check_names(kwargs)
        args.update(kwargs)
        args["lora_parameters"] = lora
        args["data"] = str(data)
        args["train"] = True
        return run(types.SimpleNamespace(**args), training_callback)

    def dora(self, data, lora_rank: Optional[int] = None, **kwargs) -> TrainResult:
        """Trains DoRA adapters (LoRA plus a learned magnitude per output row,
        mlx-lm's DoRALinear); the same arguments as ``lora()``."""
        return self.lora(data, lora_rank=lora_rank, fine_tune_type="dora", **kwargs)

    def test(self, data, adapter_path: Optional[str] = None, **kwargs) -> float:
        """The test-set loss of the model with the adapters in `adapter_path`
        (mlx_lm.lora --test without --train), computed under the budget."""
        args = dict(DEFAULTS)
        args.update(copy.deepcopy(self.options))
        _check_names(kwargs)
        args.update(kwargs)
        args.update(data=str(data), train=False, test=True)
        if adapter_path is not None:
            args["adapter_path"] = adapter_path
        return run(types.SimpleNamespace(**args)).test_loss


def _check_names(options: dict):
    unknown = set(options) - set(DEFAULTS) - {"lora_rank", "lora_scale", "lora_dropout", "lora_keys"}
    if unknown:
        raise TypeError(f"unknown PagedTrainer options: {sorted(unknown)}; known: {sorted(DEFAULTS)}")


def build_optimizer(args):
    from mlx_lm.tuner.utils import build_schedule

    lr = build_schedule(args.lr_schedule) if args.lr_schedule else args.learning_rate
    name = args.optimizer.lower()
    classes = {
        "adam": optim.Adam,
        "adamw": optim.AdamW,
        "muon": optim.Muon,
        "sgd": optim.SGD,
        "adafactor": optim.Adafactor,
    }
    if name not in classes:
        raise ValueError(f"unsupported --optimizer '{args.optimizer}': choose one of {sorted(classes)}")
    return classes[name](learning_rate=lr, **(args.optimizer_config or {}).get(name, {}))


def _callbacks(args, training_callback) -> Callbacks:
    """The run's callbacks: the console (unless quiet), --report FILE,
    --report-to's loggers (mlx-lm's own callbacks) and the caller's. With
    several ranks (mlx.launch) only rank 0 reports."""
    from mlx_lm.tuner.callbacks import get_reporting_callbacks

    # No --readahead: the readahead depth and mode are chosen from the
    # measured step (simulate.AutoReadahead), on every rank's own pager.
    auto = []
    if args.readahead is None and args.train:
        from .simulate import AutoReadahead

        auto = [AutoReadahead()]
    if mx.distributed.init().rank() != 0:
        return Callbacks([*auto, training_callback])
    config = {k: v for k, v in vars(args).items() if k != "quiet"}
    loggers = get_reporting_callbacks(
        args.report_to, project_name=args.project_name, log_dir=args.adapter_path, config=config
    )
    cbs: List = []
    if not args.quiet:
        lr = args.learning_rate if isinstance(args.learning_rate, (int, float)) else None
        kind = args.fine_tune_type
        if args.train:
            kind = f"{kind} · {args.num_layers} layers · rank {args.lora_parameters.get('rank', '?')}"
        rows = [
            ("model", str(args.model)),
            ("type", kind if args.train else f"test · adapters {args.adapter_path}"),
            ("dataset", str(args.data)),
            ("optimizer", f"{args.optimizer} · lr {f'{lr:.1e}' if lr is not None else 'schedule'}"),
            ("batch · iters", f"{args.batch_size} · {args.iters:,}"),
            ("max seq", f"{args.max_seq_length:,}"),
            (
                "memory budget",
                str(
                    args.memory_budget or f"{format_size(memlimit.default_budget())} ({memlimit.default_budget_text()})"
                )
                + (f" per rank · {world} ranks" if (world := mx.distributed.init().size()) > 1 else ""),
            ),
        ]
        cbs.append(ConsoleReport("mlx-pager lora", rows))
    if args.report:
        cbs.append(
            JsonReport(
                args.report,
                {
                    "model": str(args.model),
                    "memory_budget": args.memory_budget,
                    "batch_size": args.batch_size,
                    "iters": args.iters,
                },
            )
        )
    if args.trace:
        from .trace import TraceCallback

        cbs.append(
            TraceCallback(
                args.trace,
                io_threads=args.io_threads,
                run_info={"model": str(args.model), "memory_budget": args.memory_budget, "iters": args.iters},
            )
        )
    for a in auto:
        a.say = cbs[0].on_message if cbs and isinstance(cbs[0], ConsoleReport) else None
    cbs += [*auto, loggers, training_callback]
    return Callbacks(cbs)


def run(args, training_callback: Optional[PagerCallback] = None) -> TrainResult:
    """mlx_lm.lora's run(): loads the model and data named in `args`
    (mlx_lm.lora's arguments plus mlx-pager's), trains and/or tests under
    the memory budget, saves adapters; returns what happened."""
    args = types.SimpleNamespace(**vars(args))  # the caller's stays as given
    checks.check_args(args)
    blas.warn_once()
    heap.serve_large_by_mmap()  # before the first large allocation
    np.random.seed(args.seed)
    world = mx.distributed.init()  # one rank unless started by mlx.launch
    if world.size() > 1:
        blas.share_cores()  # ranks on one machine: a share of its cores each
        if args.ssd_cache_dir is not None:
            # Each rank pages from its own cache under its own budget.
            args.ssd_cache_dir = str(Path(args.ssd_cache_dir) / f"rank{world.rank()}")
    cb = _callbacks(args, training_callback)
    result = TrainResult()
    with interrupt.stop_on_signals():
        try:
            _run(args, cb, result)
        finally:
            cb.close()
    return result


def _run(args, cb: PagerCallback, result: TrainResult) -> None:
    """Loads, pages, then trains and/or tests (run()'s body)."""
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset

    cb.on_message(f"Loading model {args.model} (lazily: weights stay on disk)")
    model, tokenizer, config, model_path = load_lazy(args)
    cb.on_message("Loading datasets")
    train_set, valid_set, test_set = load_dataset(args, tokenizer)
    train_cached = CacheDataset(train_set) if args.train else None
    valid_cached = CacheDataset(valid_set) if args.train and len(valid_set) else None
    test_cached = CacheDataset(test_set) if args.test and len(test_set) else None
    if args.train and args.num_layers > len(model.layers):
        raise ValueError(
            f"Requested to train {args.num_layers} layers but the model only has {len(model.layers)} layers."
            # (mlx-lm's words, then the fix)
            f" Pass --num-layers {len(model.layers)} or fewer (-1 trains every layer)."
        )
    session = open_session(
        args,
        model,
        config,
        model_path,
        [train_cached, valid_cached, test_cached],
        attach_adapters=lambda: _attach_adapters(args, model, cb),
        training=args.train,
        say=cb.on_message,
        prep_progress=_prep_progress(cb, args.quiet),
    )
    try:  # (the session is closed whatever fails from here: a callback too)
        result.plan = session.plan
        result.page_footprints = session.page_footprints
        result.page_read_bytes = session.page_read_bytes
        result.block_pages = session.block_pages
        result.tail_back_pages = session.tail_back_pages
        session.gov.on_rung = cb.on_governor
        cb.on_session(session)
        if args.train:
            result.adapter_file = train_model(args, session, train_cached, valid_cached, cb, result)
        if test_cached is not None:
            result.test_loss = evaluate_model(args, session, test_cached, cb)
    finally:
        result.peak_rss = session.gov.peak_rss
        result.pager_stats = session.weights.pager.stats()
        result.governor_events = session.gov.events
        result.governor_rungs = session.gov.rungs
        session.close()


def _attach_adapters(args, model, cb: PagerCallback):
    """Training: new LoRA/DoRA layers (and --resume-adapter-file);
    --test alone: the adapters saved in --adapter-path, as mlx_lm.lora does."""
    from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters

    if args.train:
        mx.random.seed(args.seed)
        dropout.reset()
        linear_to_lora_layers(model, args.num_layers, args.lora_parameters, use_dora=(args.fine_tune_type == "dora"))
        if args.resume_adapter_file is not None:
            cb.on_message(f"Loading fine-tuned weights from {args.resume_adapter_file}")
            model.load_weights(args.resume_adapter_file, strict=False)
    elif args.adapter_path:
        path = Path(args.adapter_path)
        if not (path / "adapter_config.json").exists() or not (path / "adapters.safetensors").exists():
            raise FileNotFoundError(
                f"--adapter-path {path} holds no adapters (adapter_config.json + adapters.safetensors): "
                "point it at the directory a training run wrote, or pass --adapter-path '' to test the base model"
            )
        cb.on_message(f"Loading adapters from {path}")
        load_adapters(model, str(path))


def _prep_progress(cb: PagerCallback, quiet: bool):
    """A progress bar for writing the swap file (once per model)."""
    bar = None

    def progress(done, total):
        nonlocal bar
        interrupt.check()  # Ctrl-C while the swap file is written
        if bar is None:
            from tqdm import tqdm

            from .budget import format_size

            cb.on_message(f"Writing the swap file ({format_size(total)}, once for this model)")
            bar = tqdm(
                total=total, desc="swap file", unit="B", unit_scale=True, disable=quiet, dynamic_ncols=True, leave=False
            )
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return progress


def train_model(args, s, train_set, valid_set, cb: PagerCallback, result: TrainResult) -> Path:
    """mlx_lm.lora's train_model(): writes adapter_config.json, trains,
    saves the adapters (also when the budget runs out mid-run)."""
    from mlx_lm.utils import get_total_parameters, save_config

    # As mlx-lm counts them: the model's own parameters (a quantized
    # weight's values, not its packed words), the trainable ones apart.
    trainable = sum(v.size for _, v in tree_flatten(s.model.trainable_parameters()))
    total = get_total_parameters(s.model)
    cb.on_message(f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)")
    adapter_path = Path(args.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    adapter_file = adapter_path / "adapters.safetensors"
    config = {k: v for k, v in vars(args).items() if k not in ("quiet",)}
    if mx.distributed.init().rank() == 0:
        files.atomic_write(adapter_path / "adapter_config.json", lambda tmp: save_config(config, tmp))
    optimizer = build_optimizer(args)
    resumed = resume.load(adapter_path, s.model, optimizer, args) if args.resume else None
    loop.train(s, optimizer, train_set, valid_set, adapter_file, cb, result, resumed)
    cb.on_message(f"Saved final weights to {adapter_file}.")
    return adapter_file


def evaluate_model(args, s, test_set, cb: PagerCallback) -> float:
    """mlx_lm.lora's evaluate_model(): the test loss and perplexity."""
    n = len(test_set) // args.batch_size
    if args.test_batches != -1:
        n = min(n, args.test_batches)
    with cb.val_progress(n) as advance:
        loss = loop.evaluate(s, test_set, args.test_batches, cb, advance)
    cb.on_message(f"Test loss {loss:.3f}, Test ppl {math.exp(loss):.3f}.")
    return loss
