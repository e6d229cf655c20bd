// prefix_cache: lookup on a full hit (target >= 1 G tokens/s hashed and looked up), publish,
// eviction under memory pressure, and the hit rate on a synthetic trace of shared system prompts
// and multi-turn chats beside the hit rate of an unbounded cache on the same trace.

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "host/bench_report.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/prefix/prefix_cache.hpp"

namespace {

using kvkit::token_id;
constexpr double match_target_tokens_per_s = 1e9;

std::vector<token_id> random_tokens(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<token_id> t(n);
  for (auto& x : t) {
    x = static_cast<token_id>(rng() % 128000);
  }
  return t;
}

// A cache holding one published 8192-token prompt.
struct warm_cache {
  explicit warm_cache(std::int32_t block_size, std::int32_t len = 8192)
      : pool(len / block_size + 64), table(pool, block_size), cache(pool, block_size),
        prompt(random_tokens(static_cast<std::size_t>(len), 7)),
        out(static_cast<std::size_t>(cache.max_match_blocks(len))) {
    (void)cache.admit(table, 1, prompt);
    (void)cache.publish(1, *table.blocks(1), prompt);
  }
  kvkit::block_pool pool;
  kvkit::block_table<kvkit::block_pool> table;
  kvkit::prefix_cache<> cache;
  std::vector<token_id> prompt;
  std::vector<kvkit::block_id> out;
};

// Time of hashing the tokens of every block of a prompt (no lookups): the floor of a walk that
// finds each block by the hash of its tokens, measured in the same run. The block size is a
// constant here, as it is in the cache's walk.
template <std::size_t BlockSize>
double hash_blocks_us(const std::vector<token_id>& prompt) {
  const std::size_t blocks = (prompt.size() - 1) / BlockSize;
  return kvkit_bench::median_us([&] {
    std::uint64_t h = 0;
    for (std::size_t i = 0; i < blocks; ++i) {
      h += kvkit::detail::content_hash<BlockSize>(prompt.data() + i * BlockSize);
    }
    benchmark::DoNotOptimize(h);
  });
}

double hash_blocks_us(const std::vector<token_id>& prompt, std::int64_t block_size) {
  switch (block_size) {
  case 16:
    return hash_blocks_us<16>(prompt);
  case 32:
    return hash_blocks_us<32>(prompt);
  default:
    return hash_blocks_us<64>(prompt);
  }
}

// Hash + look up every block of an 8192-token prompt that is fully cached (probe: no references).
// Each iteration is timed by hand so the median can be reported beside the mean.
void BM_prefix_probe_full_hit(benchmark::State& state) {
  warm_cache w(static_cast<std::int32_t>(state.range(0)));
  const double hash_only_us = hash_blocks_us(w.prompt, state.range(0));
  std::int64_t tokens = 0;
  std::int32_t per_probe = 0;
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto m = kvkit_bench::timed_iteration(state, seconds, [&] {
      const auto found = w.cache.probe(w.prompt);
      benchmark::DoNotOptimize(found);
      return found;
    });
    tokens += m.num_tokens;
    per_probe = m.num_tokens;
  }
  state.SetItemsProcessed(tokens);
  kvkit_bench::report_rate_target(state, static_cast<double>(tokens), match_target_tokens_per_s);
  kvkit_bench::report_median_rate_target(state, std::move(seconds), per_probe,
                                         match_target_tokens_per_s);
  kvkit_bench::report_peer_time(state, "hash_only", hash_only_us);
}
// hash_blocks_us has these block sizes.
BENCHMARK(BM_prefix_probe_full_hit)->Arg(16)->Arg(32)->Arg(64)->UseManualTime();

