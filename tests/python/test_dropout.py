"""dropout.py: the paged step's LoRA dropout masks are the ones mlx-lm draws
from MLX's global key sequence, in mlx-lm's order, whatever order the
paged step runs its blocks in."""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.trainer import default_loss
from test_step import _train_like, batches

from mlx_pager import architectures as A
from mlx_pager import dropout as D
from mlx_pager import step as S

LORA = {"rank": 8, "scale": 20.0, "dropout": 0.1}


class _Logged(nn.Dropout):
    def __init__(self, name, log):
        super().__init__(0.5)
        self.name, self.log = name, log

    def __call__(self, x):
        self.log.append(self.name)
        return super().__call__(x)


class _Block(nn.Module):
    """Two dropouts, called in the other order than registered (a, then b)."""

    def __init__(self, i, log):
        super().__init__()
        self.a = _Logged(f"{i}.a", log)
        self.b = _Logged(f"{i}.b", log)

    def __call__(self, x):
        return self.b(x) * 2 + self.a(x)


def _state():
    return mx.random.state[0]


def test_keys_go_to_the_calls_in_the_order_mlx_lm_draws_them():
    """Global draws, block by block, each block's dropouts in call order
    (not registration order): plan's keys give every call the same mask."""
    log = []
    blocks = [_Block(i, log) for i in range(3)]
    model = type("M", (), {"layers": blocks})()
    x = mx.random.normal((2, 5, 4), key=mx.random.key(1))
    mx.random.seed(3)
    want = []
    for blk in blocks:  # as mlx-lm's forward: nn.Dropout from the global sequence
        want.append(blk(x))
    after = _state()
    mx.random.seed(3)
    mb = type("MB", (), {"inputs": x[..., 0], "row0": 0, "batch_rows": None})()
    plan = D.plan(model, [mb])
    table, n = plan.blocks, plan.draws
    assert n == 6
    for i, blk in enumerate(blocks):
        with D.keyed(blk, table[i][0]) as replaced:
            assert replaced
            got = blk(x)
        assert mx.array_equal(got, want[i]).item()
        assert isinstance(blk.a, _Logged)  # put back
    D.advance(n)
    assert mx.array_equal(_state(), after).item()


def test_grad_checkpoint_redraws_from_the_last_block_down():
    """mlx-lm's --grad-checkpoint runs each checkpointed block again in the
    vjp and draws new masks there, from the last block down (measured with
    mx.checkpoint): plan's backward keys are those draws."""
    log = []
    blocks = [_Block(i, log) for i in range(3)]
    for b in blocks:
        b.w = mx.ones((4,))
    model = type("M", (), {"layers": blocks})()
    x = mx.random.normal((2, 5, 4), key=mx.random.key(1))

    def f(ws):
        h = x
        for b, w in zip(blocks, ws):
            h = mx.checkpoint(lambda h, w, b=b: b(h) * w)(h, w)
        return h.sum()

    mx.random.seed(4)
    mx.eval(mx.grad(f)([b.w for b in blocks]))
    assert log == ["0.b", "0.a", "1.b", "1.a", "2.b", "2.a", "2.b", "2.a", "1.b", "1.a", "0.b", "0.a"]
    after = _state()
    mx.random.seed(4)
    mb = type("MB", (), {"inputs": x[..., 0], "row0": 0, "batch_rows": None})()
    plan = D.plan(model, [mb], {0, 1, 2})
    table, n = plan.blocks, plan.draws
    assert n == 12
    D.advance(n)
    assert mx.array_equal(_state(), after).item()
    mx.random.seed(4)
    keys = [D.plan(model, [mb], set()).blocks[i][0].forward for i in range(3)]
    for i in range(3):
        assert all(mx.array_equal(k, j).item() for k, j in zip(table[i][0].forward, keys[i]))
        assert not any(mx.array_equal(k, j).item() for k, j in zip(table[i][0].backward, keys[i]))


def test_paged_step_with_dropout_is_mlx_lm_s_and_moves_the_key_sequence_alike(models, tmp_path):
    path = models("llama", None, num_hidden_layers=3)
    (batch,) = batches(path, 1)
    ref = A.reference(path, 2, lora=LORA)
    model, w = A.paged(path, 2, "in_place", str(tmp_path), lora=LORA)
    _train_like(ref, model)  # LoRA's B as initialised (zeros) would hide the masks from the loss
    ref.train(), model.train()
    mx.random.seed(5)
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    after = _state()
    for tail_start in (None, 2):  # every trained block recomputed; a no-recompute tail
        mx.random.seed(5)
        losses, _, got = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], tail_start=tail_start)
        assert losses[0].item() == loss.item()
        assert not A.bitwise_mismatches(dict(tree_flatten(grads)), got)
        assert mx.array_equal(_state(), after).item()


def test_a_split_batch_s_parts_take_their_rows_of_the_batch_s_masks(models, tmp_path):
    """Parts of a batch split to fit draw the whole batch's mask and keep
    their rows: their losses sum to mlx-lm's up to float rounding (each
    part's own mask would put it 1e-2 off)."""
    path = models("llama", None, num_hidden_layers=3)
    (batch,) = batches(path, 1, batch_size=4)
    ref = A.reference(path, 2, lora=LORA)
    model, w = A.paged(path, 2, "in_place", str(tmp_path), lora=LORA)
    _train_like(ref, model)
    ref.train(), model.train()
    mx.random.seed(6)
    (loss, _), _ = nn.value_and_grad(ref, default_loss)(ref, *batch)
    after = _state()
    mx.random.seed(6)
    parts = S.split_batch(*batch, 2)
    assert [(p.batch_rows, p.row0) for p in parts] == [(4, 0), (4, 2)]
    losses, _, _ = S.paged_value_and_grad(model, w, parts)
    assert abs(sum(l.item() for l in losses) - loss.item()) <= 1e-5 * abs(loss.item())
    assert mx.array_equal(_state(), after).item()


