"""The training loop and evaluation, read top to bottom like mlx-lm's
``tuner/trainer.py`` (``train`` / ``evaluate``).

One difference in shape: with gradient accumulation over k micro-batches,
the k batches of one optimizer step (iterations g*k+1 .. g*k+k, as mlx-lm
groups them) go through the model together, layer-major, so each block is
read once per sweep rather than k times. What the user sees is still
per iteration, at mlx-lm's iterations: validation before iteration j when
j == 1, j % steps_per_eval == 0 or j == iters; a report after j when
j % steps_per_report == 0 or j == iters; a checkpoint after j when
j % save_every == 0 (holding the weights as they were after iteration j:
within a group those are the weights before the group's update).

Another, in time: where the placement runs the frozen prefix ahead
(prefix.py), the loop draws the batches of several optimizer steps at once
(a window, still in mlx-lm's order, never past a validation point) and the
window's first step computes the prefix's outputs for all of them; each
step then starts at the first trained block.
"""

from __future__ import annotations

import gc
import itertools
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import files, interrupt, placement, prefix, resume, step
from ._core import PageReadError
from .budget import BudgetError, format_size
from .callbacks import PagerCallback
from .governor import MemoryPressure, peak_rss, process_rss, release_heap, reset_peak_rss
from .session import Session
from .update import OptimizerStep


def evaluate(s: Session, dataset, num_batches: int, cb: PagerCallback, advance=None, on_block=None) -> float:
    """mlx-lm's evaluate(): the token-weighted mean loss over `num_batches`
    batches (-1: all), with the blocks paged once for a group of batches."""
    from mlx_lm.tuner.trainer import iterate_batches

    args, model = s.args, s.model
    batches = []
    it = iterate_batches(
        dataset=dataset,
        batch_size=args.batch_size,
        max_seq_length=args.max_seq_length,
        comm_group=mx.distributed.init(),
    )
    # zip takes the count first, as mlx-lm's does: 0 batches draw nothing
    # from NumPy's generator (the batch order after it is mlx-lm's).
    for _, b in zip(range(num_batches) if num_batches != -1 else itertools.count(), it):
        # Split as training splits them; each part weighted by its own tokens.
        batches.extend(step.split_batch(*b, s.parts, shared_norm=False))
    if not batches:
        return float("nan")  # mlx-lm's 0 / 0 (--val-batches 0)
    model.eval()
    s.use_forward_schedule()
    all_losses, ntokens = mx.array(0.0), mx.array(0)
    # Layer-major in groups: one sweep over the blocks serves a whole group,
    # as many batches as the activations the plan reserves hold (each keeps
    # its hidden state and the next block's output; the block works on one
    # at a time), at most 8 (Session.eval_group).
    group = s.eval_group()

    def check_block(phase, i):
        interrupt.check()
        s.gov.check()
        cb.on_block(s.weights, phase, i)

    on_block = on_block or check_block
    g, dropped = 0, False
    while g < len(batches):
        try:
            results = step.paged_loss(
                model, s.weights, batches[g : g + group], s.head_chunk_bytes, on_block=on_block, blocks=s.blocks
            )
        except MemoryPressure:
            # Over, with the page budget at its least: as a training step
            # does (_value_and_grad), let go of the compiled graphs of
            # earlier shapes, then compile no more; the group runs again.
            if not dropped and s.blocks.drop_compiled():
                s.gov.record("recompile", "validation did not fit: let go of the compiled graphs")
            elif s.blocks.stop_compiling():
                s.gov.record("uncompile", "validation did not fit: running the blocks uncompiled from now on")
            else:
                raise
            dropped = True
            results = None
        if results is None:
            gc.collect()  # the try's traceback is gone: what it held goes back
            release_heap()
            s.use_forward_schedule()  # the pager's order from the sweep's start
            continue
        for mb, (loss, toks) in zip(batches[g : g + group], results):
            if mb.batch_rows is not None:
                # A part of a batch split to fit may hold no target token
                # (a masked prompt cut by --max-seq-length): its loss is
                # 0/0, and NaN x 0 is NaN; it adds nothing, as its rows add
                # nothing to the whole batch's sum (validation was NaN).
                all_losses += mx.where(toks > 0, loss * toks, 0.0)
            else:
                all_losses += loss * toks
            ntokens += toks
            mx.eval(all_losses, ntokens)
            if advance is not None:
                advance()
        g += group
    # Every rank evaluated its share of each batch (as mlx-lm's evaluate()).
    all_losses = mx.distributed.all_sum(all_losses, stream=mx.cpu)
    ntokens = mx.distributed.all_sum(ntokens, stream=mx.cpu)
    s.use_step_schedule()
    model.train()
    return (all_losses / ntokens).item()


