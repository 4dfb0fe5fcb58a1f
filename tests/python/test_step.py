"""Same math: the paged step's loss and adapter gradients equal mlx-lm's
(default_loss under nn.value_and_grad, on the whole resident model) BITWISE
on the CPU: each block runs the same MLX ops on the same inputs, and the head
sums per-token losses exactly as default_loss does."""

import os
import types

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from conftest import SAMPLE
from mlx.utils import tree_flatten
from mlx_lm.tuner.datasets import CacheDataset, load_dataset
from mlx_lm.tuner.trainer import default_loss, iterate_batches

from mlx_pager import architectures as A
from mlx_pager import carry, segment
from mlx_pager import step as S
from mlx_pager._core import IO_ALIGN

LORA = {"rank": 8, "dropout": 0.0, "scale": 20.0}


def batches(path, n, batch_size=3):
    _, tok = mlx_lm.load(str(path), lazy=True)
    args = types.SimpleNamespace(data=str(SAMPLE), train=True, test=False, mask_prompt=False)
    train, _, _ = load_dataset(args, tok)
    it = iterate_batches(CacheDataset(train), batch_size, 2048, seed=3)
    return [next(it) for _ in range(n)]


def reference(path, num_layers, dora=False):
    return A.reference(path, num_layers, dora=dora, lora=LORA)


def paged(path, num_layers, store, tmp_path, dora=False, page_parts=None, pager_options=None):
    return A.paged(
        path, num_layers, store, str(tmp_path), dora=dora, lora=LORA, page_parts=page_parts, pager_options=pager_options
    )


def reference_sums(path, num_layers, bs):
    """mlx-lm's loss per batch of `bs` and its gradients summed over them."""
    ref = reference(path, num_layers)
    vg = nn.value_and_grad(ref, default_loss)
    total, losses = None, []
    for b in bs:
        (l, _), g = vg(ref, *b)
        mx.eval(l, g)
        losses.append(l.item())
        flat = dict(tree_flatten(g))
        total = flat if total is None else {k: total[k] + flat[k] for k in flat}
    return losses, total


def cold_start(pager):
    """Nothing in memory but the pinned pages, and the stats then: readahead
    is paused while every page is dropped (evict_all waits for the reads in
    flight), so none lands before the snapshot; it is back on for the step,
    whose reads (ahead or on demand) all count after it."""
    ahead = pager.set_readahead(0)
    pager.evict_all()
    pager.reset_peak()
    before = pager.stats()
    pager.set_readahead(ahead)
    return before


def assert_bitwise(ref_grads, grads):
    bad = A.bitwise_mismatches(dict(tree_flatten(ref_grads)), grads)
    assert not bad, bad


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [4, None])
def test_loss_and_gradients_are_bitwise_mlx_lm(models, tmp_path, arch, bits):
    path = models(arch, bits)
    (batch,) = batches(path, 1)
    ref = reference(path, 3)
    (loss, ntoks), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    for store in ("in_place", "swap"):
        model, w = paged(path, 3, store, tmp_path)
        # A small head chunk: the loss is assembled from several slices.
        losses, toks, pgrads = S.paged_value_and_grad(
            model, w, [S.MicroBatch.from_batch(*batch)], head_chunk_bytes=20_000
        )
        assert losses[0].item() == loss.item()
        assert toks[0].item() == ntoks.item()
        assert_bitwise(grads, pgrads)
        assert w.store_kind[0] == store


def test_gradient_accumulation_reads_each_block_once(models, tmp_path):
    path = models("llama", None)
    bs = batches(path, 3)
    ref = reference(path, 2)
    vg = nn.value_and_grad(ref, default_loss)
    total = None
    ref_losses = []
    for b in bs:
        (l, _), g = vg(ref, *b)
        mx.eval(l, g)
        ref_losses.append(l.item())
        flat = dict(tree_flatten(g))
        total = flat if total is None else {k: total[k] + flat[k] for k in flat}
    model, w = paged(path, 2, "in_place", tmp_path)
    before = cold_start(w.pager)
    losses, _, grads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*b) for b in bs])
    assert [l.item() for l in losses] == ref_losses
    for k in total:
        assert mx.array_equal(total[k], grads[k]).item(), k
    # 4 blocks forward + 2 backward, each acquired once for all 3 micro-batches.
    s = w.pager.stats()
    assert s["acquires"] - before["acquires"] == 6
    assert s["pages_read"] - before["pages_read"] <= 6


def test_dora_is_bitwise_mlx_lm(models, tmp_path):
    path = models("qwen3", 4)
    (batch,) = batches(path, 1)
    ref = reference(path, 2, dora=True)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = paged(path, 2, "in_place", tmp_path, dora=True)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)])
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)


def test_dropout_masks_are_replayed_in_the_backward_pass(models, tmp_path):
    """With LoRA dropout the paged step cannot draw mlx-lm's masks, but its
    backward recompute must see the forward's masks: gradients are then
    those of one consistent function, so a second identical step (same key)
    gives identical results, and they are finite."""
    path = models("llama", None)
    (batch,) = batches(path, 1)
    model, w = paged(path, 2, "in_place", tmp_path)
    for _, m in model.named_modules():
        if isinstance(m, nn.Dropout):
            m._p_1 = 0.5
    model.train()
    outs = []
    for _ in range(2):
        mx.random.seed(11)
        losses, _, g = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)])
        outs.append((losses[0].item(), g))
    assert outs[0][0] == outs[1][0]
    for k in outs[0][1]:
        assert mx.array_equal(outs[0][1][k], outs[1][1][k]).item()
        assert mx.isfinite(outs[0][1][k]).all().item()


def test_paged_eval_loss_equals_mlx_lm(models, tmp_path):
    path = models("qwen3", None)
    bs = batches(path, 2)
    ref = reference(path, 2)
    model, w = paged(path, 2, "in_place", tmp_path)
    got = S.paged_loss(model, w, [S.MicroBatch.from_batch(*b) for b in bs], head_chunk_bytes=30_000)
    for (loss, toks), b in zip(got, bs):
        l, n = default_loss(ref, *b)
        assert loss.item() == l.item() and toks.item() == n.item()


def test_paged_eval_sweeps_micro_batches_of_one_shape_with_mlx_lm_losses(models, tmp_path):
    """Evaluation's sweep carries several micro-batches of one shape through
    each block, each on its own: each loss is mlx-lm's on its rows, bit for
    bit, sweep after sweep."""
    path = models("llama", None, num_hidden_layers=3)
    (batch,) = batches(path, 1, batch_size=4)
    ref = reference(path, 2)
    model, w = paged(path, 2, "in_place", tmp_path)
    rows = S.split_batch(*batch, 4, shared_norm=False)  # 4 micro-batches of one row, one shape
    expected = [default_loss(ref, *(x[r : r + 1] for x in batch)) for r in range(4)]
    blocks = S.Blocks(model)
    for _ in range(2):
        got = S.paged_loss(model, w, rows, head_chunk_bytes=30_000, blocks=blocks)
        for (loss, toks), (l, n) in zip(got, expected):
            assert loss.item() == l.item() and toks.item() == n.item()


