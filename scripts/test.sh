#!/usr/bin/env bash
# Sets up, builds and runs kvkit's test suite.
#   scripts/test.sh             host tests, GPU tests (skipped without a GPU), examples, consumers
#   scripts/test.sh --sanitize  host tests and examples under AddressSanitizer + UBSan
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

if [[ ${1:-} == --sanitize ]]; then
  build=build/asan
  scripts/configure.sh "$build" -DKVKIT_SANITIZE=ON -DKVKIT_ENABLE_CUDA=OFF \
    -DKVKIT_BUILD_BENCHMARKS=OFF
else
  build=build/release
  scripts/configure.sh "$build"
fi
cmake --build "$build" --parallel "$(nproc)"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
ctest --test-dir "$build" --output-on-failure --parallel "$(nproc)"