def save_adapters(model, adapter_file: Path, iteration: Optional[int], cb: PagerCallback):
    """Writes the adapters (and, for a checkpoint, NNNNNNN_adapters.safetensors),
    atomically (files.py); with several ranks, rank 0 writes them (the
    ranks' adapters are equal)."""
    if mx.distributed.init().rank() != 0:
        return
    weights = dict(tree_flatten(model.trainable_parameters()))
    files.save_safetensors(adapter_file, weights)
    path = adapter_file
    if iteration is not None:
        path = adapter_file.parent / f"{iteration:07d}_adapters.safetensors"
        files.save_safetensors(path, weights)
    cb.on_save(path, iteration)


def _learning_rate(optimizer) -> float:
    lr = optimizer.learning_rate
    return lr.item() if isinstance(lr, mx.array) else float(lr)


def _clear_cache(threshold: int):
    if threshold > 0 and mx.get_cache_memory() > threshold:
        mx.clear_cache()


class _Reports:
    """Per-iteration sums between two reports, as mlx-lm keeps them."""

    def __init__(self):
        self.losses, self.tokens, self.steps, self.time, self.trained_tokens = 0, 0, 0, 0.0, 0

    def add(self, loss: mx.array, tokens: int, seconds: float):
        # Summed as mlx-lm sums them (float32 on the device), so that the
        # reported loss is the same number.
        self.losses = self.losses + loss
        self.tokens += tokens
        self.steps += 1
        self.time += seconds

    def state(self) -> dict:
        return {
            "losses": float(mx.array(self.losses).item()),
            "tokens": self.tokens,
            "steps": self.steps,
            "time": self.time,
            "trained_tokens": self.trained_tokens,
        }

    def restore(self, st: dict):
        self.losses = mx.array(st["losses"], dtype=mx.float32) if st["steps"] else 0
        self.tokens, self.steps, self.time, self.trained_tokens = (
            st["tokens"],
            st["steps"],
            st["time"],
            st["trained_tokens"],
        )

    def take(self, it: int, args, optimizer, s: Session, pager_since: dict) -> dict:
        # Over all ranks, as mlx-lm sums them (this rank's pager figures).
        world = mx.distributed.init().size()
        losses = mx.distributed.all_sum(mx.array(self.losses), stream=mx.cpu).item()
        self.tokens = int(mx.distributed.all_sum(mx.array(self.tokens), stream=mx.cpu).item())
        self.trained_tokens += self.tokens
        now = s.weights.pager.stats()
        info = {
            "iteration": it,
            "train_loss": losses / (self.steps * world),
            "learning_rate": _learning_rate(optimizer),
            "iterations_per_second": args.steps_per_report / self.time,
            "tokens_per_second": self.tokens / self.time,
            "trained_tokens": self.trained_tokens,
            "peak_memory": s.gov.peak_rss / 1e9,
            "pager_bytes_read": now["bytes_read"] - pager_since["bytes_read"],
            "pager_io_wait_s": now["io_wait_s"] - pager_since["io_wait_s"],
            "pager_faults": now["faults"] - pager_since["faults"],
        }
        self.losses, self.tokens, self.steps, self.time = 0, 0, 0, 0.0
        return info


