#!/usr/bin/env bash
# Installs mlx-pager into .venv and runs the main job, offline: it generates
# (once, cached) a model several times larger than a memory budget, then
# LoRA-trains it under that budget and prints what the pager did.
# Arguments are passed to `mlx-pager demo` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/system-deps.sh  # compiler, venv, OpenBLAS: no manual step on a fresh machine
VENV="${MLX_PAGER_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check .
exec "$VENV/bin/mlx-pager" demo "$@"
