"""Ctrl-C and SIGTERM: stop at the next block boundary, cleanly.

While a run is under ``stop_on_signals()``, SIGINT and SIGTERM only set a
flag; the run calls ``check()`` between blocks (and while it writes a swap
file), which raises ``Interrupted`` there. The training loop then saves the
adapters and the resume state of the last finished optimizer step and lets
the exception end the run; the CLI prints one line and exits with 128 +
the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell expects.
A second Ctrl-C while stopping interrupts at once (KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Optional

_pending: Optional[int] = None


class Interrupted(Exception):
    """The run was asked to stop by a signal; ``exit_code`` is 128 + signum."""

    def __init__(self, signum: int, saved: str = ""):
        self.signum, self.saved = signum, saved
        super().__init__(f"interrupted by {signal.Signals(signum).name}" + (f"; {saved}" if saved else ""))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame):
    global _pending
    if _pending is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt  # asked twice: stop now
    _pending = signum


@contextmanager
def stop_on_signals():
    """Turns SIGINT/SIGTERM into a pending stop for the duration (main
    thread only; elsewhere signals keep their handlers)."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending = None
    old = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _pending = None


def pending() -> Optional[int]:
    return _pending


def check() -> None:
    """Raises Interrupted if a stop was asked for."""
    if _pending is not None:
        raise Interrupted(_pending)
