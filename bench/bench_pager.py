"""Pager read bandwidth against a direct read of the same bytes, and bytes
read against Belady's minimum. Run: python bench/bench_pager.py [--gb 3]

Measured side by side in one run, alternating, because the machine is
shared and noisy; the medians are compared:

  dd          `dd iflag=direct bs=8M` of the page files (the disk's own pace)
  in_place    pages read by the pager straight from MLX-written safetensors
              (with the in-place alignment moves)
  swap        the same pages from the pager's swap file (one read per page)

Each pager pass runs a forward-then-backward schedule over all pages, as a
training step does, under a budget of a quarter of the pages, acquiring and
releasing each page with no compute in between: the pager's whole job is
the read. Belady's minimum is computed for the same schedule and budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from benchlib import dd_rate

from mlx_pager import Pager, SwapWriter, read_safetensors_index
from mlx_pager._core import IO_ALIGN, swap_page_bytes


def make_pages(d: Path, n_pages: int, page_mb: int, per_file: int):
    """n_pages pages of 4 tensors each, `per_file` pages per safetensors file,
    written by MLX (so tensor data sits at odd offsets)."""
    d.mkdir(parents=True, exist_ok=True)
    marker = d / f"pages-{n_pages}x{page_mb}.json"
    files = [d / f"shard-{i:03d}.safetensors" for i in range((n_pages + per_file - 1) // per_file)]
    if marker.exists() and all(f.exists() for f in files):
        return files
    elems = page_mb * 2**20 // 4 // 4  # float32, 4 tensors per page
    rng = np.random.default_rng(0)
    for fi, f in enumerate(files):
        arrays = {}
        for p in range(fi * per_file, min(n_pages, (fi + 1) * per_file)):
            for t in range(4):
                arrays[f"layers.{p}.w{t}"] = mx.array(rng.standard_normal(elems, dtype=np.float32))
        mx.save_safetensors(str(f), arrays)
        del arrays
    marker.write_text("{}")
    return files


def build_pager(kind, files, swap_path, budget_pages, readahead, policy="optimal"):
    index = {}
    for f in files:
        tensors, _, _ = read_safetensors_index(str(f))
        for name, (dt, shape, off, nb) in tensors.items():
            index[name] = (str(f), dt, shape, off, nb)
    pages = sorted({n.rsplit(".", 1)[0] for n in index}, key=lambda s: int(s.split(".")[1]))
    p = Pager(1, policy=policy, readahead=readahead, io_threads=4, io_chunk_bytes=8 << 20)
    ids = []
    if kind == "in_place":
        for pg in pages:
            names = sorted(n for n in index if n.startswith(pg + "."))
            ids.append(
                p.add_page_in_place(
                    pg, [(n, index[n][0], index[n][3], index[n][4], index[n][1], list(index[n][2])) for n in names]
                )
            )
    else:
        offsets = json.loads((swap_path.with_suffix(".json")).read_text())
        for pg in pages:
            names = sorted(n for n in index if n.startswith(pg + "."))
            ids.append(
                p.add_page_from_swap(
                    pg, str(swap_path), offsets[pg], [(n, index[n][1], list(index[n][2])) for n in names]
                )
            )
    footprint = max(p.page_bytes(i) for i in ids) + IO_ALIGN
    p.set_budget(budget_pages * footprint)
    return p, ids


def write_swap(files, swap_path: Path):
    if swap_path.exists() and swap_path.with_suffix(".json").exists():
        return
    loaded = {}
    for f in files:
        loaded.update(mx.load(str(f)))
    pages = sorted({n.rsplit(".", 1)[0] for n in loaded}, key=lambda s: int(s.split(".")[1]))
    total = sum(
        swap_page_bytes([loaded[n].nbytes for n in sorted(k for k in loaded if k.startswith(pg + "."))]) for pg in pages
    )
    w = SwapWriter(str(swap_path), total)
    offsets = {}
    for pg in pages:
        names = sorted(n for n in loaded if n.startswith(pg + "."))
        offsets[pg] = w.write_page([loaded[n] for n in names])
    w.finish()
    swap_path.with_suffix(".json").write_text(json.dumps(offsets))


def belady_loads(seq, k):
    nxt, last = [0] * len(seq), {}
    for t in range(len(seq) - 1, -1, -1):
        nxt[t] = last.get(seq[t], len(seq) + t)
        last[seq[t]] = t
    cache, loads = {}, 0  # page -> next use
    for t, pg in enumerate(seq):
        if pg not in cache:
            loads += 1
            if len(cache) == k:
                del cache[max(cache, key=cache.get)]
        cache[pg] = nxt[t]
    return loads


def lru_loads(seq, k):
    cache, loads = [], 0
    for pg in seq:
        if pg in cache:
            cache.remove(pg)
        else:
            loads += 1
            if len(cache) == k:
                cache.pop(0)
        cache.append(pg)
    return loads


def run_pager(p, ids, steps):
    n = len(ids)
    one = list(range(n)) + list(range(n - 1, -1, -1))
    seq = one * steps
    p.evict_all()
    p.set_schedule([ids[i] for i in seq], repeat=False)
    before = p.stats()
    t = time.perf_counter()
    for i in seq:
        p.acquire(ids[i])
        p.release(ids[i])
    dt = time.perf_counter() - t
    s = p.stats()
    return (s["bytes_read"] - before["bytes_read"]) / dt, s["pages_read"] - before["pages_read"], seq


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/mlx-pager-bench")
    ap.add_argument("--gb", type=float, default=3.0, help="size of the page set")
    ap.add_argument("--page-mb", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1, help="training steps per pager pass")
    ap.add_argument("--json", default=None, help="write the results here too")
    a = ap.parse_args()
    n_pages = max(4, int(a.gb * 1024 / a.page_mb))
    d = Path(a.dir)
    files = make_pages(d, n_pages, a.page_mb, per_file=8)
    swap = d / f"pages-{n_pages}x{a.page_mb}.swap"
    write_swap(files, swap)
    k = max(2, n_pages // 4)
    total = sum(f.stat().st_size for f in files)
    print(
        f"{n_pages} pages of {a.page_mb}MB ({total / 1e9:.2f}GB in {len(files)} MLX-written files), "
        f"budget {k} pages, forward+backward schedule x{a.steps}"
    )
    pagers = {kind: build_pager(kind, files, swap, k, readahead=4) for kind in ("in_place", "swap")}
    bw = {"dd": [], "in_place": [], "swap": []}
    reads = {}
    for _r in range(a.rounds):
        bw["dd"].append(dd_rate(files))
        for kind, (p, ids) in pagers.items():
            rate, pages_read, seq = run_pager(p, ids, a.steps)
            bw[kind].append(rate)
            reads[kind] = pages_read
    med = {k2: statistics.median(v) for k2, v in bw.items()}
    seq = (list(range(n_pages)) + list(range(n_pages - 1, -1, -1))) * a.steps
    minimum = belady_loads(seq, k)
    lru_p, lru_ids = build_pager("swap", files, swap, k, readahead=0, policy="lru")
    _, lru_read, _ = run_pager(lru_p, lru_ids, a.steps)
    print(f"{'':10} {'GB/s (median of ' + str(a.rounds) + ')':>22} {'vs dd':>7} {'pages read':>11} {'vs Belady':>10}")
    print(f"{'dd direct':10} {med['dd'] / 1e9:>22.2f} {1.0:>7.2f}")
    for kind in ("in_place", "swap"):
        print(
            f"{kind:10} {med[kind] / 1e9:>22.2f} {med[kind] / med['dd']:>7.2f} {reads[kind]:>11} "
            f"{reads[kind] / minimum:>10.2f}"
        )
    print(f"{'Belady':10} {'':>22} {'':>7} {minimum:>11} {1.0:>10.2f}")
    print(
        f"{'lru':10} {'':>22} {'':>7} {lru_read:>11} {lru_read / minimum:>10.2f}   (simulated LRU: {lru_loads(seq, k)})"
    )
    out = {
        "bandwidth_Bps": bw,
        "median_Bps": med,
        "pages_read": reads,
        "belady": minimum,
        "lru": lru_read,
        "pages": n_pages,
        "page_mb": a.page_mb,
        "budget_pages": k,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
