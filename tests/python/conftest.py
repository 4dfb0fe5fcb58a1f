"""Shared fixtures: small generated models (made once per session) and data."""

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest

from mlx_pager import modelgen

SAMPLE = modelgen.SAMPLE_DATA


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """models(arch, bits, **spec) -> path of a generated model (cached)."""
    root = tmp_path_factory.mktemp("models")

    def make(arch="llama", bits=4, **kw):
        spec = modelgen.ModelSpec(arch=arch, bits=bits, **kw)
        return modelgen.generate_model(root / f"{arch}-{bits}-{spec.key()}", spec)

    return make


@pytest.fixture
def train_only_data(tmp_path):
    """The sample data without valid/test sets (no evaluation passes)."""
    d = tmp_path / "data"
    d.mkdir()
    shutil.copy(SAMPLE / "train.jsonl", d / "train.jsonl")
    return d


def write_jsonl(path: Path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="session")
def big_model(tmp_path_factory):
    """A 1.83 GB float32 Llama, 30 blocks of ~62 MB (4 bytes a weight keeps
    compute per GB low), for the hard-memory-cap tests: made once a session."""
    spec = modelgen.ModelSpec(
        arch="llama",
        hidden_size=1024,
        num_hidden_layers=30,
        intermediate_size=4096,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=1024,
        dtype="float32",
        bits=None,
        seed=1,
    )
    return modelgen.generate_model(tmp_path_factory.mktemp("big") / "model", spec)


@contextmanager
def mlx_lm_class_patches_undone():
    """mlx-lm's --grad-checkpoint replaces the block class's __call__ for the
    whole process (tuner.trainer.grad_checkpoint); undone on exit, so that
    what runs next (mlx-pager, other tests) calls the blocks as defined."""
    import mlx_lm.tuner.trainer as lm_trainer

    original = lm_trainer.grad_checkpoint
    patched = []

    def recording(layer):
        patched.append((type(layer), type(layer).__call__))
        original(layer)

    lm_trainer.grad_checkpoint = recording
    try:
        yield
    finally:
        lm_trainer.grad_checkpoint = original
        for cls, call in reversed(patched):
            cls.__call__ = call


@pytest.fixture
def attention_bound(models, tmp_path):
    """(model, data): a float32 llama of width 256 with 16 heads (2 blocks)
    and two records of ~2,000 tokens (train and test sets): one sequence's
    attention is ~95% of its block's forward + vjp, ~900 MB whole (MLX's
    CPU attention builds every head's scores, its gradient ~3x that)."""
    model = models(
        "llama",
        None,
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        vocab_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        dtype="float32",
    )
    return model, long_records(tmp_path)


@pytest.fixture
def hybrid_bound(models, tmp_path):
    """(model, data): a float32 LFM2 of 4 blocks, short convolutions in
    blocks 0 and 2, attention with 16 heads in 1 and 3, and the records of
    attention_bound: at ~2,000 tokens an attention block's forward + vjp
    takes ~865 MB, a convolution block's ~53 MB. Trained whole, its first
    trained block is the small kind."""
    from mlx_pager import architectures as A

    config = dict(
        A.spec_for("lfm2", "fp32").config,
        vocab_size=1024,
        hidden_size=128,
        block_dim=128,
        num_attention_heads=16,
        num_key_value_heads=4,
        block_ff_dim=256,
        intermediate_size=256,
    )
    return models("lfm2", None, config=config, vocab_size=1024, dtype="float32"), long_records(tmp_path)


def long_records(tmp_path: Path) -> Path:
    """Train and test sets of two records of ~2,000 tokens each."""
    texts = [json.loads(l)["text"] for l in (SAMPLE / "train.jsonl").read_text().splitlines()]
    words = " ".join(texts).split() * 3
    data = tmp_path / "long2k"
    for name in ("train", "test"):
        write_jsonl(data / f"{name}.jsonl", [{"text": " ".join(words[i * 97 : i * 97 + 1600])} for i in range(2)])
    return data


def quick_adapters(path, adapter_dir, cache_dir, **kw):
    """Adapters from 3 paged LoRA steps (rate 1e-2, 3 blocks) in
    `adapter_dir`: what generation tests load. `kw`: more lora() options."""
    from mlx_pager import PagedTrainer

    opts = dict(iters=3, batch_size=2, num_layers=3, learning_rate=1e-2, save_every=1000, **kw)
    trainer = PagedTrainer(str(path), memory_budget="4GB", ssd_cache_dir=str(cache_dir), quiet=True)
    return trainer.lora(SAMPLE, adapter_path=str(adapter_dir), **opts)