def _train_like(*models):
    """The same nonzero LoRA B in each model's adapters, as after some
    training (B starts at zeros)."""
    for m in models:
        key = mx.random.key(7)
        for _name, layer in sorted(m.named_modules(), key=lambda x: x[0]):
            if hasattr(layer, "lora_b"):
                key, sub = mx.random.split(key)
                layer.lora_b = 0.05 * mx.random.normal(layer.lora_b.shape, key=sub)
        mx.eval(m.parameters())


@pytest.mark.parametrize("dora", [False, True])
def test_paged_eval_losses_are_mlx_lm_s_untrained_and_trained_at_many_lengths(models, tmp_path, dora):
    """Before the first update LoRA's B is all zeros, after it not: at
    lengths where a product of more rows sums in another order, every
    micro-batch's loss, untrained and 'trained', is mlx-lm's bit for bit
    (a grouped sweep trusted a comparison made on zeros, and a later
    validation came out 2e-5 off mlx-lm's, DoRA)."""
    path = models("llama", None, num_hidden_layers=3)
    ref = reference(path, 2, dora=dora)
    model, w = paged(path, 2, "in_place", tmp_path, dora=dora)
    (batch,) = batches(path, 1, batch_size=4)
    groups = []
    for T in (9, 14, 23, 31, 40, 47):  # row counts whose products may sum in other orders
        cut = (batch[0][:, :T], mx.minimum(batch[1], T))
        groups.append((S.split_batch(*cut, 4, shared_norm=False), cut))
    blocks = S.Blocks(model)

    def check():
        for rows, cut in groups:
            got = S.paged_loss(model, w, rows, head_chunk_bytes=30_000, blocks=blocks)
            for r, (loss, toks) in enumerate(got):
                l, n = default_loss(ref, *(x[r : r + 1] for x in cut))
                assert loss.item() == l.item() and toks.item() == n.item()

    check()
    _train_like(ref, model)
    check()


def test_blocks_stop_compiling_once_with_the_same_bits(models, tmp_path):
    """The governor's last rung (Blocks.stop_compiling): every block and the
    tail run uncompiled from then on; the step's results are the same bits."""
    path = models("llama", None)
    (batch,) = batches(path, 1)
    model, w = paged(path, 2, "in_place", tmp_path)
    blocks = S.Blocks(model)
    mbs = [S.MicroBatch.from_batch(*batch)]
    before = S.paged_value_and_grad(model, w, mbs, blocks=blocks, tail_start=3)
    assert {n[0] for n in blocks.fns.names()} == {"fwd", "bwd", "tail"}
    assert blocks.stop_compiling() and not blocks.stop_compiling()
    assert not blocks.fns and not blocks.compile and not blocks.tail.compile
    after = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], blocks=blocks, tail_start=3)
    assert not blocks.fns
    assert before[0][0].item() == after[0][0].item()
    assert not A.bitwise_mismatches(before[2], after[2])


def test_dropping_the_compiled_graphs_gives_their_memory_back_with_the_same_bits(models, tmp_path):
    """MLX keeps a compiled function's traced graph for every input shape it
    met, in its heap outside the arrays' memory (session: the process
    outside MLX grew 119 -> 212 MB over 4 steps of a 35-block model, 124 MB
    uncompiled). Blocks.drop_compiled lets go of them: after gc and
    malloc_trim the memory is the OS's again, and the blocks, compiled
    anew, give the same bits."""
    import gc

    from mlx_pager.governor import outside_mlx, process_rss, release_heap

    path = models("llama", None, num_hidden_layers=8)
    (batch,) = batches(path, 1, batch_size=2)
    model, w = paged(path, 8, "in_place", tmp_path)
    cuts = [(batch[0][:, :T], mx.minimum(batch[1], T)) for T in range(6, 30, 2)]  # a graph per length
    blocks = S.Blocks(model, keep_shapes=len(cuts))  # every length's kept (compiled.py)

    def run():
        mbs = [[S.MicroBatch.from_batch(*c)] for c in cuts]
        out = [S.paged_value_and_grad(model, w, mb, blocks=blocks, tail_start=8) for mb in mbs]
        mx.eval(out)
        return out

    def outside():
        gc.collect()
        release_heap()
        return outside_mlx(process_rss())

    first = run()  # kernels built (the JIT's libraries stay loaded: not what is measured)
    assert blocks.drop_compiled()
    base = outside()
    again = run()
    grown = outside() - base
    assert blocks.drop_compiled() and not blocks.drop_compiled()
    assert not blocks.fns and blocks.compile  # built again when next used
    freed = base + grown - outside()
    # (ASan's allocator keeps freed memory in quarantine: no RSS comes back.)
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        assert grown > 4 << 20, grown  # a graph per length and block, forward and backward
        assert freed > grown // 2, (grown, freed)
    for (l1, _, g1), (l2, _, g2) in zip(first, again):
        assert l1[0].item() == l2[0].item() and not A.bitwise_mismatches(g1, g2)


def test_a_block_mx_compile_cannot_trace_runs_uncompiled(tmp_path):
    """dbrx's router evaluates arrays inside the block, which mx.compile
    refuses: step.Blocks remembers that and runs the block uncompiled, with
    mlx-lm's results bit for bit."""
    path = A.build("dbrx", "4bit", tmp_path)
    batch = A.sample_batch(path)
    ref = A.reference(path, 2)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = A.paged(path, 2, "auto", str(tmp_path / "swap"))
    blocks = S.Blocks(model)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], blocks=blocks)
    assert blocks.uncompiled and all("eval" in why for why in blocks.uncompiled.values())
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)


@pytest.mark.parametrize("arch, bits", [("llama", None), ("qwen3", 4), ("qwen2", 4)])
def test_tail_segment_is_bitwise_mlx_lm_at_every_start(models, tmp_path, arch, bits):
    """Blocks s..L-1 and the head as one no-recompute segment (segment.py),
    for every s from the first trained block to L (none), with two
    micro-batches and a chunked head: the same bits as default_loss, with
    the tail's weights streamed (stream.py): each tail block's page acquired
    where the graph uses it, forward and backward, per micro-batch."""
    path = models(arch, bits)
    bs = batches(path, 2)
    ref_losses, total = reference_sums(path, 3, bs)
    model, w = paged(path, 3, "in_place", tmp_path)
    L = len(model.layers)
    for s in range(L - 3, L + 1):
        before = w.pager.stats()["acquires"]
        losses, _, grads = S.paged_value_and_grad(
            model, w, [S.MicroBatch.from_batch(*b) for b in bs], head_chunk_bytes=20_000, tail_start=s
        )
        assert [x.item() for x in losses] == ref_losses, s
        assert_bitwise(total, grads)
        sweep, tail, below = s, 2 * len(bs) * (L - s), s - (L - 3)
        assert w.pager.stats()["acquires"] - before == sweep + tail + below, s


