"""The swap store: where a model's frozen weights live while they are paged.

``PagedWeights`` takes an mlx-lm model loaded lazily (its weights are still
unread ``Load`` arrays) and hands its frozen weights to the C++ pager:

- the pages of each transformer block (``model.layers[i]``): the block's
  frozen tensors, read and evicted together, in one page or, for a large
  block, in a few pages of about ``PAGE_PART_BYTES`` each (``split_block``):
  a budget of one block then holds several pages, and the step reads one
  part of a block while it computes with another;
- one pinned page, ``resident``: every frozen tensor outside the blocks
  (embeddings, final norm, LM head), read once and locked in memory.

A page is read in place from the model's safetensors files when every tensor
of it is stored there as the model holds it (the usual case for mlx-lm
models); otherwise (tensors transformed by ``sanitize``, or ``store="swap"``)
it is evaluated once and written to a swap file in ``ssd_cache_dir``, laid
out for one aligned read per page, and reused by later runs.

After registration the model's frozen arrays are replaced by placeholders of
the same shape and dtype that hold no memory; ``bind(i)`` puts the paged
arrays of block i into the model, ``unbind(i)`` takes them out again.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import swapcache
from ._core import Pager, SwapWriter, combine_digests, rewrite_swap_page, swap_page_bytes
from .layers import BlockList, NotPageable, architecture

RESIDENT_PAGE = "resident"
# A block's frozen tensors are paged in parts of about this many bytes (at
# most MAX_PAGE_PARTS): large enough for the SSD to stream (several I/O
# chunks, page_io.h), small enough that one block's budget holds several.
PAGE_PART_BYTES = 48 << 20
MAX_PAGE_PARTS = 8


@dataclass
class _Slot:
    """Where one paged tensor goes in the model."""

    name: str  # full parameter path, e.g. model.layers.3.mlp.up_proj.weight
    module: nn.Module
    key: str  # the module's entry, e.g. "weight"
    placeholder: mx.array


def _unalias(module: nn.Module, array: mx.array, stand_in: mx.array) -> None:
    """Points every entry of `module` that is `array` (a page's array leaving
    the model) at `stand_in`: its slot, and any other, since a module may
    keep the weight it last saw beside a value it caches from it (plamo3's
    RMSNorm in eval mode: `_scale_weight`, compared with `is` to know when
    to recompute), and that reference kept the page's whole frame alive
    after its release (generation at the least page budget failed:
    "evicted pages are still referenced outside the pager")."""
    for k, v in list(module.items()):
        if v is array:
            module[k] = stand_in


def placeholder(shape, dtype) -> mx.array:
    """An array of the right shape and dtype that holds no memory (a lazy
    broadcast of one zero), standing in for a weight that is on disk."""
    return mx.broadcast_to(mx.zeros((), dtype=dtype), shape)


def block_prefixes(model: nn.Module) -> List[str]:
    """Each block's parameter path (e.g. model.layers.3), found where the
    forward pass reaches the blocks (layers.BlockList), whatever model.layers
    returns. Raises NotPageable for blocks that cannot be pages of their own."""
    arch = architecture(model)
    by_id = {id(m): name for name, m in model.named_modules()}
    prefixes = []
    for i, layer in enumerate(BlockList(model).blocks()):
        if id(layer) not in by_id:
            raise NotPageable(f"{arch}: block {i} of model.layers is not a submodule of the model")
        prefixes.append(by_id[id(layer)])
    dup = sorted({p for p in prefixes if prefixes.count(p) > 1})
    if dup:
        raise NotPageable(f"{arch}: model.layers holds the same block more than once ({dup[0]}): shared blocks")
    nested = [p for p in prefixes for q in prefixes if p != q and p.startswith(q + ".")]
    if nested:
        raise NotPageable(f"{arch}: block {nested[0]} lies inside another block")
    return prefixes


def block_page_name(block: int, part: int, parts: int) -> str:
    """The pager's name for part `part` of block `block`'s `parts` pages."""
    return f"layers.{block}" if parts == 1 else f"layers.{block}:{part}"


def split_block(names: List[str], params: Dict[str, mx.array], parts: Optional[int] = None) -> List[List[str]]:
    """A block's frozen tensors (`names`, in the order the model builds its
    submodules: for mlx-lm's blocks, the order their forward uses them) as
    at most `parts` pages of consecutive modules of about equal bytes (None:
    one per PAGE_PART_BYTES, at most MAX_PAGE_PARTS). A module's tensors stay
    in one page (a streamed layer reads its weight, scales and biases
    together, stream.py); modules of 1-D tensors only (norms) go in the
    first page: small, and often used first."""
    units: Dict[str, List[str]] = {}
    for n in names:
        units.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(n)
    first = [n for u in units.values() if all(params[n].ndim < 2 for n in u) for n in u]
    rest = [u for u in units.values() if not all(params[n].ndim < 2 for n in u)]
    total = sum(params[n].nbytes for n in names)
    if parts is None:
        parts = min(MAX_PAGE_PARTS, max(1, round(total / PAGE_PART_BYTES)))
    parts = max(1, min(parts, len(rest)))
    out: List[List[str]] = [list(first)]
    done = sum(params[n].nbytes for n in first)
    for u in rest:
        # A new page where this module would end past the current page's
        # share of the total (never more than `parts` pages).
        b = sum(params[n].nbytes for n in u)
        if out[-1] and len(out) < parts and done + b / 2 > total * len(out) / parts:
            out.append([])
        out[-1].extend(u)
        done += b
    return [g for g in out if g]


def _transformed_by_sanitize(model: nn.Module, model_path: Path) -> set:
    """Names of the tensors the model's ``sanitize`` changes on loading,
    whatever their shape and dtype (baichuan_m1 normalizes its LM head's
    rows in place): mlx-lm's load_model runs sanitize on the files' lazy
    arrays, so the tensors it returns as the very arrays it was given are
    the files' bytes, the others are not. Nothing is read: the arrays stay
    lazy. A sanitize that fails here counts every tensor as changed."""
    if not hasattr(model, "sanitize"):
        return set()
    raw = {}
    for f in sorted(model_path.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    try:
        out = model.sanitize(dict(raw))
    except Exception:
        return set(raw)
    return {k for k, v in out.items() if raw.get(k) is not v}


def _safetensors_index(model_path: Path) -> Dict[str, Tuple[str, mx.Dtype, list, int, int]]:
    files = sorted(model_path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no model*.safetensors files in {model_path}: --model must be an "
            "mlx-lm model directory (or a Hugging Face repo id)"
        )
    index = {}
    for f in files:
        tensors = swapcache.read_index(f)
        for name, (dtype, shape, offset, nbytes) in tensors.items():
            index[name] = (str(f), dtype, shape, offset, nbytes)
    return index


def _block_groups(model: nn.Module, params: Dict[str, mx.array], trainable: set, page_parts: Optional[int]):
    """The block prefixes, the pages' (name, tensor names) in registration
    order (each block's parts in use order, the pinned page last), and each
    block's page names."""
    prefixes = block_prefixes(model)
    groups: List[Tuple[str, List[str]]] = []
    page_names: List[List[str]] = []
    claimed = set()
    for i, prefix in enumerate(prefixes):
        names = [n for n in params if n.startswith(prefix + ".") and n not in trainable]
        claimed.update(names)
        parts = split_block(names, params, page_parts) if names else [names]
        groups.extend((block_page_name(i, j, len(parts)), part) for j, part in enumerate(parts))
        page_names.append([block_page_name(i, j, len(parts)) for j in range(len(parts))])
    rest = sorted(n for n in params if n not in claimed and n not in trainable)
    groups.append((RESIDENT_PAGE, rest))
    return prefixes, groups, page_names


def _stored_as_held(index, transformed: set, params: Dict[str, mx.array]):
    """Whether tensor `n` is stored in the model's files as the model holds
    it (dtype and shape; not changed by sanitize): then it is read in place."""

    def held(n: str) -> bool:
        if n not in index or n in transformed:
            return False
        _, dtype, shape, _, _ = index[n]
        return dtype == params[n].dtype and list(shape) == list(params[n].shape)

    return held


def _in_place_tensors(index, names: List[str]) -> list:
    return [(n, index[n][0], index[n][3], index[n][4], index[n][1], list(index[n][2])) for n in names]


def block_footprints(model: nn.Module, model_path, page_parts: Optional[int] = 1, store: str = "auto") -> List[int]:
    """The most each block's pages would be charged together once resident
    (PagedWeights.block_charge_bound) were the model paged with `page_parts`
    pages per block, before anything is registered: pages read in place are
    planned on a scratch Pager (layout.h; nothing is read), swap pages
    sized by swap_page_bytes. A block in parts may be charged well over the
    whole block (each part's alignment, and the gaps of other parts its read
    goes through), so --page-parts auto checks a split against the page
    budget with this (session.page_parts)."""
    model_path = Path(model_path)
    params = dict(tree_flatten(model.parameters()))
    trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
    _, groups, page_names = _block_groups(model, params, trainable, page_parts)
    index = _safetensors_index(model_path)
    held = _stored_as_held(index, _transformed_by_sanitize(model, model_path), params)
    scratch = Pager(1 << 62, io_threads=1)
    footprint = {}
    for page_name, names in groups[:-1]:
        if store != "swap" and names and all(held(n) for n in names):
            pid = scratch.add_page_in_place(page_name, _in_place_tensors(index, names))
            nbytes = scratch.page_bytes(pid)
        else:
            nbytes = swap_page_bytes([params[n].nbytes for n in names])
        footprint[page_name] = int(scratch.frame_charge_bound(int(nbytes)))
    return [sum(footprint[n] for n in names) for names in page_names]


class PagedWeights:
    """A model's frozen weights, paged by a ``Pager`` (see module docstring).

    Args:
        model: an mlx-lm model loaded with ``lazy=True``, before LoRA layers
            are added (LoRA wraps the same frozen modules, so bindings made
            here stay valid afterwards).
        model_path: the model's local directory.
        budget_bytes: the pager's page budget (resident + in-flight pages).
        ssd_cache_dir: where swap files go (only written when needed).
        store: "auto" (in place where possible), "in_place" (fail otherwise),
            or "swap" (always the swap file).
        pager_options: passed to ``Pager`` (policy, readahead, io_threads,
            io_chunk_bytes, direct_io).
        progress: called as progress(done_bytes, total_bytes) while a swap
            file is written.
        cache_max_bytes: size cap of ssd_cache_dir (swapcache.py).
        reload: returns the model freshly loaded with ``lazy=True``, to
            rebuild a swap page whose bytes fail their checksum (default:
            mlx_lm's load_model of model_path).
        page_parts: pages per block (split_block): 1 (default) one page
            per block; None: by size, one per PAGE_PART_BYTES; N: N, at
            most one per module.

    With an ssd_cache_dir every page read is verified against a checksum
    (swapcache.py keeps them): a swap page that fails it twice is rebuilt
    from the model's files and rewritten; an in-place page is an error
    naming the file.
    """

    def __init__(
        self,
        model: nn.Module,
        model_path,
        budget_bytes: int,
        ssd_cache_dir: Optional[str] = None,
        store: str = "auto",
        pager_options: Optional[dict] = None,
        progress=None,
        cache_max_bytes: Optional[int] = None,
        reload=None,
        page_parts: Optional[int] = 1,
    ):
        if store not in ("auto", "in_place", "swap"):
            raise ValueError(f"store must be 'auto', 'in_place' or 'swap', not '{store}'")
        self.model = model
        self.model_path = Path(model_path)
        self.pager = Pager(budget_bytes, **(pager_options or {}))
        self.slots: List[List[_Slot]] = []  # by page id
        self.block_pages: List[Tuple[int, ...]] = []  # block i's page ids, in use order
        self.store_kind: List[str] = []  # by page id: "in_place" or "swap"

        modules = dict(model.named_modules())
        params = dict(tree_flatten(model.parameters()))
        trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
        prefixes, groups, self.block_page_names = _block_groups(model, params, trainable, page_parts)

        index = _safetensors_index(self.model_path)
        transformed = _transformed_by_sanitize(model, self.model_path)
        self._reload = reload
        self._cache = self._digests = None
        self._cache_fd = None
        if ssd_cache_dir is not None:
            self._cache = swapcache.SwapCache(ssd_cache_dir, cache_max_bytes)
            self._digests = self._cache.source_digests(self.model_path, swapcache.tensor_ranges(index))

        stored_as_held = _stored_as_held(index, transformed, params)
        to_swap = []
        for page_name, names in groups:
            if not names:
                raise NotPageable(f"{architecture(model)}: page '{page_name}' has no frozen tensors")
            in_place = store != "swap" and all(stored_as_held(n) for n in names)
            if store == "in_place" and not in_place:
                bad = [n for n in names if not stored_as_held(n)][:3]
                raise ValueError(
                    f"page '{page_name}' cannot be read in place: {bad} are not stored "
                    "in the model's safetensors files as the model holds them; "
                    "use --store auto or swap (store='auto' or 'swap' from Python)"
                )
            if in_place:
                tensors = _in_place_tensors(index, names)
                pid = self.pager.add_page_in_place(page_name, tensors, checksum=self._in_place_checksum(tensors))
                self._add_slots(pid, self._slots(names, modules, params), "in_place")
            else:
                to_swap.append((page_name, names, self._slots(names, modules, params)))
        if to_swap:
            self._add_swap_pages(to_swap, params, ssd_cache_dir, progress)
        self.block_prefixes = prefixes
        self.block_pages = [tuple(self.pager.lookup(n) for n in names) for names in self.block_page_names]
        self.resident_id = self.pager.lookup(RESIDENT_PAGE)

        # Drop the model's own (lazy, unread) arrays: from here on only the
        # pager brings weights in.
        for slots in self.slots:
            for s in slots:
                s.module[s.key] = s.placeholder
        self._bound: Dict[int, int] = {}

    # ---------------------------------------------------------------- setup --
    @staticmethod
    def _slots(names, modules, params) -> List[_Slot]:
        slots = []
        for n in names:
            mod_path, key = n.rsplit(".", 1) if "." in n else ("", n)
            a = params[n]
            slots.append(_Slot(n, modules[mod_path], key, placeholder(a.shape, a.dtype)))
        return slots

    def _add_slots(self, pid: int, slots: List[_Slot], kind: str) -> None:
        assert pid == len(self.slots), "pages are registered in order"
        self.slots.append(slots)
        self.store_kind.append(kind)

    def _in_place_checksum(self, tensors) -> Optional[int]:
        if self._digests is None:
            return None
        return combine_digests([self._digests[path]["tensors"][n] for n, path, *_ in tensors])

    def _add_swap_pages(self, to_swap, params, ssd_cache_dir, progress):
        if ssd_cache_dir is None:
            raise ValueError(
                f"{len(to_swap)} pages must be written to a swap file, but no "
                "ssd_cache_dir was given: pass ssd_cache_dir (--ssd-cache-dir)"
            )
        key = swapcache.entry_key(self.model_path, self._digests, [(p, n) for p, n, _ in to_swap], params)
        total = sum(swap_page_bytes([params[n].nbytes for n in names]) for _, names, _ in to_swap)
        swap_path, manifest, self._cache_fd = self._cache.entry(
            key, self.model_path, lambda tmp: self._write_swap(tmp, to_swap, params, progress, total), total
        )
        # The entry stays in use (locked against cleanup) while this object lives.
        weakref.finalize(self, swapcache.release, self._cache_fd)
        self.swap_path = swap_path
        self._swap_pages = manifest["pages"]
        for page_name, names, slots in to_swap:
            offset, checksum = manifest["pages"][page_name]
            specs = [(n, params[n].dtype, list(params[n].shape)) for n in names]
            pid = self.pager.add_page_from_swap(page_name, str(swap_path), offset, specs, checksum=checksum)
            self._add_slots(pid, slots, "swap")
        # Through a weak reference: the pager must not keep this object alive.
        me = weakref.ref(self)
        self.pager.set_rebuild_hook(lambda pid: me() is not None and me()._rebuild_page(pid))

    def _write_swap(self, swap_path, to_swap, params, progress, total):
        writer = SwapWriter(str(swap_path), total)
        pages, done = {}, 0
        for page_name, names, slots in to_swap:
            # Evaluated one page at a time: memory stays near one page, once
            # the model's own references to the page's arrays (and params')
            # hold the placeholders they get at the end of __init__ anyway.
            # Left to the model, every page written stays evaluated.
            arrays = [params[n] for n in names]
            pages[page_name] = writer.write_page_checked(arrays)
            done += swap_page_bytes([a.nbytes for a in arrays])
            for s in slots:
                s.module[s.key] = s.placeholder
                params[s.name] = s.placeholder
            del arrays
            mx.clear_cache()
            if progress is not None:
                progress(done, total)
        writer.finish()
        return pages

    def _rebuild_page(self, pid: int) -> bool:
        """The pager's rebuild hook (pager.h): a swap page whose bytes failed
        their checksum twice is evaluated again from the model's files and
        written over itself. In-place pages cannot be rebuilt (False: the
        pager's error names the file)."""
        if self.store_kind[pid] != "swap":
            return False
        page_name = self.pager.page_name(pid)
        offset, checksum = self._swap_pages[page_name]
        if self._reload is not None:
            fresh = self._reload()
        else:
            from mlx_lm.utils import load_model

            fresh, _ = load_model(self.model_path, lazy=True)
        params = dict(tree_flatten(fresh.parameters()))
        got = rewrite_swap_page(str(self.swap_path), offset, [params[s.name] for s in self.slots[pid]])
        del fresh, params
        mx.clear_cache()
        if got != checksum:
            raise swapcache.ModelFileError(
                f"page '{page_name}' of {self.swap_path} was corrupt and rebuilding it from {self.model_path} "
                "gave other bytes: the model's files changed during the run; run again to rebuild the cache"
            )
        return True

    # -------------------------------------------------------------- binding --
    @property
    def num_blocks(self) -> int:
        return len(self.block_pages)

    @contextmanager
    def bound(self, *blocks: int):
        """Blocks paged in and their arrays in the model for the duration:
        the paged-in / run / paged-out pattern, written once."""
        done = []
        try:
            for b in blocks:
                self.bind(b)
                done.append(b)
            yield
        finally:
            for b in reversed(done):
                self.unbind(b)

    def bind(self, block: int) -> None:
        """Pages block `block` in (its pages in order) and puts its arrays
        into the model."""
        for pid in self.block_pages[block]:
            self._bind_page(pid)

    def unbind(self, block: int) -> None:
        """Takes block `block`'s arrays out of the model and releases its pages."""
        for pid in reversed(self.block_pages[block]):
            self._unbind_page(pid)

    def _bind_page(self, pid: int) -> None:
        n = self._bound.get(pid, 0)
        if n == 0:
            arrays = self.pager.acquire(pid)
            for s in self.slots[pid]:
                s.module[s.key] = arrays[s.name]
        else:
            self.pager.acquire(pid)  # count the use; the arrays are in place
        self._bound[pid] = n + 1

    def _unbind_page(self, pid: int) -> None:
        n = self._bound.get(pid, 0)
        if n == 0:
            raise RuntimeError(f"page {self.pager.page_name(pid)} is not bound")
        if n == 1:
            for s in self.slots[pid]:
                _unalias(s.module, s.module[s.key], s.placeholder)  # the slot too
        self._bound[pid] = n - 1
        self.pager.release(pid)

    def pin_resident(self) -> None:
        """Reads the resident page (embeddings, norm, head), locks it in
        memory and binds it for good (once; later calls do nothing)."""
        if getattr(self, "_resident_pinned", False):
            return
        self.pager.pin(self.resident_id)
        self._bind_page(self.resident_id)
        self._resident_pinned = True

    # ------------------------------------------------------------ accounting --
    def page_bytes(self, block: int) -> int:
        """Bytes of block `block`'s frozen tensors (its pages' frames)."""
        return sum(self.pager.page_bytes(p) for p in self.block_pages[block])

    def block_footprint(self, block: int) -> int:
        """What block `block`'s pages are charged together when resident
        (each frame with its alignment, MlxFrameAllocator::footprint)."""
        return sum(self.page_footprint(p) for p in self.block_pages[block])

    def page_footprint(self, pid: int) -> int:
        """What page `pid` is charged when its frame is fresh: the simulator's
        charge (simulate.py), which replays the pager's reads."""
        from ._core import IO_ALIGN

        return self.pager.page_bytes(pid) + int(IO_ALIGN)

    def block_charge_bound(self, block: int) -> int:
        """The most block `block`'s pages may be charged together when
        resident (page_charge_bound each): what a budget that must hold them
        at once counts."""
        return sum(self.page_charge_bound(p) for p in self.block_pages[block])

    def page_charge_bound(self, pid: int) -> int:
        """The most page `pid` may be charged when resident: its footprint,
        and the few pages more a reused frame may cost (Pager::charge_bound).
        A budget of one block's bare footprints failed a block in 4 parts
        (parts a 4 KB page apart reuse each other's frames) in its forward:
        its last part found the budget full of the others, charged 4 KB
        over, and in use."""
        return int(self.pager.page_charge_bound(pid))

    def page_read_bytes(self, pid: int) -> int:
        """Bytes one read of page `pid` transfers (Pager::read_bytes): what
        its read adds to stats()["bytes_read"], under its footprint."""
        return int(self.pager.page_read_bytes(pid))

    @property
    def page_order(self) -> List[int]:
        """Every block page's id, block by block, each block's in use order."""
        return [p for pages in self.block_pages for p in pages]

    @property
    def resident_bytes(self) -> int:
        return self.pager.page_bytes(self.resident_id)

    @property
    def paged_bytes(self) -> int:
        return sum(self.page_bytes(i) for i in range(self.num_blocks))

    @property
    def max_page_bytes(self) -> int:
        """The largest block's bytes (a block is bound whole: all its pages)."""
        return max(self.page_bytes(i) for i in range(self.num_blocks))

    @property
    def pages_per_block(self) -> int:
        """The most pages a block has (a readahead depth of one block)."""
        return max((len(p) for p in self.block_pages), default=1)

    @property
    def max_block_footprint(self) -> int:
        return max(self.block_footprint(i) for i in range(self.num_blocks))

    @property
    def max_block_charge(self) -> int:
        """The most the largest block's pages may be charged at once
        (block_charge_bound): the least page budget a step can run in."""
        return max(self.block_charge_bound(i) for i in range(self.num_blocks))
