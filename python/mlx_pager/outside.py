"""Adapters outside the blocks: LoRA/DoRA on the LM head and the embeddings.

mlx-lm's linear_to_lora_layers adapts, besides the blocks' modules, any
module of the whole model whose full name is one of the `keys` in
``lora_parameters`` (``lm_head``, ``model.embed_tokens``; with tied
embeddings the embedding's adapter is the head's too, through its
``as_linear``). Those modules are resident (the pinned page), and so are
their adapters; the paged step differentiates them where they are used:

  head     the loss's vector-Jacobian product (step.head_loss_and_grad, or
           the tail segment's, segment.py) takes them as inputs beside the
           last hidden state;
  prefix   where the embedding output h0 depends on them (an embedding's
           adapter), the backward sweep goes down to block 0, frozen blocks
           included (step.first_trained_block is then 0, as MLX's autodiff
           of the whole model differentiates every block between the
           embedding and the loss), and the vjp of the model's own call up to
           its first block (step.record_calls) turns dL/dh0 into their
           gradients;
  fed      where they change what the model passes its blocks besides h0
           (gemma4_text's per-layer inputs, made from the embedding output
           and their own embedding: Prefix.feeds), those arguments are
           carries made before block 0 (carry.PREFIX, carry_prefix): each
           block's vjp differentiates its own, their cotangents are summed
           as carries' are (carry.py), and the same vjp up to block 0 takes
           them beside dL/dh0. No tail segment runs then, not even one from
           block 0 (placement.Step.tail_allowed): every block is recomputed.

Each gives every such parameter a gradient (zeros where unused, as MLX's
autodiff gives them), and the step sums them: with one head chunk, two terms
a batch, the bits of mlx-lm's sum in any order; over an accumulation group,
each batch's two first and then the batches' sums in order, as mlx-lm adds
whole batches' gradients (each batch's head term is kept until the backward
sweep reaches the embedding: one more copy of these adapters' gradients a
batch of the group, only where both paths reach them, a tied embedding's). Where the
call arguments are fed, some cotangents sum in another order than MLX's
autodiff of the whole model (h0's uses in block 0 and in the per-layer
projection: MLX adds the projection's between block 0's ops): within float
rounding (test_outside.py: 1e-7 relative in float32).

Their dropout draws mlx-lm's masks. mlx-lm's forward pass draws each from
MLX's global key sequence, in the model's order: an adapted embedding's
(and whatever else runs before block 0) before the blocks' draws, the
head's after them. The paged step calls the model's own ``__call__`` many
times a step (recording the blocks' calls, the head per token chunk, the
vjp up to block 0), so while it pages, these dropouts are OutsideDropouts
(install_dropouts, for a training session; dropouts(), for a step): in a
step, each model call for micro-batch m draws its masks from the keys
dropout.plan gives it, in call order (drawing, new_call), taking the rows
of a part of a split batch and the tokens of a head chunk (window) of the
whole batch's masks; anywhere else (the planner's probes, the search for
what the embedding output depends on) from a key of their own, never from
the global sequence. A tied embedding's one dropout module draws twice a
call: as the embedding, then as the head (as_linear), as in mlx-lm.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import carry, dropout


def modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(full name, module) of the model's modules outside its blocks
    (model.layers): the embeddings, the head, a wrapper's own."""
    inside = {id(m) for layer in model.layers for _, m in layer.named_modules()}
    return [(n, m) for n, m in model.named_modules() if id(m) not in inside]


def trainable(model: nn.Module) -> Tuple[List[str], List[mx.array]]:
    """(full names, arrays) of the trainable parameters outside the blocks
    (model.layers), in the model's order; none for the usual run."""
    inside = {id(v) for layer in model.layers for _, v in tree_flatten(layer.trainable_parameters())}
    pairs = [(k, v) for k, v in tree_flatten(model.trainable_parameters()) if id(v) not in inside]
    return [k for k, _ in pairs], [v for _, v in pairs]


@contextmanager
def bound(model: nn.Module, names: List[str], values):
    """The model with `values` (tracers, in a vjp) in place of the
    parameters `names` for the duration; its own arrays put back after."""
    if not names:
        yield
        return
    own = dict(tree_flatten(model.trainable_parameters()))
    model.update(tree_unflatten(list(zip(names, values))))
    try:
        yield
    finally:
        model.update(tree_unflatten([(n, own[n]) for n in names]))


