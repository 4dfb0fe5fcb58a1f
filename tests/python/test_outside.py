"""Adapters outside the blocks (outside.py): LoRA/DoRA that mlx-lm's
``keys`` put on the LM head and the embeddings train with mlx-lm's loss and
gradients, and generate as mlx-lm does with them."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from conftest import quick_adapters
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from test_step import LORA, assert_bitwise, batches

from mlx_pager import architectures as A
from mlx_pager import modelgen, outside
from mlx_pager import step as S
from mlx_pager.generate import load_paged

Q = "self_attn.q_proj"
HEAD, EMBED = "lm_head", "model.embed_tokens"


def _model(models, tmp_path, arch, bits):
    if arch in ("llama", "qwen3"):
        return models(arch, bits)
    return A.build(arch, bits, tmp_path / "models")


def _randomize(*models):
    """The same random values for every trainable parameter of `models`
    (by name), from a key of their own."""
    flat = tree_flatten(models[0].trainable_parameters())
    keys = mx.random.split(mx.random.key(3), len(flat))
    new = [(n, (0.05 * mx.random.normal(v.shape, key=k)).astype(v.dtype) + v) for (n, v), k in zip(flat, keys)]
    mx.eval([v for _, v in new])
    for m in models:
        m.update(tree_unflatten(new))


@pytest.mark.parametrize(
    "arch, bits, keys, num_layers, tail, dora",
    [
        ("llama", 4, [Q, HEAD], 2, None, False),  # the head's adapter alone: blocks 0-1 stay frozen
        ("llama", 4, [Q, EMBED], 2, None, False),  # the embedding's: every block recomputed down to 0
        ("llama", None, [Q, HEAD, EMBED], 2, 1, True),  # DoRA, a tail segment from block 1
        ("llama", None, [HEAD, EMBED], 0, 0, False),  # no block trained, the whole model one tail
        ("qwen3", 4, [Q, EMBED], 2, 3, False),  # tied: the embedding's adapter is the head's too
        ("gemma", "4bit", [Q, EMBED], 2, None, False),  # tied, its embedding scaled
    ],
)
def test_adapters_on_the_head_and_embeddings_are_bitwise_mlx_lm(
    models, tmp_path, arch, bits, keys, num_layers, tail, dora
):
    path = _model(models, tmp_path, arch, bits)
    lora = dict(LORA, keys=keys)
    (batch,) = batches(path, 1)
    ref = A.reference(path, num_layers, dora=dora, lora=lora)
    model, w = A.paged(path, num_layers, "in_place", str(tmp_path / "c"), dora=dora, lora=lora)
    # The same random adapters in both (a fresh lora_b is zeros: every
    # lora_a gradient would be zeros on both sides).
    _randomize(ref, model)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    names, _ = outside.trainable(model)
    assert names and all(n.startswith(tuple(keys)) for n in names)
    takes_h0 = EMBED in keys
    assert S.first_trained_block(model) == (0 if takes_h0 else len(model.layers) - num_layers)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], tail_start=tail)
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)
    assert all(mx.any(pgrads[n] != 0).item() for n in names)


def _state():
    return mx.array(mx.random.state[0])


def _outside_modules(path):
    """Full names of the model's embeddings and linear layers outside its
    blocks (its head, position embeddings, a wrapper's language model's)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path, lazy=True)
    kinds = (nn.Embedding, nn.QuantizedEmbedding, nn.Linear, nn.QuantizedLinear)
    return [n for n, m in outside.modules(model) if isinstance(m, kinds)]


@pytest.mark.parametrize(
    "arch, rounded",
    [
        ("gpt2", None),  # learned position embeddings (model.wpe) beside the tokens'
        ("internlm2", None),  # its head is named "output"
        ("mamba2", None),  # backbone.embeddings
        ("qwen3_5", None),  # language_model.*: a wrapper's
        ("phixtral", None),  # its head a module holding the linear layer
        # per-layer inputs made from the embeddings: every block takes one
        # (carries made before block 0); the embedding output's three uses
        # sum in another order (test_adapters_that_feed_the_blocks_...)
        ("gemma4_text", "model.embed_tokens."),
        # every block takes the embedding output too (its hidden state
        # second), which is h0 itself: its uses sum in another order
        ("talkie", "model.embed."),
    ],
)
def test_every_module_outside_the_blocks_is_trained_as_mlx_lm_trains_it(tmp_path, arch, rounded):
    """Adapters on all of a model's embeddings and linear layers outside its
    blocks (4-bit, 2 blocks trained): mlx-lm's gradients bit for bit, or,
    `rounded`, off only in those adapters (float rounding: a sum's order).
    (A sweep of every architecture the matrix passes, float32 and 4-bit,
    found no other mismatch.)"""
    path = A.build(arch, "4bit", tmp_path / "models")
    lora = dict(LORA, keys=_outside_modules(path))
    assert lora["keys"]
    off = A.compare(path, 2, cache_dir=str(tmp_path / "c"), head_chunk_bytes=0, lora=lora)
    assert all(rounded and d.startswith(rounded) for d in off), off


