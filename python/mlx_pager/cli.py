"""The mlx-pager command line.

mlx-pager lora ...      drop-in for mlx_lm.lora (same flags and defaults)
                        plus --memory-budget and --ssd-cache-dir
mlx-pager demo          the offline main job: generate (once) a model several
                        times larger than the budget, train it under that
                        budget on the shipped sample data, print what the
                        pager did
mlx-pager generate ...  drop-in for mlx_lm.generate (same flags) with the
                        weights paged under --memory-budget
mlx-pager make-model DIR  write a small random-weight test model
mlx-pager plot FILE     a PNG of a --report file (memory by component, I/O),
                        or of one step of a --trace file (its timeline)
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

from .budget import BudgetError, format_size
from .layers import NotPageable


def _paging_flags(parser: argparse.ArgumentParser, fill_later: bool, readahead: str):
    """mlx-pager's own flags, added to an mlx-lm parser as the group
    "mlx-pager". `fill_later`: defaults stay None (the trainer's DEFAULTS and a
    -c config file fill them); otherwise they are the defaults themselves."""

    def default(value):
        return None if fill_later else value

    g = parser.add_argument_group("mlx-pager")
    g.add_argument(
        "--memory-budget",
        type=str,
        default=None,
        help="Memory the whole process may use, e.g. 12GB or 900MiB (default: 80%% of RAM, or of the "
        "memory cgroup's limit where that is lower, as in a container).",
    )
    g.add_argument(
        "--ssd-cache-dir",
        type=str,
        default=default(str(Path.home() / ".cache" / "mlx-pager")),
        help="Where the pager writes swap files when a model's weights cannot be read in place.",
    )
    g.add_argument(
        "--store",
        choices=["auto", "in_place", "swap"],
        default=default("auto"),
        help="Read pages from the model's files (in_place), a swap file, or decide per page (auto).",
    )
    g.add_argument(
        "--policy",
        choices=["optimal", "lru"],
        default=default("optimal"),
        help="Eviction policy (default: optimal, Belady's MIN on the known access order).",
    )
    g.add_argument("--readahead", type=int, default=None, help=readahead)
    g.add_argument(
        "--readahead-mode",
        choices=["conservative", "aggressive"],
        default=default("conservative"),
        help="conservative: never more reads than Belady's minimum; aggressive: may read "
        "more to overlap reads with compute when the budget is small.",
    )
    g.add_argument("--io-threads", type=int, default=default(4), help="I/O threads (default 4).")
    g.add_argument(
        "--page-parts",
        type=_page_parts,
        default=default(1),
        help="pages per block: N; 'auto' (lora's default): one page per block where the page budget "
        "holds 3 blocks or more, else parts of ~48 MB (at least 4), so that the next part is read while "
        "the last one computes; for generate (default 1), 'auto' splits a block over ~72 MB by size.",
    )
    return g


def _auto_or_whole(unit: str):
    """An argparse type for a flag that takes 'auto' or a whole number of
    `unit` (checks.py refuses one below 1): --page-parts, --prefix-ahead."""

    def parse(text: str):
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be 'auto' or a whole number of {unit}, not '{text}'") from None

    return parse


_page_parts = _auto_or_whole("pages")
_prefix_ahead = _auto_or_whole("steps")


def _lora_parser() -> argparse.ArgumentParser:
    from mlx_lm.lora import build_parser

    parser = build_parser()  # mlx_lm.lora's own flags, help and choices
    parser.prog = "mlx-pager lora"
    parser.description = "LoRA or DoRA fine-tuning with the frozen weights paged from the SSD."
    for action in parser._actions:
        if action.dest == "fine_tune_type":
            action.help = (
                "Type of fine-tuning to perform: lora or dora. "
                "(full is refused: it would train the weights mlx-pager pages.)"
            )
        elif action.dest == "grad_checkpoint":
            action.help = (
                "Checkpoint and recompute every trained block, as mlx_lm.lora does (the plan may still "
                "split the batch or spill checkpoints to the SSD). Without it mlx-pager plans per step "
                "which blocks keep their graph and which are recomputed, usually faster."
            )
    g = _paging_flags(
        parser,
        fill_later=True,
        readahead="Blocks to read ahead (0 = off; default: chosen after the second step from the "
        "measured compute and read rate, by the step-time simulator).",
    )
    g.add_argument(
        "--prefix-ahead",
        type=_prefix_ahead,
        default=None,
        help="Steps the frozen blocks below the first trained one run ahead for: each of them is read "
        "once for that many steps' batches, whose outputs wait in memory (default auto: by the blocks' "
        "size against the outputs'; 1 = off). The losses and adapters are the same.",
    )
    g.add_argument("--report", type=str, default=None, help="Append per-step statistics to this JSON-lines file.")
    g.add_argument(
        "--trace",
        type=str,
        default=None,
        help="Write a timeline of the run to this file (Chrome trace JSON; open it in https://ui.perfetto.dev "
        "or draw a step with `mlx-pager plot --trace FILE`): block forward/backward, the update, reads per "
        "I/O thread, acquire waits, evictions.",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="Continue exactly where the last run in --adapter-path stopped (its resume_state."
        "safetensors: adapters, optimizer state, schedule and data position), e.g. after "
        "Ctrl-C, a kill or a crash, or with a larger --iters (as one run of that many iterations).",
    )
    return parser


def lora_main(argv) -> int:
    import yaml
    from mlx_lm.lora import yaml_loader

    from .interrupt import Interrupted
    from .trainer import DEFAULTS, run

    parser = _lora_parser()
    args = vars(parser.parse_args(argv))
    config = args.get("config")  # kept, as mlx-lm keeps it (adapter_config.json names it)
    if config:
        try:
            with open(config) as f:
                loaded = yaml.load(f, yaml_loader)
        except (OSError, yaml.YAMLError) as e:
            parser.error(f"cannot read the config file {config}: {e}")
        for k, v in (loaded or {}).items():
            if args.get(k) is None:
                args[k] = v
    for k, v in DEFAULTS.items():
        if args.get(k) is None:
            args[k] = v
    if not args["train"] and not args["test"]:
        parser.error("must provide at least one of --train or --test")
    try:
        run(types.SimpleNamespace(**args))
    except Interrupted as e:
        print(f"mlx-pager: {e}", file=sys.stderr)
        return e.exit_code
    except (BudgetError, OSError, ValueError, ImportError) as e:
        # OSError: a file or directory the run cannot read or write (named);
        # ImportError: --report-to names a logger that is not installed
        # (mlx-lm's own message, which says what to install).
        print(f"mlx-pager: {_message(e, 'mlx_lm.lora')}", file=sys.stderr)
        return 2
    return 0


def _message(e: BaseException, tool: str) -> str:
    """A run's error as one line; for a model whose blocks cannot be paged,
    with what to do instead (there is no option of ours that helps)."""
    if isinstance(e, NotPageable):
        return f"{e}. mlx-pager cannot page this model; {tool} runs it with every weight in memory, where it fits"
    return str(e)


def demo_main(argv) -> int:
    """Generates (once) a float32 Llama several times larger than the memory
    budget and LoRA-trains it under that budget on the shipped sample data."""
    from . import modelgen
    from .trainer import DEFAULTS, run

    p = argparse.ArgumentParser(
        prog="mlx-pager demo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=demo_main.__doc__
        + """
