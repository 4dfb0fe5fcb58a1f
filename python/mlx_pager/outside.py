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
autodiff gives them), and the step sums them: with one head chunk and one
micro-batch, two terms, the bits of mlx-lm's sum in any order. Where the
call arguments are fed, some cotangents sum in another order than MLX's
autodiff of the whole model (h0's uses in block 0 and in the per-layer
projection: MLX adds the projection's between block 0's ops): within float
rounding (test_outside.py: 1e-7 relative in float32).

What the step cannot do is refused, by name: an adapter outside the blocks
with an active dropout (checks.check_adapter_keys, before anything is
paged, from the run's flags; prefix(), from the modules: mlx-lm draws
its masks from the global key sequence in the model's order, which the
paged step reproduces for the blocks' adapters only, dropout.py).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import carry


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


def _owners(names: List[str]) -> List[str]:
    return sorted({n.rsplit(".", 1)[0] for n in names})


def _active_dropout(model: nn.Module, names: List[str]) -> List[str]:
    """The modules owning `names` with an active LoRA/DoRA dropout."""
    modules = dict(model.named_modules())
    return [
        o
        for o in _owners(names)
        if any(isinstance(m, nn.Dropout) and m._p_1 < 1 for _, m in modules[o].named_modules())
    ]


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
    values along random tangents, from a key of its own: the global key
    sequence is untouched). Raises ValueError, naming them, for adapters the
    step cannot train as mlx-lm does: those with an active dropout
    (checks.check_adapter_keys refuses these first, from the run's flags;
    this is the step's own guard)."""
    names, params = trainable(model)
    if not names:
        return _NONE
    cached = _PREFIX.get(id(model))
    if cached is not None and cached[0]() is model and cached[1] == tuple(names):
        return cached[2]
    from . import step

    active = _active_dropout(model, names)
    if active:
        raise ValueError(
            f"the adapters on {', '.join(active)} (outside the transformer blocks) have an active dropout: "
            "mlx-pager draws mlx-lm's dropout masks for the blocks' adapters only. Set lora_parameters' "
            "dropout to 0.0, or drop those keys"
        )
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
    found = Prefix(moved[0], feeds, tuple(last))
    recorded.clear()  # (the tracers of the recording)
    for k in [k for k, v in _PREFIX.items() if v[0]() is None]:
        del _PREFIX[k]
    _PREFIX[id(model)] = (weakref.ref(model), tuple(names), found)
    return found


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
