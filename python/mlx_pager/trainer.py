"""PagedTrainer: LoRA/DoRA fine-tuning of mlx-lm models under a memory budget.

It does what ``mlx_lm.lora`` does (same data pipeline, same LoRA layers,
same loss, same optimizers and update rule, same adapter files), except that
the frozen weights of the transformer blocks are paged from the SSD by the
C++ pager instead of held in memory (see store.py and step.py):

    from mlx_pager import PagedTrainer
    trainer = PagedTrainer(model="path/or/hub-id", memory_budget="12GB",
                           ssd_cache_dir="/tmp/mlx-pager-cache")
    trainer.lora(data="./train_data", lora_rank=16, learning_rate=1e-5)

The training loop reads top to bottom like mlx-lm's: step, evaluate,
report, save. One difference in shape: with gradient accumulation over k
micro-batches, the k batches of one optimizer step are processed together,
layer-major, so each block is read once per sweep, not k times.
"""

from __future__ import annotations

import json
import math
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import step as S
from .budget import BudgetError, MemoryPlan, estimate_activations, format_size, parse_size
from .governor import Governor, process_rss, return_freed_memory_to_os
from .store import PagedWeights

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
    "grad_accumulation_steps": 1,
    "trust_remote_code": False,
    # mlx-pager
    "memory_budget": None,
    "ssd_cache_dir": str(Path.home() / ".cache" / "mlx-pager"),
    "store": "auto",
    "policy": "optimal",
    "readahead": 2,
    "readahead_mode": "conservative",
    "io_threads": 4,
    "direct_io": True,
    "head_chunk_bytes": 64 << 20,
    "report": None,
    "quiet": False,
    # Benchmarks: a page budget in bytes; the memory budget is then the
    # plan's fixed part plus this (memory_budget is ignored).
    "page_budget": None,
}


def default_budget() -> int:
    """80% of physical memory: MLX's own default memory limit."""
    import psutil

    return int(0.8 * psutil.virtual_memory().total)


def model_path_of(model: str) -> Path:
    """A local directory for `model` (downloading a hub id, as mlx-lm does)."""
    p = Path(model).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(
                f"--model {model} is a directory without config.json: point it at "
                "an mlx-lm model directory (config.json + model*.safetensors)"
            )
        return p
    from mlx_lm.utils import _download

    return Path(_download(model))


@dataclass
class TrainResult:
    train_losses: List[float] = field(default_factory=list)  # per report
    val_losses: List[float] = field(default_factory=list)
    test_loss: Optional[float] = None
    steps: List[dict] = field(default_factory=list)  # per optimizer step
    plan: Optional[MemoryPlan] = None
    peak_rss: int = 0
    pager_stats: dict = field(default_factory=dict)
    adapter_file: Optional[Path] = None
    governor_events: List[str] = field(default_factory=list)
    page_footprints: List[int] = field(default_factory=list)  # bytes each block's page is charged


class PagedTrainer:
    """Fine-tunes `model` (a local mlx-lm model directory or a hub id) with
    its frozen weights paged from the SSD, keeping the whole process under
    `memory_budget` (e.g. "12GB"; default 80% of RAM)."""

    def __init__(
        self,
        model: str,
        memory_budget=None,
        ssd_cache_dir: Optional[str] = None,
        **options,
    ):
        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown PagedTrainer options: {sorted(unknown)}")
        self.options = dict(options)
        self.options["model"] = model
        self.options["memory_budget"] = memory_budget
        if ssd_cache_dir is not None:
            self.options["ssd_cache_dir"] = ssd_cache_dir

    def lora(self, data, lora_rank: Optional[int] = None, **kwargs) -> TrainResult:
        """Trains LoRA adapters on `data` (a directory with train/valid/test
        .jsonl). Keyword arguments are mlx_lm.lora's options by their Python
        names (iters, batch_size, learning_rate, num_layers, ...); lora_rank,
        lora_scale and lora_dropout set lora_parameters."""
        args = dict(DEFAULTS)
        args.update(self.options)
        lora = dict(DEFAULTS["lora_parameters"])
        if lora_rank is not None:
            lora["rank"] = lora_rank
        for k in ("scale", "dropout"):
            if f"lora_{k}" in kwargs:
                lora[k] = kwargs.pop(f"lora_{k}")
        unknown = set(kwargs) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown training options: {sorted(unknown)}")
        args.update(kwargs)
        args["lora_parameters"] = lora
        args["data"] = str(data)
        args["train"] = True
        return run(types.SimpleNamespace(**args))

    def dora(self, data, lora_rank: Optional[int] = None, **kwargs) -> TrainResult:
        return self.lora(data, lora_rank=lora_rank, fine_tune_type="dora", **kwargs)


