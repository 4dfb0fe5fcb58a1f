"""What this process may be charged before it is killed, and the default
budget drawn from it.

A process is bounded by its memory cgroup (a container's or a systemd
unit's limit, on Linux; the tightest of its cgroup and the cgroup's
ancestors) and by the machine's RAM. The default --memory-budget is 80% of
the lesser: a run in a container capped below RAM then plans for the cap,
where 80% of RAM would page too little and be killed by the kernel.

The cgroup reading is the one platform-specific part; where there is no
cgroup file system (macOS, Windows) the limit is the machine's RAM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from .budget import format_size, parse_size

# cgroup v1 writes "no limit" as a huge page-aligned number.
_UNLIMITED = 1 << 62

# What limit_and_source names as the limit where the cgroup's is below RAM.
CGROUP = "the memory cgroup's limit"

# The default budget's share of the memory limit (MLX's own default memory
# limit is the same share of RAM).
DEFAULT_SHARE = 0.8


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


def physical_memory() -> Optional[int]:
    """The machine's RAM in bytes (None where psutil cannot tell)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total) or None
    except Exception:
        return None


def limit_and_source() -> Tuple[Optional[int], str]:
    """(what this process can be charged before it is killed, what sets it):
    the cgroup's limit where it is below RAM ("the memory cgroup's limit"),
    else RAM ("RAM"); (None, "") where neither is known."""
    cg, ram = cgroup_limit(), physical_memory()
    if cg is not None and (ram is None or cg < ram):
        return cg, CGROUP
    if ram is not None:
        return ram, "RAM"
    return None, ""


def memory_limit() -> Optional[int]:
    """What this process can be charged before it is killed: its cgroup's
    limit or the machine's RAM, the lesser (None: neither is known)."""
    return limit_and_source()[0]


def default_budget() -> int:
    """The budget when none is given: 80% of memory_limit()."""
    limit = memory_limit()
    if limit is None:
        raise RuntimeError("cannot tell this machine's memory: pass --memory-budget")
    return int(DEFAULT_SHARE * limit)


def budget_or_default(memory_budget) -> int:
    """The budget in bytes: `memory_budget` as given ("12GB", bytes), or
    default_budget() where it is None."""
    return parse_size(memory_budget) if memory_budget is not None else default_budget()


def default_budget_text() -> str:
    """Where the default budget comes from, for a run's header and its
    errors: '80% of RAM' or "80% of the memory cgroup's 700.00MB limit"."""
    limit, source = limit_and_source()
    share = f"{DEFAULT_SHARE:.0%}"
    if source == CGROUP:
        return f"{share} of the memory cgroup's {format_size(limit)} limit"
    return f"{share} of RAM"


def budget_named(budget: int, given: bool) -> str:
    """The budget as an error names it: the flag, or the default and where
    it comes from (a user who passed no --memory-budget did not choose it)."""
    if given:
        return f"--memory-budget {format_size(budget)}"
    return f"the default memory budget {format_size(budget)} ({default_budget_text()})"


def raise_advice(need: int, given: bool) -> str:
    """What to do about a budget below `need` bytes: a larger
    --memory-budget where the memory limit allows one, else a larger limit
    (advice past the limit would have the kernel kill the run)."""
    want = format_size(need, up=True)
    limit, source = limit_and_source()
    if limit is not None and need > limit:
        where = CGROUP if source == CGROUP else "this machine's RAM"
        return (
            f"This process may use at most {format_size(limit)} ({where}): raise that to {want} or more and "
            f"pass --memory-budget {want}"
        )
    if given:
        return f"Raise it to {want} or more"
    upto = f" (up to {format_size(limit)})" if limit is not None else ""
    return f"Pass --memory-budget {want} or more{upto}"
