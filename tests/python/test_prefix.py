"""The frozen prefix run ahead (prefix.py): how far ahead, and that training
with it gives mlx_lm.lora's adapters bit for bit, across validation points,
epochs and a resume."""

import copy
import json
import types

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import SAMPLE, mlx_lm_class_patches_undone, write_jsonl
from mlx_lm.lora import CONFIG_DEFAULTS
from mlx_lm.lora import run as mlx_lm_run

from mlx_pager import placement as P
from mlx_pager import prefix
from mlx_pager.trainer import DEFAULTS
from mlx_pager.trainer import run as paged_run

MB = 1 << 20


def test_ahead_weighs_reads_saved_against_room_taken():
    # outputs tiny beside the prefix: as far ahead as allowed
    assert prefix.choose_ahead(800 * MB, 1 * MB) == prefix.AHEAD_MOST
    # no prefix, or outputs as large as the prefix: not ahead
    assert prefix.choose_ahead(0, 1 * MB) == 1
    assert prefix.choose_ahead(100 * MB, 100 * MB) == 1
    # in between: the best k of prefix * (1 - 1/k) - 2 (k - 1) outputs
    k = prefix.choose_ahead(200 * MB, 16 * MB)
    gain = lambda k: 200 * (1 - 1 / k) - 2 * (k - 1) * 16  # noqa: E731
    assert k == max(range(1, 9), key=gain) and 1 < k < prefix.AHEAD_MOST


class _Block(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)


