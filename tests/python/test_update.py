"""The compiled optimizer update: the same bits as optimizer.update, for
every optimizer mlx-pager offers, with a schedule, across a replaced state
(resume), and uncompiled where a trace fails."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from mlx_pager import update as U
from mlx_pager.update import OptimizerStep


class Net(nn.Module):
    """Frozen weights beside trainable ones, in lists as mlx-lm's layers."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(8, 8), nn.Linear(8, 6), nn.Linear(6, 4)]
        self.layers[0].freeze()
        self.scale = mx.ones((4,))


def model():
    mx.random.seed(3)
    m = Net()
    mx.eval(m.parameters())
    return m


def grads_for(m, k):
    key = mx.random.key(k)
    return tree_map(lambda p: mx.random.normal(p.shape, key=key), m.trainable_parameters())


OPTIMIZERS = {
    "adam": lambda lr: optim.Adam(learning_rate=lr),
    "adamw": lambda lr: optim.AdamW(learning_rate=lr, weight_decay=0.1),
    "sgd": lambda lr: optim.SGD(learning_rate=lr, momentum=0.9),
    "adafactor": lambda lr: optim.Adafactor(learning_rate=lr),
    "muon": lambda lr: optim.Muon(learning_rate=lr),
}


def run_steps(make, compile, steps=4, schedule=False, swap_state_at=None):
    m = model()
    lr = optim.cosine_decay(1e-2, 10) if schedule else 1e-2
    opt = make(lr)
    upd = OptimizerStep(m, opt, compile=compile)
    for k in range(steps):
        if swap_state_at == k:
            # What resume.load does: a new state dict, read back from arrays.
            opt.state = tree_map(lambda x: mx.array(x), opt.state)
        upd(grads_for(m, k))
    return m, opt, upd


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", [False, True])
def test_compiled_update_is_the_plain_update_bit_for_bit(name, schedule):
    ref, ref_opt, _ = run_steps(OPTIMIZERS[name], False, schedule=schedule)
    got, got_opt, upd = run_steps(OPTIMIZERS[name], True, schedule=schedule)
    assert upd.uncompiled is None, upd.uncompiled
    for (n, a), (_, b) in zip(tree_flatten(ref.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), n
    for (n, a), (_, b) in zip(tree_flatten(ref_opt.state), tree_flatten(got_opt.state)):
        assert mx.array_equal(a, b).item(), n
    # The frozen weights were not touched, nor captured.
    assert mx.array_equal(got.layers[0].weight, model().layers[0].weight).item()


def test_a_replaced_optimizer_state_is_the_one_updated():
    ref, ref_opt, _ = run_steps(OPTIMIZERS["adam"], False, steps=5, swap_state_at=3)
    got, got_opt, upd = run_steps(OPTIMIZERS["adam"], True, steps=5, swap_state_at=3)
    assert upd.uncompiled is None
    assert got_opt.state["step"].item() == 5
    for (n, a), (_, b) in zip(tree_flatten(ref.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), n


class Untraceable(optim.SGD):
    """An update that reads an array's value (.item()): mx.compile cannot
    trace it."""

    def apply_single(self, gradient, parameter, state):
        if mx.abs(gradient).max().item() > 1e9:
            return parameter
        return super().apply_single(gradient, parameter, state)


def test_an_update_that_cannot_be_traced_runs_uncompiled_with_its_state_intact():
    ref, ref_opt, _ = run_steps(lambda lr: Untraceable(learning_rate=lr, momentum=0.9), False)
    got, got_opt, upd = run_steps(lambda lr: Untraceable(learning_rate=lr, momentum=0.9), True)
    assert upd.uncompiled is not None
    assert got_opt.state["step"].item() == 4
    for (n, a), (_, b) in zip(tree_flatten(ref.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), n


class Wide(nn.Module):
    """24 trainable matrices of 512 KB (12 MB), as LoRA's many arrays."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(256, 512, bias=False) for _ in range(24)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("compile", [False, True])
def test_an_update_in_groups_is_the_update_at_once_bit_for_bit(monkeypatch, name, compile):
    """Every parameter its own group (eval_in_groups) against
    optimizer.update evaluated at once: the same bits."""
    ref, ref_opt, _ = run_steps(OPTIMIZERS[name], False, steps=0)
    for k in range(3):
        ref_opt.update(ref, grads_for(ref, k))
        mx.eval(ref.parameters(), ref_opt.state)
    monkeypatch.setattr(U, "UPDATE_GROUP_BYTES", 1)
    got, got_opt, _ = run_steps(OPTIMIZERS[name], compile, steps=3)
    for (n, a), (_, b) in zip(tree_flatten(ref.parameters()), tree_flatten(got.parameters())):
        assert mx.array_equal(a, b).item(), n
    for (n, a), (_, b) in zip(tree_flatten(ref_opt.state), tree_flatten(got_opt.state)):
        assert mx.array_equal(a, b).item(), n


@pytest.mark.parametrize("compile", [False, True])
def test_the_update_holds_one_group_of_new_arrays_beside_the_state(monkeypatch, compile):
    """The update's peak over the parameters, gradients and moments it
    keeps: one group's new arrays and temporaries (1 MB of parameters here:
    ~3 MB compiled, ~4 MB plain), not all of them. Evaluated at once, the
    compiled Adam update held 3x the parameters more (36 MB here), the
    plain one 1.1x (14 MB): a model with 150 MB of adapters was killed at
    the least budget the plan named."""
    monkeypatch.setattr(U, "UPDATE_GROUP_BYTES", 1 << 20)
    mx.random.seed(0)
    m = Wide()
    mx.eval(m.parameters())
    params = sum(v.nbytes for _, v in tree_flatten(m.trainable_parameters()))
    opt = optim.Adam(learning_rate=1e-3)
    upd = OptimizerStep(m, opt, compile=compile)
    for k in range(3):
        g = grads_for(m, k)
        mx.eval(g)
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        upd(g)
        over = mx.get_peak_memory() - before
        if k > 0:  # (the first update also makes the moments)
            assert over <= 6 << 20, f"step {k}: {over} bytes over the state of {params} bytes of parameters"
    assert upd.uncompiled is None
