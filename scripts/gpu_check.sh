#!/usr/bin/env bash
# kvkit's GPU run of record, in one call: the GPU tests (and the [first_launch] cases once more,
# each in a process of its own), the two GPU examples (serving_sim a second time on a short trace
# with every kernel in its debug mode and preemption by swap through the copy engines), PyTorch's
# SDPA as the decode and prefill benchmarks' peer where torch is installed, every GPU benchmark,
# the decode targets checked against that run, and last the GPU tests under compute-sanitizer memcheck and
# racecheck. Logs and data go to LOG_DIR (its files of an earlier run are replaced).
#   scripts/gpu_check.sh [BUILD_DIR] [LOG_DIR]     (defaults: build/release, gpu-logs)
# Run it from the repository root. BUILD_DIR holds tests/kvkit_cuda_tests,
# bench/kvkit_bench_cuda, examples/ with decode_step and serving_sim, and lib/
# with any shared libraries the machine lacks (scripts/stage_gpu.sh prepares such a folder).
# Where BUILD_DIR has a ptx/ folder (stage_gpu.sh's third argument: a build of compute_80 PTX), its
# GPU tests and the three example runs follow the benchmarks, each bounded by KVKIT_PTX_TIMEOUT
# seconds (default 300; the driver compiles the PTX of each kernel at its first launch, and keeps it
# in its cache for the later runs), and count towards the exit status.
# KVKIT_SANITIZE_CASES picks the test cases run under the sanitizers (default: all but the
# conversion sweep and the decode page-size sweep, too slow instrumented, the other decode cases
# covering the same code paths, and the [pending_error] cases, whose failed launches on purpose
# memcheck reports as API errors); KVKIT_SANITIZE_TOOLS names the tools run (default "memcheck
# racecheck" where it is unset; set and empty: none); KVKIT_SANITIZE_TIMEOUT bounds each tool's
# run in seconds (default 320; a tool stopped by the bound names the case it was in, in its log).
# On an H200 (2026-12-06) the steps before the sanitizers took about 200 s, memcheck about 40 and
# racecheck about 320 over the default cases; on an H100 of 2026-12-07, with the beside-a-decode
# rows, the steps before the sanitizers took about 6 minutes, and memcheck more than 150 s and
# racecheck more than 330 s (each stopped by its bound), so in calls of at most 600 s run the check
# with KVKIT_SANITIZE_TOOLS="" and each sanitizer in a call of its own (a staged PTX build's tests
# took 155 s on an H100 on 2026-12-05 and 156 s with the 47 cases of 2026-12-07, compilation
# included: a call of their own too). The exit status is 0 only if the tests (the [first_launch]
# runs too), the three example runs (and the PTX build's, where staged) and the sanitizers named
# ran and passed.
set -uo pipefail
build=${1:-build/release}
logs=${2:-gpu-logs}
ptx_timeout=${KVKIT_PTX_TIMEOUT:-300}
mkdir -p "$logs"
: >"$logs/examples.txt"
: >"$logs/sanitizer.txt"
: >"$logs/sdpa.txt"
export LD_LIBRARY_PATH="$build/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u '+%Y-%m-%d %H:%M UTC'
  git describe --always --dirty 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
} 2>&1 | tee "$logs/gpu.txt"

"$build/tests/kvkit_cuda_tests" --durations yes 2>&1 | tee "$logs/cuda_tests.txt"
rc=${PIPESTATUS[0]}
tests_rc=$rc
# The [first_launch] cases once more, each in a process of its own (a kernel's first launch then
# inside a stream capture).
here=$(cd "$(dirname "$0")" && pwd)
"$here/../tests/cuda/each_case_alone.sh" "$build/tests/kvkit_cuda_tests" "[first_launch]" 2>&1 |
  tee "$logs/first_launch.txt"
first_rc=${PIPESTATUS[0]}
[[ $first_rc -eq 0 ]] || rc=1

# The examples of build folder $1, each run under `timeout $2` (0: no bound) and logged with the
# prefix $3; serving_sim once more on a shorter trace in less KV memory, with every kernel in its
# debug mode and preemption by swap (a host tier; swap_blocks_copy_engines).
run_examples() {
  local run example args bin log example_rc
  for run in decode_step serving_sim \
    "serving_sim --requests 300 --check-pages --preempt swap --kv-tokens 16384"; do
    read -r example args <<<"$run"
    bin="$1/examples/$example"
    if [[ ! -x $bin ]]; then
      echo "$3$run: $bin not found" | tee -a "$logs/examples.txt"
      rc=1
      continue
    fi
    log="$logs/$3${example}${args:+_checked}.txt"
    # shellcheck disable=SC2086 # args are words
    timeout "$2" "$bin" $args >"$log" 2>&1
    example_rc=$?
    echo "$3$run: exit $example_rc" | tee -a "$logs/examples.txt"
    tail -5 "$log"
    [[ $example_rc -eq 0 ]] || rc=1
  done
}
run_examples "$build" 0 ""

