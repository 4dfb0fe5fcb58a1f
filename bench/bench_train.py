"""Training benchmarks against the anchors, side by side in one run.

    python bench/bench_train.py [--out bench_out] [--steps 5] [--shapes compute,read,q4]
                                [--configs mlx-lm,pager 25%,naive] [--ab-env NAME=VALUE] [--trace]

For each model shape, on the same generated model, data, batch and sequence
length, each configuration in its own process (so peak RSS is its own):

  mlx-lm           mlx_lm.lora's trainer, fully resident (skipped, and said
                   so, where the weights do not fit in memory)
  mlx-lm+ckpt      the same with --grad-checkpoint
  pager @mlx-lm    mlx-pager with a memory budget of resident mlx-lm's own
                   peak RSS (+5%): where no block needs recomputing
  pager 100..10%   mlx-pager with a page budget of 100/50/25/10% of the paged
                   weights (plus the fixed part: process, resident page,
                   adapters, and the activations of the no-recompute
                   placement, whose tail streams its pages, measured at
                   start-up), run as a user runs it: no --readahead (the
                   trainer's own choice, simulate.AutoReadahead, from its
                   second step's measured compute and the disk's rate; a
                   step more than the other rows, and figures from the
                   steps that ran its choice), --page-parts auto
                   (a block is one page where the page budget holds 2
                   blocks or more, in parts below)
  cons 50..10%     the same at a fixed readahead: 4 blocks, conservative
                   (MIN reads)
  aggr 50..10%     4 blocks, aggressive (more reads, more overlap)
  whole / parts    the other choice of --page-parts auto beside the 'pager'
                   row: 'whole X%' where it paged blocks in parts, 'parts X%'
                   (~48 MB each) where it paged large blocks whole
  naive            layer streaming (the AirLLM approach) through the same code
                   with paging features off: a one-page budget, no readahead,
                   whole blocks, LRU, every block read synchronously when
                   used, every trained block checkpointed and recomputed
                   (--grad-checkpoint: a streamer cannot keep a block's
                   weights from its forward to its backward); `vs naive`
                   is against it
  naive keep       the same with the planner's no-recompute tail (its
                   frozen weights read again where the backward uses them,
                   stream.py): what the streamed tail alone gives
  pager X% again   each 'pager' row run again, in reverse order, after the
                   others (and before 'mlx-lm again'): the machine drifts
                   during a run and the disk has fast and slow periods
                   minutes long, so one run's ratio moves by up to ~30%.
                   Under the table, each ratio of both runs and their mean:
                   the figure to read a target from
  env X%, again    with --ab-env NAME=VALUE: each 'pager X%' row again with
                   those environment variables, right after it and right
                   before its 'again' (A B ... B A); under the table, the
                   mean step with them over without, per budget (e.g.
                   OPENBLAS_THREAD_TIMEOUT=4, which helped on one VM and
                   hurt on another: decide per machine)
  mlx-lm pair i,   resident and nothing paged side by side, PAIRS times, last,
  pager 100% pair i   each pair's two processes in lockstep for PAIR_STEPS
                   steps (benchlib.run_lockstep: one step each in turn,
                   never at once; the pair before's second first): under the
                   table, per step, the pager's tokens/s over mlx-lm's on the
                   same batch right before or after it, each pair's median
                   and the median of all steps (a step here moves by up to
                   +-20% from the next, runs by up to 1.4x within minutes)
  bound            max(Belady-minimum bytes / R, compute), compute the lesser
                   of resident mlx-lm's step and the row's own compute (its
                   step less the pager's waits: the pager's step can be
                   faster than mlx-lm's, never faster than its own compute)

R is the device's best direct-read rate at the pager's own I/O shape
(benchlib.read_rate: page-sized O_DIRECT reads, chunks over several I/O
threads, the best of a few thread x chunk settings), measured on the same
files in the same run. The volume has fast and slow periods minutes long, so
each pager row has its own R ("R GB/s"): every setting sampled right before
and right after the row, and the mean of the two at the shape's best setting
(the highest mean over all the shape's samples, not each row's luckiest), or, where
higher, the rate the row's own reads got (its bytes read over the time a
read was in flight, the pager's read_busy_s, in the steps its figures come
from: the device delivered at least that), never above the shape's R: the
best of three longer measurements or of any row's reads. "vs bnd" is against the
row's bound, "vs best" against the bound at the shape's R. One `dd
iflag=direct` stream is printed beside it. Compute is shown twice: resident (mlx-lm) and
with recompute (mlx-lm --grad-checkpoint; per pager row, "comp s": with the
plan's recompute). A row faster than 0.98x its bound is a measurement bug,
not a win: the bench says which and exits 1.

Each pager row also shows the step time the simulator (mlx_pager.simulate)
predicts for it ("pred s"): the row's schedule and per-block compute (each
block's time less the pager's waits, from on_block), its budget and
readahead settings, and the rate the row's reads got (bytes over
read_busy_s, in the same steps).

The bound assumes the disk never idles, which the budget can forbid: while
every page in memory is still wanted before the next read's, no read can
start. Every pager row shows the bound with the room counted ("room s":
mlx_pager.bound.room_bound, the optimum of a linear program every schedule
of the row's accesses under its budget at R satisfies, or the bound where
higher; no schedule of the plan is faster), and "vs room", the step
against it. A row whose blocks are whole pages also shows the fastest step
any eviction schedule gets under its budget at R ("opt s":
simulate.offline_best, a search over what to evict for every read and
when, with the row's per-block compute), and "vs opt", the step against it.
Where blocks are in parts (up to OPT_PARTS_MAX_PAGES pages), "opt s" is the
fastest schedule the search finds, not the fastest there is.
The search runs the simulator's model of disk and compute, so a row under
1.00x there shows where that model is off, as "pred s" does. Where that
fastest schedule reads more than the bytes target lets the pager (1.10x
MIN's bytes, simulate.DEFAULT_EXTRA_READS), the two-runs line also gives the
fastest schedule the search finds within it ("opt<=cap", offline_best's
max_bytes), and the step-time target is read against both.

Shapes (--shapes; `big` is opt-in):
  compute   long sequences, narrow layers: compute per block dwarfs its read
  read      short sequences, wide layers: reading a block takes longer than using it
  q4        4-bit weights (QLoRA, how Mac users train), short sequences; at
            100/25/10% only (a CPU computes 4-bit blocks slowly)
  big       >= 8 GB of float32 weights in 20 wide blocks, at 100%, 25%, 15% and
            10% (weights >= 6x the page budget at the last two); R on the same
            files; the lockstep pairs where the machine holds both rows' peaks

--configs NAME,...: only the configurations whose names start with one of
the NAMEs (e.g. `pager 25%,naive`); rows that need another row's figures
(`pager @mlx-lm` needs mlx-lm's peak, `whole`/`parts` and `again` their
`pager` row) are skipped without them.

--trace: each pager row also writes its run's timeline (the trainer's
--trace, Chrome trace JSON that https://ui.perfetto.dev opens) to
OUT/trace-SHAPE-ROW.json: which reads each acquire waited for, and
whether the disk was busy meanwhile.

Last, the issue's targets, each with this run's figure and whether it was met
(targets.py; also written to targets.json).

Reports tokens/s, step time (median after the first step; for 'pager' rows
of the steps that ran the trainer's readahead choice) beside the
predicted one, peak RSS and MLX peak, bytes read per step and their ratio to
Belady's minimum, I/O wait, and the ratio to the bound; writes results.json
and results.png to --out, and for each shape raw-SHAPE.json: every row's
figures as its worker returned them (per-step records, on_block marks, page
sizes, settings) and the shape's R, from which a later look can simulate a
row again (measured_accesses, pager_figures) without running it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import targets
from benchlib import READ_SETTINGS, Lockstep, cpu_steal_s, dd_rate, read_rate, run_lockstep, run_worker

HERE = Path(__file__).resolve().parent
PAIRS = 3  # (resident, pager 100%) pairs in lockstep per shape
# Steps each pair's rows run (a 'pager' row's one more): one step's ratio to
# the other row's step beside it moves by up to +-20% here (measured: 0.79 to
# 1.12x over 27 steps), so many more than a row's: 3 x 20 steps put the
# median within ~1% (the bootstrap interval printed beside it).
PAIR_STEPS = 20

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
    # QLoRA: 4-bit weights. float32 scales and activations: MLX's CPU
    # quantized matmul is ~40x slower in bf16/f16 (on a Mac, bf16 as
    # mlx-community models ship). Compute-bound on a CPU at any size
    # (~14 ns of compute per weight per 16 tokens against ~0.4 ns of read),
    # so kept small, with fewer rows.
    "q4": dict(
        spec=dict(
            hidden_size=1024,
            num_hidden_layers=8,
            intermediate_size=2816,
            num_attention_heads=16,
            num_key_value_heads=16,
            bits=4,
        ),
        batch_size=1,
        seq_len=16,
        num_layers=4,
        fractions=[1.0, 0.25, 0.1],
        aggressive=False,
    ),
    # >= 8 GB: 20 blocks of 453 MB, at page budgets of 25%, 15% and 10%
    # (5, 3 and 2 blocks; the last two hold at most 1/6 of the weights), and
    # nothing paged: in lockstep with resident mlx-lm where both fit at once
    # (2 x 9.3 GB on a 24 GB machine).
    "big": dict(
        spec=dict(
            hidden_size=3072,
            num_hidden_layers=20,
            intermediate_size=8192,
            num_attention_heads=24,
            num_key_value_heads=24,
            shard_bytes=1 << 30,
        ),
        batch_size=1,
        seq_len=16,
        num_layers=4,
        fractions=[1.0, 0.25, 0.15, 0.1],
        aggressive=False,
    ),
    # Long sequences (issue 8): batches of 4 x 1024 tokens, whose activations
    # (attention scores alone: 4 rows x 8 heads x 1024^2 floats, several
    # copies a block) are what does not fit. Rows: resident mlx-lm (the
    # footprint and the speed to compare with), mlx-lm --grad-checkpoint (the
    # adapters to compare with), and mlx-pager at `budget` under a hard
    # cgroup cap of the same size, where the earlier planner refused the run
    # (its fixed estimate needed ~1.5 GB). A budget of 25% of these weights
    # (~0.1 GB) is below what the process itself needs before any weight.
    "long": dict(
        spec=dict(
            hidden_size=1024, num_hidden_layers=8, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8
        ),
        batch_size=4,
        seq_len=1024,
        num_layers=4,
        fractions=[],
        aggressive=False,
        naive=False,
        at_mlx_lm=False,
        capped_budget=680_000_000,
        steps=3,
    ),
}
DEFAULT_SHAPES = "compute,read,q4,long"
FRACTIONS = [1.0, 0.5, 0.25, 0.1]
# A step measured faster than this fraction of its bound is a measurement bug.
BOUND_SLACK = 0.98
# Beam width of the offline optimum ("opt s"); 4x wider found the same.
OPT_WIDTH = 500
# Blocks in parts: "opt s" is the fastest schedule the beam finds, not the
# fastest there is (victims combine, and the beam cuts). Up to this many
# pages it finds schedules no slower than the pager's own in the simulator
# (read shape, 32 pages, window of 8 steps: at 25% 1.05x the bound against
# the pager's predicted 1.07x, 34 s; at 10% 1.03x against 1.04x, 3 s); at
# 120 (the big shape at 10%) the beam found one 1.10x slower than the
# pager's prediction, in 224 s.
OPT_PARTS_MAX_PAGES = 48
IO_THREADS = 4  # the trainer's default --io-threads
NEAR_SAMPLE_S = 0.5  # seconds per setting of the disk samples around each pager row


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
    import numpy as np
    from mlx_lm.lora import CONFIG_DEFAULTS, train_model
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import load_dataset

    args = dict(CONFIG_DEFAULTS, **common_args(cfg), grad_checkpoint=cfg["grad_checkpoint"])
    args = types.SimpleNamespace(**args)
    # Seeded as mlx_lm.lora's run() seeds (train_model alone does not): the
    # adapters' initial values (MLX's generator) and the batch order
    # (NumPy's), so that a row's adapters can be compared with mlx-pager's.
    np.random.seed(args.seed)
    model, tok = mlx_lm.load(cfg["model"])
    train, valid, _ = load_dataset(args, tok)
    reports = []
    lock = Lockstep.from_cfg(cfg)
    steal = [cpu_steal_s()]  # at the last report: each step's steal is from there

    class CB(TrainingCallback):
        # In lockstep (run_lockstep): the token is taken after the first
        # validation (mlx-lm's train loop has no hook before it) and passed
        # on after each step's report, outside the step's timing.
        def on_val_loss_report(self, info):
            if lock:
                lock.acquire()
            steal[0] = cpu_steal_s()

        def on_train_loss_report(self, info):
            now = cpu_steal_s()
            reports.append(dict(info, t=time.perf_counter(), steal_s=None if now is None else now - steal[0]))
            steal[0] = now
            if lock:
                lock.turn()

    train_model(args, model, train, valid, CB())
    steps = [
        {"step_s": 1 / r["iterations_per_second"], "tokens_per_s": r["tokens_per_second"], "loss": r["train_loss"]}
        | ({} if r["steal_s"] is None else {"steal_s": r["steal_s"]})
        for r in reports
    ]
    return {"steps": steps, "peak_rss": vm_hwm(), "mlx_peak": max(r["peak_memory"] for r in reports) * 1e9}


def step_marks_callback(lock: Lockstep = None):
    """A PagerCallback that keeps, per optimizer step, when it began and
    ended and when each block's pages were released, each with the pager's
    cumulative waits (io_wait_s + reclaim_wait_s): what simulate needs for
    each block's compute. With `lock` (run_lockstep), it takes the token
    before the first step and passes it on after each, outside the steps'
    timing, as worker_mlx_lm does."""
    from mlx_pager.callbacks import PagerCallback
    from mlx_pager.simulate import waited

    class StepMarks(PagerCallback):
        def __init__(self):
            self.steps = []
            self.pager = None

        def off(self, stats):
            return waited(stats)

        def on_step_begin(self, iteration, stats):
            if lock:
                lock.acquire()
            self.steps.append({"start": [time.perf_counter(), self.off(stats)], "marks": [], "steal": cpu_steal_s()})

        def on_block(self, weights, phase, block):
            self.pager = weights.pager
            if self.steps and "end" not in self.steps[-1]:
                self.steps[-1]["marks"].append([phase, block, time.perf_counter(), self.off(weights.pager.stats())])

        def on_step(self, record):
            if self.steps and self.pager is not None:
                self.steps[-1]["end"] = [time.perf_counter(), self.off(self.pager.stats())]
                self.steps[-1]["held"] = bool(record.get("tail_held"))
                # forward blocks in parts it bound whole (measured_accesses)
                self.steps[-1]["whole"] = list(record.get("forward_whole", []))
                self.steps[-1]["window"] = list(record.get("window", (1, 0)))
                steal = cpu_steal_s()
                if steal is not None and self.steps[-1]["steal"] is not None:
                    self.steps[-1]["steal_s"] = steal - self.steps[-1]["steal"]
            if lock:
                lock.turn()

    return StepMarks()


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
        readahead=cfg.get("readahead"),  # None: the trainer's own choice (AutoReadahead)
        policy=cfg["policy"],
        report=str(report),
        quiet=True,
        ssd_cache_dir=cfg["cache"],
        readahead_mode=cfg.get("readahead_mode", "conservative"),
        io_threads=IO_THREADS,
        page_parts=cfg.get("page_parts", "auto"),
        grad_checkpoint=cfg.get("grad_checkpoint", False),
        trace=cfg.get("trace"),  # bench_train --trace
    )
    marks = step_marks_callback(Lockstep.from_cfg(cfg))
    res = run(types.SimpleNamespace(**args), marks)
    steps = [
        {
            "step_s": s["step_s"],
            "tokens_per_s": s["tokens"] / s["step_s"],
            "loss": s["loss"],
            # The reads a step started (the loop's bytes_started): a window's
            # steps then hold the reads of one cycle of the schedule. Counted
            # where they landed, the counted window missed the read its last
            # step starts for the next window (the run ends there) and
            # carried none from the window before: at 50% of the read shape
            # 4 of a window's 5 block reads, 0.80x MIN's bytes.
            "bytes_read": s["bytes_started"],
            "pages_read": s["pages_started"],
            "bytes_landed": s["bytes_read"],  # over read_busy_s: the rate the reads got
            "io_wait_s": s["io_wait_s"],
            "read_busy_s": s["read_busy_s"],
            "mlx_peak": s["mlx_peak_bytes"],
            "spilled_bytes": s["spilled_bytes"],
            "spill_read_bytes": s["spill_read_bytes"],
            "page_budget_bytes": s["page_budget_bytes"],
            # the readahead the step ran with: (depth in blocks, mode)
            "readahead": [s["readahead_blocks"], s["readahead_mode"]],
            "tokens": s["tokens"],
            "window": s["window"],
        }
        for s in res.steps
    ]
    done = [m for m in marks.steps if "end" in m]
    if len(done) == len(steps):
        for st, m in zip(steps, done):
            if "steal_s" in m:
                st["steal_s"] = m["steal_s"]  # the host's, during the step (benchlib.cpu_steal_s)
    p = res.plan
    windows, window = by_window(steps, done)
    return {
        # per window of the frozen prefix (by_window): one step, or the
        # mean of the window's steps
        "steps": windows,
        "step_records": steps,
        "window": window,
        "marks": done,
        "peak_rss": vm_hwm(),
        "mlx_peak": max(s["mlx_peak"] for s in steps),
        "budget": p.budget,
        # the pages' budget the governor gave the pager for the last step
        # (page_budget caps the plan's; the plan moves it as the steps
        # measure their peaks, after the last step too)
        "page_budget": res.steps[-1]["page_budget_bytes"]
        if res.steps
        else min(p.page_budget, cfg["page_budget"] or p.page_budget),
        "page_footprint": p.max_page,
        "page_footprints": res.page_footprints,
        "page_read_bytes": res.page_read_bytes,
        "block_pages": [list(p) for p in res.block_pages],
        "tail_back_pages": [list(p) for p in res.tail_back_pages],
        "report": str(report),
        "governor": res.governor_events,
        # the settings the last step ran with (without --readahead, the
        # trainer's choice from its measured step)
        "settings": [*steps[-1]["readahead"], cfg["policy"]] if steps else [cfg.get("readahead"), None, cfg["policy"]],
        # the plan's predicted peak and the kernel's measured one, per step
        "predicted_peaks": [s["predicted_peak_bytes"] for s in res.steps],
        "step_peaks": [s["step_peak_rss_bytes"] for s in res.steps],
        "placements": [
            [s["tail_start"], s["recomputed_blocks"], s["spilled_blocks"], s["batch_parts"]] for s in res.steps
        ],
        "spilled_bytes": [s["spilled_bytes"] for s in res.steps],
        "spill_read_bytes": [s["spill_read_bytes"] for s in res.steps],
    }


def by_window(steps, marks):
    """A pager row's steps as its frozen prefix's windows (prefix.py): where
    the prefix runs ahead, a window's first step computes it for all the
    window's steps, so a step alone says little; the row's figures are taken
    per window instead (its steps' mean: time, reads, waits; tokens/s over
    the whole window), and its marks are the window's steps' marks, in
    order, and `indices` the steps it holds. Returns (the windows as steps,
    their width): the first window (the run's first step) and then only
    windows of the most common width (a window cut short by the run's end
    is another cycle of the schedule). Without windows: the steps as they
    are."""
    groups = []
    for i, st in enumerate(steps):
        n, at = st.get("window", (1, 0))
        if at == 0 or not groups:
            groups.append([])
        groups[-1].append(i)
    groups = [g for g in groups if len(g) == steps[g[0]].get("window", (1, 0))[0]]
    widths = [len(g) for g in groups[1:]]
    width = max(set(widths), key=lambda n: (widths.count(n), n)) if widths else 1
    if width == 1:
        return steps, 1
    groups = groups[:1] + [g for g in groups[1:] if len(g) == width]
    out = []
    for g in groups:
        ws = [steps[i] for i in g]
        mean = {k: statistics.mean(w[k] for w in ws) for k in ws[0] if isinstance(ws[0][k], (int, float))}
        mean.update(
            tokens_per_s=sum(w["tokens"] for w in ws) / sum(w["step_s"] for w in ws),
            mlx_peak=max(w["mlx_peak"] for w in ws),
            page_budget_bytes=min(w["page_budget_bytes"] for w in ws),
            readahead=ws[-1]["readahead"],
            window=[len(g), 0],
            indices=g,
            marks=[marks[i] for i in g] if len(marks) == len(steps) else None,
        )
        out.append(mean)
    return out, width


# ------------------------------------------------------------- orchestrator --
def busy_read_rate(r, steady: bool = False) -> float:
    """The rate a pager row's reads got: its bytes read over the time the
    disk had a read in flight (read_busy_s), summed over the whole run (a
    read can start in one step and land in the next), or with `steady` over
    the steps its figures are taken from (steady_steps). The device
    delivered at least that, at the pager's own I/O shape. (The big shape's
    first 25% row read 8.2 GB in its first step at 88 MB/s, then 0.85-2
    GB/s: over the whole run its rate was 105 MB/s, and the simulator,
    reading at that, predicted 10.4 s a step against 2.4 s measured.)"""
    steps = steady_steps(r["steps"]) if steady else r["steps"]
    busy = sum(st["read_busy_s"] for st in steps)
    return sum(st.get("bytes_landed", st["bytes_read"]) for st in steps) / busy if busy > 0 else 0.0


def row_rate(r, R: float) -> float:
    """A pager row's R: the disk's rate around it (sample_near), or where
    higher the rate its own reads got in the steps its figures come from
    (the device gave at least that), never above the shape's R (the row is
    held to no more than the device's best); the shape's R where neither is
    known (a lockstep pair has no samples around it, and its steps after
    the first may read nothing)."""
    return min(R, max(busy_read_rate(r, steady=True), r.get("disk_near", 0.0))) or R


def near_setting(samples) -> int:
    """Which read setting the samples around the rows are read at: the one
    whose samples (one list per sample, a rate per setting, READ_SETTINGS'
    order) have the highest mean."""
    return max(range(len(samples[0])), key=lambda i: statistics.mean(x[i] for x in samples))


def steady_indices(steps) -> list:
    """Which steps a row's figures are taken from: those after the first that
    ran the readahead the last step ran with (without --readahead the
    trainer runs its first two steps at depth 2, then its own choice)."""
    last = steps[-1].get("readahead") if steps else None
    same = [i for i in range(1, len(steps)) if steps[i].get("readahead") == last]
    return same or list(range(len(steps)))[-1:]


def steady_steps(steps):
    return [steps[i] for i in steady_indices(steps)]


def estimated_footprint(model: Path) -> int:
    """A block page's footprint at most, from the model's safetensors index
    (each block's tensors, each aligned, plus a page of slack), for budgets
    before a pager row has reported the exact one."""
    from mlx_pager import read_safetensors_index
    from mlx_pager._core import IO_ALIGN

    blocks = {}
    for f in sorted(model.glob("model*.safetensors")):
        tensors, _, _ = read_safetensors_index(str(f))
        for name, (_, _, _, nb) in tensors.items():
            parts = name.split(".")
            if "layers" in parts:
                i = parts[parts.index("layers") + 1]
                blocks[i] = blocks.get(i, 0) + -(-nb // IO_ALIGN) * IO_ALIGN + IO_ALIGN
    return max(blocks.values()) + 2 * IO_ALIGN


def measured_accesses(r):
    """The row's step as simulate.Access records: its schedule, with each
    access's compute the median over the steps after the first that ran the
    same schedule (a step's first one differs: it measures the tail); where
    the frozen prefix runs ahead, over the windows its figures come from."""
    from mlx_pager import simulate

    def accesses(st):
        return simulate.accesses_from_marks(
            [simulate.BlockMark(*m) for m in st["marks"]],
            tuple(st["start"]),
            tuple(st["end"]),
            r["block_pages"],
            r["tail_back_pages"],
            st.get("held", False),
            st.get("whole", ()),
        )

    if r.get("window", 1) > 1:
        # A window of the frozen prefix (by_window): its steps' accesses in
        # turn, one cycle of the schedule; from the windows the row's figures
        # come from (steady_indices), as its step time does.
        windows = [r["steps"][i]["marks"] for i in steady_indices(r["steps"]) if r["steps"][i].get("marks")]
        per_step = [[a for st in w for a in accesses(st)] for w in windows]
    else:
        per_step = [accesses(st) for st in r["marks"][1:] or r["marks"]]
    if not per_step:
        return []
    ref = [(a.pages, a.overlaps) for a in per_step[-1]]
    same = [acc for acc in per_step if [(a.pages, a.overlaps) for a in acc] == ref]
    return [
        simulate.Access(
            pages,
            statistics.median(acc[i].hold_s for acc in same),
            statistics.median(acc[i].gap_s for acc in same),
            overlaps,
        )
        for i, (pages, overlaps) in enumerate(ref)
    ]


def pages_per_block(r) -> int:
    return max((len(p) for p in r["block_pages"]), default=1)


def settings_label(settings) -> str:
    depth, mode, policy = settings
    if depth == 0:
        return f"{policy}, no ra"
    return f"ra {depth:g} {mode[:4]}" + ("" if policy == "optimal" else f" {policy}")


def min_over_steps(accesses, footprints, budgets, read_bytes=None, counted=None):
    """MIN's pages and bytes a step, living through the row's budgets:
    `budgets` holds each step's page budget from the run's first step on (the
    plan may move it between steps), and MIN runs through them in order
    (simulate.min_reads_by_step, each step `accesses`, two more of future at
    the last budget), so a step right after the budget grew pays for filling
    the room, as the pager's did. Averaged over the `counted` steps (default:
    all) as a row's reads are (a mean over the same steps: `med`).
    (Before, MIN was each counted step's steady state at its own budget:
    `pager @mlx-lm` of the compute shape, its budget 142/118/116/116 MB over
    the four steps counted, read 50/69/69/69 MB, what MIN through those
    budgets reads, and came out 1.25x a MIN that never filled the room.)
    Bytes: each page MIN reads counts what its read transfers, `read_bytes`
    (the row's page_read_bytes; default: its footprint): the bytes of the
    pages MIN reads, not of as many mean pages, as a 4-bit model's blocks
    differ by up to 40%. (Before, a page counted its footprint times the
    row's read bytes per footprint byte over the pages a replay read: where
    one page a window is read and which one turns from window to window, as
    in q4 at 100%, the replay's pages were not the row's and MIN came out
    11% low; the row had read exactly MIN's page.)"""
    from mlx_pager import simulate

    budgets = list(budgets)
    counted = list(range(len(budgets))) if counted is None else list(counted)
    order = [p for a in accesses for p in a.pages]
    steps = len(budgets) + 2
    weights = list(footprints) if read_bytes is None else list(read_bytes)
    pages = simulate.min_reads_by_step(order, footprints, budgets, steps)
    nbytes = simulate.min_reads_by_step(order, footprints, budgets, steps, weights)
    return statistics.mean(pages[i] for i in counted), statistics.mean(nbytes[i] for i in counted)


def pager_figures(r, R, read_rate, compute):
    """A pager row's MIN, bound and predicted step time (simulate). The bound
    divides MIN's bytes by R (the device's best) and takes as compute the
    lesser of resident mlx-lm's step and the row's own compute (its steps
    less the pager's waits: no step is faster than its own compute, and the
    pager's can be faster than mlx-lm's); the room bound (`room`) is the
    least step any schedule of the row's accesses gets under its budget at
    R (bound.room_bound), or the bound where higher; the prediction reads
    at `read_rate` (the rate the row's reads got, busy_read_rate)."""
    from mlx_pager import simulate
    from mlx_pager.bound import room_bound

    fp = r["page_footprints"]
    acc = measured_accesses(r)
    # The row's own compute: each step less the pager's waits, the median
    # over the steps its step time is the median of (summing the accesses'
    # medians instead, taken over other steps, put a step 2% under its own
    # compute while the machine drifted).
    own = (
        statistics.median(s["step_s"] - s["io_wait_s"] - s.get("reclaim_wait_s", 0.0) for s in steady_steps(r["steps"]))
        if r["steps"]
        else None
    )
    compute = min(c for c in (compute, own) if c is not None) if (compute, own) != (None, None) else 0.0
    rb = r["page_read_bytes"]  # what each page's read transfers
    if not acc:
        raise RuntimeError(f"{r['report']}: no complete training step was recorded")
    depth, mode, policy = r["settings"]  # depth in blocks (--readahead)
    settings = simulate.Settings(round(depth * pages_per_block(r)), mode, policy)
    budgets = [s.get("page_budget_bytes", r["page_budget"]) for s in r["steps"]]
    counted = steady_indices(r["steps"])
    min_pages, min_bytes = min_over_steps(acc, fp, budgets, rb, counted)
    pred = simulate.simulate(
        acc,
        fp,
        r["page_budget"],
        simulate.Disk(read_rate, IO_THREADS),
        settings,
        read_bytes=rb,
    )
    # The fastest step any eviction schedule gets under the budget at R
    # (simulate.offline_best), where blocks are whole pages: the search is
    # exhaustive enough there (a wider beam finds nothing faster). Blocks in
    # parts make many small pages and the beam cuts (at e74c4d0 `parts 50%`
    # of the read shape ran 0.82x the schedule it found, before the search
    # modelled lazy reads): there, up to OPT_PARTS_MAX_PAGES pages, the
    # fastest it finds, marked not exhaustive.
    # The least step any schedule gets with the row's compute under its
    # budget at R, the room counted (bound.room_bound: a linear program, a
    # lower bound where opt s is the fastest schedule a search finds).
    room = room_bound(acc, fp, r["page_budget"], R, read_bytes=rb)
    opt = capped = over = None  # over: opt's bytes over MIN's (the pages priced alike), where over the cap
    exhaustive = pages_per_block(r) == 1 and all(len(a.pages) == 1 for a in acc)
    if exhaustive or len(fp) <= OPT_PARTS_MAX_PAGES:
        opt = simulate.offline_best(acc, fp, r["page_budget"], R, read_bytes=rb, width=OPT_WIDTH)
        # The fastest schedule may read more than the bytes target lets a
        # policy (1.10x MIN's, the cap on the pager's own choice): then also
        # the fastest within it ("opt<=cap"), the yardstick for a step that
        # keeps it (None where opt keeps it, or no schedule was found).
        opt_min = simulate.min_bytes_per_step(acc, fp, r["page_budget"], rb)
        cap = (1 + simulate.DEFAULT_EXTRA_READS) * opt_min
        if opt.bytes_read > cap * (1 + 1e-9):
            over = opt.bytes_read / opt_min
            capped = simulate.offline_best(acc, fp, r["page_budget"], R, read_bytes=rb, width=OPT_WIDTH, max_bytes=cap)
            if capped is not None and capped.step_s < opt.step_s:
                # Both are beams, not exhaustive: where the one kept partly
                # by cheapness found the faster schedule, that is the
                # fastest found, and it keeps the cap (a 20-block instance
                # like the big shape at 25%: 0.98x the uncapped beam's).
                opt, capped, over = capped, None, None
    # Where the frozen prefix runs ahead, the accesses are a window's steps:
    # per step, a window's share.
    per = r.get("window", 1)
    room_s = room.step_s / per
    if per > 1:
        min_pages, min_bytes = min_pages / per, min_bytes / per
        pred = dataclasses.replace(
            pred,
            step_s=pred.step_s / per,
            io_wait_s=pred.io_wait_s / per,
            reclaim_wait_s=pred.reclaim_wait_s / per,
            bytes_read=pred.bytes_read / per,
            pages_read=pred.pages_read / per,
        )
        opt, capped = (
            simulate.Offline(o.step_s / per, o.bytes_read / per, o.pages_read / per) if o is not None else None
            for o in (opt, capped)
        )
    return dict(
        optimum=opt,
        optimum_exhaustive=exhaustive if opt is not None else None,
        optimum_capped=capped,
        optimum_bytes_vs_min=over,
        min_pages=min_pages,
        min_bytes=min_bytes,
        bound=max(min_bytes / R, compute),
        # The bound counting the room: the program's, or the bound where
        # higher (the program is fractional: with pages of different sizes
        # it may read under MIN's bytes).
        room=max(room_s, min_bytes / R, compute),
        bound_compute=compute,
        own_compute=own,
        predicted=pred,
        accesses=acc,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "mlx-pager"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--configs", default=None, help="comma-separated name prefixes of the rows to run (default: all)")
    ap.add_argument(
        "--ab-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="run each 'pager X%%' row also with this environment variable (repeatable): 'env X%%' rows, A B ... B A",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="each pager row also writes its timeline (mlx-pager's --trace) to OUT/trace-SHAPE-ROW.json",
    )
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(json.loads(a.worker))))
        return
    a.configs = [c.strip() for c in a.configs.split(",")] if a.configs else None
    bad = [e for e in a.ab_env if "=" not in e or not e.split("=", 1)[0].strip()]
    if bad:
        ap.error(f"--ab-env takes NAME=VALUE (e.g. OPENBLAS_THREAD_TIMEOUT=4), not {', '.join(map(repr, bad))}")
    a.ab_env = dict(e.split("=", 1) for e in a.ab_env)
    unknown = [n for n in a.shapes.split(",") if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, violations = {}, []
    for name in a.shapes.split(","):
        summary[name] = bench_one(name, SHAPES[name], a, out_dir)
        violations += [f"shape '{name}', {v}" for v in summary[name]["bound_violations"]]
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out_dir / "results.png")
    goals = targets.check(summary)
    print("\n== targets (issue 9), from this run")
    for t in goals:
        print(t.line())
    (out_dir / "targets.json").write_text(json.dumps([dataclasses.asdict(t) for t in goals], indent=2))
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'targets.json'} and {out_dir / 'results.png'}")
    if violations:
        print(
            f"\nFAILED: {len(violations)} row(s) ran faster than {BOUND_SLACK}x their lower bound, which is "
            "impossible: the bound's R or compute is mis-measured (a measurement bug, not a win):"
        )
        for v in violations:
            print(f"  {v}")
        sys.exit(1)


def bench_one(name, shape, a, out_dir):
    import psutil

    from mlx_pager import modelgen
    from mlx_pager._core import IO_ALIGN
    from mlx_pager.store import MAX_PAGE_PARTS, PAGE_PART_BYTES

    spec_kw = dict(arch="llama", vocab_size=1024, dtype="float32", bits=None, seed=0)
    spec_kw.update(shape["spec"])
    spec = modelgen.ModelSpec(**spec_kw)
    t = time.perf_counter()
    model = modelgen.generate_model(Path(a.cache) / f"bench-{name}-{spec.key()}", spec)
    made = time.perf_counter() - t
    data = make_data(out_dir / f"data-{name}", shape["seq_len"])
    files = sorted(model.glob("model*.safetensors"))
    W = modelgen.weight_bytes(model)
    L = shape["spec"]["num_hidden_layers"]
    fractions = shape.get("fractions", FRACTIONS)
    base = dict(
        model=str(model),
        data=str(data),
        steps=shape.get("steps", a.steps),
        batch_size=shape["batch_size"],
        seq_len=shape["seq_len"],
        num_layers=shape["num_layers"],
        cache=str(out_dir / "swap"),
    )
    kind = f"{spec.bits}-bit" if spec.bits else spec.dtype
    print(
        f"\n== shape '{name}': {L} blocks, {W / 1e9:.2f}GB {kind} weights, batch "
        f"{shape['batch_size']} x {shape['seq_len']} tokens, LoRA on the last {shape['num_layers']} blocks"
        f" (model ready in {made:.0f}s)",
        flush=True,
    )
    footprint = estimated_footprint(model)
    dd_files = [f for i, f in enumerate(files) if sum(g.stat().st_size for g in files[:i]) < 1 << 30]  # ~1 GB
    rates, own_rates, tried, dd = [], [], [], []
    # The disk's rate right before and after each pager row: a short sample
    # of every read setting on each side, and the row's rate the mean of the
    # two for one setting, the shape's best: the one whose samples, all of
    # the shape's pooled, have the highest mean (near_setting). The best
    # setting, not the luckiest of a row's six noisy means: the settings
    # run within the noise of each other, and the highest of six samples
    # of the same rate is above that rate (seen: 1.72 GB/s taken as R
    # where the same setting's reads had a median of 1.40). The volume has
    # fast and slow periods minutes long, so a row is held to the rate the
    # disk gave around it, not to the best it gave the shape's other rows.
    last_sample = None  # the latest sample's rate per setting (None: take one)
    samples = []  # every sample's rate per setting, the shape's pooled

    def pager_files():
        # The files the pager reads: the model's, and its swap file if any.
        swaps = sorted((out_dir / "swap").rglob("*.swap")) if (out_dir / "swap").exists() else []
        return files + swaps

    def sample_near() -> list:
        nonlocal last_sample
        _, t = read_rate(pager_files(), footprint, max_seconds=NEAR_SAMPLE_S)
        last_sample = [x["bytes_per_s"] for x in t]
        samples.append(last_sample)
        return last_sample

    def measure_rate():
        nonlocal last_sample
        best, t = read_rate(pager_files(), footprint)
        last_sample = [x["bytes_per_s"] for x in t]
        samples.append(last_sample)
        rates.append(best)
        own_rates.append(
            next(x["bytes_per_s"] for x in t if x["threads"] == IO_THREADS and x["chunk_bytes"] == 8 << 20)
        )
        tried.extend(t)
        dd.append(dd_rate(dd_files))

    def want(cfg_name):
        if cfg_name.startswith("env "):
            return bool(a.ab_env)  # each follows its 'pager' row, which --configs chose
        return a.configs is None or any(cfg_name.startswith(c) for c in a.configs)

    results = {}

    def go(cfg_name, cap=None, **kw):
        nonlocal last_sample
        if not want(cfg_name):
            return
        cfg = dict(base, name=cfg_name, adapter_path=str(out_dir / f"ad-{name}-{cfg_name.replace(' ', '_')}"), **kw)
        paged = cfg["kind"] == "pager"
        if paged and a.trace:
            cfg["trace"] = str(out_dir / f"trace-{name}-{cfg_name.replace(' ', '_')}.json")
        if paged and cfg.get("readahead") is None:
            # The trainer chooses after its second step: one step more, so
            # the row has as many steps at its choice as a fixed row's after
            # its first.
            cfg["steps"] += 1
        if paged and "steps" not in shape and cfg["num_layers"] < shape["spec"]["num_hidden_layers"]:
            # The frozen prefix may run ahead (prefix.py): windows of up to
            # AHEAD_MOST steps after the first step (alone); the trainer's
            # readahead choice comes at the end of the first, so that a row
            # has a window at its choice.
            from mlx_pager.prefix import AHEAD_MOST

            cfg["steps"] = max(cfg["steps"], 1 + 2 * AHEAD_MOST)
        before = (last_sample or sample_near()) if paged else None
        t = time.perf_counter()
        results[cfg_name] = run_worker(__file__, cfg, cap=cap)
        results[cfg_name]["adapter_path"] = cfg["adapter_path"]
        if paged:
            after = sample_near()
            # each setting's mean of the two; the row's is read in summary
            results[cfg_name]["disk_near_each"] = [(b + a) / 2 for b, a in zip(before, after)]
        else:
            last_sample = None  # the next pager row samples the disk right before it
        print(f"   {cfg_name:<13} ran in {time.perf_counter() - t:5.1f}s", flush=True)

    def go_lockstep(*pair):
        """Both configurations of `pair` at once, their steps alternating
        (the first's first), PAIR_STEPS each (a 'pager' row's one more, and
        the other row as many)."""
        cfgs = []
        for cfg_name, kw in pair:
            cfgs.append(
                dict(base, name=cfg_name, adapter_path=str(out_dir / f"ad-{name}-{cfg_name.replace(' ', '_')}"), **kw)
            )
        # Both at once need the two rows' peaks, as their runs before the
        # pairs measured them (the big shape: 2 x 9.3 GB of 24), else 1.5x
        # the weights each.
        need = sum(results.get(n.rsplit(" pair", 1)[0], {}).get("peak_rss") or 1.5 * W for n, _ in pair)
        if 1.05 * need > psutil.virtual_memory().available:
            for cfg_name, kw in pair:  # both at once do not fit: one after the other
                go(cfg_name, **kw)
            return
        steps = max(PAIR_STEPS + (c["kind"] == "pager" and c.get("readahead") is None) for c in cfgs)
        t = time.perf_counter()
        both = run_lockstep(__file__, *(dict(c, steps=steps) for c in cfgs))
        for c, r in zip(cfgs, both):
            results[c["name"]] = dict(r, adapter_path=c["adapter_path"], lockstep=True)
        print(
            f"   {' + '.join(c['name'] for c in cfgs):<27} ran in lockstep in {time.perf_counter() - t:5.1f}s",
            flush=True,
        )

    def pct(f):
        return f"{int(f * 100)}%"

    budgets = {}

    def page_budget(f):
        # 100%: every page fits (page frames carry a little alignment slack).
        # Below: that share of the pages' frames (what the pager charges: the
        # weights plus each frame's few KB of alignment), so that 25% of 8
        # equal blocks holds 2 of them, not 2 less their alignment (which is
        # 1). A block in parts is charged each part's alignment: a block's
        # frames as the estimate has them plus up to MAX_PAGE_PARTS pages of
        # alignment, so that the 2 blocks fit in parts too (--page-parts auto
        # splits below PARTS_BELOW_BLOCKS blocks). Never below one page: a
        # budget must hold the block in use. The same budget for every row
        # of a fraction (the footprint is corrected after the first row:
        # 90 KB more at 25% of the read shape put MIN's reads 10% lower).
        if f not in budgets:
            block = footprint + MAX_PAGE_PARTS * IO_ALIGN
            budgets[f] = int(1.1 * W) if f == 1 else max(int(f * L * block), footprint + 2 * MAX_PAGE_PARTS * IO_ALIGN)
        return budgets[f]

    measure_rate()
    # 'pager' rows run as a user does, without --readahead (the trainer's
    # own choice); 'cons' and 'aggr' rows at a fixed depth and mode.
    pager = dict(kind="pager", policy="optimal")
    fixed = dict(pager, readahead=4)
    resident_fits = 1.5 * W < psutil.virtual_memory().available
    if resident_fits:
        go("mlx-lm", kind="mlx-lm", grad_checkpoint=False)
        go("mlx-lm+ckpt", kind="mlx-lm", grad_checkpoint=True)
    else:
        print(f"   mlx-lm       skipped: {W / 1e9:.1f}GB of weights do not fit in this machine's memory")
    if shape.get("capped_budget"):
        # The whole process under a hard cap equal to its --memory-budget.
        # At a fixed readahead: its adapters are compared with mlx-lm
        # --grad-checkpoint's after as many steps (a 'pager' row runs one
        # more), and the trainer makes no choice while checkpoints spill.
        b = shape["capped_budget"]
        go(f"pager {b / 1e9:g}GB cap", page_budget=None, memory_budget=str(b), cap=b, **fixed)
    if "mlx-lm" in results and shape.get("at_mlx_lm", True):
        # The budget resident mlx-lm itself needed (its peak RSS, +5%): where
        # the no-recompute tail segment can hold every trained block.
        go("pager @mlx-lm", page_budget=None, memory_budget=str(int(1.05 * results["mlx-lm"]["peak_rss"])), **pager)
    for f in fractions:
        go(f"pager {pct(f)}", page_budget=page_budget(f), **pager)
        if f"pager {pct(f)}" in results:
            # (the largest block as either partition charges it: a block's
            # whole page may read through gaps its parts skip)
            footprint = max(footprint, results[f"pager {pct(f)}"]["page_footprint"])
            # --ab-env: the same row with the variables, right after it
            # (and again right before 'pager X% again': A B ... B A).
            go(f"env {pct(f)}", page_budget=page_budget(f), env=a.ab_env, **pager)
    measure_rate()
    for f in [f for f in fractions if f < 1]:
        go(f"cons {pct(f)}", page_budget=page_budget(f), **fixed)
    for f in [f for f in fractions if f < 1] if shape.get("aggressive", True) else []:
        go(f"aggr {pct(f)}", page_budget=page_budget(f), readahead_mode="aggressive", **fixed)
    for f in [f for f in fractions if f < 1]:
        # The other choice of --page-parts auto, side by side: whole blocks
        # where the 'pager' row paged them in parts (a budget of fewer than
        # session.PARTS_BELOW_BLOCKS blocks), and parts where it paged them
        # whole and they are large (parts of ~48 MB, as split_block by size).
        r = results.get(f"pager {pct(f)}")
        if r is None:
            continue
        if any(len(p) > 1 for p in r["block_pages"]):
            go(f"whole {pct(f)}", page_budget=page_budget(f), page_parts=1, **pager)
        elif footprint > 1.5 * PAGE_PART_BYTES:
            n = min(MAX_PAGE_PARTS, max(1, round(footprint / PAGE_PART_BYTES)))
            go(f"parts {pct(f)}", page_budget=page_budget(f), page_parts=n, **pager)
    if shape.get("naive", True):
        naive = dict(kind="pager", page_budget=footprint, readahead=0, policy="lru", page_parts=1)
        # Layer streaming recomputes: it cannot keep a block's weights from
        # the forward to the backward, so it checkpoints every trained block
        # and reads it again to recompute (--grad-checkpoint).
        go("naive", grad_checkpoint=True, **naive)
        # The same with the planner's no-recompute tail, whose weights are
        # read again for the backward where the graph uses them (stream.py).
        go("naive keep", **naive)
    # The default rows again, in reverse order, last: the machine's speed
    # drifts during a run (8-20% between a shape's first and last rows here)
    # and the disk has fast and slow periods, so each is run twice, around
    # the rest of the shape (A B ... B A with resident mlx-lm's two runs).
    for f in reversed(fractions):
        if f"pager {pct(f)}" in results:
            go(f"env {pct(f)} again", page_budget=page_budget(f), env=a.ab_env, **pager)
            go(f"pager {pct(f)} again", page_budget=page_budget(f), **pager)
    if "mlx-lm" in results:
        # Resident again, last: the ratios to resident take the mean of the two.
        go("mlx-lm again", kind="mlx-lm", grad_checkpoint=False)
    if "mlx-lm" in results and "pager 100%" in results:
        # Nothing paged against resident, in lockstep: PAIRS pairs of
        # processes, each pair's two taking turns step by step
        # (run_lockstep), so that each step of one runs right after a step
        # of the other. Runs of the same configuration here move by up to
        # 1.4x within minutes, more than adjacent runs or the A B ... B A
        # runs around the shape can cancel. Each pair's first process is the
        # other one from the pair before's.
        for i in range(1, PAIRS + 1):
            pair = [
                (f"mlx-lm pair {i}", dict(kind="mlx-lm", grad_checkpoint=False)),
                (f"pager 100% pair {i}", dict(pager, page_budget=page_budget(1))),
            ]
            go_lockstep(*(pair if i % 2 else reversed(pair)))
    measure_rate()
    R_pager = statistics.median(own_rates)
    near = near_setting(samples)
    for r in results.values():
        if "disk_near_each" in r:
            r["disk_near"] = r["disk_near_each"][near]
    # R is at least what the device demonstrably delivered: besides the best
    # of the direct-read measurements, the rate a pager row's reads got
    # while in flight. On a noisy volume a step can read faster than every
    # one-second sample (seen: 2.16 GB in 1.52 s against samples of at most
    # 1.38 GB/s).
    R_reads = max(rates)
    R_steps, R_steps_row = max(
        ((busy_read_rate(r), cfg_name) for cfg_name, r in results.items() if "page_budget" in r),
        default=(0.0, None),
    )
    R = max(R_reads, R_steps)
    # Every row's own figures as its worker returned them (per-step records,
    # on_block marks, page sizes, settings): what a later look at this run
    # needs to simulate its rows again without running them again.
    (out_dir / f"raw-{name}.json").write_text(json.dumps(dict(R=R, results=results)))

    def med(cfg, key):
        if cfg not in results:
            return None
        # Reads as a mean: readahead for a step's first pages may start in
        # the step before, which moves a page between neighbouring steps
        # (counted where it started: worker_pager).
        average = statistics.mean if key in ("pages_read", "bytes_read") else statistics.median
        return average(s[key] for s in steady_steps(results[cfg]["steps"]))

    def resident(key):
        xs = [med(c, key) for c in ("mlx-lm", "mlx-lm again") if c in results]
        return statistics.mean(xs) if xs else None

    compute, recompute = resident("step_s"), med("mlx-lm+ckpt", "step_s")
    resident_tps, naive_tps = resident("tokens_per_s"), med("naive", "tokens_per_s")
    rows, violations = [], []
    for cfg_name, r in results.items():
        row = {
            "config": cfg_name,
            "step_s": med(cfg_name, "step_s"),
            "tokens_per_s": med(cfg_name, "tokens_per_s"),
            "peak_rss": r["peak_rss"],
            "mlx_peak": r["mlx_peak"],
            # each step's tokens/s, and which steps the row's figures count
            "steps_tokens_per_s": [st["tokens_per_s"] for st in r["steps"]],
            "steady": steady_indices(r["steps"]),
        }
        steady = steady_steps(r["steps"])
        if steady and all("steal_s" in st for st in steady):
            # CPU seconds the host took from this machine during a step,
            # summed over its CPUs: compute a resident row never lost
            row["steal_s"] = med(cfg_name, "steal_s")
        if r.get("window", 1) > 1:
            # per window (by_window): each step's time, and the steps of
            # each window the row's figures count
            row["steps_s"] = [st["step_s"] for st in r["step_records"]]
            row["windows"] = [r["steps"][i]["indices"] for i in row["steady"]]
        elif "step_s" in (r["steps"][0] if r["steps"] else {}):
            row["steps_s"] = [st["step_s"] for st in r["steps"]]
        if r.get("lockstep"):
            row["lockstep"] = True
        if resident_tps:
            row["vs_resident"] = row["tokens_per_s"] / resident_tps
        if r.get("predicted_peaks"):
            # The plan's honesty: each step's measured peak RSS over the peak
            # the plan predicted for it (<= 1: the plan held); the closest
            # step after the first, which runs by estimates (sizes are
            # measured in it, and what its peak held beyond the plan's terms
            # joins the slack), as step times are taken after it. A later
            # step that went over its own prediction is flagged.
            pred, meas = r["predicted_peaks"], r["step_peaks"]
            later = list(zip(meas, pred))[1:] or list(zip(meas, pred))
            row["measured_peak"], row["predicted_peak"] = max(later, key=lambda mp: mp[0] / mp[1])
            row["peak_vs_plan"] = row["measured_peak"] / row["predicted_peak"]
            row["first_vs_plan"] = meas[0] / pred[0]
            row["plan_exceeded"] = row["peak_vs_plan"] > 1.0
            row["spilled_per_step"] = med(cfg_name, "spilled_bytes") if "spilled_bytes" in r["steps"][0] else 0
            row["placement"] = "/".join(str(x) for x in r["placements"][-1][1:])
        if r.get("cap"):
            row["cap"], row["cgroup_peak"] = r["cap"], r["cgroup_peak"]
        if "page_budget" in r:
            # The prediction reads at the rate the row's reads got (a row
            # that read nothing: any rate predicts the same).
            got = busy_read_rate(r, steady=True)
            R_row = row_rate(r, R)
            fig = pager_figures(r, R_row, got or R_pager, compute)
            best_bound = max(fig["min_bytes"] / R, fig["bound_compute"])
            pages_step, min_pages = med(cfg_name, "pages_read"), fig["min_pages"]
            bytes_step, min_bytes = med(cfg_name, "bytes_read"), fig["min_bytes"]
            row.update(
                settings=settings_label(r["settings"]),
                budget=r["budget"],
                page_budget=r["page_budget"],
                k_pages=round(r["page_budget"] / r["page_footprint"], 2),
                pages_per_step=pages_step,
                belady_pages=min_pages,
                bytes_per_step=bytes_step,
                belady_bytes=min_bytes,
                # In bytes, as the target and the trainer's cap on
                # extra reads (simulate.DEFAULT_EXTRA_READS) count them.
                vs_belady=bytes_step / min_bytes if min_bytes else (1.0 if bytes_step == 0 else float("inf")),
                io_wait_s=med(cfg_name, "io_wait_s"),
                compute_s=fig["own_compute"],
                disk_Bps=R_row,
                disk_near_Bps=r.get("disk_near"),
                bound_s=fig["bound"],
                vs_bound=row["step_s"] / fig["bound"],
                vs_best_bound=row["step_s"] / best_bound,
                room_s=fig["room"],
                vs_room=row["step_s"] / fig["room"],
                room_vs_bound=fig["room"] / fig["bound"],
                optimum_s=fig["optimum"].step_s if fig["optimum"] else None,
                vs_optimum=row["step_s"] / fig["optimum"].step_s if fig["optimum"] else None,
                optimum_vs_bound=fig["optimum"].step_s / fig["bound"] if fig["optimum"] else None,
                # False: blocks in parts, the fastest schedule the search found
                optimum_exhaustive=fig["optimum_exhaustive"],
                # Within the bytes target, where the fastest reads more.
                optimum_bytes_vs_min=fig["optimum_bytes_vs_min"],
                optimum_capped_s=fig["optimum_capped"].step_s if fig["optimum_capped"] else None,
                vs_optimum_capped=row["step_s"] / fig["optimum_capped"].step_s if fig["optimum_capped"] else None,
                optimum_capped_vs_bound=(
                    fig["optimum_capped"].step_s / fig["bound"] if fig["optimum_capped"] else None
                ),
                predicted_s=fig["predicted"].step_s,
                predicted_io_wait_s=fig["predicted"].io_wait_s,
                vs_predicted=row["step_s"] / fig["predicted"].step_s,
                # What the row's figures were simulated from, so that a row
                # can be simulated again offline (other settings, a policy
                # change): its step as [pages, hold_s, gap_s, overlaps] per access,
                # the pages' footprints, what each one's read transfers and
                # the rate its reads got.
                accesses=[[list(a.pages), a.hold_s, a.gap_s, a.overlaps] for a in fig["accesses"]],
                page_footprints=list(r["page_footprints"]),
                page_read_bytes=list(r["page_read_bytes"]),
                read_Bps=got,
                report=r.get("report"),
                governor=r.get("governor"),
            )
            if naive_tps:
                row["vs_naive"] = row["tokens_per_s"] / naive_tps
            if row["vs_bound"] < BOUND_SLACK:
                violations.append(
                    f"'{cfg_name}': {row['step_s']:.3f}s/step is {row['vs_bound']:.2f}x its bound "
                    f"{fig['bound']:.3f}s (MIN {fig['min_bytes'] / 1e9:.2f}GB at R {R_row / 1e9:.2f}GB/s, "
                    f"compute {fig['bound_compute']:.3f}s)"
                )
        rows.append(row)

    best = max(tried, key=lambda t: t["bytes_per_s"])
    steps_note = (
        f"; a row's own reads got {R_steps / 1e9:.2f}GB/s while in flight ({R_steps_row})"
        + (", taken as R" if R_steps > R_reads else "")
        if R_steps_row is not None
        else ""
    )
    print(
        f"   disk: R {R / 1e9:.2f}GB/s (best of {len(tried)} direct reads at the pager's I/O shape, "
        f"{best['threads']} threads x {best['chunk_bytes'] >> 20}MB chunks, {R_reads / 1e9:.2f}GB/s; "
        f"per measurement {', '.join(f'{x / 1e9:.2f}' for x in rates)}{steps_note}); "
        f"at the pager's own {IO_THREADS} threads x 8MB "
        f"{R_pager / 1e9:.2f}GB/s (median); one dd iflag=direct stream "
        f"{statistics.median(dd) / 1e9:.2f}GB/s; the rows' samples at "
        f"{READ_SETTINGS[near][0]} threads x {READ_SETTINGS[near][1] >> 20}MB chunks (the best mean of {len(samples)})"
    )
    if compute is not None:
        drift = ""
        if "mlx-lm again" in results:
            first, last = med("mlx-lm", "step_s"), med("mlx-lm again", "step_s")
            drift = f", the mean of {first:.2f}s first and {last:.2f}s last ({last / first:.2f}x: the machine's drift)"
        print(
            f"   compute per step: resident {compute:.2f}s (mlx-lm{drift}), with recompute "
            f"{recompute:.2f}s (mlx-lm --grad-checkpoint)"
            if recompute is not None
            else f"   compute per step: resident {compute:.2f}s (mlx-lm{drift})"
        )
    else:
        print("   compute per step: resident not measured (no mlx-lm row); each bound takes its row's own compute")
    print_rows(rows)
    twice = twice_summary(rows)
    for line in twice["lines"]:
        print(line)
    pairs = pairs_summary(rows)
    if pairs:
        print(pairs["line"])
    ab = ab_summary(rows, a.ab_env)
    for line in ab.get("lines", []):
        print(line)
    steal = steal_summary(rows, compute, os.cpu_count() or 1)
    if steal:
        print(steal["line"])
    for v in violations:
        print(f"   BOUND VIOLATED: {v}")
    for row in rows:
        if row.get("plan_exceeded"):
            print(f"   PLAN EXCEEDED: {row['config']}: a step's peak RSS went over the peak its plan predicted")
    firsts = [f"{row['config']} {row['first_vs_plan']:.2f}" for row in rows if row.get("first_vs_plan", 0) > 1.0]
    if firsts:
        print(f"   first step over its plan (formula estimates; learned into the slack): {', '.join(firsts)}")
    capped = {}
    for row in rows:
        if "cap" in row or (row["config"] in results and "cap_unavailable" in results[row["config"]]):
            capped = capped_summary(row, results, rows)
            print(capped["line"])

    return {
        "weights_bytes": W,
        "blocks": L,
        "first_trained": L - shape["num_layers"],
        "disk_Bps": R,
        "disk_reads_Bps": R_reads,
        "disk_steps_Bps": R_steps,
        "disk_samples": rates,
        "disk_pager_Bps": R_pager,
        "disk_settings": tried,
        "disk_near_setting": {"threads": READ_SETTINGS[near][0], "chunk_bytes": READ_SETTINGS[near][1]},
        "dd_Bps": dd,
        "resident_step_s": compute,
        "recompute_step_s": recompute,
        "shape": shape,
        "rows": rows,
        "bound_violations": violations,
        "capped": capped,
        "twice": twice["rows"],
        "nothing_paged_pairs": pairs,
        "ab": ab,
        "steal": steal,
    }


def steal_summary(rows, compute=None, cpus: int = 1, least: float = 0.01) -> dict:
    """The host's steal (benchlib.cpu_steal_s) per step of each row that
    measured it, and per GB it read, where some row lost at least `least`
    seconds a step: on a cloud VM the host may serve the virtual disk with
    the cores it lends, so that reading takes compute from the steps that
    read, which no bound of this machine's own counts. With `compute`
    (resident mlx-lm's step): each pager row also against its bound whose
    compute adds its steal spread over the `cpus` CPUs (the least it can
    cost a step: the CPU time no program in this machine can get back).
    Empty where no row lost that much (a Mac, bare metal, or nothing read)."""
    have = [r for r in rows if r.get("steal_s") is not None]
    if not any(r["steal_s"] >= least for r in have):
        return {}
    per_gb = {
        r["config"]: r["steal_s"] / (r["bytes_per_step"] / 1e9) for r in have if (r.get("bytes_per_step") or 0) >= 1e7
    }
    vs = {}
    if compute:
        for r in have:
            if r.get("disk_Bps") and r.get("belady_bytes") is not None:
                bound = max(r["belady_bytes"] / r["disk_Bps"], compute + r["steal_s"] / cpus)
                vs[r["config"]] = r["step_s"] / bound
    cells = [
        f"{r['config']} {r['steal_s']:.2f}s"
        + (f" ({per_gb[r['config']]:.2f}s a GB read)" if r["config"] in per_gb else "")
        for r in have
    ]
    line = "   host steal a step (CPU seconds the hypervisor took from this machine, all CPUs): " + ", ".join(cells)
    if vs:
        line += (
            f"\n   vs the bound with the steal in its compute (resident {compute:.2f}s + steal / {cpus} CPUs): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in vs.items())
        )
    return {
        "per_step": {r["config"]: r["steal_s"] for r in have},
        "per_gb": per_gb,
        "vs_steal_bound": vs,
        "line": line,
    }


def pairs_summary(rows) -> dict:
    """The 'pager 100%' row against resident mlx-lm, PAIRS pairs run in
    lockstep ('mlx-lm pair i' and 'pager 100% pair i'): per step both rows
    count, the pager's tokens/s over mlx-lm's on the same batch, one step
    right after the other (so the machine's drift, minutes long, falls on
    both). Each pair's median of them ("ratios") and the median of all of
    them ("median", the figure): the pair's medians of 4-5 steps each would
    still move with a few slow steps. Pairs not run in lockstep (an older
    results.json): their ratio of tokens/s."""
    by_name = {r["config"]: r for r in rows}
    ratios, steps, lockstep = [], [], True
    for i in range(1, PAIRS + 1):
        a, b = by_name.get(f"mlx-lm pair {i}"), by_name.get(f"pager 100% pair {i}")
        if not (a and b):
            continue
        if a.get("lockstep") and b.get("lockstep"):
            both = sorted(set(a["steady"]) & set(b["steady"]))
            each = [b["steps_tokens_per_s"][k] / a["steps_tokens_per_s"][k] for k in both]
            if b.get("windows") and a.get("steps_s"):
                # The pager's frozen prefix ran ahead: its window's first
                # step computes it for all, so a window against mlx-lm's
                # same steps (the same batches), as whole times.
                steady = set(a["steady"])
                each = [
                    sum(a["steps_s"][k] for k in w) / sum(b["steps_s"][k] for k in w)
                    for w in b["windows"]
                    if set(w) <= steady
                ]
            if each:
                steps += each
                ratios.append(statistics.median(each))
                continue
        lockstep = False
        ratios.append(b["tokens_per_s"] / a["tokens_per_s"])
        steps.append(ratios[-1])
    if not ratios:
        return {}
    m = statistics.median(steps)
    lo, hi = bootstrap_interval(steps)
    each = " / ".join(f"{x:.2f}x" for x in ratios)
    unit = (
        "windows of steps"
        if any(by_name.get(f"pager 100% pair {i}", {}).get("windows") for i in range(1, PAIRS + 1))
        else "steps"
    )
    how = f"{len(ratios)} pairs in lockstep, {len(steps)} {unit}" if lockstep else f"{len(ratios)} adjacent pairs"
    line = (
        f"   pager 100% against resident, {how}: pairs {each}, median of the steps {m:.3f}x "
        f"(90% bootstrap interval {lo:.3f}-{hi:.3f}x)"
    )
    return {"ratios": ratios, "steps": steps, "median": m, "interval": [lo, hi], "lockstep": lockstep, "line": line}


def ab_summary(rows, env: dict) -> dict:
    """--ab-env: each 'env X%' row (the variables set) against its 'pager X%'
    row, both run twice in the order A B ... B A: the mean of the two runs'
    step times with over without, and the rate their reads got. Below 1: the
    variables made the step faster on this machine."""
    if not env:
        return {}
    by_name = {r["config"]: r for r in rows}
    label = " ".join(f"{k}={v}" for k, v in env.items())
    out, lines = {"env": env, "fractions": {}}, [f"   A/B with {label} ('env X%') against without ('pager X%'):"]
    for name in by_name:
        if not (name.startswith("pager ") and name.endswith("%")):
            continue
        f = name.removeprefix("pager ")
        runs = [by_name.get(n) for n in (name, f"{name} again", f"env {f}", f"env {f} again")]
        if any(x is None or x.get("step_s") is None for x in runs):
            continue
        without = [x["step_s"] for x in runs[:2]]
        with_ = [x["step_s"] for x in runs[2:]]
        ratio = statistics.mean(with_) / statistics.mean(without)
        reads = [x.get("read_Bps") for x in runs]
        out["fractions"][f] = {"without_s": without, "with_s": with_, "ratio": ratio, "read_Bps": reads}
        rate = (
            f"; reads {statistics.mean(reads[:2]) / 1e9:.2f} -> {statistics.mean(reads[2:]) / 1e9:.2f}GB/s"
            if all(reads)
            else ""
        )
        lines.append(
            f"   {f:>5}: step {without[0]:.3f}s / {without[1]:.3f}s without, {with_[0]:.3f}s / {with_[1]:.3f}s with: "
            f"{ratio:.3f}x{rate}"
        )
    out["lines"] = lines
    return out if out["fractions"] else {}


def bootstrap_interval(xs, level: float = 0.9, draws: int = 2000) -> tuple:
    """The central `level` of the medians of `draws` resamples of `xs` (with
    replacement, a fixed seed): how far the median of this many steps moves
    with the machine's noise."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    cut = int((1 - level) / 2 * draws)
    return meds[cut], meds[draws - 1 - cut]


def twice_summary(rows) -> dict:
    """The default rows run twice ('pager X%' and 'pager X% again'): each
    ratio for both runs and their mean, the figure a target is read from
    (one run's ratio moves by up to ~30% here with the disk's periods)."""
    by_name = {r["config"]: r for r in rows}
    keys = [("step_s", "step", "s"), ("vs_resident", "vs res", "x"), ("vs_bound", "vs bnd", "x")]
    keys += [("vs_room", "vs room", "x"), ("room_vs_bound", "room/bnd", "x")]
    keys += [("vs_optimum", "vs opt", "x"), ("optimum_vs_bound", "opt/bnd", "x")]
    keys += [("optimum_bytes_vs_min", "opt bytes/MIN", "x")]
    keys += [("vs_optimum_capped", "vs opt<=cap", "x"), ("optimum_capped_vs_bound", "opt<=cap/bnd", "x")]
    keys += [("vs_naive", "vs naive", "x")]
    out, lines = {}, []
    for name, first in by_name.items():
        again = by_name.get(f"{name} again")
        if again is None:
            continue
        figs, parts = {}, []
        for key, label, unit in keys:
            if first.get(key) is None or again.get(key) is None:
                continue
            a, b = first[key], again[key]
            figs[key] = {"runs": [a, b], "mean": (a + b) / 2}
            parts.append(f"{label} {a:.2f}{unit} / {b:.2f}{unit}, mean {(a + b) / 2:.2f}{unit}")
        out[name] = figs
        lines.append(f"   {name}, two runs (first / again): " + "; ".join(parts))
    return {"rows": out, "lines": lines}


def capped_summary(row, results, rows) -> dict:
    """The capped row against the anchors: within its cap or not, bytes
    spilled and read back per step, step time vs resident, and its adapters
    against mlx-lm --grad-checkpoint's on the same flags and seed (relative
    difference, the largest over the tensors)."""
    import mlx.core as mx

    r = results[row["config"]]
    out = {"config": row["config"]}
    ref = results.get("mlx-lm+ckpt")
    if ref is not None:
        a = mx.load(str(Path(ref["adapter_path"]) / "adapters.safetensors"))
        b = mx.load(str(Path(r["adapter_path"]) / "adapters.safetensors"))
        out["adapters_rel_diff"] = max(
            (mx.linalg.norm((b[k] - a[k]).flatten()) / mx.linalg.norm(a[k].flatten())).item() for k in a
        )
    spilled = r["steps"][-1]["spilled_bytes"] if r["steps"] else 0
    read = r["steps"][-1]["spill_read_bytes"] if r["steps"] else 0
    out.update(
        cap=r.get("cap"),
        cgroup_peak=r.get("cgroup_peak"),
        spilled_per_step=spilled,
        spill_read_per_step=read,
        vs_resident=row.get("vs_resident"),
        placements=r["placements"],
    )
    if r.get("cap"):
        within = f"cgroup peak {r['cgroup_peak'] / 1e9:.2f}GB under a {r['cap'] / 1e9:.2f}GB cap"
    else:
        within = f"NOT capped ({r.get('cap_unavailable')})"
    rel = f"{out['adapters_rel_diff']:.1e}" if "adapters_rel_diff" in out else "n/a"
    vs = f"{row['vs_resident']:.2f}x" if row.get("vs_resident") else "n/a"
    out["line"] = (
        f"   {row['config']}: {within}; spilled {spilled / 1e6:.1f}MB and read back {read / 1e6:.1f}MB "
        f"per step; placement (recomputed/spilled/parts) per step {[p[1:] for p in r['placements']]}; "
        f"step {row['step_s']:.2f}s = {vs} resident; adapters vs mlx-lm --grad-checkpoint: {rel} relative"
    )
    return out


# The table: (header, width, format, row key, scale); a row without the key
# prints blanks there.
COLUMNS = [
    ("config", 15, "<", "config", None),
    ("step s", 7, ".2f", "step_s", 1),
    ("pred s", 7, ".2f", "predicted_s", 1),
    ("tok/s", 8, ".1f", "tokens_per_s", 1),
    ("vs res", 6, ".2f", "vs_resident", 1),
    ("RSS GB", 7, ".2f", "peak_rss", 1e-9),
    ("MLX GB", 7, ".2f", "mlx_peak", 1e-9),
    ("GB/step", 8, ".2f", "bytes_per_step", 1e-9),
    ("vs MIN", 6, ".2f", "vs_belady", 1),
    ("I/O s", 6, ".2f", "io_wait_s", 1),
    ("comp s", 6, ".2f", "compute_s", 1),
    ("steal s", 7, ".2f", "steal_s", 1),
    ("R GB/s", 6, ".2f", "disk_Bps", 1e-9),
    ("bound s", 7, ".2f", "bound_s", 1),
    ("vs bnd", 6, ".2f", "vs_bound", 1),
    ("vs best", 7, ".2f", "vs_best_bound", 1),
    ("room s", 6, ".2f", "room_s", 1),
    ("vs room", 7, ".2f", "vs_room", 1),
    ("opt s", 6, ".2f", "optimum_s", 1),
    ("vs opt", 6, ".2f", "vs_optimum", 1),
    ("vs naive", 8, ".2f", "vs_naive", 1),
    ("readahead", 14, "<", "settings", None),
    ("plan GB", 7, ".2f", "predicted_peak", 1e-9),
    ("meas/plan", 9, ".2f", "peak_vs_plan", 1),
    ("rec/spill/parts", 15, "<", "placement", None),
]


def print_rows(rows):
    print("   " + " ".join(f"{h:{'<' if f == '<' else '>'}{w}}" for h, w, f, _, _ in COLUMNS))
    for row in rows:
        cells = []
        for _, w, f, key, scale in COLUMNS:
            v = row.get(key)
            if v is None:
                cells.append(" " * w)
            elif f == "<":
                cells.append(f"{v:<{w}}")
            else:
                cells.append(f"{v * scale:>{w}{f}}")
        print("   " + " ".join(cells).rstrip())


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlx_pager.plot import load_report, memory_by_component

    shapes = list(summary)
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8), squeeze=False, constrained_layout=True)
    for j, name in enumerate(shapes):
        s = summary[name]
        # one point per budget: not the second runs, nor the side-by-side pairs
        once = [r for r in s["rows"] if not r["config"].endswith("again") and " pair " not in r["config"]]
        pager_rows = [r for r in once if r["config"].startswith("pager")]
        ax = axes[0][j]

        def pct(rows, s=s):
            return [r["page_budget"] / s["weights_bytes"] * 100 for r in rows]

        for prefix, marker, label in (
            ("pager", "o-", "mlx-pager step time (its own readahead choice)"),
            ("cons", "v-", "mlx-pager, conservative readahead 4"),
            ("aggr", "^-", "mlx-pager, aggressive readahead 4"),
        ):
            series = [r for r in once if r["config"].startswith(prefix)]
            if series:
                ax.plot(pct(series), [r["step_s"] for r in series], marker, label=label)
        x = pct(pager_rows)
        ax.plot(x, [r["bound_s"] for r in pager_rows], "k--", label="lower bound")
        ax.plot(x, [r["predicted_s"] for r in pager_rows], "kx", label="simulator's prediction")
        for r in once:
            if not r["config"].startswith(("pager", "cons", "aggr")):
                ax.axhline(
                    r["step_s"],
                    ls=":",
                    lw=1,
                    label=f"{r['config']} step time",
                    color={"mlx-lm": "g", "mlx-lm+ckpt": "c", "naive": "r"}.get(r["config"], "k"),
                )
        ax.set_xlabel("page budget, % of weights")
        ax.set_ylabel("seconds per step")
        ax2 = ax.twinx()
        ax2.plot(x, [r["peak_rss"] / 1e9 for r in pager_rows], "s-", color="tab:orange", label="peak RSS")
        resident = [r for r in s["rows"] if r["config"] == "mlx-lm"]
        if resident:
            ax2.axhline(resident[0]["peak_rss"] / 1e9, color="tab:orange", ls=":", lw=1, label="mlx-lm peak RSS")
        ax2.set_ylabel("GB (peak RSS)")
        ax.set_title(f"shape '{name}': step time and peak memory vs budget")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7)
        # memory by component over one step of the 25% run (or the last pager row)
        if not pager_rows:
            continue
        row = next((r for r in pager_rows if r["config"] == "pager 25%"), pager_rows[-1])
        blocks, steps = load_report(row["report"])
        ax = axes[1][j]
        if len(steps) >= 2:
            # the last full step: its block records, on the step's own clock
            n_per = len(blocks) // max(1, len(steps))
            one = blocks[-n_per:]
            t0 = one[0]["t"]
            memory_by_component(ax, [dict(b, t=b["t"] - t0) for b in one], row["budget"])
            ax.set_xlabel("seconds into the step")
        ax.set_title(f"'{name}', {row['config']}: memory by component over one step")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
