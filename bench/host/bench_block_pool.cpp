// block_pool throughput: allocate + release pairs per second on one core (target >= 100 M/s).

#include <array>
#include <vector>

#include <benchmark/benchmark.h>

#include "host/bench_report.hpp"
#include "kvkit/block/block_pool.hpp"

namespace {

constexpr double pool_target_pairs_per_s = 100e6;

// Single-block allocate then release, in bursts of 64 live blocks (a decode step's worth of new
// pages), over a pool that is half in use so ids are scattered.
void BM_pool_allocate_release(benchmark::State& state) {
  kvkit::block_pool pool(1 << 16);
  std::vector<kvkit::block_id> held(1 << 15);
  if (!pool.allocate(held).ok()) {
    state.SkipWithError("setup allocation failed");
    return;
  }
  std::array<kvkit::block_id, 64> burst{};
  for (auto _ : state) {
    for (auto& id : burst) {
      id = *pool.allocate();
    }
    for (const auto id : burst) {
      (void)pool.release(id);
    }
    benchmark::ClobberMemory();
  }
  const double pairs = static_cast<double>(state.iterations()) * burst.size();
  state.SetItemsProcessed(static_cast<std::int64_t>(pairs));
  kvkit_bench::report_rate_target(state, pairs, pool_target_pairs_per_s);
}
BENCHMARK(BM_pool_allocate_release);

// allocate(span) of a whole burst at once, then release each.
void BM_pool_allocate_span_release(benchmark::State& state) {
  kvkit::block_pool pool(1 << 16);
  std::vector<kvkit::block_id> burst(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) {
    (void)pool.allocate(burst);
    for (const auto id : burst) {
      (void)pool.release(id);
    }
    benchmark::ClobberMemory();
  }
  const double pairs = static_cast<double>(state.iterations()) * static_cast<double>(burst.size());
  state.SetItemsProcessed(static_cast<std::int64_t>(pairs));
  kvkit_bench::report_rate_target(state, pairs, pool_target_pairs_per_s);
}
BENCHMARK(BM_pool_allocate_span_release)->Arg(16)->Arg(512);

// Retain + release of shared blocks (fork and free of a 512-block sequence).
void BM_pool_retain_release(benchmark::State& state) {
  kvkit::block_pool pool(1 << 16);
  std::vector<kvkit::block_id> seq(512);
  (void)pool.allocate(seq);
  for (auto _ : state) {
    for (const auto id : seq) {
      (void)pool.retain(id);
    }
    for (const auto id : seq) {
      (void)pool.release(id);
    }
    benchmark::ClobberMemory();
  }
  const double pairs = static_cast<double>(state.iterations()) * 512.0;
  state.SetItemsProcessed(static_cast<std::int64_t>(pairs));
  kvkit_bench::report_rate_target(state, pairs, pool_target_pairs_per_s);
}
BENCHMARK(BM_pool_retain_release);

// Reclaiming cached blocks: every allocation evicts the least recently released cached block.
void BM_pool_evict_reclaim(benchmark::State& state) {
  kvkit::block_pool pool(1 << 12);
  std::vector<kvkit::block_id> all(1 << 12);
  (void)pool.allocate(all);
  for (const auto id : all) {
    (void)pool.set_cached(id, true);
  }
  for (const auto id : all) {
    (void)pool.release(id);
  }
  std::array<kvkit::block_id, 64> burst{};
  for (auto _ : state) {
    (void)pool.allocate(burst);
    for (const auto id : burst) {
      (void)pool.set_cached(id, true);
      (void)pool.release(id);
    }
    benchmark::ClobberMemory();
  }
  const double pairs = static_cast<double>(state.iterations()) * burst.size();
  state.SetItemsProcessed(static_cast<std::int64_t>(pairs));
  kvkit_bench::report_rate_target(state, pairs, pool_target_pairs_per_s);
}
BENCHMARK(BM_pool_evict_reclaim);

} // namespace
