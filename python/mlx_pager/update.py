"""The optimizer update, compiled as mlx-lm compiles it.

mlx_lm.lora runs its whole step (loss, gradients, update) as one mx.compile
function, so the optimizer's elementwise ops fuse into a few kernels. The
paged step cannot be one graph (its blocks come and go), but the update
can: ``OptimizerStep`` compiles ``optimizer.apply_gradients`` over the
trainable parameters alone, with those and the optimizer's state as the
compiled function's captured inputs and outputs (mx.compile's `inputs` /
`outputs`). The frozen weights never enter it: they are pages, bound and
unbound as the step runs, and a compiled function that captured the
model's whole state would hold them.

The results are the same bits as the uncompiled update (and as mlx-lm's
compiled step: tests/python/test_trainer.py); it is faster because it
dispatches a few fused kernels instead of ~10 ops per parameter array.
Adam over the 56 LoRA arrays of the bench's read shape, on this
repository's machine (CPU backend): 5.0 against 11.2 ms alone, and the
trainer's update (the trace's `update` span) 9 against 16 ms a step. On
Metal each kernel launch costs more, so the fused update saves more.

An optimizer whose update cannot be traced (Python control flow on array
values) is updated uncompiled from then on, its state as it was before the
failed trace; ``uncompiled`` says why.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .step import one_line


class OptimizerStep:
    """``OptimizerStep(model, optimizer)(grads)``: applies `grads` (a tree
    of the trainable parameters' gradients, as ``optimizer.update`` takes)
    to `model`'s trainable parameters and evaluates them and the optimizer's
    state. `compile=False`: ``optimizer.update`` as is."""

    def __init__(self, model: nn.Module, optimizer, compile: bool = True):
        self.model, self.optimizer = model, optimizer
        self.compile = compile
        self.uncompiled: Optional[str] = None  # why the update runs uncompiled
        self._fn = None
        self._names: Tuple[str, ...] = ()
        self._state = None  # the optimizer.state the compiled function captured
        self._params: Dict[str, mx.array] = {}  # its captured parameters, by name

    def __call__(self, grads) -> None:
        if not self.compile or self.uncompiled is not None:
            self._plain(grads)
            return
        flat = tree_flatten(grads)
        names = tuple(n for n, _ in flat)
        opt = self.optimizer
        # As optimizer.update does on its first call (from the gradients'
        # tree), but outside the trace: the state's arrays exist before it.
        opt.init(grads)
        if self._fn is None or names != self._names or opt.state is not self._state:
            # (Resume replaces optimizer.state; a placement never changes the
            # trainable set, but a caller may.)
            self._build(names)
        params = dict(tree_flatten(self.model.trainable_parameters()))
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"gradients for {missing[:3]}, which are not trainable parameters of the model")
        for n in names:
            self._params[n] = params[n]
        before = tree_flatten(opt.state)
        try:
            self._fn(dict(flat))
        except Exception as e:
            # Nothing was applied: the model's parameters are untouched, and
            # the optimizer's state goes back to what it was before the trace.
            self.uncompiled = one_line(e)
            opt.state = tree_unflatten(before)
            opt.init(grads)
            self._fn = None
            self._plain(grads)
            return
        self.model.update(tree_unflatten(list(self._params.items())))
        del before, params, flat  # (the old arrays: see eval_in_groups)
        eval_in_groups(self._params, opt.state)

    def _plain(self, grads) -> None:
        self.optimizer.update(self.model, grads)
        eval_in_groups(dict(tree_flatten(self.model.trainable_parameters())), self.optimizer.state)

    def _build(self, names: Tuple[str, ...]) -> None:
        opt = self.optimizer
        self._names = names
        self._state = opt.state
        self._params = {n: None for n in names}
        captured: List = [self._params, opt.state]
        P = self._params

        @partial(mx.compile, inputs=captured, outputs=captured)
        def step(grads: Dict[str, mx.array]):
            new = opt.apply_gradients(tree_unflatten(list(grads.items())), tree_unflatten(list(P.items())))
            for n, v in tree_flatten(new):
                P[n] = v

        self._fn = step


# The most bytes of parameters whose update one evaluation computes.
UPDATE_GROUP_BYTES = 8 << 20


def eval_in_groups(params: Dict[str, mx.array], state) -> None:
    """Evaluates an optimizer update (the new `params`, by flat name, and
    the optimizer's `state` tree) a group of parameters at a time, each
    with its own state, up to UPDATE_GROUP_BYTES of parameters a group.

    An evaluation frees the arrays it consumed only when it ends, and the
    compiled update writes new arrays beside the old ones (MLX 0.32's CPU
    backend does not donate a fused kernel's inputs to its outputs): the
    whole update in one evaluation held the new parameters and both
    moments beside the old, 3x the trainable parameters over the 4x that
    stay, where the plan counts 5x (session.trainable_state_bytes). A model
    with 150 MB of adapters was killed at the least budget the plan named.
    In groups, each group's old arrays go when it is done: 3x one group
    (4x uncompiled, with its temporaries), within the plan's slack
    (budget.CACHE_SLACK) at 8 MB a group. The same kernels run, so the bits
    are the same."""
    by_param: Dict[str, List[mx.array]] = {n: [v] for n, v in params.items()}
    rest: List[mx.array] = []
    for k, v in tree_flatten(state):
        owner = k
        while owner and owner not in by_param:
            owner = owner.rpartition(".")[0]
        (by_param[owner] if owner else rest).append(v)
    group: List[mx.array] = []
    size = 0
    for n, arrays in by_param.items():
        group += arrays
        size += params[n].nbytes
        if size >= UPDATE_GROUP_BYTES:
            mx.eval(group)
            group, size = [], 0
    mx.eval(group, rest)
