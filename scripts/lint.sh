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

if command -v "$CLANG_FORMAT" > /dev/null; then
  echo "=== clang-format ($("$CLANG_FORMAT" --version | head -1))"
  git ls-files -z 'csrc/*.h' 'csrc/*.c' 'csrc/*.cpp' 'tests/cpp/*.h' 'tests/cpp/*.cpp' ':!csrc/third_party/*' |
    xargs -0 "$CLANG_FORMAT" --dry-run -Werror || status=1
elif [ "${CI:-}" = true ]; then
  echo "lint: clang-format is missing (scripts/system-deps.sh --ci installs it)" >&2
  status=1
else
  echo "=== clang-format: not installed, C++ formatting not checked (Debian: apt-get install clang-format)"
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
RUFF_VERSION=0.17.6  # pinned: another version formats differently
if [ "$("$VENV/bin/python" -m ruff --version 2> /dev/null)" != "ruff $RUFF_VERSION" ]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "ruff==$RUFF_VERSION"
fi
RUFF=("$VENV/bin/python" -m ruff)
echo "=== ruff check ($("${RUFF[@]}" --version))"
"${RUFF[@]}" check python tests bench || status=1
echo "=== ruff format --check"
"${RUFF[@]}" format --check python tests bench || status=1

exit "$status"
