"""mx.compile's memory outside the process: where a compiled tail fits.

On MLX's CPU backend, mx.compile generates C++ for each fused kernel the
first time it meets one and builds it with the system compiler, in a child
process (the shared libraries are cached under the temp directory,
mlx/<version>/cpu, for later runs). That child is memory the budget does not
see: it is not this process's, yet a cgroup charges it. Measured on the bench
compute shape with a cold kernel cache: the compiler's processes peaked at
~120 MB, and the first step took 11 s longer. Under a hard cap equal to the
budget (tests/python/test_memory_cap.py) a compiled streamed tail got the
run killed. On a GPU backend (Metal, CUDA) the kernels are built in-process,
where the governor sees them.

So a tail (segment.Tail) is compiled on the CPU backend only where the
memory limit this process runs under (its cgroup's, else the machine's RAM)
leaves COMPILER_BYTES beyond its budget. The blocks' own compiled functions
(step.Blocks) are smaller and have always fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from .budget import format_size

# What the CPU backend's compiler took (bench compute shape, cold cache), and
# the room a compiled tail asks for beside the budget: twice that.
COMPILER_MEASURED_BYTES = 120 << 20
COMPILER_BYTES = 2 * COMPILER_MEASURED_BYTES

# cgroup v1 writes "no limit" as a huge page-aligned number.
_UNLIMITED = 1 << 62


def _read_limit(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        n = int(text)
    except ValueError:
        return None
    return n if 0 < n < _UNLIMITED else None


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> Optional[int]:
    """The tightest memory limit of this process's cgroup and its ancestors
    (v2 memory.max, or v1 memory.limit_in_bytes), in bytes; None where there
    is none or it cannot be read (not Linux, no memory controller)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    dirs = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, rel = parts
        if "memory" in controllers.split(","):
            dirs.append((root / "memory", rel, "memory.limit_in_bytes"))
        elif hid == "0" and controllers == "":
            dirs.append((root, rel, "memory.max"))
            dirs.append((root / "unified", rel, "memory.max"))
    limits = []
    for base, rel, name in dirs:
        d = base / rel.lstrip("/")
        while True:
            n = _read_limit(d / name)
            if n is not None:
                limits.append(n)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(limits) if limits else None


def memory_limit() -> Optional[int]:
    """What this process can be charged before it is killed: its cgroup's
    limit or the machine's RAM, the lesser (None: neither is known)."""
    try:
        import psutil

        ram = int(psutil.virtual_memory().total)
    except Exception:
        ram = None
    limits = [n for n in (cgroup_limit(), ram) if n]
    return min(limits) if limits else None


def tail_compile_refused(budget: Optional[int], limit: Optional[int] = None) -> Optional[str]:
    """None where a tail may be compiled (a GPU backend; or room for the CPU
    backend's compiler beside `budget`, the process's memory budget); else
    one line saying why not. `limit`: the memory limit (default
    memory_limit())."""
    if mx.default_device().type != mx.DeviceType.cpu or budget is None:
        return None
    limit = memory_limit() if limit is None else limit
    if limit is None or limit - budget >= COMPILER_BYTES:
        return None
    return (
        "the tail runs uncompiled: MLX's CPU backend compiles with the system compiler in a child process "
        f"(~{format_size(COMPILER_MEASURED_BYTES)} measured) that the {format_size(budget)} budget does not "
        f"count, and the memory limit ({format_size(limit)}) leaves no {format_size(COMPILER_BYTES)} for it"
    )