class _Model(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.layers = [_Block(p) for _ in range(4)]


def test_ahead_only_where_a_prefix_exists_without_dropout():
    fp = [100 * MB] * 4
    m = _Model()
    assert prefix.ahead_for("auto", m, 2, fp, MB) == prefix.AHEAD_MOST
    assert prefix.ahead_for(3, m, 2, fp, MB) == 3
    assert prefix.ahead_for("auto", m, 0, fp, MB) == 1  # every block trained
    assert prefix.ahead_for("auto", m, 4, fp, MB) == 1  # none trained (evaluation)
    assert prefix.ahead_for("auto", _Model(p=0.1), 2, fp, MB) == 1  # its masks would differ


def test_placement_counts_the_waiting_outputs_and_prefers_reading_less():
    sz = P.Sizes(hidden=64, itemsize=4, vocab=1000, block_per_token=4096, block_len=128, head_chunk_bytes=MB)
    st = P.Step(num_blocks=8, first_trained=4, footprints=[10 * MB] * 8, rows=4, length=128, batches=1, ahead=8)
    one, eight = P.evaluate(st, sz, 4, 1), P.evaluate(st, sz, 4, 1, ahead=8)
    assert eight.activations >= one.activations + 7 * sz.checkpoint(4, 128)
    # pages must be read: run ahead; everything fits: do not
    assert P.choose(st, sz, pool=40 * MB).ahead == 8
    assert P.choose(st, sz, pool=10**12).ahead == 1
    # the ladder never goes back above where it has been
    assert P.choose(st, sz, pool=40 * MB, ceiling=one).ahead == 1
    # everything fits and the batches are short: nothing to save either
    short = P.Step(num_blocks=8, first_trained=4, footprints=[10 * MB] * 8, rows=1, length=16, batches=1, ahead=8)
    assert P.choose(short, sz, pool=10**12).ahead == 1


def test_window_outputs_belong_to_one_split():
    w = prefix.Window(groups=[((1,), []), ((2,), [])])
    assert len(w) == 2 and w.left == 2 and not w.ready(1)
    w.outputs, w.parts = [None, None], 2
    assert w.ready(2) and not w.ready(1)
    w.drop()
    assert not w.ready(2)


@pytest.fixture
def small_data(tmp_path):
    """10 train records at batch 2 (an epoch every 5 batches) and a
    validation set: the batch order crosses epochs and validation draws."""
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", recs[:10])
    write_jsonl(d / "valid.jsonl", recs[10:14])
    return d


ARGS = dict(
    train=True,
    batch_size=2,
    num_layers=2,
    learning_rate=1e-3,
    steps_per_report=1,
    steps_per_eval=7,
    save_every=1000,
    seed=0,
    val_batches=1,
)


def page_budget(model, share):
    return int(share * sum(f.stat().st_size for f in model.glob("model*.safetensors")))


def block_budget(model, share):
    """`share` of the blocks' weights (those under a `layers.` path): for a
    model whose embeddings outweigh its blocks."""
    weights = {}
    for f in model.glob("model*.safetensors"):
        weights.update(mx.load(str(f)))
    return int(share * sum(v.nbytes for k, v in weights.items() if ".layers." in k))


def paged(model, data, path, tmp_path, **kw):
    b = dict(DEFAULTS, **ARGS, model=str(model), data=str(data), adapter_path=str(path), quiet=True)
    b.update(ssd_cache_dir=str(tmp_path / "cache"), page_budget=page_budget(model, 0.4))
    b.update(kw)
    return paged_run(types.SimpleNamespace(**copy.deepcopy(b)))


# The 4-bit model keeps float32 scales: MLX's CPU quantized matmul in
# bfloat16 is ~10x slower than in float32 (this test's three 20-iteration runs
# took 160 s in bfloat16); the bfloat16 4-bit sweep is test_step's.
@pytest.mark.parametrize(
    "arch, bits, dtype, accumulate",
    [("llama", None, "bfloat16", 1), ("qwen3", 4, "float32", 2), ("gemma4_text", None, "bfloat16", 2)],
)
def test_running_ahead_gives_mlx_lm_adapters(models, small_data, tmp_path, arch, bits, dtype, accumulate):
    """20 iterations with the prefix run ahead under a page budget that
    reads every step: windows of several steps, cut before each validation
    point, and the adapters and losses of mlx_lm.lora and of the same run
    not ahead, bit for bit. gemma4_text (Gemma 4 E2B-style): the trained
    blocks take keys and values from the prefix's (carry.py), which the
    sweep leaves for each step beside its hidden states."""
    if arch == "gemma4_text":
        from mlx_pager import architectures as A

        model = A.build(arch, "bf16", tmp_path / "models")
        # Its per-layer embeddings outweigh its blocks, and its batches'
        # outputs (hidden states and carries) its two prefix blocks: a
        # window is asked for, not chosen.
        budget = dict(page_budget=block_budget(model, 0.6), prefix_ahead=4)
    else:
        model = models(arch, bits, num_hidden_layers=6, dtype=dtype)
        budget = {}
    a = dict(CONFIG_DEFAULTS, **ARGS, model=str(model), data=str(small_data), adapter_path=str(tmp_path / "ref"))
    a.update(iters=20, grad_accumulation_steps=accumulate)
    with mlx_lm_class_patches_undone():
        mlx_lm_run(types.SimpleNamespace(**copy.deepcopy(a)))
    ahead = paged(
        model, small_data, tmp_path / "ahead", tmp_path, iters=20, grad_accumulation_steps=accumulate, **budget
    )
    alone = paged(
        model,
        small_data,
        tmp_path / "alone",
        tmp_path,
        iters=20,
        grad_accumulation_steps=accumulate,
        **{**budget, "prefix_ahead": 1},
    )
    windows = [tuple(s["window"]) for s in ahead.steps]
    assert max(n for n, _ in windows) > 1 and any(s["prefix_ahead"] for s in ahead.steps)
    assert windows[0] == (1, 0)  # the first step is a window alone
    assert all(s["window"] == [1, 0] for s in alone.steps)
    # a window never runs past a validation point (iteration 1, 7, 14, 20)
    its = [s["iteration"] for s in ahead.steps]
    for v in (7, 14):
        at = next(i for i, it in enumerate(its) if it >= v)
        assert windows[at][1] == 0, (v, windows)
    ref = mx.load(str(tmp_path / "ref" / "adapters.safetensors"))
    for run in (ahead, alone):
        got = mx.load(str(run.adapter_file))
        for k in ref:
            assert mx.array_equal(ref[k], got[k]).item(), k
    assert ahead.val_losses == alone.val_losses
    assert [s["loss"] for s in ahead.steps] == [s["loss"] for s in alone.steps]
    # fewer bytes read: the prefix's blocks once a window
    read = lambda r: sum(s["bytes_read"] for s in r.steps[1:])  # noqa: E731
    assert read(ahead) < read(alone)


def test_resume_mid_run_is_the_uninterrupted_run(models, small_data, tmp_path):
    model = models("llama", None, num_hidden_layers=6)
    full = paged(model, small_data, tmp_path / "full", tmp_path, iters=12, save_every=3)
    paged(model, small_data, tmp_path / "cut", tmp_path, iters=5, save_every=3)
    rest = paged(model, small_data, tmp_path / "cut", tmp_path, iters=12, save_every=3, resume=True)
    assert max(s["window"][0] for s in rest.steps) > 1
    by_it = {s["iteration"]: s["loss"] for s in full.steps}
    assert all(by_it[s["iteration"]] == s["loss"] for s in rest.steps)
    a = mx.load(str(tmp_path / "full" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "cut" / "adapters.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_the_plan_counts_the_sweep_s_batches_and_one_forward_block():
    """The sweep holds every batch's input and output, and one forward
    block's working set (each batch through a block on its own)."""
    sz = P.Sizes(hidden=64, itemsize=4, vocab=1000, block_per_token=4096, block_len=16, head_chunk_bytes=MB)
    st = P.Step(num_blocks=8, first_trained=4, footprints=[10 * MB] * 8, rows=1, length=16, batches=1, ahead=8)
    p = P.evaluate(st, sz, 8, 1, ahead=8)
    assert p.activations >= 2 * 8 * sz.checkpoint(1, 16) + sz.forward(1, 16)
