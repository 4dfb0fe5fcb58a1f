"""Every mlx-lm architecture: tiny configs, generated models, the same-math check.

mlx-lm has one module per architecture in ``mlx_lm.models``, each with a
``ModelArgs`` dataclass (what config.json holds) and a ``Model``. This module

  derives   a tiny config for any of them from its ModelArgs fields: every
            size-like field (hidden size, layers, heads, experts, ranks,
            state sizes, ...) is set small by its name, whatever its default;
            other required fields take the default other architectures give
            the same field, else one by name and type. Nested configs
            (``text_config`` of VLM-style wrappers, dbrx's ``ffn_config``)
            are derived the same way from the dataclasses the module uses.
  builds    the model in mlx-lm's on-disk format with modelgen, in bf16,
            float32 and 4-bit (as ``mlx_lm.convert`` quantizes), with a
            shared tokenizer;
  checks    that the paged step's loss and every adapter gradient are
            BITWISE equal to mlx-lm's ``default_loss`` under
            ``nn.value_and_grad`` on the same batch (LoRA on the last blocks).

``python -m mlx_pager.architectures --markdown`` prints the matrix
(architecture x dtype: pass / cannot build / refused, and why).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import io
import json
import pkgutil
import sys
import tempfile
import time
import types
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import modelgen

VOCAB = 512  # the local tokenizer's size (modelgen.train_tokenizer)
LAYERS = 4  # blocks per model; LoRA on all of them (every kind of block is differentiated)
# bf16 and 4-bit are what checkpoints ship in; float32 is what a CPU or CUDA
# user trains unquantized, and the only unquantized MoE the CPU backend can
# run (its GatherMM takes float32 only).
DTYPES = ("bf16", "fp32", "4bit")
LORA = {"rank": 8, "dropout": 0.0, "scale": 20.0}

# Size-like fields, set whatever their default: by field name.
_HIDDEN = 64
SIZES: Dict[str, object] = {
    # widths
    **dict.fromkeys(
        ["hidden_size", "d_model", "n_embd", "model_dim", "dim", "block_dim", "dim_model_base", "hidden_dim_base"],
        _HIDDEN,
    ),
    **dict.fromkeys(
        [
            "intermediate_size",
            "ffn_hidden_size",
            "n_inner",
            "hidden_dim",
            "ff_intermediate_size",
            "intermediate_size_mlp",
            "ffn_dim",
            "dense_intermediate_size",
            "mlp_hidden_size",
            "block_ff_dim",
        ],
        128,
    ),
    **dict.fromkeys(
        [
            "moe_intermediate_size",
            "expert_ffn_hidden_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "shared_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "routed_intermediate_size",
        ],
        64,
    ),
    # depth
    **dict.fromkeys(["num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers"], LAYERS),
    # attention
    **dict.fromkeys(
        ["num_attention_heads", "n_head", "n_heads", "num_heads", "swa_num_attention_heads", "num_query_heads_base"], 4
    ),
    **dict.fromkeys(
        [
            "num_key_value_heads",
            "n_kv_heads",
            "num_kv_heads",
            "swa_num_key_value_heads",
            "num_attention_groups",
            "multi_query_group_num",
        ],
        2,
    ),
    **dict.fromkeys(["head_dim", "swa_head_dim", "swa_v_head_dim", "kv_channels", "attention_head_dim"], 16),
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    "moe_top_k": 2,
    "kv_n_heads": 2,
    "clip_qkv": 8.0,
    "original_max_position_embeddings": 256,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 8,
    "rotary_dim": 8,
    "sliding_window": 16,
    "sliding_window_size": 16,
    "attention_window_size": 16,
    "attention_chunk_size": 16,
    # experts
    **dict.fromkeys(["num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts"], 4),
    **dict.fromkeys(
        ["num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_experts_per_token", "experts_per_token"], 2
    ),
    **dict.fromkeys(["n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts"], 1),
    "n_group": 1,
    "topk_group": 1,
    "zero_expert_num": 1,
    # state-space / linear attention / recurrent
    **dict.fromkeys(["state_size", "ssm_state_size", "mamba_d_state", "d_state"], 16),
    **dict.fromkeys(
        ["conv_kernel", "mamba_d_conv", "d_conv", "linear_conv_kernel_dim", "conv1d_width", "conv_L_cache"], 4
    ),
    "time_step_rank": 8,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "expand": 2,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "lru_width": _HIDDEN,
    "a_low_rank_dim": 8,
    "v_low_rank_dim": 8,
    "gate_low_rank_dim": 8,
    "decay_low_rank_dim": 8,
    "chunk_size": 16,
    # vocabulary and positions
    "vocab_size": VOCAB,
    **dict.fromkeys(
        [
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "block_size",
            "model_max_length",
            "seq_length",
            "max_seq_len",
        ],
        256,
    ),
}

_SKIP_MODULES = {
    "base",
    "cache",
    "switch_layers",
    "rope_utils",
    "activations",
    "pipeline",
    "bitlinear_layers",
    "gated_delta",
    "mla",
    "ssm",
}


def model_types() -> List[str]:
    """Every module of mlx_lm.models (sorted), whether or not it imports."""
    import mlx_lm.models as M

    return sorted(m.name for m in pkgutil.iter_modules(M.__path__) if m.name not in _SKIP_MODULES)


def _module(model_type: str):
    """The architecture's module; an import that fails (or exits) raises
    ImportError with the module's own words."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return importlib.import_module(f"mlx_lm.models.{model_type}")
    except SystemExit:
        raise ImportError(
            out.getvalue().strip().splitlines()[-1] if out.getvalue().strip() else "the module exits when imported"
        ) from None
    except Exception as e:
        raise ImportError(f"{type(e).__name__}: {e}") from e


