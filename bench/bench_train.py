"""Training benchmarks against the anchors, side by side in one run.

    python bench/bench_train.py [--out bench_out] [--steps 5] [--shapes compute,read]

For each model shape, on the same generated model, data, batch and sequence
length, each configuration in its own process (so peak RSS is its own):

  mlx-lm           mlx_lm.lora's trainer, fully resident
  mlx-lm+ckpt      the same with --grad-checkpoint
  pager @mlx-lm    mlx-pager with a memory budget of resident mlx-lm's own
                   peak RSS (+5%): where no block needs recomputing
  pager 100..10%   mlx-pager with a page budget of 100/50/25/10% of the paged
                   weights (plus the fixed part: process, resident page,
                   adapters, activations); conservative readahead (MIN reads)
  aggr 50..10%     the same with aggressive readahead (more reads, more overlap)
  naive            layer streaming (the AirLLM approach) through the same code
                   with paging features off: a one-page budget, no readahead,
                   every block read synchronously when used
  bound            max(Belady-minimum bytes / R, resident compute): R measured
                   with dd iflag=direct on the same files in the same run,
                   compute from the resident mlx-lm step

Reports tokens/s, step time (median after the first step), peak RSS and MLX
peak, bytes read per step and their ratio to Belady's minimum, I/O wait, and
the ratio to the bound; writes results.json and results.png to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path

from benchlib import dd_rate, run_worker

HERE = Path(__file__).resolve().parent

SHAPES = {
    # Long sequences, narrow layers: compute per block dwarfs its read.
    "compute": dict(
        spec=dict(
            hidden_size=512, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=8
        ),
        batch_size=2,
        seq_len=512,
        num_layers=8,
    ),
    # Short sequences, wide layers: reading a block takes longer than using it.
    "read": dict(
        spec=dict(
            hidden_size=2048,
            num_hidden_layers=8,
            intermediate_size=5632,
            num_attention_heads=16,
            num_key_value_heads=16,
        ),
        batch_size=1,
        seq_len=16,
        num_layers=4,
    ),
}
FRACTIONS = [1.0, 0.5, 0.25, 0.1]


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def make_data(d: Path, seq_len: int, n: int = 16) -> Path:
    """Records about `seq_len` tokens long, built from the sample data."""
    from mlx_pager.modelgen import SAMPLE_DATA

    texts = [json.loads(l)["text"] for l in (SAMPLE_DATA / "train.jsonl").read_text().splitlines()]
    words_per_record = max(4, int(seq_len * 0.8))  # ~1.2 tokens per word here
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "train.jsonl", "w") as f:
        i = 0
        for _ in range(n):
            words = []
            while len(words) < words_per_record:
                words.extend(texts[i % len(texts)].split())
                i += 1
            f.write(json.dumps({"text": " ".join(words[:words_per_record])}) + "\n")
    return d


# ----------------------------------------------------------------- workers --
def worker(cfg: dict) -> dict:
    if cfg["kind"] == "mlx-lm":
        return worker_mlx_lm(cfg)
    return worker_pager(cfg)


def common_args(cfg):
    return dict(
        model=cfg["model"],
        data=cfg["data"],
        train=True,
        iters=cfg["steps"],
        batch_size=cfg["batch_size"],
        max_seq_length=cfg["seq_len"],
        num_layers=cfg["num_layers"],
        steps_per_report=1,
        steps_per_eval=10**9,
        save_every=10**9,
        val_batches=1,
        seed=0,
        learning_rate=1e-5,
        adapter_path=cfg["adapter_path"],
    )


def worker_mlx_lm(cfg):
    import mlx_lm
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import load_dataset

    args = dict(CONFIG_DEFAULTS, **common_args(cfg), grad_checkpoint=cfg["grad_checkpoint"])
    args = types.SimpleNamespace(**args)
    model, tok = mlx_lm.load(cfg["model"])
    train, valid, _ = load_dataset(args, tok)
    reports = []

    class CB(TrainingCallback):
        def on_train_loss_report(self, info):
            reports.append(dict(info, t=time.perf_counter()))

    train_model(args, model, train, valid, CB())
    steps = [
        {"step_s": 1 / r["iterations_per_second"], "tokens_per_s": r["tokens_per_second"], "loss": r["train_loss"]}
        for r in reports
    ]
    return {"steps": steps, "peak_rss": vm_hwm(), "mlx_peak": max(r["peak_memory"] for r in reports) * 1e9}


def worker_pager(cfg):
    from mlx_pager.trainer import DEFAULTS, run

    report = Path(cfg["adapter_path"]) / "report.jsonl"
    report.parent.mkdir(parents=True, exist_ok=True)
    if report.exists():
        report.unlink()
    args = dict(
        DEFAULTS,
        **common_args(cfg),
        page_budget=cfg["page_budget"],
        memory_budget=cfg.get("memory_budget"),
        readahead=cfg["readahead"],
        policy=cfg["policy"],
        report=str(report),
        quiet=True,
        ssd_cache_dir=cfg["cache"],
        readahead_mode=cfg.get("readahead_mode", "conservative"),
    )
    res = run(types.SimpleNamespace(**args))
    steps = [
        {
            "step_s": s["step_s"],
            "tokens_per_s": s["tokens"] / s["step_s"],
            "loss": s["loss"],
            "bytes_read": s["bytes_read"],
            "io_wait_s": s["io_wait_s"],
            "pages_read": s["pages_read"],
            "mlx_peak": s["mlx_peak_bytes"],
        }
        for s in res.steps
    ]
    p = res.plan
    return {
        "steps": steps,
        "peak_rss": vm_hwm(),
        "mlx_peak": max(s["mlx_peak"] for s in steps),
        "budget": p.budget,
        "page_budget": p.page_budget,
        "page_footprint": p.max_page,
        "page_footprints": res.page_footprints,
        "report": str(report),
        "governor": res.governor_events,
    }


# ------------------------------------------------------------- orchestrator --
def belady_per_step(num_blocks, first, footprints, budget, steps=8):
    """Pages MIN reads per step in steady state, pages charged their own
    footprints against a byte budget (evict furthest next use until the
    page fits), as the pager charges them."""
    seq_one = list(range(num_blocks)) + list(range(num_blocks - 1, first - 1, -1))

    def loads(seq):
        nxt, last = [0] * len(seq), {}
        for t in range(len(seq) - 1, -1, -1):
            nxt[t] = last.get(seq[t], 10**9 + t)
            last[seq[t]] = t
        cache, used, n = {}, 0, 0
        for t, pg in enumerate(seq):
            if pg not in cache:
                n += 1
                while cache and used + footprints[pg] > budget:
                    victim = max(cache, key=cache.get)
                    used -= footprints[victim]
                    del cache[victim]
                used += footprints[pg]
            cache[pg] = nxt[t]
        return n

    return loads(seq_one * steps) - loads(seq_one * (steps - 1))


def median_after_first(xs):
    xs = xs[1:] if len(xs) > 1 else xs
    return statistics.median(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "mlx-pager"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--shapes", default="compute,read")
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))))
        return
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in a.shapes.split(","):
        summary[name] = bench_one(name, SHAPES[name], a, out_dir)
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out_dir / "results.png")
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'results.png'}")


def bench_one(name, shape, a, out_dir):
    from mlx_pager import modelgen

    spec = modelgen.ModelSpec(arch="llama", vocab_size=1024, dtype="float32", bits=None, seed=0, **shape["spec"])
    model = modelgen.generate_model(Path(a.cache) / f"bench-{name}-{spec.key()}", spec)
    data = make_data(out_dir / f"data-{name}", shape["seq_len"])
    files = sorted(model.glob("model*.safetensors"))
    W = modelgen.weight_bytes(model)
    L = shape["spec"]["num_hidden_layers"]
    first = L - shape["num_layers"]
    base = dict(
        model=str(model),
        data=str(data),
        steps=a.steps,
        batch_size=shape["batch_size"],
        seq_len=shape["seq_len"],
        num_layers=shape["num_layers"],
        cache=str(out_dir / "swap"),
    )
    print(
        f"\n== shape '{name}': {L} blocks, {W / 1e9:.2f}GB float32 weights, batch "
        f"{shape['batch_size']} x {shape['seq_len']} tokens, LoRA on the last {shape['num_layers']} blocks",
        flush=True,
    )
    R = [dd_rate(files)]
    results = {}

    def go(cfg_name, **kw):
        cfg = dict(base, name=cfg_name, adapter_path=str(out_dir / f"ad-{name}-{cfg_name.replace(' ', '_')}"), **kw)
        t = time.perf_counter()
        results[cfg_name] = run_worker(__file__, cfg)
        print(f"   {cfg_name:<12} ran in {time.perf_counter() - t:5.1f}s", flush=True)

    go("mlx-lm", kind="mlx-lm", grad_checkpoint=False)
    go("mlx-lm+ckpt", kind="mlx-lm", grad_checkpoint=True)
    # The budget resident mlx-lm itself needed (its peak RSS, +5%): where the
    # no-recompute tail segment can hold every trained block.
    go(
        "pager @mlx-lm",
        kind="pager",
        page_budget=None,
        memory_budget=str(int(1.05 * results["mlx-lm"]["peak_rss"])),
        readahead=4,
        policy="optimal",
    )
    paged = W  # page budgets are fractions of the paged weights
    footprint = None
    for f in FRACTIONS:
        # 100%: every page fits (page frames carry a little alignment slack).
        # Never below one page: a budget must hold the block in use.
        budget = int(1.1 * paged) if f == 1 else max(int(f * paged), footprint)
        go(f"pager {int(f * 100)}%", kind="pager", page_budget=budget, readahead=4, policy="optimal")
        footprint = results[f"pager {int(f * 100)}%"]["page_footprint"]
    R.append(dd_rate(files))
    for f in FRACTIONS[1:]:
        budget = max(int(f * paged), footprint)
        go(
            f"aggr {int(f * 100)}%",
            kind="pager",
            page_budget=budget,
            readahead=4,
            policy="optimal",
            readahead_mode="aggressive",
        )
    go("naive", kind="pager", page_budget=footprint, readahead=0, policy="lru")
    R.append(dd_rate(files))
    R_med = statistics.median(R)

    compute = median_after_first([s["step_s"] for s in results["mlx-lm"]["steps"]])
    resident_tps = median_after_first([s["tokens_per_s"] for s in results["mlx-lm"]["steps"]])
    rows = []
    naive_tps = median_after_first([s["tokens_per_s"] for s in results["naive"]["steps"]])
    for cfg_name, r in results.items():
        st = median_after_first([s["step_s"] for s in r["steps"]])
        tps = median_after_first([s["tokens_per_s"] for s in r["steps"]])
        row = {
            "config": cfg_name,
            "step_s": st,
            "tokens_per_s": tps,
            "peak_rss": r["peak_rss"],
            "mlx_peak": r["mlx_peak"],
            "vs_resident": tps / resident_tps,
        }
        if "page_budget" in r:
            # Pages differ a little in size (in-place pages read through small
            # gaps), so MIN is counted in pages and priced at the mean page read.
            k = r["page_budget"] / r["page_footprint"]
            min_pages = belady_per_step(L, first, r["page_footprints"], r["page_budget"])
            pages_step = median_after_first([s["pages_read"] for s in r["steps"]])
            bytes_step = median_after_first([s["bytes_read"] for s in r["steps"]])
            total_pages = sum(s["pages_read"] for s in r["steps"])
            page_read = sum(s["bytes_read"] for s in r["steps"]) / total_pages if total_pages else 0
            io = median_after_first([s["io_wait_s"] for s in r["steps"]])
            bound = max(min_pages * page_read / R_med, compute)
            row.update(
                budget=r["budget"],
                page_budget=r["page_budget"],
                k_pages=round(k, 2),
                pages_per_step=pages_step,
                belady_pages=min_pages,
                bytes_per_step=bytes_step,
                belady_bytes=min_pages * page_read,
                vs_belady=pages_step / min_pages if min_pages else (1.0 if pages_step == 0 else float("inf")),
                io_wait_s=io,
                bound_s=bound,
                vs_bound=st / bound,
                vs_naive=tps / naive_tps,
                report=r.get("report"),
            )
        rows.append(row)

    print(f"   disk (dd iflag=direct): {R_med / 1e9:.2f} GB/s; resident compute {compute:.2f}s/step")
    hdr = (
        f"   {'config':<12} {'step s':>7} {'tok/s':>8} {'vs res':>6} {'peak RSS':>9} {'MLX peak':>9} "
        f"{'GB/step':>8} {'vs MIN':>6} {'I/O s':>6} {'bound s':>7} {'vs bnd':>6} {'vs naive':>8}"
    )
    print(hdr)
    for row in rows:
        line = (
            f"   {row['config']:<12} {row['step_s']:>7.2f} {row['tokens_per_s']:>8.1f} "
            f"{row['vs_resident']:>6.2f} {row['peak_rss'] / 1e9:>8.2f}G {row['mlx_peak'] / 1e9:>8.2f}G"
        )
        if "bound_s" in row:
            line += (
                f" {row['bytes_per_step'] / 1e9:>8.2f} {row['vs_belady']:>6.2f} {row['io_wait_s']:>6.2f} "
                f"{row['bound_s']:>7.2f} {row['vs_bound']:>6.2f} {row['vs_naive']:>8.2f}"
            )
        print(line)
    return {
        "weights_bytes": W,
        "blocks": L,
        "first_trained": first,
        "disk_Bps": R_med,
        "disk_samples": R,
        "resident_step_s": compute,
        "shape": shape,
        "rows": rows,
    }


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlx_pager.plot import load_report

    shapes = list(summary)
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False, constrained_layout=True)
    for j, name in enumerate(shapes):
        s = summary[name]
        pager_rows = [r for r in s["rows"] if r["config"].startswith("pager")]
        aggr_rows = [r for r in s["rows"] if r["config"].startswith("aggr")]
        x = [r["page_budget"] / s["weights_bytes"] * 100 for r in pager_rows]
        ax = axes[0][j]
        ax.plot(x, [r["step_s"] for r in pager_rows], "o-", label="mlx-pager step time")
        ax.plot(
            [r["page_budget"] / s["weights_bytes"] * 100 for r in aggr_rows],
            [r["step_s"] for r in aggr_rows],
            "^-",
            label="mlx-pager, aggressive readahead",
        )
        ax.plot(x, [r["bound_s"] for r in pager_rows], "k--", label="lower bound")
        for r in s["rows"]:
            if not r["config"].startswith(("pager", "aggr")):
                ax.axhline(
                    r["step_s"],
                    ls=":",
                    lw=1,
                    label=f"{r['config']} step time",
                    color={"mlx-lm": "g", "mlx-lm+ckpt": "c", "naive": "r"}[r["config"]],
                )
        ax.set_xlabel("page budget, % of weights")
        ax.set_ylabel("seconds per step")
        ax2 = ax.twinx()
        ax2.plot(x, [r["peak_rss"] / 1e9 for r in pager_rows], "s-", color="tab:orange", label="peak RSS")
        ax2.axhline(s["rows"][0]["peak_rss"] / 1e9, color="tab:orange", ls=":", lw=1, label="mlx-lm peak RSS")
        ax2.set_ylabel("GB (peak RSS)")
        ax.set_title(f"shape '{name}': step time and peak memory vs budget")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
        # memory by component over one step of the 25% run
        row = next((r for r in pager_rows if r["config"] == "pager 25%"), pager_rows[-1])
        blocks, steps = load_report(row["report"])
        ax = axes[1][j]
        if len(steps) >= 2:
            # the last full step: block records between the last two step ends
            [b["t"] for b in blocks]
            n_per = len(blocks) // max(1, len(steps))
            one = blocks[-n_per:]
            t0 = one[0]["t"]
            t = [b["t"] - t0 for b in one]
            mb = 1e6
            pinned = [b["pinned_bytes"] / mb for b in one]
            pages = [b["pages_bytes"] / mb for b in one]
            other = [max(0, b["mlx_active_bytes"] - b["pinned_bytes"] - b["pages_bytes"]) / mb for b in one]
            cache = [b["mlx_cache_bytes"] / mb for b in one]
            rest = [
                max(0, b["rss_bytes"] / mb - p - q - o - c) for b, p, q, o, c in zip(one, pinned, pages, other, cache)
            ]
            ax.stackplot(
                t,
                pinned,
                pages,
                other,
                cache,
                rest,
                labels=["pinned page", "block pages", "other MLX", "MLX cache", "rest of process"],
            )
            ax.axhline(row["budget"] / mb, color="r", ls="--", lw=1, label="budget")
            ax.set_xlabel("seconds into the step")
            ax.set_ylabel("MB")
            ax.legend(fontsize=7, loc="upper left")
        ax.set_title(f"'{name}', 25% budget: memory by component over one step")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
