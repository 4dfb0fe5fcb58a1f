"""What a training run tells the outside world, through one interface.

The loop (loop.py) knows nothing about consoles, files or loggers: it calls
the hooks of a ``Callbacks`` object, which fans each event out to the
callbacks the run was given. mlx-lm's own ``TrainingCallback`` is the base,
so its reporting callbacks (``--report-to wandb,swanlab`` through
``mlx_lm.tuner.callbacks.get_reporting_callbacks``) and any user callback
written for ``mlx_lm.lora`` work here unchanged; mlx-pager adds hooks of its
own with no-op defaults:

  on_train_loss_report(info)   mlx-lm's: iteration, train_loss, ... (+ pager: ...)
  on_val_loss_report(info)     mlx-lm's: iteration, val_loss, val_time
  on_step(record)              after each optimizer step: the --report step record
  on_step_begin(iteration, stats)  before an optimizer step's first block;
                               stats: the pager's counters its record counts from
  on_block(weights, phase, i)  after each block of a sweep (memory traces)
  on_update_begin() / on_update_end()  around the optimizer update
  on_governor(rung)            the memory governor took a rung of its ladder
  on_session(session)          the paged session is open (its plan, governor)
  on_save(path, iteration)     a checkpoint or the final adapters were written
  on_message(text)             a line for the user
  close()                      the run is over (always called)

Implementations here: ``ConsoleReport`` (mlx-lm 0.32's console: header box,
iteration table, with the pager's columns added) and ``JsonReport``
(``--report FILE``: JSON lines per step and per block).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
from mlx_lm.tuner.callbacks import TrainingCallback

from .governor import process_rss


class PagerCallback(TrainingCallback):
    """mlx-lm's TrainingCallback plus mlx-pager's hooks (all no-ops)."""

    def on_step(self, record: dict):
        pass

    def on_step_begin(self, iteration: int, stats: dict):
        pass

    def on_block(self, weights, phase: str, block: int):
        pass

    def on_update_begin(self):
        pass

    def on_update_end(self):
        pass

    def on_governor(self, rung: dict):
        pass

    def on_session(self, session):
        pass

    def on_save(self, path, iteration: Optional[int]):
        pass

    def on_message(self, text: str):
        pass

    def progress_start(self, total: int):
        pass

    def progress_advance(self, n: int = 1):
        pass

    def val_progress(self, total: int):
        """A context giving an `advance()` function for one evaluation pass."""
        return _NoProgress()

    def close(self):
        pass


class _NoProgress:
    def __enter__(self):
        return lambda: None

    def __exit__(self, *exc):
        return False


class Callbacks(PagerCallback):
    """Fans every hook out to a list of callbacks. mlx-lm callbacks (without
    mlx-pager's hooks) receive only the hooks they have."""

    def __init__(self, callbacks: List[TrainingCallback]):
        self.callbacks = [c for c in callbacks if c is not None]

    def _each(self, hook: str, *args):
        for c in self.callbacks:
            f = getattr(c, hook, None)
            if f is not None:
                f(*args)

    def on_train_loss_report(self, info):
        self._each("on_train_loss_report", info)

    def on_val_loss_report(self, info):
        self._each("on_val_loss_report", info)

    def on_step(self, record):
        self._each("on_step", record)

    def on_step_begin(self, iteration, stats):
        self._each("on_step_begin", iteration, stats)

    def on_block(self, weights, phase, block):
        self._each("on_block", weights, phase, block)

    def on_update_begin(self):
        self._each("on_update_begin")

    def on_update_end(self):
        self._each("on_update_end")

    def on_governor(self, rung):
        self._each("on_governor", rung)

    def on_session(self, session):
        self._each("on_session", session)

    def on_save(self, path, iteration):
        self._each("on_save", path, iteration)

    def on_message(self, text):
        self._each("on_message", text)

    def progress_start(self, total):
        self._each("progress_start", total)

    def progress_advance(self, n=1):
        self._each("progress_advance", n)

    def val_progress(self, total):
        for c in self.callbacks:
            if isinstance(c, PagerCallback) and not isinstance(c, Callbacks):
                p = c.val_progress(total)
                if not isinstance(p, _NoProgress):
                    return p
        return _NoProgress()

    def close(self):
        errors = []
        for c in self.callbacks:
            try:
                if hasattr(c, "close"):
                    c.close()
            except Exception as e:  # close every callback, then report
                errors.append(e)
        if errors:
            raise errors[0]


class JsonReport(PagerCallback):
    """``--report FILE``: appends one JSON line per optimizer step and one
    per block of every sweep (memory by component), plus a run header so
    that a file holding several runs can be told apart (``mlx-pager plot``
    draws each run on its own)."""

    def __init__(self, path, run_info: Optional[dict] = None):
        self.t0 = time.perf_counter()
        self.session = None
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # as --adapter-path's
        self.file = open(path, "a")
        self._write({"type": "run", "time": time.time(), **(run_info or {})})

    def _write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def on_step(self, record):
        self._write(record)

    def on_val_loss_report(self, info):
        self._write({"type": "val", **info})

    def on_governor(self, rung):
        self._write({"type": "governor", "t": time.perf_counter() - self.t0, **rung})

    def on_session(self, session):
        self.session = session

    def on_block(self, weights, phase, block):
        s = weights.pager.stats()
        self._write(
            {
                "type": "block",
                "t": time.perf_counter() - self.t0,
                "phase": phase,
                "block": block,
                "rss_bytes": process_rss(),
                "pages_bytes": s["resident_bytes"] - s["pinned_bytes"],
                "pinned_bytes": s["pinned_bytes"],
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),
                "in_flight_pages": s["in_flight_pages"],
                # checkpoints held in memory, and spilled ones on the SSD (placement.py)
                **(self.session.memory_now() if self.session is not None else {}),
            }
        )

    def close(self):
        self.file.close()


