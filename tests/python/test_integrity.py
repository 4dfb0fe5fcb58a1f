"""Nothing silently wrong: checksummed pages (corruption caught, re-read,
rebuilt), a swap cache keyed by content and locked against concurrent runs,
private cache files, one-line errors for bad cache dirs and model files,
and faults injected at the page I/O layer during training."""

import copy
import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import types

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from mlx_pager import _core, interrupt, swapcache
from mlx_pager.store import PagedWeights
from mlx_pager.trainer import DEFAULTS
from mlx_pager.trainer import run as paged_run

RUN = dict(
    train=True,
    batch_size=2,
    num_layers=2,
    learning_rate=1e-3,
    steps_per_report=1,
    steps_per_eval=1000,
    save_every=1000,
    seed=0,
    val_batches=2,
    iters=3,
    memory_budget="4GB",
    quiet=True,
    store="swap",
)


def lazy(path):
    model, _ = load_model(path, lazy=True)
    model.freeze()
    return model


def own_model(models, tmp_path, name="model"):
    """A private copy of the small generated llama (tests change its files)."""
    dst = tmp_path / name
    shutil.copytree(models("llama", None), dst)
    return dst


def train(model, data, tmp_path, cache, adapters="adapters", **kw):
    a = dict(
        DEFAULTS,
        **RUN,
        model=str(model),
        data=str(data),
        adapter_path=str(tmp_path / adapters),
        ssd_cache_dir=str(cache),
    )
    a.update(kw)
    return paged_run(types.SimpleNamespace(**copy.deepcopy(a)))


def entries(cache):
    return sorted(d.name for d in cache.iterdir() if d.is_dir() and d.name != "sources")


def flip(path, offset, n=8):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(n)
        f.seek(offset)
        f.write(bytes(x ^ 0xA5 for x in b))


def check_pages(w, model_path):
    """Every block page of `w` holds the model's weights."""
    ref = dict(tree_flatten(load_model(model_path)[0].parameters()))
    for i in range(w.num_blocks):
        w.bind(i)
        for k, v in tree_flatten(w.model.layers[i].parameters()):
            assert mx.array_equal(v, ref[f"{w.block_prefixes[i]}.{k}"]).item(), k
        w.unbind(i)


# ------------------------------------------------------------- integrity --


def test_flipped_swap_bytes_are_detected_rebuilt_and_train_the_same(models, train_only_data, tmp_path):
    model = models("llama", None)
    cache = tmp_path / "cache"
    clean = train(model, train_only_data, tmp_path, cache, adapters="a0")
    assert clean.pager_stats["checksum_errors"] == 0
    (key,) = entries(cache)
    swap = cache / key / "pages.swap"
    manifest = swapcache._read_json(cache / key / "manifest.json")
    # a frozen block (the start-up probe reads the first trained one before
    # any step): its reads are in the step records
    offset, _ = manifest["pages"]["layers.0"]
    before = swap.stat().st_ino
    flip(swap, offset + 5000)
    again = train(model, train_only_data, tmp_path, cache, adapters="a1")
    assert [s["loss"] for s in again.steps] == [s["loss"] for s in clean.steps]
    assert again.pager_stats["checksum_errors"] >= 2 and again.pager_stats["pages_rebuilt"] == 1
    assert sum(s["checksum_errors"] for s in again.steps) >= 2  # the step records show it
    assert swap.stat().st_ino == before  # rewritten in place, not a new file
    third = train(model, train_only_data, tmp_path, cache, adapters="a2")
    assert third.pager_stats["checksum_errors"] == 0  # the page on disk was repaired


def test_in_place_page_corrupted_after_start_is_one_error_naming_the_file(models, tmp_path):
    path = own_model(models, tmp_path)
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path / "cache"), store="in_place")
    shard = next(path.glob("model*.safetensors"))
    tensors = _core.read_safetensors_index(str(shard))[0]
    name = next(n for n in tensors if ".layers.1." in n)
    flip(shard, tensors[name][2] + 3)
    w.bind(0)
    w.unbind(0)
    with pytest.raises(OSError, match="model.safetensors.*(checksum|corrupt)") as e:
        w.bind(1)
    assert isinstance(e.value, _core.PageReadError)
    assert w.pager.stats()["checksum_errors"] == 2


def test_changed_shard_with_restored_mtime_is_not_reused_and_old_entry_cleaned(models, tmp_path):
    path = own_model(models, tmp_path)
    cache = tmp_path / "cache"
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    first = w.swap_path
    del w
    shard = next(path.glob("model*.safetensors"))
    st = shard.stat()
    tensors = _core.read_safetensors_index(str(shard))[0]
    name = next(n for n in tensors if ".layers.0.mlp.up_proj.weight" in n)
    with open(shard, "r+b") as f:  # new values, same size
        f.seek(tensors[name][2])
        f.write(bytes(memoryview(mx.full((64,), 0.5, dtype=mx.float16))))  # finite as bfloat16 too
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # as touch -r does
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    w2 = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    assert w2.swap_path != first
    check_pages(w2, path)  # the new bytes, not the stale swap file's
    assert entries(cache) == [w2.swap_path.parent.name]  # the older key is gone
    # Touching a file without changing it re-hashes, and reuses the entry.
    del w2
    os.utime(shard)
    w3 = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    assert len(entries(cache)) == 1 and w3.swap_path.parent.name == entries(cache)[0]