def _missing(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _args_classes(mod) -> List[type]:
    """Dataclasses a module builds its config from: ModelArgs first, then any
    other argument dataclass it defines or imports (text configs of wrappers)."""
    from mlx_lm.models.base import BaseModelArgs

    found = [mod.ModelArgs]
    for _name, v in vars(mod).items():
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v not in found and issubclass(v, BaseModelArgs):
            found.append(v)
        elif isinstance(v, types.ModuleType) and v.__name__.startswith("mlx_lm.models."):
            sub = v.__name__.rsplit(".", 1)[-1]
            if sub not in _SKIP_MODULES and hasattr(v, "ModelArgs") and v.ModelArgs not in found:
                found.append(v.ModelArgs)
    return found


@lru_cache(maxsize=1)
def _field_catalogue() -> Dict[str, list]:
    """Defaults that mlx-lm's architectures give each field name."""
    seen: Dict[str, list] = collections.defaultdict(list)
    for mt in model_types():
        try:
            mod = _module(mt)
        except ImportError:
            continue
        if not hasattr(mod, "ModelArgs"):
            continue
        for cls in _args_classes(mod):
            for f in dataclasses.fields(cls):
                d = _default(f)
                if d is not dataclasses.MISSING and d is not None:
                    seen[f.name].append(d)
    return seen


def _type_names(t) -> str:
    return str(t).lower()


def _fill(name: str, f: dataclasses.Field, layers: int):
    """A value for a required field not in SIZES."""
    t = _type_names(f.type)
    n = name.lower()
    if n == "model_type":
        return None  # set by the caller
    if "eps" in n or "epsilon" in n:
        return 1e-5
    common = _field_catalogue().get(name)
    if common:
        # The most frequent default among architectures having this field.
        by = collections.Counter(json.dumps(v, sort_keys=True, default=str) for v in common)
        return json.loads(by.most_common(1)[0][0])
    if "list" in t or "tuple" in t:
        if "bool" in t:
            return [i > 0 for i in range(layers)]
        if "layer" in n:
            return []
        return []
    if "dict" in t:
        return {}
    if t in ("<class 'bool'>", "bool"):
        return False
    if "float" in t:
        if "theta" in n or "base" in n:
            return 10000.0
        if "limit" in n or "cap" in n:
            return 30.0
        return 1.0
    if "int" in t:
        if "period" in n or "every" in n or "freq" in n or "step" in n or "share" in n or "group" in n:
            return 2
        if "offset" in n or "first" in n or "reuse" in n or "dense" in n:
            return 1
        if "size" in n or "dim" in n:
            return _HIDDEN
        return 2
    if "str" in t:
        return "silu" if "act" in n else "default"
    return None


# Fields that must hold a value when the field exists, even where the
# default is None (the module reads them unconditionally).
ALWAYS = {"rope_theta": 10000.0}


def _literals(src: str) -> List[str]:
    """String literals a module compares layer kinds with, in order."""
    import re

    out = []
    for m in re.finditer(r"""(?:==|!=|\bin|index\()\s*\(?\s*["']([a-z_]+)["']""", src):
        if m.group(1) not in out:
            out.append(m.group(1))
    return out


def _subscripted(src: str, name: str) -> List[str]:
    """Keys a module reads from dict field `name` by subscript (required ones)."""
    import re

    keys = []
    for m in re.finditer(r"\b" + re.escape(name) + r"""\[\s*["'](\w+)["']\s*\]""", src):
        if m.group(1) not in keys:
            keys.append(m.group(1))
    return keys


def _key_value(key: str):
    if key in SIZES:
        return SIZES[key]
    common = _field_catalogue().get(key)
    if common:
        by = collections.Counter(json.dumps(v, sort_keys=True, default=str) for v in common)
        return json.loads(by.most_common(1)[0][0])
    k = key.lower()
    if "layers" in k:
        return list(range(1, LAYERS, 2))
    if "theta" in k:
        return 10000.0
    if "type" in k:
        return "default"
    if "factor" in k or "scale" in k or "clip" in k:
        return 1.0
    return 1


def _derive(cls: type, model_type: str, layers: int) -> dict:
    import inspect

    try:
        src = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        src = ""
    cfg = {}
    for f in dataclasses.fields(cls):
        t = _type_names(f.type)
        if f.name in SIZES:
            cfg[f.name] = SIZES[f.name]
        elif f.name == "model_type":
            cfg[f.name] = model_type
        elif f.name in ALWAYS and _default(f) in (None, dataclasses.MISSING):
            cfg[f.name] = ALWAYS[f.name]
        elif "dict" in t and _default(f) in (None, dataclasses.MISSING) and _subscripted(src, f.name):
            # A nested config the module reads keys of: those keys.
            cfg[f.name] = {k: _key_value(k) for k in _subscripted(src, f.name)}
        elif _missing(f) and "list" in t and "str" in t and "layer" in f.name:
            # Per-layer kinds: alternate the kinds the module tests for.
            kinds = _literals(src) or ["full_attention"]
            cfg[f.name] = [kinds[i % len(kinds)] for i in range(layers)][::-1]
        elif _missing(f) and "list" in t and "int" in t and "layer" in f.name:
            cfg[f.name] = list(range(1, layers, 2))  # some layers, by 0- or 1-based index
        elif _missing(f):
            cfg[f.name] = _fill(f.name, f, layers)
    return cfg


_NESTED = ("text_config", "ffn_config", "attn_config", "language_config", "llm_config")


def derive_config(model_type: str, layers: int = LAYERS) -> dict:
    """A tiny config.json for `model_type` (see the module docstring)."""
    mod = _module(model_type)
    if not (hasattr(mod, "Model") and hasattr(mod, "ModelArgs")):
        raise ImportError("the module defines no Model/ModelArgs pair (a helper, not an architecture)")
    classes = _args_classes(mod)
    cfg = _derive(classes[0], model_type, layers)
    nested = {}
    for cls in classes[1:]:
        sub_type = cls.__module__.rsplit(".", 1)[-1]
        for k, v in _derive(cls, sub_type, layers).items():
            nested.setdefault(k, v)
    # Every size key, so that wrappers reading them from a nested dict find them.
    for k, v in SIZES.items():
        nested.setdefault(k, v)
    for f in dataclasses.fields(classes[0]):
        if f.name in _NESTED and (_missing(f) or f.name == "text_config"):
            sub = dict(nested)
            d = _default(f)
            if isinstance(d, dict):
                sub = {**d, **sub}
            if isinstance(cfg.get(f.name), dict):
                sub.update(cfg[f.name])  # the keys the module reads win
            cfg[f.name] = sub
    _overlay(cfg, CONFIGS.get(model_type, {}))
    if model_type in EXCLUDED:
        return cfg
    return _repair(mod, cfg, layers)


def _overlay(cfg: dict, over: dict) -> None:
    """Lays `over` on cfg: nested dicts key by key, anything else replaced."""
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            _overlay(cfg[k], v)
        else:
            cfg[k] = v


# What the derivation cannot find by itself for some architectures: fields
# whose meaning is in the module's code, not in the names or types of its
# ModelArgs (a layer stack spelled as a pattern string, a per-layer list of
# dicts, a rope dict a validator insists on). Laid over the derived config
# before it is repaired; each value is what that architecture's published
# configs hold, at the tiny sizes.
# Gemma 4's large models: 5 sliding layers to 1 full one (here 3 to 1), K = V
# on the full layers, no KV shared across layers, no per-layer inputs.
_GEMMA4 = {
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "num_kv_shared_layers": 0,
    "global_head_dim": 32,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "hidden_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
}
CONFIGS: Dict[str, dict] = {
    # transformers validates config.json when mlx-lm loads the tokenizer
    # (load, load_paged): per-layer kinds from its list, rope dicts whole,
    # mamba2's heads x head_dim = hidden x expand.
    "afmoe": {"layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)},
    "exaone_moe": {"layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2)},
    "lfm2": {"layer_types": ["conv", "full_attention"] * (LAYERS // 2), "full_attn_idxs": list(range(1, LAYERS, 2))},
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention"] * (LAYERS // 2),
        "full_attn_idxs": list(range(1, LAYERS, 2)),
    },
    "mamba2": {"head_dim": 32},
    # What the modules read in ways their fields' names and types do not say.
    "exaone4": {  # EXAONE-4.0: the local/global mix as a pattern string, llama3 rope
        "sliding_window_pattern": "LLLG",
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "rope_theta": 1000000.0,
    },
    "hunyuan": {  # Hunyuan-Large: KV shared across layer pairs, dynamic-NTK alpha
        "use_cla": True,
        "cla_share_factor": 2,
        "use_mixed_mlp_moe": True,
        "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
    },
    "openelm": {  # per-layer heads and FFN widths growing with depth
        "num_query_heads": [2, 4, 4, 4],
        "num_kv_heads": [1, 2, 2, 2],
        "ffn_multipliers": [0.5, 1.67, 2.83, 4.0],
    },
    "mellum": {  # rope parameters keyed by layer kind: yarn on full layers
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "rope_parameters": {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "attention_factor": 1.2772588722239782,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    },
    "mimo_v2_flash": {  # per-layer 0/1 lists: global vs sliding, dense vs MoE
        "hybrid_layer_pattern": [0, 1, 1, 1],
        "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "head_dim": 24,
        "v_head_dim": 16,
        "swa_head_dim": 24,
        "swa_v_head_dim": 16,
        "swa_num_key_value_heads": 4,
        "partial_rotary_factor": 0.334,
        "attention_value_scale": 0.707,
        "rope_theta": 5000000.0,
        "swa_rope_theta": 10000.0,
        "n_shared_experts": None,
        "routed_scaling_factor": None,
    },
    "spark2_5": {  # rope parameters keyed by layer kind
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 5000000},
            "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10000},
        }
    },
    "plamo": {"n_shared_head": 2},  # query heads per KV head (8 by default: more than 4 heads)
    # its three kinds of layer (the derivation took "gelu", an activation's
    # name, for a fourth); transformers' generic config, which the tokenizer
    # loads for a model_type it does not know, refuses "conv_mixer"
    "gear": {"layer_types": ["full_attention", "conv_mixer", "sliding_attention", "full_attention"]},
    # Gemma 3n E2B/E4B: AltUp, LAuReL, per-layer inputs, KV sharing (mlx-lm's LoRA fails on AltUp)
    "gemma3n": {
        "text_config": {
            "model_type": "gemma3n_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": [128, 128, 128, 128],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-06,
            "vocab_size": 512,
            "vocab_size_per_layer_input": 512,
            "hidden_size_per_layer_input": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "num_kv_shared_layers": 2,
            "sliding_window": 16,
            "max_position_embeddings": 256,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "final_logit_softcapping": 30.0,
            "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
            "altup_num_inputs": 4,
            "altup_active_idx": 0,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "laurel_rank": 8,
        }
    },
    # Gemma 4 26B-A4B: MoE beside the MLP
    "gemma4": {"text_config": {**_GEMMA4, "enable_moe_block": True, "top_k_experts": 2}},
    # Gemma 4 E2B/E4B-style: dense, the last layers taking the keys and
    # values of the last earlier layer of their kind (carries: carry.py),
    # per-layer input embeddings, double-wide MLPs on the sharing layers
    "gemma4_text": {
        **_GEMMA4,
        "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
        "num_kv_shared_layers": LAYERS // 2,
        "attention_k_eq_v": False,
        "hidden_size_per_layer_input": 16,
        "use_double_wide_mlp": True,
        "num_experts": None,
        "moe_intermediate_size": None,
        "enable_moe_block": False,
    },
    # every 4th layer full attention without rope; Metal kernels only
    "muse_spark": {
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 512,
            "rms_norm_eps": 1e-05,
            "post_norm_eps": 1e-08,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "layer_rope_theta": [500000.0, 500000.0, 500000.0, 0],
            "sliding_window": 16,
            "final_logit_softcapping": 20.0,
            "output_multiplier": 0.1767766952966369,
            "qk_scale_factor": 5.4730064863875,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_hidden_size": 32,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.0,
            "num_shared_experts": 0,
            "mlp_layer_types": ["sparse", "sparse", "sparse", "sparse"],
        }
    },
    # the layer stack as a pattern: mamba, MoE, attention
    "nemotron_h": {
        "hybrid_override_pattern": "MEM*",
        "n_groups": 2,
        "use_conv_bias": True,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    },
    # Granite 4.0-H: mamba and NoPE attention layers, muP multipliers
    "granitemoehybrid": {
        "layer_types": ["mamba", "mamba", "attention", "mamba"],
        "position_embedding_type": "nope",
        "mamba_n_heads": 8,
        "mamba_expand": 2,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0625,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
    },
    # Llama 4 Scout: one expert per token, every layer MoE
    "llama4": {
        "text_config": {
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "use_qk_norm": True,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 16.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 16,
            },
        }
    },
    # mamba_d_ssm = mamba heads x head dim
    "falcon_h1": {"mamba_d_ssm": 64},
    # per-layer block configs: attention kept, removed or linear
    "nemotron-nas": {
        "rope_theta": 500000.0,
        "block_configs": [
            {
                "attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2},
                "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 5.25},
            },
            {
                "attention": {"no_op": True, "replace_with_linear": False, "n_heads_in_group": None},
                "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 2.625},
            },
            {
                "attention": {"no_op": False, "replace_with_linear": True, "n_heads_in_group": None},
                "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 2.625},
            },
            {
                "attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 2},
                "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 1.3125},
            },
        ],
    },
    "phi3": {  # Phi-3-*-128k's long-context rope, one factor per rotary pair
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0 + i / 8 for i in range(8)]},
        "original_max_position_embeddings": 64,
    },
}