class ConsoleReport(PagerCallback):
    """mlx-lm 0.32's console (its header box, progress bar and iteration
    table, from ``mlx_lm.cli_ui``) with the pager's columns added: bytes read
    and I/O wait since the last report, and the process's peak RSS."""

    HEADING = "  [ui.heading]iter   train_loss     tok/s     tokens   read GB   I/O wait   peak mem[/ui.heading]"

    def __init__(self, title: str, header_rows: List[tuple]):
        from mlx_lm.cli_ui import make_console, print_header_panel

        self.console = make_console()
        self._progress = None
        self._prev_loss = None
        print_header_panel(self.console, title, header_rows)

    def on_message(self, text):
        self.console.print(text, markup=False, highlight=False)

    def progress_start(self, total):
        from mlx_lm.cli_ui import make_train_progress

        self.console.print(self.HEADING)
        self._progress = make_train_progress(self.console)
        self._task = self._progress.add_task("train", total=total)
        self._progress.__enter__()

    def progress_advance(self, n=1):
        if self._progress is not None:
            self._progress.advance(self._task, n)

    @contextmanager
    def val_progress(self, total):
        task = self._progress.add_task("val", total=total) if self._progress is not None else None
        try:
            yield (lambda: self._progress.advance(task)) if task is not None else (lambda: None)
        finally:
            if task is not None:
                self._progress.remove_task(task)

    def on_train_loss_report(self, info):
        loss = info["train_loss"]
        arrow, style = ("▼", "green") if self._prev_loss is None or loss <= self._prev_loss else ("▲", "yellow")
        self._prev_loss = loss
        self.console.print(
            f"  [ui.muted]{info['iteration']:>4}[/ui.muted]    "
            f"[bold {style}]{loss:>5.3f} {arrow}[/bold {style}]    "
            f"[ui.strong]{info['tokens_per_second']:>5,.0f}[/ui.strong]    "
            f"[ui.muted]{info['trained_tokens'] / 1000:>5.1f}k[/ui.muted]   "
            f"{info['pager_bytes_read'] / 1e9:>7.2f}   {info['pager_io_wait_s']:>7.2f}s   "
            f"{info['peak_memory']:>6.3f} GB"
        )

    def on_val_loss_report(self, info):
        # mlx-lm labels the line with the iteration about to run (info has it - 1).
        self.console.print(
            f"  [ui.muted]{info['iteration'] + 1:>4}[/ui.muted]    [ui.accent]val[/ui.accent] "
            f"[ui.strong]{info['val_loss']:>5.3f}[/ui.strong]    [ui.muted]{info['val_time']:.2f}s[/ui.muted]"
        )

    def on_governor(self, rung):
        if rung["rung"] != "cache":  # freeing MLX's cache is routine
            self.console.print(f"  [ui.warn]memory[/ui.warn]  {rung['what']}", highlight=False)

    def on_save(self, path, iteration):
        if iteration is not None:
            self.console.print(f"  [ui.good]save[/ui.good]  [ui.muted]{path.name}[/ui.muted]")

    def close(self):
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None