@pytest.mark.parametrize("arch, bits", [("llama", None), ("qwen3", 4)])
def test_a_held_tail_is_compiled_and_bitwise_mlx_lm_at_every_start(models, tmp_path, arch, bits):
    """Where the tail's pages fit the page budget together (holds_tail), the
    tail holds them, bound once for both micro-batches, and its vjp runs
    under mx.compile (segment.Tail): the same bits as default_loss, and each
    tail page acquired once per step, not forward and backward per
    micro-batch."""
    path = models(arch, bits)
    bs = batches(path, 2)
    ref_losses, total = reference_sums(path, 3, bs)
    model, w = paged(path, 3, "in_place", tmp_path)
    L = len(model.layers)
    blocks = S.Blocks(model)
    for s in range(L - 3, L):
        need = sum(w.block_charge_bound(i) for i in range(s, L)) + max(w.block_charge_bound(i) for i in range(s))
        assert S.holds_tail(w, s, need) and not S.holds_tail(w, s, need - 1)
        before = w.pager.stats()["acquires"]
        probe = {}
        losses, _, grads = S.paged_value_and_grad(
            model,
            w,
            [S.MicroBatch.from_batch(*b) for b in bs],
            head_chunk_bytes=20_000,
            tail_start=s,
            blocks=blocks,
            hold_tail=True,
            probe=probe,
        )
        assert probe["tail_held"], s
        assert [x.item() for x in losses] == ref_losses, s
        assert_bitwise(total, grads)
        sweep, tail, below = s, L - s, s - (L - 3)
        assert w.pager.stats()["acquires"] - before == sweep + tail + below, s
        assert S.step_pages(w, L - 3, s, 2, held=True) == [
            p for i in [*range(L), *range(s - 1, L - 4, -1)] for p in w.block_pages[i]
        ]
        # compiled, and only the current start's: the graphs of a start the
        # run moved on from are let go of (Blocks.drop_compiled)
        assert blocks.tail.uncompiled is None and [n[1] for n in blocks.fns.names() if n[0] == "tail"] == [s]


def test_a_held_tail_falls_back_to_streaming_when_the_budget_shrank(models, tmp_path):
    """hold_tail asks, the page budget decides: a budget lowered below the
    tail's pages (the governor, between the step's start and its tail)
    streams the tail, with the same bits."""
    path = models("llama", None)
    (batch,) = batches(path, 1)
    ref = reference(path, 2)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = paged(path, 2, "in_place", tmp_path)
    L = len(model.layers)
    w.pager.set_budget(w.pager.stats()["pinned_bytes"] + max(w.block_charge_bound(i) for i in range(L)))
    probe = {}
    losses, _, pgrads = S.paged_value_and_grad(
        model, w, [S.MicroBatch.from_batch(*batch)], tail_start=L - 2, hold_tail=True, probe=probe
    )
    assert probe["tail_held"] is False
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)


def test_a_held_tail_mx_compile_cannot_trace_runs_uncompiled(tmp_path):
    """dbrx's router evaluates arrays inside a block: the tail's trace fails,
    held or streamed (its page reads half built), segment.Tail remembers why
    and runs it uncompiled, with mlx-lm's results bit for bit (and the
    model's arrays as they were)."""
    path = A.build("dbrx", "4bit", tmp_path)
    batch = A.sample_batch(path)
    ref = A.reference(path, 2)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = A.paged(path, 2, "auto", str(tmp_path / "swap"))
    blocks = S.Blocks(model)
    L = len(model.layers)
    # held twice (the failure is remembered), then streamed; then a fresh
    # streamed tail, whose trace fails the same way, its page reads half built
    for b, hold in ((blocks, True), (blocks, True), (blocks, False), (S.Blocks(model), False)):
        losses, _, pgrads = S.paged_value_and_grad(
            model, w, [S.MicroBatch.from_batch(*batch)], blocks=b, tail_start=L - 2, hold_tail=hold
        )
        assert b.tail.uncompiled and "eval" in b.tail.uncompiled
        assert losses[0].item() == loss.item()
        assert_bitwise(grads, pgrads)


LLAMA3_ROPE = {
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
}


def test_a_failed_held_tail_trace_leaves_the_model_as_it_was(models, tmp_path, monkeypatch):
    """mx.compile swaps every array of the model's state for a tracer,
    private ones too (llama3 RoPE's _freqs), and puts them back only when
    the trace succeeds: after a trace that fails (a block that evaluates an
    array, as dbrx's router does), the uncompiled fallback must see the real
    arrays, and give mlx-lm's bits."""
    path = models("llama", None, extra=LLAMA3_ROPE)
    (batch,) = batches(path, 1)
    ref = reference(path, 2)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = paged(path, 2, "in_place", tmp_path)
    L = len(model.layers)
    assert any("._" in k for k, _ in tree_flatten(model.state)), "the model should keep a private array"
    run_block = S.run_block

    def untraceable(layer, x, call):
        y = run_block(layer, x, call)
        if layer is model.layers[L - 1]:
            mx.eval(y)  # fine uncompiled, refused by a compile trace
        return y

    monkeypatch.setattr(S, "run_block", untraceable)
    blocks = S.Blocks(model)
    losses, _, pgrads = S.paged_value_and_grad(
        model, w, [S.MicroBatch.from_batch(*batch)], blocks=blocks, tail_start=L - 2, hold_tail=True
    )
    assert blocks.tail.uncompiled and "eval" in blocks.tail.uncompiled
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)


@pytest.mark.parametrize("hold", [False, True])
def test_checkpoint_bytes_count_down_to_zero_below_a_tail(models, tmp_path, hold):
    """probe["checkpoint_bytes"] (memory traces) is the recomputed blocks'
    checkpoints held: never negative, back to 0 after the backward sweep,
    with a tail (held or streamed) above them."""
    path = models("llama", None)
    (batch,) = batches(path, 1)
    model, w = paged(path, 3, "in_place", tmp_path)
    L = len(model.layers)
    probe, seen = {}, []
    S.paged_value_and_grad(
        model,
        w,
        [S.MicroBatch.from_batch(*batch)],
        tail_start=L - 1,
        hold_tail=hold,
        probe=probe,
        on_block=lambda phase, i: seen.append((phase, i, probe.get("checkpoint_bytes", 0))),
    )
    assert probe["tail_held"] is hold
    assert all(isinstance(b, int) and b >= 0 for _, _, b in seen), seen
    assert max(b for _, _, b in seen) > 0 and seen[-1][2] == 0, seen


