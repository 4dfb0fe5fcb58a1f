"""mlx-pager: fine-tune MLX language models larger than memory.

The frozen base weights live on the SSD and are paged in one transformer
block at a time by a C++ pager (``mlx_pager._core``); adapters, optimizer
state, embeddings and the LM head stay resident.
"""

from . import blas

# Before libmlx is loaded: MLX's Linux CPU wheel then uses OpenBLAS (blas.py).
blas.STATE = blas.load_openblas()

import mlx.core  # noqa: E402,F401  (registers mx.array's nanobind casters first)

from ._core import Pager, SwapWriter, read_safetensors_index  # noqa: F401
from .trainer import PagedTrainer  # noqa: F401

__version__ = "0.1.0"
