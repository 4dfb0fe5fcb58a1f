"""The step's compiled functions, kept for a bounded number of input shapes.

mx.compile keeps, for the life of a compiled function, a traced graph for
each input shape the function met: C++ objects in the process's heap,
outside MLX's active and cached bytes, which neither the plan's terms nor
mx.clear_cache see. A run over data of varied lengths meets a new shape
every few steps (mlx-lm pads a batch to a multiple of 32 tokens: up to
max_seq_length / 32 of them), and each costs memory for every compiled block
and the tail: on a 35-block Gemma-4-E2B-style model with 16 trained blocks,
memory outside MLX grew from 181 to 307 MB over 30 steps of varied lengths,
and the plan's slack took it from the pages (1286 -> 1189 MB).

So a function is compiled once per shape class (`shape`: the micro-batch's
hidden state's shape, which fixes every other input's) and the functions of
at most `keep` shapes are kept; a new shape beyond that lets go of those of
the shape used least recently, whose graphs are traced again if it comes
back (its kernels stay built: a trace, not a compile). The governor takes
back every shape but the one in use (`drop_stale`) before it takes pages.

A freed function gives its memory back only after gc and, on glibc,
malloc_trim (governor.release_heap), and only where nothing else refers to
it. Each function kept compiles a function object of its own (`_own`): MLX
keys its cache by the Python function's identity, so two compiled wrappers
of one function share one cache, and freeing either erases it for both
(measured, MLX 0.32: the survivor traced again).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Hashable, Tuple

import mlx.core as mx

# Shapes whose compiled functions are kept. mlx-lm's own step keeps every
# shape it met; 4 covers a run of one length (batches at max_seq_length and
# the shorter last part of a split batch) and the few lengths its data
# repeats most, and bounds the rest.
KEEP_SHAPES = 4


class CompiledShapes:
    """mx.compile'd functions by (shape, name), for at most `keep` shapes,
    least recently used going first."""

    def __init__(self, keep: int = KEEP_SHAPES):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.keep = keep
        self._shapes: "OrderedDict[Tuple, Dict[Hashable, object]]" = OrderedDict()
        self.dropped = 0  # shapes let go of since the start (all of them: traced again if met)

    def get(self, shape: Tuple, name: Hashable, fn: Callable, **compile_args):
        """The compiled function `name` for `shape`, made on first use from
        `fn` (mx.compile(fn, **compile_args)); the shape becomes the most
        recently used."""
        fns = self._shapes.get(shape)
        if fns is None:
            fns = self._shapes[shape] = {}
            while len(self._shapes) > self.keep:
                self._shapes.popitem(last=False)
                self.dropped += 1
        else:
            self._shapes.move_to_end(shape)
        compiled = fns.get(name)
        if compiled is None:
            compiled = fns[name] = mx.compile(_own(fn), **compile_args)
        return compiled

    def names(self):
        """The names held, over every shape (each once)."""
        return list(dict.fromkeys(n for fns in self._shapes.values() for n in fns))

    def shapes(self):
        """The shapes held, least recently used first."""
        return list(self._shapes)

    def discard(self, match: Callable[[Hashable], bool]) -> None:
        """Lets go of the functions whose name matches, for every shape."""
        for fns in self._shapes.values():
            for n in [n for n in fns if match(n)]:
                del fns[n]

    def drop_stale(self) -> bool:
        """Lets go of every shape's functions but the most recently used
        shape's; False where no other shape is held."""
        if len(self._shapes) <= 1:
            return False
        last = next(reversed(self._shapes))
        self.dropped += len(self._shapes) - 1
        self._shapes = OrderedDict([(last, self._shapes[last])])
        return True

    def clear(self) -> bool:
        """Lets go of every function; False where none was held."""
        held = bool(self)
        self.dropped += len(self._shapes)
        self._shapes.clear()
        return held

    def __bool__(self) -> bool:
        return any(self._shapes.values())


def _own(fn: Callable) -> Callable:
    """fn, as a function object no other compiled function wraps."""

    def own(*args, **kwargs):
        return fn(*args, **kwargs)

    return own