def _value_and_grad(s: Session, group, on_block, it: int, window: Optional[prefix.Window] = None):
    """The step's losses and token counts per batch of `group`, the summed
    gradients, and what the step measured (step.paged_value_and_grad's
    probe, plus the placement it ran with and the peak that predicted).

    Each batch is split into the placement's parts. When the governor finds
    the step does not fit (MemoryPressure: its cheaper rungs did not free
    enough), the step is abandoned (nothing was updated) and run again with
    a placement that needs less: a shorter no-recompute tail, or the batch
    in more parts. With nothing smaller left, the run stops (BudgetError).

    `window` (prefix.py): the steps this one belongs to; the first of a
    window of several computes the frozen prefix's outputs for all of them
    (step.prefix_forward), each then starts from its own."""
    retry, dropped = False, False
    while True:
        if retry:
            # What the abandoned try held (its traceback kept its arrays and
            # the compiled graphs it called alive until here) goes back to
            # the OS before the step runs again, from the pager's first access.
            gc.collect()
            release_heap()
            # The step's peak is the try that runs (the run's keeps this one's).
            s.gov.peak_rss = max(s.gov.peak_rss, peak_rss())
            reset_peak_rss()
            s.use_step_schedule()
        p = s.placement
        owner, mbs = [], []
        for g, b in enumerate(group):
            parts = step.split_batch(*b, p.parts)
            mbs.extend(parts)
            owner.extend([g] * len(parts))
        start = None
        probe = {}
        s.live = probe  # read by memory traces while the step runs (callbacks.JsonReport)
        spill_before = (s.spill.bytes_written, s.spill.bytes_read) if s.spill is not None else (0, 0)
        try:
            if window is not None and len(window) > 1:
                if window.done == 0 and p.ahead > 1 and not window.ready(p.parts):
                    _run_prefix(s, window, p.parts, on_block)
                if window.ready(p.parts):
                    mbs, start = window.outputs[window.done]
            shapes = [tuple(mb.inputs.shape) for mb in mbs]
            if shapes != s.last_shapes:
                # MLX's cache holds the last step's buffers (session.place lets it):
                # of other shapes they would sit beside this step's new ones.
                mx.clear_cache()
                s.last_shapes = shapes
            losses, toks, grads = step.paged_value_and_grad(
                s.model,
                s.weights,
                mbs,
                s.head_chunk_bytes,
                on_block=on_block,
                blocks=s.blocks,
                tail_start=p.tail_start,
                probe=probe,
                spill=s.spill,
                spilled=p.spilled,
                hold_tail=s.tail_hold(),
                start=start,
                grad_checkpoint=bool(getattr(s.args, "grad_checkpoint", False)),
            )
            if start is not None:
                window.outputs[window.done] = None  # its step has them now
                probe["prefix_ahead"] = True
            break
        except MemoryPressure as e:
            retry = True
            del mbs, start
            if window is not None:
                window.drop()  # the steps left compute their own prefix
            release_heap()
            # What grows outside MLX's arrays first: mx.compile keeps a traced
            # graph per input shape met (Blocks.drop_compiled), and those of
            # shapes and placements the run moved on from are dead weight.
            # Letting go of them costs a trace of the current ones; a smaller
            # placement would cost recompute for the rest of the run.
            if not dropped and s.blocks.drop_compiled():
                dropped = True
                s.gov.record(
                    "recompile",
                    f"iteration {it} did not fit: let go of the compiled graphs of earlier shapes and placements",
                    iteration=it,
                )
                continue
            if not s.replan(probe, smaller=True):
                # The least placement and still over: run uncompiled (a tiny
                # mamba's 4 steps: 203-226 MB RSS compiled, 152-160
                # uncompiled; an E2B-style 35-block model's 4 steps: 212 MB
                # outside MLX compiled, 124 MB uncompiled).
                if s.blocks.stop_compiling():
                    s.gov.record(
                        "uncompile",
                        f"iteration {it} did not fit: running the blocks uncompiled from now on",
                        iteration=it,
                    )
                    continue
                least = placement.smallest(s.shape, s.sizes)
                need = max(s.plan.fixed_without_activations + least.need, e.rss + s.gov.margin)
                s.gov.record("stop", f"iteration {it}: no placement that needs less memory fits", iteration=it)
                raise BudgetError(
                    f"iteration {it} does not fit in --memory-budget {format_size(s.plan.budget)}: the process "
                    f"uses {format_size(e.rss)}, and no placement that needs less is left (the least: "
                    f"{placement.describe(least, len(s.model.layers))}). Raise --memory-budget to at least "
                    f"{format_size(need, up=True)}, or lower --max-seq-length."
                ) from None
            q = s.placement
            rung = placement.rung(p, q) or "recompute"
            s.gov.record(
                rung,
                f"iteration {it} did not fit: running it again with {placement.describe(q, len(s.model.layers))}",
                iteration=it,
                tail_start=q.tail_start,
                parts=q.parts,
            )
    probe["placement"] = p
    probe["page_budget"] = s.gov.page_budget
    probe["predicted_peak"] = s.predicted_peak(p)
    if s.spill is not None:
        probe["spilled_bytes"] = s.spill.bytes_written - spill_before[0]
        probe["spill_read_bytes"] = s.spill.bytes_read - spill_before[1]
    if len(mbs) == len(group):
        return losses, toks, grads, probe
    # Parts of one batch add up to it (each was divided by the batch's tokens).
    batch_losses = [sum((l for l, o in zip(losses, owner) if o == g), mx.array(0.0)) for g in range(len(group))]
    batch_toks = [sum((t for t, o in zip(toks, owner) if o == g), mx.array(0)) for g in range(len(group))]
    return batch_losses, batch_toks, grads, probe


