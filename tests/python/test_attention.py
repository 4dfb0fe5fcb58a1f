"""Attention in chunks of query rows (attention.py): MLX's own output, bit
for bit; its gradients within float32 rounding of MLX's; one chunk's scores
live at a time; MLX's own function back after the chunks."""

import mlx.core as mx
import pytest

from mlx_pager import attention

SDPA = attention._original


def _inputs(mask_kind, sinks, dtype=mx.float32, rows=2, heads=4, kv_heads=2, tq=200, tk=200, dim=16):
    mx.random.seed(3)
    q = mx.random.normal((rows, heads, tq, dim)).astype(dtype)
    k = mx.random.normal((rows, kv_heads, tk, dim)).astype(dtype)
    v = mx.random.normal((rows, kv_heads, tk, dim)).astype(dtype)
    s = mx.random.normal((heads,)).astype(dtype) if sinks else None
    if mask_kind == "bool":
        mask = mx.random.uniform(shape=(rows, 1, tq, tk)) > 0.3
    elif mask_kind == "additive":
        mask = mx.where(mx.random.uniform(shape=(tq, tk)) > 0.3, 0.0, -1e9).astype(dtype)
    elif mask_kind == "row":  # one row for every query: broadcast, not sliced
        mask = mx.random.uniform(shape=(rows, 1, 1, tk)) > 0.2
    else:
        mask = mask_kind
    return q, k, v, s, mask


def _grads(fn, q, k, v, s, mask):
    w = mx.random.normal(q.shape, key=mx.random.key(7)).astype(q.dtype)

    def loss(q, k, v, s):
        return (fn(q, k, v, scale=0.25, mask=mask, sinks=s) * w).astype(mx.float32).sum()

    return mx.value_and_grad(loss, argnums=(0, 1, 2, 3) if s is not None else (0, 1, 2))(q, k, v, s)


def _rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / (mx.abs(a).max() + 1e-30)).item()


@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive", "row"])
@pytest.mark.parametrize("sinks", [False, True])
def test_chunks_give_mlx_s_attention_and_its_gradients(mask_kind, sinks):
    q, k, v, s, mask = _inputs(mask_kind, sinks)
    chunk = 64  # 200 rows: 4 chunks, the last one short
    whole = SDPA(q, k, v, scale=0.25, mask=mask, sinks=s)
    got = attention.chunked(q, k, v, scale=0.25, mask=mask, sinks=s, chunk=chunk)
    # each row is MLX's own (bit for bit where the BLAS gives a row the same
    # bits in a product of fewer rows: MLX's own; OpenBLAS ~1e-7 apart)
    assert _rel(whole, got) < 1e-6
    (l1, g1), (l2, g2) = (
        _grads(SDPA, q, k, v, s, mask),
        _grads(lambda *a, **kw: attention.chunked(*a, chunk=chunk, **kw), q, k, v, s, mask),
    )
    assert abs(l1.item() - l2.item()) <= 1e-6 * abs(l1.item())
    for a, b in zip(g1, g2):  # keys', values', sinks': summed over chunks
        assert _rel(a, b) < 3e-6


@pytest.mark.parametrize("by_rows", [True, False])
def test_an_additive_mask_computed_from_inputs_gets_its_gradient(by_rows):
    """DeepSeek V3's attention (MLA) passes its rotary scores as the mask:
    the mask is a function of the inputs, and MLX's gradient flows through
    it; the chunks' must too (zeros there left the adapters' gradients 50%
    off in every MLA model while the loss was right)."""
    q, k, v, _, _ = _inputs(None, False)
    mx.random.seed(4)
    qp = mx.random.normal((2, 4, 200, 4))
    kp = mx.random.normal((2, 1, 200, 4))
    w = mx.random.normal(q.shape, key=mx.random.key(7))

    def loss(fn):
        def f(q, k, v, qp, kp):
            mask = qp @ kp.swapaxes(-1, -2) if by_rows else (kp[..., 0] * 3.0)[:, :, None, :]
            return (fn(q, k, v, scale=0.25, mask=mask) * w).sum()

        return mx.value_and_grad(f, argnums=(0, 1, 2, 3, 4))

    l1, g1 = loss(SDPA)(q, k, v, qp, kp)
    l2, g2 = loss(lambda *a, **kw: attention.chunked(*a, chunk=64, **kw))(q, k, v, qp, kp)
    assert abs(l1.item() - l2.item()) <= 1e-5 * abs(l1.item())  # (a float32 sum of 25,600 terms)
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 3e-6


