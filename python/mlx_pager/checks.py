"""What a run can refuse before anything heavy happens (model load, data
load, swap file preparation): every flag, the budget, the model directory
and the data files. Each refusal is one line naming the flag or file, what is
wrong and the fix (a ValueError, BudgetError or FileNotFoundError)."""

from __future__ import annotations

import importlib.util
import json
import mmap
import re
import sys
from pathlib import Path

from . import memlimit
from .budget import BudgetError, format_size, parse_size


def data_formats(args=None) -> tuple:
    """mlx-lm's data formats, by the keys of a record, in the order its
    create_dataset tries them (tuner/datasets.py): prompt/completion, chat,
    text. A config renames the keys (prompt_feature, completion_feature,
    chat_feature, text_feature) as it does for mlx-lm."""

    def key(name, default):
        return getattr(args, name, None) or default

    return (
        (key("prompt_feature", "prompt"), key("completion_feature", "completion")),
        (key("chat_feature", "messages"),),
        (key("text_feature", "text"),),
    )


def _positive(args, name: str, also: str = "", least: int = -1):
    """A whole number of at least 1; `also` names what the values from
    `least` up to 0 mean where mlx-lm takes them (then they are allowed)."""
    v = getattr(args, name, None)
    if v is None:
        return
    ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 1 or (also and v >= least))
    if not ok:
        flag = "--" + name.replace("_", "-")
        extra = f" ({also})" if also else ""
        raise ValueError(f"{flag} must be a whole number of at least 1{extra}, not {v!r}")


def check_flags(args) -> None:
    if args.fine_tune_type not in ("lora", "dora"):
        raise ValueError(
            f"--fine-tune-type {args.fine_tune_type} is not supported by mlx-pager: "
            "full fine-tuning trains the weights it pages; use lora or dora"
        )
    if args.model is None:
        raise ValueError("no --model given: pass a local mlx-lm model directory or a hub id")
    if args.data is None:
        raise ValueError("no --data given: pass a directory with train.jsonl and valid.jsonl")
    if not args.train and not args.test:
        raise ValueError("Must provide at least one of --train or --test")
    for name in (
        "batch_size",
        "steps_per_report",
        "steps_per_eval",
        "save_every",
        "grad_accumulation_steps",
        "io_threads",
    ):
        _positive(args, name)
    # As mlx-lm: --num-layers -1 or 0 trains every block (it takes the last
    # max(n, 0) blocks, and [-0:] is all); --val-batches / --test-batches -1
    # evaluate the whole set, 0 none (the loss reads nan).
    _positive(args, "num_layers", also="or 0 or -1 for all")
    # --iters 0 trains nothing and writes the adapters as initialised, as
    # mlx-lm's loop of zero iterations does.
    _positive(args, "iters", also="or 0 to write untrained adapters", least=0)
    for name in ("val_batches", "test_batches"):
        _positive(args, name, also="or -1 for all, 0 for none")
    if args.max_seq_length is not None and args.max_seq_length < 2:
        raise ValueError(
            f"--max-seq-length must be at least 2 (one input and one target token), not {args.max_seq_length}"
        )
    lora = getattr(args, "lora_parameters", None)
    if lora is not None:
        # mlx-lm's linear_to_lora_layers reads each of these (a config's
        # lora_parameters replaces mlx-lm's defaults whole).
        if not isinstance(lora, dict):
            raise ValueError(f"lora_parameters must be a mapping (rank, scale, dropout), not {lora!r}")
        missing = [k for k in ("rank", "scale", "dropout") if k not in lora]
        if missing:
            raise ValueError(
                f"lora_parameters lacks {', '.join(missing)}: give rank, scale and dropout "
                "(mlx-lm's defaults are rank 8, scale 20.0, dropout 0.0)"
            )
    parts = getattr(args, "page_parts", 1)
    if parts != "auto" and (not isinstance(parts, int) or parts < 1):
        raise ValueError(f"--page-parts must be 'auto', 1 (one page per block) or more, not {parts}")
    ahead = getattr(args, "prefix_ahead", "auto")
    if ahead != "auto" and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
        raise ValueError(f"--prefix-ahead must be 'auto', 1 (off) or more steps, not {ahead}")
    if args.readahead is not None and args.readahead < 0:
        raise ValueError(f"--readahead must be 0 (off) or more blocks, not {args.readahead}")
    if args.head_chunk_bytes is not None and args.head_chunk_bytes <= 0:
        raise ValueError(f"head_chunk_bytes must be positive, not {args.head_chunk_bytes}")
    if getattr(args, "page_budget", None) is not None:
        parse_size(args.page_budget, "page_budget")
    if args.memory_budget is not None:
        check_budget_fits(parse_size(args.memory_budget))


