"""Generated test models load through mlx-lm's real loading path."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mlx_pager import modelgen


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [4, None])
def test_generated_model_loads_and_generates(models, arch, bits):
    path = models(arch, bits)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert ("quantization" in cfg) == (bits is not None)
    model, tok = mlx_lm.load(str(path))
    ids = tok.encode("The capital of Peru is Lima.")
    assert len(ids) > 3
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), cfg["vocab_size"])
    text = mlx_lm.generate(model, tok, "The capital", max_tokens=4)
    assert isinstance(text, str)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert len(chat) > 0


def test_sharded_and_cached(tmp_path):
    spec = modelgen.ModelSpec(num_hidden_layers=3, bits=None, shard_bytes=200_000)
    path = modelgen.generate_model(tmp_path / "m", spec)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    mtime = shards[0].stat().st_mtime_ns
    assert modelgen.generate_model(tmp_path / "m", spec) == path  # reused, not rewritten
    assert shards[0].stat().st_mtime_ns == mtime
    mlx_lm.load(str(path))


def test_randomize_draws_the_parameters_a_name_or_pattern_matches(tmp_path):
    """`randomize` takes full names and fnmatch patterns; the parameters
    they match are drawn, the rest keep the architecture's init, and a
    pattern that matches nothing is an error that names it."""
    spec = modelgen.ModelSpec(num_hidden_layers=2, bits=None, randomize=("*.input_layernorm.weight",))
    model, _ = mlx_lm.load(str(modelgen.generate_model(tmp_path / "m", spec)))
    for layer in model.model.layers:
        w = layer.input_layernorm.weight
        assert not mx.array_equal(w, mx.ones_like(w)).item()  # RMSNorm's init: ones
        assert mx.abs(w).max().item() <= w.shape[-1] ** -0.5
        w = layer.post_attention_layernorm.weight
        assert mx.array_equal(w, mx.ones_like(w)).item()
    bad = modelgen.ModelSpec(num_hidden_layers=2, bits=None, randomize=("*.no_such.weight",))
    with pytest.raises(ValueError, match=r"no parameter '\*\.no_such\.weight'"):
        modelgen.generate_model(tmp_path / "bad", bad)


def test_the_trained_tokenizer_cache_goes_with_the_process(tmp_path):
    """tokenizer_files trains once per process into a temporary directory;
    the directory does not outlive the process (test runs make thousands)."""
    code = (
        "import sys; from pathlib import Path; from mlx_pager import modelgen; "
        "modelgen.tokenizer_files(Path(sys.argv[1]), 300); "
        "print(next(iter(modelgen._TOKENIZERS.values()))[0])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    cache = out.stdout.strip().splitlines()[-1]
    assert "mlx-pager-tokenizer-" in cache
    assert (tmp_path / "tokenizer.json").exists()
    assert not Path(cache).exists()