TWO_RUNS = textwrap.dedent("""
    import sys, mlx.core as mx
    from pathlib import Path
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model
    from mlx_pager.store import PagedWeights
    path, cache = Path(sys.argv[1]), sys.argv[2]
    model, _ = load_model(path, lazy=True)
    model.freeze()
    w = PagedWeights(model, path, budget_bytes=1 << 30, ssd_cache_dir=cache, store="swap")
    ref = dict(tree_flatten(load_model(path)[0].parameters()))
    for _ in range(3):
        for i in range(w.num_blocks):
            w.bind(i)
            for k, v in tree_flatten(model.layers[i].parameters()):
                assert mx.array_equal(v, ref[f"{w.block_prefixes[i]}.{k}"]).item(), k
            w.unbind(i)
    print("OK", w.swap_path.stat().st_ino, w.pager.stats()["checksum_errors"])
""")


def test_two_runs_started_apart_on_one_fresh_cache_dir_are_both_correct(models, tmp_path):
    path = models("llama", None)
    cache = tmp_path / "cache"
    procs = []
    for _ in range(2):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", TWO_RUNS, str(path), str(cache)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(0.6)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    inodes = {out.split()[1] for out, _ in outs}
    assert len(inodes) == 1  # the second run waited and reused the first's file
    assert all(out.split()[2] == "0" for out, _ in outs)
    assert len(entries(cache)) == 1


# ------------------------------------------------------------ cache dirs --


def test_cache_files_are_private(models, tmp_path):
    path = models("llama", None)
    cache = tmp_path / "cache"
    PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    for root, _dirs, files in os.walk(cache):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700, root
        for f in files:
            assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600, f


def test_interrupted_preparation_leaves_no_partial_file(models, tmp_path):
    path = models("llama", None)
    cache = tmp_path / "cache"

    def progress(done, total):
        raise interrupt.Interrupted(2)

    with pytest.raises(interrupt.Interrupted):
        PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap", progress=progress)
    assert not [f for f in cache.rglob("*") if "swap" in f.name]
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    check_pages(w, path)


def test_leftovers_of_killed_runs_are_cleaned(models, tmp_path):
    path = models("llama", None)
    cache = tmp_path / "cache"
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    key = w.swap_path.parent.name
    del w
    partial = cache / "0123456789abcdef0123"
    partial.mkdir()
    (partial / "prepare.lock").touch()
    (partial / ".pages.99999999.tmp.swap").write_bytes(b"x" * 10000)
    legacy = cache / "fedcba9876543210fedc"  # an entry of an earlier version: no locks
    legacy.mkdir()
    (legacy / "pages.swap").write_bytes(b"x" * 10000)
    (cache / "notes").mkdir()  # not an entry: left alone
    (cache / key / ".pages.99999999.tmp.swap").write_bytes(b"x" * 10000)
    (cache / key / "manifest.json").unlink()  # as if killed before the manifest
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    assert entries(cache) == sorted([key, "notes"])
    assert sorted(f.name for f in (cache / key).iterdir()) == [
        "manifest.json",
        "pages.swap",
        "prepare.lock",
        "use.lock",
    ]
    check_pages(w, path)


