"""The compiled optimizer update: the same bits as optimizer.update, for
every optimizer mlx-pager offers, with a schedule, across a replaced state
(resume), and uncompiled where a trace fails."""

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

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
