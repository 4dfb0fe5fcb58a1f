"""Running a command under a hard memory cap: a child memory cgroup (v1 or
v2) of the test process's own, made for the command and removed after."""

import os
import subprocess
import time
from pathlib import Path
from typing import Optional, Tuple


def _own_cgroup() -> Tuple[Optional[Path], str]:
    """(directory of this process's memory cgroup, 'v1' or 'v2')."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            if root.exists():
                return root / path.lstrip("/"), "v1"
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                if (root / "cgroup.controllers").exists():
                    return root / path.lstrip("/"), "v2"
    return None, ""


def unavailable_reason() -> Optional[str]:
    """None if run_capped can work here, else why not."""
    if not os.path.exists("/proc/self/cgroup"):
        return "no /proc/self/cgroup (not Linux)"
    if os.geteuid() != 0:
        return "creating a memory cgroup needs root"
    parent, version = _own_cgroup()
    if parent is None:
        return "no memory cgroup controller is mounted"
    probe = parent / f"mlx_pager_probe_{os.getpid()}"
    try:
        probe.mkdir()
        limit = probe / ("memory.limit_in_bytes" if version == "v1" else "memory.max")
        if not limit.exists():
            return f"{version} memory controller not enabled for {parent}"
        limit.write_text(str(256 << 20))
    except OSError as e:
        return f"cannot create a memory cgroup under {parent}: {e}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


def run_capped(cmd, limit_bytes: int, timeout: float, env=None) -> Tuple[subprocess.CompletedProcess, int]:
    """Runs `cmd` in a new memory cgroup capped at `limit_bytes` (swap off).
    Returns (completed process, peak bytes the cgroup was charged)."""
    parent, version = _own_cgroup()
    cg = parent / f"mlx_pager_cap_{os.getpid()}_{time.monotonic_ns()}"
    cg.mkdir()
    try:
        if version == "v1":
            (cg / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = cg / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
            (cg / "memory.swappiness").write_text("0")
            procs, peak_file = cg / "cgroup.procs", cg / "memory.max_usage_in_bytes"
        else:
            (cg / "memory.max").write_text(str(limit_bytes))
            swap = cg / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
            procs, peak_file = cg / "cgroup.procs", cg / "memory.peak"

        def enter():
            procs.write_text(str(os.getpid()))

        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=enter, env=env)
        peak = int(peak_file.read_text()) if peak_file.exists() else -1
        return proc, peak
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