# -------------------------------------------------------------- repairing --
# A derived config the architecture cannot build or run is repaired from the
# error: the fields named in the failing line of mlx-lm's module (an index
# past a per-layer list, a pattern period longer than the stack, a key a
# nested dict lacks, a None the module iterates over) are given, one at a
# time, the values such fields take in mlx-lm's configs, until the tiny
# float32 model builds and runs one forward pass, or nothing helps.
_REPAIR_ROUNDS = 6


def _trial(mod, cfg) -> Optional[BaseException]:
    """None when the model builds from cfg and runs a forward pass."""
    import copy

    out = io.StringIO()
    stage = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            args = mod.ModelArgs.from_dict(copy.deepcopy(cfg))
            stage = 1
            model = mod.Model(args)
            stage = 2
            mx.eval(model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])))
        return None
    except Exception as e:
        e._stage = stage  # how far it got: config, model, forward pass
        return e


def _progress(new: Optional[BaseException], old: BaseException) -> bool:
    """A change helps when the model gets further, or as far with another
    error."""
    if new is None:
        return True
    if new._stage != old._stage:
        return new._stage > old._stage
    return type(new) is not type(old) or str(new) != str(old)


def _named_fields(e: BaseException, names: set) -> List[str]:
    """Config fields named in the failing lines of mlx-lm's model modules."""
    import re
    import traceback

    found = []
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if "mlx_lm" not in fr.filename or not fr.line:
            continue
        for ident in re.findall(r"[A-Za-z_]\w*", fr.line):
            if ident in names and ident not in found:
                found.append(ident)
    return found


