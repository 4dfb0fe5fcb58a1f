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
           gradients.

Each gives every such parameter a gradient (zeros where unused, as MLX's
autodiff gives them), and the step sums them: with one head chunk and one
micro-batch, two terms, the bits of mlx-lm's sum in any order.

What the step cannot do is refused, by name: an adapter outside the blocks
with an active dropout (checks.check_adapter_keys, before anything is
paged, from the run's flags; trains_prefix, from the modules: mlx-lm draws
its masks from the global key sequence in the model's order, which the
paged step reproduces for the blocks' adapters only, dropout.py), and one
that feeds a block anything besides the hidden state (trains_prefix, when
the session opens: a per-layer input made from an embedding; the blocks'
vjps give no cotangent for their call arguments).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten


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


# id(model) -> (weak reference to it, names, whether h0 depends on them):
# the structure, not the values. (A Module is a dict: not hashable.)
_PREFIX: Dict[int, Tuple[weakref.ref, tuple, bool]] = {}


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


def trains_prefix(model: nn.Module) -> bool:
    """Whether the embedding output h0 depends on adapters outside the
    blocks (an embedding's adapter): then the step differentiates the blocks
    down to block 0. Found by a forward-mode derivative of the model's own
    call up to its blocks (two distinct tokens, at random values along
    random tangents, from a key of its own: the global key sequence is
    untouched), which also tells whether they feed a block anything else.
    Raises ValueError, naming them, for adapters the step cannot train as
    mlx-lm does: those that feed a block anything else, and those with an
    active dropout (checks.check_adapter_keys refuses these first, from the
    run's flags; this is the step's own guard)."""
    names, params = trainable(model)
    if not names:
        return False
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

    def f(*values):
        with bound(model, names, values):
            h0, calls = step.record_calls(model, inputs)
        arrays = [v for _, v in tree_flatten(calls) if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)]
        return [h0, *arrays]

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

    def moved(only=None):
        """Which outputs of f move (h0 first), the tangents of `only`'s
        parameters alone where given."""
        ts = [t if only is None or n.rsplit(".", 1)[0] == only else mx.zeros_like(t) for n, t in zip(names, tangents)]
        _, tans = mx.jvp(f, primals, ts)
        return [bool(mx.any(t != 0).item()) for t in tans]

    first = moved()
    if any(first[1:]):
        culprits = [o for o in _owners(names) if any(moved(o)[1:])] or _owners(names)
        raise ValueError(
            f"the adapters on {', '.join(culprits)} (outside the transformer blocks) change what the model "
            "passes its blocks besides the hidden state, which mlx-pager cannot differentiate: drop those keys "
            "(or train them with mlx_lm.lora, which holds every weight in memory)"
        )
    for k in [k for k, v in _PREFIX.items() if v[0]() is None]:
        del _PREFIX[k]
    _PREFIX[id(model)] = (weakref.ref(model), tuple(names), first[0])
    return first[0]


def prefix_grads(model: nn.Module, inputs: mx.array, cotangent: mx.array) -> Dict[str, mx.array]:
    """{full name: gradient} of the adapters outside the blocks through the
    embedding output h0 of `inputs`, for the cotangent dL/dh0."""
    from . import step

    names, params = trainable(model)

    def f(*values):
        with bound(model, names, values):
            h0, _ = step.record_calls(model, inputs)
        return [h0]

    _, grads = mx.vjp(f, params, [cotangent])
    return dict(zip(names, grads))


def add(total: Dict[str, mx.array], grads: Dict[str, mx.array]) -> None:
    """Sums `grads` into `total`, by name."""
    for name, g in grads.items():
        total[name] = g if name not in total else total[name] + g
