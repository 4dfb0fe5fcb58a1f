"""Attention in chunks of queries: one sequence's attention without its
whole score matrix.

MLX's `mx.fast.scaled_dot_product_attention` has no fused kernel on the CPU
(and none for its VJP there): it builds every head's Tq x Tk scores, and
its gradient about three arrays of that size. At 4,096 tokens, 8 heads, that
is 537 MB a score array, and one block's forward + vjp peaks at ~1.75 GB of
MLX memory whatever the batch split: a sequence that long is refused under
a budget that would hold everything else.

`route(C)` / `query_chunks(C)` route every call of it (mlx-lm's models call it through
`mlx_lm.models.base.scaled_dot_product_attention`, which looks it up on
`mx.fast` at each call) to `chunked`, which computes the same attention a
chunk of C query rows at a time with MLX's own kernel on each chunk, and
its gradient the same way, each chunk's scores recomputed in the backward
(flash attention's order): a chunk holds C x Tk scores, and the chunks run
one after another (each made to depend on the one before with `mx.depends`:
MLX evaluates independent work side by side, and chunks built lazily would
all be live at once). With a causal mask a chunk takes only the keys its
rows can see (MLX aligns "causal" to the bottom right for Tq < Tk), so the
upper triangle is not computed at all.

Each output row is MLX's own arithmetic on that row (bit for bit where the
matrix product gives a row the same bits whatever rows it is computed
with: MLX's own CPU product does; with OpenBLAS they are ~1e-7 apart); the
keys' and values' gradients add the chunks' shares in float32, in another
order than the whole product does, so they differ from mlx-lm's in the
last bits (about 1e-7 relative). The session turns this on only where one sequence's block
does not fit the budget whole (session.open_session); everywhere else the
step keeps mlx-lm's arithmetic.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import mlx.core as mx

# The fewest query rows a chunk holds: below this each chunk's products are
# too small to keep the matrix units busy, and the chunks' count (one call
# each, forward and backward) costs more than the memory it saves.
MIN_ATTENTION_CHUNK = 32
# The least share of one block's memory chunks must save to be taken: where
# attention is a small part of the block (short sequences), the budget they
# save is small too, and mlx-lm's bits are worth more (adapters trained with
# 64-token sequences at a least budget named with chunks left mlx-lm's by
# 1.2e-4: Adam makes the keys' gradients' last bits into more).
MIN_ATTENTION_SAVING = 0.25

_original = mx.fast.scaled_dot_product_attention


def _mask_rows(mask, off: int, rows: int, tq: int):
    """The mask for query rows off..off+rows-1 (a mask that broadcasts over
    the query axis stays whole)."""
    if mask is None or isinstance(mask, str):
        return mask
    if mask.ndim >= 2 and mask.shape[-2] == tq and tq > 1:
        return mask[..., off : off + rows, :]
    return mask


def chunked(queries, keys, values, *, scale: float, mask=None, sinks=None, chunk: int, **kwargs):
    """`mx.fast.scaled_dot_product_attention` in chunks of `chunk` query rows
    (see the module's docstring); the whole call where there is only one
    chunk, or for anything it does not handle (extra keyword arguments, a
    causal mask over fewer keys than queries)."""
    tq, tk = queries.shape[-2], keys.shape[-2]
    # (a causal mask over more queries than keys: no call of mlx-lm's, and
    # a chunk's keys would need MLX's alignment for it: MLX's own call)
    if tq <= chunk or kwargs or (isinstance(mask, str) and (mask != "causal" or tq > tk)):
        return _original(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    mask_array = mask if isinstance(mask, mx.array) else None
    offsets = list(range(0, tq, chunk))

    def chunk_of(off, m):
        """(rows, keys, mask) of the chunk at query row `off`: with a causal
        mask (aligned to the bottom right) only the keys up to its last
        row; `m` the mask array as traced (None: `mask` as given)."""
        rows = min(chunk, tq - off)
        n = min(tk, off + rows + tk - tq) if mask_array is None and mask is not None else tk
        return rows, n, mask if mask_array is None else _mask_rows(m, off, rows, tq)

    @mx.custom_function
    def attend(q, k, v, m, s):
        outs = []
        for off in offsets:
            if outs:  # (each input: MLX would copy every chunk's keys at once)
                q, k, v = mx.depends([q, k, v], [outs[-1]])
            rows, n, kmask = chunk_of(off, m)
            outs.append(
                _original(q[..., off : off + rows, :], k[..., :n, :], v[..., :n, :], scale=scale, mask=kmask, sinks=s)
            )
        return mx.concatenate(outs, axis=-2)

    @attend.vjp
    def attend_vjp(primals, cotangent, output):
        q, k, v, m, s = primals
        # An additive mask can be a function of the inputs (DeepSeek V3's
        # MLA passes its rotary scores as the mask): it has a gradient too.
        mask_grad = m is not None and mx.issubdtype(m.dtype, mx.floating)
        by_rows = m is not None and _mask_rows(m, 0, 1, tq) is not m
        dk = mx.zeros(k.shape, mx.float32)
        dv = mx.zeros(v.shape, mx.float32)
        ds = mx.zeros(s.shape, mx.float32) if s is not None else None
        dm = mx.zeros(m.shape, mx.float32) if mask_grad and not by_rows else None
        dqs, dms = [], []
        cot = cotangent
        for off in offsets:
            if dqs:
                # this chunk starts once the last one's every use is done
                done = [dqs[-1], dk, dv] + [x for x in (ds, dm) if x is not None] + dms[-1:]
                q, k, v, cot = mx.depends([q, k, v, cot], done)
            rows, n, kmask = chunk_of(off, m)
            wrt = [q[..., off : off + rows, :], k[..., :n, :], v[..., :n, :]]
            wrt += ([kmask] if mask_grad else []) + ([s] if s is not None else [])

            def f(qc, kc, vc, *rest, kmask=kmask):
                mc = rest[0] if mask_grad else kmask
                sc = rest[-1] if s is not None else None
                return _original(qc, kc, vc, scale=scale, mask=mc, sinks=sc)

            _, grads = mx.vjp(f, wrt, [cot[..., off : off + rows, :]])
            pad = [(0, 0)] * (k.ndim - 2) + [(0, tk - n), (0, 0)]
            dk = dk + mx.pad(grads[1].astype(mx.float32), pad)
            dv = dv + mx.pad(grads[2].astype(mx.float32), pad)
            if mask_grad and by_rows:
                dms.append(grads[3])
            elif mask_grad:
                dm = dm + grads[3].astype(mx.float32)
            if ds is not None:
                ds = ds + grads[-1].astype(mx.float32)
            dqs.append(grads[0])
        if m is None:
            dmask = None
        elif not mask_grad:
            dmask = mx.zeros_like(m)
        else:
            dmask = (mx.concatenate(dms, axis=-2) if by_rows else dm).astype(m.dtype)
        return (
            mx.concatenate(dqs, axis=-2),
            dk.astype(k.dtype),
            dv.astype(v.dtype),
            dmask,
            ds.astype(s.dtype) if ds is not None else None,
        )

    return attend(queries, keys, values, mask_array, sinks)


def route(chunk: int):
    """From now on, `mx.fast.scaled_dot_product_attention` runs in chunks of
    `chunk` query rows (0: MLX's own, whatever was routed before). Returns
    what it replaced, for restore(): a session routes for its lifetime and
    puts back what it found (Session.close), not MLX's own, whoever routed
    before it."""
    previous = mx.fast.scaled_dot_product_attention
    if not chunk:
        mx.fast.scaled_dot_product_attention = _original
        return previous

    def routed(queries, keys, values, *, scale, mask=None, sinks=None, **kwargs):
        return chunked(queries, keys, values, scale=scale, mask=mask, sinks=sinks, chunk=chunk, **kwargs)

    routed.chunk = chunk
    mx.fast.scaled_dot_product_attention = routed
    return previous


def restore(previous) -> None:
    """Puts back what route() returned."""
    mx.fast.scaled_dot_product_attention = previous


def routed_chunk() -> int:
    """The chunk attention is routed to now (0: MLX's own)."""
    return getattr(mx.fast.scaled_dot_product_attention, "chunk", 0)


@contextlib.contextmanager
def query_chunks(chunk: Optional[int]):
    """While in it, attention runs in chunks of `chunk` query rows (0 or
    None: MLX's own, whole, even where it was routed before)."""
    previous = route(chunk or 0)
    try:
        yield
    finally:
        restore(previous)


def choose_chunk(
    length: int, whole: int, measure: Callable[[int], int], fits: Callable[[int], bool]
) -> Tuple[int, int]:
    """The chunk of query rows one sequence of `length` tokens runs its
    attention in, and what one block's forward + vjp took with it:
    (0, whole) where the block fits whole (`whole`: its measure) or chunks
    make it smaller by less than MIN_ATTENTION_SAVING (short sequences; a
    model that computes attention itself); else
    the largest chunk (a power of two from MIN_ATTENTION_CHUNK, fewest
    calls) whose measured block `fits`, or the smallest chunk where none
    does (what the budget it needs is named from). `measure(chunk)`: one
    block's peak with attention in chunks of `chunk` rows.

    Between the smallest chunk's measure and the whole's, a block is
    planned as a line in the chunk (its scores are chunk x length each), and
    a chunk is measured before it is taken."""
    if fits(whole) or length <= MIN_ATTENTION_CHUNK:
        return 0, whole
    least = measure(MIN_ATTENTION_CHUNK)
    if least > whole * (1 - MIN_ATTENTION_SAVING):
        return 0, whole
    chunk = 1 << (length - 1).bit_length() - 1  # the largest power of two under length
    while chunk > MIN_ATTENTION_CHUNK:
        predicted = least + (whole - least) * (chunk - MIN_ATTENTION_CHUNK) / (length - MIN_ATTENTION_CHUNK)
        if fits(int(predicted)):
            used = measure(chunk)
            if fits(used):
                return chunk, used
        chunk //= 2
    return MIN_ATTENTION_CHUNK, least