def _no_zeros(path, out):
    """A copy of the model at `path` whose float arrays that are all zeros
    are random (a generated model keeps its architecture's init: talkie's
    head was zeros, and every gradient with it)."""
    import shutil

    shutil.copytree(path, out)
    key = mx.random.key(5)
    for f in sorted(out.glob("*.safetensors")):
        arrays = mx.load(str(f))
        for name, v in arrays.items():
            if mx.issubdtype(v.dtype, mx.floating) and not mx.any(v).item():
                key, k = mx.random.split(key)
                arrays[name] = (0.5 * mx.random.normal(v.shape, key=k)).astype(v.dtype)
        mx.save_safetensors(str(f), arrays, metadata={"format": "mlx"})
    return out


@pytest.mark.parametrize(
    "arch, keys, p",
    [
        ("gemma4_text", ["self_attn.q_proj", "model.per_layer_model_projection", "model.embed_tokens_per_layer"], 0),
        ("gemma4_text", ["self_attn.q_proj", "model.embed_tokens", "model.per_layer_model_projection"], 0),
        # with dropout: the embedding's and the projection's masks, both
        # drawn before block 0's (outside.py)
        ("gemma4_text", ["self_attn.q_proj", "model.embed_tokens", "model.per_layer_model_projection"], 0.25),
        # One array every block takes (its embedding skip, e_x, before the
        # hidden state): each block's vjp adds its use to the sum the blocks
        # above it left, as MLX does; but e_x is h0 itself, whose uses in
        # block 0 MLX adds in among them (1e-7 relative).
        ("talkie", ["attn.attn_query", "model.embed"], 0),
    ],
)
def test_adapters_that_feed_the_blocks_besides_the_hidden_state_are_mlx_lm_s(tmp_path, arch, keys, p):
    """Float32, random adapters: where adapters outside the blocks change
    what the model passes its blocks besides h (outside.Prefix.feeds), the
    step takes those arguments as carries made before block 0 and
    differentiates them in every block: mlx-lm's loss bit for bit, and its
    gradients within float rounding (1e-6 relative).
    MLX's autodiff of the whole model sums some cotangents in another order
    than block by block can (gemma4_text's h0 has three uses, block 0's
    residual and norm and the per-layer projection, whose cotangent MLX adds
    between block 0's ops): measured 2e-8 to 1e-7 relative."""
    path = _no_zeros(A.build(arch, "fp32", tmp_path / "models"), tmp_path / "model")
    lora = dict(LORA, keys=keys, dropout=p)
    (batch,) = batches(path, 1)
    ref = A.reference(path, 2, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path / "c"), lora=lora)
    _randomize(ref, model)
    ref.train(), model.train()
    assert outside.prefix(model).feeds and S.first_trained_block(model) == 0
    mx.random.seed(14)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    after = _state()
    mx.random.seed(14)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)])
    assert mx.array_equal(_state(), after).item()
    assert losses[0].item() == loss.item()
    grads = dict(tree_flatten(grads))
    assert set(grads) == set(pgrads)
    for name, g in grads.items():
        assert mx.any(g != 0).item(), name
        off = mx.linalg.norm((g - pgrads[name]).flatten()).item()
        assert off <= 1e-6 * mx.linalg.norm(g.flatten()).item(), (name, off)


