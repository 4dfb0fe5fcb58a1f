"""kinds.py: which blocks a start-up probe of one stands for."""

import mlx.core as mx
import pytest

from mlx_pager import architectures as A
from mlx_pager import kinds
from mlx_pager import step as S


@pytest.fixture(scope="module")
def arch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kinds")


def loaded(arch_root, arch, length=64):
    """(model, calls, footprints) of the tiny `arch` (4 blocks, LoRA on all),
    its calls recorded on `length` tokens."""
    path = A.build(arch, "fp32", arch_root)
    model, w = A.paged(path, 4, "auto", str(arch_root / f"{arch}-swap"))
    calls = S.record_calls(model, mx.zeros((1, length), dtype=mx.int32))[1]
    return model, calls, [w.block_charge_bound(i) for i in range(len(model.layers))]


def test_a_model_of_one_kind_is_measured_on_one_block(arch_root):
    model, calls, _ = loaded(arch_root, "llama")
    assert kinds.block_kinds(model, calls, range(4)) == [[0, 1, 2, 3]]
    # (ties on bytes: the lowest block, the first trained one)
    assert list(kinds.represented(model, calls, range(1, 4), [10] * 4)) == [1]
    assert list(kinds.represented(model, calls, range(4), [10, 10, 12, 10])) == [2]
    assert list(kinds.represented(model, calls, [], [10] * 4)) == []


@pytest.mark.parametrize(
    "arch,groups",
    [
        ("lfm2", [[0, 2], [1, 3]]),  # short convolutions / attention
        ("gemma3_text", [[0, 2], [1, 3]]),  # is_sliding, its window's mask against "causal"
        ("qwen3_next", [[0, 2], [1], [3]]),  # linear attention with experts / a dense MLP / full attention
        ("jamba", [[0, 2], [1, 3]]),  # Mamba / attention
    ],
)
def test_kinds_differ_by_class_parameters_call_and_settings(arch_root, arch, groups):
    model, calls, _ = loaded(arch_root, arch)
    assert kinds.block_kinds(model, calls, range(4)) == groups


def test_a_setting_that_names_each_block_does_not_split_them(arch_root):
    """mamba2's blocks differ only in layer_idx, their index: a name, not a
    kind. An integer setting that is not the index plus one offset is a kind
    (a window of 16 in block 1, 32 in block 3), and so is a bool that would
    be (False in block 0, True in block 1), and so is one that looks like
    an index on the blocks compared but not on the model's."""
    model, calls, _ = loaded(arch_root, "mamba2")
    named = [m for l in model.layers for _, m in l.named_modules() if "layer_idx" in vars(m)]
    assert [m.layer_idx for m in named] == [0, 1, 2, 3]
    assert kinds.block_kinds(model, calls, range(4)) == [[0, 1, 2, 3]]
    assert kinds.block_kinds(model, calls, range(2, 4)) == [[2, 3]]
    try:
        for m, v in zip(named, [16, 16, 16, 32]):
            m.window = v
        assert kinds.block_kinds(model, calls, range(4)) == [[0, 1, 2], [3]]
        for m, v in zip(named, [False, True, True, True]):
            m.window = v
        assert kinds.block_kinds(model, calls, range(4)) == [[0], [1, 2, 3]]
        # (whether a setting names the blocks is judged on the whole model:
        # two of an alternating 0 / 1 flag's blocks look like an index)
        for m, v in zip(named, [0, 1, 0, 1]):
            m.window = v
        assert kinds.block_kinds(model, calls, range(2, 4)) == [[2], [3]]
    finally:
        for m in named:
            del m.window


def test_more_kinds_than_the_most_are_grouped_by_class_and_call(arch_root, monkeypatch):
    """OpenELM's heads and widths grow with depth: every block its own kind.
    Past MAX_KINDS, one block per class and call: the one with most bytes."""
    model, calls, footprints = loaded(arch_root, "openelm")
    assert kinds.block_kinds(model, calls, range(4)) == [[0], [1], [2], [3]]
    assert list(kinds.represented(model, calls, range(4), footprints)) == [0, 1, 2, 3]
    monkeypatch.setattr(kinds, "MAX_KINDS", 2)
    assert footprints[3] == max(footprints)
    assert list(kinds.represented(model, calls, range(4), footprints)) == [3]


def test_a_call_s_signature_is_its_arrays_shapes_and_its_other_arguments():
    sig = kinds.call_signature
    a, b = mx.zeros((2, 3)), mx.ones((2, 3))
    assert sig(((a,), {"mask": "causal"})) == sig(((b,), {"mask": "causal"}))
    assert sig(((a,), {"mask": "causal"})) != sig(((a,), {"mask": mx.zeros((3, 3), dtype=mx.bool_)}))
    assert sig(((a,), {})) != sig(((a.astype(mx.bfloat16),), {}))
    assert sig(((a,), {"cache": None})) != sig(((a,), {"cache": object()}))
    assert sig([a, {"k": 1}]) == ("list", (("array", (2, 3), str(mx.float32)), ("dict", (("k", 1),))))