# ------------------------------------------------------------------ the run --
class _Run:
    """Everything one training run holds; built step by step in run()."""

    def __init__(self, args):
        self.args = args
        self.result = TrainResult()
        self.report_file = open(args.report, "a") if args.report else None
        self.bar = None  # the training progress bar, while it is shown
        self.t0 = time.perf_counter()

    def out(self, text: str = ""):
        """A report line, printed above the progress bar if there is one."""
        if self.args.quiet:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def progress(self, total: int, desc: str, unit: str = "it", scale: bool = False):
        """A progress bar with ETA on stderr (none when quiet)."""
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, disable=self.args.quiet,
                    dynamic_ncols=True, leave=False)

    def log_json(self, record: dict):
        if self.report_file is not None:
            self.report_file.write(json.dumps(record) + "\n")
            self.report_file.flush()

    def trace(self, weights, phase: str, block: int):
        """A per-block memory record for the report (memory by component)."""
        if self.report_file is None:
            return
        s = weights.pager.stats()
        self.log_json({
            "type": "block", "t": time.perf_counter() - self.t0, "phase": phase, "block": block,
            "rss_bytes": process_rss(), "pages_bytes": s["resident_bytes"] - s["pinned_bytes"],
            "pinned_bytes": s["pinned_bytes"], "mlx_active_bytes": mx.get_active_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(), "in_flight_pages": s["in_flight_pages"],
        })


def _build_optimizer(args):
    from mlx_lm.tuner.utils import build_schedule

    lr = build_schedule(args.lr_schedule) if args.lr_schedule else args.learning_rate
    name = args.optimizer.lower()
    classes = {"adam": optim.Adam, "adamw": optim.AdamW, "muon": optim.Muon,
               "sgd": optim.SGD, "adafactor": optim.Adafactor}
    if name not in classes:
        raise ValueError(f"unsupported --optimizer '{args.optimizer}': choose one of {sorted(classes)}")
    return classes[name](learning_rate=lr, **(args.optimizer_config or {}).get(name, {}))


def _init_dora_magnitudes(model, weights: PagedWeights, first: int):
    """DoRA's magnitude m is the row norm of the frozen weight, which mlx-lm
    computes when it wraps the layer; here the weight is paged, so compute it
    the same way with each block paged in."""
    from mlx_lm.tuner.dora import DoRALinear

    for i in range(first, len(model.layers)):
        doras = [m for _, m in model.layers[i].named_modules() if isinstance(m, DoRALinear)]
        if not doras:
            continue
        weights.bind(i)
        try:
            for d in doras:
                d.m = mx.linalg.norm(d._dequantized_weight().astype(mx.float32), axis=1)
            mx.eval([d.m for d in doras])
        finally:
            weights.unbind(i)


def _trainable_state_bytes(model, args) -> int:
    n = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    # parameter + gradient + accumulated gradient + optimizer moments
    moments = {"adam": 2, "adamw": 2, "sgd": 1, "adafactor": 2}.get(args.optimizer, 2)
    return n * (3 + moments)