@pytest.mark.parametrize(
    "arch, bits, dora, pages",
    [("llama", None, False, 2), ("qwen3", 4, False, 2), ("llama", None, True, 2), ("llama", None, False, 1)],
)
def test_a_streamed_tail_needs_a_page_not_all_of_them(models, tmp_path, arch, bits, dora, pages):
    """No recompute below the budget that holds the tail's pages: with room
    for two block pages (or one), a tail of every trained block (s = first) reads its
    weights forward and again backward (stream.py), keeps the pages under
    the budget, and gives default_loss's bits (DoRA: its base weights are
    held copies, the rest streamed)."""
    path = models(arch, bits)
    (b,) = batches(path, 1)
    ref = reference(path, 3, dora=dora)
    (loss, _), g = nn.value_and_grad(ref, default_loss)(ref, *b)
    mx.eval(loss, g)
    model, w = paged(path, 3, "in_place", tmp_path, dora=dora)
    L, first = len(model.layers), S.first_trained_block(model)
    page = max(w.page_bytes(i) for i in range(L)) + 2 * IO_ALIGN  # a frame: the page, aligned
    budget = w.resident_bytes + IO_ALIGN + pages * page
    w.pager.set_budget(budget)
    w.pager.set_schedule(S.step_pages(w, first, first))
    before = cold_start(w.pager)
    losses, _, grads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*b)], tail_start=first)
    after = w.pager.stats()
    assert losses[0].item() == loss.item()
    assert_bitwise(g, grads)
    assert after["peak_resident_bytes"] <= budget
    reads = after["pages_read"] - before["pages_read"]
    if dora:
        # DoRA computes with its base weights directly: they are held copies,
        # and the backward reads nothing.
        assert reads == L
    else:
        # Every block forward, and the trained ones again backward: no page
        # is kept from its forward to its backward but the last one or two.
        assert L + (L - first) - 2 <= reads <= L + (L - first), reads


@pytest.mark.parametrize(
    "arch, bits, dora, pages", [("llama", None, False, 2), ("qwen3", 4, False, 1), ("llama", None, True, 2)]
)
def test_a_streamed_tail_is_compiled_and_bitwise_step_after_step(
    models, tmp_path, monkeypatch, arch, bits, dora, pages
):
    """A streamed tail runs under mx.compile (segment.Tail): its page reads
    and custom vjps are traced once per input shape and replayed after
    that, with no Python. Every call (the trace, a replay on the same
    shape, a new shape's trace with a new Stream, a replay of the first)
    gives mlx-lm's bits, reads each page where
    the uncompiled tail does, and keeps the pages under the budget."""
    path = models(arch, bits)
    b0, b1 = batches(path, 2)
    b1 = (b1[0][:2], b1[1][:2])  # fewer rows: a new shape, traced again
    ref = reference(path, 3, dora=dora)
    vg = nn.value_and_grad(ref, default_loss)
    model, w = paged(path, 3, "in_place", tmp_path, dora=dora)
    L, first = len(model.layers), S.first_trained_block(model)
    page = max(w.page_bytes(i) for i in range(L)) + 2 * IO_ALIGN
    budget = w.resident_bytes + IO_ALIGN + pages * page
    w.pager.set_budget(budget)
    w.pager.set_schedule(S.step_pages(w, first, first))
    blocks = S.Blocks(model)
    traced = []
    build = segment.tail_value_and_grad
    monkeypatch.setattr(segment, "tail_value_and_grad", lambda *a, **k: traced.append(1) or build(*a, **k))
    for b in (b0, b0, b1, b0):
        (loss, _), g = vg(ref, *b)
        mx.eval(loss, g)
        before = cold_start(w.pager)
        losses, _, grads = S.paged_value_and_grad(
            model, w, [S.MicroBatch.from_batch(*b)], tail_start=first, blocks=blocks
        )
        after = w.pager.stats()
        assert losses[0].item() == loss.item()
        assert_bitwise(g, grads)
        assert after["peak_resident_bytes"] <= budget
        reads = after["pages_read"] - before["pages_read"]
        assert reads == L if dora else L + (L - first) - 2 <= reads <= L + (L - first), reads
    assert blocks.tail.uncompiled is None
    assert [n[3] for n in blocks.fns.names() if n[0] == "tail"] == [True], "one compiled streamed tail"
    assert b0[0].shape != b1[0].shape
    assert len(traced) == 2, "traced once per batch shape, replayed otherwise"


@pytest.mark.parametrize("parts", [2, 4])
def test_a_split_batch_adds_up_to_the_whole(models, tmp_path, parts):
    """A batch split into micro-batches of rows (each divided by the whole
    batch's tokens) gives the batch's loss and gradients (default_loss),
    up to float rounding: the same math, in smaller pieces."""
    path = models("llama", None)
    (batch, lengths) = batches(path, 1, batch_size=4)[0]
    ref = reference(path, 3)
    (l, n), g = nn.value_and_grad(ref, default_loss)(ref, batch, lengths)
    model, w = paged(path, 3, "in_place", tmp_path)
    mbs = S.split_batch(batch, lengths, parts)
    assert len(mbs) == parts and sum(mb.rows for mb in mbs) == 4
    probe = {}
    losses, toks, grads = S.paged_value_and_grad(model, w, mbs, tail_start=len(model.layers) - 1, probe=probe)
    assert sum(x.item() for x in losses) == pytest.approx(l.item(), rel=1e-5)
    assert sum(t.item() for t in toks) == n.item()
    for k, v in tree_flatten(g):
        assert mx.allclose(grads[k], v, rtol=1e-4, atol=1e-6).item(), k
    # what the planner learns from the step: the tail's and one recomputed block's peaks
    assert probe["tail"][1:] == (1, mbs[0].rows, batch.shape[1] - 1) and probe["tail"][0] > 0
    assert probe["block"][1:] == (mbs[0].rows, batch.shape[1] - 1) and probe["block"][0] > 0
    assert probe["peak"] >= max(probe["tail"][0], probe["block"][0])


def test_a_split_batch_s_backward_holds_one_part_s_working_set(models, tmp_path):
    """The backward sweep runs a recomputed block one micro-batch at a
    time, as the forward sweep does and as the plan counts it. Evaluated
    together, the parts' graphs ran side by side: DoRA, a batch of 8 in 8
    parts, each recomputed block's backward peaked at ~3x one part's
    working set, and the step ran 7% over its memory budget."""
    path = models("qwen3", 4, hidden_size=512, intermediate_size=1536, num_hidden_layers=3)
    (batch, lengths) = batches(path, 1, batch_size=8)[0]
    model, w = paged(path, 3, "in_place", tmp_path, dora=True)
    mbs = S.split_batch(batch, lengths, 8)
    backward = []

    def on_block(phase, i):
        if phase == "backward":
            backward.append(mx.get_peak_memory() - mx.get_active_memory())
        mx.reset_peak_memory()

    probe = {}
    S.paged_value_and_grad(model, w, mbs, tail_start=len(model.layers), probe=probe, on_block=on_block)
    one = probe["block"][0]  # the first part's, measured alone
    assert len(backward) == 3 and one > 0
    assert max(backward) <= 1.5 * one, (backward, one)


