"""LoRA dropout with mlx-lm's masks, replayed where a block is recomputed.

mlx-lm's ``nn.Dropout`` draws each mask from MLX's global key sequence
(``mx.random.bernoulli`` without a key: the sequence's next key, the state
split in two, one half kept as the new state). Its training step, batch by
batch, runs the whole model forward, so the draws come in this order:

  forward    for each block 0..L-1, one draw per dropout call, in call
             order (the order the block's forward reaches its LoRA layers,
             not the order its modules are registered in);
  backward   only with ``--grad-checkpoint``: mlx-lm's checkpointed blocks
             (those of the class of ``model.layers[0]`` whose vjp the
             gradient reaches: from the first trained block up) run their
             forward again inside the vjp, from the last block down, and
             draw new masks there (their gradients are not those of the
             forward's masks; measured: 2 draws a step for one block).

The paged step runs the blocks layer-major over several micro-batches and
recomputes blocks in its backward sweep, so it cannot let the masks come
from the global sequence as the blocks run. ``plan`` computes, from the
global state at the step's start, the key each (block, micro-batch,
call) gets in mlx-lm's order, and ``advance`` then moves the global
state past the step's draws, as mlx-lm's step leaves it. A step retried
after MemoryPressure plans again from the same state (``advance`` runs only
once a step is done). A micro-batch that is part of a batch split to fit
draws the whole batch's mask from its key and takes its own rows (the
batch's parts then see mlx-lm's masks; their sums still differ from the
whole batch's by float rounding).

A block without active dropout (p = 0, mlx-lm's default, or evaluation) is
left alone: its math and the global state are exactly mlx-lm's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Set, Tuple

import mlx.core as mx
import mlx.nn as nn


def active(layer: nn.Module) -> List[Tuple[str, nn.Dropout]]:
    """The block's dropout modules that draw masks (p > 0, training)."""
    return [(name, m) for name, m in layer.named_modules() if isinstance(m, nn.Dropout) and m.training and m._p_1 < 1]


@dataclass
class BlockDraws:
    """The keys of one block's dropout calls for one micro-batch, in call
    order: `forward` for its forward pass, `backward` for its recompute in
    the backward sweep (the same keys, except where mlx-lm's
    --grad-checkpoint draws new ones). `rows`: the whole batch's rows where
    the micro-batch is `part_rows` rows of it from `row0` (None: the batch)."""

    forward: List[mx.array]
    backward: List[mx.array]
    rows: Optional[int] = None
    row0: int = 0
    part_rows: int = 0


class KeyedDropout(nn.Module):
    """nn.Dropout drawing its mask from the next of a block's keys (shared
    by the block's dropout modules through `at`, so they take them in call
    order) instead of the global key sequence."""

    def __init__(self, p_keep: float, keys: List[mx.array], draws: BlockDraws, at: List[int]):
        super().__init__()
        self._p_keep, self._keys, self._draws, self._at = p_keep, keys, draws, at

    def __call__(self, x):
        j = self._at[0]
        self._at[0] += 1
        keys = self._keys
        # More calls than planned (plan without `calls`, or the planner's
        # probes, fixed()): keys of its own, the same in the recompute.
        key = keys[j] if j < len(keys) else mx.random.split(keys[-1], j + 1)[j]
        return (mask(self._p_keep, key, x, self._draws) * x) * (1 / self._p_keep)


