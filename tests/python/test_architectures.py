"""Every mlx-lm architecture: a tiny generated model of each model_type in
mlx_lm.models (4 blocks, LoRA on all of them), in bf16, float32 and 4-bit,
paged; its loss and every adapter gradient must be BITWISE mlx-lm's
(default_loss under nn.value_and_grad, same batch).

The paged blocks run uncompiled here (step.Blocks(model, compile=False)): on
the CPU backend mx.compile JIT-builds C++ kernels for every new graph, which
for ~250 models would take most of the CI budget. The compiled path is
checked bitwise against mlx-lm in test_step.py (llama and qwen3, bf16 and
4-bit, and dbrx's fallback to uncompiled blocks).

An architecture that cannot be built (or whose own mlx-lm LoRA step fails),
or that mlx-pager refuses with its one-line reason, is reported as a skip
with the reason. One recorded as passing (architectures.RECORDED) that no
longer passes fails, as does any architecture that builds and is not refused
but does not match."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlx_pager import architectures as A
from mlx_pager import attention


@pytest.fixture(scope="session")
def arch_root(tmp_path_factory):
    return tmp_path_factory.mktemp("archs")


@pytest.mark.parametrize("dtype", A.DTYPES)
@pytest.mark.parametrize("model_type", A.model_types())
def test_architecture_is_paged_bitwise(arch_root, model_type, dtype):
    r = A.check(model_type, dtype, arch_root)
    mx.clear_cache()
    recorded = A.RECORDED.get(model_type, {}).get(dtype)
    if r.status == "pass":
        return
    if recorded == "pass":
        pytest.fail(f"{model_type} {dtype} passed before, now {r.status}: {r.reason}")
    if r.status in ("cannot build", "refused"):
        pytest.skip(f"{r.status}: {r.reason}")
    pytest.fail(f"{model_type} {dtype}: {r.reason}")


@pytest.mark.parametrize("model_type", ["llama", "mamba", "qwen3_next", "deepseek_v3", "lfm2"])
def test_trained_adapters_in_recomputed_compiled_blocks_are_bitwise(arch_root, model_type):
    """The matrix checks fresh adapters (lora_b zeros) with the blocks
    uncompiled; from the second step the adapters are not zeros, and a
    recomputed block runs compiled. Random adapters on every block, every
    block recomputed and compiled (float32): mlx-lm's loss and gradients bit
    for bit. (A sweep of every float32 architecture found six, those with
    the tanh GELU, a few entries apart: docs/design.md, "The step is
    compiled"; in bf16 and 4-bit, none.)"""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.trainer import default_loss

    from mlx_pager import step as S

    path = A.build(model_type, "fp32", arch_root)
    batch = A.sample_batch(path)
    ref = A.reference(path, -1)
    model, w = A.paged(path, -1, "auto", str(arch_root / f"trained-{model_type}"))
    flat = tree_flatten(ref.trainable_parameters())
    keys = mx.random.split(mx.random.key(3), len(flat))
    new = [(n, (0.05 * mx.random.normal(v.shape, key=k)).astype(v.dtype) + v) for (n, v), k in zip(flat, keys)]
    for m in (ref, model):
        m.update(tree_unflatten(new))
    assert all(mx.any(v != 0).item() for n, v in new if n.endswith("lora_b"))
    (loss, _), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
    mx.eval(loss, grads)
    blocks = S.Blocks(model, compile=True)
    losses, _, got = S.paged_value_and_grad(model, w, [S.MicroBatch.from_batch(*batch)], blocks=blocks)
    assert not blocks.uncompiled
    assert losses[0].item() == loss.item()
    assert not A.bitwise_mismatches(dict(tree_flatten(grads)), got)
    mx.clear_cache()


def _unquantized(model_type):
    """bf16 where it passes, else float32 (bf16 MoE cannot run on the CPU
    backend: its GatherMM takes float32 only), else None."""
    rec = A.RECORDED.get(model_type, {})
    return next((d for d in ("bf16", "fp32") if rec.get(d) == "pass"), None)


@pytest.mark.parametrize(
    "model_type,dtype", [(mt, _unquantized(mt)) for mt in A.model_types() if _unquantized(mt) is not None]
)
def test_architecture_in_parts_is_paged_bitwise(arch_root, model_type, dtype):
    """Each block in up to 3 pages (what --page-parts auto does at a small
    budget: a forward block's parts read lazily inside its graph), bf16
    (float32 for the MoE models the CPU backend cannot run in bf16): every
    architecture recorded as passing whole passes in parts."""
    r = A.check(model_type, dtype, arch_root, page_parts=3)
    mx.clear_cache()
    assert r.status == "pass", f"{model_type} {dtype} in parts: {r.status}: {r.reason}"


@pytest.mark.parametrize("dtype", A.DTYPES)
@pytest.mark.parametrize("model_type", [mt for mt in A.model_types() if "pass" in A.RECORDED.get(mt, {}).values()])
def test_architecture_generates_bitwise_at_the_least_page_budget(arch_root, model_type, dtype):
    """Generation through a prompt cache at the least page budget: the
    prompt's and 5 greedy steps' logits are mlx-lm's bit for bit (found
    this way: plamo3's norms kept released pages alive, and
    longcat_flash_ngram's n-gram cache was appended to twice a step)."""
    if A.RECORDED[model_type].get(dtype) != "pass":
        pytest.skip(f"not a training pass in {dtype}")
    r = A.check_generation(model_type, dtype, arch_root)
    mx.clear_cache()
    if r.status == "cannot build":
        pytest.skip(r.reason)
    assert r.status == "pass", f"{model_type} {dtype}: {r.status}: {r.reason}"


@pytest.mark.parametrize("model_type", [mt for mt in A.model_types() if A.RECORDED.get(mt, {}).get("fp32") == "pass"])
def test_architecture_s_attention_in_chunks_is_its_attention(arch_root, model_type):
    """mlx-lm's own LoRA step (float32, 64 tokens) with attention in chunks
    of 16 query rows (attention.py, as a session routes it where one
    sequence does not fit whole): the loss and every adapter gradient
    within float32 rounding of the whole attention's, whatever each
    architecture passes MLX's attention (masks by rows or broadcast, masks
    computed from the inputs as MLA's, sinks, grouped heads, other value
    widths). Architectures that compute attention another way are skipped."""
    from mlx_lm.tuner.trainer import default_loss

    path = A.build(model_type, "fp32", arch_root)
    batch = A.sample_batch(path, max_tokens=64)
    ref = A.reference(path, A.LAYERS)
    f = nn.value_and_grad(ref, default_loss)
    (whole, _), g_whole = f(ref, *batch)
    mx.eval(whole, g_whole)
    seen = []
    with attention.query_chunks(16):
        routed = mx.fast.scaled_dot_product_attention

        def counting(q, *a, **kw):
            seen.append(q.shape[-2])
            return routed(q, *a, **kw)

        mx.fast.scaled_dot_product_attention = counting
        (chunked, _), g_chunked = f(ref, *batch)
        mx.eval(chunked, g_chunked)
    assert mx.fast.scaled_dot_product_attention is attention._original
    if not any(t > 16 for t in seen):
        pytest.skip("computes attention without mx.fast.scaled_dot_product_attention")
    assert abs(whole.item() - chunked.item()) <= 1e-6 * abs(whole.item())
    g_chunked = dict(tree_flatten(g_chunked))
    for name, g in tree_flatten(g_whole):
        off, norm = mx.linalg.norm((g - g_chunked[name]).flatten()).item(), mx.linalg.norm(g.flatten()).item()
        assert off <= 2e-5 * norm, (name, off, norm)  # (LoRA's A: zero gradients at the start)


@pytest.mark.parametrize("model_type", [mt for mt in A.model_types() if A.RECORDED.get(mt, {}).get("fp32") == "pass"])
def test_architecture_s_largest_block_is_among_the_kinds_measured(arch_root, model_type):
    """Whichever block training starts from, the blocks the session measures
    before the first step (kinds.represented: one of each kind above
    it) include one whose forward + vjp is within 20% of the largest above
    it (128 tokens, float32; each block measured twice after a first probe,
    the lower kept: same-kind blocks differ by up to ~15% from run to run
    and with MoE routing). Measured on its first trained block alone,
    15 architectures were planned under 80% of their largest block: Jamba at 1%
    (its Mamba blocks 262 MB, its attention blocks 3 MB), Step-3.5, OpenELM,
    LFM2 at 26-53%."""
    from mlx_pager import kinds
    from mlx_pager import step as S

    path = A.build(model_type, "fp32", arch_root)
    model, w = A.paged(path, A.LAYERS, "auto", str(arch_root / f"{model_type}-kinds-swap"))
    w.pin_resident()
    L = len(model.layers)
    calls = S.record_calls(model, mx.zeros((1, 128), dtype=mx.int32))[1]
    footprints = [w.block_charge_bound(i) for i in range(L)]
    S.probe_block(model, w, 0, 1, 128)  # (a process's first probe holds one-off memory)
    took = [min(S.probe_block(model, w, i, 1, 128) for _ in range(2)) for i in range(L)]
    mx.clear_cache()
    for first in range(L):
        measured = list(kinds.represented(model, calls, range(first, L), footprints))
        assert max(took[i] for i in measured) >= 0.8 * max(took[first:]), (first, measured, took)


def test_no_generated_weight_matrix_or_head_is_zeros(arch_root):
    """A matrix of zeros where a trained model's is not (a MoE router:
    every token to the same experts; a bare head: a constant output) hides
    what the matrix is there to see. architectures.RANDOMIZE draws those;
    a new architecture that needs it fails here by name."""
    from mlx_lm.utils import load_model

    zeros = []
    for mt in A.model_types():
        if A.RECORDED.get(mt, {}).get("fp32") != "pass":
            continue
        model, _ = load_model(A.build(mt, "fp32", arch_root), lazy=True)
        zeros += [
            f"{mt}: {name}"
            for name, v in tree_flatten(model.parameters())
            if v.ndim == 2 and name.endswith(("weight", "lm_head")) and not mx.any(v).item()
        ]
    assert not zeros, zeros


def test_every_recorded_pass_is_still_an_architecture():
    """A recorded pass cannot silently drop out of the matrix."""
    gone = [mt for mt, d in A.RECORDED.items() if "pass" in d.values() and mt not in A.model_types()]
    assert not gone, gone


def test_refusals_are_one_line(arch_root):
    """A model whose blocks cannot be paged is refused with one line naming
    the architecture, not a traceback."""
    r = A.check("rwkv7", "bf16", arch_root)
    assert r.status in ("refused", "pass", "cannot build")
    if r.status == "refused":
        assert r.reason.startswith("rwkv7: ") and "\n" not in r.reason


def test_derived_configs_are_tiny():
    for mt in ("llama", "qwen3_moe", "deepseek_v3", "gemma3"):
        cfg = A.derive_config(mt)
        flat = {**cfg, **cfg.get("text_config", {})}
        assert flat["hidden_size"] <= 64 and flat["num_hidden_layers"] <= A.LAYERS
        assert flat["vocab_size"] == A.VOCAB
