"""compiled.CompiledShapes: the step's compiled functions for a bounded number
of input shapes, and step.Blocks over data of many lengths."""

import gc
import os

import mlx.core as mx
import pytest
from test_step import batches, paged

import mlx_pager.step as S
from mlx_pager import architectures as A
from mlx_pager.compiled import CompiledShapes
from mlx_pager.governor import outside_mlx, process_rss, release_heap


class Traced:
    """A function that counts its traces (its Python body runs only when
    mx.compile traces it)."""

    def __init__(self):
        self.traces = 0

    def __call__(self, x):
        self.traces += 1
        return mx.exp(x) * 2 + 1


def call(fns, f, n):
    x = mx.arange(n, dtype=mx.float32)
    y = fns.get((n,), "f", f)(x)
    assert mx.array_equal(y, mx.exp(x) * 2 + 1).item()


def test_a_shape_beyond_keep_lets_go_of_the_least_recently_used():
    f, fns = Traced(), CompiledShapes(keep=2)
    for n in (3, 4, 3, 5):  # 4 is the least recently used when 5 comes
        call(fns, f, n)
    assert f.traces == 3 and fns.shapes() == [(3,), (5,)] and fns.dropped == 1
    call(fns, f, 3)
    call(fns, f, 5)
    assert f.traces == 3, "kept shapes replay their graphs"
    call(fns, f, 4)
    assert f.traces == 4, "a shape let go of is traced again"
    assert fns.shapes() == [(5,), (4,)]


def test_letting_go_of_one_shape_keeps_the_others_graphs():
    """MLX keys its compile cache by the Python function: two compiled
    wrappers of one function share a cache, and freeing one erases it for
    the other. Each shape's function is its own, so one function may be given
    for every shape."""
    shared = Traced()
    a, b = mx.compile(shared), mx.compile(shared)
    x = mx.ones((3,))
    mx.eval(a(x), b(x))
    assert shared.traces == 1, "one cache for both wrappers"
    del a
    gc.collect()
    mx.eval(b(x))
    assert shared.traces == 2, "freeing one wrapper erased the other's graphs"

    f, fns = Traced(), CompiledShapes(keep=4)
    for n in (3, 4, 5):
        call(fns, f, n)
    assert fns.drop_stale() and not fns.drop_stale()
    gc.collect()
    assert fns.shapes() == [(5,)]
    call(fns, f, 5)
    assert f.traces == 3, "the shape kept replays its graph"


def test_discard_and_clear():
    f, fns = Traced(), CompiledShapes(keep=4)
    x = mx.ones((2,))
    for name in ("a", "b"):
        for n in (2, 3):
            fns.get((n,), name, f)(x)
    fns.discard(lambda name: name == "a")
    assert fns.names() == ["b"]
    assert fns.clear() and not fns and not fns.clear()
    with pytest.raises(ValueError, match="at least 1"):
        CompiledShapes(keep=0)


def test_blocks_keep_the_graphs_of_at_most_keep_shapes_with_the_same_bits(models, tmp_path):
    """Over 12 lengths, Blocks compiles each block and the tail per length
    and keeps those of the last `keep_shapes`: the same bits as with every
    length kept, and the memory outside MLX grows by a fraction of what
    every length's graphs hold."""
    path = models("llama", None, num_hidden_layers=8)
    (batch,) = batches(path, 1, batch_size=2)
    model, w = paged(path, 8, "in_place", tmp_path)
    cuts = [(batch[0][:, :T], mx.minimum(batch[1], T)) for T in range(6, 30, 2)]

    def run(blocks):
        out = []
        for c in cuts:
            out.append(S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*c)], blocks=blocks, tail_start=5))
            mx.eval(out[-1])
        return out

    def outside():
        gc.collect()
        release_heap()
        return outside_mlx(process_rss())

    run(S.Blocks(model, keep_shapes=len(cuts)))  # kernels built: the JIT's libraries stay loaded
    gc.collect()
    base = outside()
    every = S.Blocks(model, keep_shapes=len(cuts))
    kept_all = run(every)
    grown_all = outside() - base
    assert len(every.fns.shapes()) == len(cuts)
    del every
    base = outside()
    bounded = S.Blocks(model, keep_shapes=2)
    kept_two = run(bounded)
    grown_two = outside() - base
    assert [s[1] for s in bounded.fns.shapes()] == [c[0].shape[1] - 1 for c in cuts[-2:]]
    assert bounded.fns.dropped == len(cuts) - 2
    assert {n[0] for n in bounded.fns.names()} == {"fwd", "bwd", "tail"}
    for (l1, _, g1), (l2, _, g2) in zip(kept_all, kept_two):
        assert l1[0].item() == l2[0].item() and not A.bitwise_mismatches(g1, g2)
    # (ASan's allocator keeps freed memory in quarantine: no RSS comes back.)
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        assert grown_all > 4 << 20, grown_all  # a graph per length, block and direction
        assert grown_two < grown_all / 2, (grown_two, grown_all)


def test_the_governor_s_rung_keeps_the_shape_in_use(models, tmp_path, monkeypatch):
    """Blocks.drop_stale (the governor's `graphs` rung): every shape's
    graphs but the last one's go; the next step of that shape is not traced
    again, and gives the same bits."""
    path = models("llama", None, num_hidden_layers=3)
    (batch,) = batches(path, 1, batch_size=2)
    model, w = paged(path, 3, "in_place", tmp_path)
    blocks = S.Blocks(model)
    cuts = [(batch[0][:, :T], mx.minimum(batch[1], T)) for T in (7, 12, 9)]
    outs = [S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*c)], blocks=blocks) for c in cuts]
    mx.eval(outs)
    assert len(blocks.fns.shapes()) == 3
    assert blocks.drop_stale() and not blocks.drop_stale()
    kept = blocks.fns.shapes()
    assert len(kept) == 1 and kept[0][1] == cuts[-1][0].shape[1] - 1
    traces = []
    build = S.run_block
    monkeypatch.setattr(S, "run_block", lambda *a, **k: traces.append(1) or build(*a, **k))
    again = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*cuts[-1])], blocks=blocks)
    mx.eval(again)
    assert not traces, "the shape in use replays its graphs"
    assert again[0][0].item() == outs[-1][0][0].item()
    assert not A.bitwise_mismatches(again[2], outs[-1][2])


def test_a_compiled_tail_is_freed_without_the_cycle_collector(models, tmp_path):
    """The tail's compiled function refers to what it shares with the Tail,
    not to the Tail: a Blocks let go of (or a shape dropped) frees its
    functions, and the model's arrays they hold, when the last reference
    goes, not whenever Python's cycle collector next runs (which, inside a
    measured block, lowered the measurement: test_step)."""
    import weakref

    path = models("llama", None)
    (batch,) = batches(path, 1, batch_size=2)
    model, w = paged(path, 3, "in_place", tmp_path)
    blocks = S.Blocks(model)
    out = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], blocks=blocks, tail_start=3)
    mx.eval(out)
    assert "tail" in {n[0] for n in blocks.fns.names()}
    gc.disable()
    try:
        tail = weakref.ref(blocks.tail)
        del blocks
        assert tail() is None
    finally:
        gc.enable()
