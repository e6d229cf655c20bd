#!/usr/bin/env bash
# Copies the GPU test and benchmark binaries of a build and its two GPU examples (decode_step,
# serving_sim; where built), without their debug information (their symbols stay, for the
# sanitizers' backtraces), with the shared libraries a bare GPU machine may lack (Google
# Benchmark, the CUDA runtime), into one folder laid out as the build is, to run elsewhere with
# scripts/gpu_check.sh. PTX_BUILD_DIR, where given, is a second build of PTX only (configured with
# -DCMAKE_CUDA_ARCHITECTURES=80-virtual: the paths of devices before Hopper, compiled for the GPU
# at its first launch); its GPU tests and examples go to STAGE_DIR/ptx, where gpu_check.sh runs
# them too.   scripts/stage_gpu.sh [BUILD_DIR] [STAGE_DIR] [PTX_BUILD_DIR]
set -euo pipefail
shopt -s nullglob
build=${1:-build/release}
stage=${2:-build/gpu-stage}
ptx_build=${3:-}
rm -rf "$stage"
mkdir -p "$stage/tests" "$stage/bench" "$stage/examples" "$stage/lib"
cp "$build/tests/kvkit_cuda_tests" "$stage/tests/"
cp "$build/bench/kvkit_bench_cuda" "$stage/bench/"
# The examples of build $1, where built, into $2/examples.
copy_examples() {
  for example in decode_step serving_sim; do
    if [[ -f $1/examples/$example ]]; then
      cp "$1/examples/$example" "$2/examples/"
    fi
  done
}
copy_examples "$build" "$stage"
if [[ -n $ptx_build ]]; then
  mkdir -p "$stage/ptx/tests" "$stage/ptx/examples"
  cp "$ptx_build/tests/kvkit_cuda_tests" "$stage/ptx/tests/"
  copy_examples "$ptx_build" "$stage/ptx"
fi
for bin in "$stage"/tests/* "$stage"/bench/* "$stage"/examples/* "$stage"/ptx/*/*; do
  strip --strip-debug "$bin"
  ldd "$bin" | awk '/libbenchmark|libcudart/ {print $3}' | xargs -r -I{} cp -L {} "$stage/lib/"
done
du -sh "$stage"
