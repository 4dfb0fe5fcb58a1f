"""The paging set-up (session.py): the budget's minimum is a property of the
model, the data and the flags, not of whether this run just wrote the swap
file (writing it leaves heap behind, which the plan used to count as the
process's baseline)."""

import re
import subprocess
import sys
import types

import pytest
from conftest import SAMPLE

from mlx_pager import placement as P
from mlx_pager.session import Session


def minimum(model, tmp_path, cache, budget="20MB"):
    out = run(model, tmp_path, cache, budget)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    m = re.search(r"needs at least ([\d.]+)MB", out.stderr)
    assert m, out.stderr
    return float(m.group(1))


def run(model, tmp_path, cache, budget):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_pager.cli",
            "lora",
            "--model",
            str(model),
            "--train",
            "--data",
            str(SAMPLE),
            "--iters",
            "1",
            "--num-layers",
            "2",
            "--store",
            "swap",
            "--memory-budget",
            budget,
            "--adapter-path",
            str(tmp_path / "a"),
            "--ssd-cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_least_budget_a_refusal_names_is_taken(models, tmp_path):
    """The least budget counts the process's baseline, which moves between
    runs of one command by up to ~1%: given the least a refusal named, the
    same command was refused again with one a little larger (183.20MB, then
    183.46MB, then 183.75MB). The least named holds that spread."""
    model = models("llama", None, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    cache = tmp_path / "cache"
    least = minimum(model, tmp_path, cache)
    for _ in range(2):
        out = run(model, tmp_path, cache, f"{least:.2f}MB")
        assert out.returncode == 0, out.stderr[-2000:]


def test_minimum_budget_does_not_depend_on_writing_the_swap_file(models, tmp_path):
    model = models("llama", None, hidden_size=512, intermediate_size=2048, num_hidden_layers=4)
    cache = tmp_path / "cache"
    fresh = minimum(model, tmp_path, cache)  # writes the swap file
    assert any(cache.rglob("*.swap"))
    warm = minimum(model, tmp_path, cache)  # reuses it
    assert abs(fresh - warm) <= 0.02 * warm, (fresh, warm)


def test_page_parts_auto_splits_blocks_only_below_a_few_blocks_of_budget():
    from mlx_pager.session import AUTO_MIN_PARTS, PARTS_BELOW_BLOCKS, page_parts
    from mlx_pager.store import MAX_PAGE_PARTS, PAGE_PART_BYTES

    blocks = [100 << 20] * 6
    assert page_parts(3, blocks, 1) == 3  # a number is taken as given
    assert page_parts("auto", blocks, None) == 1  # budget unknown: whole
    assert page_parts("auto", blocks, PARTS_BELOW_BLOCKS * (100 << 20)) == 1
    assert page_parts("auto", blocks, PARTS_BELOW_BLOCKS * (100 << 20) - 1) == AUTO_MIN_PARTS
    big = [20 * PAGE_PART_BYTES]
    assert page_parts("auto", big, big[0]) == MAX_PAGE_PARTS  # ~48 MB each, at most 8
    assert page_parts("auto", [], 1) == 1
    # Where the budget does not hold a block in parts (each part's alignment
    # and read-through) and it is smaller whole, whole: a bound block's parts
    # must fit together (where neither fits, the plan names the smaller).
    whole, split = 100 << 20, (100 << 20) + 5 * 4096
    fp = lambda n: whole if n == 1 else split  # noqa: E731
    assert page_parts("auto", blocks, whole, fp) == 1
    assert page_parts("auto", blocks, whole - 1, fp) == 1
    assert page_parts("auto", blocks, split, fp) == AUTO_MIN_PARTS
    wider = lambda n: split if n == 1 else whole  # noqa: E731  (a whole page reading through gaps)
    assert page_parts("auto", blocks, whole - 1, wider) == AUTO_MIN_PARTS


def run_one_step(model, tmp_path, name, callback=None, **kw):
    import types

    from mlx_pager.trainer import DEFAULTS, run

    args = dict(
        DEFAULTS,
        train=True,
        model=str(model),
        data=str(SAMPLE),
        iters=1,
        batch_size=1,
        num_layers=2,
        max_seq_length=64,
        steps_per_report=1,
        steps_per_eval=10**9,
        save_every=10**9,
        val_batches=1,
        seed=0,
        adapter_path=str(tmp_path / name),
        ssd_cache_dir=str(tmp_path / "cache"),
        quiet=True,
    )
    args.update(kw)
    return run(types.SimpleNamespace(**args), callback)


def test_a_block_s_fixed_memory_is_measured_not_planned_per_token(models, tmp_path):
    """DoRA builds each linear's dense weight and its adapted copy whatever
    the tokens. The session measures one block on one sequence and on a
    batch's and plans what does not grow with them as fixed: the block it
    plans for the batch is the block measured on the batch, not ~3x it, as
    planned per token (which split the first steps' batches 4
    ways at 500 MB on a 14 MB model: the adapters then differed from
    mlx-lm's in the last bits). The tail is measured before the first step
    too, where its estimate fits the memory budget."""
    from mlx_pager import segment, step
    from mlx_pager.callbacks import PagerCallback

    rows = 4
    model = models("qwen3", 4, hidden_size=512, intermediate_size=1536, num_hidden_layers=3)

    class Measure(PagerCallback):
        def on_session(self, s):
            length, first = s.seq_len, s.first_trained
            self.planned = s.sizes.block(rows, length)
            self.one = step.probe_block(s.model, s.weights, first, 1, length)
            self.measured = step.probe_block(s.model, s.weights, first, rows, length)
            self.fixed = s.sizes.block_fixed
            self.tail_measured = s.sizes.tail_per_token is not None
            blocks = len(s.model.layers) - first
            self.tail_planned = s.sizes.tail(blocks, rows, length)
            self.tail_wide = segment.probe_tail(s.model, s.weights, first, rows, length, s.args.head_chunk_bytes)

    m = Measure()
    out = run_one_step(
        model, tmp_path, "dora", m, fine_tune_type="dora", batch_size=rows, num_layers=-1, memory_budget="4GB"
    )
    assert out.steps[0]["batch_parts"] == 1
    # the tail too, where its estimate for one sequence fits the budget
    assert m.tail_measured
    assert m.fixed > 0.5 * m.one, (m.fixed, m.one)  # mostly fixed at these lengths
    # (two measures of one size differ by up to ~3% in one process; the
    # plan's slack and margin hold that)
    assert 0.95 * m.measured <= m.planned <= 1.5 * m.measured, (m.planned, m.measured, rows * m.one)
    # the tail measured on one sequence, planned for the batch: not per token
    # (~2.8x: the first step split the batch at budgets its steps ran whole)
    assert 0.95 * m.tail_wide <= m.tail_planned <= 1.5 * m.tail_wide, (m.tail_planned, m.tail_wide)


def test_a_batch_the_first_probe_has_no_room_for_is_measured_on_more_rows(models, tmp_path):
    """A block's (and a tail's) growth per row grows with its rows (a 4-bit
    DoRA qwen3 block: 3.0 MB a row up to 4 rows, 7.3 MB from 4 on): where
    the room left the block probe 3 of a batch's 8 rows, the line through 1
    and 3 rows planned the first step's 8-row tail 4% under what it took,
    and the step peaked 3.5% over its budget. The block is now measured on
    more rows where they fit (at most a one-row block each), and the tail
    on one row and on as many as fit: the batch's rows are planned at no
    less than they take, and the split batch's parts not far over."""
    from mlx_pager import segment, step
    from mlx_pager.callbacks import PagerCallback

    rows = 8
    model = models("qwen3", 4, hidden_size=512, intermediate_size=1536, num_hidden_layers=3)

    class Room(PagerCallback):
        def on_session(self, s):
            length, first = s.seq_len, s.first_trained
            self.fixed = s.plan.fixed_without_activations
            self.one = step.probe_block(s.model, s.weights, first, 1, length)
            self.max_page = s.weights.max_block_charge

    class Measure(PagerCallback):
        def on_session(self, s):
            length, first, blocks = s.seq_len, s.first_trained, len(s.model.layers) - s.first_trained
            z = s.sizes
            self.block_tokens = z._tokens["block"]
            self.tail_rows = z.tail_rows
            self.length = length
            self.block = {
                r: (z.block(r, length), step.probe_block(s.model, s.weights, first, r, length)) for r in (4, 8)
            }
            chunk = s.args.head_chunk_bytes
            self.tail = {
                r: (z.tail(blocks, r, length), segment.probe_tail(s.model, s.weights, first, r, length, chunk))
                for r in (2, 4, 8)
            }

    common = dict(fine_tune_type="dora", batch_size=rows, num_layers=-1, iters=0)
    room = Room()
    run_one_step(model, tmp_path, "room", room, memory_budget="4GB", **common)
    # the room as the session sees it: the first wide probe takes 3 rows
    budget = room.fixed + room.max_page + int(3.5 * room.one)
    m = Measure()
    run_one_step(model, tmp_path, "tight", m, memory_budget=str(budget), **common)
    assert m.block_tokens > 3 * m.length, (m.block_tokens, m.length)  # more rows than the first probe's 3
    for r, (planned, took) in m.block.items():
        assert planned >= 0.97 * took, (r, planned, took)
    assert m.tail_rows > 1
    for r, (planned, took) in m.tail.items():
        assert planned >= 0.97 * took, (r, planned, took)
    assert m.tail[2][0] <= 1.3 * m.tail[2][1], m.tail


def test_page_parts_auto_follows_the_planned_page_budget(models, tmp_path):
    """--page-parts auto (the default): whole blocks where the budget holds
    several, parts where it holds about one; the step's math is the same."""
    from mlx_pager._core import IO_ALIGN
    from mlx_pager.session import PARTS_BELOW_BLOCKS
    from mlx_pager.store import MAX_PAGE_PARTS

    model = models("llama", None, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    roomy = run_one_step(model, tmp_path, "roomy", memory_budget="4GB")
    assert all(len(p) == 1 for p in roomy.block_pages)
    block = max(roomy.page_footprints)
    tight = run_one_step(model, tmp_path, "tight", page_budget=block + 2 * MAX_PAGE_PARTS * IO_ALIGN)
    assert all(len(p) > 1 for p in tight.block_pages), tight.block_pages
    assert tight.train_losses == roomy.train_losses
    enough = run_one_step(model, tmp_path, "enough", page_budget=PARTS_BELOW_BLOCKS * block)
    assert all(len(p) == 1 for p in enough.block_pages)
    # The trained blocks as the tail: held (bound once, compiled) where
    # their pages fit beside another block, streamed through a block's room.
    assert roomy.steps[-1]["tail_held"] and roomy.steps[-1]["recomputed_blocks"] == 0
    assert not tight.steps[-1]["tail_held"]


def test_page_parts_auto_pages_whole_where_a_block_fits_the_budget_only_whole(models, tmp_path):
    """A small 4-bit block in parts is charged more than whole (each part's
    alignment): at a budget between the two, --page-parts auto pages whole
    blocks and the run trains and validates (in parts, binding a block for
    validation failed: its parts did not fit the budget together)."""
    from mlx_lm.utils import load_model

    from mlx_pager.session import AUTO_MIN_PARTS
    from mlx_pager.store import block_footprints

    model = models("qwen3", 4, num_hidden_layers=6)

    def footprint(parts):
        m, _ = load_model(model, lazy=True)
        m.freeze()
        return max(block_footprints(m, model, parts))

    whole, split = footprint(1), footprint(AUTO_MIN_PARTS)
    assert split > whole
    roomy = run_one_step(model, tmp_path, "roomy", memory_budget="4GB")
    between = run_one_step(model, tmp_path, "between", page_budget=(whole + split) // 2, steps_per_eval=1)
    assert all(len(p) == 1 for p in between.block_pages)
    assert between.train_losses == roomy.train_losses and between.val_losses


def test_a_page_budget_under_one_block_is_refused_naming_the_least(models, tmp_path):
    """The least is named in bytes, and in decimal units rounded up: given
    back as written, either one trains (rounded to nearest, "at least
    192.51KB" parsed 2 bytes under a least of 192512, and the same message
    came back). A page budget may be written as a size."""
    import re

    from mlx_lm.utils import load_model

    from mlx_pager.budget import BudgetError, format_size, parse_size
    from mlx_pager.store import block_footprints

    model = models("qwen3", 4, num_hidden_layers=6)
    m, _ = load_model(model, lazy=True)
    m.freeze()
    whole = max(block_footprints(m, model, 1))
    with pytest.raises(BudgetError, match="page_budget") as e:
        run_one_step(model, tmp_path, "small", page_budget=whole // 2, page_parts=1)
    assert f"at least {whole} ({format_size(whole, up=True)})" in str(e.value)
    with pytest.raises(BudgetError, match="page_budget"):
        run_one_step(model, tmp_path, "small", page_budget=whole - 1, page_parts=1)
    text = re.search(r"at least \d+ \((\S+)\)", str(e.value)).group(1)
    assert whole <= parse_size(text) < whole + 10
    assert run_one_step(model, tmp_path, "given", page_budget=text, page_parts=1).train_losses
    with pytest.raises(BudgetError, match="invalid page_budget '12 KB'"):
        run_one_step(model, tmp_path, "bad", page_budget="12 KB")


def test_evaluation_sweeps_as_many_batches_as_their_hidden_states_leave_room_for():
    """Session.eval_group: each batch keeps two hidden states, beside one
    forward block's working set (a batch at a time): that block, measured
    forward-only, decides how many go in a sweep (not a recomputed block's
    forward and vjp, which evaluation never runs)."""
    sz = P.Sizes(hidden=64, itemsize=4, vocab=1000, block_per_token=4096, block_len=16, head_chunk_bytes=1 << 10)
    rows, length = 1, 16

    def group(activations, accumulate=1):
        s = types.SimpleNamespace(
            args=types.SimpleNamespace(batch_size=rows, grad_accumulation_steps=accumulate),
            parts=1,
            seq_len=length,
            sizes=sz,
            placement=None,
            plan=types.SimpleNamespace(activations=activations),
        )
        return Session.eval_group(s)

    def needs(n):
        work = max(sz.head(rows, length), sz.forward(rows, length))
        return n * 2 * sz.checkpoint(rows, length) + work

    # unmeasured, the forward is sized as a recomputed block
    assert needs(8) >= sz.block(rows, length) + 8 * 2 * sz.checkpoint(rows, length)
    assert group(needs(8)) == 8
    assert group(needs(8) - 1) == 7
    assert group(needs(3)) == 3
    assert group(0) == 1  # at least one
    assert group(1 << 40, accumulate=16) == 16  # as many as a step's batches
    # measured: a forward-only block, smaller than a recomputed one, leaves room for more
    sz.block_fixed = 1 << 30
    sz.learn({"forward": (64 * 1024, rows, length)})
    assert sz.block(rows, length) > 1 << 30
    assert group(needs(8)) == 8 and needs(8) < 1 << 20


def test_the_estimate_reads_a_nested_text_config():
    """Gemma 3 / 4, Llama 4 and Mistral 3 keep their sizes in text_config:
    the estimate reads them there (the top level wins where both say)."""
    from mlx_pager.session import estimate_sizes

    config = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "vocab_size": 262_208}}
    sz = estimate_sizes(config, 128, 2, 0, 1000)
    assert (sz.hidden, sz.vocab) == (2560, 262_208)
    assert estimate_sizes(dict(config, vocab_size=1000), 128, 2, 0, 1000).vocab == 1000


def test_attention_runs_in_chunks_only_where_one_sequence_does_not_fit_whole(attention_bound, tmp_path):
    """One sequence of ~2,000 tokens, 16 heads: its block takes ~900 MB
    with its attention whole. With room for that the step runs MLX's own
    attention (mlx-lm's arithmetic); with 350 MB over what the process
    holds it runs in chunks of
    query rows (attention.py), with the same loss to float32 rounding; too
    small even for chunks, the run is refused naming its least budget.
    MLX's own attention function is back after each (the session's close,
    or the refusal)."""
    import mlx.core as mx

    from mlx_pager import attention
    from mlx_pager.budget import BudgetError
    from mlx_pager.governor import process_rss

    model, data = attention_bound
    kw = dict(data=str(data), max_seq_length=2048, num_layers=-1)
    # (budgets over what this process holds: a whole suite's ~240 MB, ~120 alone)
    held = process_rss()
    whole = run_one_step(model, tmp_path, "whole", memory_budget="4GB", **kw)
    assert mx.fast.scaled_dot_product_attention is attention._original
    budget = held + 350 * 10**6
    chunked = run_one_step(model, tmp_path, "chunked", memory_budget=budget, **kw)
    assert mx.fast.scaled_dot_product_attention is attention._original
    assert whole.steps[0]["attention_chunk"] == 0
    assert 0 < chunked.steps[0]["attention_chunk"] < 2048
    assert chunked.steps[0]["step_peak_rss_bytes"] <= budget
    assert abs(whole.steps[0]["loss"] - chunked.steps[0]["loss"]) <= 1e-5 * abs(whole.steps[0]["loss"])
    with pytest.raises(BudgetError, match="attention in chunks of 32 queries"):
        run_one_step(model, tmp_path, "small", memory_budget="200MB", **kw)
    assert mx.fast.scaled_dot_product_attention is attention._original

    # Evaluation alone: one block's forward measured (not the formula's
    # forward + vjp, which named 1.88 GB), its attention in chunks where
    # whole it does not fit; the test loss is the whole one's.
    from mlx_pager.callbacks import PagerCallback

    class Chunk(PagerCallback):
        def on_session(self, s):
            self.chunk = s.attention_chunk

    test = dict(kw, train=False, test=True, adapter_path=str(tmp_path / "whole"))
    seen = [Chunk(), Chunk()]
    big = run_one_step(model, tmp_path, "whole", seen[0], memory_budget="4GB", **test)
    small = run_one_step(model, tmp_path, "whole", seen[1], memory_budget=held + 250 * 10**6, **test)
    assert seen[0].chunk == 0 and 0 < seen[1].chunk < 2048
    assert abs(big.test_loss - small.test_loss) <= 1e-5 * big.test_loss
    assert mx.fast.scaled_dot_product_attention is attention._original


def test_kinds_whose_compiled_graph_takes_more_run_uncompiled(tmp_path):
    """On the CPU backend mlx-lm's gated delta (Qwen3-Next's linear
    attention) is a loop over the tokens, and mx.compile's graph of it
    holds ~7x the uncompiled one's memory at 256 tokens (its square of the
    length: 2.9 GB against 59 MB at 2,048 for a tiny block). The session
    measures each kind of block both ways (session.compiled_over) and runs
    those kinds uncompiled, the tail too; Qwen3-Next's full-attention
    block, and every llama block, stay compiled."""
    import mlx.core as mx

    from mlx_pager import architectures as A
    from mlx_pager import kinds
    from mlx_pager import step as S
    from mlx_pager.session import compiled_over

    def check(arch, length=256, room=float("inf")):
        path = A.build(arch, "fp32", tmp_path / "models")
        model, w = A.paged(path, 4, "auto", str(tmp_path / f"{arch}-{length}-swap"))
        w.pin_resident()
        calls = S.record_calls(model, mx.zeros((1, length), dtype=mx.int32))[1]
        standing = kinds.represented(model, calls, range(4), [w.block_charge_bound(i) for i in range(4)])
        blocks = S.Blocks(model, compile=True)
        said = compiled_over(model, w, blocks, standing, length, room)
        return blocks, said

    blocks, said = check("qwen3_next")
    assert sorted(blocks.uncompiled) == [0, 1, 2], (blocks.uncompiled, said)
    assert blocks.tail.uncompiled is not None
    assert len(said) == 2 and all("run" in s and "uncompiled: compiled, block" in s for s in said), said
    blocks, said = check("llama")
    assert not blocks.uncompiled and blocks.tail.uncompiled is None and not said
    # With no room for a compiled probe beside the uncompiled one, a kind
    # runs uncompiled.
    blocks, said = check("llama", 64, 1e6)
    assert sorted(blocks.uncompiled) == [0, 1, 2, 3] and "no room" in said[0], said


def test_a_step_s_block_measure_counts_only_where_the_largest_kind_was_recomputed():
    """A hybrid model's step measures its recomputed blocks; where the
    largest kind (start-up: kinds.py) ran only in the tail, its measure is
    a smaller kind's and must not replace the start-up one."""
    from mlx_pager.session import kept_measures

    probe = {"block": (10, 1, 64), "tail": (50, 2, 1, 64)}
    assert kept_measures(probe, range(0, 2), [3]) == {"tail": (50, 2, 1, 64)}
    assert kept_measures(probe, range(0, 4), [3]) == probe
    assert kept_measures(probe, range(0, 2), []) == probe  # (one kind)
    assert kept_measures({"tail": (50, 2, 1, 64)}, range(0, 2), [3]) == {"tail": (50, 2, 1, 64)}