@dataclass(frozen=True)
class Prefix:
    """What the adapters outside the blocks change before block 0."""

    h0: bool  # the embedding output (the hidden state block 0 takes)
    # (block, leaf index of its call in carry.map_leaves order): the block
    # call arguments they change besides the hidden state (a per-layer
    # input made from the embedding, an embedding skip)
    feeds: Tuple[Tuple[int, int], ...] = ()
    # Per distinct array among them: the last block that takes it
    last: Tuple[int, ...] = ()

    def pairs(self) -> List[Tuple[int, int]]:
        """(carry.PREFIX, last consumer) per argument: placement.Step's
        carries."""
        return [(carry.PREFIX, c) for c in self.last]

    @property
    def trains(self) -> bool:
        return self.h0 or bool(self.feeds)


# id(model) -> (weak reference to it, names, Prefix): the structure, not
# the values. (A Module is a dict: not hashable.)
_PREFIX: Dict[int, Tuple[weakref.ref, tuple, Prefix]] = {}
_NONE = Prefix(False)


def _call_leaves(calls) -> List[Tuple[int, int, mx.array]]:
    """(block, leaf index, array) of every differentiable leaf of the
    blocks' recorded calls (carry.map_leaves order)."""
    return [
        (i, j, v) for i, call in enumerate(calls) for j, v in enumerate(carry.leaves(call)) if carry.differentiable(v)
    ]


def prefix(model: nn.Module) -> Prefix:
    """What the adapters outside the blocks change before block 0 (Prefix):
    where they change anything, the step differentiates the blocks down to
    block 0 (step.first_trained_block). Found by a forward-mode derivative of
    the model's own call up to its blocks (two distinct tokens, at random
    values along random tangents, from a key of its own; their dropouts
    too: the global key sequence is untouched)."""
    names, params = trainable(model)
    if not names:
        return _NONE
    cached = _PREFIX.get(id(model))
    if cached is not None and cached[0]() is model and cached[1] == tuple(names):
        return cached[2]
    with dropouts(model), _own_keys(model):  # (their masks from a key of their own)
        found = _find_prefix(model, names, params)
    for k in [k for k, v in _PREFIX.items() if v[0]() is None]:
        del _PREFIX[k]
    _PREFIX[id(model)] = (weakref.ref(model), tuple(names), found)
    return found


def _find_prefix(model: nn.Module, names: List[str], params: List[mx.array]) -> Prefix:
    """prefix()'s search."""
    from . import step

    inputs = mx.array([[1, 2]], dtype=mx.int32)
    where: List[Tuple[int, int]] = []
    recorded = []

    def f(*values):
        with bound(model, names, values):
            h0, calls = step.record_calls(model, inputs)
        leaves = _call_leaves(calls)
        where[:] = [(i, j) for i, j, _ in leaves]
        recorded[:] = [calls]
        return [h0, *(v for _, _, v in leaves)]

    # At random values too, not the adapters' own: a fresh lora_b is zeros,
    # and the model's frozen weights may still be placeholders (zeros), under
    # which a DoRA embedding's output does not move with its magnitudes.
    keys = mx.random.split(mx.random.key(0), 2 * len(params))

    def rand(j, p):
        if not mx.issubdtype(p.dtype, mx.floating):
            return p
        return mx.random.normal(p.shape, key=keys[j]).astype(p.dtype)

    primals = [rand(2 * j, p) for j, p in enumerate(params)]
    tangents = [rand(2 * j + 1, p) for j, p in enumerate(params)]
    # The frozen float weights outside the blocks at random values too (held
    # fixed): when the session opens they are still placeholders, under
    # which an adapter on a projection of the embedding output (gemma4_text's
    # per_layer_model_projection) moved nothing, and the step left it
    # untrained (its gradient zero; mlx_lm.lora trains it).
    inside = {id(v) for layer in model.layers for _, v in tree_flatten(layer.parameters())}
    taken = set(names)
    fixed = [
        (k, v)
        for k, v in tree_flatten(model.parameters())
        if id(v) not in inside and k not in taken and mx.issubdtype(v.dtype, mx.floating)
    ]
    # (One random row broadcast to each one's shape: a random table the size
    # of an embedding's is computed whole where the derivative takes rows of
    # it, ~3x the table at its peak, 2.4 GB for a Gemma 4 E2B's.)
    fkeys = mx.random.split(mx.random.key(1), max(1, len(fixed)))
    rows = [mx.random.normal(v.shape[-1:], key=r).astype(v.dtype) for (_, v), r in zip(fixed, fkeys)]
    model.update(tree_unflatten([(k, mx.broadcast_to(row, v.shape)) for (k, v), row in zip(fixed, rows)]))
    try:
        _, tans = mx.jvp(f, primals, tangents)
    finally:
        model.update(tree_unflatten(fixed))
    moved = [bool(mx.any(t != 0).item()) for t in tans]
    feeds = tuple(w for w, m in zip(where, moved[1:]) if m)
    index = _fed(recorded[0], feeds)[1]
    last = [max(i for (i, _), k in index.items() if k == n) for n in range(len(set(index.values())))]
    recorded.clear()  # (the tracers of the recording)
    return Prefix(moved[0], feeds, tuple(last))