@pytest.mark.parametrize("tail", [None, 0])
def test_an_accumulation_group_is_mlx_lm_s_sum_of_its_batches(models, tmp_path, tail):
    """Two batches in one step (gradient accumulation): a tied embedding's
    adapter takes a gradient through the head and one through the embedding
    output per batch; mlx-lm adds each batch's whole gradient to the
    group's, so the step sums each batch's two first (summed by path, the
    sweep found its last bits apart: gemma bf16 DoRA, 4e-8 after 3 steps).
    Bit for bit, every trained block recomputed or the whole model one
    tail."""
    path = models("qwen3", None)
    lora = dict(LORA, keys=[Q, EMBED])
    two = batches(path, 2)
    ref = A.reference(path, 2, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path / "c"), lora=lora)
    _randomize(ref, model)
    total = None
    for batch in two:
        _, g = nn.value_and_grad(ref, default_loss)(ref, *batch)
        g = dict(tree_flatten(g))
        total = g if total is None else {k: g[k] + total[k] for k in g}  # (mlx-lm's grad + prev_grad)
    mx.eval(total)
    _, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*b) for b in two], tail_start=tail)
    assert not A.bitwise_mismatches(total, pgrads)


def test_a_split_batch_and_a_chunked_head_add_up_to_the_whole(models, tmp_path):
    """The head's adapter's gradient is summed over the head's token chunks
    and the micro-batches, the embedding's over the micro-batches: the
    whole batch's, up to float rounding, as close to it as mlx-lm's own
    gradients of the same parts summed (random adapters: ~1e-3 relative)."""
    path = models("llama", None)
    lora = dict(LORA, keys=[Q, HEAD, EMBED])
    batch, lengths = batches(path, 1, batch_size=4)[0]
    ref = A.reference(path, 2, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path / "c"), lora=lora)
    _randomize(ref, model)
    vg = nn.value_and_grad(ref, default_loss)
    (l, n), g = vg(ref, batch, lengths)
    mbs = S.split_batch(batch, lengths, 2)
    parts = {}
    for r in (slice(0, 2), slice(2, 4)):
        (_, n_r), g_r = vg(ref, batch[r], lengths[r])
        for k, v in tree_flatten(g_r):
            parts[k] = parts.get(k, 0) + v * (n_r / n)
    losses, _, grads = S.paged_value_and_grad(model, w, mbs, head_chunk_bytes=20_000)
    assert sum(x.item() for x in losses) == pytest.approx(l.item(), rel=1e-5)
    for k, v in tree_flatten(g):
        theirs = mx.abs(parts[k] - v).max().item()
        assert mx.abs(grads[k] - v).max().item() <= 2 * theirs + 1e-6 * mx.abs(v).max().item(), k


def test_finding_what_the_embedding_output_depends_on_leaves_the_key_sequence_alone(models, tmp_path):
    path = models("llama", 4)
    model, _ = A.paged(path, 2, "in_place", str(tmp_path / "c"), lora=dict(LORA, keys=[Q, EMBED]))
    mx.random.seed(7)
    state = mx.array(mx.random.state[0])
    assert outside.trains_prefix(model)
    assert mx.array_equal(state, mx.random.state[0]).item()
    model, _ = A.paged(path, 2, "in_place", str(tmp_path / "c2"), lora=dict(LORA, keys=[Q, HEAD]))
    assert not outside.trains_prefix(model)
    model, _ = A.paged(path, 2, "in_place", str(tmp_path / "c3"))
    assert outside.trainable(model) == ([], []) and not outside.trains_prefix(model)


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def __call__(self, h, per_layer):
        return self.proj(h) + per_layer


