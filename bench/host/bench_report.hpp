#pragma once
// Counters that put a measured figure beside its target or peer, from the same run.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace kvkit_bench {

// Reports `target_rate` (items per second) and the ratio measured/target, which reads >= 1 when
// the target is met. Google Benchmark divides a rate counter by the measured time, so a counter
// of items/target_rate comes out as (items/s)/target_rate.
inline void report_rate_target(benchmark::State& state, double items, double target_rate) {
  state.counters["target/s"] = benchmark::Counter(target_rate);
  state.counters["x_target"] = benchmark::Counter(items / target_rate, benchmark::Counter::kIsRate);
}

// One iteration of a benchmark timed by hand (UseManualTime): runs `fn`, reports its wall time as
// the iteration's time, appends it to `seconds` and returns what `fn` returned.
template <class F>
auto timed_iteration(benchmark::State& state, std::vector<double>& seconds, F&& fn) {
  const auto start = std::chrono::steady_clock::now();
  auto result = fn();
  const auto stop = std::chrono::steady_clock::now();
  seconds.push_back(std::chrono::duration<double>(stop - start).count());
  state.SetIterationTime(seconds.back());
  return result;
}

// Reports, beside Google Benchmark's mean, the rate at the median of `seconds` (the wall time of
// each iteration, timed by hand) and its ratio to `target_rate`. On a shared machine, work of other
// tenants lands in some iterations and pulls the mean down; the median shows the code's own speed.
inline void report_median_rate_target(benchmark::State& state, std::vector<double> seconds,
                                      double items_per_iteration, double target_rate) {
  if (seconds.empty()) {
    return;
  }
  const auto mid = seconds.begin() + static_cast<std::ptrdiff_t>(seconds.size() / 2);
  std::nth_element(seconds.begin(), mid, seconds.end());
  const double rate = items_per_iteration / *mid;
  state.counters["median_us"] = benchmark::Counter(*mid * 1e6);
  state.counters["median/s"] = benchmark::Counter(rate);
  state.counters["x_target_median"] = benchmark::Counter(rate / target_rate);
}

// Reports a per-iteration time target (in microseconds) and the ratio target/measured, which
// reads >= 1 when the target is met.
inline void report_time_target(benchmark::State& state, double target_us) {
  state.counters["target_us"] = benchmark::Counter(target_us);
  state.counters["x_target"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * target_us * 1e-6, benchmark::Counter::kIsRate);
}

// Reports a peer's per-iteration time (microseconds, measured by the caller in the same run) and
// the ratio peer/measured: 1 means as fast as the peer.
inline void report_peer_time(benchmark::State& state, const char* name, double peer_us) {
  state.counters[std::string(name) + "_us"] = benchmark::Counter(peer_us);
  state.counters[std::string("x_") + name] = benchmark::Counter(
      static_cast<double>(state.iterations()) * peer_us * 1e-6, benchmark::Counter::kIsRate);
}

// Median wall time of `fn` in microseconds over `reps` runs, after one warm-up run.
template <class F>
double median_us(F&& fn, int reps = 101) {
  fn();
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const auto stop = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
  }
  std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
  return t[static_cast<std::size_t>(reps / 2)];
}

} // namespace kvkit_bench