def trains_prefix(model: nn.Module) -> bool:
    """Whether the adapters outside the blocks change what block 0 or any
    block takes from the embedding (prefix): then the step differentiates
    the blocks down to block 0."""
    return prefix(model).trains


def _fed(calls, feeds) -> Tuple[List[mx.array], Dict[Tuple[int, int], int]]:
    """The distinct arrays at `feeds` in the blocks' `calls` (one array
    passed to several blocks once), in order, and each position's index
    among them."""
    at = {(i, j): v for i, j, v in _call_leaves(calls)}
    arrays, index, seen = [], {}, {}
    for w in feeds:
        v = at[w]
        if id(v) not in seen:
            seen[id(v)] = len(arrays)
            arrays.append(v)
        index[w] = seen[id(v)]
    return arrays, index


def carry_prefix(model: nn.Module, mb) -> None:
    """Where the adapters outside the blocks change block call arguments
    (Prefix.feeds), `mb`'s recorded calls (step.MicroBatch) take them as
    carries of a producer before block 0 (carry.PREFIX: the step
    differentiates them in each consumer's vjp and sums their cotangents,
    carry.py), their values as mb.fed ({ref: value}), which the step keeps
    beside the micro-batch's other carries."""
    feeds = prefix(model).feeds
    if not feeds:
        return
    arrays, index = _fed(mb.calls, feeds)
    put = {}
    for i, j in feeds:
        put.setdefault(i, {})[j] = carry.Out(carry.PREFIX, index[(i, j)] + 1)
    mb.calls = [carry.map_leaves(c, lambda j, v, p=put.get(i, {}): p.get(j, v)) for i, c in enumerate(mb.calls)]
    mb.carries = carry.Carries(mb.calls)
    mb.fed = {(carry.PREFIX, k + 1): v for k, v in enumerate(arrays)}


def prefix_grads(model: nn.Module, inputs: mx.array, cotangent: mx.array, fed=None) -> Dict[str, mx.array]:
    """{full name: gradient} of the adapters outside the blocks through the
    embedding output h0 of `inputs`, for the cotangent dL/dh0, and through
    the block call arguments they change (Prefix.feeds), for `fed`: the
    cotangents the blocks left for them ({ref: [cotangent]}, carry_prefix's
    refs)."""
    from . import step

    names, params = trainable(model)
    feeds = prefix(model).feeds
    fed = fed or {}
    # (every argument has a consumer in the sweep, which runs down to block
    # 0 without a tail: the step's carries.crosses)
    cots = [cotangent, *(fed[(carry.PREFIX, k + 1)][0] for k in range(len(fed)))]

    def f(*values):
        with bound(model, names, values):
            h0, calls = step.record_calls(model, inputs)
        arrays = _fed(calls, feeds)[0] if feeds else []
        if len(arrays) != len(fed):
            raise RuntimeError(f"{len(fed)} cotangents for {len(arrays)} call arguments made before block 0")
        # (MLX's vjp takes one cotangent per distinct output array: an
        # argument that is h0 itself, talkie's e_x, goes out as a copy.)
        return [h0, *(v + 0 if v is h0 else v for v in arrays)]

    _, grads = mx.vjp(f, params, cots)
    return dict(zip(names, grads))


