"""Spilled checkpoints: block inputs that leave memory between the forward
and the backward sweep, through the pager, as swap does for a process.

A recomputed block keeps its input (its checkpoint) from the forward sweep
to its backward; with long sequences those checkpoints, all of them held at
once, are what no longer fits. A spilled block's checkpoint is written to
an activation swap file right after the forward sweep has used it, and read
back by the pager like any page: each (block, micro-batch) has a page of
its own there, registered with the pager, placed in the step's schedule at
the block's backward position, so the pager's readahead brings the pages
back in backward order while earlier blocks compute, and the optimal policy
weighs them with the weight pages against the same budget. A page is
discarded (Pager::discard) when it is rewritten, so a copy read before the
write is never used, and again once its block's backward has used it.

Writes run on one background thread (the forward sweep goes on while a
checkpoint is written; a read of it waits for its write). The file lives in
--ssd-cache-dir for the run only; it is removed when the run ends.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class SpillStore:
    """The activation swap file and its pages, for one run."""

    def __init__(self, weights, directory, slot_bytes: int):
        from ._core import IO_ALIGN

        self.pager = weights.pager
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"activations-{os.getpid()}-{uuid.uuid4().hex[:8]}.swap"
        self.align = IO_ALIGN
        self.slot_bytes = _round_up(max(1, slot_bytes), IO_ALIGN)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._size = 0
        self._pages: Dict[Tuple[int, int], Tuple[int, int]] = {}  # (block, slot) -> (page id, offset)
        self._meta: Dict[Tuple[int, int], Tuple[tuple, mx.Dtype]] = {}
        self._writes: Dict[Tuple[int, int], Future] = {}
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-pager-spill")
        self._lock = threading.Lock()
        self.bytes_written = 0
        self.bytes_read = 0
        self.live_bytes = 0  # checkpoint bytes on the SSD, written and not yet used

    # -------------------------------------------------------------- pages --
    def page_id(self, block: int, slot: int) -> int:
        """The page of (block, micro-batch slot), registered on first use."""
        key = (block, slot)
        if key not in self._pages:
            offset = self._size
            self._size += self.slot_bytes
            os.posix_fallocate(self._fd, offset, self.slot_bytes)  # ENOSPC now, not mid-write
            pid = self.pager.add_page_from_swap(
                f"activations.{block}.{slot}", str(self.path), offset, [("h", mx.uint8, [self.slot_bytes])]
            )
            self._pages[key] = (pid, offset)
        return self._pages[key][0]

    def page_ids(self, block: int, slots: int) -> List[int]:
        return [self.page_id(block, m) for m in range(slots)]

    def fits(self, h: mx.array) -> bool:
        return h.nbytes <= self.slot_bytes

    # ------------------------------------------------------------ traffic --
    def put(self, block: int, slot: int, h: mx.array) -> None:
        """Writes h (evaluated) as the checkpoint of (block, slot), in the
        background; the page's old copy in memory is discarded after it."""
        if not self.fits(h):
            raise ValueError(
                f"[SpillStore.put] a checkpoint of {h.nbytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )
        pid = self.page_id(block, slot)
        offset = self._pages[(block, slot)][1]
        self._meta[(block, slot)] = (tuple(h.shape), h.dtype)
        self.wait(block, slot)  # a write of the previous step, never still running in practice

        def write(h=h):
            from ._core import write_swap_array

            write_swap_array(str(self.path), offset, h)
            self.pager.discard(pid)

        self._writes[(block, slot)] = self._io.submit(write)
        self.bytes_written += h.nbytes
        self.live_bytes += h.nbytes

    def wait(self, block: int, slot: int) -> None:
        f = self._writes.pop((block, slot), None)
        if f is not None:
            f.result()  # raises the write's error (e.g. ENOSPC) here

    def get(self, block: int, slot: int) -> mx.array:
        """The checkpoint of (block, slot), read through the pager (held
        until release)."""
        self.wait(block, slot)
        shape, dtype = self._meta[(block, slot)]
        pid = self.page_id(block, slot)
        flat = self.pager.acquire(pid)["h"]
        n = dtype.size
        for d in shape:
            n *= d
        self.bytes_read += n
        return flat[:n].view(dtype).reshape(shape)

    def release(self, block: int, slot: int) -> None:
        """Done with the checkpoint: released and dropped from memory (its
        next use is after the next forward sweep rewrites it)."""
        pid = self.page_id(block, slot)
        self.pager.release(pid)
        self.pager.discard(pid)
        shape, dtype = self._meta[(block, slot)]
        n = dtype.size
        for d in shape:
            n *= d
        self.live_bytes -= n

    def close(self) -> None:
        self._io.shutdown(wait=True)
        try:
            os.close(self._fd)
        except OSError:
            pass
        try:
            self.path.unlink()
        except OSError:
            pass
