"""Carries: state a block passes to later blocks besides the hidden state.

Some architectures' blocks return more than the hidden state, and a later
block takes part of it as an argument:

  gemma4 E2B/E4B  the last layers (``num_kv_shared_layers``) take the keys
                  and values of the last earlier layer of their kind
  hunyuan (CLA)   every other layer takes the keys and values of the one
                  before it (``use_cla``)
  rwkv7           every layer takes the first layer's value residual, passed
                  on from block to block

step.record_calls finds these: its stand-ins return placeholders
(step._Out: output k of block p) for the extra outputs, and a block's
recorded call holds the placeholder where the model passes that output on.
A `Carries` is that map. Paging such a model:

  forward   block p also returns the outputs (p, k) some later block takes;
            they are kept per micro-batch (they are small: keys and values,
            not weights) and put into the consumers' calls in place of the
            placeholders (`fill`)
  backward  a consumer's vector-Jacobian product also differentiates the
            carried arrays it took from a trained producer, seeded with the
            cotangent the consumers above it left (it returns them as
            themselves), so MLX adds its uses to that sum in the order its
            autodiff of the whole model does; the producer's vjp takes the
            sum as the cotangent of its extra output. A carry is kept until
            its last consumer's backward (the recompute needs it), or, where
            only frozen blocks take it, their forward.
  tail      a no-recompute tail (segment.py) resolves carries inside its
            graph. Carries from below its start enter it as constants where
            their producer is frozen (below the first trained block: no
            gradient goes back to it); from a trained producer none may
            enter it: placement.Step.tail_allowed plans around it.
  prefix    a frozen prefix run ahead (prefix.py) leaves each micro-batch
            the carries blocks above it take (MicroBatch.carried), beside
            its hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

Ref = Tuple[int, int]  # (producing block, output index >= 1)

# The producer of what the model makes before block 0 and passes blocks
# besides the hidden state, where adapters outside the blocks change it
# (outside.carry_prefix: a per-layer input made from the embedding): it is
# trained, and its cotangents go to outside.prefix_grads.
PREFIX = -1


def trained(producer: int, first: int) -> bool:
    """Whether carries of `producer` have cotangents where training starts
    at block `first`."""
    return producer == PREFIX or producer >= first


class Out:
    """Stands in for output `k` (k >= 1) of block `block` where blocks
    return more than the hidden state (gemma4's ``h, shared_kv, offset``,
    hunyuan's ``h, shared_kv_states``): recording finds where the model
    passes it (a block's recorded call holds it there)."""

    def __init__(self, block: int, k: int):
        self.block, self.k = block, k

    @property
    def ref(self) -> Ref:
        return (self.block, self.k)

    def __repr__(self):
        return f"<output {self.k} of block {self.block}>"


def map_leaves(tree, fn: Callable, _at=None):
    """`tree` (nested lists, tuples and dicts) with each leaf replaced by
    fn(j, leaf), j the leaf's index in depth-first order; containers keep
    their types (a model may unpack a tuple it passed)."""
    at = [0] if _at is None else _at
    if type(tree) in (list, tuple):
        return type(tree)(map_leaves(t, fn, at) for t in tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(map_leaves(t, fn, at) for t in tree))
    if type(tree) is dict:  # not a dict subclass such as an nn.Module: a leaf
        return {k: map_leaves(v, fn, at) for k, v in tree.items()}
    j = at[0]
    at[0] += 1
    return fn(j, tree)


def leaves(tree) -> list:
    out = []
    map_leaves(tree, lambda j, v: out.append(v))
    return out


def differentiable(v) -> bool:
    return isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.inexact)


def diff_leaves(tree) -> List[mx.array]:
    """The leaves of `tree` autodiff can differentiate (floating arrays)."""
    return [v for v in leaves(tree) if differentiable(v)]


def with_diff_leaves(tree, new: Sequence[mx.array]):
    """`tree` with its differentiable leaves replaced by `new`, in order."""
    it = iter(new)
    return map_leaves(tree, lambda j, v: next(it) if differentiable(v) else v)


def array_leaves(tree) -> List[mx.array]:
    return [v for v in leaves(tree) if isinstance(v, mx.array)]


class _Input:
    """Marks an array leaf of a template that is input `j` passed through."""

    def __init__(self, j: int):
        self.j = j


_ARRAY = object()  # marks an array leaf of a template that is a new output


def template(tree, inputs: Sequence[mx.array] = ()):
    """`tree` with its array leaves marked: those that are one of `inputs`
    (passed through unchanged, as rwkv7's value residual is), and the new
    ones, which a compiled function returns (`new_arrays`)."""
    at = {id(v): j for j, v in enumerate(inputs)}
    return map_leaves(
        tree, lambda j, v: (_Input(at[id(v)]) if id(v) in at else _ARRAY) if isinstance(v, mx.array) else v
    )


def new_arrays(tree, inputs: Sequence[mx.array] = ()) -> List[mx.array]:
    """The array leaves of `tree` that are not among `inputs`."""
    ids = {id(v) for v in inputs}
    return [v for v in array_leaves(tree) if id(v) not in ids]


def with_array_leaves(template, new: Sequence[mx.array], inputs: Sequence[mx.array] = ()):
    """`template` with its array leaves put back: the new ones from `new`,
    in order (a compiled function's outputs, arrays only), the passed-through
    ones from `inputs` (the same arrays, not a compiled function's copies
    of them: the same memory would be counted once per copy)."""
    it = iter(new)
    return map_leaves(template, lambda j, v: next(it) if v is _ARRAY else inputs[v.j] if isinstance(v, _Input) else v)


class Carries:
    """Which block outputs later blocks take, from a recording's calls
    [(args, kwargs)] per block."""

    def __init__(self, calls: Sequence):
        # block -> [(leaf index in its call, ref)]
        self.slots: Dict[int, List[Tuple[int, Ref]]] = {}
        self.consumers: Dict[Ref, List[int]] = {}
        for i, call in enumerate(calls):
            found = []
            map_leaves(call, lambda j, v, found=found: found.append((j, v.ref)) if isinstance(v, Out) else None)
            if found:
                self.slots[i] = found
                for _, ref in found:
                    self.consumers.setdefault(ref, []).append(i)

    def __bool__(self) -> bool:
        return bool(self.consumers)

    def keep(self, block: int) -> Tuple[int, ...]:
        """The outputs of `block` later blocks take (output indices)."""
        return tuple(sorted(k for (p, k) in self.consumers if p == block))

    def takes(self, block: int) -> Tuple[Ref, ...]:
        """The carries `block` takes, in its call's order."""
        return tuple(ref for _, ref in self.slots.get(block, ()))

    def crosses(self, s: int, lowest: int = 0) -> bool:
        """Whether a carry goes from below block s to block s or above (from
        a producer at `lowest` or above)."""
        return any(trained(p, lowest) and p < s <= max(c) for (p, _), c in self.consumers.items())

    def entering(self, s: int) -> List[Ref]:
        """The carries made below block s that blocks from s up take, in a
        fixed order: a tail starting at s takes them as inputs."""
        return sorted(r for r, c in self.consumers.items() if r[0] < s <= max(c))

    def pairs(self) -> List[Tuple[int, int]]:
        """(producer, last consumer) per carry."""
        return [(p, max(c)) for (p, _), c in self.consumers.items()]

    def fill(self, block: int, call, values: Sequence):
        """Block `block`'s call with its carries `values` (in `takes`
        order) in place of their placeholders (or of what stands in for
        them: `strip`'s None)."""
        slots = self.slots.get(block)
        if not slots:
            return call
        at = {j: v for (j, _), v in zip(slots, values)}
        return map_leaves(call, lambda j, v: at[j] if j in at else v)

    def strip(self, block: int, call):
        """The call with None for its placeholders: what a compiled function
        can take (fill puts the values back)."""
        return self.fill(block, call, [None] * len(self.slots.get(block, ())))


@dataclass
class Link:
    """One call's carries (carry.py) for block `block`: the values it
    takes, in the order of `carries.takes(block)`, put in its call's
    placeholders; `keep`: its own outputs later blocks take, returned
    beside the hidden state."""

    carries: "Carries"
    block: int
    values: list
    keep: Tuple[int, ...] = ()
    # Backward: per value taken, whether its cotangent is wanted (its
    # producer is trained; None: all are), and the cotangent its later
    # consumers left for it (None: none yet). A seeded value is returned by
    # the vjp as itself, so that MLX adds this block's uses to what is
    # pending in its own order, as its autodiff of the whole model does.
    learn: Optional[Tuple[bool, ...]] = None
    seeds: Optional[list] = None

    def fill(self, call, values=None):
        return self.carries.fill(self.block, call, self.values if values is None else values)

    def learns(self) -> Tuple[bool, ...]:
        return self.learn if self.learn is not None else (True,) * len(self.values)


def link(carries: "Carries", i: int, extras: dict, pending: Optional[dict] = None, first: int = 0) -> Optional[Link]:
    """Block i's Link for one micro-batch (None: it neither takes nor keeps
    carries): the values it takes from `extras`; the outputs it keeps, or
    in the backward sweep (`pending`), those whose cotangents are pending,
    and which values it differentiates (producers from block `first` up)
    and seeds (pending ones; a value taken twice, its first place)."""
    if not carries:
        return None
    takes, keep = carries.takes(i), carries.keep(i)
    if pending is not None:
        keep = tuple(k for k in keep if (i, k) in pending)
    if not takes and not keep:
        return None
    values = [extras[r] for r in takes]
    if pending is None:
        return Link(carries, i, values, keep)
    learn = tuple(trained(r[0], first) for r in takes)
    seeds = [pending.get(r) if l and r not in takes[:k] else None for k, (r, l) in enumerate(zip(takes, learn))]
    return Link(carries, i, values, keep, learn, seeds)


def kept(out, link: Optional[Link], extras: dict):
    """The hidden state of a forward's result, its kept outputs put in
    `extras`."""
    if link is None or not link.keep:
        return out
    h, outputs = out
    for k, v in zip(link.keep, outputs):
        extras[(link.block, k)] = v
    return h


def kept_arrays(link: Optional[Link], extras: dict) -> list:
    """The arrays of the outputs a block kept (evaluated with its hidden
    state, so that no graph on its pages outlives the block)."""
    if link is None:
        return []
    return [array_leaves(extras[(link.block, k)]) for k in link.keep]


def add_cotangents(lk: Link, g_c: list, pending: dict) -> None:
    """Block lk.block's cotangents of the carries it took and learns (g_c,
    in diff_leaves order) into their producers' pending ones: a seeded one
    already holds what was pending (it replaces it), another adds to it."""
    at = 0
    for k, (ref, value, learn) in enumerate(zip(lk.carries.takes(lk.block), lk.values, lk.learns())):
        if not learn:
            continue  # a frozen producer's: no backward reaches it
        n = len(diff_leaves(value))
        part, at = g_c[at : at + n], at + n
        old = pending.get(ref)
        seeded = lk.seeds is not None and lk.seeds[k] is not None
        pending[ref] = part if seeded or old is None else [a + b for a, b in zip(old, part)]


def forget(carries: "Carries", extras: List[dict], upto: Optional[int] = None, down_to: Optional[int] = None) -> None:
    """Drops the kept carries no block needs any more: those whose consumers
    all ran forward, up to block `upto`, or backward, down to `down_to`."""
    if not carries:
        return
    for ref, consumers in carries.consumers.items():
        if (upto is not None and max(consumers) <= upto) or (down_to is not None and min(consumers) >= down_to):
            for ex in extras:
                ex.pop(ref, None)


def unique_bytes(trees) -> int:
    """Bytes of the distinct arrays among the leaves of `trees`."""
    seen = {}
    for v in array_leaves(trees):
        seen[id(v)] = v.nbytes
    return sum(seen.values())


def strip_all(carries: "Carries", calls: Sequence) -> list:
    return [carries.strip(i, c) for i, c in enumerate(calls)]