class _PerLayerInputs(nn.Module):
    """A model that passes every block a per-layer input made from its
    embedding output, as Gemma 3n does."""

    def __init__(self, vocab=32, d=8, n=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = [_Block(d) for _ in range(n)]
        self.lm_head = nn.Linear(d, vocab)

    def __call__(self, inputs):
        h = self.embed_tokens(inputs)
        per_layer = 0.5 * h
        for layer in self.layers:
            h = layer(h, per_layer)
        return self.lm_head(h)


def test_what_an_adapter_outside_the_blocks_changes_before_block_0_is_found():
    """outside.prefix: the embedding's adapter changes h0 and every block's
    per-layer input (the first leaf of its call, h aside); the head's changes neither."""
    model = _PerLayerInputs()
    model.freeze()
    linear_to_lora_layers(model, 2, dict(LORA, keys=["proj", "embed_tokens", "lm_head"]))
    found = outside.prefix(model)
    assert found.h0 and found.feeds == ((0, 0), (1, 0)) and found.pairs() == [(-1, 1)]  # one array, both blocks
    assert S.first_trained_block(model) == 0
    model = _PerLayerInputs()
    model.freeze()
    linear_to_lora_layers(model, 2, dict(LORA, keys=["proj", "lm_head"]))
    assert not outside.trains_prefix(model) and outside.prefix(model).feeds == ()


def test_adapters_on_the_head_and_embeddings_generate_as_mlx_lm(models, tmp_path):
    path = models("llama", 4, num_hidden_layers=6)
    ad = tmp_path / "ad"
    quick_adapters(path, ad, tmp_path / "cache", lora_parameters=dict(LORA, keys=[Q, HEAD, EMBED]), val_batches=0)
    saved = mx.load(str(ad / "adapters.safetensors"))
    assert {f"{HEAD}.lora_b", f"{EMBED}.lora_b"} <= set(saved)
    prompt = "the quick brown fox"
    model, tok = mlx_lm.load(str(path), adapter_path=str(ad))
    ref = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=12)]
    del model
    pages = None
    for budget in (None, "two blocks"):
        kw = {}
        if budget is not None:
            kw["page_budget"] = 2 * (max(pages) + 4096)
        paged, ptok = load_paged(str(path), adapter_path=str(ad), ssd_cache_dir=str(tmp_path / "c"), **kw)
        pages = [paged.weights.page_bytes(i) for i in range(paged.weights.num_blocks)]
        assert [r.token for r in mlx_lm.stream_generate(paged, ptok, prompt, max_tokens=12)] == ref


def test_adapters_that_feed_the_blocks_train_and_evaluate_as_mlx_lm_s(tmp_path):
    """gemma4_text's embedding adapter (which changes every block's per-layer
    input) through the CLIs: mlx_lm.lora and mlx-pager lora train it 2 steps
    alike (their gradients within float rounding: test_adapters_that_feed_...;
    the adapters within 1e-4 relative, measured 1e-7), and --test alone
    (nothing differentiated) gives mlx-lm's test loss with mlx-lm's
    adapters. Found two silent bugs: an evaluation's compiled block (no
    carries) reused by training, which then ran without the per-layer inputs
    (62% off after one step); and, at session open, the frozen weights'
    placeholders hiding what the adapters change (per_layer_model_projection's
    left untrained)."""
    import re

    from test_lora_cli import ANSI, cli

    path = A.build("gemma4_text", "fp32", tmp_path / "models")
    keys = "[self_attn.q_proj, model.embed_tokens, model.per_layer_model_projection]"
    (tmp_path / "c.yaml").write_text(f"lora_parameters: {{rank: 4, scale: 20.0, dropout: 0.0, keys: {keys}}}\n")
    data = ["--data", modelgen.SAMPLE_DATA, "--batch-size", 2, "--num-layers", 2]
    run = ["--model", path, "--train", "--iters", 2, "-c", tmp_path / "c.yaml", *data]
    train = cli("mlx_lm", *run, "--adapter-path", tmp_path / "ad")
    assert train.returncode == 0, train.stderr[-2000:]
    paged = ["--memory-budget", "2GB", "--ssd-cache-dir", tmp_path / "c"]
    own = cli("paged", *run, "--adapter-path", tmp_path / "own", *paged)
    assert own.returncode == 0, own.stderr[-2000:]
    ref, got = (
        mx.load(str(tmp_path / "ad" / "adapters.safetensors")),
        mx.load(str(tmp_path / "own" / "adapters.safetensors")),
    )
    assert set(ref) == set(got) and any(k.startswith(EMBED) for k in got)
    for k in ref:
        assert mx.linalg.norm((ref[k] - got[k]).flatten()).item() <= 1e-4 * mx.linalg.norm(ref[k].flatten()).item(), k
    flags = ["--model", path, "--test", "--test-batches", 3, *data, "--adapter-path", tmp_path / "ad"]
    ref = cli("mlx_lm", *flags)
    out = cli("paged", *flags, *paged)
    assert ref.returncode == 0 and out.returncode == 0, out.stderr[-2000:]
    line = re.compile(r"Test loss \d+\.\d+, Test ppl \d+\.\d+\.")
    assert line.findall(ANSI.sub("", out.stdout)) == line.findall(ANSI.sub("", ref.stdout)) != []


