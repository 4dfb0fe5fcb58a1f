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

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from . import attention, jit, kinds, placement, prefix, segment, step, stream, swapcache
from . import outside as out  # (adapters outside the blocks; `outside` names bytes here)
from .budget import CACHE_SLACK, BudgetError, MemoryPlan, format_size, parse_size
from .governor import Governor, outside_mlx, process_rss, release_heap
from .memlimit import budget_or_default, memory_limit
from .store import MAX_PAGE_PARTS, PAGE_PART_BYTES, PagedWeights, block_footprints, block_prefixes

# Parameter, gradient, accumulated gradient (+ optimizer moments, below).
_STATE_COPIES = 3
_OPTIMIZER_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1, "adafactor": 2}

# The least headroom Session.learn_peak adds over what a step's peak held.
_PEAK_JITTER_MIN = 4 << 20

# How many more times the session's block probe widens its batch towards
# the batch's rows, where the room allows (open_session).
WIDER_BLOCK_PROBES = 3
# A kind of block runs uncompiled where compiled its forward + vjp takes
# more than COMPILED_GROWTH times uncompiled on any of COMPILED_CHECK_TOKENS
# tokens (compiled_over), or where the memory limit leaves no room for
# COMPILED_PROBE_ROOM times the uncompiled one to measure it.
COMPILED_GROWTH = 1.5
COMPILED_CHECK_TOKENS = (64, 256)
COMPILED_PROBE_ROOM = 8


