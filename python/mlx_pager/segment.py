"""The tail segment: the last blocks and the head, forward and backward in
one vector-Jacobian product, with no recompute.

step.py checkpoints each trained block's input in the forward sweep and
recomputes the block in the backward sweep (mlx-lm's --grad-checkpoint
cost: trained blocks run forward twice). When the budget can hold the pages
of blocks s..L-1 together, plus the activations their autodiff graph keeps,
those blocks need neither: the forward sweep stops at h[s], and

    loss, (dL/dh[s], dL/dadapters[s..L-1]) = vjp(tail, h[s])
    tail(h) = head_loss(block[L-1](... block[s](h)))

computes them in one graph, as mlx-lm's own value_and_grad does over the
whole model. The backward sweep then walks s-1 .. first with recompute, as
before. With s = first a step does mlx-lm's arithmetic with no recompute at
all, and the results are the same bits. The tail's frozen weights are
streamed (stream.py): read where the graph uses them, forward and again
backward, so the tail's pages need not fit together. placement.py picks s
for the budget, from the page footprints and the activations steps
measured.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import carry, dropout, heap, outside, step
from .compiled import CompiledShapes


def _head_loss_in_graph(model, mb: "step.MicroBatch", h: mx.array, chunk_bytes: int) -> mx.array:
    """default_loss's value from the last hidden state, over the same token
    chunks as step.head_loss (the per-token losses do not depend on the
    chunking; they are summed at once, as default_loss sums them)."""
    T, parts = h.shape[1], []
    for t0, t1 in step.head_chunks(T, h.shape[0], step._vocab_size(model), chunk_bytes):
        with outside.window(model, t0, t1, T):  # (its dropout's tokens of the masks, outside.py)
            parts.append(
                step._head_ce(model, mb.inputs[:, t0:t1], mb.targets[:, t0:t1], mb.mask[:, t0:t1], h[:, t0:t1])
            )
    return step._concat(parts).astype(mx.float32).sum() / mb.norm


def tail_value_and_grad(
    model: nn.Module,
    start: int,
    mb: "step.MicroBatch",
    h: mx.array,
    keys: Sequence[Optional[mx.array]],
    chunk_bytes: int,
    stream=None,
    entering: Optional[dict] = None,
) -> Tuple[mx.array, mx.array, Dict[int, Dict[str, mx.array]], Dict[str, mx.array]]:
    """(loss, dL/dh[start], {block: {adapter name: grad}}, {full name: grad}
    of the adapters outside the blocks (outside.py: the head's)) for blocks
    start..L-1 and the head, for one micro-batch. The blocks' pages must be
    bound, or `stream` (a bound stream.Stream over them) reads them where
    the graph uses them. keys[i]: block i's dropout key (None without dropout). When no
    block below `start` is trained, dL/dh[start] is not computed (None):
    nothing needs it, and mlx-lm does not compute it either. `entering`
    ({ref: value}): the carries made below `start` that the tail's blocks
    take (carry.py), from frozen blocks: not differentiated."""
    L = len(model.layers)
    carries = mb.carries
    layers = [model.layers[i] for i in range(start, L)]
    names = [step._trainable_names(layer) for layer in layers]
    params = [[v for _, v in tree_flatten(layer.trainable_parameters())] for layer in layers]
    sizes = [len(p) for p in params]
    out_names, out_params = outside.trainable(model)  # the head's adapters, if any (outside.py)

    def tail(x, *flat):
        at = 0
        for layer, n, k in zip(layers, names, sizes):
            layer.update(tree_unflatten(list(zip(n, flat[at : at + k]))))
            at += k
        extras = dict(entering or {})  # carries taken in the tail: from frozen blocks below, or made in it
        for j, layer in enumerate(layers):
            i = start + j
            if stream is not None:
                stream.enter(i, x)
            link = carry.link(carries, i, extras)
            with step.keyed_dropout(layer, keys[i]):
                x = carry.kept(step.run_linked(layer, x, mb.calls[i], link), link, extras)
        with outside.bound(model, out_names, flat[at:]):
            return [_head_loss_in_graph(model, mb, x, chunk_bytes)]

    flat = [p for ps in params for p in ps] + out_params
    # dL/dh[start] where a block below is differentiated, or the
    # embedding's adapters take it (outside.py).
    need_h = step.first_trained_block(model) < start or (start == 0 and outside.trains_prefix(model))
    try:
        if need_h:
            (loss,), grads = mx.vjp(tail, [h, *flat], [mx.array(1.0, dtype=mx.float32)])
        else:
            (loss,), grads = mx.vjp(lambda *p: tail(h, *p), flat, [mx.array(1.0, dtype=mx.float32)])
            grads = [None, *grads]
    finally:
        for layer, n, ps in zip(layers, names, params):
            layer.update(tree_unflatten(list(zip(n, ps))))  # drop tracers
        if stream is not None:
            stream.built()
    out: Dict[int, Dict[str, mx.array]] = {}
    at = 1
    for j, (n, k) in enumerate(zip(names, sizes)):
        out[start + j] = dict(zip(n, grads[at : at + k]))
        at += k
    return loss, grads[0], out, dict(zip(out_names, grads[at:]))


class Tail:
    """Runs tail_value_and_grad under mx.compile, held or streamed, as
    mlx-lm compiles its step: elementwise ops fuse across the forward and
    the backward, with the model's state as the compiled function's inputs.
    The results are the same bits.

    Held (the pages fit together: step.py binds them for the tail, as
    ordinary arrays), this is the step with nothing to page, and the fusion
    is what separated it from mlx-lm's (bench compute shape at 100%: 1.93 s
    compiled against 2.05 s uncompiled, mlx-lm 2.00 s).

    Streamed (stream.py), the lazy page reads and the streamed layers'
    custom vjps are traced into the compiled graph like any other op: a
    page read is a primitive whose one input orders it (its `after`), so a
    replay of the trace reads the same pages in the same order, after the
    new step's arrays. The Python that builds the graph (Stream.enter, the
    custom vjps) runs only when MLX traces: once per start, input shapes
    and constant arguments (the blocks' call arguments); `_stream[0]` is the
    current step's Stream (None for a held tail), for a retrace that a new
    batch shape starts (a list the compiled functions share, not the Tail:
    a function that referred to the Tail would make a cycle, freed only by
    Python's cycle collector, with the model's arrays in it). Bench compute shape, paired runs: 1.98-2.07 s a step
    compiled against 2.11-2.21 s uncompiled with room for 2 or 4 of 8
    blocks, 2.10 against 2.15 s with 0.8 (the one-page budget waits a little
    longer for reads).

    `compile` False: everything uncompiled. The session turns it off on
    MLX's CPU backend where the memory limit leaves no room for the system
    compiler that backend's mx.compile runs (jit.tail_compile_refused).

    A tail with active dropout (its blocks', or the head's: outside.py)
    runs uncompiled (a compiled graph would freeze its keys), and so does a tail mx.compile cannot trace (dbrx's
    router evaluates arrays inside a block): the failure is remembered
    (``uncompiled``)."""

    def __init__(self, model: nn.Module, compile: bool = True, fns: Optional[CompiledShapes] = None):
        self.model, self.compile = model, compile
        # Its compiled functions per input shape (compiled.py), named
        # ("tail", start, chunk_bytes, streamed): the blocks' (step.Blocks),
        # so that a shape's go together.
        self.fns = fns if fns is not None else CompiledShapes()
        self._stream = [None]  # the Stream a streamed trace builds its reads from (None: held)
        self.uncompiled: Optional[str] = None  # why it runs uncompiled (mx.compile failed, or Blocks.run_uncompiled)

    def value_and_grad(
        self, start: int, mb: "step.MicroBatch", h: mx.array, keys, chunk_bytes: int, stream=None, extras=None
    ):
        """`extras`: the carries kept below `start` (carry.py), of which the
        tail takes those entering it."""
        refs = mb.carries.entering(start) if mb.carries else []
        entering = {r: (extras or {})[r] for r in refs}
        dropout = any(k is not None for k in keys[start:]) or outside.drawing_now(self.model)
        if not self.compile or self.uncompiled is not None or dropout:
            return tail_value_and_grad(self.model, start, mb, h, keys, chunk_bytes, stream, entering)
        streamed = stream is not None
        # A placement the run has moved on from: its graphs go (MLX keeps
        # them with the function, compiled.py).
        self.fns.discard(lambda name: name[0] == "tail" and name[1] != start)
        model, current = self.model, self._stream
        carries = mb.carries  # the model's, the same for every batch

        def compiled(h, inputs, targets, mask, norm, calls, values):
            m = step.MicroBatch(inputs, targets, mask, norm, calls=calls, norm=norm, carries=carries)
            return tail_value_and_grad(
                model, start, m, h, [None] * len(keys), chunk_bytes, current[0], dict(zip(refs, values))
            )

        fn = self.fns.get(tuple(h.shape), ("tail", start, chunk_bytes, streamed), compiled, inputs=[model.state])
        # mx.compile swaps every array of model.state (private ones too, e.g.
        # a scaled RoPE's _freqs) for a tracer, and swaps them back only when
        # the trace succeeds.
        before = tree_flatten(self.model.state)
        self._stream[0] = stream
        try:
            calls = carry.strip_all(mb.carries, mb.calls) if mb.carries else mb.calls  # no placeholders into mx.compile
            return fn(h, mb.inputs, mb.targets, mb.mask, mb.norm, calls, [entering[r] for r in refs])
        except Exception as e:
            self.model.update(tree_unflatten(before), strict=False)
            # A trace that fails fails before running anything; running the
            # tail uncompiled raises any error of its own again.
            self.uncompiled = step.one_line(e)
            self.fns.discard(lambda name: name[0] == "tail")
            return tail_value_and_grad(self.model, start, mb, h, keys, chunk_bytes, stream, entering)
        finally:
            self._stream[0] = None


def probe_tail(model: nn.Module, weights, start: int, rows: int, length: int, chunk_bytes: int) -> int:
    """MLX's peak memory for the tail start..L-1's vector-Jacobian product
    (streamed, stream.py) on a micro-batch of `rows` x `length` tokens, over
    the memory active before it, and the C heap its graph held once built
    (heap.py): the no-recompute placement's working set,
    measured before the first step, less the pages it read and kept (the
    plan counts pages apart). The pager's budget is two blocks' pages (beyond what
    it holds now) for the duration: what a tight budget would stream."""
    from .stream import Stream

    L = len(model.layers)
    mb = step.probe_batch(model, rows, length)
    h = mb.h0
    mx.eval(h)
    pager = weights.pager
    window = sum(sorted((weights.block_charge_bound(i) for i in range(start, L)), reverse=True)[:2])
    old = pager.set_budget(pager.stats()["resident_bytes"] + window)
    try:
        with Stream(weights, range(start, L)).bound() as st, step.gc_paused():
            # The frame the pager keeps for its next read is the pages'
            # (mlx_frames.h), not the tail's: measure without it.
            pager.drop_kept_frame()
            base = mx.get_active_memory()
            resident = pager.stats()["resident_bytes"]
            heap_start = heap.in_use()
            mx.reset_peak_memory()
            # dropout from keys of its own: mlx-lm's key sequence untouched
            keys = [dropout.fixed(layer) for layer in model.layers]
            loss, g_h, g_blocks, g_out = tail_value_and_grad(model, start, mb, h, keys, chunk_bytes, st)
            graph = heap.grown_since(heap_start)  # built, not yet run (heap.py)
            mx.eval(loss, g_blocks, g_out, [] if g_h is None else g_h)
            # less the pages it read and kept: the plan counts pages apart
            read = max(0, pager.stats()["resident_bytes"] - resident)
            used = max(0, mx.get_peak_memory() - base - read - pager.kept_frame_bytes()) + graph
            del loss, g_h, g_blocks, g_out
    finally:
        pager.set_budget(old)
    mx.reset_peak_memory()
    return used
