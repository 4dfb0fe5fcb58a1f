"""Kinds of blocks: which blocks a start-up probe of one stands for.

The session measures a block's working set before the first step
(step.probe_block) and plans every block from it (placement.Sizes.block).
That holds where the blocks are alike. Hybrid models mix kinds whose
working sets differ many times over at long sequences: Qwen3-Next's and
Qwen3.5's linear-attention blocks against their full-attention block
(118 MB against 934 MB at 4,096 tokens, forward + vjp), LFM2's convolution
blocks against its attention blocks (42 against 490 MB), Jamba's Mamba
blocks against its attention blocks (15.9 GB against 69 MB at 1,024).
Planned from the first trained block alone, a run under a hard cap was
killed by the kind it had not measured.

Blocks are of one kind where the model builds and calls them alike: the
same class, the same parameters (paths, shapes, dtypes), the same call
(its arrays' shapes and dtypes, its other arguments: a sliding window's
mask against "causal"), and the same scalar settings in every submodule
(gemma3's ``is_sliding``, cohere2's ``use_sliding_window``). An integer
setting that is its block's index plus one offset in every block that has
it (``layer_idx``) names the block, not its kind, and is left out.

`represented` gives one block of each kind to measure (with the blocks it
stands for), the plan then takes the largest measure. Where the blocks fall into more than
MAX_KINDS kinds (OpenELM's heads and widths grow with depth), they are
grouped by class and call alone, and each group is measured on its block
with the most bytes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# The most blocks measured before the first step, one per kind.
MAX_KINDS = 4

_SCALARS = (bool, int, float, str)


def call_signature(value: Any) -> Any:
    """What of a block's call arguments shapes its working set: each array's
    shape and dtype, nested containers' structure, scalars and strings as
    they are (a mask of "causal" against an array), other objects by type."""
    if isinstance(value, mx.array):
        return ("array", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(call_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, call_signature(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))))
    if value is None or isinstance(value, _SCALARS):
        return value
    return type(value).__name__


def _parameters(layer: nn.Module) -> Tuple:
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(layer.parameters()))


def _settings(layer: nn.Module) -> Dict[Tuple[str, str], Any]:
    """Every submodule's scalar attributes (not its arrays or submodules),
    by (module path, name)."""
    out = {}
    for path, module in layer.named_modules():
        for name, v in vars(module).items():
            if not name.startswith("_") and isinstance(v, _SCALARS):
                out[(path, name)] = v
    return out


def block_kinds(model: nn.Module, calls: Sequence, blocks: Sequence[int]) -> List[List[int]]:
    """`blocks` grouped by kind (module docstring), each group in order,
    the groups in the order of their first block. `calls`: each block's
    recorded ``(args, kwargs)`` (step.record_calls), indexed by block."""
    blocks = list(blocks)
    # (a setting names the blocks where it does in the whole model: two
    # trained blocks of an alternating 0 / 1 flag are no index)
    settings = {i: _settings(layer) for i, layer in enumerate(model.layers)}
    naming = set()
    for n in set().union(*(s.keys() for s in settings.values())):
        # (an integer that is its block's index plus one offset, in every
        # block that has it, two or more: not a bool, which is an int too)
        having = [(i, v[n]) for i, v in settings.items() if n in v]
        if len(having) >= 2 and all(type(v) is int for _, v in having) and len({v - i for i, v in having}) == 1:
            naming.add(n)

    def kind(i: int) -> Tuple:
        own = tuple(sorted((k, repr(v)) for k, v in settings[i].items() if k not in naming))
        return _coarse(model, calls, i) + (_parameters(model.layers[i]), own)

    return _grouped(blocks, kind)


def represented(
    model: nn.Module, calls: Sequence, blocks: Sequence[int], footprints: Sequence[int]
) -> Dict[int, List[int]]:
    """The blocks among `blocks` to measure, one of each kind (block_kinds),
    each with the blocks it stands for, in order: the one with the most
    bytes (`footprints`, by block), the lowest where they tie (a model of
    one kind: its first block). With more than MAX_KINDS kinds, one per
    class and call; still more, the MAX_KINDS of those with the most bytes
    (the rest stand for nothing)."""
    blocks = list(blocks)
    groups = block_kinds(model, calls, blocks) if blocks else []
    if len(groups) > MAX_KINDS:
        groups = _grouped(blocks, lambda i: _coarse(model, calls, i))
    out = {max(g, key=lambda i: (footprints[i], -i)): g for g in groups}
    if len(out) > MAX_KINDS:
        out = dict(sorted(out.items(), key=lambda kv: (footprints[kv[0]], -kv[0]), reverse=True)[:MAX_KINDS])
    return dict(sorted(out.items()))


def _coarse(model: nn.Module, calls: Sequence, i: int) -> Tuple:
    layer = model.layers[i]
    return (type(layer).__module__, type(layer).__qualname__, call_signature(calls[i]))


def _grouped(blocks: List[int], key) -> List[List[int]]:
    groups: Dict[Any, List[int]] = {}
    for i in blocks:
        groups.setdefault(key(i), []).append(i)
    return list(groups.values())
