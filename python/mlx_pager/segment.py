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
before. With s = first (a budget that holds every trained block) a step does
mlx-lm's arithmetic with no recompute at all, and the results are the same
bits. ``choose_start`` picks the smallest s that fits, from the page
footprints and a measured size of one block's activations.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import step


def _head_loss_in_graph(model, mb: "step.MicroBatch", h: mx.array, chunk_bytes: int) -> mx.array:
    """default_loss's value from the last hidden state, over the same token
    chunks as step.head_loss (the per-token losses do not depend on the
    chunking; they are summed at once, as default_loss sums them)."""
    parts = [
        step._head_ce(model, mb.inputs[:, t0:t1], mb.targets[:, t0:t1], mb.mask[:, t0:t1], h[:, t0:t1])
        for t0, t1 in step.head_chunks(h.shape[1], h.shape[0], step._vocab_size(model), chunk_bytes)
    ]
    return step._concat(parts).astype(mx.float32).sum() / mb.ntoks


def tail_value_and_grad(
    model: nn.Module,
    start: int,
    mb: "step.MicroBatch",
    h: mx.array,
    keys: Sequence[Optional[mx.array]],
    chunk_bytes: int,
) -> Tuple[mx.array, mx.array, Dict[int, Dict[str, mx.array]]]:
    """(loss, dL/dh[start], {block: {adapter name: grad}}) for blocks
    start..L-1 and the head, for one micro-batch; the blocks' pages must be
    bound. keys[i]: block i's dropout key (None without dropout). When no
    block below `start` is trained, dL/dh[start] is not computed (None):
    nothing needs it, and mlx-lm does not compute it either."""
    L = len(model.layers)
    layers = [model.layers[i] for i in range(start, L)]
    names = [step._trainable_names(layer) for layer in layers]
    params = [[v for _, v in tree_flatten(layer.trainable_parameters())] for layer in layers]
    sizes = [len(p) for p in params]

    def tail(x, *flat):
        at = 0
        for layer, n, k in zip(layers, names, sizes):
            layer.update(tree_unflatten(list(zip(n, flat[at : at + k]))))
            at += k
        for j, layer in enumerate(layers):
            with step.keyed_dropout(layer, keys[start + j]):
                x = step.run_block(layer, x, mb.calls[start + j])
        return [_head_loss_in_graph(model, mb, x, chunk_bytes)]

    flat = [p for ps in params for p in ps]
    need_h = step.first_trained_block(model) < start
    try:
        if need_h:
            (loss,), grads = mx.vjp(tail, [h, *flat], [mx.array(1.0, dtype=mx.float32)])
        else:
            (loss,), grads = mx.vjp(lambda *p: tail(h, *p), flat, [mx.array(1.0, dtype=mx.float32)])
            grads = [None, *grads]
    finally:
        for layer, n, ps in zip(layers, names, params):
            layer.update(tree_unflatten(list(zip(n, ps))))  # drop tracers
    out: Dict[int, Dict[str, mx.array]] = {}
    at = 1
    for j, (n, k) in enumerate(zip(names, sizes)):
        out[start + j] = dict(zip(n, grads[at : at + k]))
        at += k
    return loss, grads[0], out


class _Batch:
    """The parts of a MicroBatch the tail reads (inputs of a compiled tail)."""

    def __init__(self, inputs, targets, mask, ntoks, calls):
        self.inputs, self.targets, self.mask, self.ntoks, self.calls = inputs, targets, mask, ntoks, calls


class Tail:
    """tail_value_and_grad, compiled with mx.compile once per start (as mlx-lm
    compiles its step: elementwise ops fuse; the results are the same bits).
    Everything that changes between steps is an input of the compiled
    function: the hidden state, every parameter of the tail's blocks (their
    pages are new arrays each step), the batch and the blocks' call
    arguments. With active dropout, or when the trace fails, it runs
    uncompiled (``uncompiled`` says why)."""

    def __init__(self, model: nn.Module, compile: bool = True):
        self.model, self.compile = model, compile
        self._fns: Dict[int, object] = {}
        self.uncompiled: Optional[str] = None

    def value_and_grad(self, start: int, mb: "step.MicroBatch", h: mx.array, keys, chunk_bytes: int):
        L = len(self.model.layers)
        if not self.compile or self.uncompiled or any(k is not None for k in keys[start:]):
            return tail_value_and_grad(self.model, start, mb, h, keys, chunk_bytes)
        layers = [self.model.layers[i] for i in range(start, L)]
        if start not in self._fns:
            model = self.model

            def fn(h, params, inputs, targets, mask, ntoks, calls):
                for layer, p in zip(layers, params):
                    layer.update(p)
                batch = _Batch(inputs, targets, mask, ntoks, [None] * start + list(calls))
                loss, g_h, grads = tail_value_and_grad(model, start, batch, h, [None] * L, chunk_bytes)
                return loss, [] if g_h is None else [g_h], [grads[i] for i in range(start, L)]

            self._fns[start] = mx.compile(fn)
        params = [layer.parameters() for layer in layers]
        try:
            loss, g_h, grads = self._fns[start](h, params, mb.inputs, mb.targets, mb.mask, mb.ntoks, mb.calls[start:])
        except Exception as e:  # a trace that fails runs nothing: go uncompiled
            self.uncompiled = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            self._fns.clear()
            return tail_value_and_grad(self.model, start, mb, h, keys, chunk_bytes)
        finally:
            for layer, p in zip(layers, params):
                layer.update(p)  # tracing left tracers in the modules
        return loss, (g_h[0] if g_h else None), {start + j: g for j, g in enumerate(grads)}


def head_bytes(batch: int, seq_len: int, vocab: int) -> int:
    """What the head's autodiff graph keeps for a whole micro-batch: the
    float32 logits, their softmax and its gradient."""
    return 3 * batch * seq_len * vocab * 4


def choose_start(
    first: int, footprints: List[int], page_budget: int, block_act_bytes: int, head_act_bytes: int, act_budget: int
) -> int:
    """The smallest s >= first such that the pages of blocks s..L-1 fit in
    the page budget together, and the pages plus the tail's activations (one
    measured block's worth per block, plus the head's) fit in the page and
    activation budgets together. Returns L (no tail) when nothing fits."""
    L = len(footprints)
    for s in range(first, L):
        pages = sum(footprints[s:])
        acts = (L - s) * block_act_bytes + head_act_bytes
        if pages <= page_budget and pages + acts <= page_budget + act_budget:
            return s
    return L