def test_chunks_under_compile_bfloat16_and_fewer_queries_than_keys():
    # queries after a prefix of keys (a causal mask aligned to the bottom
    # right, as MLX aligns it), bfloat16, inside mx.compile
    q, k, v, s, mask = _inputs("causal", True, dtype=mx.bfloat16, tq=150, tk=230)
    fn = mx.compile(lambda q, k, v, s: _grads(lambda *a, **kw: attention.chunked(*a, chunk=32, **kw), q, k, v, s, mask))
    (l1, g1), (l2, g2) = _grads(SDPA, q, k, v, s, mask), fn(q, k, v, s)
    assert abs(l1.item() - l2.item()) <= 1e-3 * abs(l1.item())
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 2e-2  # bfloat16: MLX sums in bfloat16, the chunks in float32


def test_one_chunk_s_scores_are_live_at_a_time():
    """The gradient's peak falls with the chunk: MLX evaluates independent
    work side by side, and chunks not made to depend on each other peak as
    the whole does."""
    q, k, v, _, _ = _inputs("causal", False, rows=1, heads=8, kv_heads=2, tq=1024, tk=1024, dim=32)
    mx.eval(q, k, v)

    def peak(chunk):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        with attention.query_chunks(chunk):
            l, g = _grads(mx.fast.scaled_dot_product_attention, q, k, v, None, "causal")
            mx.eval(l, g)
        return mx.get_peak_memory() - base

    scores = 8 * 1024 * 1024 * 4  # one whole score matrix
    whole, chunked = peak(0), peak(64)
    assert whole > 2 * scores, whole
    assert chunked < whole / 4 and chunked < scores, (whole, chunked)


def test_query_chunks_puts_back_what_it_found():
    before = mx.fast.scaled_dot_product_attention
    with attention.query_chunks(64):
        assert attention.routed_chunk() == 64
        with attention.query_chunks(32):
            assert attention.routed_chunk() == 32
        with attention.query_chunks(0):  # whole, while routed
            assert mx.fast.scaled_dot_product_attention is SDPA
        assert attention.routed_chunk() == 64
    assert mx.fast.scaled_dot_product_attention is before and attention.routed_chunk() == 0
    with pytest.raises(ValueError):
        with attention.query_chunks(64):
            raise ValueError
    assert mx.fast.scaled_dot_product_attention is before
    # a session's route puts back what it found, not MLX's own
    outer = attention.route(128)
    inner = attention.route(32)
    attention.restore(inner)
    assert attention.routed_chunk() == 128
    attention.restore(outer)
    assert mx.fast.scaled_dot_product_attention is before


def test_a_causal_mask_over_fewer_keys_than_queries_is_mlx_s_own():
    q, k, v, _, _ = _inputs("causal", False, tq=80, tk=40)
    whole = SDPA(q, k, v, scale=0.25, mask="causal")
    assert mx.array_equal(whole, attention.chunked(q, k, v, scale=0.25, mask="causal", chunk=32)).item()


def test_choose_chunk_takes_the_largest_chunk_that_fits():
    # a block of 1000 + one byte a score row per query (length 1024)
    length = 1024

    def block(chunk):
        return 1000 + (chunk or length) * 10

    def choose(room, measure=block):
        seen = []

        def m(chunk):
            seen.append(chunk)
            return measure(chunk)

        return attention.choose_chunk(length, measure(0), m, lambda b: b <= room), seen

    assert choose(block(0)) == ((0, block(0)), [])  # fits whole: nothing measured
    # the line through the smallest chunk's measure and the whole's picks
    # the chunk to measure
    assert choose(block(256)) == ((256, block(256)), [32, 256])
    assert choose(block(32)) == ((32, block(32)), [32])
    assert choose(block(32) - 1)[0] == (32, block(32))  # none fits: the least, to name a budget from
    # a block whose attention is not MLX's (chunks change nothing): whole
    assert choose(100, lambda chunk: block(0))[0] == (0, block(0))
    # a chunk is taken on its measure, not the line's: 256 over, 128 then
    over = choose(block(256), lambda chunk: block(chunk) + (50 if chunk == 256 else 0))
    assert over == ((128, block(128)), [32, 256, 128])