def plan_slack() -> int:
    """The plan's slack before a step has run: what MLX's buffer cache and
    allocator rounding may hold beside the pages, the activations and the
    state (Session.learn_peak grows it to what the steps measure)."""
    return CACHE_SLACK


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
    from mlx_lm.utils import load_model

    from .checks import check_backend_ops, check_blocks_unpatched, check_pageable, load_tokenizer

    model_path = model_path_of(args.model)
    swapcache.check_model_files(model_path)  # a corrupt shard: one error naming it
    model, config = load_model(model_path, lazy=True, trust_remote_code=args.trust_remote_code)
    check_blocks_unpatched(model)
    check_pageable(model)
    check_backend_ops(model)
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
    # The pages as the simulator sees them (simulate.py): page n is
    # weights.page_order[n], charged page_footprints[n], its read moving
    # page_read_bytes[n]; block i's pages in use order, and those a streamed
    # tail reads again for its backward.
    page_footprints: List[int]
    page_read_bytes: List[int]
    block_pages: List[Tuple[int, ...]]
    tail_back_pages: List[Tuple[int, ...]]
    seq_len: int  # the longest padded batch the data can make
    # How the step spends its activation memory (placement.py): blocks
    # tail_start..L-1 run as one no-recompute segment (L: none), each batch
    # in `parts` micro-batches. Re-planned after every step from what it
    # measured (replan).
    sizes: Optional[placement.Sizes] = None
    shape: Optional[placement.Step] = None
    placement: Optional[placement.Placement] = None
    page_cap: Optional[int] = None  # page_budget: pages never get more
    # No placement with a longer tail, fewer spilled blocks or fewer parts:
    # set by the ladder (replan), or from the start by --grad-checkpoint.
    ceiling: Optional[placement.Placement] = None
    spill: Optional[object] = None  # spill.SpillStore, once a placement spills
    live: Optional[dict] = None  # the running step's probe (step.paged_value_and_grad)
    # Per step: what the plan's slack had to hold (learn_peak).
    slack_needed: List[int] = field(default_factory=list)
    # The process's memory outside MLX's buffers (RSS less MLX's active and
    # cached bytes) when the baseline was taken, and its growth since, per
    # step (learn_peak).
    outside_base: int = 0
    outside_grown: List[int] = field(default_factory=list)
    last_shapes: Optional[list] = None  # the micro-batch shapes of the last step (loop.py)
    held: Optional[bool] = None  # the schedule's tail is held (step.holds_tail), not streamed
    # The frozen prefix's window (prefix.py): its steps, and how many of
    # them have run (loop.py sets it; the schedule follows).
    window: Tuple[int, int] = (1, 0)
    # mx.compile is off for this session (open_session): put back on close.
    compile_disabled: bool = False
    # Attention runs in chunks of this many query rows for this session
    # (attention.route; 0: MLX's own, mlx-lm's arithmetic): where one
    # sequence's block does not fit whole (open_session). What it replaced
    # is put back on close.
    attention_chunk: int = 0
    attention_replaced: Optional[Callable] = None
    # The blocks of the kind measured largest at start-up (kinds.py): a
    # step's block measure replaces that one only where one of them was
    # recomputed (replan).
    largest_kind: List[int] = field(default_factory=list)
    # Steps in a row whose peak went over the budget, and whether the run
    # was told that its plan needs more than the budget (after_step).
    overs: int = 0
    told_over: bool = False

    def memory_now(self) -> dict:
        """Checkpoints held in memory and on the SSD now (memory traces)."""
        return {
            "checkpoint_bytes": int((self.live or {}).get("checkpoint_bytes", 0)),
            "spilled_now_bytes": int(self.spill.live_bytes) if self.spill is not None else 0,
        }

    @property
    def tail_start(self) -> int:
        return self.placement.tail_start if self.placement is not None else len(self.model.layers)

    @property
    def parts(self) -> int:
        return self.placement.parts if self.placement is not None else 1

    @property
    def head_chunk_bytes(self) -> int:
        """The head's chunk of logits the steps run with: the placement's,
        or --head-chunk-bytes (the trainer's default)."""
        chunk = self.placement.head_chunk if self.placement is not None else 0
        return chunk or self.args.head_chunk_bytes or 0

    def use_step_schedule(self):
        """The pager's access order: a training step (forward, then backward
        down to the first trained block, or to the tail's start), with each
        spilled block's checkpoint pages after its own page in the backward
        sweep (the order step.py acquires them in). In a window of several
        steps whose frozen prefix runs ahead (prefix.py): the prefix's
        blocks once, then each step from its first trained block, from the
        step about to run on."""
        slots = self.shape.micro_batches(self.parts)
        self.held = self.holds_tail()
        spilled = range(self.first_trained, self.first_trained + (self.placement.spilled if self.placement else 0))
        steps, at = self.window
        ahead = steps > 1 and self.placement is not None and self.placement.ahead > 1
        ids = step.step_pages(
            self.weights,
            self.first_trained,
            self.tail_start,
            slots,
            lambda i: self.spill.page_ids(i, slots) if i in spilled and self.spill is not None else [],
            held=self.held,
            prefix=not ahead,
        )
        if ahead:
            sweep = [p for i in range(self.first_trained) for p in self.weights.block_pages[i]]
            order = sweep + ids * steps
            cut = 0 if at == 0 else len(sweep) + at * len(ids)
            ids = order[cut:] + order[:cut]
        self.weights.pager.set_schedule(ids)

    def start_window(self, steps: int) -> None:
        """A window of `steps` steps begins (loop.py): the schedule follows
        where the prefix runs ahead, or where the last window's did."""
        last = self.window[0]
        self.window = (steps, 0)
        if steps > 1 or last > 1:
            self.use_step_schedule()

    def window_at(self, done: int) -> None:
        """`done` steps of the window have run (the schedule, if it must be
        set again mid-window, starts at the next)."""
        self.window = (self.window[0], done)

    def holds_tail(self) -> bool:
        """Whether the placement's tail fits the page budget now, so that a
        step holds its pages rather than streaming them (step.holds_tail)."""
        # with spilled checkpoints, no tail is held: their pages come and go
        # beside the blocks below the tail, which the hold does not count
        if self.placement is not None and self.placement.spilled:
            return False
        return step.holds_tail(self.weights, self.tail_start, step.page_room(self.weights))

    def tail_hold(self) -> bool:
        """holds_tail() for the step about to run; the pager's schedule
        follows when it changed (the governor moved the page budget)."""
        if self.holds_tail() != self.held:
            self.use_step_schedule()
        return self.held

    def spill_store(self, p: "placement.Placement"):
        """The activation swap file for placement `p` (None: it spills
        nothing); made, or made again with bigger slots, as needed."""
        if not p.spilled:
            return self.spill
        from .spill import SpillStore

        rows = -(-self.args.batch_size // p.parts)
        need = self.sizes.checkpoint(rows, self.seq_len)
        if self.spill is None or self.spill.slot_bytes < need:
            if self.spill is not None:
                self.spill.close()
            self.spill = SpillStore(self.weights, self.args.ssd_cache_dir, need)
        return self.spill

    def close(self):
        """The run is over: the spill file goes, and MLX's cache (which the
        plan let grow into the budget's unused room) is emptied; the model's
        dropouts outside the blocks are its own again (outside.py)."""
        try:
            self._close()
        finally:
            out.restore_dropouts(self.model)

    def _close(self):
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        self.weights.pager.evict_all()
        self.weights.pager.drop_kept_frame()  # the frame and pool kept for reads (mlx_frames.h)
        release_heap()
        if self.compile_disabled:
            self.compile_disabled = False
            mx.enable_compile()
        if self.attention_chunk:
            self.attention_chunk = 0
            attention.restore(self.attention_replaced)

    @property
    def pool(self) -> int:
        """What the budget leaves for pages and activations."""
        return self.plan.budget - self.plan.fixed_without_activations

    def place(self, p: "placement.Placement") -> None:
        """Uses placement `p` from the next step on: the activations it
        reserves leave the rest of the pool to the pages (readahead and
        caching use them)."""
        old = self.placement
        self.placement = p
        self.spill_store(p)
        self.plan.activations = p.activations
        page_budget = self.plan.page_budget if self.page_cap is None else min(self.page_cap, self.plan.page_budget)
        # (At least its pages: after_step may place one that does not fit.)
        self.gov.set_page_budget(max(p.pages, page_budget))
        self.gov.min_page_budget = p.pages
        # MLX keeps freed buffers for reuse up to its cache limit (32 MB by
        # default on the CPU): beyond it, every step's activations are freed
        # to the OS and faulted in again (~350K page faults a step on the
        # bench's compute shape, a third of its time). Room the pages will
        # never fill may hold them between steps. So may the activations'
        # own reservation when the step is one graph (the whole trained part
        # as the tail, one micro-batch): a step of the same shapes then asks
        # for the same buffers in the same order, each one a cache hit, so
        # the cache never adds to the peak (loop.py empties it when the
        # shapes change). With recompute, phases of other sizes would leave
        # buffers in the cache beside new ones: not there. A tail streaming
        # its pages through a small budget is one graph too: the pager keeps
        # the last frame freed for the next read (mlx_frames.h), within its
        # budget, so MLX's cache does not fill with frames. Except through a
        # budget of one frame, where MLX's stream drains before every read
        # (nothing frees the frame before): the buffers it frees then stay in
        # the cache beside the next ones (measured 1.03-1.06x the plan).
        # (A frame is a page: a block in parts streams through several
        # frames even where the budget holds one block.)
        unused = max(0, page_budget - sum(self.shape.footprints))
        tail = self.shape.footprints[p.tail_start :]
        streams = page_budget < sum(tail)
        tail_pages = [self.page_footprints[n] for b in self.block_pages[p.tail_start :] for n in b]
        one_frame = streams and page_budget < 2 * max(tail_pages, default=0)
        one_graph = p.recomputed == 0 and p.parts == 1 and self.shape.batches == 1 and not one_frame
        # (The prefix's outputs waiting for their steps are live, not cache.)
        cache = CACHE_SLACK + unused + (p.activations - p.waiting if one_graph else 0)
        mx.set_cache_limit(int(cache))
        schedule = old is None or (old.tail_start, old.spilled, old.parts, old.ahead) != (
            p.tail_start,
            p.spilled,
            p.parts,
            p.ahead,
        )
        if schedule:
            self.use_step_schedule()
        if schedule or old.head_chunk != p.head_chunk:
            mx.clear_cache()  # buffers of the old placement's shapes would not serve the new one

    def replan(self, probe: Optional[dict] = None, smaller: bool = False, refresh: bool = False) -> bool:
        """Takes in a step's measurements and picks the placement for the
        next one; `smaller`: one that needs less memory than the current one
        (a step did not fit; the run never goes back above it); `refresh`:
        place it even if unchanged (the plan's fixed part changed). Returns
        False when nothing fits (the placement stays: predictions err high,
        and the governor watches the steps; after_step acts on a measure)."""
        if probe:
            tail_start = self.placement.tail_start if self.placement is not None else self.first_trained
            self.sizes.learn(kept_measures(probe, range(self.first_trained, tail_start), self.largest_kind))
            self.follow_pages()
        p = placement.choose(
            self.shape,
            self.sizes,
            self.pool,
            self.page_cap,
            at_most=self.placement if smaller else None,
            ceiling=self.ceiling,
        )
        if p is None:
            return False
        if smaller:
            self.ceiling = p
        old = self.placement
        if p != old or refresh:
            self.place(p)
        if p != old:
            if not smaller and old is not None:
                # The pool changed (a budget lowered, sizes measured): a
                # placement that needs less is a rung of the ladder too.
                rung = placement.rung(old, p)
                if rung is not None:
                    self.gov.record(rung, f"next step: {placement.describe(p, len(self.model.layers))}")
        return True

    def after_step(self, peak: int) -> None:
        """Takes in a step's peak RSS (the kernel's high-water mark). Where
        it went over the budget a second step in a row (once may be a one-off:
        a first step's compiling, graphs of shapes the governor let go of
        mid-step), inside a block's graph between the governor's samples, the
        next steps run with a placement that needs less: one that fits where
        the sizes measured leave one, else the one that needs the least, or
        with none left, uncompiled; and the run is told once what budget the
        plan needs. (A DoRA run at 1.05x its least budget peaked 7% over it
        every step, its plan predicting more than the budget, and said
        nothing.)"""
        self.overs = self.overs + 1 if peak > self.plan.budget else 0
        if self.overs < 2:
            return
        old = self.placement
        if not self.replan(smaller=True):
            least = placement.least(self.shape, self.sizes, self.ceiling)
            if least.need < old.need:
                self.ceiling = least
                self.place(least)
        p = self.placement
        if p != old:
            self.gov.record(
                placement.rung(old, p) or "recompute",
                f"a step peaked at {format_size(peak)}, over the budget: the next with "
                f"{placement.describe(p, len(self.model.layers))}",
                tail_start=p.tail_start,
                parts=p.parts,
            )
        elif self.blocks.stop_compiling():
            self.gov.record(
                "uncompile", f"a step peaked at {format_size(peak)}, over the budget: the blocks run uncompiled"
            )
        need = self.plan.fixed_without_activations + p.need
        if need > self.plan.budget and not self.told_over:
            self.told_over = True
            self.gov.record(
                "over",
                f"the steps measured more than the start-up planned: the least placement left needs "
                f"{format_size(need, up=True)}, over --memory-budget {format_size(self.plan.budget)}; the run "
                f"goes on, its steps split or stopped where the governor finds the budget reached. Give "
                f"--memory-budget {format_size(need, up=True)} or more to run within it",
            )

    def learn_peak(self, measured: int, ran: "placement.Placement", page_budget: int) -> bool:
        """Takes in a step's measured peak RSS (the kernel's high-water
        mark), beside the peak the plan now predicts for the placement it ran
        with (`ran`, at `page_budget`), from the sizes the step measured.
        What the slack had to hold is memory no other term of the plan sees:
        MLX's cache holding buffers a graph freed beside those it allocates
        next (MLX's peak counter sees only the latter), and the process's own
        memory outside MLX that grows after the baseline is taken (~20 MB on
        the bench's shapes). The slack becomes the most any step needed, never
        less than CACHE_SLACK beside the growth of the memory outside MLX
        measured after each step (RSS less MLX's active and cached bytes,
        against the same at the baseline: a later step's cache may be full
        beside it), and 2% more; the first step counts only until
        a second has run (it also holds one-off costs: compiling, start-up
        probes). The pages make room (with page_budget, the memory budget
        follows: follow_pages). Returns True when the slack changed."""
        again = placement.evaluate(self.shape, self.sizes, *placement.evaluate_args(ran))
        self.slack_needed.append(measured - (self.predicted_peak(again, page_budget) - self.plan.slack))
        # The page pool's pages (mlx_frames.h) are the pages' memory, inside
        # the page budget, though outside MLX's counts.
        pooled = self.weights.pager.stats().get("pool_bytes", 0)
        self.outside_grown.append(outside_mlx(process_rss()) - pooled - self.outside_base)
        needed = max(self.slack_needed[1:] or self.slack_needed)
        # What a step needed is memory outside MLX plus what MLX's cache held
        # at its peak, and the cache differs from step to step: a page frame
        # the pager let go of (mlx_frames.h) sits in it at one step's peak
        # and not at the next's (bench: +46 MB on the read shape at 10%, +8 MB
        # on q4). So the slack holds at least the cache's limit (CACHE_SLACK
        # where the pages stream) beside the memory outside MLX measured
        # after each step.
        outside = max(0, max(self.outside_grown[1:] or self.outside_grown))
        # 2% more: peaks of steps of one shape differ by up to about that
        # (measured: a second step 1.2-1.7% over the first)
        slack = max(CACHE_SLACK + outside, needed) + max(_PEAK_JITTER_MIN, measured // 50)
        change = slack - self.plan.slack
        if change == 0 or (change < 0 and len(self.slack_needed) > 2):
            return False  # it shrinks once, when the first step stops counting
        self.plan.slack = slack
        self.follow_pages()
        return True

    def follow_pages(self) -> None:
        """With page_budget, the memory budget follows the pages (open()):
        the fixed part, the activations of the placement with no block
        recomputed, from the sizes measured so far, and the pages. It only
        grows: a measured size or slack larger than the start-up's would
        otherwise take room from the pages or split the batch."""
        if self.page_cap is None:
            return
        acts = placement.evaluate(
            self.shape, self.sizes, self.shape.first_trained, 1, ahead=self.shape.ahead
        ).activations
        budget = self.plan.fixed_without_activations + acts + self.page_cap
        if budget > self.plan.budget:
            self.plan.budget = budget
            mx.set_memory_limit(int(budget))

    def predicted_peak(self, p: Optional["placement.Placement"] = None, page_budget: Optional[int] = None) -> int:
        """The process's peak as the plan predicts it for placement `p` (the
        current one): everything fixed, the activations, and the pages
        (the pager fills its budget, `page_budget` or the current one, with
        pages it may need again, up to all of them)."""
        p = p or self.placement
        page_budget = self.gov.page_budget if page_budget is None else page_budget
        pages = max(p.pages, min(page_budget, sum(self.shape.footprints)))
        return self.plan.fixed_without_activations - self.plan.margin + p.activations + pages

    def eval_group(self) -> int:
        """Micro-batches a forward-only sweep (evaluation) carries together
        in the activations reserved: each keeps its hidden state and the
        next block's output, besides the larger of one forward block's
        working set (a micro-batch at a time, step._forward_sweep) and the
        head's loss for one. At most 8 batches' worth (or a step's); at
        least 1."""
        rows, length = -(-self.args.batch_size // self.parts), self.seq_len
        per = 2 * self.sizes.checkpoint(rows, length)
        chunk = self.placement.head_chunk if self.placement is not None else 0
        work = max(self.sizes.head(rows, length, chunk), self.sizes.forward(rows, length))
        most = max(8, self.args.grad_accumulation_steps) * self.parts
        return max([1] + [n for n in range(2, most + 1) if n * per + work <= self.plan.activations])

    def use_forward_schedule(self):
        """The pager's access order: forward sweeps only (evaluation)."""
        self.weights.pager.set_schedule(self.weights.page_order)


# --page-parts auto: a block is one page while the page budget holds at
# least this many blocks, and in parts below. With whole blocks and room
# for about one, nothing overlaps a block's read: each block is read, then
# computed. In parts the next part is read while the last one computes
# (bench, read shape at one block: 1.59-1.84 s a step against 2.30 s whole;
# compute shape: 2.20 s against 2.82 s). With room for two whole blocks the
# disk still idles wherever both frames hold blocks in use (a block's
# recompute and backward, the optimizer update): the fastest eviction
# schedule of whole blocks (bench "opt s") is 1.3x the read bound there.
# Side by side at two blocks (bench at bd6c093, 2026-12-04): read shape
# 0.72 / 0.85 / 0.80 / 0.94 / 0.69 s in parts against 0.87 / 1.02 / 0.80 /
# 0.81 / 0.63 s whole (the same runs' 'again' rows in parts: 0.79 / 0.60 /
# 0.66 / 0.59 / 0.62); compute shape 2.19 / 2.77 / 2.75 against 3.15 /
# 3.29 / 4.05; 4-bit and the 8 GB shape even. At three blocks neither won
# (read shape, docs/design.md "Pages"), and from four whole blocks stream faster with
# fewer, larger reads (read shape at four: 0.95 s against 1.14 s).
PARTS_BELOW_BLOCKS = 3
AUTO_MIN_PARTS = 4


def page_parts(
    arg,
    block_bytes: Sequence[int] = (),
    page_budget: Optional[int] = None,
    footprint: Optional[Callable[[int], int]] = None,
) -> Optional[int]:
    """PagedWeights' page_parts for --page-parts: N as given; 'auto' by the
    page budget (PARTS_BELOW_BLOCKS): 1 where it holds enough blocks (or is
    unknown), else each block in parts of ~PAGE_PART_BYTES, at least
    AUTO_MIN_PARTS and at most MAX_PAGE_PARTS (split_block keeps modules
    whole: fewer where a block has fewer). `footprint(n)`: the largest
    block's footprint in n pages (store.block_footprints); where the budget
    does not hold it in parts and it is smaller whole, whole (a recomputed
    or evaluated block is bound whole: its parts must fit together; a small
    block's parts cost more than it, each with its alignment)."""
    if arg != "auto":
        return int(arg)
    biggest = max(block_bytes, default=0)
    if not biggest or page_budget is None or page_budget >= PARTS_BELOW_BLOCKS * biggest:
        return 1
    n = min(MAX_PAGE_PARTS, max(AUTO_MIN_PARTS, round(biggest / PAGE_PART_BYTES)))
    if footprint is not None:
        split = footprint(n)  # (each call plans every page of the model)
        if split > page_budget and footprint(1) < split:
            return 1
    return n


def frozen_block_bytes(model: nn.Module) -> Tuple[List[int], int]:
    """Before paging: each block's frozen bytes, and the frozen bytes
    outside the blocks (the pinned page: embeddings, final norm, head)."""
    params = dict(tree_flatten(model.parameters()))
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    frozen = {k: v.nbytes for k, v in params.items() if k not in trainable}
    blocks = [sum(b for k, b in frozen.items() if k.startswith(p + ".")) for p in block_prefixes(model)]
    return blocks, sum(frozen.values()) - sum(blocks)


def estimated_page_budget(args, model, config, seq_len: int, baseline: int, outside: int) -> Optional[int]:
    """The page budget open_session will plan, estimated before the pages
    are registered (to choose --page-parts auto): page_budget as given;
    else the memory budget less the process, the pinned page, the slack,
    the margin and one recomputed block's activations by the formula
    (estimate_sizes: it over-estimates, so a borderline budget pages in
    parts; `outside`: frozen_block_bytes' second figure). None where the
    budget is not readable (open_session says why)."""
    if args.page_budget is not None:
        return parse_size(args.page_budget, "page_budget")
    try:
        budget = budget_or_default(args.memory_budget)
    except BudgetError:
        return None
    params = [v for _, v in tree_flatten(model.parameters())]
    largest = max((int(np.prod(v.shape)) for v in params), default=0)
    floating = [v.dtype for v in params if mx.issubdtype(v.dtype, mx.floating)]
    itemsize = (floating[0] if floating else mx.float32).size
    acts = estimate_sizes(config, seq_len, itemsize, args.head_chunk_bytes or 0, largest).block(
        args.batch_size, seq_len
    )
    return budget - baseline - outside - plan_slack() - Governor.margin_for(budget) - acts


def simulated_pages(weights: PagedWeights) -> dict:
    """Session's page_footprints, page_read_bytes, block_pages and
    tail_back_pages."""
    index = {pid: n for n, pid in enumerate(weights.page_order)}
    return dict(
        page_footprints=[weights.page_footprint(p) for p in weights.page_order],
        page_read_bytes=[weights.page_read_bytes(p) for p in weights.page_order],
        block_pages=[tuple(index[p] for p in pages) for pages in weights.block_pages],
        tail_back_pages=[tuple(index[p] for p in stream.backward_pages(weights, i)) for i in range(weights.num_blocks)],
    )


def estimate_sizes(
    config: dict,
    seq_len: int,
    act_itemsize: int,
    head_chunk_bytes: int,
    largest_weight_elems: int,
    attention_chunk: int = 0,
) -> placement.Sizes:
    """What the planner assumes before a step has measured anything: a
    conservative formula for one block's forward + vjp in float32 (~16
    hidden-sized and ~6 MLP-sized temporaries per token, the attention
    scores, their softmax and their gradients, ~6 score-sized buffers),
    and an unquantized copy of the largest weight for backends that
    dequantize. The first step runs by it, so it must not underestimate:
    the governor cannot step in inside one block's graph. With attention
    in chunks of `attention_chunk` query rows (attention.py), the scores
    are that many rows long, not seq_len."""
    # (Gemma 3 / 4, Llama 4, Mistral 3 keep these in text_config.)
    config = {**(config.get("text_config") or {}), **{k: v for k, v in config.items() if v is not None}}
    d = int(config.get("hidden_size", 4096))
    f = int(config.get("intermediate_size", 4 * d))
    heads = int(config.get("num_attention_heads", 32))
    per_token = (16 * d + 6 * f) * 4 + 6 * heads * min(seq_len, attention_chunk or seq_len) * 4
    return placement.Sizes(
        hidden=d,
        itemsize=act_itemsize,
        vocab=int(config.get("vocab_size", 32000)),
        block_per_token=per_token,
        block_len=seq_len,
        block_fixed=2 * largest_weight_elems * 4,
        head_chunk_bytes=head_chunk_bytes,
    )


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
    """The largest block weight's elements: what a block's graph may hold
    a dequantized copy of (estimate_sizes). Not the resident page's
    (embeddings, LM head): no block's graph takes them, and the embedding
    is the largest weight of most models (Gemma 3 27B's: 1.4 billion
    elements, 11 GB of float32 reserved for every block's working set)."""
    return max(
        (
            int(np.prod(s.placeholder.shape))
            for pid, slots in enumerate(weights.slots)
            if pid != weights.resident_id
            for s in slots
        ),
        default=0,
    )


def init_dora_magnitudes(model, weights: PagedWeights, first: int):
    """DoRA's magnitude m is the row norm of the frozen weight, which mlx-lm
    computes when it wraps the layer; here the weight is paged, so compute it
    the same way with each block paged in."""
    from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear

    # Outside the blocks (outside.py: the head's, the embeddings'), the
    # weights are the resident page's, pinned by now: mlx-lm's own code.
    for _, d in out.modules(model):
        if isinstance(d, DoRALinear):
            d.set_linear(d.linear)
        elif isinstance(d, DoRAEmbedding):
            d.set_embedding(d.embedding)
    for i in range(first, len(model.layers)):
        doras = [m for _, m in model.layers[i].named_modules() if isinstance(m, DoRALinear)]
        if not doras:
            continue
        with weights.bound(i):
            for d in doras:
                d.m = mx.linalg.norm(d._dequantized_weight().astype(mx.float32), axis=1)
            mx.eval([d.m for d in doras])


def kept_measures(probe: dict, recomputed: range, largest_kind: List[int]) -> dict:
    """What of a step's measures (`probe`) the plan learns: all, but its
    block measure only where a block of the largest kind measured at
    start-up (`largest_kind`; empty: one kind) was among the `recomputed`
    blocks it is the largest of (a linear-attention block's vjp, where the
    full-attention one, 8x it at 4,096 tokens, ran in the tail)."""
    if "block" in probe and largest_kind and not any(b in recomputed for b in largest_kind):
        return {k: v for k, v in probe.items() if k != "block"}
    return probe


def compiled_over(
    model, weights, blocks: step.Blocks, standing: Dict[int, List[int]], seq_len: int, room: float
) -> List[str]:
    """Runs uncompiled the kinds of blocks (`standing`: kinds.represented)
    whose forward + vjp compiled takes more than COMPILED_GROWTH times
    uncompiled, measured on COMPILED_CHECK_TOKENS (at most `seq_len`):
    the plan is the uncompiled measure. On MLX's CPU backend mlx-lm's
    linear-attention (gated delta) and Mamba blocks are loops over the
    sequence, and compiled their memory grows with its square: a tiny
    Qwen3-Next linear-attention block took 2.0 / 3.4 / 6.6x its
    uncompiled memory at 64 / 128 / 256 tokens, and 2.9 GB against 59 MB at
    2,048 (mlx_lm.lora itself peaked at 4.3 GB there); a Mamba block 3.4x at
    256. Other kinds take about the same either way. Each length is tried in
    turn, the next only where the last stayed under; a compiled probe runs
    only where `room` (what the memory limit leaves) holds
    COMPILED_PROBE_ROOM times the uncompiled one, else the kind runs
    uncompiled. Returns what it says, a line per kind."""
    said = []
    lengths = sorted({min(seq_len, n) for n in COMPILED_CHECK_TOKENS})
    for block, kind in standing.items():
        why = None
        for n in lengths:
            try:
                plain = step.probe_block(model, weights, block, 1, n)
                if plain * COMPILED_PROBE_ROOM > room:
                    why = f"no room to measure block {block} compiled on {n} tokens"
                    break
                compiled = step.probe_block(model, weights, block, 1, n, blocks=blocks)
            except Exception:  # (the step says what fails)
                break
            if compiled > COMPILED_GROWTH * plain + (1 << 20):
                why = (
                    f"compiled, block {block}'s forward + vjp took {format_size(compiled)} on {n} tokens, "
                    f"{format_size(plain)} uncompiled"
                )
                break
        if why is not None:
            blocks.run_uncompiled(kind, why)
            which = f"Blocks {', '.join(map(str, kind))} run" if len(kind) > 1 else f"Block {kind[0]} runs"
            said.append(f"{which} uncompiled: {why}.")
        weights.pager.evict_all()  # (its page: nothing evicts yet)
    blocks.drop_compiled()  # (the checks' shapes)
    release_heap()
    return said


def open_session(args, *rest, **kwargs) -> Session:
    """Pages `model`, attaches adapters (`attach_adapters()`, called after the
    frozen weights are registered), plans the budget and starts governing
    (_open_session, whose arguments it takes).

    Where the memory limit leaves the CPU backend's compiler no room beside
    the budget (jit.tail_compile_refused), mx.compile is off for the whole
    session, MLX's own compiled functions (activations) and the optimizer
    update included, from before the start-up probes: each new kernel is
    built by the system compiler in a child process the cgroup charges, and
    under a hard cap equal to the budget a cold kernel cache had the run
    killed (gemma3_text, 1024 tokens, 214.69 MB: it trains with the kernels
    cached). Session.close() turns it back on."""
    budget = None
    if getattr(args, "page_budget", None) is None:
        try:
            budget = budget_or_default(args.memory_budget)
        except (BudgetError, RuntimeError):
            budget = None  # _open_session says why
    disable = budget is not None and jit.tail_compile_refused(budget) is not None
    if disable:
        mx.disable_compile()
    attention_before = mx.fast.scaled_dot_product_attention  # (the probes may route it)
    try:
        session = _open_session(args, *rest, **kwargs)
    except BaseException:
        if disable:
            mx.enable_compile()
        attention.restore(attention_before)
        out.restore_dropouts(rest[0] if rest else kwargs["model"])
        raise
    session.compile_disabled = disable
    return session


def _open_session(
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
    """open_session's body. `datasets`: the CacheDatasets the run will
    iterate (sizes the activations). Raises BudgetError naming the minimum
    budget when the budget cannot hold one block page besides everything
    else."""
    model.freeze()
    # What an earlier run in this process left (its pages, until its objects
    # are collected; MLX's cache) is not this run's baseline.
    gc.collect()
    release_heap()
    # The process's baseline, measured before a swap file may be written:
    # writing one leaves heap behind (given back below), and the budget's
    # minimum must not depend on whether this run wrote it.
    baseline = process_rss()
    outside_base = outside_mlx(baseline)
    seq_len = longest_batch(args.max_seq_length, datasets)
    parts_arg = getattr(args, "page_parts", 1)
    if parts_arg == "auto":
        blocks, outside = frozen_block_bytes(model)
        store = getattr(args, "store", "auto")
        parts = page_parts(
            "auto",
            blocks,
            estimated_page_budget(args, model, config, seq_len, baseline, outside),
            lambda n: max(block_footprints(model, model_path, n, store), default=0),
        )
    else:
        parts = page_parts(parts_arg)
    weights = PagedWeights(
        model,
        model_path,
        budget_bytes=1 << 62,  # set by the governor below
        ssd_cache_dir=args.ssd_cache_dir,
        store=args.store,
        pager_options=dict(
            policy=args.policy,
            # no --readahead: 2 until the measured step chooses (simulate.AutoReadahead)
            readahead=args.readahead if args.readahead is not None else 2,
            io_threads=args.io_threads,
            direct_io=args.direct_io,
            readahead_mode=args.readahead_mode,
        ),
        progress=prep_progress,
        page_parts=parts,
    )
    # --readahead counts blocks; the pager counts pages.
    weights.pager.set_readahead((args.readahead if args.readahead is not None else 2) * weights.pages_per_block)
    release_heap()
    attach_adapters()
    if training:
        # Dropouts of adapters outside the blocks draw mlx-lm's masks in the
        # steps and masks of their own anywhere else (outside.py), until
        # Session.close.
        out.install_dropouts(model)
    # (Evaluation differentiates nothing: the adapters outside the blocks
    # evaluate as mlx-lm evaluates them, outside.py.)
    first = step.first_trained_block(model) if training else len(model.layers)

    floating = [
        s.placeholder.dtype
        for s in weights.slots[weights.resident_id]
        if mx.issubdtype(s.placeholder.dtype, mx.floating)
    ]
    act_itemsize = (floating[0] if floating else mx.float32).size
    plan_budget, budget_error = 0, None
    try:
        plan_budget = budget_or_default(args.memory_budget)
    except BudgetError as e:
        budget_error = e
    max_page = weights.max_block_charge
    slack = plan_slack()
    L = len(model.layers)
    carries = step.model_carries(model)  # what blocks pass each other besides h (carry.py)
    # Forward-only evaluation keeps no checkpoints: plan it as a step with
    # no trained block.
    shape = placement.Step(
        num_blocks=L,
        first_trained=first if training else L,
        footprints=[weights.block_charge_bound(i) for i in range(weights.num_blocks)],
        held=[stream.held_bytes(weights, i) for i in range(weights.num_blocks)],
        rows=args.batch_size,
        length=seq_len,
        # evaluation sweeps groups of up to 8 batches together (loop.evaluate)
        batches=args.grad_accumulation_steps if training else max(8, args.grad_accumulation_steps),
        # (and those adapters outside the blocks make: outside.Prefix)
        carries=carries.pairs() + (out.prefix(model).pairs() if training and first == 0 else []),
    )
    head_cap = args.head_chunk_bytes or 0  # (None: the head whole unless the plan chunks it)
    largest = _largest_weight_elems(weights)
    measured = step.carried_sizes(model) if carries else None

    def fresh_sizes(attention_chunk: int = 0) -> placement.Sizes:
        """The formula's sizes, with attention in chunks of `attention_chunk`
        query rows (0: whole), before any block is measured."""
        sizes = estimate_sizes(config, seq_len, act_itemsize, head_cap, largest, attention_chunk)
        sizes.vocab = step._vocab_size(model)  # the head's own (step.head_chunks sizes its chunks by it)
        if measured is not None:
            sizes.learn({"carried": measured})  # from the graph's shapes, before any step
        return sizes

    sizes = fresh_sizes()
    if training:
        # The frozen prefix's outputs for the steps to come (prefix.py):
        # one hidden state per batch, and the carries above it take.
        shape.ahead = prefix.ahead_for(
            getattr(args, "prefix_ahead", "auto"),
            model,
            first,
            shape.footprints,
            placement.prefix_outputs(shape, sizes, args.batch_size),
        )
    plan = MemoryPlan(
        budget=plan_budget,
        baseline=baseline,
        resident=weights.page_charge_bound(weights.resident_id),
        trainable=trainable_state_bytes(model, args.optimizer.lower(), training),
        activations=0,
        slack=slack,
        max_page=max_page,
        margin=Governor.margin_for(plan_budget),
        given=args.memory_budget is not None,
    )

    # What a start-up probe may take before the process is killed: what
    # its memory limit (a cgroup's, or RAM) leaves beside what it holds now,
    # one block page and the slack. Past it, a probe under a hard cap equal
    # to the budget had the run killed before it could be refused (one
    # 2,048-token sequence whose block took 900 MB with its attention
    # whole, under 400 MB). Not the budget's room: a probe over the budget
    # for a moment, where nothing kills it, measures what the formula
    # would only guess (and it guesses a short sequence's attention high).
    uncapped = args.page_budget is not None or budget_error is not None
    limit = memory_limit()

    def room_for_probes() -> float:
        """probe_room, with the resident page pinned (the probes' embedding
        and head need it: 270 MB for a 150k-token bf16 vocabulary)."""
        weights.pin_resident()
        return float("inf") if limit is None else limit - process_rss() - max_page - slack

    probe_room = float("inf")

    def measure_blocks(sizes, used: int) -> None:
        """One block's forward + vjp on one sequence of the longest length
        (`used`: block_probe's), then measured on more, learnt into
        `sizes`."""
        sizes.learn({"block": (used, 1, seq_len)})
        try:
            # Again on as many sequences as a batch has (as many as fit
            # beside the least pages; page_budget: nothing caps the memory),
            # then on one: what does not grow with them is fixed, not per
            # token (DoRA's dense weight and its adapted copy, a dequantized
            # weight: on a 4-bit DoRA model ~7x the per-token part at 64
            # tokens, which planned as per token split the first steps'
            # batches 4 ways). The line through the two is exact at both
            # and above the measures between them (each row costs a little
            # more than the one before), not past them (placement.Sizes.block:
            # a DoRA block's rows cost 2.4x more each from 4 rows on): so
            # the batch's rows are measured where they fit, the rows a
            # measure leaves room for (a row more costing at most a one-row
            # block whole) measured next, a few times. The first probe of
            # a process also holds one-off memory (~10 MB there), which the
            # second, on one sequence again, leaves out.
            if args.batch_size > 1 and used <= probe_room:
                one = step.probe_block(model, weights, probed, 1, seq_len)
                room = int(min(plan_budget - plan.fixed_without_activations - max_page, probe_room))
                rows = args.batch_size if args.page_budget is not None else min(args.batch_size, room // max(1, one))
            else:
                rows = 1
            if rows > 1:
                wide = step.probe_block(model, weights, probed, rows, seq_len)
                for _ in range(WIDER_BLOCK_PROBES):  # (page_budget: the batch's rows already)
                    more = min(args.batch_size, rows + max(0, room - wide) // max(1, one))
                    if more <= rows:
                        break
                    rows, wide = more, step.probe_block(model, weights, probed, more, seq_len)
                # Once more, the larger kept: MLX frees one array before or
                # after another's peak from run to run (a 4-bit DoRA qwen3
                # block, 8 rows of 64 tokens: 64.55 MB about one time in
                # seven, else 67.69 MB; planned from the first, the rows
                # were planned 5% under what they took).
                wide = max(wide, step.probe_block(model, weights, probed, rows, seq_len))
                fixed = (rows * one - wide) // (rows - 1)
                sizes.learn({"block_fixed": fixed, "block": (wide, rows, seq_len), "block_one": (one, seq_len)})
        except Exception as e:  # as for one sequence: the formula plans the rows
            say(f"Could not measure a block before training ({type(e).__name__}); planning from an estimate.")
        release_heap()

    # What a block's probe measures: its forward + vjp where this run
    # trains (the block a recomputed one takes), its forward alone where it
    # only evaluates (an evaluation sweep's, on the largest block: the
    # sweep runs them all, and nothing measures it again).
    what = "block" if training else "forward"
    # One block of each kind (kinds.py: a hybrid model's linear-attention
    # and full-attention blocks), among the trained blocks (the blocks whose
    # forward + vjp a step runs) or, evaluating, all; the plan takes the
    # largest measure, and `probed` is the block that gave it.
    # (Blocks below the adapted ones that an embedding's adapter makes the
    # sweep differentiate, outside.py, are frozen: their vjp takes less.)
    adapted = step.first_adapted_block(model)
    probe_from = adapted if training and adapted < L else first
    probed = probe_from if training else max(range(L), key=lambda i: shape.footprints[i], default=0)
    measured_blocks, standing = [probed], {}  # (standing: each measured block's kind, kinds.represented)
    took_most: dict = {}  # chunk -> the measured block that took the most with it (block_probe)

    def block_fits(sizes, used: int) -> bool:
        """Whether the least placement fits the budget with one block
        (`what`) on one sequence measured at `used` bytes."""
        least = placement.smallest(shape, sizes.with_measure(what, used, seq_len))
        return plan_budget - plan.fixed_without_activations - least.activations >= max(max_page, least.pages)

    def block_probe(chunk: int) -> int:
        """One block's `what` on one sequence of seq_len tokens, its
        attention in chunks of `chunk` query rows (0: whole): measured, or
        predicted where the formula (estimate_sizes: above the measures)
        says it may not fit probe_room: measured on the longest half,
        quarter, ... of the sequence that it says fits, and scaled to
        seq_len as the formula grows (which overestimates attention's
        growth); measured at seq_len only where that fits."""
        probe = step.probe_block if training else step.probe_forward

        def formula(n):
            return estimate_sizes(config, n, act_itemsize, head_cap, largest, chunk).block(1, n)

        length = seq_len
        while length > attention.MIN_ATTENTION_CHUNK and formula(length) > probe_room:
            length //= 2
        most = -1
        for block in measured_blocks:
            with attention.query_chunks(chunk):
                used = probe(model, weights, block, 1, length)
                if length < seq_len:
                    predicted = int(used * formula(seq_len) / formula(length))
                    used = predicted if predicted > probe_room else probe(model, weights, block, 1, seq_len)
            if len(measured_blocks) > 1:
                # (nothing evicts before the governor sets the page budget:
                # each kind's page would stay beside the next one's probe)
                weights.pager.evict_all()
            release_heap()
            if used > most:
                most, took_most[chunk] = used, block
        return most

    attention_chunk, attention_replaced = 0, None
    if L > 0 and (first < L or not training):
        # One block measured on one sequence of the longest length, before
        # anything is decided (the formula only stands in where the
        # measurement fails): its forward + vjp where this run trains; its
        # forward where it only evaluates.
        try:
            # (the calls' shapes only: nothing recorded is evaluated)
            recorded = step.record_calls(model, mx.zeros((1, seq_len), dtype=mx.int32))[1]
            standing = kinds.represented(
                model, recorded, range(probe_from, L) if training else range(L), shape.footprints
            )
            measured_blocks = list(standing) or measured_blocks
            del recorded
        except Exception:  # (the probe below says what failed)
            pass
        probe_room = room_for_probes()
        try:
            used = block_probe(0)
        except Exception as e:  # an architecture the dummy batch does not suit: the formula plans
            say(
                f"Could not measure a block before {'training' if training else 'evaluating'} "
                f"({type(e).__name__}); planning from an estimate."
            )
            used = None
        if used is not None and not uncapped:
            # Where one sequence's block does not fit whole, its attention
            # runs in chunks of query rows (attention.py) for the whole
            # session, if that makes it fit (or smaller: the least budget
            # named is then the chunked one's).
            try:
                # Weighed against a second measure: the first probe of a
                # process holds one-off memory the chunks' would not (a
                # rank-512 LoRA block at 64 tokens: ~38 MB of its 87, which
                # chunks of 32 then seemed to save). The plan keeps the
                # first where attention stays whole and neither fits (the
                # least budget named, as before), the second where it fits.
                again = block_probe(0) if not block_fits(sizes, used) else used
                attention_chunk, chunked = attention.choose_chunk(
                    seq_len, again, block_probe, lambda b: block_fits(sizes, b)
                )
                if attention_chunk:
                    used = chunked
                elif block_fits(sizes, again):
                    used = again
            except Exception as e:  # the probe in chunks failed: MLX's own attention
                say(f"Could not measure attention in chunks ({type(e).__name__}); attention runs whole.")
                attention_chunk = 0
            if attention_chunk:
                attention_replaced = attention.route(attention_chunk)
                sizes = fresh_sizes(attention_chunk)
        if used is not None:
            probed = took_most.get(attention_chunk, probed)  # (the kind that took the most as it runs)
        if used is not None and training:
            measure_blocks(sizes, used)
        elif used is not None:
            sizes.learn({"forward": (used, 1, seq_len)})
    if training:
        # The head's loss and gradient on one row of MIN_HEAD_CHUNK_TOKENS
        # tokens (what the least placement's head holds at most): whole
        # logits planned at 4x their bytes would miss a head that keeps
        # more of them (Gemma 2's softcapping: 196.9 MB where 131.1 were
        # planned, 1 x 256 tokens of 32,000).
        weights.pin_resident()
        try:
            tokens = min(seq_len, placement.MIN_HEAD_CHUNK_TOKENS)
            sizes.learn({"head": (step.probe_head(model, 1, tokens), 1, tokens)})
        except Exception as e:
            say(f"Could not measure the head before training ({type(e).__name__}); planning from an estimate.")
        release_heap()
    # --grad-checkpoint keeps mlx-lm's meaning: every trained block is
    # checkpointed and recomputed in the backward sweep (no block keeps its
    # graph from the forward). The planner may still split the batch or
    # spill checkpoints where the budget needs it. Without the flag it
    # chooses per step (placement.choose), usually faster.
    ceiling = None
    if training and first < L and getattr(args, "grad_checkpoint", False):
        ceiling = placement.evaluate(shape, sizes, L, 1, ahead=shape.ahead)
    # The whole tail's working set (one sequence), measured rather than
    # guessed (--grad-checkpoint: no tail to measure).
    # (Not where carries from below cross `first`, nor where no tail may
    # start there: carries made before block 0, outside.carry_prefix.)
    tail_measurable = (
        training and first < L and ceiling is None and not carries.crosses(first) and shape.tail_allowed(first)
    )

    def probe_tail(room=None):
        # On one sequence, then on as many of a batch's as the estimate
        # from that one lets fit in `room` (None: nothing caps the memory):
        # planned from one row alone, through the blocks' growth, a 4-bit
        # DoRA tail came out 4% under what 8 rows took where the block was
        # measured on 3 (placement.Sizes.block), and 43% over where on 8.
        try:
            used = segment.probe_tail(model, weights, first, 1, seq_len, head_cap)
            sizes.learn({"tail": (used, L - first, 1, seq_len)})
            fits = [
                r
                for r in range(2, args.batch_size + 1)
                if room is None or sizes.tail(L - first, r, seq_len) + 2 * max_page <= room
            ]
            if fits:
                used = segment.probe_tail(model, weights, first, fits[-1], seq_len, head_cap)
                sizes.learn({"tail": (used, L - first, fits[-1], seq_len)})
        except Exception as e:  # as for the block probe: the formula plans
            say(f"Could not measure the tail before training ({type(e).__name__}); planning from an estimate.")
        release_heap()

    page_cap = None
    if args.page_budget is not None:
        # Benchmarks and tests: exactly this many bytes of pages, besides
        # the activations of the fastest placement, with no block recomputed
        # (the tail streams its pages, stream.py; the memory budget follows).
        page_cap = parse_size(args.page_budget, "page_budget")
        if page_cap < max_page:
            # (A block bound whole, for validation or a recompute, needs
            # all its pages at once.)
            raise BudgetError(
                f"page_budget {page_cap} ({format_size(page_cap)}) does not hold one block: the largest "
                f"block's pages take {max_page} bytes"
                f"{f' in {weights.pages_per_block} parts' if weights.pages_per_block > 1 else ''}. "
                f"Raise page_budget to at least {max_page} ({format_size(max_page, up=True)}), or leave it out "
                "(memory_budget plans the pages)."
            )
        if tail_measurable:
            probe_tail()  # nothing caps the memory here
        lowest = next(t for t in range(shape.first_trained, L + 1) if shape.tail_allowed(t))  # (L always is)
        fastest = ceiling if ceiling is not None else placement.evaluate(shape, sizes, lowest, 1, ahead=shape.ahead)
        plan.activations = fastest.activations
        plan.budget = plan.fixed + page_cap
        plan.margin = Governor.margin_for(plan.budget)
        plan.budget = plan.fixed + page_cap
        budget_error = None
    elif tail_measurable and budget_error is None:
        # Under a memory budget, where the tail's estimate for one sequence
        # (every block's forward + vjp kept: more than the tail keeps) fits
        # beside the probe's two blocks of pages: the first step then plans
        # from it (from the estimate, a 4-bit model's batch of 4 split in 2
        # at a budget its steps ran whole under from the second on).
        room = plan_budget - plan.fixed_without_activations
        if sizes.tail(L - first, 1, seq_len) + 2 * max_page <= room:
            probe_tail(room)
    least = placement.smallest(shape, sizes)
    plan.activations = least.activations
    # A least placement that spills reads checkpoints back beside a block's
    # pages: the budget must hold them (counted as one block page, budgets
    # just above it were taken, and the first backward stopped on a full
    # page budget: a sweep, gemma2 and phi3 at 170 MB).
    plan.least_pages = least.pages
    if budget_error is not None:
        raise BudgetError(
            f"{budget_error} This run needs at least {format_size(plan.least, up=True)} ({plan.breakdown()})."
        )
    try:
        plan.check()
    except BudgetError as e:
        if not attention_chunk:
            raise
        raise BudgetError(
            f"{e} (Its activations count one sequence's attention in chunks of {attention_chunk} "
            "queries: whole, it needs more.)"
        ) from None
    if attention_chunk:
        say(
            f"One sequence of {seq_len} tokens does not fit the budget with its attention whole: "
            f"attention runs in chunks of {attention_chunk} queries "
            + (
                "(its keys' and values' gradients differ from mlx-lm's in the last bits)."
                if training
                else "(each row's output is MLX's own)."
            )
        )
    first_placement = placement.choose(
        shape, sizes, plan.budget - plan.fixed_without_activations, page_cap, ceiling=ceiling
    )
    gov = Governor(plan, weights.pager, pinned_bytes=weights.page_charge_bound(weights.resident_id))
    weights.pin_resident()
    # Where the memory limit leaves the CPU backend's compiler no room
    # beside the budget, nothing is compiled: under a hard cap equal to the
    # least budget, the blocks' kernels alone had the compiler killed and
    # the run with it (a sweep, phi3 bf16 at 169 MB).
    uncompiled_tail = jit.tail_compile_refused(plan.budget)
    blocks = step.Blocks(model, compile=uncompiled_tail is None, compile_tail=uncompiled_tail is None)
    gov.drop_stale_graphs = blocks.drop_stale
    if training and blocks.compile:
        for names in compiled_over(model, weights, blocks, standing, seq_len, room_for_probes()):
            say(names)
    if training and args.fine_tune_type == "dora":
        init_dora_magnitudes(model, weights, first)
        if getattr(args, "resume_adapter_file", None):
            # mlx-lm loads the file after its DoRA layers took their
            # magnitudes from the weights: the file's magnitudes win (they
            # were overwritten here, and a resumed DoRA run went its own way).
            model.load_weights(args.resume_adapter_file, strict=False)
    session = Session(
        args=args,
        model=model,
        config=config,
        weights=weights,
        plan=plan,
        gov=gov,
        blocks=blocks,
        first_trained=first,
        **simulated_pages(weights),
        seq_len=seq_len,
        sizes=sizes,
        shape=shape,
        page_cap=page_cap,
        ceiling=ceiling,
        outside_base=outside_base,
        attention_chunk=attention_chunk,
        attention_replaced=attention_replaced,
        largest_kind=list(standing.get(probed, [])) if len(standing) > 1 else [],
    )
    session.place(first_placement or least)
    if not training:
        session.use_forward_schedule()

    say(
        f"Model: {len(model.layers)} blocks, {format_size(weights.paged_bytes)} paged "
        f"({'/'.join(sorted(set(weights.store_kind)))}), "
        f"{format_size(weights.resident_bytes)} resident. Budget {format_size(plan.budget)}: "
        f"pages {format_size(gov.page_budget)} (~{gov.page_budget / plan.max_page:.1f} blocks"
        f"{f', each in {weights.pages_per_block} parts' if weights.pages_per_block > 1 else ''}), "
        f"activations {format_size(plan.activations)} ({placement.describe(session.placement, L)}), "
        f"fixed {format_size(plan.fixed_without_activations)}."
    )
    if uncompiled_tail is not None and training:
        # (Muon's bf16 Newton-Schulz gives other bits compiled: docs/design.md)
        muon = "; the Muon update then differs from mlx_lm.lora's in the last bits"
        say(f"Note: {uncompiled_tail}{muon if args.optimizer.lower() == 'muon' else ''}.")
    io = weights.pager.stats()
    if io["buffered_files"]:
        say(
            f"Warning: {io['buffered_files']} of {io['buffered_files'] + io['direct_files']} weight files "
            "refused direct I/O: their reads go through the page cache, dropped after each read."
        )
    return session