def add(total: Dict[str, mx.array], grads: Dict[str, mx.array]) -> None:
    """Sums `grads` into `total`, by name."""
    for name, g in grads.items():
        total[name] = g if name not in total else total[name] + g


# ---- Their dropout (the module's docstring) ----------------------------


class _Drawing:
    """What a model's OutsideDropouts draw from, shared by them."""

    def __init__(self, model: nn.Module, found: List[Tuple[str, nn.Dropout]]):
        self.model = weakref.ref(model)
        self.found = found  # (full name, the nn.Dropout stood in for)
        self.stand_ins: List["OutsideDropout"] = []  # theirs, in the same order (install_dropouts)
        self.draws: Optional[dropout.OutsideDraws] = None  # a step's, for one micro-batch (drawing)
        self.at = 0  # the next call's index in draws.forward (new_call resets it)
        self.window: Optional[Tuple[int, int, int]] = None  # a head chunk's tokens (window)
        self.log: Optional[Tuple[List[int], List[int]]] = None  # counting: (blocks called at each draw, blocks called)
        self.counts: Dict[tuple, Tuple[int, int]] = {}  # dropout_calls per input shape
        self.own = mx.random.key(0)  # the key of the masks drawn outside a step
        # The whole masks the current model call (and a head's later chunks)
        # took theirs of (dropout.mask's cache; new_call, drawing)
        self.masks: dict = {}

    def mask(self, p_keep: float, x: mx.array) -> Optional[mx.array]:
        if self.log is not None:
            self.log[0].append(self.log[1][0])
            return None
        d = self.draws
        if d is None:
            # (of a head chunk's, the whole sequence's, as the step's: the
            # planner's probes measure what the step holds)
            return dropout.mask(p_keep, self.own, x, None, self.window, self.masks)
        j, self.at = self.at, self.at + 1
        if j >= len(d.forward):
            raise RuntimeError(
                f"a model call drew {j + 1} dropout masks outside the blocks, where its counted calls draw "
                f"{len(d.forward)}"
            )
        return dropout.mask(p_keep, d.forward[j], x, d, self.window, self.masks)


class OutsideDropout(nn.Dropout):
    """Stands in for an active nn.Dropout of an adapter outside the blocks:
    the same arithmetic, its mask from the model's _Drawing."""

    def __init__(self, p_keep: float, drawing: _Drawing):
        super().__init__(1 - p_keep)
        self._p_1 = p_keep  # (exactly: 1 - (1 - p) need not be p)
        self._drawing = drawing

    def __call__(self, x):
        if self._p_1 == 1 or not self.training:
            return x
        mask = self._drawing.mask(self._p_1, x)
        return x if mask is None else (mask * x) * (1 / self._p_1)


# id(model) -> its _Drawing, while its dropouts are OutsideDropouts
_DRAWING: Dict[int, _Drawing] = {}


def _drawing(model: nn.Module) -> Optional[_Drawing]:
    d = _DRAWING.get(id(model))
    return d if d is not None and d.model() is model else None


def install_dropouts(model: nn.Module) -> bool:
    """Makes the dropouts of the adapters outside the blocks that draw
    masks (p > 0) OutsideDropouts, until restore_dropouts (none: the model
    is left as it is, and the modules are not looked for again until
    then). Once for a model: a second call changes nothing (False)."""
    if _drawing(model) is not None:
        return False
    found = [(n, m) for n, m in modules(model) if type(m) is nn.Dropout and m._p_1 < 1]
    drawing = _Drawing(model, found)
    modules_ = dict(model.named_modules())
    for name, m in found:
        stand_in = OutsideDropout(m._p_1, drawing)
        stand_in.train(m.training)
        drawing.stand_ins.append(stand_in)
        dropout.put(modules_, name, stand_in)
    _DRAWING[id(model)] = drawing
    return True


def restore_dropouts(model: nn.Module) -> None:
    """Puts back the nn.Dropouts install_dropouts stood in for (their
    training mode the stand-ins')."""
    drawing = _drawing(model)
    if drawing is None:
        return
    modules_ = dict(model.named_modules())
    for (name, m), stand_in in zip(drawing.found, drawing.stand_ins):
        m.train(stand_in.training)
        dropout.put(modules_, name, m)
    del _DRAWING[id(model)]