def check_budget_fits(budget: int) -> None:
    """Refuses a budget above this process's memory cgroup limit (the kernel
    kills the process there, mid-run); warns of one above the machine's RAM
    (the OS swaps or compresses, the budget no longer protects the run)."""
    cgroup, ram = memlimit.cgroup_limit(), memlimit.physical_memory()
    # The kernel keeps a cgroup's limit in whole pages (rounded down): a cap
    # set to the budget's bytes reads back up to a page below it.
    if cgroup is not None and budget >= cgroup + mmap.PAGESIZE:
        raise BudgetError(
            f"--memory-budget {format_size(budget)} is more than this process's memory cgroup limit "
            f"{format_size(cgroup)}: the kernel kills the process past it. Pass --memory-budget "
            f"{format_size(int(memlimit.DEFAULT_SHARE * cgroup))} or less (or leave it out: the default is "
            f"{memlimit.DEFAULT_SHARE:.0%} of that limit)"
        )
    if ram and budget > ram:
        print(
            f"mlx-pager: warning: --memory-budget {format_size(budget)} is more than this machine's "
            f"{format_size(ram)} of memory: the budget will not protect the process from the OS",
            file=sys.stderr,
        )


# A Hugging Face repo id, as huggingface_hub's validate_repo_id allows one:
# owner/name of letters, digits, '-', '_' and '.', each starting and ending
# with a letter, digit or '_' (so a dotted name such as
# mlx-community/Llama-3.2-1B-Instruct-4bit is an id, not a path).
_REPO_ID = re.compile(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]{0,94}\w)?")


def looks_like_path(name: str) -> bool:
    """True where `name` (a --model or --data) cannot be a Hugging Face repo
    id, so a missing directory of that name is an error here, not a hub
    download for mlx-lm."""
    return not _REPO_ID.fullmatch(name) or ".." in name or "--" in name or name.endswith(".git")


def check_model(model: str) -> None:
    p = Path(model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise FileNotFoundError(
                f"--model {model} is a file: point it at an mlx-lm model directory (config.json + model*.safetensors)"
            )
        if not (p / "config.json").exists():
            raise FileNotFoundError(
                f"--model {model} has no config.json: point it at an mlx-lm model directory "
                "(config.json + model*.safetensors)"
            )
        if not any(p.glob("model*.safetensors")):
            raise FileNotFoundError(
                f"--model {model} has no model*.safetensors files: point it at an mlx-lm model "
                "directory (convert a Hugging Face model with mlx_lm.convert)"
            )
        return
    if looks_like_path(model):
        raise FileNotFoundError(
            f"--model {model}: no such directory (a local model is a directory with config.json "
            "and model*.safetensors; a Hugging Face repo id is written owner/name)"
        )


# What a tokenizer is read from (transformers' fast and slow tokenizers).
_TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.*", "merges.txt", "*.tiktoken")


def load_tokenizer(model_path, tokenizer_config: dict, eos_token_ids=None):
    """mlx-lm's load_tokenizer, with a model directory that lacks its
    tokenizer's files named: transformers then fails with a message about
    converting slow tokenizers (llama) or builds an empty tokenizer (qwen2)
    that mlx-lm's dataset code stops on with an IndexError."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    missing = (
        f"the model directory {model_path} lacks its tokenizer's files (tokenizer.json, or tokenizer.model or "
        "vocab.json and merges.txt, with tokenizer_config.json): copy them from the model's source"
    )
    has_files = any(any(Path(model_path).glob(f)) for f in _TOKENIZER_FILES)
    try:
        tokenizer = mlx_lm_load_tokenizer(Path(model_path), tokenizer_config, eos_token_ids=eos_token_ids)
    except Exception:
        if not has_files:
            raise ValueError(missing) from None
        raise
    if len(tokenizer.encode("hello world")) == 0:
        raise ValueError(f"its tokenizer encodes text to no tokens: {missing}")
    return tokenizer


def _records(path: Path):
    """(line number, record) of a .jsonl file; one clear error per bad line
    (mlx-lm's loader reads every line as JSON: a blank one too)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                raise ValueError(
                    f"{path} line {n} is blank: mlx-lm reads every line as one JSON object; delete the blank line"
                )
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(
                    f"{path} line {n} is not valid JSON ({e.msg} at column {e.colno}): "
                    "each line must be one JSON object"
                ) from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path} line {n} is a JSON {type(rec).__name__}, not an object")
            yield n, rec


