#!/usr/bin/env bash
# Lints mlx-pager: clang-format on the C++ (style in .clang-format) and ruff on
# the Python. Checks only; fix with `clang-format -i FILE` and `ruff format`.
# Uses the virtual environment .venv (MLX_PAGER_VENV overrides) and installs
# ruff into it when missing. The same checks run as pre-commit hooks
# (.pre-commit-config.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MLX_PAGER_VENV:-.venv}"
CLANG_FORMAT="${CLANG_FORMAT:-clang-format}"
status=0

echo "=== clang-format ($("$CLANG_FORMAT" --version | head -1))"
git ls-files -z 'csrc/*.h' 'csrc/*.cpp' 'tests/cpp/*.h' 'tests/cpp/*.cpp' |
  xargs -0 "$CLANG_FORMAT" --dry-run -Werror || status=1

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -m ruff --version > /dev/null 2>&1; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check ruff
fi
RUFF=("$VENV/bin/python" -m ruff)
echo "=== ruff check ($("${RUFF[@]}" --version))"
"${RUFF[@]}" check python tests bench || status=1
echo "=== ruff format --check"
"${RUFF[@]}" format --check python tests bench || status=1

exit "$status"
