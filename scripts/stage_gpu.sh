#!/usr/bin/env bash
# Copies the GPU test and benchmark binaries of a build and its two GPU examples (decode_step,
# serving_sim; where built), without their debug information (their symbols stay, for the
# sanitizers' backtraces), with the shared libraries a bare GPU machine may lack (Google
# Benchmark, the CUDA runtime), into one folder laid out as the build is, to run elsewhere with
# scripts/gpu_check.sh.   scripts/stage_gpu.sh [BUILD_DIR] [STAGE_DIR]
set -euo pipefail
shopt -s nullglob
build=${1:-build/release}
stage=${2:-build/gpu-stage}
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/bench" "$stage/examples" "$stage/lib"
cp "$build/tests/kvkit_cuda_tests" "$stage/tests/"
cp "$build/bench/kvkit_bench_cuda" "$stage/bench/"
for example in decode_step serving_sim; do
  if [[ -f $build/examples/$example ]]; then
    cp "$build/examples/$example" "$stage/examples/"
  fi
done
for bin in "$stage"/tests/* "$stage"/bench/* "$stage"/examples/*; do
  strip --strip-debug "$bin"
  ldd "$bin" | awk '/libbenchmark|libcudart/ {print $3}' | xargs -r -I{} cp -L {} "$stage/lib/"
done
du -sh "$stage"
