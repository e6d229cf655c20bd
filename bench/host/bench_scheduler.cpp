// scheduler: one step with 256 running and 1024 waiting sequences (target <= 20 us), and the
// engine-side complete_step that follows it.

#include <cstdlib>
#include <vector>

#include <benchmark/benchmark.h>

#include "host/bench_report.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/prefix/prefix_cache.hpp"
#include "kvkit/sched/scheduler.hpp"

namespace {

using table_t = kvkit::block_table<kvkit::block_pool>;
using cache_t = kvkit::prefix_cache<>;
constexpr double step_target_us = 20.0;

// 256 sequences decoding (prompts of 512 tokens, all prefilled) and 1024 waiting behind them; the
// pool is sized so the running ones keep growing without preemption.
struct busy_server {
  // Room for the prompts and 3000 timed steps of growth, so no preemption disturbs the figure.
  kvkit::block_pool pool{256 * (512 + 3100) / 16 + 64};
  table_t table{pool, 16};
  cache_t cache{pool, 16};
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched{
      table, cache, pool, {.max_running = 256, .max_batched_tokens = 8192, .prefill_chunk = 2048}};
  std::vector<std::vector<kvkit::token_id>> out;
  std::vector<kvkit::sample_result> samples;

  busy_server() {
    for (kvkit::seq_id id = 0; id < 256 + 1024; ++id) {
      std::vector<kvkit::token_id> prompt(512);
      for (std::size_t i = 0; i < prompt.size(); ++i) {
        prompt[i] = static_cast<kvkit::token_id>(id * 1000 + i);
      }
      const kvkit::status added = sched.add_request({id, std::move(prompt), 100000, 0});
      if (!added) {
        std::abort(); // the benchmark setup must hold
      }
    }
    // Prefill the first 256 (8192 tokens a step: 16 prompts per step).
    while (sched.num_running() < 256 || !all_decoding()) {
      finish(sched.step());
    }
  }
  bool decoding_ = false;
  bool all_decoding() const { return decoding_; }
  void finish(const kvkit::step_plan& plan) {
    out.assign(plan.batch.size(), std::vector<kvkit::token_id>{7});
    samples.clear();
    bool any_prefill = false;
    for (std::size_t i = 0; i < plan.batch.size(); ++i) {
      any_prefill |= !plan.batch[i].decode;
      if (plan.batch[i].samples) {
        samples.push_back({plan.batch[i].id, out[i], false});
      }
    }
    decoding_ = !any_prefill && plan.batch.size() == 256;
    (void)sched.complete_step(samples);
  }
};

void BM_scheduler_step_256_running_1024_waiting(benchmark::State& state) {
  busy_server s;
  for (auto _ : state) {
    const auto& plan = s.sched.step();
    benchmark::DoNotOptimize(plan.batch.data());
    state.PauseTiming();
    s.finish(plan);
    state.ResumeTiming();
  }
  state.counters["running"] = static_cast<double>(s.sched.num_running());
  state.counters["preemptions"] = static_cast<double>(s.sched.num_preemptions());
  state.counters["waiting"] = static_cast<double>(s.sched.num_waiting());
  kvkit_bench::report_time_target(state, step_target_us);
}
BENCHMARK(BM_scheduler_step_256_running_1024_waiting)
    ->Unit(benchmark::kMicrosecond)
    ->Iterations(3000);

void BM_scheduler_complete_step_256(benchmark::State& state) {
  busy_server s;
  for (auto _ : state) {
    state.PauseTiming();
    const auto& plan = s.sched.step();
    s.out.assign(plan.batch.size(), std::vector<kvkit::token_id>{7});
    s.samples.clear();
    for (std::size_t i = 0; i < plan.batch.size(); ++i) {
      s.samples.push_back({plan.batch[i].id, s.out[i], false});
    }
    state.ResumeTiming();
    benchmark::DoNotOptimize(s.sched.complete_step(s.samples));
  }
  kvkit_bench::report_time_target(state, step_target_us);
}
BENCHMARK(BM_scheduler_complete_step_256)->Unit(benchmark::kMicrosecond)->Iterations(3000);

} // namespace