def check_jsonl(path: Path, args=None) -> int:
    """Checks that every record of `path` has the keys of one of mlx-lm's
    formats (that of the first record; data_formats(args)). Returns the
    number of records."""
    fmt, count = None, 0
    formats = data_formats(args)
    for n, rec in _records(path):
        if fmt is None:
            fmt = next((keys for keys in formats if all(k in rec for k in keys)), None)
            if fmt is None:
                (p, c), (chat,), (text,) = formats
                raise ValueError(
                    f"{path} line {n} has keys {sorted(rec)}; mlx-lm's formats are {{{text!r}}}, "
                    f"{{{p!r}, {c!r}}} or {{{chat!r}}}: rename the keys (or name yours in a config's "
                    "text_feature, prompt_feature, completion_feature or chat_feature)"
                )
            if getattr(args, "mask_prompt", False) and fmt == formats[2]:
                raise ValueError(
                    f"--mask-prompt needs prompts, but {path} holds text records ({fmt[0]!r}): use "
                    f"{{{formats[0][0]!r}, {formats[0][1]!r}}} or {{{formats[1][0]!r}}} records, or drop --mask-prompt"
                )
        missing = [k for k in fmt if k not in rec]
        if missing:
            raise ValueError(
                f"{path} line {n} lacks {missing}, which the file's first record has: "
                "every record of a file must have the same format"
            )
        count += 1
    return count


def check_data(args) -> None:
    d = Path(args.data).expanduser()
    if not d.exists():
        if not looks_like_path(str(args.data)) and importlib.util.find_spec("datasets") is not None:
            return  # a Hugging Face dataset name: mlx-lm loads it
        raise FileNotFoundError(
            f"--data {args.data}: no such directory (it must hold train.jsonl and valid.jsonl; test.jsonl for --test)"
        )
    if not d.is_dir():
        raise FileNotFoundError(f"--data {args.data} is a file: pass the directory that holds train.jsonl")
    need = (["train"] if args.train else []) + (["test"] if args.test else [])
    for name in ["train", "valid", "test"]:
        f = d / f"{name}.jsonl"
        if not f.exists():
            if name in need:
                raise FileNotFoundError(
                    f"--data {args.data} has no {name}.jsonl: {'--train' if name == 'train' else '--test'} needs it"
                )
            continue
        n = check_jsonl(f, args)
        if n == 0 and name in need:
            raise ValueError(f"{f} has no records: write one JSON object per line")
        # mlx-lm's batches need batch_size records: training's, each
        # validation's (valid.jsonl is optional) and --test's.
        used = name in need or (name == "valid" and args.train and n > 0)
        if getattr(args, {"valid": "val_batches", "test": "test_batches"}.get(name, ""), 1) == 0:
            used = False  # --val-batches 0 / --test-batches 0: never read
        if used and n < args.batch_size:
            raise ValueError(
                f"{f} has {n} records, fewer than --batch-size {args.batch_size}: lower --batch-size or add data"
            )


