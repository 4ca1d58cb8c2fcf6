#!/usr/bin/env bash
# Builds the C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer (g++) in build-asan/ and
# runs them. CPU only (AUTOMOE_CUDA=OFF), no Python extension. Extra arguments go to ctest, e.g.
#   scripts/sanitize.sh -R Safetensors
# LibTorch itself is not instrumented; what it leaks at exit is suppressed by
# tests/sanitize/lsan.supp (libtorch's own libraries only: never AutoMoE code).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=$PWD/.venv/bin/python
[ -x "$PY" ] || scripts/setup.sh
BUILD=${BUILD_ASAN:-build-asan}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g1"
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR=$PWD

if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DPython3_EXECUTABLE="$PY" -DCMAKE_BUILD_TYPE=Release \
    -DAUTOMOE_CUDA=OFF -DAUTOMOE_BUILD_PYTHON=OFF -DAUTOMOE_BUILD_TESTS=ON \
    -DAUTOMOE_PYTHON_OUT="$PWD/$BUILD/python/automoe" \
    -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN"
fi

# gtest_discover_tests runs the test binary at build time: the sanitizer options apply there too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/sanitize/lsan.supp:print_suppressions=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

start=$(date +%s)
cmake --build "$BUILD" --target automoe_tests -j "${SANITIZE_JOBS:-2}"
echo "sanitize: build took $(($(date +%s) - start)) s"

cd "$BUILD"
ctest --output-on-failure -j "${SANITIZE_JOBS:-2}" "$@"
