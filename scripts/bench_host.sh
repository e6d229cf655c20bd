#!/usr/bin/env bash
# Builds the host benchmarks the way an engine's release build compiles kvkit (-O3, assertions
# off) in build/bench, and runs them: scripts/bench_host.sh [Google Benchmark arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/configure.sh build/bench -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="-O3 -DNDEBUG" >/dev/null
cmake --build build/bench --target kvkit_bench_host
exec build/bench/bench/kvkit_bench_host "$@"