def mask(
    p_keep: float,
    key: mx.array,
    x: mx.array,
    d: Optional[BlockDraws],
    window: Optional[Tuple[int, int, int]] = None,
    cache: Optional[dict] = None,
):
    """The mask `key` draws for x where x is a part of what mlx-lm's
    dropout sees: the whole batch's mask, of which x's rows (`d`: a part
    of a batch split to fit; None: x's own) and x's tokens (`window` =
    (t0, t1, T): tokens t0..t1 of T, the LM head's chunk, outside.py) are
    taken. `cache` ({}): the whole masks drawn, by key and shape, so that
    a head's chunks take theirs from one draw, one buffer their slices
    share (drawn per chunk, a tail's graph held a whole mask a chunk)."""
    shape, rows, tokens = list(x.shape), slice(None), slice(None)
    if d is not None and d.rows is not None and x.ndim and x.shape[0] % d.part_rows == 0:
        # The part's rows of the batch's mask; an input whose first axis
        # holds m entries a row (its rows flattened with the positions,
        # batch-major) takes m entries a row. (A MoE layer's input sorted
        # by expert across the rows, mlx-lm's gather_sort, interleaves
        # the rows: its part's mask is the batch's, not mlx-lm's.)
        m = x.shape[0] // d.part_rows
        shape[0], rows = d.rows * m, slice(d.row0 * m, (d.row0 + d.part_rows) * m)
    if window is not None:
        t0, t1, T = window
        if x.ndim < 2 or x.shape[1] != t1 - t0:
            raise RuntimeError(f"a dropout input of shape {tuple(x.shape)} in a chunk of tokens {t0}..{t1}")
        shape[1], tokens = T, slice(t0, t1)
    found = None if cache is None else cache.get((id(key), tuple(shape)))
    if found is None:
        found = (key, mx.random.bernoulli(p_keep, tuple(shape), key=key))  # (the key kept: its id stays its own)
        if cache is not None:
            cache[(id(key), tuple(shape))] = found
    out = found[1]
    if rows != slice(None):
        out = out[rows]
    return out if tokens == slice(None) else out[:, tokens]


def put(modules: dict, name: str, m: nn.Module) -> None:
    """Sets the module called `name` (a full name, as named_modules gives
    it) to `m`; `modules`: dict(root.named_modules())."""
    parent, attr = name.rsplit(".", 1) if "." in name else ("", name)
    modules[parent][attr] = m


@contextmanager
def _replaced(layer: nn.Module, found, stand_in):
    """Within the block, each of the `found` (name, nn.Dropout) pairs
    replaced by stand_in(module); put back afterwards."""
    modules = dict(layer.named_modules())
    try:
        for name, m in found:
            put(modules, name, stand_in(m))
        yield
    finally:
        for name, m in found:
            put(modules, name, m)


@contextmanager
def keyed(layer: nn.Module, draws: Optional[BlockDraws], backward: bool = False):
    """Within the block, every active nn.Dropout replaced by a KeyedDropout
    drawing `draws`' forward (or `backward`) keys in call order; put back
    afterwards. Yields whether any was replaced (a block with dropout runs
    uncompiled: a compiled graph would freeze its keys)."""
    found = active(layer) if draws is not None else []
    if not found:
        yield False
        return
    keys = draws.backward if backward else draws.forward
    at = [0]
    with _replaced(layer, found, lambda m: KeyedDropout(m._p_1, keys, draws, at)):
        yield True


class _Counter(nn.Module):
    """Stands in for an active nn.Dropout: counts the call, draws nothing."""

    def __init__(self, n: List[int]):
        super().__init__()
        self._n = n

    def __call__(self, x):
        self._n[0] += 1
        return x


@contextmanager
def counting(layer: nn.Module):
    """Within the block, every active nn.Dropout replaced by a counter of
    its calls (nothing drawn, nothing masked); yields the count, a list of
    one int, which the block's calls add to."""
    n = [0]
    with _replaced(layer, active(layer), lambda m: _Counter(n)):
        yield n


def fixed(layer: nn.Module) -> Optional[BlockDraws]:
    """Draws for a measurement run of the block (the planner's probes), from
    a key of their own: the masks cost what the step's do, and mlx-lm's
    global key sequence is left as it is. None without active dropout."""
    c = len(active(layer))
    if not c:
        return None
    keys = list(mx.random.split(mx.random.key(0), c))
    return BlockDraws(keys, keys)


def checkpointed_blocks(model: nn.Module, first_trained: int) -> Set[int]:
    """The blocks whose forward mlx-lm's --grad-checkpoint runs again in the
    backward pass: its grad_checkpoint patches the class of model.layers[0],
    and the gradient reaches the blocks from the first trained one up."""
    layers = model.layers
    return {i for i in range(first_trained, len(layers)) if type(layers[i]) is type(layers[0])}


@dataclass
class OutsideDraws(BlockDraws):
    """The keys of one model call's dropouts outside the blocks (outside.py)
    for one micro-batch, in call order: `before` drawn before block 0, then
    `after` after the last block."""

    before: int = 0
    after: int = 0


