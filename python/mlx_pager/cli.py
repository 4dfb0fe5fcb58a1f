"""The mlx-pager command line.

  mlx-pager lora ...      drop-in for mlx_lm.lora (same flags and defaults)
                          plus --memory-budget and --ssd-cache-dir
  mlx-pager demo          the offline main job: generate (once) a model several
                          times larger than the budget, train it under that
                          budget on the shipped sample data, print what the
                          pager did
  mlx-pager generate DIR  write a small random-weight test model
  mlx-pager plot FILE     a PNG of a --report file (memory by component, I/O)
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

from .budget import BudgetError, format_size


def _lora_parser() -> argparse.ArgumentParser:
    from mlx_lm.lora import build_parser

    parser = build_parser()  # mlx_lm.lora's own flags, help and choices
    parser.prog = "mlx-pager lora"
    parser.description = "LoRA or DoRA fine-tuning with the frozen weights paged from the SSD."
    g = parser.add_argument_group("mlx-pager")
    g.add_argument("--memory-budget", type=str, default=None,
                   help="Memory the whole process may use, e.g. 12GB or 900MiB (default: 80%% of RAM).")
    g.add_argument("--ssd-cache-dir", type=str, default=None,
                   help="Where the pager writes swap files when a model's weights cannot be read in place.")
    g.add_argument("--store", choices=["auto", "in_place", "swap"], default=None,
                   help="Read pages from the model's files (in_place), a swap file, or decide per page (auto).")
    g.add_argument("--policy", choices=["optimal", "lru"], default=None,
                   help="Eviction policy (default: optimal, which knows the step's access order).")
    g.add_argument("--readahead", type=int, default=None, help="Blocks to read ahead (default 2; 0 = off).")
    g.add_argument("--readahead-mode", choices=["conservative", "aggressive"], default=None,
                   help="conservative: never more reads than Belady's minimum; aggressive: may read "
                        "more to overlap reads with compute when the budget is small.")
    g.add_argument("--io-threads", type=int, default=None, help="I/O threads (default 4).")
    g.add_argument("--report", type=str, default=None, help="Append per-step statistics to this JSON-lines file.")
    return parser


def lora_main(argv) -> int:
    import yaml
    from mlx_lm.lora import yaml_loader

    from .trainer import DEFAULTS, run

    parser = _lora_parser()
    args = vars(parser.parse_args(argv))
    config = args.pop("config", None)
    if config:
        with open(config) as f:
            for k, v in yaml.load(f, yaml_loader).items():
                if args.get(k) is None:
                    args[k] = v
    unsupported = {
        "grad_checkpoint": "blocks are always checkpointed and recomputed",
        "clear_cache_threshold": "the memory governor manages MLX's cache",
    }
    for k, why in unsupported.items():
        if args.get(k):
            print(f"note: --{k.replace('_', '-')} is not needed with mlx-pager: {why}", file=sys.stderr)
        args.pop(k, None)
    if args.pop("report_to", None):
        print("note: --report-to is not supported; use --report FILE for JSON lines", file=sys.stderr)
    args.pop("project_name", None)
    for k, v in DEFAULTS.items():
        if args.get(k) is None:
            args[k] = v
    if not args["train"] and not args["test"]:
        parser.error("must provide at least one of --train or --test")
    if not args["train"]:
        parser.error("mlx-pager trains; use mlx_lm.lora --test to evaluate saved adapters")
    try:
        run(types.SimpleNamespace(**args))
    except BudgetError as e:
        print(f"mlx-pager: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"mlx-pager: {e}", file=sys.stderr)
        return 2
    return 0


def demo_main(argv) -> int:
    """Generates (once) a float32 Llama several times larger than the memory
    budget and LoRA-trains it under that budget on the shipped sample data."""
    from . import modelgen
    from .trainer import DEFAULTS, run

    p = argparse.ArgumentParser(prog="mlx-pager demo", description=demo_main.__doc__)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "mlx-pager"),
                   help="Where the generated model and swap files are kept.")
    p.add_argument("--memory-budget", default="450MB", help="The budget to train under.")
    p.add_argument("--layers", type=int, default=30, help="Blocks of the generated model.")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-seq-length", type=int, default=96)
    p.add_argument("--num-layers", type=int, default=4, help="Blocks that get LoRA adapters.")
    a = p.parse_args(argv)
    spec = modelgen.ModelSpec(
        arch="llama", hidden_size=a.hidden_size, num_hidden_layers=a.layers,
        intermediate_size=4 * a.hidden_size, num_attention_heads=max(1, a.hidden_size // 64),
        num_key_value_heads=max(1, a.hidden_size // 256), vocab_size=1024, dtype="float32",
        bits=None, seed=0,
    )
    model_dir = Path(a.cache_dir) / "models" / f"demo-llama-{spec.key()}"
    t0 = time.perf_counter()
    print(f"Generating (or reusing) a {a.layers}-block Llama with random float32 weights in {model_dir}")
    modelgen.generate_model(model_dir, spec)
    size = modelgen.weight_bytes(model_dir)
    print(f"Model: {format_size(size)} of weights ({time.perf_counter() - t0:.1f}s)")
    args = dict(DEFAULTS)
    args.update(
        model=str(model_dir), data=str(modelgen.SAMPLE_DATA), train=True, iters=a.iters,
        batch_size=a.batch_size, max_seq_length=a.max_seq_length, num_layers=a.num_layers,
        steps_per_report=1, steps_per_eval=10**9, val_batches=2, save_every=10**9,
        memory_budget=a.memory_budget, ssd_cache_dir=str(Path(a.cache_dir) / "swap"),
        adapter_path=str(Path(a.cache_dir) / "demo-adapters"), learning_rate=1e-4,
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
    print(f"  peak process RSS   {format_size(res.peak_rss):>10}   ({'within' if res.peak_rss <= res.plan.budget else 'OVER'} budget)")
    print(f"  peak paged memory  {format_size(s['peak_resident_bytes']):>10}")
    print(f"  pages read         {s['pages_read']:>10}   ({s['faults']} faults, {s['readahead_hits']} readahead hits)")
    print(f"  bytes read         {format_size(s['bytes_read']):>10}   ({format_size(per_step_read)} per step after the first)")
    print(f"  step time          {step_s:>9.2f}s   (median; I/O wait {sum(x['io_wait_s'] for x in steps):.2f}s in all)")
    print(f"  loss               {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
    return 0


def generate_main(argv) -> int:
    from . import modelgen

    p = argparse.ArgumentParser(prog="mlx-pager generate", description="Write a random-weight test model.")
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
        arch=a.arch, hidden_size=a.hidden_size, num_hidden_layers=a.layers,
        intermediate_size=a.intermediate_size or 3 * a.hidden_size, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, vocab_size=a.vocab_size, dtype=a.dtype, bits=a.bits, seed=a.seed,
    )
    path = modelgen.generate_model(a.path, spec)
    print(f"{path}: {format_size(modelgen.weight_bytes(path))} of weights")
    return 0


def plot_main(argv) -> int:
    from .plot import plot_report

    p = argparse.ArgumentParser(prog="mlx-pager plot", description="Plot a --report file as a PNG.")
    p.add_argument("report")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: REPORT with .png)")
    p.add_argument("--budget", default=None, help="Draw this memory budget, e.g. 450MB.")
    a = p.parse_args(argv)
    from .budget import parse_size

    out = a.output or str(Path(a.report).with_suffix(".png"))
    plot_report(a.report, out, parse_size(a.budget) if a.budget else None)
    print(out)
    return 0


COMMANDS = {"lora": lora_main, "demo": demo_main, "generate": generate_main, "plot": plot_main}


def main(argv=None) -> int:
    if argv is None:
        from .blas import reexec_with_openblas

        reexec_with_openblas()  # Linux CPU: MLX's bundled BLAS is ~10x slower
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