@contextmanager
def dropouts(model: nn.Module):
    """install_dropouts for the duration, where they are not already (a
    model in evaluation mode draws no masks: left alone)."""
    installed = model.training and install_dropouts(model)
    try:
        yield
    finally:
        if installed:
            restore_dropouts(model)


def with_dropouts(fn):
    """fn(model, ...) run within dropouts(model)."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        with dropouts(model):
            return fn(model, *args, **kwargs)

    return run


def _training(model: nn.Module) -> Optional[_Drawing]:
    """The model's _Drawing where an OutsideDropout of it draws masks."""
    d = _drawing(model)
    return d if d is not None and any(s.training for s in d.stand_ins) else None


@contextmanager
def drawing(model: nn.Module, draws: Optional[dropout.OutsideDraws]):
    """The model calls within draw their masks outside the blocks from
    `draws` (dropout.Plan.outside's, for one micro-batch; None: as they
    were)."""
    d = _drawing(model)
    if d is None or draws is None:
        yield
        return
    before = d.draws, d.at
    d.draws, d.at = draws, 0
    d.masks.clear()
    try:
        yield
    finally:
        (d.draws, d.at), d.masks = before, {}


@contextmanager
def _own_keys(model: nn.Module):
    """The model calls within draw their masks from the key of their own,
    whatever step they run in."""
    d = _drawing(model)
    if d is None:
        yield
        return
    before = d.draws, d.window
    d.draws, d.window = None, None
    try:
        yield
    finally:
        d.draws, d.window = before


def drawing_now(model: nn.Module) -> bool:
    """Whether the model calls now draw a step's masks after its blocks
    (drawing: the head's): then what runs the head is not compiled (a
    compiled graph would freeze the keys)."""
    d = _drawing(model)
    return d is not None and d.draws is not None and d.draws.after > 0


def new_call(model: nn.Module) -> None:
    """A call of the model's own ``__call__`` starts (step.record_calls,
    step.head_call): its dropouts outside the blocks take their keys from
    the first."""
    d = _drawing(model)
    if d is not None:
        d.at = 0
        if d.window is None or d.window[0] == 0:
            d.masks.clear()  # (a new sequence of head chunks, or no chunks: no mask of before is taken again)


@contextmanager
def window(model: nn.Module, t0: int, t1: int, T: int):
    """The model calls within run on tokens t0..t1 of T (a head chunk,
    step.head_chunks): their masks are those tokens of the whole
    sequence's."""
    d = _drawing(model)
    if d is None or (t0, t1) == (0, T):
        yield
        return
    before, d.window = d.window, (t0, t1, T)
    try:
        yield
    finally:
        d.window = before


def dropout_calls(model: nn.Module, inputs: mx.array) -> Tuple[int, int]:
    """(calls before block 0, calls after the last block) of the dropouts
    outside the blocks in one call of the model on `inputs`' shape (0, 0
    without any drawing masks): mlx-lm draws a mask per call. Counted on
    the model's own call with its blocks passing the hidden state through
    (nothing drawn or evaluated), once per input shape. Raises ValueError
    where one is called between blocks, whose mask mlx-lm would draw
    between the blocks' (not a pattern the step runs)."""
    from . import step

    d = _training(model)
    if d is None:
        return (0, 0)
    shape = tuple(inputs.shape)
    if shape not in d.counts:
        L, n = len(model.layers), step._outputs(model)
        called, seen = [0], []

        class _Counted(step._Pass):
            def __call__(self, *args, **kwargs):
                called[0] += 1
                return super().__call__(*args, **kwargs)

        d.log = (seen, called)
        try:
            with step.stand_ins(model, lambda i, l: _Counted(l, i, n)):
                model(mx.zeros(shape, dtype=inputs.dtype))
        finally:
            d.log = None
        between = sorted({c for c in seen if 0 < c < L})
        if between:
            raise ValueError(
                f"{step.architecture(model)}: an adapter outside the transformer blocks with dropout is called "
                f"after block {between[0] - 1}, between blocks: set lora_parameters' dropout to 0.0, or drop "
                "its key"
            )
        d.counts[shape] = (seen.count(0), seen.count(L))
    return d.counts[shape]