def test_the_cycle_collector_does_not_lower_a_measured_peak(models, tmp_path, monkeypatch):
    """Cyclic garbage holding arrays (an earlier model's, a failed try's),
    freed by Python's cycle collector while a block's peak is measured,
    lowered the memory under the measurement's start: CI measured a
    recomputed block at 0 bytes. The collector waits for the window to end
    (here it runs in each block's vjp where it is enabled, as it may at any
    allocation), and is enabled again after it."""
    import gc

    path = models("llama", None)
    (batch, lengths) = batches(path, 1, batch_size=2)[0]
    model, w = paged(path, 3, "in_place", tmp_path)
    vjp = S.Blocks.vjp

    def collecting(self, *a, **k):
        if gc.isenabled():
            gc.collect()
        return vjp(self, *a, **k)

    monkeypatch.setattr(S.Blocks, "vjp", collecting)
    threshold = gc.get_threshold()
    gc.set_threshold(1 << 30)  # no collection but the one above
    try:
        garbage = [mx.zeros((64 << 20) // 4)]  # 64 MB in a cycle
        garbage.append(garbage)
        mx.eval(garbage[0])
        del garbage
        probe = {}
        S.paged_value_and_grad(
            model, w, [S.MicroBatch.from_batch(batch, lengths)], tail_start=len(model.layers) - 1, probe=probe
        )
    finally:
        gc.set_threshold(*threshold)
    assert gc.isenabled()
    assert probe["block"][0] > 0, probe["block"]
    gc.collect()


def test_spilled_checkpoints_come_back_bitwise(models, tmp_path):
    """Checkpoints written to the SSD after the forward sweep and read back
    through the pager in the backward sweep (spill.py): the same bits as
    mlx-lm, step after step (each step rewrites the pages: a copy read
    before the write is never used), with the bytes counted both ways."""
    from mlx_pager.spill import SpillStore

    path = models("llama", None)
    bs = batches(path, 3)
    ref = reference(path, 3)
    vg = nn.value_and_grad(ref, default_loss)
    model, w = paged(path, 3, "in_place", tmp_path)
    L = len(model.layers)
    first = S.first_trained_block(model)
    store = SpillStore(w, tmp_path / "spill", 1)
    try:
        for b in bs:
            (l, _), g = vg(ref, *b)
            mx.eval(l, g)
            mb = S.MicroBatch.from_batch(*b)
            mb.record(model)
            need = mb.h0.nbytes  # one checkpoint
            if need > store.slot_bytes:
                store.close()
                store = SpillStore(w, tmp_path / "spill", need)
            before = (store.bytes_written, store.bytes_read)
            losses, _, grads = S.paged_value_and_grad(model, w, [mb], tail_start=L, spill=store, spilled=L - first)
            assert losses[0].item() == l.item()
            assert_bitwise(g, grads)
            written, read = store.bytes_written - before[0], store.bytes_read - before[1]
            assert written == read == (L - first) * need
        assert store.path.exists()
    finally:
        store.close()
    assert not store.path.exists()


@pytest.mark.parametrize("arch,bits", [("llama", None), ("qwen3", 4)])
@pytest.mark.parametrize("tail", [False, True])
def test_blocks_in_several_pages_are_bitwise_mlx_lm(models, tmp_path, arch, bits, tail):
    """Each block split into 3 pages (store.split_block): forward blocks read
    their pages lazily inside their graph, the tail streams them forward and
    (in reverse) backward, the backward sweep binds them together; the math
    is mlx-lm's, bit for bit, and the pages are acquired in exactly the
    order the schedule (step_pages) says."""
    path = models(arch, bits)
    (batch,) = batches(path, 1)
    ref = reference(path, 3)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    model, w = paged(path, 3, "in_place", tmp_path, page_parts=3)
    L, first = len(model.layers), S.first_trained_block(model)
    assert all(len(p) == 3 for p in w.block_pages)
    start = first if tail else None
    order = S.step_pages(w, first, start)
    # Every page fits, no readahead: each page is read at its first use, so
    # the reads come in the order the step first uses the pages.
    w.pager.set_readahead(0)
    w.pager.set_schedule(order)
    w.pager.evict_all()
    w.pager.take_trace()
    w.pager.enable_trace(True)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], tail_start=start)
    w.pager.enable_trace(False)
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)
    reads = [e[2] for e in sorted(w.pager.take_trace(), key=lambda e: e[6]) if e[0] == "read"]
    assert reads == list(dict.fromkeys(order))
    # A budget of one block: the reads are those the simulator's replay of
    # the pager (simulate.py) makes for the step's accesses (a lazily read
    # page one access, a bound block its pages together), in that order:
    # the tail's backward re-reads each block's pages in reverse.
    from mlx_pager import simulate as sim
    from mlx_pager.stream import backward_pages

    index = {p: n for n, p in enumerate(w.page_order)}
    s_tail = L if start is None else start
    acc = [sim.Access((index[p],)) for i in range(L) for p in w.block_pages[i]]
    acc += [sim.Access((index[p],)) for i in reversed(range(s_tail, L)) for p in backward_pages(w, i)]
    acc += [sim.Access(tuple(index[p] for p in w.block_pages[i])) for i in range(s_tail - 1, first - 1, -1)]
    # (each frame may take one alignment more than page_footprint says: MLX's
    # allocator rounds small buffers up)
    budget = max(w.block_footprint(i) + len(w.block_pages[i]) * IO_ALIGN for i in range(L))
    fps = [w.page_footprint(p) for p in w.page_order]
    predicted = sim.simulate(acc, fps, budget, sim.Disk(1e9), sim.Settings(0), steps=1, warmup=0)
    expected = [w.page_order[r.page] for r in predicted.reads]
    w.pager.set_budget(w.resident_bytes + 2 * IO_ALIGN + budget)  # the pinned resident page counts
    w.pager.evict_all()
    w.pager.enable_trace(True)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], tail_start=start)
    w.pager.enable_trace(False)
    assert_bitwise(grads, pgrads)
    reads = [e[2] for e in sorted(w.pager.take_trace(), key=lambda e: e[6]) if e[0] == "read"]
    assert reads == expected


def _sweep(model, w, mbs, blocks):
    return S._forward_sweep(model, w, mbs, S.first_trained_block(model), None, "forward", blocks)


