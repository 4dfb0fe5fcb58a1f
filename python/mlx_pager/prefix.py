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
would compute, bit for bit. What changes is only when, and how many
batches a block computes at once: batches of a few positions leave a
matrix product of a few rows, far slower per row than a larger one, so
the sweep runs batches of the same shape through a block together, up
to GROUP_TOKENS positions (sweep_group). Whether a backend's kernels give
each row the same bits in a larger product is not something MLX promises
(a kernel can be chosen by the number of rows), so the sweep checks it:
the first time a block meets a group of a given shape, it computes the
batches one at a time as well, and groups that block and shape from then
on only where every output came out bit for bit the same
(step.Blocks.forward_group).

A window is the steps one sweep serves. The training loop (loop.py) draws
their batches in mlx-lm's order; a window never reaches past a validation
point (validation draws from NumPy's generator too, between two batches),
nor past the run's last iteration.

Not run ahead (ahead = 1): with no prefix (every block trained), with an
active dropout in the prefix (its masks would come from other draws), and
where the pages hold every block and the window's batches are too long to
group (nothing is read or computed to save: placement.choose). Where the
pages hold every block and the batches are short, the prefix still runs
ahead, for the grouped sweep's compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.nn as nn

# The most steps one sweep serves.
AHEAD_MOST = 8

# The most positions (rows x padded length) the prefix sweep runs through a
# block at once. Measured on this project's machine (2 cores, OpenBLAS,
# float32, a 2048-wide block): 8 batches of 16 positions together take 0.43x
# their time one at a time, 16 of them 0.40x, 8 of 64 positions 0.74x, and
# batches of 256 positions or more gain nothing; 4-bit weights gain nothing
# on a CPU. Its memory is the planner's (placement.evaluate: the sweep's
# block works on a whole group).
GROUP_TOKENS = 512


def sweep_group(rows: int, length: int, count: int, most: int = GROUP_TOKENS) -> int:
    """How many of `count` micro-batches of `rows` x `length` positions the
    prefix sweep runs through a block at once: as many as fit in `most`
    positions, at least 1."""
    return max(1, min(count, most // max(1, rows * length)))


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
    the module's docstring)."""
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
