"""Where a model's transformer blocks really live.

mlx-lm models expose their blocks as ``model.layers``. For most
architectures that is the list the model iterates over in its forward pass,
so replacing its items changes what the model calls. For the 17
architectures built on ``PipelineMixin`` (qwen2, qwen3_moe, deepseek_v3, ...)
``model.layers`` returns ``self.model.pipeline_layers``, a NEW slice of the
inner ``self.model.layers`` on every access: replacing items of that slice
changes nothing the model calls.

``BlockList`` finds the list object that holds the blocks (the one the
forward pass reads), and the window of it that ``model.layers`` shows, so
that stand-ins and paged weights are put where the model will find them.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import mlx.nn as nn


class NotPageable(ValueError):
    """The model's blocks cannot be paged; the message says why."""


def _architecture(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def _lists(module: nn.Module, prefix: str = "") -> Iterator[Tuple[str, list]]:
    """Every list of modules held anywhere in the module tree, with its path."""
    for key, value in module.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, list):
            yield path, value
            for j, v in enumerate(value):
                if isinstance(v, nn.Module):
                    yield from _lists(v, f"{path}.{j}")
        elif isinstance(value, nn.Module):
            yield from _lists(value, path)


class BlockList:
    """The window ``holder[start:start + n]`` of the list that holds
    ``model.layers``' blocks; ``blocks()`` and ``replace()`` work on it."""

    def __init__(self, model: nn.Module):
        view = getattr(model, "layers", None)
        if not isinstance(view, (list, tuple)) or not view:
            raise NotPageable(
                f"{_architecture(model)}: the model has no model.layers list of blocks; "
                "mlx-pager pages models whose transformer blocks are in model.layers"
            )
        self.n = len(view)
        self.model = model
        if isinstance(view, list) and model.layers is view:
            self.holder, self.start, self.path = view, 0, "layers"
            return
        found = self._find(model, list(view))
        if found is None:
            raise NotPageable(
                f"{_architecture(model)}: model.layers is not a window of any list the model "
                "holds, so its blocks cannot be replaced while it runs"
            )
        self.path, self.holder, self.start = found

    @staticmethod
    def _find(model: nn.Module, blocks: list) -> Optional[Tuple[str, list, int]]:
        first = blocks[0]
        for path, lst in _lists(model):
            for s, item in enumerate(lst):
                if item is first and all(
                    s + j < len(lst) and lst[s + j] is b for j, b in enumerate(blocks)
                ):
                    return path, lst, s
        return None

    def blocks(self) -> List[nn.Module]:
        return self.holder[self.start:self.start + self.n]

    def replace(self, new: List) -> None:
        """Puts `new` (one item per block) where the model calls its blocks."""
        if len(new) != self.n:
            raise ValueError(f"{len(new)} replacements for {self.n} blocks")
        self.holder[self.start:self.start + self.n] = new
