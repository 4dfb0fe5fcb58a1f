"""Streamed frozen weights: a tail segment whose pages need not be resident
together.

The tail segment (segment.py) runs blocks s..L-1 forward and backward in one
vector-Jacobian product, with no recompute. MLX's autodiff keeps every array
the backward needs from the forward to the backward, and for a product
x @ W.T that includes W: a tail whose weights are ordinary arrays holds all
its pages for the whole segment, so it only fits where the budget holds
them all, and below that blocks had to be recomputed.

Here the tail's frozen weights are lazy page reads (Pager.lazy_page,
csrc/mlx/paged_tensor.h) that MLX evaluates in graph order, after a given
array:

  forward   block i's pages are read after block i's input, one after the
            other (lazy_pages); every tensor of a page comes from one read.
  backward  each frozen linear layer (nn.Linear, nn.QuantizedLinear, called
            as a module, e.g. as LoRA's base layer) is a custom function
            whose vjp takes the input gradient from a second read of its
            page, after the first cotangent that reaches the block (the
            block's pages in reverse; the same operation MLX's own vjp
            does: cot @ W, or quantized_matmul with transpose flipped, so
            the results are the same bits).

So the graph never holds a linear layer's weights from its forward to its
backward: between the two, the pager may evict the page, and the budget,
not the tail's length, bounds the pages in memory. The page budget also
throttles MLX: its graph submission waits in the read while the budget is
full, until the arrays it submitted earlier are freed.

Tensors used otherwise (norm weights, biases, a DoRA layer's weight, MoE
experts, convolutions) come from the forward read as copies in buffers of
their own (`held`): the graph keeps them, as it keeps activations, without
keeping the page's frame.

The pager's schedule sees each tail block twice per micro-batch: forward
s..L-1 (each block's pages in order), then backward L-1..s (the pages
backward_pages names, in reverse): step.step_pages.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

# The streamed layers' frozen entries: the tensors their input gradient needs.
_STREAMED_KEYS = {nn.Linear: ("weight",), nn.QuantizedLinear: ("weight", "scales", "biases")}


def streamed_keys(module: nn.Module) -> tuple:
    """The entries of `module` a streamed tail re-reads in the backward
    (empty: the module is not streamed; its tensors are held copies)."""
    return _STREAMED_KEYS.get(type(module), ())


def _not_called_as_modules(block: nn.Module) -> set:
    """ids of linear layers whose weight a parent uses directly (DoRA
    computes with its base layer's weight): those cannot be streamed."""
    out = set()
    for _, m in block.named_modules():
        base = m.get("linear") if isinstance(m, nn.Module) else None
        if isinstance(base, nn.Module) and type(m).__name__.startswith("DoRA"):
            out.add(id(base))
    return out


def plan_block(weights, block: int) -> Dict[int, List[bool]]:
    """For each page of block `block`, for each of its tensors (registration
    order): True where a streamed tail re-reads it in the backward, False
    where it is held as a copy from the forward."""
    direct = _not_called_as_modules(weights.model.layers[block])
    return {
        pid: [s.key in streamed_keys(s.module) and id(s.module) not in direct for s in weights.slots[pid]]
        for pid in weights.block_pages[block]
    }


def backward_pages(weights, block: int) -> List[int]:
    """The pages of block `block` a streamed tail reads again for its
    backward, in the order it reads them (the reverse of the forward's):
    those holding a streamed tensor."""
    masks = plan_block(weights, block)
    return [p for p in reversed(weights.block_pages[block]) if any(masks[p])]


def held_bytes(weights, block: int) -> int:
    """Bytes a streamed tail holds of block `block` from forward to backward."""
    return sum(
        int(s.placeholder.nbytes)
        for pid, mask in plan_block(weights, block).items()
        for s, streamed in zip(weights.slots[pid], mask)
        if not streamed
    )


def lazy_pages(weights, pids, after: mx.array, copy=None) -> Dict[int, List[mx.array]]:
    """Pages `pids` as lazy page reads (Pager.lazy_page), read in the order
    given whatever order MLX's graph reaches them in: the first after
    `after`, each next one after the one before it (its first tensor), so
    that the pager sees the reads in its schedule's order. `copy[pid]`: per
    tensor, a buffer of its own (default: views of the frame)."""
    out = {}
    for pid in pids:
        out[pid] = weights.pager.lazy_page(pid, after, (copy or {}).get(pid, []))
        after = out[pid][0] if out[pid] else after
    return out


def _placeholders(weights, pids) -> None:
    """Pages `pids`' tensors out of the model: their placeholders back."""
    for pid in pids:
        for s in weights.slots[pid]:
            s.module[s.key] = s.placeholder


@contextmanager
def forward_pages(weights, block: int, after: mx.array):
    """Block `block` in the model for one forward, its pages as lazy reads
    after `after` in use order (lazy_pages), so that the pager reads the
    block's later pages while MLX computes with its first. Yields `drop`:
    call it once the block's graph is built and before it is evaluated, so
    that each page's frame goes as soon as the graph is done with it (a
    view the model kept would keep every frame of the block until the end)."""
    pids = weights.block_pages[block]
    got = lazy_pages(weights, pids, mx.stop_gradient(after))

    def drop():
        _placeholders(weights, pids)

    try:
        for pid in pids:
            for s, a in zip(weights.slots[pid], got[pid]):
                s.module[s.key] = a
        got = None
        yield drop
    finally:
        drop()


class _StreamedLinear(nn.Linear):
    def __call__(self, x):
        return _ACTIVE[id(self)].linear(self, x)


class _StreamedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x):
        return _ACTIVE[id(self)].quantized(self, x)


