"""Faster float32 matmuls for MLX's Linux CPU backend.

The ``mlx[cpu]`` wheel for Linux links the reference (netlib) BLAS it
bundles, which runs sgemm at a few GFLOP/s; OpenBLAS on the same machine is
about 10x faster. libmlx resolves ``cblas_sgemm`` and friends dynamically,
so loading OpenBLAS's ``libblas.so.3`` into the global symbol scope before
libmlx is loaded makes MLX use it without any change to MLX:

- ``import mlx_pager`` does this itself (``ctypes.CDLL(..., RTLD_GLOBAL)``)
  when it is imported before ``mlx``, so ``PagedTrainer`` gets it too;
- the CLI re-executes itself once with LD_PRELOAD set, which also covers
  child processes;
- when neither can apply (OpenBLAS not installed, or ``mlx`` imported
  first), ``warn_once()`` says so, with the fix, the first time a run starts.

OpenBLAS on Debian/Ubuntu: ``apt-get install libopenblas0-pthread``.

Set MLX_PAGER_OPENBLAS=0 to keep MLX's bundled BLAS. Nothing here runs on
macOS, where MLX uses Accelerate and Metal.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
]


def openblas_path() -> Optional[str]:
    """The OpenBLAS library to preload, or None (not Linux, not installed,
    or turned off with MLX_PAGER_OPENBLAS=0)."""
    if not sys.platform.startswith("linux") or os.environ.get("MLX_PAGER_OPENBLAS") == "0":
        return None
    return next((p for p in CANDIDATES if os.path.exists(p)), None)


def _mapped(lib: str) -> bool:
    """Whether `lib` (or any OpenBLAS) is mapped into this process."""
    try:
        maps = open("/proc/self/maps").read()
    except OSError:
        return False
    return os.path.realpath(lib) in maps or "openblas" in maps


def load_openblas() -> str:
    """Loads OpenBLAS into the global symbol scope if libmlx is not loaded
    yet. Returns the state: "active", "late" (MLX was loaded first with its
    bundled BLAS), "missing" (Linux without OpenBLAS), "off"
    (MLX_PAGER_OPENBLAS=0) or "n/a" (not Linux)."""
    if not sys.platform.startswith("linux"):
        return "n/a"
    if os.environ.get("MLX_PAGER_OPENBLAS") == "0":
        return "off"
    lib = openblas_path()
    if lib is None:
        return "missing"
    if _mapped(lib):
        return "active"
    if "mlx.core" in sys.modules:
        return "late"
    import ctypes

    try:
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except OSError:
        return "missing"
    return "active"


# Thread counts a user may have set, which share_cores leaves alone.
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "GOTO_NUM_THREADS")


def ranks_on_this_host(env=None) -> int:
    """How many ranks of a distributed run share this machine (1 outside
    one): MPI's OMPI_COMM_WORLD_LOCAL_SIZE, or for mlx.launch's ring
    backend the ranks whose address in MLX_HOSTFILE (a JSON list, one entry
    per rank: "ip:port" or a list of them) has this rank's (MLX_RANK) IP."""
    env = os.environ if env is None else env
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "").isdigit():
        return max(1, int(env["OMPI_COMM_WORLD_LOCAL_SIZE"]))
    path, rank = env.get("MLX_HOSTFILE"), env.get("MLX_RANK", "")
    if not path or not rank.isdigit():
        return 1
    try:
        with open(path) as f:
            hosts = json.load(f)
    except (OSError, ValueError):
        return 1

    def ip(entry):
        first = entry[0] if isinstance(entry, list) and entry else entry
        return first.rsplit(":", 1)[0] if isinstance(first, str) else None

    if not isinstance(hosts, list) or int(rank) >= len(hosts) or ip(hosts[int(rank)]) is None:
        return 1
    return sum(ip(h) == ip(hosts[int(rank)]) for h in hosts)


def share_cores(env=None) -> Optional[int]:
    """Where several ranks share this machine, gives OpenBLAS this rank's
    share of its cores, unless the user set a thread count (THREAD_VARS).
    OpenBLAS starts a thread per core and they spin while they wait: two
    ranks on a 2-core machine, each with two threads, trained at 0.31x one
    rank's throughput (bench_distributed; 0.52x with a thread each).
    Returns the threads set, or None."""
    env = os.environ if env is None else env
    if STATE != "active" or any(v in env for v in THREAD_VARS):
        return None
    local = ranks_on_this_host(env)
    if local <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    import ctypes

    try:
        # dlsym on the library's handle also searches what it links
        # (Debian's libblas.so.3 is a front for libopenblas.so.0).
        set_threads = ctypes.CDLL(openblas_path(), mode=os.RTLD_GLOBAL).openblas_set_num_threads
    except (OSError, AttributeError, TypeError):
        return None
    n = max(1, cores // local)
    set_threads(ctypes.c_int(n))
    return n


STATE = "n/a"  # set by mlx_pager/__init__.py at import
_warned = False


def warn_once() -> None:
    """Tells the user, once per process, when MLX's float32 matmuls run on
    the slow bundled BLAS, and how to fix it."""
    global _warned
    if _warned or STATE not in ("missing", "late"):
        return
    _warned = True
    if STATE == "missing":
        fix = "install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread)"
    else:
        fix = "import mlx_pager before mlx, or start Python with LD_PRELOAD=" + str(openblas_path())
    print(
        f"mlx-pager: warning: MLX's Linux CPU wheel runs float32 matmuls on its bundled reference BLAS "
        f"(~10-30x slower than OpenBLAS); to fix, {fix}. Set MLX_PAGER_OPENBLAS=0 to silence.",
        file=sys.stderr,
    )


def preloaded() -> bool:
    lib = openblas_path()
    return lib is not None and lib in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas() -> None:
    """Replaces this process by itself with OpenBLAS preloaded, once."""
    lib = openblas_path()
    if lib is None or preloaded() or os.environ.get("_MLX_PAGER_REEXEC"):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{lib}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else lib
    env["_MLX_PAGER_REEXEC"] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "mlx_pager.cli", *sys.argv[1:]], env)
