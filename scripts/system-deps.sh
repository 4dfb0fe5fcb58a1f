#!/usr/bin/env bash
# Installs the system packages mlx-pager needs to build and run fast, where
# they are missing and the machine has apt-get (Debian, Ubuntu): a C++20
# compiler, a C compiler (csrc/mm/xxh3_*.c), Python's venv module and
# OpenBLAS (MLX's Linux CPU wheel bundles a reference BLAS ~10-30x slower for
# float32 matmuls; see docs/platforms.md, "On Linux CPUs: BLAS"). Elsewhere (macOS, other distributions) it only says what is
# missing. Used by scripts/demo.sh and .ci/run; with --ci also the lint
# tools (clang-format).
set -euo pipefail
need=()
[ "${1:-}" = --ci ] && { command -v clang-format > /dev/null || need+=(clang-format); }
command -v g++ > /dev/null || command -v c++ > /dev/null || need+=(g++)
command -v gcc > /dev/null || command -v cc > /dev/null || need+=(gcc)
python3 -c 'import venv, ensurepip' 2> /dev/null || need+=(python3-venv)
if [ "$(uname -s)" = Linux ]; then
  [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] ||
    [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] ||
    [ -e /usr/lib64/libopenblas.so.0 ] || need+=(libopenblas0-pthread)
fi
[ ${#need[@]} -eq 0 ] && exit 0
if command -v apt-get > /dev/null; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo > /dev/null; then SUDO="sudo"; else
      echo "system-deps: missing ${need[*]}; install them as root: apt-get install ${need[*]}" >&2
      exit 1
    fi
  fi
  echo "system-deps: installing ${need[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need[@]}"
else
  echo "system-deps: missing ${need[*]} (Debian package names); install their equivalents." >&2
  case " ${need[*]} " in *" g++ "*|*" gcc "*|*" python3-venv "*) exit 1 ;; esac  # cannot build without them
fi
