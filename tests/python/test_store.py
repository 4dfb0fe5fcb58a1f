"""The swap store: a model's frozen weights as pages, read in place or from a
swap file written once and reused; placeholders that hold no memory."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from mlx_pager.store import PAGE_PART_BYTES, RESIDENT_PAGE, PagedWeights, block_footprints, split_block


def lazy(path):
    model, _ = load_model(path, lazy=True)
    model.freeze()
    return model


@pytest.mark.parametrize("store", ["in_place", "swap"])
def test_pages_hold_the_models_weights(models, tmp_path, store):
    path = models("qwen3", 4)
    ref = dict(tree_flatten(load_model(path)[0].parameters()))
    model = lazy(path)
    w = PagedWeights(model, path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), store=store)
    assert w.num_blocks == len(model.layers) and set(w.store_kind) == {store}
    # Until bound, the model holds placeholders: right shapes, no memory.
    before = mx.get_active_memory()
    for name, a in tree_flatten(model.parameters()):
        assert a.shape == ref[name].shape and a.dtype == ref[name].dtype
    assert mx.get_active_memory() - before < 1 << 16
    w.pin_resident()
    read = w.pager.stats()["bytes_read"]
    for i in range(w.num_blocks):
        w.bind(i)
        got = dict(tree_flatten(model.layers[i].parameters()))
        prefix = w.block_prefixes[i]
        for k, v in got.items():
            assert mx.array_equal(v, ref[f"{prefix}.{k}"]).item(), k
        w.unbind(i)
        # What each page's read transferred, as page_read_bytes says (the
        # bench's MIN counts it), under what the page is charged.
        now = w.pager.stats()["bytes_read"]
        assert now - read == sum(w.page_read_bytes(p) for p in w.block_pages[i])
        assert all(0 < w.page_read_bytes(p) < w.page_footprint(p) for p in w.block_pages[i])
        read = now
    assert w.pager.lookup(RESIDENT_PAGE) == w.resident_id


def test_swap_file_is_written_once_and_reused(models, tmp_path):
    path = models("llama", None)
    w1 = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), store="swap")
    swap = w1.swap_path
    mtime = swap.stat().st_mtime_ns
    del w1
    w2 = PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), store="swap")
    assert w2.swap_path == swap and swap.stat().st_mtime_ns == mtime
    w2.bind(0)
    w2.unbind(0)


def test_writing_the_swap_file_holds_one_page_at_a_time(models, tmp_path):
    # Each page is evaluated to be written; the model's own references to
    # its arrays kept every page written so far in memory, so writing the
    # swap file of a model took the whole model's memory (a 4.9 GB
    # Gemma-3-shaped model was killed under a 4.5 GB cap).
    path = models("llama", None)
    model = lazy(path)
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    w = PagedWeights(model, path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), store="swap")
    pages = [w.pager.page_bytes(p) for p in range(len(w.slots))]
    assert len(pages) > 3
    assert mx.get_peak_memory() - base <= max(pages) * 1.1, (mx.get_peak_memory() - base, pages)
    assert mx.get_active_memory() - base < 1 << 16


def test_swap_without_a_cache_dir_is_a_clear_error(models):
    path = models("llama", None)
    with pytest.raises(ValueError, match="ssd_cache_dir"):
        PagedWeights(lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=None, store="swap")
    with pytest.raises(ValueError, match="'auto', 'in_place' or 'swap'"):
        PagedWeights(lazy(path), path, budget_bytes=1 << 30, store="disk")


def test_unbinding_twice_is_an_error(models, tmp_path):
    path = models("llama", None)
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30)
    w.bind(1)
    w.unbind(1)
    with pytest.raises(RuntimeError, match="not bound"):
        w.unbind(1)


def test_a_module_s_own_reference_to_a_page_array_leaves_with_it(models, tmp_path):
    """A module may keep the weight it last saw (plamo3's RMSNorm in eval
    mode keeps `_scale_weight` to know when its cached scale is stale):
    unbinding points that entry at the placeholder too, or it would keep
    the page's frame alive after its release."""
    path = models("llama", None)
    w = PagedWeights(lazy(path), path, budget_bytes=1 << 30)
    norm = w.model.model.layers[1].input_layernorm
    w.bind(1)
    page_array = norm.weight
    norm._seen = norm.weight  # as a module caching from its weight does
    norm._other = mx.ones((3,))
    w.unbind(1)
    assert norm._seen is norm.weight and norm._seen is not page_array  # the placeholder
    assert norm._other.tolist() == [1.0, 1.0, 1.0]  # anything else is left alone
    w.bind(1)
    assert norm.weight is not norm._seen  # a module comparing with `is` sees it is new
    w.unbind(1)


