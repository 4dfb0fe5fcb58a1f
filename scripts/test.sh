#!/usr/bin/env bash
# Runs every test of mlx-pager: the linters (scripts/lint.sh), the C++ core (plain, AddressSanitizer+UBSan,
# and ThreadSanitizer for the MLX-free part), then the Python tests.
# Creates/uses the virtual environment .venv (MLX_PAGER_VENV overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MLX_PAGER_VENV:-.venv}"
JOBS="${MLX_PAGER_JOBS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu)}"

step() { printf '\n=== %s\n' "$*"; }

step "Python environment ($VENV)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$(cd "$VENV/bin" && pwd)/python"
"$PY" -m pip install -q --disable-pip-version-check --upgrade pip
# The package (builds the extension) with its test extras, and the build
# tools the C++ test builds use.
"$PY" -m pip install -q --disable-pip-version-check ".[test]" \
  "scikit-build-core>=0.10" "nanobind==3.1.0" "cmake>=3.24" ninja
export PATH="$(dirname "$PY"):$PATH"

step "Lint (clang-format, ruff)"
MLX_PAGER_VENV="$VENV" ./scripts/lint.sh

cxx_tests() {  # name, sanitizers, with-mlx
  local dir="build/test-$1"
  step "C++ tests: $1"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DMLX_PAGER_BUILD_TESTS=ON -DMLX_PAGER_SANITIZE="$2" -DMLX_PAGER_WITH_MLX="$3" \
    -DPython_EXECUTABLE="$PY" > "$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  cmake --build "$dir" -j "$JOBS"
  (cd "$dir" && ctest --output-on-failure)
}

cxx_tests plain "" ON
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 cxx_tests asan "address,undefined" ON
# ThreadSanitizer maps fixed address ranges; on kernels with high ASLR
# entropy it needs randomisation off for the test binary.
if command -v setarch > /dev/null && setarch "$(uname -m)" -R true 2> /dev/null; then
  export MLX_PAGER_TSAN_WRAP="setarch $(uname -m) -R"
fi
step "C++ tests: tsan (MLX-free core)"
cmake -S . -B build/test-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMLX_PAGER_BUILD_TESTS=ON -DMLX_PAGER_SANITIZE=thread -DMLX_PAGER_WITH_MLX=OFF > /dev/null
cmake --build build/test-tsan -j "$JOBS"
TSAN_OPTIONS="halt_on_error=1" ${MLX_PAGER_TSAN_WRAP:-} build/test-tsan/mm_tests

# MLX's Linux CPU wheel bundles the reference BLAS; OpenBLAS, when installed,
# makes float32 matmuls ~10x faster (see python/mlx_pager/blas.py).
BLAS="$("$PY" -c 'from mlx_pager.blas import openblas_path; print(openblas_path() or "")')"

if [ "$(uname -s)" = Linux ] && [ $# -eq 0 ]; then
  # The extension built with AddressSanitizer and UBSan, under the Python
  # tests that drive the pager through its bindings: lifetimes across the boundary
  # (arrays viewing frames, leases, lazy pages, a Pager dropped first) are
  # what the C++ tests alone do not see. The ASan runtime comes first in the
  # process, and libstdc++ with it (its __cxa_throw interceptor needs it
  # loaded); the tests whose figures are the process's memory stay out
  # (ASan's own memory moves them). The quarantine of freed memory is 64 MB,
  # not ASan's 256: what it holds stays in the RSS the governor checks, and
  # with the start-up probes of gemma4_text's four kinds of blocks (kinds.py)
  # test_prefix's run went over the budget it derives from its page budget
  # (it passes alone, and with glibc's allocator). --capture=sys: a
  # sanitizer's report, written to fd 2 as it aborts, reaches the log.
  step "Python tests under ASan+UBSan (the extension's lifetimes)"
  dir=build/test-asan-py
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMLX_PAGER_BUILD_PYTHON=ON \
    -DMLX_PAGER_SANITIZE=address,undefined -DPython_EXECUTABLE="$PY" > "$dir.configure.log" 2>&1 \
    || { cat "$dir.configure.log"; exit 1; }
  cmake --build "$dir" -j "$JOBS" --target _core
  rm -rf "$dir/pkg" && mkdir -p "$dir/pkg"
  cp -r python/mlx_pager "$dir/pkg/" && rm -f "$dir"/pkg/mlx_pager/_core*.so
  cp "$dir"/_core*.so "$dir/pkg/mlx_pager/"
  cxx="$(grep -m1 '^CMAKE_CXX_COMPILER:' "$dir/CMakeCache.txt" | cut -d= -f2)"
  asan_rt="$(readlink -f "$("$cxx" -print-file-name=libasan.so)")"
  stdcxx="$(readlink -f "$("$cxx" -print-file-name=libstdc++.so.6)")"
  [ -f "$asan_rt" ] && [ -f "$stdcxx" ] || { echo "no ASan runtime found for $cxx"; exit 1; }
  # Left to the plain run below: parametrizations that repeat a path the
  # others cover (the slow part is MLX's 4-bit CPU products, not what ASan
  # checks: under ASan these took 57 of the step's 247 s).
  asan_skip=(
    "--deselect=tests/python/test_step.py::test_tail_segment_is_bitwise_mlx_lm_at_every_start[qwen2-4]"
    "--deselect=tests/python/test_step.py::test_tail_segment_is_bitwise_mlx_lm_at_every_start[qwen3-4]"
    "--deselect=tests/python/test_prefix.py::test_running_ahead_gives_mlx_lm_adapters[qwen3-4-float32-2]"
  )
  (cd tests/python && ASAN_OPTIONS=detect_leaks=0:quarantine_size_mb=64 UBSAN_OPTIONS=print_stacktrace=1 PYTHONPATH="$(cd "../../$dir/pkg" && pwd)" \
    LD_PRELOAD="$asan_rt:$stdcxx${BLAS:+:$BLAS}" \
    "$PY" -m pytest -q -p no:cacheprovider --capture=sys test_core.py test_step.py test_prefix.py test_store.py \
    "${asan_skip[@]}")
fi

step "Python tests"
if [ -n "$BLAS" ]; then export LD_PRELOAD="$BLAS${LD_PRELOAD:+:$LD_PRELOAD}"; fi
cd tests/python && "$PY" -m pytest -q -p no:cacheprovider "$@"