With the defaults the model is a 30-block float32 Llama of 1.83 GB (hidden
size 1024), trained under a 450 MB budget. It needs about 1.9 GB of disk
under --cache-dir (the model, generated once and reused; its pages are read
in place, so no swap copy is written) and about 2-3 minutes on 2 CPU cores
with OpenBLAS (the first run also spends ~1 minute generating the model;
without OpenBLAS on Linux, float32 matmuls are ~10x slower). Size and
time scale with --layers x --hidden-size^2.""",
    )
    p.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "mlx-pager"),
        help="Where the generated model and swap files are kept.",
    )
    p.add_argument("--memory-budget", default="450MB", help="The budget to train under.")
    p.add_argument("--layers", type=int, default=30, help="Blocks of the generated model.")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-seq-length", type=int, default=96)
    p.add_argument("--num-layers", type=int, default=4, help="Blocks that get LoRA adapters.")
    a = p.parse_args(argv)
    spec = modelgen.ModelSpec(
        arch="llama",
        hidden_size=a.hidden_size,
        num_hidden_layers=a.layers,
        intermediate_size=4 * a.hidden_size,
        num_attention_heads=max(1, a.hidden_size // 64),
        num_key_value_heads=max(1, a.hidden_size // 256),
        vocab_size=1024,
        dtype="float32",
        bits=None,
        seed=0,
    )
    model_dir = Path(a.cache_dir) / "models" / f"demo-llama-{spec.key()}"
    t0 = time.perf_counter()
    print(f"Generating (or reusing) a {a.layers}-block Llama with random float32 weights in {model_dir}")
    modelgen.generate_model(model_dir, spec)
    size = modelgen.weight_bytes(model_dir)
    print(f"Model: {format_size(size)} of weights ({time.perf_counter() - t0:.1f}s)")
    args = dict(DEFAULTS)
    args.update(
        model=str(model_dir),
        data=str(modelgen.SAMPLE_DATA),
        train=True,
        iters=a.iters,
        batch_size=a.batch_size,
        max_seq_length=a.max_seq_length,
        num_layers=a.num_layers,
        steps_per_report=1,
        steps_per_eval=10**9,
        val_batches=2,
        save_every=10**9,
        memory_budget=a.memory_budget,
        ssd_cache_dir=str(Path(a.cache_dir) / "swap"),
        adapter_path=str(Path(a.cache_dir) / "demo-adapters"),
        learning_rate=1e-4,
    )
    try:
        res = run(types.SimpleNamespace(**args))
    except BudgetError as e:
        print(f"mlx-pager: {e}", file=sys.stderr)
        return 2
    s = res.pager_stats
    steps = res.steps
    step_s = sorted(x["step_s"] for x in steps)[len(steps) // 2]
    per_step_read = sum(x["bytes_read"] for x in steps[1:]) / max(1, len(steps) - 1)
    print()
    print("What the pager did")
    print(f"  model weights      {format_size(size):>10}   ({size / res.plan.budget:.1f}x the budget)")
    print(f"  memory budget      {format_size(res.plan.budget):>10}   (pages: {format_size(res.plan.page_budget)})")
    within = "within" if res.peak_rss <= res.plan.budget else "OVER"
    print(f"  peak process RSS   {format_size(res.peak_rss):>10}   ({within} budget)")
    print(f"  peak paged memory  {format_size(s['peak_resident_bytes']):>10}")
    print(
        f"  pages read         {s['pages_read']:>10}   ({s['faults']} faults, {s['readahead_hits']} readahead hits, "
        f"{s.get('frames_reused', 0)} into a reused frame)"
    )
    per_step = f"{format_size(per_step_read)} per step after the first"
    busy = sum(x.get("read_busy_s", 0.0) for x in steps)
    if busy > 0:
        # The rate the reads got, and how much of the steps the disk worked:
        # near 100%, the run is bound by the reads.
        rate = sum(x["bytes_read"] for x in steps) / busy
        share = busy / sum(x["step_s"] for x in steps)
        per_step += f"; {format_size(rate)}/s while reading, the disk busy {share:.0%} of the steps"
    print(f"  bytes read         {format_size(s['bytes_read']):>10}   ({per_step})")
    print(f"  step time          {step_s:>9.2f}s   (median; I/O wait {sum(x['io_wait_s'] for x in steps):.2f}s in all)")
    print(f"  loss               {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
    return 0


def make_model_main(argv) -> int:
    from . import modelgen

    p = argparse.ArgumentParser(prog="mlx-pager make-model", description="Write a random-weight test model.")
    p.add_argument("path")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=None)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--bits", type=int, default=None, help="Quantize to this many bits (e.g. 4).")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    spec = modelgen.ModelSpec(
        arch=a.arch,
        hidden_size=a.hidden_size,
        num_hidden_layers=a.layers,
        intermediate_size=a.intermediate_size or 3 * a.hidden_size,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        vocab_size=a.vocab_size,
        dtype=a.dtype,
        bits=a.bits,
        seed=a.seed,
    )
    path = modelgen.generate_model(a.path, spec)
    print(f"{path}: {format_size(modelgen.weight_bytes(path))} of weights")
    return 0


def plot_main(argv) -> int:
    from .plot import __doc__ as plot_doc
    from .plot import plot_report, plot_trace
    from .trace import is_trace

    p = argparse.ArgumentParser(
        prog="mlx-pager plot", description=plot_doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "report", nargs="?", help="A JSON-lines file written by `mlx-pager lora --report FILE` (or a --trace file)."
    )
    p.add_argument("--trace", default=None, help="Draw one step of a file written by `mlx-pager lora --trace FILE`.")
    p.add_argument("--step", type=int, default=None, help="With --trace: the step (iteration) to draw (default: last).")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: the input with .png)")
    p.add_argument("--budget", default=None, help="Draw this memory budget, e.g. 450MB.")
    a = p.parse_args(argv)
    from .budget import parse_size

    trace = a.trace or (a.report if a.report and is_trace(a.report) else None)
    if trace is None and a.report is None:
        p.error("give a --report file or --trace FILE")
    out = a.output or str(Path(trace or a.report).with_suffix(".png"))
    try:
        if trace is not None:
            plot_trace(trace, out, a.step)
        else:
            plot_report(a.report, out, parse_size(a.budget, "--budget") if a.budget else None)
    except (OSError, ValueError) as e:  # BudgetError is a ValueError
        print(f"mlx-pager plot: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _generate_parser() -> argparse.ArgumentParser:
    from mlx_lm.generate import setup_arg_parser

    parser = setup_arg_parser()  # mlx_lm.generate's own flags, help and defaults
    parser.prog = "mlx-pager generate"
    parser.description = "Generate text with the frozen weights paged from the SSD under a memory budget."
    _paging_flags(
        parser, fill_later=False, readahead="Blocks the pager looks ahead to read (default: all blocks; 0 = off)."
    )
    return parser


def generate_main(argv) -> int:
    """mlx_lm.generate's main(), with load_paged in place of mlx_lm.load."""
    import json

    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .generate import ModelNotFound, load_paged

    parser = _generate_parser()
    args = parser.parse_args(argv)
    for flag, why in (
        ("draft_model", "speculative decoding would need a second paged model"),
        ("prompt_cache_file", "saved prompt caches are not read"),
        ("image", "vision inputs are not paged"),
        ("quantize_activations", "activation quantization is not supported"),
    ):
        if getattr(args, flag):
            parser.error(f"--{flag.replace('_', '-')} is not supported by mlx-pager generate: {why}")
    if args.model is None:
        parser.error("no --model given: pass a local mlx-lm model directory or a hub id")
    if args.max_tokens == 0 or args.max_tokens < -1:
        # (mlx-lm's stream_generate raised it, with a traceback, after loading)
        parser.error(f"--max-tokens must be at least 1, or -1 for no limit, not {args.max_tokens}")
    if args.seed is not None:
        mx.random.seed(args.seed)
    try:
        paged, tokenizer = load_paged(
            args.model,
            adapter_path=args.adapter_path,
            memory_budget=args.memory_budget,
            ssd_cache_dir=args.ssd_cache_dir,
            max_kv_tokens=1,
            prefill_step_size=args.prefill_step_size,
            store=args.store,
            policy=args.policy,
            readahead=args.readahead,
            readahead_mode=args.readahead_mode,
            io_threads=args.io_threads,
            page_parts=None if args.page_parts == "auto" else args.page_parts,
            trust_remote_code=args.trust_remote_code,
            measure_read=True,
        )
        for eos_token in args.extra_eos_token:
            tokenizer.add_eos_token(eos_token)
        template_kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}
        prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        prompt = sys.stdin.read() if prompt == "-" else prompt
        use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
        if use_chat_template:
            messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
            messages.append({"role": "user", "content": prompt})
            has_prefill = args.prefill_response is not None
            if has_prefill:
                messages.append({"role": "assistant", "content": args.prefill_response})
            prompt = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                continue_final_message=has_prefill,
                add_generation_prompt=not has_prefill,
                **template_kwargs,
            )
        tokens = tokenizer.encode(prompt, add_special_tokens=not use_chat_template)
        kv_tokens = len(tokens) + max(0, args.max_tokens)
        if args.max_kv_size is not None:
            kv_tokens = min(kv_tokens, args.max_kv_size)
        paged.reserve(kv_tokens)
    except (BudgetError, ModelNotFound, FileNotFoundError, ValueError) as e:
        print(f"mlx-pager: {_message(e, 'mlx_lm.generate')}", file=sys.stderr)
        return 2
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    if args.verbose:
        print("=" * 10)
    text, response = "", None
    try:
        for response in stream_generate(
            paged,
            tokenizer,
            tokens,
            max_tokens=args.max_tokens,
            sampler=sampler,
            max_kv_size=args.max_kv_size,
            prefill_step_size=paged.prefill_chunk,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            quantized_kv_start=args.quantized_kv_start,
        ):
            if args.verbose:
                print(response.text, end="", flush=True)
            text += response.text
    except (BudgetError, NotPageable) as e:
        print(f"\nmlx-pager: {_message(e, 'mlx_lm.generate')}", file=sys.stderr)
        return 2
    if not args.verbose:
        print(text)
        return 0
    print()
    print("=" * 10)
    if response is None:
        print("No text generated for this prompt")
        return 0
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
    s = paged.summary(read_rate=paged.read_rate)
    print(f"Peak memory: {s['peak_rss'] / 1e9:.3f} GB (process RSS; budget {format_size(s['memory_budget'])})")
    print(_pager_line(s))
    return 0