def _run_prefix(s: Session, window: prefix.Window, parts: int, on_block) -> None:
    """The frozen prefix's outputs for every step of `window`, each batch
    split into `parts` (one sweep, step.prefix_forward)."""
    per_step = [[mb for b in group for mb in step.split_batch(*b, parts)] for _, group in window.groups]
    flat = [mb for mbs in per_step for mb in mbs]
    hs = step.prefix_forward(s.model, s.weights, flat, on_block=on_block, blocks=s.blocks)
    window.outputs, window.parts, at = [], parts, 0
    for mbs in per_step:
        window.outputs.append((mbs, hs[at : at + len(mbs)]))
        at += len(mbs)


def _draw_window(s: Session, batches, it: int, k: int, is_val_point, validate, first: bool = False) -> prefix.Window:
    """The next optimizer steps' batches, drawn in mlx-lm's order (batch j,
    then validation before iteration j where it falls): as many steps as
    the placement runs the frozen prefix ahead for, stopping before a step
    with a validation point (validation draws from NumPy's generator
    between two batches, and sees the weights of the step before it) and
    at the last iteration. The run's `first` step is a window alone: it
    measures the sizes the placement is planned from, which may change the
    split a window's outputs are computed for."""
    window = prefix.Window()
    iters = s.args.iters
    while len(window) < (1 if first else max(1, s.placement.ahead)) and it < iters:
        its = list(range(it + 1, min(it + k, iters) + 1))
        if len(window) and any(is_val_point(j) for j in its):
            break
        group = []
        for j in its:
            group.append(next(batches))
            if is_val_point(j):
                validate(j)
        window.groups.append((its, group))
        it = its[-1]
    return window


# What ends a run mid-step, after the last finished step is saved.
STOPS = (interrupt.Interrupted, BudgetError, PageReadError)


