"""Faster float32 matmuls for MLX's Linux CPU backend.

The ``mlx[cpu]`` wheel for Linux links the reference (netlib) BLAS it
bundles, which runs sgemm at a few GFLOP/s; OpenBLAS on the same machine is
about 10x faster. libmlx resolves ``cblas_sgemm`` and friends dynamically,
so preloading OpenBLAS's ``libblas.so.3`` makes MLX use it without any
change to MLX. The library must be loaded before the process starts, so
the CLI re-executes itself once with LD_PRELOAD set when OpenBLAS is
installed (Debian: ``apt-get install libopenblas0-pthread``).

Set MLX_PAGER_OPENBLAS=0 to keep MLX's bundled BLAS. Nothing here runs on
macOS, where MLX uses Accelerate and Metal.
"""

from __future__ import annotations

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
