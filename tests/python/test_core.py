"""The C++ pager through its bindings: mx.array across the boundary, exact
bytes for every dtype, the budget against Belady, errors naming the page."""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_pager import Pager, SwapWriter, read_safetensors_index
from mlx_pager._core import swap_page_bytes


def every_dtype():
    mx.random.seed(5)
    r = mx.random.normal((6, 40))
    arrays = {
        "f32": r,
        "f16": r.astype(mx.float16),
        "bf16": r.astype(mx.bfloat16),
        "u8": (mx.abs(r) * 40).astype(mx.uint8),
        "i8": (r * 40).astype(mx.int8),
        "u16": (mx.abs(r) * 900).astype(mx.uint16),
        "i16": (r * 900).astype(mx.int16),
        "u32": (mx.abs(r) * 1e6).astype(mx.uint32),
        "i32": (r * 1e6).astype(mx.int32),
        "u64": (mx.abs(r) * 1e9).astype(mx.uint64),
        "i64": (r * 1e9).astype(mx.int64),
        "bool": r > 0,
        "c64": r.astype(mx.complex64),
        "scalar": mx.array(3.5),
    }
    w = mx.random.normal((32, 128)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    arrays.update({"q.weight": q, "q.scales": s, "q.biases": b})
    mx.eval(arrays)
    return arrays


def same_bytes(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape

    def flat(x):
        return x.reshape(-1).view(mx.uint8)

    return np.array_equal(np.array(flat(a)), np.array(flat(b)))


def in_place_page(pager, name, path):
    tensors, _, _ = read_safetensors_index(str(path))
    spec = [(k, str(path), off, n, dt, shape) for k, (dt, shape, off, n) in tensors.items()]
    return pager.add_page_in_place(name, spec)


def test_mx_array_crosses_the_boundary_both_ways(tmp_path):
    arrays = every_dtype()
    w = SwapWriter(str(tmp_path / "p.swap"), swap_page_bytes([a.nbytes for a in arrays.values()]))
    off = w.write_page(list(arrays.values()))  # mx.array into C++
    w.finish()
    p = Pager(1 << 24)
    pid = p.add_page_from_swap(
        "p", str(tmp_path / "p.swap"), off, [(k, a.dtype, list(a.shape)) for k, a in arrays.items()]
    )
    got = p.acquire(pid)  # mx.array out of C++
    assert all(isinstance(v, mx.array) for v in got.values())
    for k, a in arrays.items():
        assert same_bytes(got[k], a), k
    p.release(pid)


def test_every_dtype_in_place_equals_mx_load(tmp_path):
    arrays = every_dtype()
    path = tmp_path / "all.safetensors"
    mx.save_safetensors(str(path), arrays)  # MLX's writer: data at odd offsets
    p = Pager(1 << 24, readahead=0)
    pid = in_place_page(p, "all", path)
    got = p.acquire(pid)
    loaded = mx.load(str(path))
    for k in arrays:
        assert same_bytes(got[k], loaded[k]), k
    x = mx.random.normal((3, 128)).astype(mx.bfloat16)
    y1 = mx.quantized_matmul(x, got["q.weight"], got["q.scales"], got["q.biases"], group_size=64, bits=4)
    y2 = mx.quantized_matmul(x, loaded["q.weight"], loaded["q.scales"], loaded["q.biases"], group_size=64, bits=4)
    assert mx.array_equal(y1, y2).item()
    assert mx.array_equal(
        got["bf16"] @ got["f32"].T.astype(mx.bfloat16), loaded["bf16"] @ loaded["f32"].T.astype(mx.bfloat16)
    ).item()
    p.release(pid)
    assert p.stats()["direct_files"] == 1


def belady_loads(seq, k):
    cache, loads = [], 0
    for t, page in enumerate(seq):
        if page in cache:
            continue
        loads += 1
        if len(cache) == k:

            def next_use(q, t=t):
                return next((u for u in range(t + 1, len(seq)) if seq[u] == q), len(seq) + 1)

            cache.remove(max(cache, key=next_use))
        cache.append(page)
    return loads


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("readahead", [0, 2])
def test_budget_holds_and_optimal_reads_belady_minimum(tmp_path, k, readahead):
    n = 8
    blocks = {f"b{i}": mx.full((64, 256), float(i)) for i in range(n)}  # 64 KiB each
    path = tmp_path / "blocks.safetensors"
    mx.save_safetensors(str(path), blocks)
    tensors, _, _ = read_safetensors_index(str(path))
    p = Pager(1, readahead=readahead, policy="optimal")
    ids = []
    for i in range(n):
        dt, shape, off, nb = tensors[f"b{i}"]
        ids.append(p.add_page_in_place(f"p{i}", [(f"b{i}", str(path), off, nb, dt, shape)]))
    footprint = max(p.page_bytes(i) for i in ids) + 4096
    budget = k * footprint
    p.set_budget(budget)
    step = list(range(n)) + list(range(n - 1, -1, -1))
    seq = step * 3
    p.set_schedule(seq, repeat=False)
    for i in seq:
        arrays = p.acquire(ids[i])
        assert arrays[f"b{i}"][0, 0].item() == float(i)
        assert p.stats()["resident_bytes"] <= budget
        del arrays
        p.release(ids[i])
    s = p.stats()
    assert s["peak_resident_bytes"] <= budget
    assert s["pages_read"] == belady_loads(seq, k)


def test_unreadable_page_names_page_and_file(tmp_path):
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"w": mx.ones((1024, 1024))})
    p = Pager(1 << 24, readahead=0)
    pid = in_place_page(p, "layers.7", path)
    os.truncate(path, 1000)  # the file is cut short after the pager planned it
    with pytest.raises(OSError) as e:
        p.acquire(pid)
    assert "layers.7" in str(e.value) and "w.safetensors" in str(e.value)
    assert p.stats()["read_errors"] == 1


