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

So on the CPU backend the step (the tail, segment.Tail, and the blocks'
compiled functions, step.Blocks) is compiled only where the memory limit
this process runs under (its cgroup's, else the machine's RAM) leaves
COMPILER_BYTES beyond its budget. The blocks' kernels alone were thought to
fit always; a sweep in session 46 had the compiler killed for them under a
hard cap equal to the least budget (phi3 bf16, batch 4 x 256, 169 MB), and
the run died with it.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .budget import format_size
from .memlimit import memory_limit

# What the CPU backend's compiler took (bench compute shape, cold cache), and
# the room a compiled tail asks for beside the budget: twice that.
COMPILER_MEASURED_BYTES = 120 << 20
COMPILER_BYTES = 2 * COMPILER_MEASURED_BYTES


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
        "the step runs uncompiled: MLX's CPU backend compiles with the system compiler in a child process "
        f"(~{format_size(COMPILER_MEASURED_BYTES)} measured) that the {format_size(budget)} budget does not "
        f"count, and the memory limit ({format_size(limit)}) leaves no {format_size(COMPILER_BYTES)} for it"
    )
