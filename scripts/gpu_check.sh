#!/usr/bin/env bash
# Runs kvkit's GPU tests (plainly, then under compute-sanitizer memcheck and racecheck) and GPU
# benchmarks from a build, writing logs to LOG_DIR.
#   scripts/gpu_check.sh [BUILD_DIR] [LOG_DIR]     (defaults: build/release, gpu-logs)
# BUILD_DIR holds tests/kvkit_cuda_tests and bench/kvkit_bench_cuda, and lib/ with any shared
# libraries the machine lacks (scripts/stage_gpu.sh prepares such a folder).
set -uo pipefail
build=${1:-build/release}
logs=${2:-gpu-logs}
mkdir -p "$logs"
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv |
  tee "$logs/gpu.txt"

"$build/tests/kvkit_cuda_tests" 2>&1 | tee "$logs/cuda_tests.txt"
rc=${PIPESTATUS[0]}

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [[ -n $sanitizer ]]; then
  # The kernels under test; the 64 M-value conversion sweep and the decode page-size sweep are
  # left out (too slow instrumented; the other decode cases cover the same code paths).
  for tool in memcheck racecheck; do
    "$sanitizer" --tool "$tool" --error-exitcode 3 "$build/tests/kvkit_cuda_tests" \
      "~[conversions]~[sweep]" >"$logs/$tool.txt" 2>&1
    tool_rc=$?
    ran=$(grep -c "All tests passed" "$logs/$tool.txt")
    echo "compute-sanitizer $tool: exit $tool_rc, tests passed under it: $ran;" \
      "$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$tool.txt" | tail -1)" |
      tee -a "$logs/sanitizer.txt"
    if [[ $tool_rc -ne 0 || $ran -eq 0 ]]; then
      rc=1
    fi
  done
else
  echo "compute-sanitizer not found" | tee "$logs/sanitizer.txt"
fi

"$build/bench/kvkit_bench_cuda" --benchmark_out="$logs/bench_cuda.json" \
  --benchmark_out_format=json 2>&1 | tee "$logs/bench_cuda.txt"
exit "$rc"