@pytest.mark.parametrize("arch, bits", [("llama", None), ("qwen3", 4)])
def test_the_prefix_sweep_gives_each_micro_batch_its_own_bits(models, tmp_path, arch, bits):
    """The frozen blocks' sweep carries several micro-batches, each through
    a block on its own: each output is the one its own step's forward
    computes, sweep after sweep."""
    path = models(arch, bits, num_hidden_layers=4)
    (batch,) = batches(path, 1, batch_size=4)
    model, w = paged(path, 2, "in_place", tmp_path)
    mbs = S.split_batch(*batch, 4)  # 4 micro-batches of one row, one shape
    blocks = S.Blocks(model)
    for mb in mbs:
        mb.record(model)
    own = []
    for mb in mbs:
        h = mb.h0
        for i in range(S.first_trained_block(model)):
            with w.bound(i):
                h = blocks.forward(i, h, mb.calls[i])
                mx.eval(h)
        own.append(h)
    for _ in range(2):
        got = _sweep(model, w, mbs, blocks)
        assert all(mx.array_equal(a, b).item() for a, b in zip(own, got))


@pytest.mark.parametrize("arch, bits", [("llama", None), ("qwen3", 4)])
def test_the_prefix_sweep_reads_a_block_in_parts_as_its_graph_uses_them(models, tmp_path, arch, bits, monkeypatch):
    """A frozen block in several pages, one micro-batch: the sweep does not
    bind the block whole but makes its pages lazy reads in the block's
    graph (stream.forward_pages), so each page's frame can go once the
    graph is done with it and the pager reads the next block's first pages
    meanwhile (with room for one block, binding it whole left the disk idle
    for the block's compute). Several micro-batches bind it whole; the
    outputs are the same bits either way."""
    path = models(arch, bits, num_hidden_layers=4)
    (batch,) = batches(path, 1, batch_size=4)
    model, w = paged(path, 1, "in_place", tmp_path, page_parts=4)
    prefix = S.first_trained_block(model)
    assert prefix == 3 and all(len(w.block_pages[i]) > 1 for i in range(prefix))
    one_block = max(w.block_charge_bound(i) for i in range(len(model.layers)))
    w.pager.set_budget(w.resident_bytes + 2 * IO_ALIGN + one_block)  # the pinned resident page counts
    bound = []
    whole = w.bound

    def spy(i):
        bound.append(i)
        return whole(i)

    monkeypatch.setattr(w, "bound", spy)
    mbs = S.split_batch(*batch, 4)
    blocks = S.Blocks(model)
    w.pager.reset_peak()
    single = _sweep(model, w, mbs[:1], blocks)  # one graph per block: lazy reads
    assert bound == []
    assert w.pager.stats()["peak_resident_bytes"] <= w.pager.budget
    several = _sweep(model, w, mbs, blocks)  # bound whole
    assert bound == list(range(prefix))
    assert mx.array_equal(single[0], several[0]).item()


@pytest.mark.parametrize("trained", [4, 3, 2])
def test_blocks_taking_another_block_s_outputs_are_bitwise_mlx_lm(tmp_path, trained):
    """Carries (carry.py): Gemma 4 E2B-style, blocks 2 and 3 take the keys
    and values of blocks 0 and 1. The paged step keeps them from the
    producer's forward to the consumer's backward and hands the consumers'
    cotangents back to the producers: the same bits as default_loss over
    the whole model, compiled or not, at every tail start (one a trained
    producer's carry crosses runs as none; a frozen producer's carry enters
    the tail as a constant), the producers trained or frozen; evaluation's
    forward sweep likewise."""
    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    bs = batches(path, 2)
    ref_losses, total = reference_sums(path, trained, bs)
    for compile in (True, False):
        model, w = paged(path, trained, "in_place", tmp_path / str(compile))
        L = len(model.layers)
        blocks = S.Blocks(model, compile=compile)
        for s in range(L - trained, L + 1):
            mbs = [S.MicroBatch.from_batch(*b) for b in bs]
            losses, _, grads = S.paged_value_and_grad(model, w, mbs, blocks=blocks, tail_start=s)
            assert [x.item() for x in losses] == ref_losses, (compile, s)
            assert_bitwise(total, grads)
        # keys and values (output 1) and the rope offset (output 2)
        assert mbs[0].carries.consumers == {(0, 1): [2], (0, 2): [2], (1, 1): [3], (1, 2): [3]}
        assert not blocks.uncompiled
        evaluated = S.paged_loss(model, w, [S.MicroBatch.from_batch(*b) for b in bs], blocks=blocks)
        assert [x.item() for x, _ in evaluated] == ref_losses


def test_carries_with_several_consumers_each_are_bitwise_mlx_lm(tmp_path, monkeypatch):
    """Six layers, the last four sharing: blocks 2 and 4 take block 0's
    keys and values, blocks 3 and 5 block 1's (as Gemma 4 E2B's 20 sharing
    layers take two producers'). Each consumer's vjp is seeded with what
    the consumers above it left, so MLX adds its uses in the order its
    autodiff of the whole model does: the producers' gradients are
    mlx-lm's bit for bit, compiled or not, trained producers or frozen."""
    six = {
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "num_kv_shared_layers": 4,
        "num_hidden_layers": 6,
    }
    monkeypatch.setitem(A.CONFIGS, "gemma4_text", {**A.CONFIGS["gemma4_text"], **six})
    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    bs = batches(path, 2)
    for trained in (6, 4):
        ref_losses, total = reference_sums(path, trained, bs)
        for compile in (True, False):
            model, w = paged(path, trained, "in_place", tmp_path / f"{trained}{compile}")
            mbs = [S.MicroBatch.from_batch(*b) for b in bs]
            blocks = S.Blocks(model, compile=compile)
            losses, _, grads = S.paged_value_and_grad(model, w, mbs, blocks=blocks, tail_start=len(model.layers))
            assert mbs[0].carries.consumers[(0, 1)] == [2, 4] and mbs[0].carries.consumers[(1, 1)] == [3, 5]
            assert [x.item() for x in losses] == ref_losses, (trained, compile)
            assert_bitwise(total, grads)


@pytest.mark.parametrize("how", ["pages in parts", "spilled"])
def test_carries_with_lazy_pages_and_spilled_checkpoints_are_bitwise_mlx_lm(tmp_path, how):
    """One micro-batch, each block in 3 pages read lazily inside its
    forward graph, or every recomputed block's checkpoint spilled to the
    SSD: the carries are kept beside them and the bits are mlx-lm's."""
    from mlx_pager.spill import SpillStore

    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    (batch,) = batches(path, 1)
    ref_losses, total = reference_sums(path, 4, [batch])
    model, w = paged(path, 4, "in_place", tmp_path, page_parts=3 if how == "pages in parts" else None)
    L = len(model.layers)
    mb = S.MicroBatch.from_batch(*batch)
    spill = None
    if how == "spilled":
        mb.record(model)
        spill = SpillStore(w, tmp_path / "spill", mb.h0.nbytes)
    try:
        losses, _, grads = S.paged_value_and_grad(model, w, [mb], tail_start=L, spill=spill, spilled=L if spill else 0)
    finally:
        if spill is not None:
            spill.close()
    assert [x.item() for x in losses] == ref_losses
    assert_bitwise(total, grads)


