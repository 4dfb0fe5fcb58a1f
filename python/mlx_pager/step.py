"""One paged training step: the math of mlx-lm's LoRA step, block by block.

mlx-lm computes ``nn.value_and_grad(model, default_loss)`` over the whole
model at once, so every block's weights are in memory together. Here the
same loss and gradients are computed with one block's weights in memory at a
time (llm.c style: forward, then backward walking the forward in reverse):

  record     run the model's own ``__call__`` with every block replaced by a
             stand-in that records its arguments (mask, cache, ...) and
             passes its input through: gives the embedding output h0 and each
             block's call arguments, for any architecture that calls its
             blocks in sequence (``model.layers``). Nothing heavy is computed:
             the rest of that graph is never evaluated.
  forward    for each block i: page it in, h[i+1] = block(h[i]), evaluate,
             keep h[i] as a checkpoint if block i is trained, page it out.
  head       the loss from h[L]: the model's ``__call__`` again, the last
             block replaced by a stand-in returning h[L], so the final norm,
             LM head and any softcapping are the model's own. The loss and
             dL/dh[L] are computed over slices of the sequence so that the
             full-vocabulary logits of the whole batch never exist at once;
             per-token losses are summed exactly as ``default_loss`` sums them.
  backward   for each trained block i, from the last: page it in, recompute
             block(h[i]) and take its vector-Jacobian product for h[i] and
             the block's adapter parameters, page it out. Blocks below the
             first trained one are never revisited (unless an embedding's
             adapter needs dL/dh0: outside.py).

With several micro-batches (gradient accumulation) every micro-batch passes
through a block while it is in memory (layer-major order), so a block is
read once per sweep per optimizer step, not once per micro-batch.

Where a block takes another's extra outputs (Gemma 4 E2B's shared keys and
values: carry.py), the forward keeps them from producer to consumer, and
the backward hands the consumer's cotangents for them to the producer.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import carry, dropout, heap, outside
from .carry import Carries
from .compiled import KEEP_SHAPES, CompiledShapes
from .layers import BlockList, NotPageable, architecture
from .stream import Stream, forward_pages


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first line (why
    a trace or a model failed, in a message or a record)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# Block class -> the position of the argument its hidden state comes in,
# where it is not the first (talkie: block(e_x, x, mask, cache)): found by
# record_calls.
_HIDDEN_AT: Dict[type, int] = {}


def _hidden_at(layer) -> int:
    return _HIDDEN_AT.get(type(layer), 0)


def _hidden_param(layer) -> Optional[str]:
    """The name of the parameter a block takes its hidden state in (the first
    one of its __call__, or the one _HIDDEN_AT names), for blocks the model
    calls by keyword (gptj: ``block(inputs=h, mask=..., cache=...)``)."""
    try:
        params = list(inspect.signature(type(layer).__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    at = _hidden_at(layer)
    return (
        params[at].name
        if len(params) > at
        and params[at].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        else None
    )


def _split_call(layer, args, kwargs):
    """(hidden state, other args, other kwargs) of a call to a block, whether
    the hidden state came positionally or by keyword. run_block calls the
    block back with the hidden state where it was: the same call."""
    at = _hidden_at(layer)
    if len(args) > at:
        return args[at], args[:at] + args[at + 1 :], kwargs
    name = _hidden_param(layer)
    if name is None or name not in kwargs:
        raise NotPageable(
            f"{_architecture_of(layer)}: a block was called without its hidden state as "
            "first argument; mlx-pager pages blocks that take the hidden state first"
        )
    kwargs = dict(kwargs)
    return kwargs.pop(name), args, kwargs


def _architecture_of(layer) -> str:
    return type(layer).__module__.rsplit(".", 1)[-1]


_Out = carry.Out  # output k >= 1 of a block, as the stand-ins return it


# How many values the blocks of a model class return (1: the hidden state
# alone), as record_calls last found it; the stand-ins return as many.
_OUTPUTS: Dict[type, int] = {}
_MAX_OUTPUTS = 4


def _outputs(model: nn.Module) -> int:
    return _OUTPUTS.get(type(model), 1)


class _Pass:
    """Stands in for a block: passes its input through untouched (with
    placeholders for any further outputs the model's blocks return)."""

    def __init__(self, layer, index: int = 0, outputs: int = 1):
        self._layer, self._index, self._n = layer, index, outputs

    def _result(self, x):
        return x if self._n == 1 else (x, *(_Out(self._index, k) for k in range(1, self._n)))

    def __call__(self, *args, **kwargs):
        return self._result(_split_call(self._layer, args, kwargs)[0])

    def __getattr__(self, name):  # e.g. layer.use_sliding, layer.is_linear
        return getattr(self._layer, name)

    @property
    def __class__(self):
        # isinstance(stand_in, BlockClass) is what the model sees when it
        # picks a block's mask by the block's class (olmo_hybrid:
        # ``isinstance(layer, FullAttentionDecoderLayer)``); isinstance
        # consults __class__ when type() does not match.
        return type(self._layer)


class _Record(_Pass):
    """Stands in for block `index`: records how it was called as
    ``calls[index] = (x, args, kwargs)`` (and as called, ``raws[index] =
    (args, kwargs)``) and returns a new array of x's value in its place
    (``outs[index]``: where the next block takes it tells which argument
    carries the hidden state; never evaluated). ``order`` gets the index of
    each call, so that record_calls can check the blocks are called once
    each, in order."""

    def __init__(self, layer, index: int, calls: list, order: list, outs: list, raws: list, outputs: int = 1):
        super().__init__(layer, index, outputs)
        self._calls, self._order, self._outs, self._raws = calls, order, outs, raws

    def __call__(self, *args, **kwargs):
        self._raws[self._index] = (args, kwargs)
        x, args, kwargs = _split_call(self._layer, args, kwargs)
        self._calls[self._index] = (x, args, kwargs)
        self._order.append(self._index)
        out = x + 0 if isinstance(x, mx.array) else x
        self._outs[self._index] = out
        return self._result(out)


class _Emit(_Pass):
    """Stands in for the last block: returns the given hidden state."""

    def __init__(self, layer, h, index: int = 0, outputs: int = 1):
        super().__init__(layer, index, outputs)
        self._h = h

    def __call__(self, *args, **kwargs):
        return self._result(self._h)


@contextmanager
def stand_ins(model: nn.Module, make):
    """Replaces each block of ``model.layers`` by ``make(i, layer)`` for the
    duration of the block, in the list the model's forward pass reads
    (layers.py), and always puts the real blocks back."""
    where = BlockList(model)
    real = where.blocks()
    try:
        where.replace([make(i, l) for i, l in enumerate(real)])
        yield
    finally:
        where.replace(real)


keyed_dropout = dropout.keyed  # (segment.py runs its blocks under it too)


@dataclass
class MicroBatch:
    """Rows of one batch, as they go through the blocks together. A batch
    too big for the budget is split into several (split_batch); each part's
    loss is divided by the token count of its whole batch (`norm`), so that
    the parts' losses and gradients sum to the batch's, as gradient
    accumulation weights them by tokens."""

    inputs: mx.array  # (B, T) token ids, batch[:, :-1]
    targets: mx.array  # (B, T), batch[:, 1:]
    mask: mx.array  # (B, T) bool, as default_loss builds it
    ntoks: mx.array  # scalar int32, mask.sum()
    h0: mx.array = None
    calls: list = field(default_factory=list)  # (args, kwargs) per block
    carries: Carries = None  # what blocks pass each other besides h (carry.py)
    norm: mx.array = None  # the whole batch's token count (ntoks when unsplit)
    # The carries a frozen prefix's sweep left for the blocks above it
    # (prefix_forward; carry.py), as {ref: value}.
    carried: dict = field(default_factory=dict)
    # The call arguments adapters outside the blocks make before block 0,
    # as carries ({ref: value}, outside.carry_prefix).
    fed: dict = field(default_factory=dict)
    # Where a batch was split to fit: its rows, and this part's first row
    # (dropout.py draws the batch's masks and takes the part's rows).
    batch_rows: Optional[int] = None
    row0: int = 0

    def __post_init__(self):
        if self.norm is None:
            self.norm = self.ntoks

    @property
    def rows(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def tokens(self) -> int:
        """Positions the blocks compute (rows x padded length)."""
        return int(self.inputs.shape[0] * self.inputs.shape[1])

    def record(self, model: nn.Module) -> None:
        """Fills h0 and calls (record_calls)."""
        self.h0, self.calls = record_calls(model, self.inputs)
        self.carries = Carries(self.calls)
        self.fed = {}
        mx.eval(self.h0, [v for _, v in tree_flatten(self.calls) if isinstance(v, mx.array)])

    @staticmethod
    def from_batch(batch: mx.array, lengths: mx.array) -> "MicroBatch":
        inputs, targets = batch[:, :-1], batch[:, 1:]
        steps = mx.arange(1, targets.shape[1] + 1)
        mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
        return MicroBatch(inputs, targets, mask, mask.sum())


def split_batch(batch: mx.array, lengths: mx.array, parts: int, shared_norm: bool = True) -> List[MicroBatch]:
    """The batch as `parts` micro-batches of consecutive rows (fewer when it
    has fewer rows), each normalised by the whole batch's token count: their
    losses and gradients add up to the batch's (default_loss's) up to float
    rounding. parts=1: the batch itself, exactly as mlx-lm computes it.
    shared_norm=False (evaluation, which weights each loss by its own
    tokens): each part is normalised by its own token count."""
    whole = MicroBatch.from_batch(batch, lengths)
    rows = batch.shape[0]
    parts = max(1, min(parts, rows))
    if parts == 1:
        return [whole]
    size = -(-rows // parts)
    out = []
    for r in range(0, rows, size):
        mb = MicroBatch.from_batch(batch[r : r + size], lengths[r : r + size])
        mb.batch_rows, mb.row0 = rows, r
        if shared_norm:
            mb.norm = whole.ntoks
        out.append(mb)
    return out


def _sequence_problem(arch: str, calls: list, order: List[int], outs: list) -> Optional[str]:
    """Why a recording's calls cannot be paged (None: they can): the
    blocks must be called once each, in order, the output of one the input
    of the next."""
    L = len(calls)
    if not order:
        return (
            f"{arch}: the forward pass never calls the blocks of model.layers "
            "(it reaches into their submodules), so they cannot be run one at a time"
        )
    if order != list(range(L)):
        repeated = sorted({i for i in order if order.count(i) > 1})
        if repeated:
            why = f"calls blocks {repeated[:4]} more than once (shared or looped blocks)"
        elif len(order) < L:
            why = f"never calls blocks {[i for i in range(L) if i not in order][:4]}"
        else:
            why = "calls its blocks out of order"
        return f"{arch}: the forward pass {why}; mlx-pager pages blocks called once each, in order"
    for i in range(1, L):
        if calls[i][0] is not outs[i - 1]:
            return (
                f"{arch}: the forward pass changes the hidden state between blocks {i - 1} and {i} "
                "(or uses a block's output otherwise), so blocks cannot be run one after the other"
            )
    return None


def _find_hidden(model: nn.Module, outs: list, raws: list) -> bool:
    """Where block 1 takes block 0's output (`outs`, the stand-ins') in
    another positional argument than the one its hidden state was taken
    from (talkie: block(e_x, x, mask, cache), its embedding output first),
    that argument's position for every block class of the model
    (_HIDDEN_AT); False where there is nothing to change."""
    layers = model.layers
    if len(layers) < 2 or raws[1] is None or outs[0] is None:
        return False
    args, kwargs = raws[1]
    at = [j for j, a in enumerate(args) if a is outs[0]]
    if len(at) != 1 or any(v is outs[0] for v in kwargs.values()) or at[0] == _hidden_at(layers[1]):
        return False
    for layer in layers:
        _HIDDEN_AT[type(layer)] = at[0]
    return True


def record_calls(model: nn.Module, inputs: mx.array, per_block_state: bool = False, **kwargs):
    """(h0, calls): the embedding output and each block's call arguments
    ``(args, kwargs)``, from running the model's own ``__call__`` on `inputs`
    with recording stand-ins for its blocks (nothing heavy is computed: the
    logits of that pass are never evaluated).

    Raises NotPageable (one line: the architecture and why) when the model
    does not reach its blocks as the paged step runs them: each block once,
    in order, the output of one the input of the next. Objects among a
    block's arguments (state the blocks share) are refused, except, with
    `per_block_state` (generation), one object per block such as its own KV
    cache. Where a block takes another's extra output, its call holds that
    output's placeholder (carry.Out): a carry, which the caller passes on
    (carry.Carries of the calls)."""
    L = len(model.layers)
    arch = architecture(model)
    saved = [(c, _attributes(c)) for c in _cache_objects(kwargs.get("cache"))]
    problem = None  # the first try's: what it raised, or why its calls cannot be paged

    def record(n: int):
        calls, order, outs, raws = [None] * L, [], [None] * L, [None] * L
        # (dropouts outside the blocks: a step's masks, or of their own; outside.py)
        with outside.dropouts(model), stand_ins(model, lambda i, l: _Record(l, i, calls, order, outs, raws, outputs=n)):
            outside.new_call(model)
            model(inputs, **kwargs)  # the logits of this pass are never evaluated
        return calls, _sequence_problem(arch, calls, order, outs), outs, raws

    before = dict(_HIDDEN_AT)

    def hidden_as_before():
        _HIDDEN_AT.clear()
        _HIDDEN_AT.update(before)

    # Blocks return the hidden state, or a tuple of it and more (the model
    # unpacks as many as its blocks return): the count last found first.
    for n in dict.fromkeys([_outputs(model), *range(1, _MAX_OUTPUTS + 1)]):
        try:
            calls, why, outs, raws = record(n)
            if why is not None and _find_hidden(model, outs, raws):
                _restore(saved)
                calls, why, outs, raws = record(n)  # the hidden state where it is
        except NotPageable:
            hidden_as_before()
            raise
        except Exception as e:
            why = e
        if why is None:
            break
        hidden_as_before()  # (where it was not what was wrong: as it was)
        problem = problem or why
        _restore(saved)  # the try's changes to the caches undone
    else:
        if isinstance(problem, str):
            raise NotPageable(problem)
        raise NotPageable(
            f"{arch}: its forward pass fails when its blocks only pass the hidden state on "
            f"({one_line(problem)}); "
            "its blocks exchange more than the hidden state"
        ) from problem
    _OUTPUTS[type(model)] = n
    owner = {}
    for i, (x, args, kwargs) in enumerate(calls):
        if i > 0 and any(v is x for v in carry.leaves((args, kwargs))):
            # (Recorded, the second place would hold the stand-in's output,
            # not the state the paged step runs the block on. Block 0 may
            # take h0 twice: talkie's e_x is its embedding output, a
            # constant of every block's call.)
            raise NotPageable(
                f"{arch}: block {i} is passed its hidden state twice, so it cannot run on its own "
                "(mlx-pager passes each block the hidden state in one argument)"
            )
        for _, v in tree_flatten((args, kwargs)):
            if v is None or isinstance(v, (mx.array, bool, int, float, str)):
                continue
            if isinstance(v, _Out):
                continue  # a carry (carry.py): the paged step passes it on
            if not per_block_state or owner.setdefault(id(v), i) != i:
                raise NotPageable(
                    f"{arch}: block {i} is passed a {type(v).__name__} besides the hidden state "
                    "(state its blocks share in the forward pass), so it cannot run on its own"
                )
    return calls[0][0], [(args, kwargs) for _, args, kwargs in calls]


def model_carries(model: nn.Module) -> Carries:
    """What the model's blocks pass each other besides the hidden state
    (carry.py), from a recording on two tokens (nothing is computed)."""
    _, calls = record_calls(model, mx.zeros((1, 2), dtype=mx.int32))
    return Carries(calls)


def _graph_forward(model: nn.Module, mb: "MicroBatch", upto: int, context) -> dict:
    """Builds the forward graph of blocks 0..upto-1 for micro-batch `mb`,
    never evaluated, whatever the frozen weights are (the store's
    placeholders, unread; recording `mb` evaluated its embedding), each
    block run inside `context(layer)`; returns the carries they make
    ({ref: value})."""
    extras, h = dict(mb.fed), mb.h0
    for i in range(upto):
        layer = model.layers[i]
        link = carry.link(mb.carries, i, extras)
        with context(layer):
            h = carry.kept(run_linked(layer, h, mb.calls[i], link), link, extras)
    return extras


def _shaped_carries(model: nn.Module, mb: "MicroBatch", upto: int) -> dict:
    """The carries blocks 0..upto-1 make for micro-batch `mb` ({ref:
    value}), from the blocks' forward graph (_graph_forward): their shapes
    and dtypes. Active dropout draws from keys of its own (MLX's global key
    sequence, whose next keys are mlx-lm's masks, is left alone)."""
    return _graph_forward(model, mb, upto, lambda layer: keyed_dropout(layer, dropout.fixed(layer)))


# model -> {input shape: each block's dropout calls} (dropout_calls)
_DROPOUT_CALLS: Dict[int, Dict[tuple, List[int]]] = {}


def dropout_calls(model: nn.Module, mb: "MicroBatch") -> List[int]:
    """Each block's calls of its active dropout modules in a forward pass on
    micro-batch `mb`'s shapes: mlx-lm draws a mask per call, and a block may
    call a LoRA layer more than once (mamba's x_proj and dt_proj, once per
    position: 2 + 2T draws a block, where one per module would be 4).
    Counted on the blocks' forward graph (_graph_forward, nothing drawn or
    evaluated), once per model and input shape."""
    memo = _DROPOUT_CALLS.get(id(model))
    if memo is None:
        memo = _DROPOUT_CALLS[id(model)] = {}
        weakref.finalize(model, _DROPOUT_CALLS.pop, id(model), None)
    shape = tuple(mb.inputs.shape)
    if shape not in memo:
        counts = []

        @contextmanager
        def count(layer):
            with dropout.counting(layer) as n:
                yield
            counts.append(n[0])

        _graph_forward(model, mb, len(model.layers), count)
        memo[shape] = counts
    return memo[shape]


def carried_sizes(model: nn.Module, length: int = 8) -> Optional[tuple]:
    """(bytes, rows, length, count): the carries (carry.py) of one sequence
    of `length` tokens, all `count` of them together, as a step's probe
    reports them (placement.Sizes.learn); None for a model without any.
    From the shapes of the blocks' forward graph (_shaped_carries)."""
    mb = MicroBatch.from_batch(mx.zeros((1, length + 1), dtype=mx.int32), mx.array([[0, length]], dtype=mx.int32))
    mb.record(model)
    if not mb.carries:
        return None
    extras = _shaped_carries(model, mb, len(model.layers))
    return carry.unique_bytes(list(extras.values())), 1, length, len(extras)


def run_block(layer: nn.Module, h: mx.array, call, keep: Tuple[int, ...] = ()):
    """The block's output hidden state: its output, or the first of the
    outputs it returns. With `keep` (output indices, carry.Carries.keep):
    (hidden state, [those outputs]), what later blocks take from it."""
    args, kwargs = call
    at = _hidden_at(layer)
    if at <= len(args):
        out = layer(*args[:at], h, *args[at:], **kwargs)
    else:  # (called by keyword)
        out = layer(*args, **{_hidden_param(layer): h}, **kwargs)
    several = isinstance(out, (tuple, list)) and out and isinstance(out[0], mx.array)
    first = out[0] if several else out
    if not isinstance(first, mx.array):
        raise NotPageable(
            f"{_architecture_of(layer)}: block {type(layer).__name__} returns "
            f"{type(out).__name__}, not the hidden state"
        )
    if not keep:
        return first
    return first, [out[k] for k in keep]


def run_linked(layer: nn.Module, h: mx.array, call, link: Optional[carry.Link]):
    """run_block with a block's carries (None: it has none): the values it
    takes in its call, and (hidden state, kept outputs) where it keeps some."""
    if link is None:
        return run_block(layer, h, call)
    return run_block(layer, h, link.fill(call), link.keep)


def head_chunks(T: int, B: int, vocab: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """Token ranges [t0, t1) so that one chunk's float32 logits for the batch
    stay under `chunk_bytes` (0 or None: one, mlx-lm's own products; a
    token's loss is its own, but the BLAS need not give a row the same bits
    in products of other row counts: OpenBLAS, hidden 896 x 151,936 tokens,
    differed by ~1e-9)."""
    if not chunk_bytes:
        return [(0, T)]
    per_token = max(1, B * vocab * 4)
    step = max(1, min(T, chunk_bytes // per_token))
    return [(t, min(T, t + step)) for t in range(0, T, step)]


def _concat(parts: List[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def head_loss_and_grad(
    model: nn.Module, mb: MicroBatch, h: mx.array, chunk_bytes: int
) -> Tuple[mx.array, mx.array, Dict[str, mx.array]]:
    """default_loss's value for this micro-batch, its gradient w.r.t. h
    (the last block's output), and those of the adapters outside the blocks
    (outside.py: the head's; {} for the usual run), computed over token
    chunks."""
    names, params = outside.trainable(model)
    ce_parts, grad_parts, out = [], [], {}
    T = h.shape[1]
    for t0, t1 in head_chunks(T, h.shape[0], _vocab_size(model), chunk_bytes):
        inputs = mb.inputs[:, t0:t1]
        targets, mask = mb.targets[:, t0:t1], mb.mask[:, t0:t1]

        def chunk_loss(hc, *values, inputs=inputs, targets=targets, mask=mask, t0=t0, t1=t1):
            with outside.bound(model, names, values), outside.window(model, t0, t1, T):
                ce = _head_ce(model, inputs, targets, mask, hc)
            return ce.astype(mx.float32).sum() / mb.norm, ce

        # (MLX returns a lone gradient bare, even for argnums=(0,).)
        argnums = tuple(range(1 + len(params))) if params else 0
        (_, ce), g = mx.value_and_grad(chunk_loss, argnums=argnums)(h[:, t0:t1], *params)
        g_h, g_p = (g[0], g[1:]) if params else (g, ())
        outside.add(out, dict(zip(names, g_p)))
        mx.eval(ce, g_h, out)
        ce_parts.append(ce)
        grad_parts.append(g_h)
    # Summed over all tokens at once, exactly as default_loss sums them.
    return _concat(ce_parts).astype(mx.float32).sum() / mb.norm, _concat(grad_parts), out


def head_loss(model: nn.Module, mb: MicroBatch, h: mx.array, chunk_bytes: int) -> mx.array:
    """default_loss's value alone (evaluation), over the same token chunks."""
    ce_parts = []
    for t0, t1 in head_chunks(h.shape[1], h.shape[0], _vocab_size(model), chunk_bytes):
        ce = _head_ce(model, mb.inputs[:, t0:t1], mb.targets[:, t0:t1], mb.mask[:, t0:t1], h[:, t0:t1])
        mx.eval(ce)
        ce_parts.append(ce)
    loss = _concat(ce_parts).astype(mx.float32).sum() / mb.norm
    mx.eval(loss)
    return loss


def head_call(model: nn.Module, inputs: mx.array, h: mx.array, **kwargs) -> mx.array:
    """The model's own ``__call__`` on `inputs` with its blocks stood in for,
    the last returning `h`: the model's head (final norm, LM head, any
    softcapping) applied to the last hidden state. What that call does to
    the cache objects among `kwargs` (generation's) outside the blocks is
    undone: the recording pass (record_calls) already did it, once, as the
    model's own call does (longcat_flash_ngram's n-gram embedding appends
    the new tokens to a cache of its own; twice, its decode diverged from
    mlx-lm's at the second token)."""
    last = len(model.layers) - 1
    saved = [(c, _attributes(c)) for c in _cache_objects(kwargs.get("cache"))]
    try:
        n = _outputs(model)
        with outside.dropouts(model), stand_ins(model, lambda i, l: _Emit(l, h, i, n) if i == last else _Pass(l, i, n)):
            outside.new_call(model)
            return model(inputs, **kwargs)
    finally:
        _restore(saved)


def _cache_objects(cache) -> list:
    """The cache objects in a model call's `cache` argument (mlx-lm's list of
    per-layer caches, CacheList's members included)."""
    if cache is None or isinstance(cache, mx.array):
        return []
    if isinstance(cache, (list, tuple)):
        return [c for x in cache for c in _cache_objects(x)]
    if not hasattr(cache, "__dict__"):
        return []
    return [cache] + _cache_objects(getattr(cache, "caches", None))


def _attributes(obj) -> dict:
    """A copy of obj's attributes, lists copied (ArraysCache sets its list's
    items in place)."""
    return _copied(vars(obj))


def _copied(attrs: dict) -> dict:
    return {k: list(v) if isinstance(v, list) else v for k, v in attrs.items()}


def _restore(saved) -> None:
    """Puts back the attributes `_attributes` took, [(obj, attrs)], each
    from a fresh copy (what is put back may be changed again, and restored
    again, from the same snapshot)."""
    for obj, attrs in saved:
        vars(obj).clear()
        vars(obj).update(_copied(attrs))


def _head_ce(model, inputs, targets, mask, h):
    """Masked per-token cross entropy of the model's head applied to h."""
    return nn.losses.cross_entropy(head_call(model, inputs, h), targets) * mask


# Only sizes the head's chunks when a model names no vocabulary and has no
# embedding to measure.
_FALLBACK_VOCAB = 32000


def _vocab_size(model: nn.Module) -> int:
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    if v is None:
        v = next(
            (
                m.weight.shape[0]
                for _, m in model.named_modules()
                if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
            ),
            _FALLBACK_VOCAB,
        )
    return int(v)


def _trainable_names(layer: nn.Module) -> List[str]:
    return [k for k, _ in tree_flatten(layer.trainable_parameters())]


def block_vjp(
    layer: nn.Module, h: mx.array, call, cotangent: mx.array, link: Optional[carry.Link] = None, extra_cots=()
):
    """Recomputes the block at h and returns (dL/dh, {adapter name:
    dL/dparam}, dL/dcarried) for the cotangent dL/d(block output). With a
    `link`: the block takes its carries' values; dL/dcarried are the
    cotangents of the differentiable leaves (carry.diff_leaves order) of
    those it learns (link.learns()), a seeded one's (link.seeds) including
    what was pending for it; `extra_cots` are the cotangents of the
    differentiable leaves of its kept outputs (link.keep)."""
    names = _trainable_names(layer)
    params = [v for _, v in tree_flatten(layer.trainable_parameters())]
    values = link.values if link is not None else []
    keep = link.keep if link is not None else ()
    learn = link.learns() if link is not None else ()
    seeds = link.seeds if link is not None and link.seeds is not None else [None] * len(values)
    groups = [carry.diff_leaves(v) if wanted else [] for v, wanted in zip(values, learn)]
    cin = [x for g in groups for x in g]
    n = len(cin)
    seed_cots = [c for seed in seeds if seed is not None for c in seed]

    def f(x, *rest):
        layer.update(tree_unflatten(list(zip(names, rest[n:]))))
        vals, seeded, at = [], [], 0
        for v, g, seed in zip(values, groups, seeds):
            tracers, at = list(rest[at : at + len(g)]), at + len(g)
            vals.append(carry.with_diff_leaves(v, tracers) if g else v)
            if seed is not None:
                seeded.extend(tracers)
        c = link.fill(call, vals) if values else call
        if not keep:
            out, more = run_block(layer, x, c), []
        else:
            out, extras = run_block(layer, x, c, keep)
            more = carry.diff_leaves(extras)
        outs, seen = [out], {id(out)}
        for v in [*more, *seeded]:
            if id(v) in seen:
                v = v + 0  # MLX's vjp takes one cotangent per distinct output array
            seen.add(id(v))
            outs.append(v)
        return outs

    try:
        _, grads = mx.vjp(f, [h, *cin, *params], [cotangent, *extra_cots, *seed_cots])
    finally:
        layer.update(tree_unflatten(list(zip(names, params))))  # drop tracers
    return grads[0], dict(zip(names, grads[1 + n :])), list(grads[1 : 1 + n])


def _link_key(link: Optional[carry.Link]) -> tuple:
    """What of a block's carries (carry.Link) shapes its compiled function:
    those it takes, keeps, differentiates and is seeded with."""
    if link is None:
        return ()
    seeds = tuple(s is not None for s in link.seeds) if link.seeds is not None else None
    return (link.carries.takes(link.block), link.keep, link.learn, seeds)


class Blocks:
    """Runs model.layers[i] forward and backward, each compiled with
    mx.compile once per block (as mlx-lm compiles its step, so elementwise
    ops fuse; the results are the same bits). The block's weights are inputs
    of the compiled function, never constants: they are new arrays each time
    the page comes in. Blocks with active dropout run uncompiled (a compiled
    graph would freeze the dropout key), and so does a block that mx.compile
    cannot trace (dbrx's router evaluates arrays inside the block): the
    failure is remembered and the block runs as mlx-lm runs it, uncompiled,
    from then on (``uncompiled`` lists those blocks and why). `compile_tail`:
    the tail segment too (segment.Tail; jit.tail_compile_refused says where
    its compile does not fit the memory limit)."""

    def __init__(
        self, model: nn.Module, compile: bool = True, compile_tail: bool = True, keep_shapes: int = KEEP_SHAPES
    ):
        from .segment import Tail

        self.model, self.compile = model, compile
        # The compiled functions, per input shape (the hidden state's), for
        # a bounded number of shapes (compiled.py): ("fwd", i, link), ("bwd", i, link),
        # and the tail's.
        self.fns = CompiledShapes(keep_shapes)
        # (block, _link_key) -> its kept outputs' template (carry.template),
        # as the compiled function of that key was traced
        self._extras: Dict[tuple, object] = {}
        self.uncompiled: Dict[int, str] = {}  # block -> why it runs uncompiled (mx.compile failed, run_uncompiled)
        # Forward blocks in parts that ran bound whole (their pages all
        # acquired before the block's graphs and held to their end: several
        # micro-batches), in the order run, since the caller last
        # cleared it; the others read their parts lazily. A measured step's
        # accesses take them as one access of all their pages
        # (simulate.accesses_from_marks `whole`).
        self.bound_whole: List[int] = []
        self.tail = Tail(model, compile and compile_tail, self.fns)  # the no-recompute tail segment (segment.py)

    def drop_compiled(self) -> bool:
        """Lets go of every compiled function (the blocks' and the tail's),
        which are built again as they are next used; False where none is
        held. MLX keeps a compiled function's traced graph for each input
        shape it met, in its own heap outside the arrays' memory, until the
        function is freed: graphs of shapes and placements a run has moved
        on from stay (a 35-block E2B-style model: 119 -> 212 MB outside MLX
        over 4 steps whose placement changed twice, 124 MB uncompiled).
        Freed (with gc and malloc_trim after the last reference goes), the
        memory comes back."""
        return self.fns.clear()

    def drop_stale(self) -> bool:
        """Lets go of the compiled functions of every input shape but the one
        used last (the governor's rung before it takes pages: a shape met
        again is traced again); False where no other shape is held."""
        return self.fns.drop_stale()

    def stop_compiling(self) -> bool:
        """Runs every block and the tail uncompiled from now on (the
        governor's last rung, where even the current shapes' compiled graphs
        do not fit). False if already so."""
        if not self.compile and not self.tail.compile:
            return False
        self.compile, self.tail.compile = False, False
        self.drop_compiled()
        return True

    def run_uncompiled(self, blocks, why: str) -> None:
        """Runs `blocks` uncompiled from now on (`why`: one line), and the
        tail segment, which may hold them, too."""
        for i in blocks:
            self.uncompiled[i] = why
        self.fns.discard(lambda name: name[0] in ("fwd", "bwd") and name[1] in self.uncompiled)
        self.tail.uncompiled = self.tail.uncompiled or why

    def _compiled(self, i: int, fn, *args):
        """fn(*args) compiled; None when the block cannot be compiled (the
        trace failed), after which the caller runs it uncompiled."""
        if i in self.uncompiled:
            return None
        try:
            return fn(*args)
        except Exception as e:
            # A trace that fails (an eval or .item() inside the block, an
            # argument compile cannot take) fails before running anything;
            # running the block uncompiled raises any error of its own again.
            self.uncompiled[i] = one_line(e)
            self.fns.discard(lambda name: name[0] in ("fwd", "bwd") and name[1] == i)
            return None

    def forward(self, i: int, h: mx.array, call, key=None, link: Optional[carry.Link] = None):
        """Block i's output hidden state; with a `link` that keeps outputs,
        (hidden state, [kept outputs])."""
        layer = self.model.layers[i]
        keep = link.keep if link is not None else ()
        with keyed_dropout(layer, key) as drops:
            if drops or not self.compile or i in self.uncompiled:
                return run_linked(layer, h, call, link)
        shapes = self._extras
        carries = link.carries if link is not None else None  # (not the link: its values are this call's)
        name = ("fwd", i, _link_key(link))

        def fwd(h, params, values, args, kwargs):
            layer.update(params)
            c = carries.fill(i, (args, kwargs), values) if carries is not None else (args, kwargs)
            if not keep:
                return run_block(layer, h, c)
            out, extras = run_block(layer, h, c, keep)
            # A compiled function returns arrays only, and a copy of an
            # input it passes through: the template keeps both apart.
            inputs = carry.array_leaves(values)
            shapes[name[1:]] = carry.template(extras, inputs)
            return [out, *carry.new_arrays(extras, inputs)]

        # (Keyed by the carries it takes and keeps too: the compiled function
        # fills them in from its closure's. An evaluation takes none where
        # training takes what adapters outside the blocks make, carry.PREFIX:
        # an evaluation's function, reused, ran training's blocks without
        # their per-layer inputs.)
        fn = self.fns.get(tuple(h.shape), name, fwd)
        params = layer.parameters()
        values = link.values if link is not None else []
        bare = link.carries.strip(i, call) if link is not None else call
        try:
            out = self._compiled(i, fn, h, params, values, *bare)
        finally:
            layer.update(params)  # tracing left tracers in the module
        if out is None:
            return run_linked(layer, h, call, link)
        if not keep:
            return out
        return out[0], carry.with_array_leaves(self._extras[name[1:]], out[1:], carry.array_leaves(values))

    def vjp(
        self, i: int, h: mx.array, call, cotangent: mx.array, key=None, link: Optional[carry.Link] = None, extra_cots=()
    ):
        """(dL/dh, {adapter name: grad}, dL/dcarried): block_vjp, compiled."""
        layer = self.model.layers[i]
        with keyed_dropout(layer, key, backward=True) as drops:
            if drops or not self.compile or i in self.uncompiled:
                return block_vjp(layer, h, call, cotangent, link, extra_cots)
        names = _trainable_names(layer)
        # (Not the link: its values and seeds are this call's.)
        carries = link.carries if link is not None else None
        keep = link.keep if link is not None else ()
        learn = link.learns() if link is not None else ()

        def bwd(h, params, cotangent, values, extra_cots, seeds, args, kwargs):
            layer.update(params)
            lk = None if carries is None else carry.Link(carries, i, values, keep, learn, seeds)
            g_h, g_p, g_c = block_vjp(layer, h, (args, kwargs), cotangent, lk, extra_cots)
            return g_h, [g_p[n] for n in names], g_c

        fn = self.fns.get(tuple(h.shape), ("bwd", i, _link_key(link)), bwd)
        params = layer.parameters()
        values = link.values if link is not None else []
        seeds = link.seeds if link is not None and link.seeds is not None else [None] * len(values)
        bare = link.carries.strip(i, call) if link is not None else call
        try:
            out = self._compiled(i, fn, h, params, cotangent, values, list(extra_cots), seeds, *bare)
        finally:
            layer.update(params)
        if out is None:
            return block_vjp(layer, h, call, cotangent, link, extra_cots)
        g_h, grads, g_c = out
        return g_h, dict(zip(names, grads)), g_c


def probe_block(model: nn.Module, weights, block: int, rows: int, length: int, blocks=None) -> int:
    """MLX's peak memory for block `block`'s forward + vector-Jacobian
    product on a micro-batch of `rows` x `length` tokens (over the memory
    active before it), and the C heap its graph held once built (graph
    nodes: heap.py, per token in a block that loops over them): what the
    placement planner needs before the first step, measured rather than
    guessed. The block's page is read for it.
    A block that takes carries (carry.py) takes zeros of their shapes
    (_shaped_carries: the blocks below it are not read). `blocks` (a
    Blocks): run as it runs the block (compiled where it compiles);
    without, uncompiled."""
    return _probe(model, weights, block, rows, length, backward=True, blocks=blocks)


def probe_forward(model: nn.Module, weights, block: int, rows: int, length: int) -> int:
    """probe_block's measure for the block's forward alone (no graph kept):
    what an evaluation sweep's block takes."""
    return _probe(model, weights, block, rows, length, backward=False)


def _probe(model: nn.Module, weights, block: int, rows: int, length: int, backward: bool, blocks=None) -> int:
    mb = probe_batch(model, rows, length)
    link = None
    if mb.carries.takes(block):
        shaped = _shaped_carries(model, mb, block)
        zeros = [
            carry.map_leaves(shaped[r], lambda j, v: mx.zeros(v.shape, v.dtype) if isinstance(v, mx.array) else v)
            for r in mb.carries.takes(block)
        ]
        link = carry.Link(mb.carries, block, zeros)
        mx.eval(zeros)
    h = mb.h0
    with weights.bound(block), gc_paused():
        mx.eval(h)
        base = mx.get_active_memory()
        heap_start = heap.in_use()
        mx.reset_peak_memory()
        layer = model.layers[block]
        if backward and blocks is not None:  # (it draws from the key it is given)
            out = blocks.vjp(block, h, mb.calls[block], mx.ones_like(h), dropout.fixed(layer), link)
        else:
            with keyed_dropout(layer, dropout.fixed(layer)):  # mlx-lm's key sequence untouched
                if backward:
                    out = block_vjp(layer, h, mb.calls[block], mx.ones_like(h), link)
                else:
                    out = run_linked(layer, h, mb.calls[block], link)
        graph = heap.grown_since(heap_start)  # built, not yet run (heap.py)
        mx.eval(out)
        used = max(0, mx.get_peak_memory() - base) + graph
        del out
    mx.reset_peak_memory()
    return used


def probe_batch(model: nn.Module, rows: int, length: int) -> MicroBatch:
    """A micro-batch of `rows` x `length` zero tokens, recorded (h0, calls):
    the start-up probes' input."""
    batch = mx.zeros((rows, length + 1), dtype=mx.int32)
    lengths = mx.array([[0, length]] * rows, dtype=mx.int32)
    mb = MicroBatch.from_batch(batch, lengths)
    mb.record(model)
    return mb


def probe_head(model: nn.Module, rows: int, length: int) -> int:
    """MLX's peak memory for the head's loss and gradient (whole, one chunk)
    on `rows` x `length` tokens, over the memory active before it: what
    its logits and what the model does with them (Gemma 2's softcapping:
    1.5x a plain head's) take. The resident page (the head) must be bound."""
    mb = probe_batch(model, rows, length)
    h = mx.zeros(mb.h0.shape, mb.h0.dtype)  # the hidden state's shape and dtype, as the blocks pass it on
    mx.eval(h, mb.ntoks)
    used = 0
    # Twice, the larger kept: MLX frees one array before or after another's
    # peak from run to run (a Gemma 2 head on 16 tokens measured 5.0x its
    # logits once where it takes 6.0x, and a longer batch's head was then
    # planned under what it took).
    for _ in range(2):
        with gc_paused():
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            loss, g, g_out = head_loss_and_grad(model, mb, h, 0)
            mx.eval(loss, g, g_out)
            used = max(used, mx.get_peak_memory() - base)
            del loss, g, g_out
    mx.reset_peak_memory()
    return used


def first_trained_block(model: nn.Module) -> int:
    """Index of the lowest block the backward sweep differentiates: the
    lowest with trainable parameters (first_adapted_block), or 0 where an
    adapter outside the blocks makes the embedding output (outside.py)."""
    if outside.trains_prefix(model):
        return 0
    return first_adapted_block(model)


def first_adapted_block(model: nn.Module) -> int:
    """Index of the lowest block with trainable parameters (len(layers) if none)."""
    for i, layer in enumerate(model.layers):
        if tree_flatten(layer.trainable_parameters()):
            return i
    return len(model.layers)


def page_room(weights) -> int:
    """The pager's budget less what its pinned pages are charged now: the
    room pages have (the governor moves the budget)."""
    return int(weights.pager.budget) - int(weights.pager.stats()["pinned_bytes"])


def holds_tail(weights, tail_start: int, page_budget: int) -> bool:
    """Whether a tail segment starting at `tail_start` is held: bound for
    the tail's duration (ordinary arrays, one read per step, a compiled
    vjp: segment.Tail) rather than streamed (stream.py). It is where
    `page_budget` holds the tail's pages together and, beside them, the
    largest other block: then the pages stay resident from one step to the
    next whichever way the tail runs (MIN keeps them; the other blocks
    stream through the rest), so holding them reads nothing more. With less
    room a held tail would evict its own pages for the blocks below it and
    read them again, all at once, before its graph could start."""
    L = weights.num_blocks
    if tail_start >= L:
        return False
    other = max((weights.block_charge_bound(i) for i in range(tail_start)), default=0)
    return sum(weights.block_charge_bound(i) for i in range(tail_start, L)) + other <= page_budget


def step_pages(
    weights,
    first_trained: int,
    tail_start: Optional[int],
    micro_batches: int = 1,
    after=None,
    held: bool = False,
    prefix: bool = True,
) -> List[int]:
    """The page ids of one training step in the order it acquires them:
    forward, then backward down to the first trained block, each block's
    pages in order. With a tail segment starting at s, blocks s..L-1 are
    read forward then backward (streamed, stream.py: the pages
    backward_pages names) once per micro-batch, or, `held` (holds_tail),
    bound once for all micro-batches; the backward sweep below starts at
    s-1. `after(i)`: pages acquired right after block i's in the backward
    sweep (its spilled checkpoints). `prefix=False`: a step whose frozen
    prefix ran ahead (prefix.py): its forward starts at the first trained
    block."""
    from .stream import backward_pages

    L = weights.num_blocks
    s = L if tail_start is None else max(first_trained, min(L, tail_start))
    pages = weights.block_pages
    ids = [p for i in range(0 if prefix else first_trained, s) for p in pages[i]]
    tail = [p for i in range(s, L) for p in pages[i]]
    if held:
        ids += tail
    else:
        tail += [p for i in range(L - 1, s - 1, -1) for p in backward_pages(weights, i)]
        ids += tail * micro_batches
    for i in range(s - 1, first_trained - 1, -1):
        ids += pages[i]
        ids += list(after(i)) if after is not None else []
    return ids


@outside.with_dropouts  # (their masks from the step's keys: outside.py)
def paged_value_and_grad(
    model: nn.Module,
    weights,
    micro_batches: Sequence[MicroBatch],
    head_chunk_bytes: int = 0,
    on_block=None,
    blocks: Optional[Blocks] = None,
    tail_start: Optional[int] = None,
    probe: Optional[dict] = None,
    spill=None,
    spilled: int = 0,
    hold_tail: bool = False,
    start: Optional[List[mx.array]] = None,
    grad_checkpoint: bool = False,
) -> Tuple[List[mx.array], List[mx.array], Dict[str, mx.array]]:
    """Losses and token counts per micro-batch, and the SUM over micro-batches
    of the adapter gradients, as a flat {model parameter path: grad} dict.

    `weights` is a PagedWeights; `on_block(phase, i)` is called after each
    block (for the memory governor and progress reports); `blocks` keeps the
    compiled block functions from one step to the next. `tail_start` = s:
    blocks s..L-1 and the head run as one segment, forward and backward in
    one vjp, no recompute (segment.py), its pages streamed (stream.py) or,
    `hold_tail` (holds_tail), bound together for the tail's duration;
    None or L: every trained block is checkpointed and recomputed.
    `spill` (a spill.SpillStore) and `spilled` = k: the checkpoints of the
    recomputed blocks first..first+k-1 go to the SSD after the forward
    sweep uses them and come back through the pager in the backward sweep.
    `start`: each micro-batch's input to the first trained block, computed
    ahead (prefix_forward: the frozen blocks below it do not depend on the
    adapters); the forward sweep then starts there, with the carries the
    blocks above take from below (carry.py), which prefix_forward left in
    each MicroBatch (`carried`): `micro_batches` must be the ones it ran.

    Active dropout draws mlx-lm's masks (dropout.py): the micro-batches are
    its batches in order (a split batch's parts consecutive), and
    `grad_checkpoint` (mlx-lm's --grad-checkpoint) recomputes with the new
    masks mlx-lm's checkpointed blocks draw in its backward pass. The global
    key sequence moves past the step's draws only when the step is done.

    `probe` (a dict) gets what this step measured, for the placement
    planner (placement.py), from MLX's peak-memory counter (which it
    resets; "peak" keeps the step's overall MLX peak):
      "block": (bytes, rows, length) of the largest recomputed block's
               forward + vjp on the first micro-batch (its rows and padded
               length), over the memory active before it (every recomputed
               block is measured: a hybrid model's kinds differ, kinds.py);
      "tail":  (bytes, blocks, rows, length) of the tail segment's vjp on
               the first micro-batch, likewise;
      "peak":  MLX's peak memory over the step;
      "tail_held": whether the tail's pages were held (not streamed);
      "carried": (bytes, rows, length, count) of the carries the first
               micro-batch kept through the step (carry.py).
    """
    _resume_gc()  # (a measurement an exception cut short)
    L = len(model.layers)
    first = first_trained_block(model)
    s_tail = L if tail_start is None else max(first, min(L, tail_start))
    prefixes = weights.block_prefixes
    blocks = blocks or Blocks(model)
    for mb in micro_batches:
        mb.record(model)
    # Active dropout draws from per-(block, micro-batch) keys, mlx-lm's
    # (dropout.plan), so that the backward pass's recompute sees the masks
    # it should, and so do those of the adapters outside the blocks
    # (outside.py); without it (mlx-lm's default) the global PRNG is left
    # untouched, as mlx-lm does.
    redrawn = dropout.checkpointed_blocks(model, first) if grad_checkpoint else set()
    plan = dropout.plan(
        model,
        micro_batches,
        redrawn,
        lambda mb: dropout_calls(model, mb),
        lambda mb: outside.dropout_calls(model, mb.inputs),
    )
    keys, around = plan.blocks, plan.outside
    for mb, draws in zip(micro_batches, around):
        if draws is not None and draws.before:
            with outside.drawing(model, draws):
                mb.record(model)  # h0 with the embedding's masks
        if first == 0:
            # What adapters outside the blocks change in the blocks' call
            # arguments besides h: carries made before block 0 (mb.fed).
            with outside.drawing(model, draws):
                outside.carry_prefix(model, mb)
    carries = micro_batches[0].carries
    if carries and carries.crosses(s_tail, first):
        s_tail = L  # (the planner never picks such a tail: placement.Step.tail_allowed)
    # Per micro-batch: the outputs later blocks take (carry.py), kept from
    # their producer's forward to their last consumer's backward; where the
    # prefix ran ahead, those it left for the blocks above it.
    extras: List[Dict[carry.Ref, object]] = [mb.carried if start is not None else dict(mb.fed) for mb in micro_batches]
    for mb in micro_batches:
        mb.carried = {}  # the step's now: forget() frees them as it goes

    # Forward, layer-major, up to the tail.
    if start is not None and len(start) != len(micro_batches):
        raise ValueError(f"{len(start)} prefix outputs for {len(micro_batches)} micro-batches")
    hs = list(start) if start is not None else [mb.h0 for mb in micro_batches]
    saved: Dict[int, List[mx.array]] = {}
    to_ssd = set(range(first, min(s_tail, first + spilled))) if spill is not None else set()
    held = 0  # bytes of checkpoints in memory (probe["checkpoint_bytes"], for memory traces)
    for i in range(first if start is not None else 0, s_tail):
        # A block of several pages, one micro-batch: its pages are lazy reads
        # in the block's graph (stream.forward_pages), so the later ones are
        # read while MLX computes with the first. Otherwise the block is
        # bound (read) whole before its graph runs.
        lazy = len(weights.block_pages[i]) > 1 and len(micro_batches) == 1
        if not lazy and len(weights.block_pages[i]) > 1:
            blocks.bound_whole.append(i)
        with forward_pages(weights, i, hs[0]) if lazy else _bound(weights, i) as drop:
            if i in to_ssd:
                for m, h in enumerate(hs):
                    spill.put(i, m, h)
                saved[i] = None
            elif i >= first:
                saved[i] = hs
                held += sum(h.nbytes for h in hs)
                if probe is not None:
                    probe["checkpoint_bytes"] = held
            # One micro-batch at a time: a batch split to fit keeps one
            # part's working set in memory, not all of them.
            out = []
            for m, (h, mb) in enumerate(zip(hs, micro_batches)):
                base = _measure_start(probe) if m == 0 else None
                pages = _page_bytes(weights) if base is not None else None
                link = carry.link(carries, i, extras[m])
                out.append(carry.kept(blocks.forward(i, h, mb.calls[i], keys[i][m], link), link, extras[m]))
                drop()
                if base is not None:
                    base.built()
                mx.eval(out[-1], carry.kept_arrays(link, extras[m]))
                if base is not None:
                    # One forward block's working set, less the pages read
                    # ahead meanwhile (the largest of the sweep's blocks);
                    # read lazily, the block's own pages are read inside it,
                    # the one in use at least in memory at its peak.
                    read = _pages_read(weights, pages)
                    if lazy:
                        read = max(read, max(weights.page_footprint(p) for p in weights.block_pages[i]))
                    used = max(0, _measure_end(probe, base) - read)
                    if used >= probe.get("forward", (0,))[0]:
                        probe["forward"] = (used, mb.rows, int(h.shape[1]))
            hs = out
            carry.forget(carries, extras, upto=min(i, first - 1))  # no backward needs them
        if on_block is not None:
            on_block("forward", i)
    if probe is not None and carries:
        kept, mb = list(extras[0].values()), micro_batches[0]
        probe["carried"] = (carry.unique_bytes(kept), mb.rows, mb.tokens // mb.rows, len(kept))

    grads: Dict[str, mx.array] = {}

    def add(block_grads: Dict[str, mx.array], i: int, g_p: Dict[str, mx.array]):
        for name, g in g_p.items():
            full = f"{prefixes[i]}.{name}"
            block_grads[full] = g if full not in block_grads else block_grads[full] + g

    # Where the adapters outside the blocks take gradients through the head
    # and through the embedding output both (outside.py), each micro-batch's
    # two are summed first and the micro-batches' sums then, in order, as
    # mlx-lm adds whole batches' gradients in an accumulation group (a tied
    # embedding's adapter, summed by path first: its last bits differed).
    heads: Optional[List[Dict[str, mx.array]]] = (
        [{} for _ in micro_batches] if first == 0 and outside.trains_prefix(model) else None
    )
    losses, ntoks, cots = [], [], []
    if s_tail < L:
        # The tail: blocks s..L-1 and the head in one graph per micro-batch,
        # its pages bound for all of them, or streamed through each. (Held
        # only if the pages still fit: the governor may have lowered the
        # page budget since the step began.)
        # (Not with spilled checkpoints: their pages come and go beside the
        # blocks below the tail, which holds_tail does not count.)
        tail_held = hold_tail and not to_ssd and holds_tail(weights, s_tail, page_room(weights))
        if probe is not None:
            probe["tail_held"] = tail_held
        with weights.bound(*range(s_tail, L)) if tail_held else Stream(weights, range(s_tail, L)).bound() as streamed:
            tail_grads: Dict[str, mx.array] = {}
            for m, (h, mb) in enumerate(zip(hs, micro_batches)):
                base = _measure_start(probe) if m == 0 else None
                pages = _page_bytes(weights) if base is not None else None
                with outside.drawing(model, around[m]):
                    loss, g_h, g_blocks, g_out = blocks.tail.value_and_grad(
                        s_tail, mb, h, [keys[i][m] for i in range(L)], head_chunk_bytes, streamed, extras[m]
                    )
                for i, g_p in g_blocks.items():
                    add(tail_grads, i, g_p)
                outside.add(tail_grads if heads is None else heads[m], g_out)
                if base is not None:
                    base.built()
                mx.eval(loss, tail_grads, [] if g_h is None else g_h, heads or [])
                if base is not None:
                    # The pages the tail read and kept are pages, not its
                    # working set (the plan counts them apart); so is the
                    # frame the pager keeps for its next read.
                    used = max(0, _measure_end(probe, base) - _pages_read(weights, pages))
                    probe["tail"] = (used, L - s_tail, mb.rows, int(h.shape[1]))
                losses.append(loss)
                ntoks.append(mb.ntoks)
                cots.append(g_h)
            grads.update(tail_grads)
        if on_block is not None:
            for i in range(L - 1, s_tail - 1, -1):
                on_block("tail", i)
    else:
        for m, (h, mb, draws) in enumerate(zip(hs, micro_batches, around)):
            with outside.drawing(model, draws):
                loss, g, g_out = head_loss_and_grad(model, mb, h, head_chunk_bytes)
            outside.add(grads if heads is None else heads[m], g_out)
            mx.eval(loss, g, grads, heads or [])
            losses.append(loss)
            ntoks.append(mb.ntoks)
            cots.append(g)
    del hs

    # Per micro-batch: the summed cotangents of carries whose consumers'
    # backward has run, for their producer's (its kept outputs').
    pending: List[Dict[carry.Ref, List[mx.array]]] = [{} for _ in micro_batches]
    for i in range(s_tail - 1, first - 1, -1):
        kept = saved.pop(i)
        if kept is not None:
            held -= sum(h.nbytes for h in kept)
            if probe is not None:
                probe["checkpoint_bytes"] = held
        with weights.bound(i), _checkpoints(kept, spill, i, len(micro_batches)) as ins:
            del kept
            new_cots, block_grads = [], {}
            for m, (h, mb) in enumerate(zip(ins, micro_batches)):
                base = _measure_start(probe) if m == 0 else None
                link = carry.link(carries, i, extras[m], pending[m], first)
                extra = [g for k in (link.keep if link else ()) for g in pending[m].pop((i, k))]
                g_h, g_p, g_c = blocks.vjp(i, h, mb.calls[i], cots[m], keys[i][m], link, extra)
                if base is not None:
                    base.built()
                    mx.eval(g_h, g_p)
                    took = _measure_end(probe, base)
                    if took >= probe.get("block", (-1,))[0]:
                        probe["block"] = (took, mb.rows, int(h.shape[1]))
                new_cots.append(g_h)
                add(block_grads, i, g_p)
                if link is not None:
                    carry.add_cotangents(link, g_c, pending[m])
                if len(micro_batches) > 1:
                    # One micro-batch at a time, as the forward sweep: the
                    # plan holds one part's working set. Evaluated together,
                    # the parts' graphs ran side by side (DoRA, 8 parts: the
                    # block's peak 3x one part's, the step 7% over budget).
                    # The gradients sum in the same order: the same bits.
                    mx.eval(g_h, block_grads, list(pending[m].values()))
            h = None  # no reference to a checkpoint outlives its block
            cots = new_cots
            mx.eval(cots, block_grads, [list(p.values()) for p in pending])
            grads.update(block_grads)
            carry.forget(carries, extras, down_to=i)  # their consumers' backward is done
        if on_block is not None:
            on_block("backward", i)
    if heads is not None:
        # dL/dh0, and the cotangents of the call arguments they made
        # (carry.PREFIX's), to the adapters that make the embedding output
        # (outside.py).
        for m, mb in enumerate(micro_batches):
            fed = {r: c for r, c in pending[m].items() if r[0] == carry.PREFIX}
            with outside.drawing(model, around[m]):
                outside.add(heads[m], outside.prefix_grads(model, mb.inputs, cots[m], fed))
            outside.add(grads, heads[m])
            heads[m] = {}
            mx.eval(grads)
    if probe is not None:
        probe["peak"] = max(probe.get("peak", 0), mx.get_peak_memory())
    dropout.advance(plan.draws)
    return losses, ntoks, grads


@contextmanager
def _bound(weights, block: int):
    """weights.bound(block), yielding a `drop` that does nothing (the block's
    arrays stay in the model until the block is unbound)."""
    with weights.bound(block):
        yield lambda: None


@contextmanager
def _checkpoints(kept: Optional[List[mx.array]], spill, block: int, n: int):
    """Block `block`'s checkpoints for its backward: those kept in memory,
    or (None) its spilled ones, read back through the pager and released
    and dropped afterwards."""
    if kept is not None:
        yield kept
        return
    got = []
    try:
        for m in range(n):
            got.append(spill.get(block, m))
        yield got
    finally:
        held = len(got)
        got.clear()  # the caller's name for the list too: the arrays go before their pages
        for m in range(held):
            spill.release(block, m)


def _page_bytes(weights) -> tuple:
    """The pager's resident bytes and its kept frame's, now."""
    return weights.pager.stats()["resident_bytes"], weights.pager.kept_frame_bytes()


def _pages_read(weights, before: tuple) -> int:
    """Bytes of pages (and kept frame) gained since `before` (_page_bytes):
    pages, not a working set, when a peak is measured."""
    return sum(max(0, now - then) for now, then in zip(_page_bytes(weights), before))


_GC_PAUSED = False  # _measure_start paused the cycle collector


@contextmanager
def gc_paused():
    """Python's cycle collector paused for a measured window (the start-up
    probes'): arrays it would free inside it (cyclic garbage holding them)
    lower the memory under the window's start, and the peak over the start
    under-counts the block (_measure_start). CI, 880 tests into a run: a
    MoE block probed at 77% of its twin's, below the kinds test's 80%."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _resume_gc() -> None:
    global _GC_PAUSED
    if _GC_PAUSED:
        _GC_PAUSED = False
        gc.enable()


@dataclass
class _Window:
    """One measured stretch of a step (_measure_start): MLX's active memory
    at its start, and the C heap's bytes in use (heap.py), then what the
    stretch's lazy graph held there once built (built())."""

    mlx: int
    heap_start: Optional[int]
    graph: int = 0

    def built(self) -> None:
        """The stretch's graph is built, not yet run: what it holds in the
        heap (graph nodes; per token where a block loops over them), which
        MLX's peak does not count, is taken now."""
        self.graph = heap.grown_since(self.heap_start)


def _measure_start(probe: Optional[dict]) -> Optional[_Window]:
    """Starts measuring a peak: MLX's active memory now and the heap's
    (None: no probe). The step's peak so far is kept in probe["peak"]
    before the reset.

    Python's cycle collector waits until _measure_end: arrays it frees
    inside the window (cyclic garbage that holds them: an earlier model's
    compiled tail, a failed try's frames) lower the memory under the
    start, and a peak over the start less them under-counts the block (CI,
    after 400 tests: a recomputed block measured 0 bytes). A window an
    exception left open is closed at the next step's start."""
    global _GC_PAUSED
    if probe is None:
        return None
    if gc.isenabled():
        gc.disable()
        _GC_PAUSED = True
    probe["peak"] = max(probe.get("peak", 0), mx.get_peak_memory())
    mx.reset_peak_memory()
    return _Window(mx.get_active_memory(), heap.in_use())


def _measure_end(probe: dict, window: _Window) -> int:
    """MLX's peak over the window's start, plus the heap its graph held
    (window.built(), where it was called before the graph ran)."""
    peak = mx.get_peak_memory()
    _resume_gc()
    probe["peak"] = max(probe.get("peak", 0), peak)
    return max(0, peak - window.mlx) + window.graph


def prefix_forward(
    model: nn.Module,
    weights,
    micro_batches: Sequence[MicroBatch],
    on_block=None,
    blocks: Optional[Blocks] = None,
) -> List[mx.array]:
    """Each micro-batch's input to the first trained block: the frozen
    blocks below it run forward, layer-major (each block read once for all
    the micro-batches), each micro-batch on its own through the same
    compiled block functions a step runs, so the outputs are a step's own,
    bit for bit. The carries the blocks above take from the prefix
    (carry.py) are left in each micro-batch (`carried`). The micro-batches may belong to several steps to come
    (prefix.py): these blocks have no adapters, so their outputs do not
    depend on the updates in between. `on_block("forward", i)` after each
    block."""
    return _forward_sweep(model, weights, micro_batches, first_trained_block(model), on_block, "forward", blocks)


def _forward_sweep(model, weights, micro_batches, upto: int, on_block, phase: str, blocks: Optional[Blocks]):
    """The micro-batches' hidden states after blocks 0..upto-1, forward
    only, layer-major (each block read once for all of them), each
    micro-batch through a block on its own; `on_block(phase, i)` after each
    block.

    Never several as one batch (concatenated along the rows: a larger
    matrix product, faster per row on a CPU): MLX does not promise a row
    the same bits in a product of more rows, and on the CPU backend it
    does not give them. Two micro-batches of 32 positions together gave
    other bits than alone in 1 to 76 of 8192 outputs in about one block
    in seven, on the same block and shapes that gave the same bits on
    other data; a comparison made once per block and shape (as this sweep
    did) let a test loss come out 9e-6 off mlx-lm's.

    A block of several pages and one micro-batch has its pages as lazy
    reads in the block's graph (stream.forward_pages), as the step's own
    forward sweep does: a page's frame goes once the graph is done with
    it, so the pager reads the next block's first pages while MLX computes
    with this one's last (with room for one block, binding it whole left
    the disk idle for the whole of its compute). Otherwise the block is
    bound whole."""
    blocks = blocks or Blocks(model)
    for mb in micro_batches:
        mb.record(model)
    carries = micro_batches[0].carries
    extras: List[dict] = [{} for _ in micro_batches]  # carries, from producer to last consumer
    hs = [mb.h0 for mb in micro_batches]
    for i in range(upto):
        lazy = len(weights.block_pages[i]) > 1 and len(hs) == 1
        if not lazy and len(weights.block_pages[i]) > 1:
            blocks.bound_whole.append(i)
        with forward_pages(weights, i, hs[0]) if lazy else _bound(weights, i) as drop:
            out = []
            for m, (h, mb) in enumerate(zip(hs, micro_batches)):
                link = carry.link(carries, i, extras[m])
                out.append(carry.kept(blocks.forward(i, h, mb.calls[i], None, link), link, extras[m]))
                drop()
                mx.eval(out[-1], carry.kept_arrays(link, extras[m]))
        hs = out
        carry.forget(carries, extras, upto=i)
        if on_block is not None:
            on_block(phase, i)
    for mb, ex in zip(micro_batches, extras):
        mb.carried = ex  # what blocks from `upto` up take from those below (prefix_forward's step)
    return hs


def paged_loss(
    model,
    weights,
    micro_batches: Sequence[MicroBatch],
    head_chunk_bytes=0,
    on_block=None,
    blocks: Optional[Blocks] = None,
):
    """Forward only (evaluation): losses and token counts per micro-batch,
    mlx-lm's bit for bit. The blocks sweep layer-major, each micro-batch
    on its own, as the frozen prefix's sweep (_forward_sweep)."""
    hs = _forward_sweep(model, weights, micro_batches, len(model.layers), on_block, "eval", blocks)
    return [(head_loss(model, mb, h, head_chunk_bytes), mb.ntoks) for h, mb in zip(hs, micro_batches)]