// match on a full hit: hash, look up and take a reference to each block. Only the match is timed;
// giving the references back and forgetting the sequence (what an engine does when the request
// ends) run outside the timed part.
void BM_prefix_match_full_hit(benchmark::State& state) {
  warm_cache w(static_cast<std::int32_t>(state.range(0)));
  std::int64_t tokens = 0;
  std::int32_t per_match = 0;
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto m = kvkit_bench::timed_iteration(
        state, seconds, [&] { return w.cache.match(2, w.prompt, {}, w.out); });
    tokens += m->num_tokens;
    per_match = m->num_tokens;
    for (std::int32_t i = m->num_blocks; i-- > 0;) {
      (void)w.pool.release(w.out[static_cast<std::size_t>(i)]);
    }
    (void)w.cache.forget(2);
  }
  state.SetItemsProcessed(tokens);
  kvkit_bench::report_rate_target(state, static_cast<double>(tokens), match_target_tokens_per_s);
  kvkit_bench::report_median_rate_target(state, std::move(seconds), per_match,
                                         match_target_tokens_per_s);
}
BENCHMARK(BM_prefix_match_full_hit)->Arg(16)->Arg(32)->Arg(64)->UseManualTime();

// Publish the 512 blocks of a freshly computed 8192-token prompt.
void BM_prefix_publish(benchmark::State& state) {
  constexpr std::int32_t bs = 16;
  kvkit::block_pool pool(8192 / bs + 64);
  kvkit::block_table<kvkit::block_pool> table(pool, bs);
  kvkit::prefix_cache<> cache(pool, bs);
  const auto prompt = random_tokens(8192, 11);
  (void)cache.admit(table, 1, prompt);
  std::int64_t tokens = 0;
  for (auto _ : state) {
    tokens += static_cast<std::int64_t>(*cache.publish(1, *table.blocks(1), prompt)) * bs;
    state.PauseTiming();
    cache.clear();
    (void)cache.forget(1);
    (void)table.free(1);
    (void)cache.admit(table, 1, prompt);
    state.ResumeTiming();
  }
  state.SetItemsProcessed(tokens);
}
BENCHMARK(BM_prefix_publish)->Unit(benchmark::kMicrosecond);

// Memory full of evictable cached blocks: each new 1024-token request evicts 64 of them, computes,
// publishes and finishes (its blocks become evictable in turn).
void BM_prefix_evict_under_pressure(benchmark::State& state) {
  constexpr std::int32_t bs = 16;
  constexpr std::int32_t len = 1024;
  kvkit::block_pool pool(4096);
  kvkit::block_table<kvkit::block_pool> table(pool, bs);
  kvkit::prefix_cache<> cache(pool, bs);
  std::vector<std::vector<token_id>> prompts;
  for (std::uint64_t i = 0; i < 256; ++i) {
    prompts.push_back(random_tokens(len, 1000 + i));
  }
  kvkit::seq_id s = 0;
  for (auto _ : state) {
    const auto& p = prompts[s % prompts.size()];
    // Vary the first token so every request misses and must evict.
    auto prompt = p;
    prompt[0] = static_cast<token_id>(s);
    (void)cache.admit(table, s, prompt);
    (void)cache.finish(s, *table.blocks(s), prompt);
    (void)table.free(s);
    ++s;
  }
  state.SetItemsProcessed(pool.num_evictions());
  state.counters["evictions"] = static_cast<double>(pool.num_evictions());
}
BENCHMARK(BM_prefix_evict_under_pressure)->Unit(benchmark::kMicrosecond);

// ---------------------------------------------------------------------------------------------
// Hit rate on a synthetic trace.
//
// 8 system prompts of 300..2000 tokens (not block aligned) shared by 400 conversations of 1..6
// turns. Turn t's prompt is the conversation so far (system prompt, earlier user messages and
// answers) plus a new user message of 20..200 tokens; answers are 50..400 tokens. Conversations
// interleave: the next request comes from a random open conversation. Between them, one request
// in four is a one-off document of 1500..4000 tokens that is never seen again. KV memory holds
// 40k tokens, so the cache must choose what to keep.
struct request {
  std::vector<token_id> prompt;
  std::int32_t answer = 0;
  std::int32_t system_len = 0;
};