def test_blocks_returning_more_than_the_hidden_state_are_bitwise_mlx_lm(tmp_path, monkeypatch):
    """gemma4's blocks return (h, shared_kv, offset): the stand-ins return
    as many values (the model unpacks them), the paged blocks pass the
    hidden state on, and no block takes the others (no KV shared across
    layers, as Gemma 4 26B and 31B): the same bits as default_loss,
    compiled, and with a no-recompute tail at every start."""
    dense = {**A._GEMMA4, "num_experts": None, "moe_intermediate_size": None, "enable_moe_block": False}
    monkeypatch.setitem(A.CONFIGS, "gemma4_text", dense)
    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    bs = batches(path, 2)
    ref_losses, total = reference_sums(path, 3, bs)
    model, w = paged(path, 3, "in_place", tmp_path)
    L = len(model.layers)
    blocks = S.Blocks(model)
    for s in range(L - 3, L + 1):
        mbs = [S.MicroBatch.from_batch(*b) for b in bs]
        losses, _, grads = S.paged_value_and_grad(model, w, mbs, blocks=blocks, tail_start=s)
        assert [x.item() for x in losses] == ref_losses, s
        assert_bitwise(total, grads)
    assert S._outputs(model) == 3 and not mbs[0].carries
    assert not blocks.uncompiled


class _Three(nn.Module):
    """A block returning a list of three values, the hidden state first."""

    def __call__(self, h, cache=None):
        return [h * 2, h, None]


class _AppendsToItsCache(nn.Module):
    """A model that writes to a cache object outside its blocks (as
    longcat_flash_ngram's n-gram embedding does) and unpacks three values
    from each block."""

    def __init__(self):
        super().__init__()
        self.layers = [_Three(), _Three()]

    def __call__(self, inputs, cache=None):
        cache[0].seen.append(inputs.shape[1])
        h = inputs.astype(mx.float32)
        for layer, c in zip(self.layers, cache):
            h, _, _ = layer(h, cache=c)
        return h


def test_recording_tries_each_output_count_from_the_caches_as_they_were(tmp_path):
    """The recording tries stand-ins returning 1, 2, 3 values until the
    model's forward pass goes through; what each failed try did to the cache
    objects is undone, so the model's own writes happen once (twice, the
    n-gram cache of longcat_flash_ngram sent decode off mlx-lm's)."""
    model = _AppendsToItsCache()
    cache = [types.SimpleNamespace(seen=[]), types.SimpleNamespace(seen=[])]
    S._OUTPUTS.pop(type(model), None)
    h0, calls = S.record_calls(model, mx.ones((1, 5)), per_block_state=True, cache=cache)
    assert S._outputs(model) == 3 and cache[0].seen == [5]
    assert mx.array_equal(S.run_block(model.layers[0], h0, calls[0]), h0 * 2).item()  # a list's first value


class _CarryBlock(nn.Module):
    """Block 0 makes k = proj(h) and returns it as a carry (`pair`: as
    (k, k), one array twice, as K = V with no norms); the blocks above take
    it and use it in two ops."""

    def __init__(self, width: int, pair: bool):
        super().__init__()
        self.proj, self.pair = nn.Linear(width, width), pair

    def __call__(self, h, shared=None):
        if shared is None:
            k = self.proj(h)
            return h + mx.tanh(k), ((k, k) if self.pair else k)
        a, b = shared if self.pair else (shared, shared)
        return h * a + mx.sin(b) + self.proj(h), None


class _CarryModel(nn.Module):
    def __init__(self, blocks: int, width: int, pair: bool):
        super().__init__()
        self.layers = [_CarryBlock(width, pair) for _ in range(blocks)]

    def __call__(self, x):
        h, k = self.layers[0](x)
        for layer in self.layers[1:]:
            h, _ = layer(h, k)
        return h


def _recorded_carry_model(blocks: int, width: int, pair: bool, seed: int):
    """A _CarryModel, an input, an output cotangent, and the recording:
    (model, x, cot, h0, calls, carries)."""
    mx.random.seed(seed)
    model = _CarryModel(blocks, width, pair)
    x = mx.random.normal((2, 8, width))
    cot = mx.random.normal((2, 8, width))
    S._OUTPUTS.pop(type(model), None)
    h0, calls = S.record_calls(model, x)
    return model, x, cot, h0, calls, S.Carries(calls)


def _whole_model_grads(model, x, cot) -> dict:
    """Every parameter's gradient of sum(model(x) * cot), by MLX's
    autodiff of the whole model."""

    def whole(params):
        model.update(params)
        return (model(x) * cot).sum()

    return dict(tree_flatten(mx.grad(whole)(model.trainable_parameters())))


def test_a_carry_holding_one_array_twice_gets_both_cotangents():
    """MLX's vjp takes one cotangent per distinct output array: returned
    twice, an array gets the first alone. The producer's vjp makes a
    repeated carry leaf distinct, so both consumers' uses reach the
    producer's weights: the gradient of the whole model's."""
    model, x, cot, h0, calls, carries = _recorded_carry_model(2, 4, pair=True, seed=0)
    assert carries.consumers == {(0, 1): [1]}
    p0, p1 = model.layers
    h1, (kv,) = S.run_block(p0, h0, calls[0], (1,))
    assert kv[0] is kv[1]
    g_h1, g1, g_c = S.block_vjp(p1, h1, calls[1], cot, carry.Link(carries, 1, [kv]))
    assert len(g_c) == 2
    _, g0, _ = S.block_vjp(p0, h0, calls[0], g_h1, carry.Link(carries, 0, [], (1,)), g_c)

    ref = _whole_model_grads(model, x, cot)
    for name, g in g0.items():
        assert mx.allclose(ref[f"layers.0.{name}"], g, atol=1e-5).item(), name


def test_a_block_taking_carries_is_measured_with_zeros_of_their_shapes(tmp_path):
    """Gemma 4 E2B with LoRA on its last layers: every trained block takes
    keys and values from a frozen one. The planner's probe measures the
    first trained block itself, given zeros of the carries' shapes (from
    the forward graph on the placeholders: nothing below it is read); it
    had refused to measure, and the plan fell back to its formula."""
    import numpy as np

    from mlx_pager.session import _largest_weight_elems

    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    model, w = paged(path, 2, "in_place", tmp_path)
    first = S.first_trained_block(model)
    assert S.model_carries(model).takes(first)
    before = w.pager.stats()["bytes_read"]
    assert S.probe_block(model, w, first, 1, 16) > 0
    assert w.pager.stats()["bytes_read"] - before <= w.page_read_bytes(w.block_pages[first][0])
    # the dequantized copy a block may hold is of a block weight, not of the
    # embeddings (resident), the largest weight of most models
    blocks = [
        int(np.prod(s.placeholder.shape)) for pid, slots in enumerate(w.slots) if pid != w.resident_id for s in slots
    ]
    resident = [int(np.prod(s.placeholder.shape)) for s in w.slots[w.resident_id]]
    assert max(resident) > max(blocks) == _largest_weight_elems(w)