class _FlatBlock(nn.Module):
    """Its dropout sees the rows flattened with the positions (B*T, D)."""

    def __init__(self):
        super().__init__()
        self.d = nn.Dropout(0.5)

    def __call__(self, x):
        B, T, D = x.shape
        return self.d(x.reshape(B * T, D)).reshape(B, T, D)


def test_a_part_takes_its_rows_of_a_mask_whose_rows_are_flattened_with_positions():
    """A split batch's part draws the batch's mask and keeps its rows, also
    where the dropout's input holds the rows flattened with the positions
    (B*T first): T entries a row."""
    blocks = [_FlatBlock()]
    model = type("M", (), {"layers": blocks})()
    x = mx.random.normal((4, 3, 5), key=mx.random.key(2))
    mx.random.seed(9)
    want = blocks[0](x)  # as mlx-lm: the whole batch's mask from the global sequence
    mx.random.seed(9)
    parts = [type("MB", (), {"inputs": x[r : r + 2, :, 0], "row0": r, "batch_rows": 4})() for r in (0, 2)]
    plan = D.plan(model, parts)
    table, n = plan.blocks, plan.draws
    assert n == 1
    for m, r in enumerate((0, 2)):
        with D.keyed(blocks[0], table[0][m]):
            got = blocks[0](x[r : r + 2])
        assert mx.array_equal(got, want[r : r + 2]).item()


def test_the_planner_s_probe_leaves_the_key_sequence_alone(models, tmp_path):
    path = models("llama", None, num_hidden_layers=3)
    model, w = A.paged(path, 2, "in_place", str(tmp_path), lora=LORA)
    model.train()
    mx.random.seed(7)
    before = _state()
    assert S.probe_block(model, w, 2, 2, 16) > 0
    assert mx.array_equal(_state(), before).item()


def test_sizing_the_carries_leaves_the_key_sequence_alone(tmp_path):
    """step.carried_sizes builds the model's forward graph at start-up to
    size the carries (Gemma 4 E2B-style): its dropout draws from keys of its
    own. From the global sequence, it moved mlx-lm's masks and the sweep
    found a run's losses 0.4% off by its second step."""
    path = A.build("gemma4_text", "bf16", tmp_path / "models")
    model, w = A.paged(path, 4, "in_place", str(tmp_path), lora=LORA)
    model.train()
    mx.random.seed(7)
    before = _state()
    nbytes, rows, length, count = S.carried_sizes(model)
    assert nbytes > 0 and (rows, length, count) == (1, 8, 4)
    assert mx.array_equal(_state(), before).item()


def test_a_block_calling_a_lora_layer_per_position_draws_mlx_lm_s_masks(tmp_path):
    """mamba's block calls x_proj and dt_proj once per position (its scan
    loops over the sequence): with LoRA there, mlx-lm draws a mask per call,
    2 + 2T a block, where one a module would be 4. The plan counts the
    calls on the blocks' forward graph (step.dropout_calls), and the paged
    step is mlx-lm's bit for bit, at two lengths, every trained block
    recomputed or in a tail, and leaves the key sequence where mlx-lm's
    does. (One key a module, the sweep found a run 2e-4 off in its loss.)"""
    path = A.build("mamba", "bf16", tmp_path / "models")
    (batch,) = batches(path, 1)
    lora = dict(LORA, keys=["mixer.x_proj", "mixer.dt_proj", "mixer.in_proj"])
    ref = A.reference(path, 2, lora=lora)
    model, w = A.paged(path, 2, "in_place", str(tmp_path), lora=lora)
    _train_like(ref, model)
    ref.train(), model.train()
    L = len(model.layers)
    for T in (7, 12):
        cut = (batch[0][:, : T + 1], mx.minimum(batch[1], T))
        mx.random.seed(5)
        (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *cut)
        mx.eval(loss, grads)
        after = _state()
        mb = S.MicroBatch.from_batch(*cut)
        mb.record(model)
        assert S.dropout_calls(model, mb)[L - 2 :] == [1 + 2 * T] * 2  # in_proj once, x_proj and dt_proj per position
        for tail_start in (None, L - 1):
            mx.random.seed(5)
            losses, _, got = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*cut)], tail_start=tail_start)
            assert losses[0].item() == loss.item(), (T, tail_start)
            assert not A.bitwise_mismatches(dict(tree_flatten(grads)), got)
            assert mx.array_equal(_state(), after).item()


def test_a_head_s_chunks_take_their_tokens_of_one_whole_mask():
    """dropout.mask for chunks of tokens (the LM head's, outside.py): each
    chunk's mask is its tokens of the whole sequence's, drawn once for all
    chunks (the cache), and a part of a split batch takes its rows too."""
    key = mx.random.key(1)
    whole = mx.random.bernoulli(0.5, (4, 6, 5), key=key)
    cache = {}
    d = D.BlockDraws([key], [key], rows=4, row0=2, part_rows=2)
    x = mx.zeros((2, 3, 5))
    parts = [D.mask(0.5, key, x, d, (t, t + 3, 6), cache) for t in (0, 3)]
    assert len(cache) == 1
    assert mx.array_equal(mx.concatenate(parts, axis=1), whole[2:4]).item()
    assert mx.array_equal(D.mask(0.5, key, mx.zeros((4, 6, 5)), None), whole).item()  # (no window, no rows)
