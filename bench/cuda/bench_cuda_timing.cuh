#pragma once
// Shared helpers of the GPU benchmarks: a device check and event timing of a peer operation.

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

namespace kvkit_bench {

inline bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// The middle element of `v` (the upper middle for an even count); `v` must not be empty.
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Median seconds of `fn` (work queued on `stream`) over `reps` runs timed with CUDA events,
// after one warm-up run.
template <class F>
double median_seconds(F&& fn, int reps = 15, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    float ms = 0;
    if (cudaEventSynchronize(b) != cudaSuccess || cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
      // A failed run (a fault in `fn`) has no time: NaN, never a figure.
      cudaEventDestroy(a);
      cudaEventDestroy(b);
      return std::numeric_limits<double>::quiet_NaN();
    }
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(std::move(t)) * 1e-3;
}

// The benchmark loop of GPU launches: each iteration times `calls` back-to-back calls of `launch`
// (which returns the launch's cudaError_t) between two CUDA events and reports the time per call
// as manual time, a call being `per_launch` calls of the kernel measured (a graph's replay of
// several); stops with an error on failure, a launch's or one the device reports at the wait.
// Returns the per-call seconds of each iteration. The events go to `stream`, the stream `launch`
// queues its work on. With `host_per_call`, also the host's seconds per call to queue the loop (the
// calls, not the wait for them): where they come near the event time, the loop measures how fast
// the host launches, not the kernel.
template <class Launch>
std::vector<double> time_launches(benchmark::State& state, Launch&& launch, int calls = 1,
                                  cudaStream_t stream = nullptr,
                                  std::vector<double>* host_per_call = nullptr,
                                  int per_launch = 1) {
  std::vector<double> per_call;
  cudaEvent_t a, e;
  cudaEventCreate(&a);
  cudaEventCreate(&e);
  for (auto _ : state) {
    cudaEventRecord(a, stream);
    cudaError_t err = cudaSuccess;
    const auto queued_from = std::chrono::steady_clock::now();
    for (int c = 0; c < calls && err == cudaSuccess; ++c) {
      err = launch();
    }
    if (host_per_call != nullptr) {
      const std::chrono::duration<double> queued = std::chrono::steady_clock::now() - queued_from;
      host_per_call->push_back(queued.count() / calls);
    }
    cudaEventRecord(e, stream);
    const cudaError_t waited = cudaEventSynchronize(e);
    float ms = 0;
    if (err == cudaSuccess) {
      err = waited != cudaSuccess ? waited : cudaEventElapsedTime(&ms, a, e);
    }
    if (err != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(err));
      per_call.clear(); // no figure from a run that failed
      break;
    }
    per_call.push_back(ms * 1e-3 / (static_cast<double>(calls) * per_launch));
    state.SetIterationTime(per_call.back());
  }
  cudaEventDestroy(a);
  cudaEventDestroy(e);
  return per_call;
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
