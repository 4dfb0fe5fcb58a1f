"""Where a model's transformer blocks really live.

mlx-lm models expose their blocks as ``model.layers``. For most
architectures that is the list the model iterates over in its forward pass,
so replacing its items changes what the model calls. For the 17
architectures built on ``PipelineMixin`` (qwen2, qwen3_moe, deepseek_v3, ...)
``model.layers`` returns ``self.model.pipeline_layers``, a NEW slice of the
inner ``self.model.layers`` on every access: replacing items of that slice
changes nothing the model calls.

Others build ``model.layers`` by concatenating lists (afm7: its blocks
then its KV-reuse blocks), or name a list under another attribute (gptj:
``model.h``).

``BlockList`` finds the list objects that hold the blocks (the ones the
forward pass reads), and the windows of them that ``model.layers`` shows, so
that stand-ins and paged weights are put where the model will find them.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

import mlx.nn as nn


class NotPageable(ValueError):
    """The model's blocks cannot be paged; the message says why."""


def architecture(model: nn.Module) -> str:
    """The model's model_type (or its module's name) for messages."""
    args = getattr(model, "args", None)
    mt = getattr(args, "model_type", None) if args is not None else None
    if mt is None:
        mt = getattr(model, "model_type", None)
    return str(mt if isinstance(mt, str) else type(model).__module__.rsplit(".", 1)[-1])


_architecture = architecture


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
    """The windows ``holder[start:start + n]`` of the lists that hold
    ``model.layers``' blocks, in order; ``blocks()`` and ``replace()`` work
    on them."""

    def __init__(self, model: nn.Module):
        try:
            view = getattr(model, "layers", None)
        except Exception as e:  # a property that fails
            raise NotPageable(f"{architecture(model)}: model.layers fails ({type(e).__name__}: {e})") from e
        if not isinstance(view, (list, tuple)) or not view:
            raise NotPageable(
                f"{architecture(model)}: the model has no model.layers list of blocks; "
                "mlx-pager pages models whose transformer blocks are in model.layers"
            )
        self.n = len(view)
        self.model = model
        if isinstance(view, list) and model.layers is view:
            self.segments = [(view, 0, self.n)]
            self.path = "layers"
            return
        found = self._find(model, list(view))
        if found is None:
            raise NotPageable(
                f"{architecture(model)}: model.layers is not made of windows of lists the model "
                "holds, so its blocks cannot be replaced while it runs"
            )
        self.path = ",".join(p for p, _, _, _ in found)
        self.segments = [(lst, s, n) for _, lst, s, n in found]

    @property
    def holder(self) -> list:
        return self.segments[0][0]

    @property
    def start(self) -> int:
        return self.segments[0][1]

    @staticmethod
    def _find(model: nn.Module, blocks: list) -> Optional[List[Tuple[str, list, int, int]]]:
        """Greedy: the longest window of a held list that matches the blocks
        from position j on, then the next one."""
        lists = list(_lists(model))
        found, j = [], 0
        while j < len(blocks):
            best = None
            for path, lst in lists:
                for s, item in enumerate(lst):
                    if item is not blocks[j]:
                        continue
                    n = 0
                    while s + n < len(lst) and j + n < len(blocks) and lst[s + n] is blocks[j + n]:
                        n += 1
                    if best is None or n > best[3]:
                        best = (path, lst, s, n)
            if best is None:
                return None
            found.append(best)
            j += best[3]
        return found

    def blocks(self) -> List[nn.Module]:
        out = []
        for lst, s, n in self.segments:
            out.extend(lst[s : s + n])
        return out

    def replace(self, new: List) -> None:
        """Puts `new` (one item per block) where the model calls its blocks."""
        if len(new) != self.n:
            raise ValueError(f"{len(new)} replacements for {self.n} blocks")
        j = 0
        for lst, s, n in self.segments:
            lst[s : s + n] = new[j : j + n]
            j += n