@pytest.mark.parametrize(
    "arch, bits, keys, tail, dora",
    [
        ("llama", None, [Q, HEAD, EMBED], None, False),  # every trained block recomputed, down to block 0
        ("llama", None, [Q, HEAD, EMBED], 1, True),  # DoRA, a tail from block 1: the head in its graph
        ("llama", 4, [Q, HEAD], 3, False),  # the head's alone, blocks below frozen
        ("qwen3", None, [Q, EMBED], None, False),  # tied: one dropout module, drawn as embedding and as head
        ("llama", None, [HEAD, EMBED], 0, False),  # no block trained: the whole model one tail
    ],
)
def test_dropout_outside_the_blocks_draws_mlx_lm_s_masks(models, tmp_path, arch, bits, keys, tail, dora):
    """Active dropout on adapters outside the blocks (the embedding's,
    drawn before the blocks' masks in mlx-lm's forward, and the head's,
    after them): the paged step's loss and gradients are mlx-lm's bit for
    bit, and the global key sequence moves as mlx-lm's step moves it."""
    path = models(arch, bits)
    lora = dict(LORA, dropout=0.25, keys=keys)
    (batch,) = batches(path, 1)
    ref = A.reference(path, 2, dora=dora, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path / "c"), dora=dora, lora=lora)
    _randomize(ref, model)
    ref.train(), model.train()
    mx.random.seed(11)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    after = _state()
    mx.random.seed(11)
    losses, _, pgrads = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], tail_start=tail)
    assert losses[0].item() == loss.item()
    assert_bitwise(grads, pgrads)
    assert mx.array_equal(_state(), after).item()
    mx.random.seed(12)  # (other masks move the loss: the dropout is live)
    assert nn.value_and_grad(ref, default_loss)(ref, *batch)[0][0].item() != loss.item()
    assert type(dict(model.named_modules())[f"{keys[-1]}.dropout"]) is nn.Dropout  # put back after the step


def test_dropout_outside_the_blocks_over_a_split_batch_and_head_chunks(models, tmp_path):
    """A batch split to fit, its head in token chunks: each part's masks
    outside the blocks are its rows, and each chunk's its tokens, of the
    whole batch's: the loss is mlx-lm's within float rounding, and far from
    one with other masks; the key sequence moves as mlx-lm's. The gradients
    are mlx-lm's within the split's rounding (random adapters: without
    dropout the same split is 5e-3 off, with it 3.5e-3; a step with other
    masks was 110-130% off)."""
    path = models("llama", None)
    lora = dict(LORA, dropout=0.25, keys=[Q, HEAD, EMBED])
    batch, lengths = batches(path, 1, batch_size=4)[0]
    ref = A.reference(path, 2, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path / "c"), lora=lora)
    _randomize(ref, model)
    ref.train(), model.train()
    vg = nn.value_and_grad(ref, default_loss)
    mx.random.seed(12)
    (loss, _), grads = vg(ref, batch, lengths)
    mx.eval(loss, grads)
    after = _state()
    mx.random.seed(13)
    (other, _), _ = vg(ref, batch, lengths)
    assert abs(other.item() - loss.item()) > 1e-3 * abs(loss.item())  # the masks move the loss
    mx.random.seed(12)
    parts = S.split_batch(batch, lengths, 2)
    losses, _, pgrads = S.paged_value_and_grad(model, w, parts, head_chunk_bytes=20_000)
    assert S.head_chunks(batch.shape[1] - 1, 2, S._vocab_size(model), 20_000) != [(0, batch.shape[1] - 1)]
    assert sum(x.item() for x in losses) == pytest.approx(loss.item(), rel=1e-5)
    for k, g in tree_flatten(grads):
        off = mx.linalg.norm((g - pgrads[k]).flatten()).item()
        assert off <= 2e-2 * mx.linalg.norm(g.flatten()).item(), k
    assert mx.array_equal(_state(), after).item()


def test_dropout_outside_the_blocks_called_between_blocks_is_refused():
    """A dropout outside the blocks that the model calls between two blocks
    (its mask drawn among theirs): refused by name, not trained otherwise."""

    class _Between(_PerLayerInputs):
        def __call__(self, inputs):
            h = self.embed_tokens(inputs)
            h = self.layers[0](h, 0.5 * h)
            h = self.layers[1](self.lm_head(h)[..., : h.shape[-1]], 0.5 * h)
            return self.lm_head(h)

    model = _Between()
    model.freeze()
    linear_to_lora_layers(model, 2, dict(LORA, dropout=0.1, keys=["proj", "lm_head"]))
    model.train()
    with outside.dropouts(model), pytest.raises(ValueError, match="called after block 0, between blocks"):
        outside.dropout_calls(model, mx.zeros((1, 3), dtype=mx.int32))
