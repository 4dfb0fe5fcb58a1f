"""The frozen prefix, run ahead: the blocks below the first trained one,
computed for several steps' batches in one sweep.

mlx-lm trains adapters on the last ``--num-layers`` blocks (16 by default),
so in a deep model most blocks carry none. Their outputs depend on the data
only, not on the adapters the optimizer updates, so the outputs a step
needs from them can be computed before the steps in between have run: one
sweep over the prefix carries the batches of the next `ahead` steps
(layer-major, as gradient accumulation carries its micro-batches, step.py),
and each block of the prefix is read once per `ahead` steps instead of once
per step. The outputs (one hidden state per batch) wait in memory for their
step; the placement planner counts them (placement.py, `ahead`).

The math is unchanged: each batch's outputs are the ones its own step
would compute, bit for bit. What changes is only when. Each batch goes
through a block on its own: several as one batch (a larger matrix
product, faster per row on a CPU) do not get the same bits per row, and
not even the same way from one call to the next (step._forward_sweep).

A window is the steps one sweep serves. The training loop (loop.py) draws
their batches in mlx-lm's order; a window never reaches past a validation
point (validation draws from NumPy's generator too, between two batches),
nor past the run's last iteration.

Not run ahead (ahead = 1): with no prefix (every block trained), with an
active dropout in the prefix (its masks would come from other draws), and
where the pages hold every block (nothing is read to save:
placement.choose).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.nn as nn

# The most steps one sweep serves.
AHEAD_MOST = 8


def choose_ahead(prefix_bytes: int, batch_bytes: int, most: int = AHEAD_MOST) -> int:
    """How many steps the prefix runs ahead for: the k that saves the most,
    reading the prefix once per k steps (prefix_bytes * (1 - 1/k) fewer
    bytes a step) against the memory the outputs take from the pages
    ((k - 1) * batch_bytes; a byte of room the pages lose can cost up to two
    bytes read a step, a block read forward and again backward). 1 when
    nothing is saved."""
    if prefix_bytes <= 0:
        return 1

    def gain(k: int) -> float:
        return prefix_bytes * (1 - 1 / k) - 2 * (k - 1) * batch_bytes

    return max(range(1, max(1, most) + 1), key=lambda k: (gain(k), -k))


def prefix_dropout(model: nn.Module, first: int) -> bool:
    """Whether a block below `first` has an active dropout."""
    return any(
        isinstance(m, nn.Dropout) and m.training and m._p_1 < 1
        for layer in model.layers[:first]
        for _, m in layer.named_modules()
    )


def ahead_for(arg, model: nn.Module, first: int, footprints: Sequence[int], batch_bytes: int) -> int:
    """The window for --prefix-ahead `arg`: a whole number of steps (1: off)
    or 'auto' (choose_ahead); 1 wherever running ahead cannot apply (see
    the module's docstring). `batch_bytes`: what one step's outputs take
    (hidden states, and the carries blocks above the prefix take from it)."""
    if first <= 0 or first >= len(model.layers) or prefix_dropout(model, first):
        return 1
    if arg is None or arg == "auto":
        return choose_ahead(sum(footprints[:first]), batch_bytes)
    return max(1, int(arg))


@dataclass
class Window:
    """The steps one prefix sweep serves: each step's iterations and
    batches, in order, and, once the sweep ran, each step's micro-batches
    and their prefix outputs (for the split the sweep ran with, `parts`)."""

    groups: List[tuple] = field(default_factory=list)  # (iterations, batches) per step
    parts: Optional[int] = None  # the split the outputs are for
    outputs: Optional[List[list]] = None  # per step: (micro-batches, outputs)
    done: int = 0  # steps of the window already run

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def left(self) -> int:
        return len(self.groups) - self.done

    def ready(self, parts: int) -> bool:
        """Whether the outputs were computed for this split."""
        return self.outputs is not None and self.parts == parts

    def drop(self) -> None:
        """Forgets the outputs (the split changed, or a step did not fit):
        the steps left compute their prefix themselves."""
        self.outputs, self.parts = None, None