# The decode rows beside their SDPA peer, measured in this call, then every other GPU benchmark.
if python3 -c "import torch" 2>/dev/null &&
  python3 "$here/../bench/cuda/sdpa_peer.py" "$logs/sdpa.csv" >"$logs/sdpa.txt" 2>&1; then
  export KVKIT_SDPA_CSV="$logs/sdpa.csv"
else
  echo "no SDPA peer this run (torch missing or its script failed; see sdpa.txt)" |
    tee -a "$logs/sdpa.txt"
fi
"$build/bench/kvkit_bench_cuda" --benchmark_filter=paged_decode \
  --benchmark_out="$logs/bench_decode.json" --benchmark_out_format=json 2>&1 |
  tee "$logs/bench_decode.txt"
python3 "$here/decode_targets.py" "$logs/bench_decode.json" 2>&1 | tee "$logs/targets.txt"
# The prefill rows beside their SDPA peer, measured in this call.
: >"$logs/sdpa_prefill.txt"
if python3 -c "import torch" 2>/dev/null &&
  python3 "$here/../bench/cuda/sdpa_prefill_peer.py" "$logs/sdpa_prefill.csv" \
    >"$logs/sdpa_prefill.txt" 2>&1; then
  export KVKIT_SDPA_PREFILL_CSV="$logs/sdpa_prefill.csv"
else
  echo "no SDPA prefill peer this run (see sdpa_prefill.txt)" | tee -a "$logs/sdpa_prefill.txt"
fi
"$build/bench/kvkit_bench_cuda" --benchmark_filter=paged_prefill \
  --benchmark_out="$logs/bench_prefill.json" --benchmark_out_format=json 2>&1 |
  tee "$logs/bench_prefill.txt"
"$build/bench/kvkit_bench_cuda" --benchmark_filter='^(BM_|write_kv|quantize_pages|dequantize_pages|decode_beside_swap)' \
  --benchmark_out="$logs/bench_cuda.json" --benchmark_out_format=json 2>&1 |
  tee "$logs/bench_cuda.txt"
# The PTX build, where staged: the paths of devices before Hopper (no cluster merge, no dependent
# launch), compiled for this GPU by its driver.
ptx_tests_rc=
if [[ -d $build/ptx ]]; then
  export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296} # every kernel's compiled PTX kept
  timeout "$ptx_timeout" "$build/ptx/tests/kvkit_cuda_tests" --durations yes \
    >"$logs/ptx_cuda_tests.txt" 2>&1
  ptx_tests_rc=$?
  echo "PTX build's GPU tests: exit $ptx_tests_rc; $(grep -E "^(All tests passed|test cases:)" \
    "$logs/ptx_cuda_tests.txt" | tail -1)" | tee -a "$logs/examples.txt"
  [[ $ptx_tests_rc -eq 0 ]] || rc=1
  run_examples "$build/ptx" "$ptx_timeout" ptx_
fi
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
tools=${KVKIT_SANITIZE_TOOLS-memcheck racecheck}
if [[ -z ${tools// /} ]]; then
  echo "no sanitizer run (KVKIT_SANITIZE_TOOLS is empty)" | tee "$logs/sanitizer.txt"
elif [[ -n $sanitizer ]]; then
  cases=${KVKIT_SANITIZE_CASES:-"~[conversions]~[sweep]~[pending_error]"}
  # shellcheck disable=SC2086 # the tools' names are words
  for tool in $tools; do
    timeout "${KVKIT_SANITIZE_TIMEOUT:-320}" "$sanitizer" --tool "$tool" --error-exitcode 3 \
      "$build/tests/kvkit_cuda_tests" "$cases" --durations yes >"$logs/$tool.txt" 2>&1
    tool_rc=$?
    ran=$(grep -c "All tests passed" "$logs/$tool.txt")
    echo "compute-sanitizer $tool over '$cases': exit $tool_rc, tests passed under it: $ran;" \
      "$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/$tool.txt" | tail -1)" |
      tee -a "$logs/sanitizer.txt"
    if [[ $tool_rc -ne 0 || $ran -eq 0 ]]; then
      rc=1
    fi
  done
else
  echo "compute-sanitizer not found" | tee "$logs/sanitizer.txt"
  rc=1
fi
# One summary of the verdicts, last in the output and in summary.txt.
{
  echo "gpu_check: GPU tests exit $tests_rc, the [first_launch] cases alone $first_rc${ptx_tests_rc:+,}" \
    "${ptx_tests_rc:+the PTX build of the tests $ptx_tests_rc};" \
    "$(grep -c ': exit 0$' "$logs/examples.txt") of $([[ -n $ptx_tests_rc ]] && echo 6 || echo 3)" \
    "example runs passed; exit $rc"
  cat "$logs/examples.txt" "$logs/sanitizer.txt"
} | tee "$logs/summary.txt"
exit "$rc"