def test_cache_size_cap_removes_least_recently_used_entries(models, tmp_path):
    cache = tmp_path / "cache"
    a, b = own_model(models, tmp_path, "a"), own_model(models, tmp_path, "b")
    wa = PagedWeights(lazy(a), a, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    ka = wa.swap_path.parent.name
    wb = PagedWeights(lazy(b), b, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap", cache_max_bytes=1)
    assert ka in entries(cache)  # in use by wa: kept, whatever the cap
    del wa
    wb2 = PagedWeights(lazy(b), b, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap", cache_max_bytes=1)
    assert entries(cache) == [wb2.swap_path.parent.name]
    del wb


def lora_cli(*flags):
    cmd = [sys.executable, "-m", "mlx_pager.cli", "lora"]
    return subprocess.run(cmd + [str(f) for f in flags], capture_output=True, text=True, timeout=300)


def one_line_error(out, *needles):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("mlx-pager: ")]
    assert len(lines) == 1, out.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def cli_flags(model, data, tmp_path, cache):
    return [
        "--model",
        model,
        "--train",
        "--data",
        data,
        "--iters",
        1,
        "--batch-size",
        2,
        "--num-layers",
        2,
        "--adapter-path",
        tmp_path / "ad",
        "--memory-budget",
        "4GB",
        "--store",
        "swap",
        "--ssd-cache-dir",
        cache,
    ]


def test_cache_dir_that_is_a_file_is_one_line(models, train_only_data, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    out = lora_cli(*cli_flags(models("llama", None), train_only_data, tmp_path, f))
    one_line_error(out, str(f), "not a directory")


def _mount_tmpfs(where, *opts):
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(("mode=0700",) + opts), "tmpfs", str(where)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only or tiny tmpfs needs root")


@needs_root
def test_read_only_cache_dir_is_one_line(models, train_only_data, tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro")
    try:
        out = lora_cli(*cli_flags(models("llama", None), train_only_data, tmp_path, ro))
        one_line_error(out, str(ro), "not writable")
    finally:
        subprocess.run(["umount", str(ro)])


@needs_root
def test_full_disk_cache_dir_is_one_line_and_leaves_no_swap_file(models, train_only_data, tmp_path):
    small = tmp_path / "small"
    _mount_tmpfs(small, "size=512k")
    try:
        out = lora_cli(*cli_flags(models("llama", None), train_only_data, tmp_path, small))
        one_line_error(out, "pages.swap", "needs", "free")
        assert not [p for p in small.rglob("*") if "swap" in p.name]
    finally:
        subprocess.run(["umount", str(small)])


def test_enospc_while_writing_the_swap_file_is_one_error_and_no_file(models, tmp_path):
    path = models("llama", None)
    cache = tmp_path / "cache"
    _core.inject_swap_write_error(100_000)
    try:
        with pytest.raises(swapcache.CacheDirError) as e:
            PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(cache), store="swap")
    finally:
        _core.inject_swap_write_error(-1)
    assert e.value.errno == errno.ENOSPC and "pages.swap" in str(e.value) and "free" in str(e.value)
    assert not [p for p in cache.rglob("*") if "swap" in p.name]


# ----------------------------------------------------------- model files --


def test_truncated_shard_is_one_line_naming_the_file(models, train_only_data, tmp_path):
    path = own_model(models, tmp_path)
    shard = next(path.glob("model*.safetensors"))
    os.truncate(shard, shard.stat().st_size - min(1 << 20, shard.stat().st_size // 2))
    out = lora_cli(*cli_flags(path, train_only_data, tmp_path, tmp_path / "cache"))
    one_line_error(out, shard.name)


def test_flipped_header_is_one_line_naming_the_file(models, train_only_data, tmp_path):
    path = own_model(models, tmp_path)
    shard = next(path.glob("model*.safetensors"))
    flip(shard, 20, 4)
    out = lora_cli(*cli_flags(path, train_only_data, tmp_path, tmp_path / "cache"))
    one_line_error(out, shard.name)


# -------------------------------------------------------- fault injection --

PAGES = 1 << 20  # a page budget of about two blocks: pages are read every step


@pytest.fixture
def inject(monkeypatch):
    """inject(kind, **rule): every PagedWeights the trainer makes gets the
    fault rule (Pager.inject_faults) on its swap file's reads."""
    from mlx_pager import session

    rules = []

    class Injected(PagedWeights):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if rules:
                kind, rule = rules[-1]
                self.pager.inject_faults(kind, path_contains="pages.swap", **rule)

    monkeypatch.setattr(session, "PagedWeights", Injected)
    return lambda kind, **rule: rules.append((kind, rule))


def test_transient_eio_and_short_reads_are_retried(models, train_only_data, tmp_path, inject):
    model = models("llama", None)
    # the same page budget as the faulty runs: the same placements, so the same bits
    clean = train(model, train_only_data, tmp_path, tmp_path / "cache", adapters="a0", page_budget=PAGES)
    inject("eio", skip=3, count=2)
    got = train(model, train_only_data, tmp_path, tmp_path / "cache", adapters="a1", page_budget=PAGES)
    assert [s["loss"] for s in got.steps] == [s["loss"] for s in clean.steps]
    assert got.pager_stats["io_retries"] == 2 and got.pager_stats["read_errors"] == 0
    inject("short", skip=5, count=1, length=4096)
    got = train(model, train_only_data, tmp_path, tmp_path / "cache", adapters="a2", page_budget=PAGES)
    assert [s["loss"] for s in got.steps] == [s["loss"] for s in clean.steps]
    assert got.pager_stats["io_retries"] == 1 and got.pager_stats["read_errors"] == 0


def test_persistent_eio_stops_the_run_with_adapters_and_resume_state(models, train_only_data, tmp_path, inject):
    model = models("llama", None)
    train(model, train_only_data, tmp_path, tmp_path / "cache", adapters="a0")  # writes the swap file
    inject("eio", skip=12, count=-1)
    with pytest.raises(OSError, match="pages.swap") as e:
        train(model, train_only_data, tmp_path, tmp_path / "cache", adapters="a1", iters=20, page_budget=PAGES)
    assert isinstance(e.value, _core.PageReadError) and "--resume" in str(e.value)
    ad = tmp_path / "a1"
    assert (ad / "adapters.safetensors").exists()
    mx.load(str(ad / "adapters.safetensors"))  # loads: nothing corrupt
    assert [f for f in ad.iterdir() if "resume" in f.name or "state" in f.name]
    assert not [f for f in ad.iterdir() if ".tmp" in f.name]