def _pager_line(s: dict) -> str:
    line = f"Pager: weights {format_size(s['paged_bytes'])} paged, page budget {format_size(s['page_budget'])}"
    if s["decode_tokens"]:
        line += (
            f"; decode {1 / max(s['decode_s_per_token'], 1e-9):.3f} tokens-per-sec, "
            f"{format_size(s['decode_bytes_per_token'])} read per token "
            f"(MIN for the budget: {format_size(s['min_bytes_per_token'])})"
        )
    if s["prefill_tokens"]:
        line += f"; prefill {s['prefill_tokens'] / max(s['prefill_s'], 1e-9):.1f} tokens-per-sec"
    if s["decode_tokens"] and s["min_bytes_per_token"] == 0:
        line += "\nBound: every block stays resident (no reads per token): decode is compute-bound"
    elif s.get("bound_s_per_token") is not None and s["decode_tokens"]:
        resident = s["paged_bytes"] - s["min_bytes_per_token"]
        line += (
            f"\nBound: (weights {format_size(s['paged_bytes'])} - resident {format_size(resident)}) / "
            f"R {format_size(s['read_rate'])}/s = {s['bound_s_per_token']:.4f} s/token; "
            f"decode {s['decode_s_per_token']:.4f} s/token = "
            f"{s['decode_s_per_token'] / max(s['bound_s_per_token'], 1e-12):.2f}x the bound"
        )
    return line


COMMANDS = {
    "lora": lora_main,
    "demo": demo_main,
    "generate": generate_main,
    "make-model": make_model_main,
    "plot": plot_main,
}


def version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    from . import __version__

    return f"mlx-pager {__version__} (mlx {v('mlx')}, mlx-lm {v('mlx-lm')})"


def main(argv=None) -> int:
    if argv is None:
        from .blas import reexec_with_openblas

        reexec_with_openblas()  # Linux CPU: MLX's bundled BLAS is ~10x slower
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
