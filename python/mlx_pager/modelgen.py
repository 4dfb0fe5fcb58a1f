"""Small random-weight models in mlx-lm's on-disk format, made locally.

Tests, benchmarks and the offline main job need models without a download.
``generate_model`` writes a real mlx-lm architecture with random weights:
Llama or Qwen3 from the sizes of a ``ModelSpec``, or any mlx-lm model_type
from an explicit ``config`` dict (see architectures.py, which derives tiny
configs for every architecture mlx-lm has), in bf16/f16/f32 or quantized
(4-bit affine by default), as
mlx-lm writes models: ``config.json`` (with the ``quantization`` key when
quantized), sharded ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json``, and tokenizer files from a byte-level BPE
tokenizer trained here on the shipped sample data. ``mlx_lm.load(path)`` loads
the result like any model from the hub.

Weights are created lazily and written shard by shard, so making a model of
several GB needs about one shard of memory.
"""

from __future__ import annotations

import atexit
import contextlib
import fnmatch
import hashlib
import io
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

SAMPLE_DATA = Path(__file__).parent / "data" / "sample"
MARKER = "mlx_pager_model.json"

# Architecture defaults beyond the sizes: what mlx-lm's ModelArgs need.
_ARCH_DEFAULTS: Dict[str, dict] = {
    "llama": {
        "model_type": "llama",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    # Qwen2/2.5: blocks reached through PipelineMixin.pipeline_layers.
    "qwen2": {
        "model_type": "qwen2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


@dataclass
class ModelSpec:
    """What to generate. Sizes follow the Hugging Face config names."""

    arch: str = "llama"
    hidden_size: int = 128
    num_hidden_layers: int = 4
    intermediate_size: int = 384
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    vocab_size: int = 512
    dtype: str = "bfloat16"  # of unquantized weights, norms, scales
    bits: Optional[int] = 4  # None: not quantized
    group_size: int = 64
    seed: int = 0
    shard_bytes: int = 256 << 20
    extra: dict = field(default_factory=dict)  # more config.json keys
    # The whole config.json (any mlx-lm model_type; `arch` is then only a
    # label). The size fields above are ignored, except vocab_size, which
    # sizes the tokenizer and must match config["vocab_size"] if present.
    config: Optional[dict] = None
    # Parameters drawn at random, uniform in +-1/sqrt(last dimension) as
    # nn.Linear draws its weights, where the architecture's own init would
    # leave the output constant (talkie's bare head: zeros) or tie what a
    # trained model spreads (a MoE router of zeros sends every token to the
    # same experts). Full names, or fnmatch patterns ("*.mlp.gate.weight");
    # each must match a parameter.
    randomize: Tuple[str, ...] = ()

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["config"] is None:
            del d["config"]  # specs without one keep the keys they always had
        if not d["randomize"]:
            del d["randomize"]  # (likewise)
        else:
            d["randomize"] = list(d["randomize"])
        return d

    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _config(spec: ModelSpec) -> dict:
    if spec.config is not None:
        cfg = dict(spec.config)
        cfg.setdefault("vocab_size", spec.vocab_size)
        cfg.setdefault("torch_dtype", spec.dtype)
        cfg.update(spec.extra)
        return cfg
    if spec.arch not in _ARCH_DEFAULTS:
        raise ValueError(f"unknown architecture '{spec.arch}': choose one of {sorted(_ARCH_DEFAULTS)}")
    cfg = dict(_ARCH_DEFAULTS[spec.arch])
    cfg.update(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        vocab_size=spec.vocab_size,
        torch_dtype=spec.dtype,
    )
    cfg["head_dim"] = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    if spec.bits is not None:
        q = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
        cfg["quantization"] = q
        cfg["quantization_config"] = q
    cfg.update(spec.extra)
    return cfg


_TOKENIZERS: Dict[tuple, Tuple[Path, int]] = {}  # (vocab_size, corpus) -> (dir, size)


def tokenizer_files(path: Path, vocab_size: int, corpus_dir: Path = SAMPLE_DATA) -> int:
    """Writes the tokenizer train_tokenizer would write into `path`, training
    it once per process and copying the files afterwards (training takes
    about a second; test sessions make many models). Returns its size. The
    trained copy lives in a temporary directory removed when the process
    exits."""
    key = (vocab_size, str(Path(corpus_dir).resolve()))
    if key not in _TOKENIZERS or not _TOKENIZERS[key][0].exists():
        d = Path(tempfile.mkdtemp(prefix="mlx-pager-tokenizer-"))
        atexit.register(shutil.rmtree, d, True)
        _TOKENIZERS[key] = (d, train_tokenizer(d, vocab_size, corpus_dir))
    d, n = _TOKENIZERS[key]
    for f in d.iterdir():
        shutil.copy(f, Path(path) / f.name)
    return n


def train_tokenizer(path: Path, vocab_size: int, corpus_dir: Path = SAMPLE_DATA) -> int:
    """Trains a byte-level BPE tokenizer on the sample data and saves it in
    the Hugging Face layout mlx-lm loads. Returns the tokenizer's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    for f in sorted(corpus_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            texts.extend(str(v) for v in rec.values() if isinstance(v, str))
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
        "<|im_start|>assistant\n{% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
    )
    fast.save_pretrained(str(path))
    return tok.get_vocab_size()


def _make_module(spec: ModelSpec, cfg: dict) -> nn.Module:
    """The model, cast and quantized; quantizing may add per-layer entries
    to cfg["quantization"] (config-driven specs), so cfg is updated."""
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    if spec.randomize:
        own = dict(tree_flatten(model.parameters()))
        drawn = []
        for pattern in spec.randomize:
            names = [n for n in own if fnmatch.fnmatchcase(n, pattern)]
            if not names:
                raise ValueError(f"randomize: the model has no parameter {pattern!r}")
            for name in names:
                scale = own[name].shape[-1] ** -0.5
                drawn.append((name, mx.random.uniform(-scale, scale, own[name].shape)))
        model.update(tree_unflatten(drawn))
    dtype = getattr(mx, spec.dtype)
    model.set_dtype(dtype)
    if spec.bits is not None:
        if spec.config is None:
            nn.quantize(model, group_size=spec.group_size, bits=spec.bits, mode="affine")
        else:
            # As mlx_lm.convert quantizes: the model's own quant_predicate
            # (e.g. routers kept unquantized), layers whose input dimension
            # the group size does not divide left alone, and the
            # per-layer choices recorded in the config for the loader.
            plain = {k: v for k, v in cfg.items() if k not in ("quantization", "quantization_config")}
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet):
                _, qcfg = quantize_model(model, plain, spec.group_size, spec.bits, mode="affine")
            cfg["quantization"] = qcfg["quantization"]
            cfg["quantization_config"] = qcfg["quantization_config"]
    return model


def generate_model(path, spec: ModelSpec | None = None, force: bool = False) -> Path:
    """Writes the model `spec` describes to `path` (a directory), unless it is
    already there from an earlier call with the same spec. Returns the path."""
    spec = spec or ModelSpec()
    path = Path(path)
    marker = path / MARKER
    if not force and marker.exists():
        try:
            if json.loads(marker.read_text()).get("key") == spec.key():
                return path
        except (OSError, ValueError):
            pass
    if path.exists():
        shutil.rmtree(path)
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    # The tokenizer decides the vocabulary; the embedding rows must cover it.
    n_tokens = tokenizer_files(tmp, spec.vocab_size)
    if n_tokens > spec.vocab_size:
        raise ValueError(f"tokenizer has {n_tokens} tokens > vocab_size {spec.vocab_size}")
    cfg = _config(spec)
    if cfg.get("vocab_size", spec.vocab_size) < n_tokens:
        raise ValueError(f"tokenizer has {n_tokens} tokens > config vocab_size {cfg['vocab_size']}")

    mx.random.seed(spec.seed)
    model = _make_module(spec, cfg)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    weights = tree_flatten(model.parameters())
    if hasattr(model, "sanitize"):
        # What load() keeps after sanitize (e.g. no lm_head when tied).
        kept = model.sanitize(dict(weights))
        weights = [(k, v) for k, v in weights if k in kept]
    weights.sort(key=lambda kv: kv[0])

    # Shard in name order, as mlx-lm's save_model does, evaluating one shard
    # at a time so memory stays near one shard.
    shards, cur, cur_bytes = [], [], 0
    for k, v in weights:
        if cur and cur_bytes + v.nbytes > spec.shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((k, v))
        cur_bytes += v.nbytes
    if cur:
        shards.append(cur)
    n = len(shards)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        arrays = dict(shard)
        mx.eval(list(arrays.values()))
        mx.save_safetensors(str(tmp / name), arrays, metadata={"format": "mlx"})
        for k, v in shard:
            weight_map[k] = name
            total += v.nbytes
        del arrays
        shards[i] = None
        mx.clear_cache()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (tmp / MARKER).write_text(json.dumps({"key": spec.key(), "spec": spec.as_dict(), "weight_bytes": total}, indent=2))
    tmp.rename(path)
    return path


def weight_bytes(path) -> int:
    """Bytes of weights in a model directory (from its safetensors files)."""
    return sum(p.stat().st_size for p in Path(path).glob("model*.safetensors"))
