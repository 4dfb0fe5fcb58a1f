"""PagedTrainer and `mlx-pager lora` against mlx_lm.lora itself."""

import copy
import json
import subprocess
import sys
import types

import mlx.core as mx
import mlx_lm
import pytest
from conftest import SAMPLE, mlx_lm_class_patches_undone, write_jsonl
from mlx_lm.lora import CONFIG_DEFAULTS
from mlx_lm.lora import run as mlx_lm_run
from test_lora_cli import table

from mlx_pager import PagedTrainer
from mlx_pager.budget import BudgetError
from mlx_pager.trainer import DEFAULTS
from mlx_pager.trainer import run as paged_run

COMMON = dict(
    train=True,
    batch_size=2,
    num_layers=2,
    learning_rate=1e-3,
    steps_per_report=5,
    steps_per_eval=1000,
    save_every=1000,
    seed=0,
    val_batches=2,
)


def both(model, data, tmp_path, **kw):
    """Trains with mlx_lm.lora and with mlx-pager on the same arguments;
    returns (mlx-lm adapters, mlx-pager adapters, mlx-pager result)."""
    a = dict(CONFIG_DEFAULTS, **COMMON, model=str(model), data=str(data), adapter_path=str(tmp_path / "ref"))
    a.update(kw)
    with mlx_lm_class_patches_undone():
        mlx_lm_run(types.SimpleNamespace(**copy.deepcopy(a)))
    b = dict(
        DEFAULTS,
        **COMMON,
        model=str(model),
        data=str(data),
        adapter_path=str(tmp_path / "paged"),
        memory_budget="4GB",
        ssd_cache_dir=str(tmp_path / "cache"),
        quiet=True,
    )
    b.update(kw)
    res = paged_run(types.SimpleNamespace(**copy.deepcopy(b)))
    return (
        mx.load(str(tmp_path / "ref" / "adapters.safetensors")),
        mx.load(str(tmp_path / "paged" / "adapters.safetensors")),
        res,
    )


def assert_same_adapters(ref, got):
    assert set(ref) == set(got)
    for k in ref:
        assert mx.array_equal(ref[k], got[k]).item(), f"{k}: max diff {mx.abs(ref[k] - got[k]).max()}"


# (4-bit: 8 steps, not 20; MLX's CPU 4-bit products made the 20 steps 43 s
# of the suite, and bits that part at one step stay apart)
@pytest.mark.parametrize("arch, bits, iters", [("llama", None, 20), ("qwen3", 4, 8)])
def test_many_steps_give_mlx_lm_adapters(models, train_only_data, tmp_path, arch, bits, iters):
    """Many optimizer steps, same seed and data: the adapters are identical
    bit for bit to those mlx_lm.lora writes (its compiled step included)."""
    ref, got, res = both(models(arch, bits), train_only_data, tmp_path, iters=iters)
    assert_same_adapters(ref, got)
    losses = [s["loss"] for s in res.steps]
    assert all(map(lambda x: x == x, losses)) and losses[-1] < losses[0]