def train(
    s: Session,
    optimizer,
    train_set,
    val_set,
    adapter_file: Path,
    cb: PagerCallback,
    result,
    resumed: Optional[dict] = None,
) -> None:
    """Trains for args.iters iterations; reports, validates and saves at
    mlx-lm's iterations (see the module docstring). `resumed`: the metadata
    of a resume state already loaded into the model and optimizer
    (resume.py); training goes on from the iteration after it.

    Every checkpoint also writes the resume state of the last finished
    optimizer step; a SIGINT/SIGTERM (interrupt.py) stops at the next block
    boundary with the adapters and the resume state of that step saved."""
    from mlx_lm.tuner.trainer import iterate_batches

    args, model, weights, gov = s.args, s.model, s.weights, s.gov
    k = args.grad_accumulation_steps
    model.train()
    world = mx.distributed.init()
    # With several ranks (mlx.launch), each takes its share of every batch.
    batches = iterate_batches(
        dataset=train_set, batch_size=args.batch_size, max_seq_length=args.max_seq_length, loop=True, comm_group=world
    )
    reports = _Reports()
    pager = weights.pager
    names = [n for n, _ in tree_flatten(model.trainable_parameters())]

    def is_val_point(j: int) -> bool:
        return val_set is not None and (j == 1 or j % args.steps_per_eval == 0 or j == args.iters)

    it = 0
    if resumed is not None:
        # Replay the draws from NumPy's generator up to the iteration reached:
        # each batch, and the first batch of each validation pass.
        it = resumed["iteration"]  # at most args.iters (resume.check)
        for j in range(1, it + 1):
            next(batches)
            # as this run draws them: a finished run continued with a larger
            # --iters draws as one run of the larger --iters (not the
            # validation at the smaller one's end)
            if is_val_point(j):
                next(
                    iterate_batches(
                        dataset=val_set,
                        batch_size=args.batch_size,
                        max_seq_length=args.max_seq_length,
                        comm_group=world,
                    )
                )
        reports.restore(resumed["reports"])
        cb.on_message(f"Resuming after iteration {it} from {Path(args.adapter_path) / resume.STATE_FILE}")
    done = it  # the last iteration whose optimizer step is finished
    apply_update = OptimizerStep(model, optimizer)
    since_report = pager.stats()

    def on_block(phase, i):
        interrupt.check()
        gov.check()
        cb.on_block(weights, phase, i)

    pending_val = {}  # validation reports by iteration, until their place comes

    def validate(j: int):
        """mlx-lm's validation before iteration j (weights within a group do
        not change before its update, so these are the weights it sees)."""
        total = len(val_set) // args.batch_size
        if args.val_batches != -1:
            total = min(total, args.val_batches)
        tic = time.perf_counter()
        with cb.val_progress(total) as advance:
            val_loss = evaluate(s, val_set, args.val_batches, cb, advance, on_block)
        val_time = time.perf_counter() - tic
        result.val_losses.append(val_loss)
        # Reported where mlx-lm reports it, after iteration j - 1's train
        # report: a window draws (and so validates) before the steps of its
        # first group, which may hold iterations before j (loggers such as
        # wandb's drop a step that goes back).
        pending_val[j] = {"iteration": j - 1, "val_loss": val_loss, "val_time": val_time}

    def report_val(upto: int):
        for j in sorted(v for v in pending_val if v <= upto):
            cb.on_val_loss_report(pending_val.pop(j))

    def save_state(at: int):
        if world.rank() == 0:
            resume.save(Path(args.adapter_path), model, optimizer, at, args, reports.state())

    cb.progress_start(args.iters)
    cb.progress_advance(it)
    window = prefix.Window()
    try:
        while it < args.iters:
            if not window.left:
                # Batch j is drawn, then validation runs, in mlx-lm's order: both
                # draw from NumPy's global generator (batch order, validation
                # batches), so the order of the draws decides every later batch.
                window = _draw_window(s, batches, it, k, is_val_point, validate, first=not result.steps)
                s.start_window(len(window))
            its, group = window.groups[window.done]
            it = its[-1]
            s.window_at(window.done)

            before = pager.stats()
            s.blocks.bound_whole = []
            cb.on_step_begin(it, before)
            # The readahead this step runs with (the automatic choice,
            # simulate.AutoReadahead, may change it after a step).
            readahead = (pager.readahead / weights.pages_per_block, pager.readahead_mode)
            mx.reset_peak_memory()
            reset_peak_rss()
            tic = time.perf_counter()
            step_losses, step_toks, grads, probe = _value_and_grad(s, group, on_block, it, window)
            window.done += 1
            # The next step's placement, from what this one measured.
            s.replan(probe)
            losses = [x.item() for x in step_losses]
            toks = [int(t.item()) for t in step_toks]
            update = len(group) == k  # a partial last group updates nothing, as in mlx-lm
            # Checkpoints inside the group hold the weights before its update.
            early = [j for j in its if j % args.save_every == 0 and (j != its[-1] or not update)]
            for j in early:
                save_adapters(model, adapter_file, j, cb)
            if update:
                cb.on_update_begin()
                # Once per optimizer step, as mlx-lm: averaged over the ranks
                # (a no-op for one), then over the micro-batches.
                tree = average_gradients(tree_unflatten([(n, grads[n]) for n in names]))
                if k > 1:
                    tree = tree_map(lambda g, k=k: g / k, tree)
                apply_update(tree)  # optimizer.update, compiled (update.py)
                cb.on_update_end()
                del tree
            # The gradients are spent (or, in a partial last group, unused):
            # held to the next step, they and their average (with gradient
            # accumulation) were 2 dead copies of the adapters beside its
            # gradients, over what the plan counts (session.
            # trainable_state_bytes): a run with 300 MB of adapters and
            # --grad-accumulation-steps 2 was killed at the least budget named.
            del grads
            _clear_cache(args.clear_cache_threshold)
            elapsed = time.perf_counter() - tic
            after = pager.stats()
            step_peak = max(peak_rss(), process_rss())
            gov.peak_rss = max(gov.peak_rss, step_peak)
            rec = {
                "type": "step",
                "iteration": it,
                "loss": sum(losses) / len(group),
                "tokens": sum(toks),
                "step_s": elapsed,
                "io_wait_s": after["io_wait_s"] - before["io_wait_s"],
                "reclaim_wait_s": after["reclaim_wait_s"] - before["reclaim_wait_s"],
                # the time the disk had a page read in flight (bytes_read /
                # read_busy_s: the rate the reads got)
                "read_busy_s": after["read_busy_s"] - before["read_busy_s"],
                "bytes_read": after["bytes_read"] - before["bytes_read"],
                "pages_read": after["pages_read"] - before["pages_read"],
                # The reads this step started: those that landed or are in
                # flight at its end, less those already in flight at its
                # start. A read ahead for the next step counts here, in the
                # step that made it (bytes_read counts it where it lands).
                "bytes_started": (after["bytes_read"] + after["in_flight_bytes"])
                - (before["bytes_read"] + before["in_flight_bytes"]),
                "pages_started": (after["pages_read"] + after["in_flight_pages"])
                - (before["pages_read"] + before["in_flight_pages"]),
                "faults": after["faults"] - before["faults"],
                "readahead_hits": after["readahead_hits"] - before["readahead_hits"],
                "acquires": after["acquires"] - before["acquires"],
                "readahead_blocks": readahead[0],  # depth in blocks (--readahead's unit)
                "readahead_mode": readahead[1],
                # Integrity (pager.h): reads retried, pages that failed their
                # checksum, pages rewritten from the model's files.
                **{k: after[k] - before[k] for k in ("io_retries", "checksum_errors", "pages_rebuilt")},
                "peak_resident_bytes": after["peak_resident_bytes"],
                "mlx_peak_bytes": max(probe.get("peak", 0), mx.get_peak_memory()),
                "rss_bytes": process_rss(),
                "peak_rss_bytes": gov.peak_rss,  # of the run so far
                "step_peak_rss_bytes": step_peak,  # of this step (the kernel's high-water mark)
                # The placement this step ran with, and the peak it predicted.
                "tail_start": probe["placement"].tail_start,
                "tail_held": bool(probe.get("tail_held", False)),
                "recomputed_blocks": probe["placement"].recomputed,
                "batch_parts": probe["placement"].parts,
                "spilled_blocks": probe["placement"].spilled,
                # the head's chunk of logits the step ran with (0: whole)
                "head_chunk_bytes": s.head_chunk_bytes,
                # the query rows attention ran in a chunk of (attention.py; 0: whole)
                "attention_chunk": s.attention_chunk,
                # checkpoints written to the SSD and read back (spill.py)
                "spilled_bytes": probe.get("spilled_bytes", 0),
                "spill_read_bytes": probe.get("spill_read_bytes", 0),
                "predicted_peak_bytes": probe["predicted_peak"],
                "page_budget_bytes": probe["page_budget"],  # the pages' budget it ran with
                # The frozen prefix's window (prefix.py): its steps, and this
                # step's place in it (0: the step that ran the prefix for all).
                "window": [len(window), window.done - 1],
                "prefix_ahead": bool(probe.get("prefix_ahead", False)),
                # forward blocks in parts this step bound whole (Blocks.bound_whole)
                "forward_whole": list(s.blocks.bound_whole),
            }
            result.steps.append(rec)
            cb.on_step(rec)
            # What the step's peak held beyond the plan's terms joins its slack
            # (MLX's cache inside one graph, memory outside MLX): the next
            # step's pages make room for it.
            if s.learn_peak(step_peak, probe["placement"], probe["page_budget"]):
                s.replan(refresh=True)
            s.after_step(step_peak)  # a peak over the budget between the governor's samples
            cb.progress_advance(len(group))

            for j, loss, ntok in zip(its, step_losses, toks):
                report_val(j)
                reports.add(loss, ntok, elapsed / len(group))
                if j % args.steps_per_report == 0 or j == args.iters:
                    info = reports.take(j, args, optimizer, s, since_report)
                    since_report = pager.stats()
                    result.train_losses.append(info["train_loss"])
                    cb.on_train_loss_report(info)
            if update:
                done = it
                if it % args.save_every == 0:
                    save_adapters(model, adapter_file, it, cb)
                if any(j % args.save_every == 0 for j in its):
                    save_state(it)
    except STOPS as e:
        # Stopped mid-step (a signal, the budget, a page that cannot be read):
        # the model holds the weights of the last finished optimizer step.
        report_val(args.iters)
        save_adapters(model, adapter_file, None, cb)
        save_state(done)
        note = (
            f"the adapters and resume state of iteration {done} are saved in {Path(args.adapter_path)}; "
            "continue with --resume"
        )
        if isinstance(e, interrupt.Interrupted):
            raise interrupt.Interrupted(e.signum, note) from None
        # The same exception, its message with the note (a new one of its
        # type may not be made from a message alone: MemoryPressure).
        e.args = (f"{e} {note[0].upper()}{note[1:]}.",)
        raise e from None
    save_adapters(model, adapter_file, None, cb)
    save_state(done)