def check_adapter_paths(args) -> None:
    """--adapter-path must be a directory (or not exist yet; it is made when
    the first adapters are saved), and --resume-adapter-file an existing
    file: each stopped the run with a bare OSError (File exists) or MLX's
    RuntimeError traceback, after the model and data were loaded."""
    adapter_path = getattr(args, "adapter_path", None)
    if args.train and adapter_path is not None and Path(adapter_path).is_file():
        raise FileExistsError(
            f"--adapter-path {adapter_path} is a file: choose a directory (it is created if missing); "
            "the adapters are written into it as adapters.safetensors"
        )
    resume_file = getattr(args, "resume_adapter_file", None)
    if args.train and resume_file is not None and not Path(resume_file).is_file():
        raise FileNotFoundError(
            f"--resume-adapter-file {resume_file}: no such file (it takes an adapters.safetensors that an "
            "earlier run wrote)"
        )


def check_args(args) -> None:
    """Everything refusable before a model or data is loaded."""
    check_flags(args)
    check_model(str(args.model))
    check_data(args)
    check_adapter_paths(args)
    if getattr(args, "resume", False) and args.train:
        from . import resume

        resume.check(args.adapter_path, args)


def check_blocks_unpatched(model) -> None:
    """Refuses a model whose block class mlx-lm's --grad-checkpoint patched
    earlier in this process: mlx_lm.tuner.trainer.grad_checkpoint replaces
    the class's __call__ for the whole process with one that re-sets the
    block's parameters inside mx.checkpoint, which keeps the views of pages
    mlx-pager reads lazily (the run would stop on a full page budget)."""
    for layer in getattr(model, "layers", [])[:1]:
        call = type(layer).__call__
        if getattr(call, "__module__", "") == "mlx_lm.tuner.trainer" and call.__name__ == "checkpointed_fn":
            raise ValueError(
                f"{type(layer).__module__}.{type(layer).__name__}.__call__ was replaced by mlx-lm's "
                "grad_checkpoint earlier in this process (mlx_lm.lora with --grad-checkpoint), for every "
                "model of this architecture: run mlx-pager in a fresh process (its own --grad-checkpoint "
                "recomputes without patching)"
            )


def check_backend_ops(model) -> None:
    """Refuses, before anything is paged, a model whose layers need an op
    this MLX backend does not run for their dtype: MLX's CPU backend runs
    gather_mm (the experts of an unquantized mixture-of-experts layer,
    mlx-lm's SwitchLinear) in float32 only; a bf16 mixtral failed in its
    first validation with a traceback, as mlx_lm.lora fails. Asked of the
    backend itself, on two tiny arrays per dtype, so a backend that runs
    them (Metal; the CPU once MLX adds them) is not refused."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    dtypes = {m.weight.dtype for _, m in model.named_modules() if isinstance(m, SwitchLinear) and "weight" in m}
    for dtype in sorted(dtypes - {mx.float32}, key=str):
        try:
            a, b = mx.zeros((1, 1, 1, 4), dtype=dtype), mx.zeros((2, 4, 2), dtype=dtype)
            mx.eval(mx.gather_mm(a, b, rhs_indices=mx.array([[1]], dtype=mx.uint32)))
        except RuntimeError as e:
            kind = getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]
            raise ValueError(
                f"{kind}: its mixture-of-experts layers hold {str(dtype).rsplit('.', 1)[-1]} weights, and this "
                f"MLX backend cannot multiply them (gather_mm: {e}); mlx-lm fails the same way. Use a "
                "quantized model (mlx_lm.convert -q), or one converted to float32, or a backend that runs "
                "them (Metal)"
            ) from None


def check_pageable(model, generation: bool = False) -> None:
    """Refuses, before any data is loaded or any page read, a model whose
    blocks cannot be paged (layers.NotPageable, one line: the architecture
    and why): the model's own forward pass on two tokens with recording
    stand-ins for its blocks (step.record_calls; nothing is computed), as
    every step or generated token records it. `generation`: through a
    prompt cache of its own, thrown away after."""
    import mlx.core as mx

    from . import step

    kwargs = {}
    if generation:
        from mlx_lm.models.cache import make_prompt_cache

        kwargs = {"per_block_state": True, "cache": make_prompt_cache(model)}
    step.record_calls(model, mx.zeros((1, 2), dtype=mx.int32), **kwargs)
