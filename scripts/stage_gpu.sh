#!/usr/bin/env bash
# Copies the GPU test and benchmark binaries of a build and its two GPU examples (decode_step,
# serving_sim; where built), stripped, with the shared libraries a bare GPU machine may lack
# (Google Benchmark, the CUDA runtime), into one folder to run elsewhere with scripts/gpu_check.sh.
#   scripts/stage_gpu.sh [BUILD_DIR] [STAGE_DIR]
set -euo pipefail
build=${1:-build/release}
stage=${2:-build/gpu-stage}
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/bench" "$stage/ex" "$stage/lib"
cp "$build/tests/kvkit_cuda_tests" "$stage/tests/"
cp "$build/bench/kvkit_bench_cuda" "$stage/bench/"
for example in decode_step serving_sim; do
  if [[ -f $build/examples/$example ]]; then
    cp "$build/examples/$example" "$stage/ex/"
  fi
done
strip "$stage"/tests/* "$stage"/bench/* "$stage"/ex/* 2>/dev/null || true
for bin in "$stage"/tests/* "$stage"/bench/* "$stage"/ex/*; do
  ldd "$bin" | awk '/libbenchmark|libcudart/ {print $3}' | xargs -r -I{} cp -L {} "$stage/lib/"
done
du -sh "$stage"