_STREAMED_CLASS = {nn.Linear: _StreamedLinear, nn.QuantizedLinear: _StreamedQuantizedLinear}
# id(module) -> (_Stream, block, {key: tensor index}) while a tail is streamed.
_ACTIVE: Dict[int, "_Binding"] = {}


class _Binding:
    def __init__(self, stream: "Stream", block: int, page: int, index: Dict[str, int]):
        self.stream, self.block, self.page, self.index = stream, block, page, index

    def _backward(self, cot: mx.array, key: str) -> Optional[mx.array]:
        if key not in self.index:
            return None
        return self.stream.backward_page(self.block, self.page, cot)[self.index[key]]

    def linear(self, m: nn.Module, x: mx.array) -> mx.array:
        w, b = m["weight"], m.get("bias")

        @mx.custom_function
        def f(x):
            return mx.addmm(b, x, w.T) if b is not None else x @ w.T

        @f.vjp
        def f_vjp(primals, cot, output):
            return (cot @ self._backward(cot, "weight"),)

        return f(x)

    def quantized(self, m: nn.Module, x: mx.array) -> mx.array:
        w, scales, biases = m["weight"], m["scales"], m.get("biases")
        kw = dict(group_size=m.group_size, bits=m.bits, mode=m.mode)

        @mx.custom_function
        def f(x):
            return mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True, **kw)

        @f.vjp
        def f_vjp(primals, cot, output):
            return (
                mx.quantized_matmul(
                    cot,
                    self._backward(cot, "weight"),
                    scales=self._backward(cot, "scales"),
                    biases=self._backward(cot, "biases"),
                    transpose=False,
                    **kw,
                ),
            )

        y = f(x)
        if "bias" in m:
            y = y + m["bias"]
        return y


class Stream:
    """Blocks `blocks`' frozen weights as lazy page reads, for one tail
    segment; `enter(i, x)` binds block i's forward reads (after x), once
    per block per vector-Jacobian product that is built (under mx.compile,
    once per trace: a replay makes the same reads with no Python)."""

    def __init__(self, weights, blocks):
        self.weights = weights
        self.blocks = list(blocks)
        # Planned before bound() swaps the layers' classes (streamed_keys
        # goes by class).
        self.masks = {p: m for i in self.blocks for p, m in plan_block(weights, i).items()}
        self.back = {i: backward_pages(weights, i) for i in self.blocks}
        self._bwd: Dict[int, Dict[int, List[mx.array]]] = {}
        self._bindings: Dict[int, _Binding] = {}

    def enter(self, block: int, x: mx.array) -> None:
        pids = self.weights.block_pages[block]
        fwd = lazy_pages(self.weights, pids, mx.stop_gradient(x), {p: [not m for m in self.masks[p]] for p in pids})
        for pid in pids:
            for s, a in zip(self.weights.slots[pid], fwd[pid]):
                s.module[s.key] = a
        self._bwd.pop(block, None)

    def backward_page(self, block: int, pid: int, after: mx.array) -> List[mx.array]:
        """Page `pid` of block `block` read again for the backward, after
        `after` (the first cotangent to reach the block): the block's pages
        are all made at once, read in backward_pages order."""
        got = self._bwd.get(block)
        if got is None:
            got = self._bwd[block] = lazy_pages(self.weights, self.back[block], after)
        return got[pid]

    def built(self) -> None:
        """The vector-Jacobian product is built: the graph now holds what it
        needs, and nothing else may hold a page's view past its use (a view
        kept here would keep the frame after the pager evicts the page)."""
        _placeholders(self.weights, [p for i in self.blocks for p in self.weights.block_pages[i]])
        self._bwd.clear()

    @contextmanager
    def bound(self):
        """The streamed layers swapped in for the duration (and the
        placeholders back afterwards)."""
        swapped = []
        try:
            for i in self.blocks:
                index: Dict[int, Dict[str, int]] = {}
                page: Dict[int, int] = {}
                modules = {}
                for pid in self.weights.block_pages[i]:
                    for n, (s, streamed) in enumerate(zip(self.weights.slots[pid], self.masks[pid])):
                        if streamed:
                            index.setdefault(id(s.module), {})[s.key] = n
                            page[id(s.module)] = pid  # a module's tensors share a page (store.split_block)
                            modules[id(s.module)] = s.module
                for mid, m in modules.items():
                    _ACTIVE[mid] = _Binding(self, i, page[mid], index[mid])
                    swapped.append((m, type(m)))
                    m.__class__ = _STREAMED_CLASS[type(m)]
            yield self
        finally:
            for m, cls in swapped:
                m.__class__ = cls
                _ACTIVE.pop(id(m), None)
            self.built()