def test_arrays_may_outlive_their_pager(tmp_path):
    """A model may still hold a lazy page's views (or an unevaluated graph)
    when the Pager is dropped: the views keep their memory, their lease ends
    harmlessly, and a late evaluation is an error naming the page."""
    import gc

    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"a": mx.ones((256, 256)), "b": mx.full((256,), 2.0)})
    p = Pager(1 << 24, readahead=0)
    pid = in_place_page(p, "layers.3", path)
    views = p.lazy_page(pid, mx.array(0.0))
    mx.eval(views)
    late = p.lazy_page(pid, mx.array(0.0))
    del p
    gc.collect()
    assert mx.sum(views[0]).item() == 256 * 256 and mx.sum(views[1]).item() == 512
    del views
    gc.collect()
    with pytest.raises(RuntimeError, match="page 'layers.3' is evaluated after its Pager"):
        mx.eval(late)


def test_bad_inputs_are_errors_not_crashes(tmp_path):
    with pytest.raises(Exception, match="cannot open|No such file"):
        read_safetensors_index(str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(RuntimeError, match="junk.safetensors"):
        read_safetensors_index(str(tmp_path / "junk.safetensors"))
    with pytest.raises(ValueError, match="'lru' or 'optimal'"):
        Pager(1 << 20, policy="fifo")
    p = Pager(1 << 20)
    with pytest.raises(IndexError):
        p.acquire(3)
    with pytest.raises(Exception, match="no page named"):
        p.acquire("nope")


def test_freed_frames_pages_go_to_the_next_frames_within_the_budget(tmp_path):
    # mlx_frames.h, page_pool.h: where the page pool runs (Linux, MLX's CPU
    # backend), a freed frame's pages go to the pool, not its buffer; frames
    # of other sizes take them; pages plus pool stay within the budget, and
    # dropping the kept memory empties the pool.
    sizes = [(64, 256), (96, 256), (48, 256), (96, 256)]
    blocks = {f"b{i}": mx.full(shape, float(i)) for i, shape in enumerate(sizes)}
    path = tmp_path / "blocks.safetensors"
    mx.save_safetensors(str(path), blocks)
    tensors, _, _ = read_safetensors_index(str(path))
    p = Pager(1, readahead=0, policy="lru")
    ids = []
    for i in range(len(sizes)):
        dt, shape, off, nb = tensors[f"b{i}"]
        ids.append(p.add_page_in_place(f"p{i}", [(f"b{i}", str(path), off, nb, dt, shape)]))
    budget = max(p.page_bytes(i) for i in ids) + 3 * 4096  # one frame
    p.set_budget(budget)
    if sys.platform != "linux" or mx.metal.is_available() or mx.cuda.is_available():
        assert p.stats()["pool_bytes"] == 0  # no pool: the kept frame (test above)
        return
    for i in ids + ids:
        arrays = p.acquire(i)
        assert same_bytes(arrays[f"b{i}"], blocks[f"b{i}"])
        assert p.stats()["resident_bytes"] + p.stats()["pool_bytes"] <= budget
        p.release(i)
        del arrays
        p.evict_all()
        assert p.kept_frame_bytes() == 0  # the pool in its place
        assert 0 < p.stats()["pool_bytes"] <= budget
    # Every read after the first landed (mostly) in pages the one before left.
    assert p.stats()["pool_filled_bytes"] >= sum(p.page_bytes(i) for i in ids[1:]) // 2
    pooled = p.stats()["pool_bytes"]
    assert p.drop_kept_frame() == pooled
    assert p.stats()["pool_bytes"] == 0
    # Dropped (a session closed): a frame freed late, by arrays that
    # outlived the drop, is not kept; the next read resumes the pool.
    arrays = p.acquire(ids[0])
    p.release(ids[0])
    p.evict_all()
    p.drop_kept_frame()
    del arrays
    assert p.stats()["pool_bytes"] == 0
    arrays = p.acquire(ids[1])
    p.release(ids[1])
    del arrays
    p.evict_all()
    assert p.stats()["pool_bytes"] > 0


def test_a_freed_frame_is_kept_for_the_next_read_and_can_be_dropped(tmp_path):
    # mlx_frames.h, without the page pool (a GPU backend, macOS): the last
    # frame freed is reused by the next read that fits it (memory already
    # mapped), outside the page budget; dropping it frees it.
    n = 3
    blocks = {f"b{i}": mx.full((64, 256), float(i)) for i in range(n)}
    path = tmp_path / "blocks.safetensors"
    mx.save_safetensors(str(path), blocks)
    tensors, _, _ = read_safetensors_index(str(path))
    p = Pager(1, readahead=0, policy="lru", page_pool=False)
    ids = []
    for i in range(n):
        dt, shape, off, nb = tensors[f"b{i}"]
        ids.append(p.add_page_in_place(f"p{i}", [(f"b{i}", str(path), off, nb, dt, shape)]))
    p.set_budget(p.page_bytes(ids[0]) + 3 * 4096)  # one frame
    assert p.kept_frame_bytes() == 0
    for i in ids:
        arrays = p.acquire(i)
        assert p.kept_frame_bytes() == 0  # the read took the frame kept before it
        assert same_bytes(arrays[f"b{i}"], blocks[f"b{i}"])
        p.release(i)
        del arrays
        p.evict_all()  # the frame is freed: kept, outside the budget
        assert p.stats()["resident_bytes"] == 0
        assert p.kept_frame_bytes() >= p.page_bytes(i)
    assert p.stats()["pages_read"] == n
    assert p.stats()["peak_resident_bytes"] <= p.budget
    kept = p.kept_frame_bytes()
    assert p.drop_kept_frame() == kept
    assert p.kept_frame_bytes() == 0
    assert p.drop_kept_frame() == 0


def _hash_in_a_process(xxh3_env):
    """hash_file of a fixed file and xxh3_build(), in a fresh process (the
    build is chosen once a process) with MLX_PAGER_XXH3 set to xxh3_env."""
    import subprocess

    env = dict(os.environ, MLX_PAGER_XXH3=xxh3_env)
    code = (
        "import os, tempfile\n"
        "from mlx_pager._core import hash_file, xxh3_build\n"
        "p = os.path.join(tempfile.mkdtemp(), 'f')\n"
        "open(p, 'wb').write(bytes(range(256)) * 40000 + b'tail')\n"
        "print(hash_file(p, [(3, 1000), (5000, 4000000)]), xxh3_build())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_every_xxh3_build_gives_the_same_digests_and_a_bad_choice_is_named():
    from mlx_pager._core import xxh3_build

    auto, portable = _hash_in_a_process("auto"), _hash_in_a_process("portable")
    assert auto.returncode == 0 and portable.returncode == 0, auto.stderr + portable.stderr
    *digests_auto, build_auto = auto.stdout.split()
    *digests_portable, build_portable = portable.stdout.split()
    assert build_portable == "portable" and build_auto == xxh3_build()
    assert digests_auto == digests_portable  # swap caches keyed by them stay valid
    bad = _hash_in_a_process("sse9")
    assert bad.returncode != 0
    assert "MLX_PAGER_XXH3=sse9" in bad.stderr and "auto (the default), avx2 or portable" in bad.stderr