def _longest_batch(args, datasets) -> int:
    """The longest padded batch iterate_batches can make from `datasets`
    (it pads to 1 + a multiple of 32, capped at max_seq_length)."""
    longest = 1
    for d in datasets:
        for i in range(len(d) if d is not None else 0):
            item = d[i]  # tokenizes (and caches) the record: (tokens, offset)
            tokens = item[0] if isinstance(item, tuple) and len(item) == 2 else item
            longest = max(longest, len(tokens))
    return min(args.max_seq_length, 1 + 32 * ((longest + 31) // 32))


def _largest_weight_elems(weights: PagedWeights) -> int:
    best = 0
    for slots in weights.slots:
        for s in slots:
            best = max(best, int(np.prod(s.placeholder.shape)))
    return best


def run(args) -> TrainResult:
    """Loads the model and data named in `args` (mlx_lm.lora's arguments plus
    mlx-pager's), trains, saves adapters; returns what happened."""
    import mlx_lm
    from mlx_lm.tuner.datasets import CacheDataset, load_dataset
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model, load_tokenizer, save_config

    return_freed_memory_to_os()  # before the first large allocation
    r = _Run(args)
    np.random.seed(args.seed)
    if args.fine_tune_type not in ("lora", "dora"):
        raise ValueError(
            f"--fine-tune-type {args.fine_tune_type} is not supported by mlx-pager: "
            "full fine-tuning trains the weights it pages; use lora or dora"
        )
    if args.grad_accumulation_steps < 1:
        raise ValueError("grad_accumulation_steps must be at least 1")
    if args.model is None:
        raise ValueError("no --model given: pass a local mlx-lm model directory or a hub id")

    r.out(f"Loading model {args.model} (lazily: weights stay on disk)")
    model_path = model_path_of(args.model)
    model, config = load_model(model_path, lazy=True, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(model_path, {"trust_remote_code": args.trust_remote_code},
                               eos_token_ids=config.get("eos_token_id", None))
    if args.data is None:
        raise ValueError("no --data given: pass a directory with train.jsonl and valid.jsonl")
    r.out("Loading datasets")
    train_set, valid_set, test_set = load_dataset(args, tokenizer)

    model.freeze()
    if args.num_layers > len(model.layers):
        raise ValueError(
            f"Requested to train {args.num_layers} layers but the model only has {len(model.layers)} layers."
        )

    prep_bar = None

    def prep_progress(done, total):
        nonlocal prep_bar
        if prep_bar is None:
            r.out(f"Writing the swap file ({format_size(total)}, once for this model)")
            prep_bar = r.progress(total, "swap file", unit="B", scale=True)
        prep_bar.update(done - prep_bar.n)
        if done >= total:
            prep_bar.close()

    weights = PagedWeights(
        model,
        model_path,
        budget_bytes=1 << 62,  # set by the governor below
        ssd_cache_dir=args.ssd_cache_dir,
        store=args.store,
        pager_options=dict(
            policy=args.policy, readahead=args.readahead, io_threads=args.io_threads,
            direct_io=args.direct_io, readahead_mode=args.readahead_mode,
        ),
        progress=prep_progress,
    )

    mx.random.seed(args.seed)
    linear_to_lora_layers(
        model, args.num_layers, args.lora_parameters, use_dora=(args.fine_tune_type == "dora")
    )
    if args.resume_adapter_file is not None:
        r.out(f"Loading fine-tuned weights from {args.resume_adapter_file}")
        model.load_weights(args.resume_adapter_file, strict=False)
    first = S.first_trained_block(model)

    # ---- the memory plan
    from ._core import IO_ALIGN

    act_itemsize = next((s.placeholder.dtype for s in weights.slots[weights.resident_id]
                         if mx.issubdtype(s.placeholder.dtype, mx.floating)), mx.float32).size
    plan_budget = 0
    budget_error = None
    try:
        plan_budget = parse_size(args.memory_budget) if args.memory_budget is not None else default_budget()
    except BudgetError as e:
        budget_error = e
    train_cached = CacheDataset(train_set)
    valid_cached = CacheDataset(valid_set) if len(valid_set) else None
    seq_len = _longest_batch(args, [train_cached, valid_cached])
    max_page = weights.max_page_bytes + IO_ALIGN
    # Slack: MLX's buffer cache keeps one freed page frame for the next read
    # to reuse (a fresh frame costs page faults and zeroing on every read),
    # plus allocator rounding.
    slack = max(48 << 20, max_page + (16 << 20))
    if args.page_budget is None:
        slack = max(slack, plan_budget // 20)
    plan = MemoryPlan(
        budget=plan_budget,
        baseline=process_rss(),
        resident=weights.resident_bytes + IO_ALIGN,
        trainable=_trainable_state_bytes(model, args),
        activations=estimate_activations(
            config, args.batch_size, seq_len, args.grad_accumulation_steps,
            len(model.layers) - first, act_itemsize, args.head_chunk_bytes,
            _largest_weight_elems(weights),
        ),
        slack=slack,
        max_page=max_page,
    )
    if args.page_budget is not None:
        plan.budget = plan.fixed + int(args.page_budget)
        budget_error = None
    if budget_error is not None:
        raise BudgetError(f"{budget_error} This run needs at least {format_size(plan.minimum)} ({plan.breakdown()}).")
    plan.check()
    r.result.plan = plan
    r.result.page_footprints = [weights.page_bytes(i) + IO_ALIGN for i in range(weights.num_blocks)]
    gov = Governor(plan, weights.pager, pinned_bytes=weights.resident_bytes + IO_ALIGN)
    r.gov_check = gov.check
    r.blocks = S.Blocks(model)
    weights.pin_resident()
    if args.fine_tune_type == "dora":
        _init_dora_magnitudes(model, weights, first)
    schedule = S.step_schedule(len(model.layers), first)
    weights.pager.set_schedule([weights.page_ids[i] for i in schedule])

    r.out(
        f"Model: {len(model.layers)} blocks, {format_size(weights.paged_bytes)} paged "
        f"({'/'.join(sorted(set(weights.store_kind)))}), "
        f"{format_size(weights.resident_bytes)} resident. Budget {format_size(plan.budget)}: "
        f"pages {format_size(plan.page_budget)} (~{plan.page_budget / plan.max_page:.1f} blocks), "
        f"fixed {format_size(plan.fixed)}."
    )
    io = weights.pager.stats()
    if io["buffered_files"]:
        r.out(f"Warning: {io['buffered_files']} of {io['buffered_files'] + io['direct_files']} weight files "
              "refused direct I/O: their reads go through the page cache, dropped after each read.")
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    r.out(f"Trainable parameters: {100 * trainable / total:.3f}% ({trainable / 1e6:.3f}M/{total / 1e6:.3f}M)")

    adapter_path = Path(args.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    adapter_file = adapter_path / "adapters.safetensors"
    cfg = {k: v for k, v in vars(args).items() if k not in ("quiet",)}
    save_config(cfg, adapter_path / "adapter_config.json")

    optimizer = _build_optimizer(args)
    try:
        _train(r, model, weights, gov, optimizer, train_cached, valid_cached, adapter_file)
    except BudgetError as e:
        # Out of memory mid-run: keep what was trained, then say what is needed.
        if r.bar is not None:
            r.bar.close()
            r.bar = None
        _save_adapters(model, adapter_file, None)
        raise BudgetError(f"{e} The adapters trained so far are saved in {adapter_file}.") from e

    if args.test and len(test_set):
        r.result.test_loss = _evaluate(r, model, weights, CacheDataset(test_set), args.test_batches)
        r.out(f"Test loss {r.result.test_loss:.3f}, Test ppl {math.exp(r.result.test_loss):.3f}.")
    r.result.adapter_file = adapter_file
    r.result.peak_rss = gov.peak_rss
    r.result.pager_stats = weights.pager.stats()
    r.result.governor_events = gov.events
    if r.report_file is not None:
        r.report_file.close()
    return r.result


def _evaluate(r: _Run, model, weights: PagedWeights, dataset, num_batches: int) -> float:
    """mlx-lm's evaluate(): token-weighted mean loss over `num_batches`
    batches (-1: all), with the blocks paged once for all of them."""
    from mlx_lm.tuner.trainer import iterate_batches

    args = r.args
    model.eval()
    batches = []
    it = iterate_batches(dataset=dataset, batch_size=args.batch_size, max_seq_length=args.max_seq_length)
    for i, b in enumerate(it):
        if num_batches != -1 and i >= num_batches:
            break
        batches.append(S.MicroBatch.from_batch(*b))
    pager = weights.pager
    pager.set_schedule([weights.page_ids[i] for i in range(len(model.layers))])
    all_losses, ntokens = mx.array(0.0), mx.array(0)
    # Layer-major in groups: one sweep over the blocks serves a whole group.
    # Forward-only keeps no checkpoints, so a group of 8 fits the plan made
    # for training's grad_accumulation_steps micro-batches.
    group = max(8, args.grad_accumulation_steps)
    for g in range(0, len(batches), group):
        for loss, toks in S.paged_loss(model, weights, batches[g:g + group], args.head_chunk_bytes,
                                       on_block=lambda *_: r.gov_check(), blocks=r.blocks):
            all_losses += loss * toks
            ntokens += toks
            mx.eval(all_losses, ntokens)
    first = S.first_trained_block(model)
    pager.set_schedule([weights.page_ids[i] for i in S.step_schedule(len(model.layers), first)])
    model.train()
    return (all_losses / ntokens).item()


def _train(r: _Run, model, weights, gov, optimizer, train_set, val_set, adapter_file):
    from mlx_lm.tuner.trainer import iterate_batches

    args = r.args
    k = args.grad_accumulation_steps
    model.train()
    batches = iterate_batches(dataset=train_set, batch_size=args.batch_size,
                              max_seq_length=args.max_seq_length, loop=True)
    losses, n_tokens, steps, trained_tokens, train_time = 0.0, 0, 0, 0, 0.0
    pager = weights.pager
    it = 0
    r.bar = r.progress(args.iters, "train")

    def on_block(phase, i):
        gov.check()
        r.trace(weights, phase, i)

    while it < args.iters:
        group = [next(batches) for _ in range(min(k, args.iters - it))]
        first_it, it = it + 1, it + len(group)
        if val_set is not None and any(
            j == 1 or j % args.steps_per_eval == 0 or j == args.iters for j in range(first_it, it + 1)
        ):
            tic = time.perf_counter()
            val_loss = _evaluate(r, model, weights, val_set, args.val_batches)
            r.result.val_losses.append(val_loss)
            r.out(f"Iter {first_it}: Val loss {val_loss:.3f}, Val took {time.perf_counter() - tic:.3f}s")
            r.log_json({"type": "val", "iteration": first_it, "val_loss": val_loss})

        before = pager.stats()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        mbs = [S.MicroBatch.from_batch(*b) for b in group]
        step_losses, step_toks, grads = S.paged_value_and_grad(
            model, weights, mbs, args.head_chunk_bytes, on_block=on_block, blocks=r.blocks
        )
        if len(group) == k:  # a partial last group updates nothing, as in mlx-lm
            if k > 1:
                grads = {n: g / k for n, g in grads.items()}
            names = [n for n, _ in tree_flatten(model.trainable_parameters())]
            optimizer.update(model, tree_unflatten([(n, grads[n]) for n in names]))
            mx.eval(model.trainable_parameters(), optimizer.state)
        elapsed = time.perf_counter() - tic
        after = pager.stats()
        step_loss = sum(l.item() for l in step_losses)
        toks = sum(t.item() for t in step_toks)
        losses += step_loss
        n_tokens += toks
        steps += len(group)
        train_time += elapsed
        rec = {
            "type": "step",
            "iteration": it,
            "loss": step_loss / len(group),
            "tokens": toks,
            "step_s": elapsed,
            "io_wait_s": after["io_wait_s"] - before["io_wait_s"],
            "bytes_read": after["bytes_read"] - before["bytes_read"],
            "pages_read": after["pages_read"] - before["pages_read"],
            "faults": after["faults"] - before["faults"],
            "readahead_hits": after["readahead_hits"] - before["readahead_hits"],
            "acquires": after["acquires"] - before["acquires"],
            "peak_resident_bytes": after["peak_resident_bytes"],
            "mlx_peak_bytes": mx.get_peak_memory(),
            "rss_bytes": process_rss(),
            "peak_rss_bytes": gov.peak_rss,
        }
        r.result.steps.append(rec)
        r.log_json(rec)
        r.bar.update(len(group))

        if it % args.steps_per_report < len(group) or it == args.iters:
            train_loss = losses / steps
            trained_tokens += n_tokens
            lr = optimizer.learning_rate.item() if isinstance(optimizer.learning_rate, mx.array) else optimizer.learning_rate
            s = pager.stats()
            ra = s["readahead_hits"] / max(1, s["acquires"])
            r.out(
                f"Iter {it}: Train loss {train_loss:.3f}, Learning Rate {lr:.3e}, "
                f"It/sec {steps / train_time:.3f}, Tokens/sec {n_tokens / train_time:.3f}, "
                f"Trained Tokens {trained_tokens}, Peak mem {gov.peak_rss / 1e9:.3f} GB | "
                f"pager: faults {s['faults']}, readahead hits {100 * ra:.0f}%, "
                f"read {s['bytes_read'] / 1e9:.2f} GB, I/O wait {s['io_wait_s']:.2f}s"
            )
            r.result.train_losses.append(train_loss)
            losses, n_tokens, steps, train_time = 0.0, 0, 0, 0.0

        if it % args.save_every < len(group):
            _save_adapters(model, adapter_file, it)
            r.out(f"Iter {it}: Saved adapter weights to {adapter_file}.")
    r.bar.close()
    r.bar = None
    _save_adapters(model, adapter_file, None)
    r.out(f"Saved final weights to {adapter_file}.")


def _save_adapters(model, adapter_file: Path, it: Optional[int]):
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(adapter_file), weights)
    if it is not None:
        mx.save_safetensors(str(adapter_file.parent / f"{it:07d}_adapters.safetensors"), weights)
