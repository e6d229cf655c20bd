#pragma once
// Shared helpers of the GPU benchmarks: a device check and event timing of a peer operation.

#include <algorithm>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

namespace kvkit_bench {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Median seconds of `fn` (work queued on stream 0) over `reps` runs timed with CUDA events,
// after one warm-up run.
template <class F>
double median_seconds(F&& fn, int reps = 15) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[static_cast<std::size_t>(reps / 2)] * 1e-3;
}

// The benchmark loop of a GPU launch: times each iteration of `launch` (which returns the launch's
// cudaError_t) with CUDA events and reports it as manual time; stops with an error on failure.
template <class Launch>
void time_launches(benchmark::State& state, Launch&& launch) {
  cudaEvent_t a, e;
  cudaEventCreate(&a);
  cudaEventCreate(&e);
  for (auto _ : state) {
    cudaEventRecord(a);
    const cudaError_t err = launch();
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    if (err != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(err));
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, a, e);
    state.SetIterationTime(ms * 1e-3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(e);
}

// Counters of a bandwidth benchmark: effective bytes/s, the same-run memcpy peer (TB/s) and the
// ratios to it and to `target` bytes/s (rates, so Google Benchmark divides by the time).
inline void report_bandwidth(benchmark::State& state, double bytes, double peer_rate,
                             double target) {
  state.counters["bytes/s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_TB/s"] = peer_rate / 1e12;
  state.counters["x_memcpy"] =
      benchmark::Counter(bytes / peer_rate, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["x_target"] =
      benchmark::Counter(bytes / target, benchmark::Counter::kIsIterationInvariantRate);
}

} // namespace kvkit_bench