def test_grad_accumulation_and_mask_prompt_match_mlx_lm(models, tmp_path):
    data = tmp_path / "pc"
    recs = [json.loads(l) for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    write_jsonl(data / "train.jsonl", [{"prompt": r["text"][:40], "completion": r["text"][40:]} for r in recs[:60]])
    ref, got, res = both(models("llama", None), data, tmp_path, iters=6, grad_accumulation_steps=3, mask_prompt=True)
    assert_same_adapters(ref, got)
    # layer-major accumulation: the blocks below the tail forward once per
    # optimizer step of 3 micro-batches, and the recomputed ones backward,
    # not 3 x (4 + 2); the no-recompute tail's pages are held for all 3
    # micro-batches where they fit the page budget together, or else
    # streamed (read where the graph uses them, forward and backward) per
    # micro-batch.
    assert all(
        s["acquires"]
        == s["tail_start"] + (1 if s["tail_held"] else 2 * 3) * (4 - s["tail_start"]) + s["recomputed_blocks"]
        for s in res.steps
    )
    assert res.steps[-1]["recomputed_blocks"] == 0 and res.steps[-1]["tail_held"]


def test_grad_checkpoint_recomputes_every_trained_block_as_mlx_lm_does(models, train_only_data, tmp_path):
    """--grad-checkpoint keeps mlx-lm's meaning: every step checkpoints and
    recomputes every trained block (no no-recompute tail, which the planner
    picks without it at this budget), and the adapters are mlx_lm.lora
    --grad-checkpoint's bit for bit."""
    ref, got, res = both(models("llama", None), train_only_data, tmp_path, iters=4, grad_checkpoint=True)
    assert_same_adapters(ref, got)
    L = 4  # the test model's blocks; the last num_layers=2 are trained
    assert all(s["tail_start"] == L and s["recomputed_blocks"] == 2 for s in res.steps)
    # each step: its 4 blocks forward, the 2 trained ones recomputed and
    # back (everything fits: the frozen prefix does not run ahead, there
    # is nothing to read less)
    assert all(s["acquires"] == L + 2 and s["window"][0] == 1 for s in res.steps)


@pytest.mark.parametrize(
    "grad_checkpoint, keys",
    [(False, None), (True, None), (True, ["self_attn.q_proj", "self_attn.v_proj", "lm_head", "model.embed_tokens"])],
)
def test_lora_dropout_draws_mlx_lm_s_masks(models, train_only_data, tmp_path, grad_checkpoint, keys):
    """LoRA dropout: each mask is the one mlx-lm draws from MLX's global key
    sequence (dropout.py), though the paged step runs layer-major over an
    accumulation group and recomputes blocks; with --grad-checkpoint, the
    new masks mlx-lm's checkpointed blocks draw in its backward pass; with
    adapters on the embedding and the head (outside.py), theirs before and
    after the blocks' forward draws. The adapters are mlx_lm.lora's bit for
    bit (before, masks of the paged step's own: after 5 steps they differed
    by up to 1.27 times an adapter's largest value)."""
    lora = {"rank": 8, "scale": 20.0, "dropout": 0.1, **({"keys": keys} if keys else {})}
    ref, got, res = both(
        models("llama", None),
        train_only_data,
        tmp_path,
        iters=5,
        grad_accumulation_steps=2,
        lora_parameters=lora,
        grad_checkpoint=grad_checkpoint,
    )
    assert_same_adapters(ref, got)
    if keys:
        assert "lm_head.lora_b" in got and "model.embed_tokens.lora_b" in got
    if not grad_checkpoint:  # the no-recompute tail draws them in its one graph
        assert any(s["tail_start"] < 4 for s in res.steps)


def test_chat_data_with_validation(models, tmp_path):
    data = tmp_path / "chat"
    recs = [json.loads(l)["text"] for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    chats = [
        {"messages": [{"role": "user", "content": t[:30]}, {"role": "assistant", "content": t[30:]}]} for t in recs[:40]
    ]
    write_jsonl(data / "train.jsonl", chats[:30])
    write_jsonl(data / "valid.jsonl", chats[30:])
    ref, got, res = both(models("qwen3", None), data, tmp_path, iters=4, steps_per_eval=2)
    assert_same_adapters(ref, got)
    assert len(res.val_losses) == 3  # at iterations 1, 2 and 4, as mlx-lm


def test_adapters_load_in_mlx_lm_and_generate(models, tmp_path):
    model_path = models("llama", 4)
    t = PagedTrainer(str(model_path), memory_budget="2GB", ssd_cache_dir=str(tmp_path / "c"), quiet=True)
    res = t.lora(
        SAMPLE,
        lora_rank=4,
        iters=3,
        batch_size=2,
        num_layers=2,
        adapter_path=str(tmp_path / "ad"),
        steps_per_eval=1000,
        val_batches=1,
    )
    assert res.adapter_file.exists()
    model, tok = mlx_lm.load(str(model_path), adapter_path=str(tmp_path / "ad"))
    ours = mx.load(str(res.adapter_file))
    loaded = dict(mlx_lm_tree(model))
    for k, v in ours.items():
        assert mx.array_equal(loaded[k], v).item()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(model_path),
            "--adapter-path",
            str(tmp_path / "ad"),
            "--prompt",
            "The capital",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr


def mlx_lm_tree(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.trainable_parameters()) + tree_flatten(model.parameters())


@pytest.mark.parametrize("fine_tune_type, bits", [("lora", 4), ("dora", None)])
def test_adapters_on_the_head_and_embeddings_give_mlx_lm_adapters(
    models, train_only_data, tmp_path, fine_tune_type, bits
):
    """lora_parameters' keys naming the LM head and the embedding (mlx-lm
    adapts any module a key names in full): the adapters are mlx_lm.lora's
    bit for bit (outside.py), DoRA's magnitudes taken from the resident
    weights as mlx-lm takes them (they were the placeholders' zeros)."""
    keys = ["self_attn.q_proj", "self_attn.v_proj", "lm_head", "model.embed_tokens"]
    lora = {"rank": 8, "dropout": 0.0, "scale": 20.0, "keys": keys}
    ref, got, _ = both(
        models("llama", bits), train_only_data, tmp_path, iters=4, lora_parameters=lora, fine_tune_type=fine_tune_type
    )
    assert {"lm_head.lora_b", "model.embed_tokens.lora_b"} <= set(got)
    assert_same_adapters(ref, got)


def test_dora_resumed_from_an_adapter_file_keeps_its_magnitudes(models, train_only_data, tmp_path):
    """--resume-adapter-file with DoRA: mlx-lm loads the file after its
    layers took their magnitudes from the weights. mlx-pager computed the
    blocks' magnitudes after loading it, over the file's: the resumed run
    went its own way (adapters 1e-2 off mlx-lm's after 2 steps)."""
    model = models("llama", None)
    both(model, train_only_data, tmp_path / "one", iters=3, fine_tune_type="dora")
    first = tmp_path / "one" / "ref" / "adapters.safetensors"
    ref, got, _ = both(
        model, train_only_data, tmp_path / "two", iters=2, fine_tune_type="dora", resume_adapter_file=str(first)
    )
    assert_same_adapters(ref, got)


def test_resume_continues_from_saved_adapters(models, tmp_path):
    model_path = models("llama", None)
    t = PagedTrainer(str(model_path), memory_budget="2GB", ssd_cache_dir=str(tmp_path / "c"), quiet=True)
    first = t.lora(
        SAMPLE,
        iters=4,
        batch_size=2,
        num_layers=2,
        learning_rate=1e-3,
        adapter_path=str(tmp_path / "a1"),
        steps_per_eval=1000,
    )
    saved = mx.load(str(first.adapter_file))
    second = t.lora(
        SAMPLE,
        iters=4,
        batch_size=2,
        num_layers=2,
        learning_rate=1e-3,
        adapter_path=str(tmp_path / "a2"),
        steps_per_eval=1000,
        resume_adapter_file=str(first.adapter_file),
    )
    after = mx.load(str(second.adapter_file))
    # It started from the saved adapters (lora_b is zero at a fresh start)...
    assert any(mx.abs(v).sum().item() > 0 for k, v in saved.items() if k.endswith("lora_b"))
    # ...and kept training: the second run's first loss is near the first
    # run's last, far below a fresh start's, and the weights moved on.
    assert second.steps[0]["loss"] < first.steps[0]["loss"]
    assert any(not mx.array_equal(saved[k], after[k]).item() for k in saved)


@pytest.mark.parametrize("budget", ["12 GB", "12gb", "0", "-1", "lots"])
def test_bad_budget_is_refused_before_anything_heavy(models, budget, tmp_path):
    t = PagedTrainer(
        str(models("llama", 4)), memory_budget=budget, ssd_cache_dir=str(tmp_path / "c"), quiet=True, store="swap"
    )
    with pytest.raises(BudgetError) as e:
        t.lora(SAMPLE, iters=1, num_layers=2, adapter_path=str(tmp_path / "a"))
    msg = str(e.value)
    assert budget in msg and "--memory-budget" in msg and ("12GB" in msg or "must" in msg or "write" in msg)
    assert not (tmp_path / "a" / "adapters.safetensors").exists()
    assert not (tmp_path / "c").exists()  # refused before the swap file was written


def test_cli_budget_too_small_exits_with_the_minimum(models, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_pager.cli",
            "lora",
            "--model",
            str(models("llama", 4)),
            "--train",
            "--data",
            str(SAMPLE),
            "--num-layers",
            "2",
            "--iters",
            "1",
            "--memory-budget",
            "20MB",
            "--adapter-path",
            str(tmp_path / "a"),
            "--ssd-cache-dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "too small" in out.stderr and "at least" in out.stderr and "one block page" in out.stderr


def test_cli_is_a_drop_in_for_mlx_lm_lora(models, tmp_path):
    help_text = subprocess.run(
        [sys.executable, "-m", "mlx_pager.cli", "lora", "--help"], capture_output=True, text=True
    ).stdout
    for flag in [
        "--model",
        "--train",
        "--data",
        "--fine-tune-type",
        "--num-layers",
        "--batch-size",
        "--iters",
        "--learning-rate",
        "--max-seq-length",
        "--adapter-path",
        "--resume-adapter-file",
        "--save-every",
        "--steps-per-report",
        "--steps-per-eval",
        "--val-batches",
        "--grad-accumulation-steps",
        "--mask-prompt",
        "--seed",
        "--config",
        "--memory-budget",
        "--ssd-cache-dir",
    ]:
        assert flag in help_text, flag
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(
        f"model: {models('qwen3', None)}\ntrain: true\ndata: {SAMPLE}\niters: 2\n"
        f"num_layers: 1\nbatch_size: 2\nadapter_path: {tmp_path / 'ad'}\n"
        f"memory_budget: 1GB\nssd_cache_dir: {tmp_path / 'c'}\nsteps_per_eval: 100\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mlx_pager.cli", "lora", "-c", str(cfg), "--report", str(tmp_path / "r.jsonl")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    train_rows, _ = table(out.stdout)
    assert [it for it, _ in train_rows] == ["2"]  # mlx-lm's table: a report at the last iteration
    assert (tmp_path / "ad" / "adapters.safetensors").exists()
    cfg_saved = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg_saved["num_layers"] == 1 and cfg_saved["fine_tune_type"] == "lora"
    lines = [json.loads(l) for l in (tmp_path / "r.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["type"] == "step"]
    blocks = [l for l in lines if l["type"] == "block"]
    assert len(steps) == 2 and all("bytes_read" in s and "io_wait_s" in s for s in steps)
    assert all(s["bytes_started"] >= 0 and s["pages_started"] >= 0 for s in steps)  # the reads a step started
    phases = [b["phase"] for b in blocks if b["phase"] != "eval"]  # validation is traced too
    # Each step: the 3 frozen blocks forward, the trained block as the
    # no-recompute tail (the default budget holds it) or, in a step that
    # recomputes it, forward then backward.
    at = 0
    for st in steps:
        n = 5 if st["recomputed_blocks"] else 4
        assert phases[at : at + n] == (["forward"] * 4 + ["backward"] if n == 5 else ["forward"] * 3 + ["tail"])
        at += n
    assert at == len(phases)
    assert "eval" in {b["phase"] for b in blocks}
    png = subprocess.run(
        [sys.executable, "-m", "mlx_pager.cli", "plot", str(tmp_path / "r.jsonl"), "--budget", "1GB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert png.returncode == 0, png.stderr
    assert (tmp_path / "r.png").stat().st_size > 10_000


def test_api_lora_parameters_are_honoured_like_mlx_lm(models, train_only_data, tmp_path):
    """PagedTrainer.lora(lora_parameters=...) with rank, scale, dropout and
    keys: the adapters are mlx_lm.lora's on the same options, bit for bit."""
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.down_proj"]}
    model = models("llama", None)
    a = dict(
        CONFIG_DEFAULTS,
        **COMMON,
        model=str(model),
        data=str(train_only_data),
        adapter_path=str(tmp_path / "ref"),
        iters=3,
        lora_parameters=lora,
    )
    mlx_lm_run(types.SimpleNamespace(**copy.deepcopy(a)))
    t = PagedTrainer(str(model), memory_budget="2GB", ssd_cache_dir=str(tmp_path / "c"), quiet=True)
    res = t.lora(
        train_only_data,
        lora_parameters=lora,
        iters=3,
        adapter_path=str(tmp_path / "paged"),
        **{k: v for k, v in COMMON.items() if k != "train"},
    )
    ref, got = mx.load(str(tmp_path / "ref" / "adapters.safetensors")), mx.load(str(res.adapter_file))
    assert_same_adapters(ref, got)
    assert {k.split(".")[-2] for k in got} == {"q_proj", "down_proj"}
    assert all(
        v.shape[-1] == 4 or v.shape[0] == 4 for k, v in got.items() if k.endswith("lora_a") or k.endswith("lora_b")
    )
    with pytest.raises(TypeError, match="unknown PagedTrainer options"):
        t.lora(train_only_data, lora_rnak=4)