std::vector<request> make_trace(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto uniform = [&](int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng);
  };
  std::vector<std::vector<token_id>> systems;
  for (int i = 0; i < 8; ++i) {
    systems.push_back(random_tokens(static_cast<std::size_t>(uniform(300, 2000)), seed + 100 + i));
  }
  struct conversation {
    std::vector<token_id> history;
    int turns_left;
    int system_len;
  };
  std::vector<conversation> open;
  std::vector<request> trace;
  int started = 0;
  while (started < 400 || !open.empty()) {
    if (uniform(0, 3) == 0) {
      // A one-off document (summarize this, translate that): long, never seen again.
      const auto doc = random_tokens(static_cast<std::size_t>(uniform(1500, 4000)), rng());
      trace.push_back({doc, uniform(50, 200), 0});
    }
    if (started < 400 && (open.size() < 24 || uniform(0, 3) == 0)) {
      const auto& sys = systems[static_cast<std::size_t>(uniform(0, 7))];
      open.push_back({sys, uniform(1, 6), static_cast<int>(sys.size())});
      ++started;
    }
    auto& c = open[static_cast<std::size_t>(uniform(0, static_cast<int>(open.size()) - 1))];
    const auto user = random_tokens(static_cast<std::size_t>(uniform(20, 200)), rng());
    c.history.insert(c.history.end(), user.begin(), user.end());
    const int answer = uniform(50, 400);
    trace.push_back({c.history, answer, c.system_len});
    const auto reply = random_tokens(static_cast<std::size_t>(answer), rng());
    c.history.insert(c.history.end(), reply.begin(), reply.end());
    if (--c.turns_left == 0) {
      c = std::move(open.back());
      open.pop_back();
    }
  }
  return trace;
}

// Serves the trace one request at a time in `kv_tokens` of KV memory; returns the hit rate over
// prompt tokens.
template <class Policy>
double serve(const std::vector<request>& trace, bool partial, bool keep_system, Policy policy,
             std::int32_t kv_tokens = 40000) {
  constexpr std::int32_t bs = 16;
  kvkit::block_pool pool(kv_tokens / bs, policy.num_levels());
  kvkit::block_table<kvkit::block_pool> table(pool, bs);
  kvkit::prefix_cache<kvkit::xxh3_hasher, Policy> cache(pool, bs, {.share_partial_blocks = partial},
                                                        {}, policy);
  kvkit::seq_id s = 0;
  for (const auto& r : trace) {
    const kvkit::retention keep{keep_system ? 90 : 0, keep_system ? r.system_len : 0};
    if (!cache.admit(table, s, r.prompt, {}, keep).ok()) {
      continue; // does not fit at all: not counted
    }
    table.release_copy_sources(); // the admission's copy-on-write copy has run
    auto tokens = r.prompt;
    (void)cache.publish(s, *table.blocks(s), tokens);
    // The answer's tokens are generated and published as blocks fill.
    (void)table.append_tokens(s, r.answer, {});
    tokens.resize(tokens.size() + static_cast<std::size_t>(r.answer), 0);
    (void)cache.finish(s, *table.blocks(s), tokens);
    (void)table.free(s);
    ++s;
  }
  return cache.stats().hit_rate();
}

// The best any cache could do on this trace: every earlier prompt's blocks kept forever (memory
// for the whole trace; same block-granular rule, last token always computed). Answers are random
// here, so reuse comes from system prompts and from earlier turns' prompts.
double ideal_hit_rate(const std::vector<request>& trace) {
  return serve(trace, true, false, kvkit::lru{}, 4'000'000);
}

void BM_prefix_hit_rate_trace(benchmark::State& state) {
  const auto trace = make_trace(2026);
  const double ideal = ideal_hit_rate(trace);
  double rate = 0;
  for (auto _ : state) {
    switch (state.range(0)) {
    case 0:
      rate = serve(trace, false, false, kvkit::lru{});
      break;
    case 1:
      rate = serve(trace, true, false, kvkit::lru{});
      break;
    default:
      rate = serve(trace, true, true, kvkit::retention_priority(4));
      break;
    }
  }
  static const char* const names[] = {"lru", "lru+partial", "retention+partial"};
  state.SetLabel(names[state.range(0)]);
  state.counters["hit_rate"] = rate;
  state.counters["ideal_hit_rate"] = ideal;
  state.counters["x_ideal"] = rate / ideal;
  state.counters["requests"] = static_cast<double>(trace.size());
}
BENCHMARK(BM_prefix_hit_rate_trace)->DenseRange(0, 2)->Unit(benchmark::kMillisecond)->Iterations(3);

} // namespace