def test_tensors_changed_by_sanitize_are_not_read_in_place(tmp_path):
    """baichuan_m1's sanitize normalizes its LM head's rows on loading: same
    name, shape and dtype as in the file, other values. Reading that tensor
    in place would train against the wrong head; it goes to the swap file,
    and the pages hold what mlx-lm's load_model holds."""
    from mlx_pager import architectures as A

    path = A.build("baichuan_m1", "bf16", tmp_path)
    ref = dict(tree_flatten(load_model(path)[0].parameters()))
    with pytest.raises(ValueError, match="lm_head.weight") as e:
        PagedWeights(lazy(path), path, budget_bytes=1 << 30, store="in_place")
    assert "use --store auto or swap" in str(e.value)  # the fix, as a CLI user writes it
    model = lazy(path)
    w = PagedWeights(model, path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path / "swap"), store="auto")
    assert w.store_kind[w.resident_id] == "swap" and w.store_kind[w.block_pages[0][0]] == "in_place"
    w.pin_resident()
    assert mx.array_equal(model.lm_head.weight, ref["lm_head.weight"]).item()


def test_split_block_keeps_modules_whole_norms_first_and_parts_balanced():
    MB = 1 << 20
    params = {
        "attn.q.weight": mx.zeros((4 * MB // 4, 1), mx.float32),  # 4 MB
        "attn.k.weight": mx.zeros((MB // 4, 1), mx.float32),
        "attn.k.bias": mx.zeros((4,), mx.float32),
        "mlp.up.weight": mx.zeros((6 * MB // 4, 1), mx.uint32),  # a quantized layer: 6 MB
        "mlp.up.scales": mx.zeros((MB // 4, 1), mx.float32),
        "mlp.down.weight": mx.zeros((5 * MB // 4, 1), mx.float32),
        "norm.weight": mx.zeros((8,), mx.float32),
    }
    names = list(params)
    assert split_block(names, params, 1) == [["norm.weight"] + names[:-1]]
    parts = split_block(names, params, 3)
    assert parts == [
        ["norm.weight", "attn.q.weight", "attn.k.weight", "attn.k.bias"],
        ["mlp.up.weight", "mlp.up.scales"],
        ["mlp.down.weight"],
    ]
    # Never more pages than modules with weights, nor asked for.
    assert len(split_block(names, params, 8)) <= 4
    # By size: one page per PAGE_PART_BYTES.
    big = {f"l{i}.weight": mx.zeros((PAGE_PART_BYTES // 4, 1), mx.float32) for i in range(6)}
    assert len(split_block(list(big), big)) == 6
    assert len(split_block(list(big)[:1], big)) == 1


def test_a_block_in_several_pages_binds_whole(models, tmp_path):
    path = models("llama", None)
    ref = dict(tree_flatten(load_model(path)[0].parameters()))
    model = lazy(path)
    w = PagedWeights(model, path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), page_parts=2)
    assert all(len(p) == 2 for p in w.block_pages)
    assert w.page_order == [p for ps in w.block_pages for p in ps]
    assert w.block_footprint(0) == sum(w.page_footprint(p) for p in w.block_pages[0])
    assert w.pager.page_name(w.block_pages[1][1]) == "layers.1:1"
    w.pin_resident()
    w.bind(1)
    for k, v in tree_flatten(model.layers[1].parameters()):
        assert mx.array_equal(v, ref[f"{w.block_prefixes[1]}.{k}"]).item(), k
    w.unbind(1)


@pytest.mark.parametrize("arch, bits, store", [("qwen3", 4, "auto"), ("llama", None, "swap")])
def test_block_footprints_before_registering_are_what_the_pages_are_charged(models, tmp_path, arch, bits, store):
    """store.block_footprints plans a split without registering it (what
    --page-parts auto checks against the budget): the most each block may be
    charged, as PagedWeights then counts it (block_charge_bound), in place
    and in a swap file, whole and in parts; parts cost more than the whole
    block (alignment, read-through, and each part's reuse slack)."""
    path = models(arch, bits)
    got = {}
    for parts in (1, 4):
        planned = block_footprints(lazy(path), path, parts, store)
        w = PagedWeights(
            lazy(path), path, budget_bytes=1 << 30, ssd_cache_dir=str(tmp_path), store=store, page_parts=parts
        )
        assert planned == [w.block_charge_bound(i) for i in range(w.num_blocks)], parts
        got[parts] = planned
    assert all(p > w for p, w in zip(got[4], got[1]))
