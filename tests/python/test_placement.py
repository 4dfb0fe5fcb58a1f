"""The placement planner (placement.py): the fastest placement that fits,
from measured sizes, and the ladder's smaller ones."""

import pytest

from mlx_pager import placement as P

MB = 1 << 20


def sizes(**kw):
    base = dict(hidden=64, itemsize=4, vocab=1000, block_per_token=4096, block_len=128, head_chunk_bytes=1 * MB)
    base.update(kw)
    return P.Sizes(**base)


def shape(**kw):
    base = dict(num_blocks=8, first_trained=0, footprints=[10 * MB] * 8, rows=4, length=128, batches=1)
    base.update(kw)
    return P.Step(**base)


def test_a_pool_that_holds_everything_recomputes_nothing():
    st, sz = shape(), sizes()
    p = P.choose(st, sz, pool=10**12)
    assert (p.tail_start, p.parts, p.recomputed) == (0, 1, 0)
    assert p.pages == 10 * MB  # the tail streams its pages: one at a time at least


def test_less_memory_means_a_shorter_tail_then_a_split_batch():
    st, sz = shape(), sizes()
    full = P.evaluate(st, sz, 0, 1)
    none = P.evaluate(st, sz, 8, 1)
    assert none.need < full.need
    # a pool between the two: the cheapest that fits (a shorter tail, or the
    # whole tail with the batch split), cheaper than recomputing everything
    mid = P.choose(st, sz, pool=(full.need + none.need) // 2)
    assert mid.need <= (full.need + none.need) // 2 and mid.cost < none.cost
    assert mid.tail_start > 0 or mid.parts > 1
    # every fitting placement costs at least as much as the one chosen
    for q in P.candidates(st, sz):
        if q.need <= (full.need + none.need) // 2:
            assert q.cost >= mid.cost
    # below what recomputing everything needs whole: the batch is split, or
    # the head's loss runs in smaller chunks
    least = P.smallest(st, sz)
    assert least.parts == 4 and least.tail_start >= 7  # a one-block tail needs no more than the sweep
    p = P.choose(st, sz, pool=(none.need + least.need) // 2)
    assert p is not None and (p.parts > 1 or p.head_chunk > 0)
    assert P.choose(st, sz, pool=least.need - 1) is None


def test_a_measured_tail_scales_with_its_blocks_and_tokens():
    sz = sizes()
    sz.learn({"tail": (40 * MB, 4, 2, 128)})  # 4 blocks, 2 rows of 128
    # exact where it was measured, proportional beyond (an overestimate)
    assert sz.tail(4, 2, 128) == 40 * MB
    assert sz.tail(8, 2, 128) == 80 * MB
    assert sz.tail(4, 4, 128) == 80 * MB
    # a shorter tail keeps the head's share: no less than proportional
    assert 20 * MB <= sz.tail(2, 2, 128) < 40 * MB
    # longer sequences: per token, and once more for attention's square
    assert sz.tail(4, 2, 256) == 160 * MB


def test_a_measure_over_fewer_tokens_does_not_replace_a_longer_one():
    sz = sizes()
    sz.learn({"tail": (40 * MB, 4, 2, 128), "forward": (4 * MB, 2, 128)})
    sz.learn({"tail": (10 * MB, 4, 1, 64), "forward": (1 * MB, 1, 64)})  # a short batch
    assert sz.tail(4, 2, 128) == 40 * MB and sz.forward(2, 128) == 4 * MB
    sz.learn({"tail": (44 * MB, 4, 2, 128)})  # as long: the latest counts
    assert sz.tail(4, 2, 128) == 44 * MB
    sz.learn({"tail": (8 * MB, 2, 1, 64)})  # another tail: replaces it whatever its length
    assert sz.tail_blocks == 2 and sz.tail(2, 1, 64) == 8 * MB


def test_a_measured_block_replaces_the_formula():
    sz = sizes(block_fixed=1 * MB)
    before = sz.block(2, 128)
    sz.learn({"block": (3 * MB, 2, 128)})
    assert sz.block(2, 128) == 3 * MB and sz.block(2, 128) != before
    assert sz.block(1, 128) == 1 * MB + 1 * MB  # the weight copy does not shrink with rows


def test_a_block_past_the_rows_measured_is_not_planned_on_the_line():
    """A block's growth per row is not a line (a 4-bit DoRA qwen3 block:
    3.0 MB a row up to 4 rows, 7.3 MB a row from 4 to 16): the line through
    two measures plans the rows between them, and past the most tokens
    measured each row costs at most a one-row block whole."""
    sz = sizes(block_fixed=1 * MB)
    sz.learn({"block_fixed": 24 * MB, "block": (35 * MB, 3, 128)})  # 24 MB fixed, 11/3 MB a row
    row = (35 * MB - 24 * MB) / 3
    assert sz.block(3, 128) == 35 * MB and sz.block(2, 128) == int(24 * MB + 2 * row)
    one_row = 24 * MB + row
    assert sz.block(8, 128) == pytest.approx(35 * MB + 5 * one_row, abs=8)
    # a one-row block measured whole (the formula's weight copy may be more
    # than a row really holds): that, per row past the measure
    sz.learn({"block_one": (26 * MB, 128)})
    assert sz.block(8, 128) == pytest.approx(35 * MB + 5 * 26 * MB, abs=8)
    assert sz.block(3, 128) == 35 * MB
    sz.learn({"block": (70 * MB, 8, 128)})  # measured on the batch: the line again
    assert sz.block(8, 128) == 70 * MB


def test_a_measured_fixed_part_is_planned_once_not_per_row():
    """session.open_session measures a block on one sequence and on a
    batch's: what does not grow with them (DoRA's dense weights) is fixed."""
    sz = sizes(block_fixed=1 * MB)
    sz.learn({"block_fixed": 20 * MB, "block": (36 * MB, 4, 128)})
    assert sz.block(4, 128) == 36 * MB and sz.block(1, 128) == 24 * MB  # the line through both measures
    assert sz.block(2, 256) == 20 * MB + 2 * 4 * MB * 2 * 2  # per token, and attention's square
    sz.learn({"block_fixed": -1 * MB})  # (a measure's noise where nothing is fixed)
    assert sz.block_fixed == 20 * MB
    low = sizes(block_fixed=2 * MB)
    low.learn({"block_fixed": 0})
    assert low.block_fixed == 2 * MB  # never below the formula's weight copy


def test_a_tail_measured_on_other_rows_keeps_its_fixed_part_fixed():
    """A tail is T = F + p * rows (DoRA: F most of it), and a measure on
    one row count tells neither: on more rows the estimate is the lesser of
    per token and the measure plus the blocks' and head's growth per row;
    on fewer, F is at most the blocks' fixed parts. Where nothing is fixed
    (LoRA), it is per token, as before."""
    vocab, length, blocks = 1000, 128, 4
    head_row = 3 * length * vocab * 4
    block_row = 4096 * length  # block_per_token * length: a block's growth per row
    dora = sizes(block_fixed=20 * MB, vocab=vocab)
    dora.learn({"tail": (90 * MB, blocks, 1, length)})  # measured on one sequence
    per_token = 4 * 90 * MB
    assert dora.tail(blocks, 4, length) == per_token  # no block measured: p unbounded
    dora.learn({"block": (20 * MB + block_row, 1, length)})
    # a block measured on one row only: past it, a row costs a one-row block whole
    one_row_block = 20 * MB + block_row
    assert dora.tail(blocks, 4, length) == min(per_token, 90 * MB + 3 * (blocks * one_row_block + head_row))
    dora.learn({"block": (20 * MB + 4 * block_row, 4, length)})  # and on the batch's rows
    assert dora.tail(blocks, 4, length) == min(per_token, 90 * MB + 3 * (blocks * block_row + head_row))
    assert dora.tail(blocks, 4, length) < 0.5 * per_token
    assert dora.tail(blocks, 1, length) == 90 * MB
    dora.learn({"tail": (120 * MB, blocks, 4, length)})  # then on the whole batch
    assert dora.tail(blocks, 4, length) == 120 * MB
    assert dora.tail(blocks, 2, length) == 80 * MB + 40 * MB * 2 // 4  # F = 4 blocks' 20 MB
    assert dora.tail(blocks, 1, 2 * length) >= dora.tail(blocks, 1, length)
    lora = sizes(block_fixed=0, vocab=vocab)
    lora.learn({"tail": (40 * MB, blocks, 4, length)})
    assert lora.tail(blocks, 2, length) == 20 * MB and lora.tail(blocks, 4, length) == 40 * MB
    lora.learn({"tail": (48 * MB, blocks, 8, length)})
    assert lora.tail(blocks, 8, length) == 48 * MB and lora.tail(blocks, 4, length) == 24 * MB


def test_a_tail_measured_on_one_row_and_on_more_plans_the_rows_between_on_their_line():
    """session.open_session measures the tail on one row and on as many of
    a batch's as fit: the rows between are planned on the line through the
    two (a tail's growth per row grows with its rows: above it there), not
    from the fixed part's bound; another tail's measure drops the line."""
    length, blocks = 128, 3
    sz = sizes(block_fixed=20 * MB)
    sz.learn({"tail": (50 * MB, blocks, 1, length)})
    sz.learn({"tail": (120 * MB, blocks, 8, length)})
    assert sz.tail(blocks, 8, length) == 120 * MB
    assert sz.tail(blocks, 1, length) == 50 * MB
    assert sz.tail(blocks, 4, length) == 50 * MB + 70 * MB * 3 // 7
    bound = sizes(block_fixed=20 * MB)  # the same wide measure alone: F's bound
    bound.learn({"tail": (120 * MB, blocks, 8, length)})
    assert bound.tail(blocks, 4, length) == 60 * MB + 60 * MB * 4 // 8
    sz.learn({"tail": (90 * MB, blocks - 1, 4, length)})  # another tail (its blocks)
    assert sz.tail_one_per_token is None
    assert sz.tail(blocks - 1, 2, length) == 40 * MB + 50 * MB * 2 // 4


def test_a_measured_forward_block_sizes_the_sweep_and_not_a_recomputed_block():
    st = shape(footprints=[10 * MB] * 8, first_trained=4)
    sz = sizes(block_fixed=8 * MB)  # the estimate counts a weight copy
    tail = {"tail": (1 * MB, 4, 4, 128)}
    sz.learn(tail)
    streamed = P.evaluate(st, sz, 4, 1)  # nothing recomputed: the sweep is the largest work
    assert streamed.activations >= sz.block(4, 128)  # unmeasured: the forward is sized as a block
    sz.learn({"forward": (2 * MB, 4, 128)})
    assert sz.forward(4, 128) == 2 * MB and sz.forward(2, 128) == 1 * MB
    assert P.evaluate(st, sz, 4, 1).activations < streamed.activations
    assert P.evaluate(st, sz, 4, 1).activations < sz.block(4, 128)
    # a recomputed block runs its forward and vjp: still the block's size
    assert P.evaluate(st, sz, 6, 1).activations >= sz.block(4, 128)


def test_the_ladder_only_goes_down():
    st, sz = shape(), sizes()
    top = P.choose(st, sz, pool=10**12)
    smaller = P.choose(st, sz, pool=10**12, at_most=top)
    assert smaller.need < top.need
    assert smaller.tail_start >= top.tail_start and smaller.parts >= top.parts
    # with a ceiling, a later plan never comes back above it
    again = P.choose(st, sz, pool=10**12, ceiling=smaller)
    assert again.tail_start >= smaller.tail_start and again.parts >= smaller.parts


def test_a_page_cap_does_not_shorten_a_streamed_tail():
    """The tail's weights are streamed (stream.py): a page budget of one
    page still runs every block without recompute, where the activations
    fit; the tensors the tail holds as copies count as activations."""
    st, sz = shape(), sizes()
    p = P.choose(st, sz, pool=10**12, page_cap=15 * MB)
    assert p.pages == 10 * MB and p.tail_start == 0 and p.recomputed == 0
    assert P.choose(st, sz, pool=10**12, page_cap=9 * MB) is None  # not one page
    held = P.evaluate(shape(held=[1 * MB] * 8), sz, 0, 1)
    assert held.activations == P.evaluate(st, sz, 0, 1).activations + 8 * MB
    assert P.evaluate(shape(held=[1 * MB] * 8), sz, 6, 1).activations == P.evaluate(st, sz, 6, 1).activations + 2 * MB


@pytest.mark.parametrize("first", [0, 3, 8])
def test_checkpoints_count_recomputed_blocks_and_batches(first):
    st, sz = shape(first_trained=first, batches=2), sizes()
    p = P.evaluate(st, sz, 8, 1)
    ckpt = sz.checkpoint(4, 128)
    assert p.recomputed == 8 - first
    assert p.activations >= (8 - first + 2) * 2 * ckpt


def test_no_tail_starts_between_a_carry_s_producer_and_consumer_and_carries_are_counted():
    """Carries (carry.py), Gemma 4 E2B-style: blocks 5 and 6 take outputs
    of blocks 2 and 3. No tail starts at 3..6 (the step would run it as
    none); the fastest allowed is the whole stack's; the carries made below
    the tail weigh on the activations, two hidden states each until
    measured, then as measured, and so do the cotangents of a trained
    producer's carries (pending from their consumers' backward down to the
    producer's). Carries from frozen producers (below the first trained
    block) constrain no tail and have no cotangents."""
    st, sz = shape(carries=[(2, 5), (3, 6)]), sizes()
    assert [st.tail_allowed(s) for s in range(9)] == [True] * 3 + [False] * 4 + [True] * 2
    assert {p.tail_start for p in P.candidates(st, sz)} == {0, 1, 2, 7, 8}
    # frozen producers' carries enter a tail as constants: any start
    frozen = shape(first_trained=4, carries=[(2, 5), (3, 6)])
    assert all(frozen.tail_allowed(s) for s in range(4, 9))
    mixed = shape(first_trained=3, carries=[(2, 5), (3, 6)])  # block 3 trained, block 2 frozen
    assert [mixed.tail_allowed(s) for s in range(3, 9)] == [True, False, False, False, True, True]
    plain = shape()
    ckpt = sz.checkpoint(4, 128)
    assert P.evaluate(st, sz, 8, 1).activations == P.evaluate(plain, sz, 8, 1).activations + 2 * 2 * 2 * ckpt
    assert P.evaluate(mixed, sz, 8, 1).activations == P.evaluate(shape(first_trained=3), sz, 8, 1).activations + (
        2 + 1
    ) * (2 * ckpt)
    assert P.evaluate(frozen, sz, 8, 1).activations == P.evaluate(shape(first_trained=4), sz, 8, 1).activations + 2 * (
        2 * ckpt
    )
    assert P.evaluate(st, sz, 0, 1).activations == P.evaluate(plain, sz, 0, 1).activations  # in the tail's graph
    sz.learn({"carried": (2 * 4 * 128 * 100, 4, 128, 2)})  # two carries of 100 bytes a token
    assert sz.carry(4, 128) == 4 * 128 * 100
    assert P.evaluate(st, sz, 8, 1).activations == P.evaluate(plain, sz, 8, 1).activations + 2 * 2 * 4 * 128 * 100
    p = P.choose(st, sz, pool=P.evaluate(st, sz, 7, 1).need)
    assert p.tail_start not in range(3, 7)
    # a prefix running ahead keeps each batch's carries into the blocks above it
    ahead = shape(first_trained=4, carries=[(2, 5), (3, 6), (0, 1)], ahead=3)
    assert P.prefix_outputs(ahead, sz, 4) == sz.checkpoint(4, 128) + 2 * sz.carry(4, 128)
    assert P.evaluate(ahead, sz, 8, 1, ahead=3).waiting == 2 * P.prefix_outputs(ahead, sz, 4)


def test_a_head_too_large_whole_runs_in_the_largest_chunks_that_fit():
    """A large vocabulary's logits (4 x them: softmax and gradients) are the
    step's largest working set with no tail: where they fit whole the head
    runs whole (mlx-lm's own products); where not, in chunks of half the
    tokens, then half that, down to MIN_HEAD_CHUNK_TOKENS, before the batch
    is split."""
    st = shape(rows=2, length=128)
    sz = sizes(vocab=150_000, head_chunk_bytes=0)
    whole = P.evaluate(st, sz, 8, 1)
    assert whole.head_chunk == 0 and sz.head(2, 128) == 4 * 2 * 128 * 150_000 * 4 + 2 * 128 * (2 * 64 + 32) * 4
    options = sz.head_chunk_options(2, 128)
    tokens = [c // (2 * 150_000 * 4) for c in options[1:]]
    assert options[0] == 0 and tokens == [64, 32, 16]
    heads = [sz.head(2, 128, c) for c in options]
    assert heads == sorted(heads, reverse=True)
    assert [sz.head_chunks(2, 128, c) for c in options] == [1, 2, 4, 8]
    # a pool that holds everything: the whole head
    assert P.choose(st, sz, pool=10**12).head_chunk == 0
    # one that holds every block recomputed and the head in chunks of 32
    # tokens, not in 64: chunks of 32, the batch whole
    at32 = P.evaluate(st, sz, 8, 1, head_chunk=options[2])
    p = P.choose(st, sz, pool=at32.need)
    assert (p.tail_start, p.parts, p.head_chunk) == (8, 1, options[2])
    assert P.rung(whole, p) == "head" and "chunks of" in P.describe(p, 8)
    assert p.cost > whole.cost  # each chunk more reads the head once more
    # the least: the smallest chunks, the batch in rows
    least = P.smallest(st, sz)
    assert least.parts == 2 and sz.head_chunks(1, 128, least.head_chunk) == 8
    # a ladder that has chunked the head does not go back to larger chunks
    assert all(q.head_chunk and q.head_chunk <= p.head_chunk for q in P.candidates(st, sz) if P._below(q, p))


def test_a_user_chunk_caps_the_head_and_the_plan_halves_it_from_there():
    st = shape(rows=1, length=128)
    sz = sizes(vocab=150_000, head_chunk_bytes=40 * 150_000 * 4)  # 40 tokens a chunk
    assert sz.head_chunks(1, 128) == 4 and sz.head(1, 128) == 4 * 40 * 150_000 * 4 + 128 * (2 * 64 + 32) * 4
    tokens = [c // (150_000 * 4) for c in sz.head_chunk_options(1, 128)[1:]]
    assert tokens == [16]  # 8 chunks of 16 tokens; no fewer tokens than the floor
    # a tail holds the head in its graph: no chunks planned there
    assert all(p.head_chunk == 0 for p in P.candidates(st, sz) if p.tail_start < 8)


def test_a_chunk_holds_whole_tokens_and_the_head_s_measure_sets_its_factor():
    """A chunk under one token's logits still runs a token (step.head_chunks),
    and counts as one; a measured head replaces the unmeasured 4x."""
    sz = sizes(vocab=150_000, head_chunk_bytes=1000)
    assert sz.head_chunks(2, 64) == 64
    per = (2 * 64 + 32) * 4  # the hidden state's gradient (twice) and the token's small arrays
    assert sz.head(2, 64) == 4 * 2 * 150_000 * 4 + 2 * 64 * per
    sz.learn({"head": (6 * 16 * 150_000 * 4 + 16 * 64 * 4, 1, 16)})  # Gemma 2's softcapping: 6x
    assert sz.head_factor == 6 and sz.head(1, 16) == 6 * 1 * 150_000 * 4 + 16 * per  # a token a chunk
    sz.head_chunk_bytes = 0
    assert sz.head(1, 16) == 6 * 16 * 150_000 * 4 + 16 * per
