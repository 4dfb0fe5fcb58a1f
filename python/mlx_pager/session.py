"""A paged session: the model loaded lazily, its frozen weights handed to the
pager, adapters attached, the memory budget planned and the governor set.

Everything a training or evaluation run needs before its loop starts, in the
order it must happen:

  load       config, tokenizer and a lazy model (weights stay unread ``Load``
             arrays), as ``mlx_lm.load(..., lazy=True)`` does
  page       ``PagedWeights``: block pages and the pinned page registered, the
             model's frozen arrays replaced by placeholders (before adapters
             wrap the frozen layers)
  adapters   new LoRA/DoRA layers (training; ``--resume-adapter-file``), or the
             saved ones from ``--adapter-path`` (``--test`` alone)
  plan       ``MemoryPlan``: what the budget must hold besides the pages
  govern     ``Governor`` and MLX's limits; the pinned page read and locked;
             the step's access order given to the pager
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import step, swapcache
from .budget import BudgetError, MemoryPlan, estimate_activations, format_size, parse_size
from .governor import Governor, process_rss, release_heap
from .store import PagedWeights

# Parameter, gradient, accumulated gradient (+ optimizer moments, below).
_STATE_COPIES = 3
_OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1, "adafactor": 2}
# MLX's buffer cache keeps one freed page frame for the next read to reuse
# (a fresh frame costs page faults and zeroing on every read), plus allocator
# rounding: the slack is at least this, and at least one page + this margin.
_MIN_SLACK = 48 << 20
_SLACK_MARGIN = 16 << 20
# Of a user's budget, at least this fraction is kept as slack.
_SLACK_FRACTION = 1 / 20


def plan_slack(max_page: int) -> int:
    """The plan's slack for a model whose largest page frame is `max_page`."""
    return max(_MIN_SLACK, max_page + _SLACK_MARGIN)


def default_budget() -> int:
    """80% of physical memory: MLX's own default memory limit."""
    import psutil

    return int(0.8 * psutil.virtual_memory().total)


def model_path_of(model: str) -> Path:
    """A local directory for `model`: the directory itself (checked by
    checks.check_model), or a hub id downloaded as mlx-lm does. Raises
    FileNotFoundError, one line, when neither works."""
    from .checks import check_model

    check_model(str(model))
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from mlx_lm.utils import _download

        return Path(_download(model))
    except Exception as e:  # offline, unknown repo, ...
        raise FileNotFoundError(
            f"--model {model}: not a local directory, and it could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}): pass a local mlx-lm model directory"
        ) from None