def _candidates(name: str, value, layers: int, kinds: List[str]) -> list:
    """Values to try for field `name` (currently `value`)."""
    per_layer = [
        [1] * layers,
        [i % 2 for i in range(layers)],
        [i % 2 == 1 for i in range(layers)],
        [True] * layers,
        [0] * layers,
    ]
    per_layer += [[kinds[(i + s) % len(kinds)] for i in range(layers)] for s in range(len(kinds))]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [v for v in (layers // 2, 1, layers, 0) if v != value]
    if isinstance(value, dict):
        return [None, {}]
    if isinstance(value, (list, tuple)):
        return [v for v in per_layer if v != list(value)] + [None]
    if value is None:
        return [{}, *per_layer, layers // 2]
    return [None]


def _repair(mod, cfg: dict, layers: int) -> dict:
    import inspect
    import re

    try:
        kinds = _literals(inspect.getsource(mod)) or ["full_attention"]
    except (OSError, TypeError):
        kinds = ["full_attention"]
    names, defaults = set(), {}
    for cls in _args_classes(mod):
        for f in dataclasses.fields(cls):
            names.add(f.name)
            d = _default(f)
            defaults.setdefault(f.name, None if d is dataclasses.MISSING else d)
    names -= {"model_type", "vocab_size", "hidden_size", "num_hidden_layers"}
    tried = set()
    e = _trial(mod, cfg)
    for _ in range(_REPAIR_ROUNDS):
        if e is None:
            return cfg
        homes = [cfg] + [v for k, v in cfg.items() if k in _NESTED and isinstance(v, dict)]
        options = []
        listed = re.findall(r"'(\w+)'", str(e)) if "must contain" in str(e) else []
        if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str):
            # A key a nested config dict lacks.
            key = e.args[0]
            for home in homes:
                for k, v in home.items():
                    if isinstance(v, dict) and k not in _NESTED and key not in v:
                        options.append((home, k, {**v, key: _key_value(key)}))
        for field in _named_fields(e, names):
            for home in homes:
                if field in home or home is cfg or field not in cfg:
                    for v in _candidates(field, home.get(field, defaults.get(field)), layers, kinds):
                        options.append((home, field, v))
                    if listed:  # "... must contain keys {'type', 'factor'}"
                        options.append((home, field, {k: _key_value(k) for k in listed}))
        fixed = False
        for home, k, v in options:
            sig = (id(home), k, json.dumps(v, sort_keys=True, default=str))
            if sig in tried:
                continue
            tried.add(sig)
            old = home.get(k, dataclasses.MISSING)
            home[k] = v
            e2 = _trial(mod, cfg)
            if _progress(e2, e):
                e, fixed = e2, True  # solved, or on to the next error
                break
            if old is dataclasses.MISSING:
                del home[k]
            else:
                home[k] = old
        if not fixed:
            break
    return cfg


# ------------------------------------------------------------------ building --
# Parameters an architecture initialises to zeros where a trained model's
# are not, drawn at random instead (modelgen.ModelSpec's `randomize`):
# - a head of zeros makes the output constant: every gradient of the tiny
#   model is zero and proves nothing (compare refuses that);
# - a MoE router of zeros (MoEGate's mx.zeros) scores every expert alike, so
#   every token goes to the same top-k experts: the matrix would never see
#   tokens spread over experts (gather_mm/gather_qmm with their sort), as a
#   trained router spreads them;
# - rwkv7's output GroupNorm of zero weight leaves the attention's output
#   nothing but its bias; its token-shift mixes (x_r, ..., ffn.x_k) of
#   zeros leave the previous token unused, and with it the shift state a
#   prompt cache carries; its k_k of zeros makes the normalised key (the
#   state's removal term) zero, k_a leaves the in-context learning rate
#   out of the key, and r_k drops the bonus term;
# - baichuan_m1's key and value convolutions over time (conv_k, conv_v)
#   of zeros make every key and value zero: uniform attention, the
#   attention's q/k/v adapters without a gradient, and the convolution
#   state a prompt cache carries unused;
# - gpt_oss's attention sinks of zeros.
_ROUTER = ("*mlp.gate.weight",)
RANDOMIZE: Dict[str, Tuple[str, ...]] = {
    "talkie": ("lm_head",),  # a bare parameter, mx.zeros at init
    **{
        mt: _ROUTER
        for mt in (
            "bailing_moe_v3",
            "deepseek",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "dots1",
            "exaone_moe",
            "glm4_moe",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "kimi_k25",
            "kimi_vl",
            "mimo_v2_flash",
            "solar_open",
        )
    },
    "nemotron_h": ("*mixer.gate.weight",),
    "rwkv7": ("*attn.g_norm.weight", "*attn.x_?", "*ffn.x_k", "*attn.k_k", "*attn.k_a", "*attn.r_k"),
    "baichuan_m1": ("*self_attn.conv_k", "*self_attn.conv_v"),
    "gpt_oss": ("*self_attn.sinks",),
}


def spec_for(model_type: str, dtype: str, config: Optional[dict] = None) -> modelgen.ModelSpec:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    cfg = config if config is not None else derive_config(model_type)
    return modelgen.ModelSpec(
        arch=model_type,
        vocab_size=VOCAB,
        dtype="float32" if dtype == "fp32" else "bfloat16",
        bits=4 if dtype == "4bit" else None,
        group_size=32,
        config=cfg,
        randomize=RANDOMIZE.get(model_type, ()),
    )


def build(model_type: str, dtype: str, root) -> Path:
    """Generates the tiny model (cached under root by spec)."""
    spec = spec_for(model_type, dtype)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        return modelgen.generate_model(Path(root) / f"{model_type}-{dtype}-{spec.key()}", spec)


# ------------------------------------------------------------------ checking --
def sample_batch(path, batch_size: int = 2, max_tokens: int = 32) -> Tuple[mx.array, mx.array]:
    """A (batch, lengths) pair as mlx-lm's iterate_batches makes them: the
    sample data's first texts tokenized, padded, lengths as (offset, length);
    the lengths differ so that padding is masked."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
    texts = [
        json.loads(l)["text"] for l in (modelgen.SAMPLE_DATA / "train.jsonl").read_text().splitlines()[:batch_size]
    ]
    seqs = []
    for i, t in enumerate(texts):
        ids = tok.encode(t)
        n = max_tokens + 1 - 5 * i  # the first fills the batch, the next are shorter
        seqs.append(ids[:n] if len(ids) >= n else ids)
    T = max(len(s) for s in seqs)
    batch = mx.array([s + [0] * (T - len(s)) for s in seqs])
    lengths = mx.array([[0, len(s)] for s in seqs])
    return batch, lengths


def reference(path, num_layers: int, dora: bool = False, lora=LORA) -> nn.Module:
    """The model as mlx_lm.lora trains it: loaded, frozen, LoRA on the last
    num_layers blocks (the global PRNG seeded for the adapters' init)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(path), lazy=True)
    model.freeze()
    mx.random.seed(0)
    linear_to_lora_layers(model, num_layers, lora, use_dora=dora)
    return model


def paged(
    path,
    num_layers: int,
    store: str = "in_place",
    cache_dir=None,
    dora: bool = False,
    lora=LORA,
    page_parts: Optional[int] = 1,
    pager_options: Optional[dict] = None,
):
    """The same model with its frozen weights paged (PagedWeights, each
    block in at most `page_parts` pages; `pager_options` for its Pager),
    the same adapters. Returns (model, weights)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    from .step import first_trained_block
    from .store import PagedWeights

    model, _ = load_model(Path(path), lazy=True)
    model.freeze()
    w = PagedWeights(
        model,
        path,
        budget_bytes=1 << 30,
        ssd_cache_dir=cache_dir,
        store=store,
        page_parts=page_parts,
        pager_options=pager_options,
    )
    w.pin_resident()
    mx.random.seed(0)
    linear_to_lora_layers(model, num_layers, lora, use_dora=dora)
    if dora:
        from .session import init_dora_magnitudes

        init_dora_magnitudes(model, w, first_trained_block(model))
    return model, w


def bitwise_mismatches(ref: Dict[str, mx.array], got: Dict[str, mx.array]) -> List[str]:
    """What differs between two {name: array} dicts, bit for bit (NaNs in
    the same places count as equal)."""
    bad = []
    if set(ref) != set(got):
        missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
        bad.append(f"gradient names differ: missing {missing[:3]}, extra {extra[:3]}")
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{k}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
        elif not mx.array_equal(a, b, equal_nan=True).item():
            d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            bad.append(f"{k}: max diff {d:.3g}")
    return bad


def compare(
    path,
    num_layers: int = LAYERS,
    store: str = "in_place",
    cache_dir=None,
    batch=None,
    head_chunk_bytes: int = 20_000,
    compile: bool = False,
    page_parts: int = 1,
    lora=LORA,
) -> List[str]:
    """Runs mlx-lm's step and the paged step on the same batch; returns the
    differences (empty: bitwise equal). Raises NotPageable (or ValueError)
    when mlx-pager refuses the model. `lora`: mlx-lm's lora_parameters
    (its `keys` may name modules outside the blocks: outside.py). ``compile``: the paged step's blocks
    compiled with mx.compile (step.Blocks) or run as mlx-lm runs them; the
    matrix runs them uncompiled, since compiling JIT-builds C++ kernels for
    every new shape on the CPU backend (test_step.py checks the compiled
    path bitwise on llama and qwen3)."""
    from mlx_lm.tuner.trainer import default_loss

    from . import step as S

    batch = batch if batch is not None else sample_batch(path)
    try:
        ref = reference(path, num_layers, lora=lora)
        if not tree_flatten(ref.trainable_parameters()):
            raise ValueError("mlx-lm's LoRA finds no layer to adapt in its blocks")
        (loss, ntoks), grads = nn.value_and_grad(ref, default_loss)(ref, *batch)
        mx.eval(loss, grads)
    except Exception as e:
        raise MlxLmFails(_one_line(e)) from e
    model, w = paged(path, num_layers, store, cache_dir, page_parts=page_parts, lora=lora)
    losses, toks, pgrads = S.paged_value_and_grad(
        model,
        w,
        [S.MicroBatch.from_batch(*batch)],
        head_chunk_bytes=head_chunk_bytes,
        blocks=S.Blocks(model, compile=compile),
    )
    bad = []
    if not mx.array_equal(losses[0], loss, equal_nan=True).item():
        bad.append(f"loss {losses[0].item()!r} vs mlx-lm {loss.item()!r}")
    if toks[0].item() != ntoks.item():
        bad.append(f"tokens {toks[0].item()} vs {ntoks.item()}")
    bad += bitwise_mismatches(dict(tree_flatten(grads)), pgrads)
    if not tree_flatten(grads) and not bad:
        bad.append("no adapter gradients (mlx-lm put no LoRA layers in the blocks)")
    elif not bad and not any(mx.any(g != 0).item() for _, g in tree_flatten(grads)):
        # (talkie's generated head was its init, zeros: every logit equal,
        # every gradient zero on both sides, and a wrong step passed: RANDOMIZE)
        bad.append("every gradient is zero in mlx-lm too: the comparison proves nothing (a constant output?)")
    return bad


class MlxLmFails(Exception):
    """mlx-lm's own LoRA step fails on the model (nothing to compare with)."""


@dataclasses.dataclass
class Result:
    model_type: str
    dtype: str
    status: str  # "pass", "cannot build", "refused", "fail"
    reason: str = ""
    seconds: float = 0.0


def _one_line(e: BaseException) -> str:
    from .step import one_line

    return one_line(e)[:300]


# The matrix as last recorded on this repository's machine (CPU backend):
# test_architectures.py fails when one recorded "pass" stops passing.
# Regenerate with `python -m mlx_pager.architectures --json FILE`.
RECORDED: Dict[str, Dict[str, str]] = {
    "Klear": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "afm7": {"bf16": "refused", "fp32": "refused", "4bit": "cannot build"},
    "afmoe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "apertus": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "baichuan_m1": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "bailing_hybrid": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "bailing_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "bailing_moe_linear": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "bailing_moe_v3": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "bitnet": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "cohere": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "cohere2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "dbrx": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "deepseek": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "deepseek_v2": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "deepseek_v3": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "deepseek_v32": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "deepseek_v41": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "dots1": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "ernie4_5": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "ernie4_5_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "exaone": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "exaone4": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "exaone_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "falcon_h1": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gear": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gemma": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gemma2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gemma3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gemma3_text": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gemma3n": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "gemma4": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "gemma4_text": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "glm": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "glm4": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "glm4_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "glm4_moe_lite": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "glm_moe_dsa": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "gpt2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gpt_bigcode": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gpt_neox": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "gpt_oss": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "gptj": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "granite": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "granitemoe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "granitemoehybrid": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "helium": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "hunyuan": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "hunyuan_v1_dense": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "internlm2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "internlm3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "iquestloopcoder": {"bf16": "refused", "fp32": "refused", "4bit": "refused"},
    "jamba": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "kimi_k25": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "kimi_k3": {"bf16": "cannot build", "fp32": "refused", "4bit": "refused"},
    "kimi_linear": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "kimi_vl": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "laguna": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "lfm2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "lfm2-vl": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "lfm2_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "lille-130m": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "llama": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "llama4": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "llama4_text": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "longcat_flash": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "longcat_flash_ngram": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "mamba": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "mamba2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "mellum": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "mimo": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "mimo_v2_flash": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "minicpm": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "minicpm3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "minimax": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "minimax_m3_vl": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "ministral3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "mistral3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "mistral4": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "mixtral": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "muse_glimmer": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "muse_spark": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "nanbeige": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "nanochat": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "nemotron": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "nemotron-nas": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "nemotron_h": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "olmo": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "olmo2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "olmo3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "olmo_hybrid": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "olmoe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "openelm": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "phi": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "phi3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "phi3small": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "phimoe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "phixtral": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "pixtral": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "plamo": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "plamo2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "plamo3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "prism_hadamard_qwen35": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "qwen": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "qwen2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "qwen2_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "qwen2_vl": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "qwen3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "qwen3_5": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "qwen3_5_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "qwen3_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "qwen3_next": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "qwen3_vl": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "qwen3_vl_moe": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "recurrent_gemma": {"bf16": "cannot build", "fp32": "cannot build", "4bit": "cannot build"},
    "rwkv7": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "seed_oss": {"bf16": "pass", "fp32": "pass", "4bit": "cannot build"},
    "smollm3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "solar_open": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "spark2_5": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "stablelm": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "starcoder2": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "step3p5": {"bf16": "cannot build", "fp32": "pass", "4bit": "pass"},
    "talkie": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "telechat3": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
    "youtu_llm": {"bf16": "pass", "fp32": "pass", "4bit": "pass"},
}

# Architectures whose tiny models would crash the process (so they are not
# run): what a generated config cannot express.
EXCLUDED = {
    "phi3small": "its head writes -inf at hard-coded token ids >= 100256 (its tokenizer's dummy "
    "tokens): out of bounds for a small vocabulary, MLX's scatter corrupts the heap",
}


def check(model_type: str, dtype: str, root, compile: bool = False, page_parts: int = 1) -> Result:
    """Builds and checks one architecture in one dtype, each block in at
    most `page_parts` pages (a forward block of several is read lazily,
    part by part: what --page-parts auto does at a small budget)."""
    from .layers import NotPageable

    t0 = time.perf_counter()

    def done(status, reason=""):
        return Result(model_type, dtype, status, reason, time.perf_counter() - t0)

    if model_type in EXCLUDED:
        return done("cannot build", EXCLUDED[model_type])

    try:
        path = build(model_type, dtype, root)
        from mlx_lm.utils import load_model

        model, _ = load_model(path, lazy=True)  # loads as mlx-lm would load it
        del model
    except Exception as e:
        return done("cannot build", _one_line(e))
    try:
        # store="auto": pages holding tensors the model's sanitize changes
        # (not the files' bytes) go through the swap file.
        # The head's loss in chunks of 20 kB where that keeps the bits:
        # OpenBLAS (which the tests preload) gives a float32 product's rows
        # other bits in products of other row counts, so float32 runs the
        # head whole, as the trainer does unless the budget asks for chunks.
        head = 0 if dtype == "fp32" else 20_000
        bad = compare(
            path,
            store="auto",
            cache_dir=str(Path(root) / "swap"),
            compile=compile,
            page_parts=page_parts,
            head_chunk_bytes=head,
        )
    except MlxLmFails as e:
        return done("cannot build", f"mlx-lm's own LoRA step fails: {e}")
    except NotPageable as e:
        return done("refused", str(e))
    except Exception as e:
        return done("fail", _one_line(e))
    return done("fail", "; ".join(bad[:3])) if bad else done("pass")


GENERATE_PROMPT = [3, 17, 42, 5, 99, 8, 250, 11]  # token ids of the tiny vocabulary


def check_generation(model_type: str, dtype: str, root, tokens: int = 5) -> Result:
    """Generation at the least page budget (one block's pages), each block a
    page, against mlx-lm's own model: a prompt's prefill and `tokens` greedy
    decode steps through a prompt cache (mlx-lm's make_prompt_cache), every
    step's logits BITWISE equal. "cannot build" where mlx-lm's loader (its
    tokenizer's config check included) refuses the tiny model."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from .generate import load_paged
    from .layers import NotPageable

    t0 = time.perf_counter()

    def done(status, reason=""):
        return Result(model_type, dtype, status, reason, time.perf_counter() - t0)

    if model_type in EXCLUDED:
        return done("cannot build", EXCLUDED[model_type])
    cache_dir = str(Path(root) / "swap")
    try:
        path = build(model_type, dtype, root)
        ref, _ = load_model(path)
        probe, _ = load_paged(str(path), ssd_cache_dir=cache_dir, page_parts=1)
        least = probe.weights.max_block_charge
        del probe
    except NotPageable as e:
        return done("refused", str(e))
    except Exception as e:
        return done("cannot build", _one_line(e))

    def run(model) -> List[mx.array]:
        cache = make_prompt_cache(model)
        logits = model(mx.array([GENERATE_PROMPT]), cache=cache)[:, -1]
        out = [logits]
        for _ in range(tokens):
            logits = model(mx.argmax(logits, axis=-1)[:, None], cache=cache)[:, -1]
            out.append(logits)
        mx.eval(out)
        return out

    try:
        want = run(ref)
        del ref
        paged, _ = load_paged(str(path), ssd_cache_dir=cache_dir, page_parts=1, page_budget=least)
        got = run(paged)
    except NotPageable as e:
        return done("refused", str(e))
    except Exception as e:
        return done("fail", _one_line(e))
    bad = [k for k, (a, b) in enumerate(zip(want, got)) if not mx.array_equal(a, b).item()]
    return done("fail", f"logits differ at steps {bad} (0: the prompt)") if bad else done("pass")


def run_matrix(root, archs=None, dtypes=DTYPES, log=None, compile: bool = False) -> List[Result]:
    results = []
    for mt in archs or model_types():
        for dt in dtypes:
            # What models print while they build (mlx-lm's config warnings)
            # goes to stderr: stdout is the table's.
            with contextlib.redirect_stdout(sys.stderr):
                r = check(mt, dt, root, compile)
            results.append(r)
            mx.clear_cache()
            if log:
                log(r)
    return results


def markdown(results: List[Result]) -> str:
    by = collections.OrderedDict()
    for r in results:
        by.setdefault(r.model_type, {})[r.dtype] = r
    dts = [d for d in DTYPES if any(d in v for v in by.values())]
    lines = ["| architecture | " + " | ".join(dts) + " | why |", "|---" * (len(dts) + 2) + "|"]
    for mt, rs in by.items():
        cells, why = [], []
        for d in dts:
            r = rs.get(d)
            cells.append(r.status if r else "")
            if r and r.status != "pass" and r.reason and r.reason not in why:
                why.append(r.reason)
        lines.append(f"| {mt} | " + " | ".join(cells) + " | " + " / ".join(why).replace("|", "\\|") + " |")
    counts = collections.Counter((r.dtype, r.status) for r in results)
    summary = "; ".join(
        f"{d}: "
        + ", ".join(f"{counts[(d, s)]} {s}" for s in ("pass", "refused", "cannot build", "fail") if counts[(d, s)])
        for d in dts
    )
    return "\n".join(lines) + f"\n\n{summary}\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print the matrix as a markdown table")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON")
    p.add_argument("--arch", action="append", help="only these architectures")
    p.add_argument("--dtype", action="append", choices=DTYPES)
    p.add_argument("--root", help="where models are generated (default: a temporary folder)")
    p.add_argument("--compile", action="store_true", help="the paged blocks compiled (step.Blocks' default)")
    a = p.parse_args(argv)
    root = a.root or tempfile.mkdtemp(prefix="mlx-pager-archs-")

    def log(r):
        print(f"{r.model_type:24s} {r.dtype:5s} {r.status:12s} {r.seconds:5.1f}s {r.reason}", file=sys.stderr)

    results = run_matrix(root, a.arch, a.dtype or DTYPES, log, a.compile)
    if a.json:
        Path(a.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    if a.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