def test_a_consumer_using_a_carry_twice_adds_its_uses_in_mlx_s_order():
    """Two consumers of one carry, each using it in two ops: the lower
    consumer's vjp is seeded with the upper one's cotangent, so MLX sums
    ((upper + use 2) + use 1), as its autodiff of the whole model does; the
    producer's gradient is the whole model's bit for bit."""
    model, x, cot, h0, calls, carries = _recorded_carry_model(3, 16, pair=False, seed=1)
    assert carries.consumers == {(0, 1): [1, 2]}
    blocks = model.layers
    h1, (k,) = S.run_block(blocks[0], h0, calls[0], (1,))
    h2 = S.run_block(blocks[1], h1, carries.fill(1, calls[1], [k]))
    pending = {}
    g, cots = cot, {}
    for i in (2, 1):
        lk = carry.link(carries, i, {(0, 1): k}, pending)
        g, cots[i], g_c = S.block_vjp(blocks[i], (h2, h1)[2 - i], calls[i], g, lk)
        carry.add_cotangents(lk, g_c, pending)
    lk = carry.link(carries, 0, {}, pending)
    _, g0, _ = S.block_vjp(blocks[0], h0, calls[0], g, lk, pending.pop((0, 1)))

    ref = _whole_model_grads(model, x, cot)
    for name, got in g0.items():
        assert mx.array_equal(ref[f"layers.0.{name}"], got).item(), name


def test_a_carry_passed_on_unchanged_is_counted_once(tmp_path):
    """rwkv7 passes its first block's value residual from block to block:
    three carries, one array. A compiled block returns a copy of an input
    it passes through (a new Python object over the same memory), so the
    step keeps the input itself: the carries measured are one hidden
    state's bytes, compiled or not (counted per copy, the plan reserved
    L - 1 of them)."""
    path = A.build("rwkv7", "bf16", tmp_path / "models")
    (b,) = batches(path, 1)
    model, w = paged(path, 4, "auto", tmp_path)
    for compile in (True, False):
        probe, mb = {}, S.MicroBatch.from_batch(*b)
        S.paged_value_and_grad(model, w, [mb], blocks=S.Blocks(model, compile=compile), tail_start=4, probe=probe)
        assert len(mb.carries.consumers) == 3
        assert probe["carried"][0] == mb.h0.nbytes and probe["carried"][3] == 3, compile


def test_the_step_measures_its_largest_recomputed_block(tmp_path):
    """A hybrid model's recomputed blocks differ in kind (kinds.py): LFM2's
    attention block takes ~2x its convolution blocks at 256 tokens. The
    step's "block" measure, which the next placement is planned from, is
    the largest recomputed block's (it was the topmost one's: a
    convolution block here, which would have planned the attention block at
    half its size)."""
    path = A.build("lfm2", "fp32", tmp_path / "models")
    model, w = paged(path, 4, "auto", tmp_path)
    w.pin_resident()
    attention = S.probe_block(model, w, 1, 1, 256)
    assert S.probe_block(model, w, 2, 1, 256) < 0.7 * attention
    batch = mx.zeros((1, 257), dtype=mx.int32)
    probe, mb = {}, S.MicroBatch.from_batch(batch, mx.array([[0, 256]]))
    S.paged_value_and_grad(model, w, [mb], blocks=S.Blocks(model, compile=False), tail_start=3, probe=probe)
    assert probe["block"][1:] == (1, 256)
    assert probe["block"][0] >= 0.8 * attention, (probe["block"], attention)


def test_a_block_that_loops_over_its_tokens_is_measured_with_its_graph(tmp_path, monkeypatch):
    """Off Metal, mlx-lm runs Qwen3-Next's gated delta as a Python loop
    over the tokens: the block's forward + vjp graph holds ~53 KB of nodes
    a token in the C heap (heap.py), which MLX's peak does not count. At 512
    tokens the graph is ~2x the block's buffers; the start-up probe and the
    step's measure (which later plans learn from) both count it."""
    from mlx_pager import heap

    if heap.in_use() is None:
        pytest.skip("an allocator that says what it holds")
    path = A.build("qwen3_next", "fp32", tmp_path / "models")
    model, w = paged(path, 4, "auto", tmp_path)
    w.pin_resident()
    took = S.probe_block(model, w, 0, 1, 512)  # linear attention
    batch = mx.zeros((1, 513), dtype=mx.int32)
    probe, mb = {}, S.MicroBatch.from_batch(batch, mx.array([[0, 512]]))
    S.paged_value_and_grad(model, w, [mb], blocks=S.Blocks(model, compile=False), tail_start=3, probe=probe)
    monkeypatch.setattr(heap, "in_use", lambda: None)  # MLX's peak alone
    buffers = S.probe_block(model, w, 0, 1, 512)
    assert took >= 2 * buffers, (took, buffers)
    assert probe["block"][0] >= 0.9 * took, (probe["block"], took)
    print(
        f"\nQwen3-Next linear attention, 512 tokens: {took / 1e6:.1f}MB with its graph, buffers {buffers / 1e6:.1f}MB"
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_the_head_measured_on_a_few_tokens_plans_a_longer_batch_s(tmp_path, arch):
    """step.probe_head: the head's loss and gradient measured on one row of
    16 tokens, learned as a factor of the logits' bytes (placement.Sizes.head),
    covers what a batch of more rows and tokens takes. Gemma 2's final
    softcapping keeps more logits-sized arrays than a plain head (6x the
    float32 logits against 4x, measured on a 32,000-token vocabulary)."""
    import dataclasses

    from mlx_pager import modelgen
    from mlx_pager import placement as P

    spec = A.spec_for(arch, "bf16")
    config = dict(spec.config, vocab_size=32000, torch_dtype="float32")
    spec = dataclasses.replace(spec, config=config, dtype="float32", vocab_size=32000, bits=None)
    path = modelgen.generate_model(tmp_path / "model", spec)
    model, w = A.paged(path, 2, "auto", str(tmp_path / "swap"))
    w.pin_resident()
    vocab, hidden = S._vocab_size(model), model.layers[0].input_layernorm.weight.shape[0]
    sz = P.Sizes(hidden=hidden, itemsize=4, vocab=vocab, block_per_token=1, block_len=1)
    sz.learn({"head": (S.probe_head(model, 1, 16), 1, 16)})
    took = S.probe_head(model, 2, 96)
    assert took <= sz.head(2, 96) <= 1.3 * took, (arch, sz.head_factor, took, sz.head(2, 96))
    # a plain head: the logits, their softmax and two gradients; Gemma 2's
    # softcapping two more
    assert (sz.head_factor > 5.5) if arch == "gemma2" else (sz.head_factor < 4.5), sz.head_factor
    print(f"\n{arch}: head factor {sz.head_factor:.2f}, vocabulary {vocab}, 2 x 96 tokens took {took / 1e6:.2f}MB")