@dataclass
class Plan:
    """A step's dropout keys (plan)."""

    blocks: List[List[Optional[BlockDraws]]]  # [i][m]: block i's for micro-batch m, None without dropout
    # [m]: the adapters outside the blocks' (outside.py), None without
    # dropout; `forward` holds the keys of one model call, in call order:
    # those drawn before block 0, then those after the last block.
    outside: List[Optional[OutsideDraws]]
    draws: int  # the global draws the step makes (advance)


def plan(
    model: nn.Module,
    micro_batches: Sequence,
    redrawn: Set[int] = frozenset(),
    calls: Optional[Callable[[object], List[int]]] = None,
    outside: Optional[Callable[[object], Tuple[int, int]]] = None,
) -> Plan:
    """The keys of every dropout call of the step in mlx-lm's order from the
    global key state now (see the module's docstring), and the number of
    global draws the step makes. Micro-batches are in their batches'
    order; a batch's parts are consecutive, its first at row0 0.
    `redrawn`: the blocks mlx-lm's --grad-checkpoint draws again in its
    backward pass (checkpointed_blocks), empty without it. `calls(mb)`:
    each block's dropout calls for a batch of micro-batch mb's shapes
    (step.dropout_calls: a block may call a LoRA layer more than once,
    mamba's once per position); without it, one per active module.
    `outside(mb)`: the calls of the active dropouts outside the blocks
    (outside.dropout_calls) before block 0 (an adapted embedding's) and
    after the last block (the head's): mlx-lm draws the first before the
    blocks' forward draws and the second after them, before any
    --grad-checkpoint redraws. Nothing is drawn from the global sequence
    here."""
    L, M = len(model.layers), len(micro_batches)
    modules = [len(active(layer)) for layer in model.layers]
    table: List[List[Optional[BlockDraws]]] = [[None] * M for _ in range(L)]
    around = [outside(mb) if outside is not None else (0, 0) for mb in micro_batches]
    outer: List[Optional[OutsideDraws]] = [None] * M
    if not any(modules) and not any(sum(a) for a in around):
        return Plan(table, outer, 0)
    state = mx.random.state[0]
    n = 0

    def take(k: int) -> List[mx.array]:
        nonlocal state, n
        out = []
        for _ in range(k):
            state, key = mx.random.split(state)
            out.append(key)
        n += k
        return out

    batches: List[List[int]] = []  # micro-batch indices of each batch
    for m, mb in enumerate(micro_batches):
        if mb.row0 == 0 or not batches:
            batches.append([])
        batches[-1].append(m)
    for parts in batches:
        counts = calls(micro_batches[parts[0]]) if calls is not None and any(modules) else modules
        before, after = around[parts[0]]
        prefix = take(before)
        forward = [take(c) for c in counts]
        head = take(after)
        backward = list(forward)
        for i in sorted(redrawn, reverse=True):
            if counts[i]:
                backward[i] = take(counts[i])
        for m in parts:
            mb = micro_batches[m]
            part_rows = int(mb.inputs.shape[0])
            rows = mb.batch_rows if mb.batch_rows != part_rows else None
            for i in range(L):
                if modules[i]:
                    table[i][m] = BlockDraws(forward[i], backward[i], rows, mb.row0, part_rows)
            if prefix or head:
                keys = prefix + head
                outer[m] = OutsideDraws(keys, keys, rows, mb.row0, part_rows, len(prefix), len(head))
    return Plan(table, outer, n)


_drawn = [0]  # draws advance() made since reset(): what resume.py keeps


def advance(n: int) -> None:
    """Moves MLX's global key sequence past `n` draws (the step's, as
    mlx-lm's step leaves it): each random op without a key takes one."""
    for _ in range(n):
        mx.random.uniform(shape=(1,))
    _drawn[0] += n


def reset() -> None:
    """Training starts (the global sequence just seeded): no draws yet."""
    _drawn[0] = 0


def drawn() -> int:
    """The steps' draws since reset(). A resumed run (resume.py) seeds,
    makes the adapters as the interrupted run did, and advances past these:
    its masks are then the uninterrupted run's."""
    return _drawn[0]