def load_lazy(args):
    """(model, tokenizer, config, model_path): the model with its weights
    still on disk, as mlx_lm.load(..., lazy=True) returns it."""
    from mlx_lm.utils import load_model, load_tokenizer

    model_path = model_path_of(args.model)
    swapcache.check_model_files(model_path)  # a corrupt shard: one error naming it
    model, config = load_model(model_path, lazy=True, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(
        model_path, {"trust_remote_code": args.trust_remote_code}, eos_token_ids=config.get("eos_token_id", None)
    )
    return model, tokenizer, config, model_path


@dataclass
class Session:
    args: object
    model: nn.Module
    config: dict
    weights: PagedWeights
    plan: MemoryPlan
    gov: Governor
    blocks: step.Blocks
    first_trained: int
    page_footprints: List[int]
    seq_len: int  # the longest padded batch the data can make
    # Blocks tail_start..L-1 run as one no-recompute segment (segment.py);
    # L: none. Chosen by the loop from a measured block (plan_tail).
    tail_start: int = 0
    block_act_bytes: Optional[int] = None

    def use_step_schedule(self):
        """The pager's access order: a training step (forward, then backward
        down to the first trained block, or to the tail's start)."""
        order = step.step_schedule(len(self.model.layers), self.first_trained, self.tail_start)
        self.weights.pager.set_schedule([self.weights.page_ids[i] for i in order])

    def plan_tail(self, batch_size: int) -> int:
        """The tail segment's start for the budget as it is now, from the
        measured activations of one block (none measured yet, or a governor
        that had to degrade: no tail). Sets the schedule when it changes."""
        from . import segment

        L = len(self.model.layers)
        start = L
        if self.block_act_bytes is not None and not self.gov.events:
            head = segment.head_bytes(batch_size, self.seq_len, step._vocab_size(self.model))
            start = segment.choose_start(
                self.first_trained,
                self.page_footprints,
                self.gov.page_budget,
                self.block_act_bytes,
                head,
                self.plan.activations,
            )
        if start != self.tail_start:
            self.tail_start = start
            self.use_step_schedule()
        return start

    def use_forward_schedule(self):
        """The pager's access order: forward sweeps only (evaluation)."""
        self.weights.pager.set_schedule(list(self.weights.page_ids))


def trainable_state_bytes(model, optimizer: str, training: bool = True) -> int:
    n = sum(v.nbytes for _, v in tree_flatten(model.trainable_parameters()))
    if not training:
        return n
    return n * (_STATE_COPIES + _OPTIMIZER_MOMENTS.get(optimizer, 2))


def longest_batch(max_seq_length: int, datasets) -> int:
    """The longest padded batch iterate_batches can make from `datasets`
    (it pads to 1 + a multiple of 32, capped at max_seq_length)."""
    longest = 1
    for d in datasets:
        for i in range(len(d) if d is not None else 0):
            item = d[i]  # tokenizes (and caches) the record: (tokens, offset)
            tokens = item[0] if isinstance(item, tuple) and len(item) == 2 else item
            longest = max(longest, len(tokens))
    return min(max_seq_length, 1 + 32 * ((longest + 31) // 32))


def _largest_weight_elems(weights: PagedWeights) -> int:
    return max((int(np.prod(s.placeholder.shape)) for slots in weights.slots for s in slots), default=0)


def init_dora_magnitudes(model, weights: PagedWeights, first: int):
    """DoRA's magnitude m is the row norm of the frozen weight, which mlx-lm
    computes when it wraps the layer; here the weight is paged, so compute it
    the same way with each block paged in."""
    from mlx_lm.tuner.dora import DoRALinear

    for i in range(first, len(model.layers)):
        doras = [m for _, m in model.layers[i].named_modules() if isinstance(m, DoRALinear)]
        if not doras:
            continue
        with weights.bound(i):
            for d in doras:
                d.m = mx.linalg.norm(d._dequantized_weight().astype(mx.float32), axis=1)
            mx.eval([d.m for d in doras])


def open_session(
    args,
    model: nn.Module,
    config: dict,
    model_path: Path,
    datasets,
    attach_adapters: Callable[[], None],
    training: bool,
    say: Callable[[str], None],
    prep_progress: Optional[Callable[[int, int], None]] = None,
) -> Session:
    """Pages `model`, attaches adapters (`attach_adapters()`, called after the
    frozen weights are registered), plans the budget and starts governing.

    `datasets`: the CacheDatasets the run will iterate (sizes the
    activations). Raises BudgetError naming the minimum budget when the
    budget cannot hold one block page besides everything else."""
    from ._core import IO_ALIGN

    model.freeze()
    # The process's baseline, measured before a swap file may be written:
    # writing one leaves heap behind (given back below), and the budget's
    # minimum must not depend on whether this run wrote it.
    baseline = process_rss()
    weights = PagedWeights(
        model,
        model_path,
        budget_bytes=1 << 62,  # set by the governor below
        ssd_cache_dir=args.ssd_cache_dir,
        store=args.store,
        pager_options=dict(
            policy=args.policy,
            readahead=args.readahead,
            io_threads=args.io_threads,
            direct_io=args.direct_io,
            readahead_mode=args.readahead_mode,
        ),
        progress=prep_progress,
    )
    release_heap()
    attach_adapters()
    first = step.first_trained_block(model)

    floating = [
        s.placeholder.dtype
        for s in weights.slots[weights.resident_id]
        if mx.issubdtype(s.placeholder.dtype, mx.floating)
    ]
    act_itemsize = (floating[0] if floating else mx.float32).size
    plan_budget, budget_error = 0, None
    try:
        plan_budget = parse_size(args.memory_budget) if args.memory_budget is not None else default_budget()
    except BudgetError as e:
        budget_error = e
    seq_len = longest_batch(args.max_seq_length, datasets)
    max_page = weights.max_page_bytes + IO_ALIGN
    slack = plan_slack(max_page)
    if args.page_budget is None:
        slack = max(slack, int(plan_budget * _SLACK_FRACTION))
    # Forward-only evaluation keeps no checkpoints; training keeps one per
    # trained block and micro-batch.
    trained = len(model.layers) - first if training else 0
    plan = MemoryPlan(
        budget=plan_budget,
        baseline=baseline,
        resident=weights.resident_bytes + IO_ALIGN,
        trainable=trainable_state_bytes(model, args.optimizer.lower(), training),
        activations=estimate_activations(
            config,
            args.batch_size,
            seq_len,
            args.grad_accumulation_steps,
            trained,
            act_itemsize,
            args.head_chunk_bytes,
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
    gov = Governor(plan, weights.pager, pinned_bytes=weights.resident_bytes + IO_ALIGN)
    weights.pin_resident()
    if training and args.fine_tune_type == "dora":
        init_dora_magnitudes(model, weights, first)
    session = Session(
        args=args,
        model=model,
        config=config,
        weights=weights,
        plan=plan,
        gov=gov,
        blocks=step.Blocks(model),
        first_trained=first,
        page_footprints=[weights.page_bytes(i) + IO_ALIGN for i in range(weights.num_blocks)],
        seq_len=seq_len,
        tail_start=len(model.layers),
    )
    if training:
        session.use_step_schedule()
    else:
        session.use_forward_schedule()

    say(
        f"Model: {len(model.layers)} blocks, {format_size(weights.paged_bytes)} paged "
        f"({'/'.join(sorted(set(weights.store_kind)))}), "
        f"{format_size(weights.resident_bytes)} resident. Budget {format_size(plan.budget)}: "
        f"pages {format_size(plan.page_budget)} (~{plan.page_budget / plan.max_page:.1f} blocks), "
        f"fixed {format_size(plan.fixed)}."
    )
    io = weights.pager.stats()
    if io["buffered_files"]:
        say(
            f"Warning: {io['buffered_files']} of {io['buffered_files'] + io['direct_files']} weight files "
            "refused direct I/O: their reads go through the page cache, dropped after each read."
        )
    return session
