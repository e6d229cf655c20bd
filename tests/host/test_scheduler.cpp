#include <algorithm>
#include <limits>
#include <map>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/prefix/prefix_cache.hpp"
#include "kvkit/sched/scheduler.hpp"

using kvkit::errc;
using kvkit::seq_id;
using kvkit::token_id;

namespace {

using table_t = kvkit::block_table<kvkit::block_pool>;
using cache_t = kvkit::prefix_cache<>;

// A result of one token, token_of(sequence), for every sequence of `plan` that samples; the
// results point into `storage`.
template <class F>
std::vector<kvkit::sample_result>
sample_all(const kvkit::step_plan& plan, std::vector<std::vector<token_id>>& storage, F token_of) {
  std::vector<kvkit::sample_result> samples;
  storage.clear();
  storage.reserve(plan.batch.size());
  for (const auto& s : plan.batch) {
    if (s.samples) {
      storage.push_back({token_of(s)});
      samples.push_back({s.id, storage.back(), false});
    }
  }
  return samples;
}

// Token 9 for every sequence.
token_id nine(const kvkit::scheduled_sequence& /*unused*/) {
  return 9;
}

template <class Policy = kvkit::fcfs>
struct rig {
  explicit rig(std::int32_t blocks, kvkit::scheduler_config cfg = {}, std::int32_t block_size = 4)
      : pool(blocks), table(pool, block_size), cache(pool, block_size),
        sched(table, cache, pool, cfg) {}
  kvkit::block_pool pool;
  table_t table;
  cache_t cache;
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool, Policy> sched;

  // Runs steps, sampling token 100 + position for every sampling sequence, until no work is left.
  std::map<seq_id, std::vector<token_id>> run(std::int32_t max_steps = 10000) {
    std::map<seq_id, std::vector<token_id>> out;
    for (std::int32_t step = 0; sched.has_work() && step < max_steps; ++step) {
      std::vector<std::vector<token_id>> storage;
      const auto samples = sample_all(sched.step(), storage, [](const auto& s) {
        return static_cast<token_id>(100 + s.first_position + s.num_tokens);
      });
      const auto done = sched.complete_step(samples);
      REQUIRE(done.ok());
      for (const auto& f : *done) {
        out[f.id] = f.generated;
      }
    }
    return out;
  }

  // Runs steps until no work is left (at most `max_steps`), sampling token 9 for every sampling
  // sequence: arrive(step) ahead of each step (to add requests), on_step(step, plan) after it.
  // Returns the outputs of the requests that finished, by id.
  template <class Arrive, class OnStep>
  std::map<seq_id, std::vector<token_id>> run_steps(int max_steps, Arrive arrive, OnStep on_step) {
    std::map<seq_id, std::vector<token_id>> done;
    for (int step = 0; sched.has_work() && step < max_steps; ++step) {
      arrive(step);
      const kvkit::step_plan& plan = sched.step();
      on_step(step, plan);
      std::vector<std::vector<token_id>> storage;
      const auto finished = sched.complete_step(sample_all(plan, storage, nine));
      REQUIRE(finished.ok());
      for (const auto& f : *finished) {
        done[f.id] = f.generated;
      }
    }
    return done;
  }
};

std::vector<token_id> prompt_of(std::int32_t n, token_id first = 1) {
  std::vector<token_id> p(static_cast<std::size_t>(n));
  for (std::int32_t i = 0; i < n; ++i) {
    p[static_cast<std::size_t>(i)] = first + i;
  }
  return p;
}

// Lookahead 3 over 64 blocks: request 1 (a 6-token prompt, at most `max_new` new tokens) is
// prefilled and samples token 7; returns the plan of the step after, its first decode.
const kvkit::step_plan& first_decode_with_lookahead(rig<>& r, std::int32_t max_new) {
  REQUIRE(r.sched.add_request({1, prompt_of(6), max_new, 0}).ok());
  (void)r.sched.step();
  const std::vector<token_id> first{7};
  const kvkit::sample_result s0{1, first, false};
  REQUIRE(r.sched.complete_step(std::span(&s0, 1)).ok());
  return r.sched.step();
}

rig<> lookahead_rig() {
  return rig<>(64,
               {.max_running = 2, .max_batched_tokens = 64, .prefill_chunk = 64, .lookahead = 3});
}

} // namespace

TEST_CASE("a request prefills in chunks, decodes, finishes and gives its blocks back",
          "[scheduler]") {
  rig r(64, {.max_running = 4, .max_batched_tokens = 8, .prefill_chunk = 5});
  REQUIRE(r.sched.add_request({1, prompt_of(12), 3, 0}).ok());
  const auto& first = r.sched.step();
  REQUIRE(first.batch.size() == 1);
  CHECK(first.batch[0].num_tokens == 5);
  CHECK(first.batch[0].first_position == 0);
  CHECK_FALSE(first.batch[0].samples);
  REQUIRE(r.sched.complete_step({}).ok());
  CHECK(r.sched.step().batch[0].num_tokens == 5);
  REQUIRE(r.sched.complete_step({}).ok());
  const auto& third = r.sched.step();
  CHECK(third.batch[0].num_tokens == 2); // the rest of the prompt, then the first sample
  CHECK(third.batch[0].samples);
  const std::vector<token_id> t{50};
  const kvkit::sample_result s{1, t, false};
  REQUIRE(r.sched.complete_step(std::span(&s, 1)).ok());
  const auto& decode = r.sched.step();
  CHECK(decode.batch[0].decode);
  CHECK(decode.batch[0].first_position == 12);
  CHECK(decode.batch[0].num_tokens == 1);
  REQUIRE(r.sched.complete_step(std::span(&s, 1)).ok());
  (void)r.sched.step();
  const auto done = r.sched.complete_step(std::span(&s, 1));
  REQUIRE(done.ok());
  REQUIRE(done->size() == 1);
  CHECK((*done)[0].generated == std::vector<token_id>{50, 50, 50});
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("budgets hold and prefills mix with decodes", "[scheduler]") {
  rig r(256, {.max_running = 3, .max_batched_tokens = 10, .prefill_chunk = 6});
  for (seq_id i = 1; i <= 6; ++i) {
    REQUIRE(r.sched.add_request({i, prompt_of(9, static_cast<token_id>(10 * i)), 4, 0}).ok());
  }
  bool mixed = false;
  for (int step = 0; r.sched.has_work() && step < 200; ++step) {
    const auto& plan = r.sched.step();
    CHECK(plan.num_tokens <= 10);
    CHECK(plan.batch.size() <= 3);
    bool prefill = false;
    bool decode = false;
    for (const auto& s : plan.batch) {
      prefill |= !s.decode;
      decode |= s.decode;
    }
    mixed |= prefill && decode;
    std::vector<std::vector<token_id>> storage;
    REQUIRE(r.sched.complete_step(sample_all(plan, storage, nine)).ok());
  }
  CHECK(mixed);
  CHECK_FALSE(r.sched.has_work());
}

TEST_CASE("admission takes the cached prefix and computes only the rest", "[scheduler]") {
  rig r(64, {.max_running = 4, .max_batched_tokens = 64, .prefill_chunk = 64});
  REQUIRE(r.sched.add_request({1, prompt_of(10), 1, 0}).ok());
  r.run();
  REQUIRE(r.sched.add_request({2, prompt_of(10), 1, 0}).ok());
  const auto& plan = r.sched.step();
  REQUIRE(plan.batch.size() == 1);
  CHECK(plan.batch[0].first_position == 8); // two cached blocks of 4
  CHECK(plan.batch[0].num_tokens == 2);
}

TEST_CASE("preemption by recompute resumes and finishes every request exactly", "[scheduler]") {
  // 12 blocks of 4 tokens; four requests of 10 prompt + 12 output tokens cannot all fit.
  rig r(12, {.max_running = 4, .max_batched_tokens = 64, .prefill_chunk = 64});
  for (seq_id i = 1; i <= 4; ++i) {
    REQUIRE(r.sched.add_request({i, prompt_of(10, static_cast<token_id>(100 * i)), 12, 0}).ok());
  }
  const auto out = r.run();
  CHECK(r.sched.num_preemptions() > 0);
  REQUIRE(out.size() == 4);
  for (const auto& [id, generated] : out) {
    CHECK(generated.size() == 12);
  }
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("preemption by swap moves blocks to a bounded host tier and back", "[scheduler]") {
  rig r(12, {.max_running = 4,
             .max_batched_tokens = 64,
             .prefill_chunk = 64,
             .preemption = kvkit::preemption_mode::swap,
             .host_blocks = 8});
  for (seq_id i = 1; i <= 4; ++i) {
    REQUIRE(r.sched.add_request({i, prompt_of(10, static_cast<token_id>(100 * i)), 12, 0}).ok());
  }
  std::size_t swapped_out = 0;
  std::size_t swapped_in = 0;
  std::int32_t max_host = 0;
  for (int step = 0; r.sched.has_work() && step < 1000; ++step) {
    const auto& plan = r.sched.step();
    swapped_out += plan.swap_out.size();
    swapped_in += plan.swap_in.size();
    max_host = std::max(max_host, r.sched.host_blocks_used());
    std::vector<std::vector<token_id>> storage;
    REQUIRE(r.sched.complete_step(sample_all(plan, storage, nine)).ok());
  }
  CHECK_FALSE(r.sched.has_work());
  CHECK(swapped_out > 0);
  CHECK(swapped_in > 0);
  CHECK(max_host <= 8);
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("priority policy admits the important request first", "[scheduler]") {
  rig<kvkit::priority_first> r(64,
                               {.max_running = 1, .max_batched_tokens = 64, .prefill_chunk = 64});
  REQUIRE(r.sched.add_request({1, prompt_of(4), 1, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(4, 50), 1, 9}).ok());
  CHECK(r.sched.step().batch.at(0).id == 2);
}

TEST_CASE("speculative lookahead reserves slots and rolls back the rejected ones", "[scheduler]") {
  rig<> r = lookahead_rig();
  const auto& plan = first_decode_with_lookahead(r, 10);
  REQUIRE(plan.batch.size() == 1);
  CHECK(plan.batch[0].decode);
  CHECK(plan.batch[0].num_tokens == 4); // the last token plus 3 draft slots
  CHECK(*r.table.num_tokens(1) == 10);
  // One draft accepted, plus the bonus token: K/V of 2 of the 4 positions stays.
  const std::vector<token_id> accepted{8, 9};
  const kvkit::sample_result s1{1, accepted, false};
  REQUIRE(r.sched.complete_step(std::span(&s1, 1)).ok());
  CHECK(*r.table.num_tokens(1) == 8);
  const auto& next = r.sched.step();
  CHECK(next.batch[0].first_position == 8);
}

TEST_CASE("a request admitted with only its last token to compute decodes it without lookahead",
          "[scheduler]") {
  // Request 1's 9-token prompt is cached once it has run; request 2 with the same prompt then
  // has only its last token to compute in the step that admits it: a decode of 1 token, no draft
  // slots (admission takes no lookahead); its next decodes take them.
  rig r(64, {.max_running = 2, .max_batched_tokens = 64, .prefill_chunk = 64, .lookahead = 3});
  REQUIRE(r.sched.add_request({1, prompt_of(9), 1, 0}).ok());
  REQUIRE(r.run().contains(1));
  REQUIRE(r.sched.add_request({2, prompt_of(9), 10, 0}).ok());
  const auto& plan = r.sched.step();
  REQUIRE(plan.batch.size() == 1);
  CHECK(plan.batch[0].decode);
  CHECK(plan.batch[0].first_position == 8);
  CHECK(plan.batch[0].num_tokens == 1);
  CHECK(plan.batch[0].samples);
  const std::vector<token_id> one{7};
  const kvkit::sample_result s{2, one, false};
  REQUIRE(r.sched.complete_step(std::span(&s, 1)).ok());
  const auto& next = r.sched.step();
  REQUIRE(next.batch.size() == 1);
  CHECK(next.batch[0].decode);
  CHECK(next.batch[0].num_tokens == 4);
}

TEST_CASE("a table and a prefix cache of different block sizes take no request", "[scheduler]") {
  kvkit::block_pool pool(16);
  table_t table(pool, 4);
  cache_t cache(pool, 8);
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched(table, cache, pool, {});
  CHECK(sched.add_request({1, prompt_of(12), 4, 0}).error() == errc::bad_argument);
  CHECK_FALSE(sched.has_work());
  CHECK(sched.step().batch.empty());
  CHECK(pool.num_used() == 0);
}

TEST_CASE("a table over another allocator than the scheduler's takes no request", "[scheduler]") {
  kvkit::block_pool pool(16);
  kvkit::block_pool other(16);
  table_t table(other, 4);
  cache_t cache(pool, 4);
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched(table, cache, pool, {});
  CHECK(sched.add_request({1, prompt_of(12), 4, 0}).error() == errc::bad_argument);
  CHECK_FALSE(sched.has_work());
}

TEST_CASE("a prefix cache over another pool than the scheduler's takes no request", "[scheduler]") {
  kvkit::block_pool pool(16);
  kvkit::block_pool other(16);
  table_t table(pool, 4);
  cache_t cache(other, 4); // attached, but to a pool whose block ids mean other pages
  REQUIRE(cache.attached());
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched(table, cache, pool, {});
  CHECK(sched.add_request({1, prompt_of(12), 4, 0}).error() == errc::bad_argument);
  CHECK_FALSE(sched.has_work());
}

TEST_CASE("a request whose id the prefix cache already tracks is refused", "[scheduler]") {
  rig<> r(16);
  // The engine used the cache directly under the same id.
  std::vector<kvkit::block_id> out(static_cast<std::size_t>(r.cache.max_match_blocks(12)));
  REQUIRE(r.cache.match(1, prompt_of(12), {}, out).ok());
  CHECK(r.sched.add_request({1, prompt_of(12), 4, 0}).error() == errc::duplicate_sequence);
  CHECK_FALSE(r.sched.has_work());
  REQUIRE(r.cache.forget(1).ok());
  REQUIRE(r.sched.add_request({1, prompt_of(12), 4, 0}).ok());
  const auto outputs = r.run();
  REQUIRE(outputs.count(1) == 1);
  CHECK(outputs.at(1).size() == 4);
}

TEST_CASE("step called again before complete_step returns the step in flight", "[scheduler]") {
  kvkit::scheduler_config cfg;
  cfg.prefill_chunk = 4;
  rig<> r(16, cfg);
  // An empty plan is no step in flight: an engine that only waits on it and steps again sees
  // the request queued in between.
  REQUIRE(r.sched.step().batch.empty());
  REQUIRE(r.sched.add_request({1, prompt_of(12), 2, 0}).ok());
  const kvkit::step_plan first = r.sched.step();
  REQUIRE(first.batch.size() == 1);
  CHECK(first.batch[0].num_tokens == 4);
  CHECK(*r.table.num_tokens(1) == 4);
  const kvkit::step_plan& again = r.sched.step();
  REQUIRE(again.batch.size() == 1);
  CHECK(again.batch[0].first_position == first.batch[0].first_position);
  CHECK(again.batch[0].num_tokens == 4);
  CHECK(again.num_tokens == first.num_tokens);
  CHECK(*r.table.num_tokens(1) == 4); // the chunk appended once
  REQUIRE(r.sched.complete_step({}).ok());
  const kvkit::step_plan& next = r.sched.step();
  REQUIRE(next.batch.size() == 1);
  CHECK(next.batch[0].first_position == 4);
  CHECK(*r.table.num_tokens(1) == 8);
}

TEST_CASE("a prefix cache not attached to its pool takes no request", "[scheduler]") {
  kvkit::block_pool pool(16);
  table_t table(pool, 4);
  cache_t first(pool, 4);
  cache_t second(pool, 4); // the pool has a cache: this one stays detached
  REQUIRE_FALSE(second.attached());
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched(table, second, pool, {});
  CHECK(sched.add_request({1, prompt_of(12), 4, 0}).error() == errc::bad_argument);
  CHECK_FALSE(sched.has_work());
}

TEST_CASE("bad requests and results are rejected while the others go on", "[scheduler]") {
  rig r(8, {.max_running = 4, .max_batched_tokens = 16, .prefill_chunk = 16});
  CHECK(r.sched.add_request({1, {}, 4, 0}).error() == errc::bad_argument);
  CHECK(r.sched.add_request({1, prompt_of(4), 0, 0}).error() == errc::bad_argument);
  CHECK(r.sched.add_request({2, prompt_of(40), 4, 0}).error() == errc::out_of_blocks); // never fits
  REQUIRE(r.sched.add_request({3, prompt_of(4), 2, 0}).ok());
  CHECK(r.sched.add_request({3, prompt_of(4), 2, 0}).error() == errc::duplicate_sequence);
  CHECK(r.sched.abort(99).error() == errc::unknown_sequence);
  const auto& plan = r.sched.step();
  REQUIRE(plan.batch.size() == 1);
  const std::vector<token_id> two{1, 2};
  const std::vector<token_id> one{1};
  const kvkit::sample_result too_many{3, two, false};
  const kvkit::sample_result stranger{42, one, false};
  CHECK(r.sched.complete_step(std::span(&too_many, 1)).error() == errc::bad_argument);
  CHECK(r.sched.complete_step(std::span(&stranger, 1)).error() == errc::unknown_sequence);
  CHECK(r.sched.complete_step({}).error() == errc::bad_argument); // a sampling sequence is missing
  const kvkit::sample_result good{3, one, true};                  // end of sequence
  const auto done = r.sched.complete_step(std::span(&good, 1));
  REQUIRE(done.ok());
  CHECK(done->size() == 1);
  CHECK(r.pool.num_used() == 0);
  // Zero budgets are invalid configurations.
  CHECK(kvkit::scheduler_config{.max_batched_tokens = 0}.validate().error() == errc::bad_argument);
  CHECK(kvkit::scheduler_config{.max_running = 0}.validate().error() == errc::bad_argument);
  CHECK_FALSE(kvkit::scheduler_config{.preemption = kvkit::preemption_mode::swap}.validate().ok());
}

TEST_CASE("refused results change nothing, and the right ones are then applied", "[scheduler]") {
  // Requests 1 and 2 sample this step (their prompts fit whole); request 3 computes the first
  // chunk of its prompt and samples nothing.
  rig r(32, {.max_running = 4, .max_batched_tokens = 12, .prefill_chunk = 4});
  REQUIRE(r.sched.add_request({1, prompt_of(4), 2, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(3, 50), 2, 0}).ok());
  REQUIRE(r.sched.add_request({3, prompt_of(10, 80), 2, 0}).ok());
  const kvkit::step_plan plan = r.sched.step();
  REQUIRE(plan.batch.size() == 3);
  REQUIRE(plan.batch[2].id == 3);
  REQUIRE_FALSE(plan.batch[2].samples);
  const auto tokens_of = [&] {
    return std::vector<std::int32_t>{*r.table.num_tokens(1), *r.table.num_tokens(2),
                                     *r.table.num_tokens(3)};
  };
  const auto before = tokens_of();
  const std::vector<token_id> t1{7};
  const std::vector<token_id> t2{8};
  const std::vector<token_id> two{7, 8};
  const auto refused = [&](std::vector<kvkit::sample_result> samples, errc want) {
    CHECK(r.sched.complete_step(samples).error() == want);
    // Nothing applied: the tables, the queues and the step in flight are as they were.
    CHECK(tokens_of() == before);
    CHECK(r.sched.num_running() == 3);
    CHECK(r.sched.num_waiting() == 0);
    const kvkit::step_plan& again = r.sched.step();
    REQUIRE(again.batch.size() == plan.batch.size());
    for (std::size_t i = 0; i < plan.batch.size(); ++i) {
      CHECK(again.batch[i].id == plan.batch[i].id);
      CHECK(again.batch[i].first_position == plan.batch[i].first_position);
      CHECK(again.batch[i].num_tokens == plan.batch[i].num_tokens);
    }
  };
  // The first result good, the second one token too many for a prefill.
  refused({{1, t1, false}, {2, two, false}}, errc::bad_argument);
  // One sequence twice and the other not at all: the count alone would pass.
  refused({{1, t1, false}, {1, t2, false}}, errc::bad_argument);
  // A result for the sequence that samples nothing this step.
  refused({{1, t1, false}, {2, t2, false}, {3, t1, false}}, errc::unknown_sequence);
  // An empty result.
  refused({{1, {}, false}, {2, t2, false}}, errc::bad_argument);
  // Then the right results apply once.
  const std::vector<kvkit::sample_result> good{{1, t1, false}, {2, t2, false}};
  const auto done = r.sched.complete_step(good);
  REQUIRE(done.ok());
  CHECK(done->empty());
  CHECK(*r.table.num_tokens(1) == 4);
  CHECK(*r.table.num_tokens(3) == 4);
  const auto outputs = r.run();
  REQUIRE(outputs.size() == 3);
  CHECK(outputs.at(1).front() == 7);
  CHECK(outputs.at(2).front() == 8);
  CHECK(outputs.at(1).size() == 2);
  CHECK(outputs.at(3).size() == 2);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("add_request refuses what could never run and ids the table already has", "[scheduler]") {
  rig<> r(16);
  // An id the engine put in the block table itself.
  REQUIRE(r.table.add_sequence(1).ok());
  CHECK(r.sched.add_request({1, prompt_of(4), 2, 0}).error() == errc::duplicate_sequence);
  CHECK_FALSE(r.sched.has_work());
  CHECK(*r.table.num_tokens(1) == 0);
  REQUIRE(r.table.free(1).ok());
  // An output length whose blocks would not fit an int32 count: refused, not wrapped.
  CHECK(
      r.sched.add_request({2, prompt_of(4), std::numeric_limits<std::int32_t>::max(), 0}).error() ==
      errc::out_of_blocks);
  // A prompt and output (but its last token) of 64 tokens need every block of the pool, with no
  // spare for a copy-on-write; 60 tokens (15 blocks of 4) fit.
  CHECK(r.sched.add_request({3, prompt_of(60), 5, 0}).error() == errc::out_of_blocks);
  CHECK_FALSE(r.sched.has_work());
  REQUIRE(r.sched.add_request({3, prompt_of(56), 5, 0}).ok());
  REQUIRE(r.sched.add_request({4, prompt_of(1), 1, 0}).ok());
  CHECK(r.sched.num_waiting() == 2);
  // Every configuration rule.
  using cfg = kvkit::scheduler_config;
  for (const cfg& bad : {cfg{.max_running = -1}, cfg{.max_batched_tokens = -5},
                         cfg{.prefill_chunk = 0}, cfg{.watermark_blocks = -1}, cfg{.lookahead = -1},
                         cfg{.host_blocks = -1}, cfg{.max_batched_tokens = 4, .lookahead = 4},
                         cfg{.preemption = kvkit::preemption_mode::swap, .host_blocks = 0}}) {
    CHECK(bad.validate().error() == errc::bad_argument);
  }
  CHECK(cfg{.max_batched_tokens = 5, .lookahead = 4}.validate().ok());
  CHECK(cfg{.preemption = kvkit::preemption_mode::swap, .host_blocks = 1}.validate().ok());
}

TEST_CASE("a request aborted while its step is in flight is left out of that step's results",
          "[scheduler]") {
  // Request 1 samples this step (its whole prompt fits), request 2 computes a prefill chunk (no
  // sample); both are aborted between step() and complete_step(), and 2 is queued again at once.
  rig r(32, {.max_running = 4, .max_batched_tokens = 12, .prefill_chunk = 8});
  REQUIRE(r.sched.add_request({1, prompt_of(4), 3, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(12), 3, 0}).ok());
  REQUIRE(r.sched.add_request({3, prompt_of(4), 3, 0}).ok());
  const auto& plan = r.sched.step();
  REQUIRE(plan.batch.size() == 2);
  REQUIRE(plan.batch[0].samples);
  REQUIRE_FALSE(plan.batch[1].samples);
  const std::int32_t used = r.pool.num_used();
  REQUIRE(r.sched.abort(1).ok());
  REQUIRE(r.sched.abort(2).ok());
  CHECK(r.pool.num_used() < used); // their blocks are free at once
  REQUIRE(r.sched.add_request({2, prompt_of(12), 3, 0}).ok());
  const std::vector<token_id> one{7};
  const kvkit::sample_result late{1, one, false};
  CHECK(r.sched.complete_step(std::span(&late, 1)).error() == errc::unknown_sequence);
  const auto done = r.sched.complete_step({}); // nothing left to sample in this step
  REQUIRE(done.ok());
  CHECK(done->empty());
  CHECK_FALSE(r.table.contains(1));
  // The new request 2 and request 3 run to the end.
  const auto out = r.run();
  CHECK(out.size() == 2);
  CHECK(out.contains(2));
  CHECK(out.contains(3));
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("abort gives back a running request's blocks", "[scheduler]") {
  rig r(16, {.max_running = 4, .max_batched_tokens = 16, .prefill_chunk = 16});
  REQUIRE(r.sched.add_request({1, prompt_of(8), 4, 0}).ok());
  (void)r.sched.step();
  const std::vector<token_id> one{1};
  const kvkit::sample_result s{1, one, false};
  REQUIRE(r.sched.complete_step(std::span(&s, 1)).ok());
  CHECK(r.pool.num_used() > 0);
  REQUIRE(r.sched.abort(1).ok());
  CHECK(r.pool.num_used() == 0);
  CHECK_FALSE(r.sched.has_work());
}

TEST_CASE("the watermark holds admission back only while other sequences run", "[scheduler]") {
  // 10 blocks of 4 tokens and a watermark of 5: request 1 needs 8 blocks for its prompt, more
  // than the 5 beyond the watermark, but fits the allocator alone, so it is admitted while
  // nothing runs; request 2 then waits for the watermark until 1 is done.
  rig r(10,
        {.max_running = 4, .max_batched_tokens = 64, .prefill_chunk = 64, .watermark_blocks = 5});
  REQUIRE(r.sched.add_request({1, prompt_of(32), 1, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(4), 1, 0}).ok());
  const auto& plan = r.sched.step();
  REQUIRE(plan.batch.size() == 1);
  CHECK(plan.batch[0].id == 1);
  CHECK(r.sched.num_waiting() == 1);
  const std::vector<token_id> one{7};
  const kvkit::sample_result s{1, one, false};
  REQUIRE(r.sched.complete_step(std::span(&s, 1)).ok());
  const auto out = r.run(100);
  CHECK_FALSE(r.sched.has_work());
  CHECK(out.contains(2));
  CHECK(r.pool.num_used() == 0);
}

namespace {

// Swap preemption to a host tier of 16 blocks of 4 tokens. By default 10 blocks and a watermark
// of 2, where the cases below run this: A (4 + 30 tokens) and B (28 + 8)
// start together; when A needs its third block, B (8 blocks) is swapped out, and it needs 9 or 10
// blocks to come back: more than the 8 beyond the watermark, so it returns once A is done.
rig<> swap_rig(std::int32_t blocks = 10, std::int32_t watermark = 2, std::int32_t budget = 64) {
  return rig<>(blocks, {.max_running = 4,
                        .max_batched_tokens = budget,
                        .prefill_chunk = 64,
                        .watermark_blocks = watermark,
                        .preemption = kvkit::preemption_mode::swap,
                        .host_blocks = 16});
}

// Runs one step of `r`, sampling token 9 for every sampling sequence; returns the plan's swap-outs.
std::size_t run_step(rig<>& r) {
  const auto& plan = r.sched.step();
  const std::size_t swapped = plan.swap_out.size();
  std::vector<std::vector<token_id>> storage;
  REQUIRE(r.sched.complete_step(sample_all(plan, storage, nine)).ok());
  return swapped;
}

} // namespace

TEST_CASE("a request swapped out comes back once the sequences before it are done", "[scheduler]") {
  rig<> r = swap_rig();
  REQUIRE(r.sched.add_request({1, prompt_of(4), 30, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(28, 50), 8, 0}).ok());
  std::size_t swapped = 0;
  for (int step = 0; r.sched.has_work() && step < 200; ++step) {
    swapped += run_step(r);
  }
  CHECK(swapped == 8);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("abort gives back a swapped-out request's host blocks", "[scheduler]") {
  for (const bool in_flight : {false, true}) {
    INFO("aborted " << (in_flight ? "during the step that swaps it out" : "between steps"));
    rig<> r = swap_rig();
    REQUIRE(r.sched.add_request({1, prompt_of(4), 30, 0}).ok());
    REQUIRE(r.sched.add_request({2, prompt_of(28, 50), 8, 0}).ok());
    if (in_flight) {
      // Steps until the plan swaps B out; abort it before the step completes: this step's
      // copies go into its host blocks, so they stay taken until complete_step.
      bool aborted = false;
      for (int step = 0; !aborted && step < 50; ++step) {
        const auto& plan = r.sched.step();
        std::vector<std::vector<token_id>> storage;
        const auto samples = sample_all(plan, storage, nine);
        if (!plan.swap_out.empty()) {
          REQUIRE(r.sched.abort(2).ok());
          CHECK(r.sched.host_blocks_used() == 8);
          aborted = true;
        }
        REQUIRE(r.sched.complete_step(samples).ok());
      }
      REQUIRE(aborted);
      CHECK(r.sched.host_blocks_used() == 0);
    } else {
      for (int step = 0; r.sched.num_swapped() == 0 && step < 50; ++step) {
        (void)run_step(r);
      }
      REQUIRE(r.sched.num_swapped() == 1);
      CHECK(r.sched.host_blocks_used() == 8);
      REQUIRE(r.sched.abort(2).ok());
      CHECK(r.sched.host_blocks_used() == 0); // at once: no step is in flight
    }
    const auto out = r.run(200);
    CHECK(out.size() == 1);
    CHECK(out.contains(1));
    CHECK_FALSE(r.sched.has_work());
    CHECK(r.pool.num_used() == 0);
  }
}

TEST_CASE("a decode whose draft slots the budget left cannot hold lets the requests after it run",
          "[scheduler]") {
  // Budget 6, decodes of 1 + 3: after A's decode 2 tokens are left, which B's decode cannot use;
  // C, running behind B in mid-prefill, takes them, before W (newer, waiting) is admitted.
  rig r(64, {.max_running = 8, .max_batched_tokens = 6, .prefill_chunk = 6, .lookahead = 3});
  REQUIRE(r.sched.add_request({1, prompt_of(3), 20, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(3, 20), 20, 0}).ok());
  REQUIRE(r.sched.add_request({3, prompt_of(20, 40), 20, 0}).ok());
  REQUIRE(r.sched.add_request({4, prompt_of(8, 70), 20, 0}).ok());
  std::vector<std::vector<seq_id>> ids;
  std::vector<std::vector<std::int32_t>> tokens;
  for (int step = 0; step < 3; ++step) {
    const auto& plan = r.sched.step();
    ids.emplace_back();
    tokens.emplace_back();
    for (const auto& s : plan.batch) {
      ids.back().push_back(s.id);
      tokens.back().push_back(s.num_tokens);
    }
    CHECK(plan.num_tokens <= 6);
    std::vector<std::vector<token_id>> storage;
    REQUIRE(r.sched.complete_step(sample_all(plan, storage, nine)).ok());
  }
  CHECK(ids[0] == std::vector<seq_id>{1, 2});          // both prompts, 3 tokens each
  CHECK(ids[1] == std::vector<seq_id>{1, 3});          // A decodes 4; C is admitted with 2
  CHECK(ids[2] == std::vector<seq_id>{1, 3});          // A decodes 4; C goes on with 2, W waits
  CHECK(tokens[2] == std::vector<std::int32_t>{4, 2}); // (before: C skipped, W admitted)
}

TEST_CASE("a decode takes no draft slots past the tokens the request may still generate",
          "[scheduler]") {
  rig<> r = lookahead_rig();
  // Two tokens more at most: the last one and one draft slot, not three.
  const auto& plan = first_decode_with_lookahead(r, 3);
  REQUIRE(plan.batch.size() == 1);
  CHECK(plan.batch[0].decode);
  CHECK(plan.batch[0].num_tokens == 2);
  CHECK(*r.table.num_tokens(1) == 8);
  const std::vector<token_id> both{8, 9};
  const kvkit::sample_result s1{1, both, false};
  const auto done = r.sched.complete_step(std::span(&s1, 1));
  REQUIRE(done.ok());
  REQUIRE(done->size() == 1);
  CHECK(done->front().generated == std::vector<token_id>{7, 8, 9});
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE(
    "a swapped-out request whose prefix others still hold comes back as soon as the rest fits",
    "[scheduler]") {
  // A and S share an 8-token prefix (2 blocks of 4). S, the newest, is swapped out when the
  // 8-block pool runs dry; C's finish then frees 2 blocks while A runs. S needs just 1 of them
  // (its 2 shared blocks are A's, its own cached one comes back from the cache): it swaps in
  // beside A, not after A is done (counted as 4 blocks and a spare, it waited for A to finish).
  rig<> r = swap_rig(8, 0);
  REQUIRE(r.sched.add_request({1, prompt_of(8), 12, 0}).ok());
  std::vector<token_id> shared = prompt_of(8);
  shared.push_back(50);
  bool swapped_out = false;
  bool back_beside_a = false;
  std::int32_t swap_ins = 0;
  for (int step = 0; r.sched.has_work() && step < 100; ++step) {
    if (step == 1) {
      REQUIRE(r.sched.add_request({2, prompt_of(4, 900), 6, 0}).ok());
      REQUIRE(r.sched.add_request({3, shared, 8, 0}).ok());
    }
    const auto& plan = r.sched.step();
    swapped_out = swapped_out || !plan.swap_out.empty();
    if (!plan.swap_in.empty()) {
      ++swap_ins;
      back_beside_a = std::any_of(plan.batch.begin(), plan.batch.end(),
                                  [](const auto& s) { return s.id == 1; });
    }
    std::vector<std::vector<token_id>> storage;
    REQUIRE(r.sched.complete_step(sample_all(plan, storage, nine)).ok());
  }
  REQUIRE(swapped_out);
  CHECK(swap_ins == 1);
  CHECK(back_beside_a);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("a request swapped out mid-prefill comes back though the cache holds more of its prompt",
          "[scheduler]") {
  // S shares A's 40-token prompt and is swapped out after its first 4 tokens, when A's prompt is
  // in the cache (9 blocks of it: 36 tokens): S comes back from the cache in the same step, as an
  // admission would, and computes only the last 4 tokens of its prompt (it used to wait for A to
  // finish and compute 36 again; and its swap-in, taking only its own computed block from the
  // cache and giving the rest back, must not count those against it).
  rig<> r = swap_rig(13, 0, 44);
  REQUIRE(r.sched.add_request({1, prompt_of(40), 2, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(40), 1, 0}).ok());
  bool swapped_out = false;
  std::size_t swapped_in = 0;
  std::vector<std::int32_t> computed_after; // S's tokens computed in each step from its swap-out
  const auto done = r.run_steps(
      50, [](int /*step*/) {},
      [&](int /*step*/, const kvkit::step_plan& plan) {
        swapped_in += plan.swap_in.size();
        if (!plan.preempted.empty()) {
          swapped_out = true;
          // Back in the same step: the swap-out into its host block is dropped, the block free.
          CHECK(plan.swap_out.empty());
          CHECK(r.sched.host_blocks_used() == 0);
        }
        for (const auto& s : plan.batch) {
          if (s.id == 2 && swapped_out) {
            computed_after.push_back(s.num_tokens);
          }
        }
      });
  REQUIRE(swapped_out);
  CHECK_FALSE(r.sched.has_work());
  CHECK(done.size() == 2);
  // It came back from the cache alone: no copy from the host, and of its prompt only what the
  // cache does not hold computed again (not the 36 tokens after its own 4).
  CHECK(swapped_in == 0);
  CHECK(computed_after == std::vector<std::int32_t>{40 - 36});
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("a request swapped out and back in one step copies out only the block it reads back",
          "[scheduler]") {
  // 12 blocks of 4 tokens, prefill chunks of 5. T (16 tokens) shares its prompt with U (18
  // tokens) and has computed 9 when the others' growth swaps it out; its two whole blocks are
  // then U's, in the cache, and it comes back in the same step: only its partial third block goes
  // to the host and back (its two whole blocks used to be copied out too, into host blocks that
  // nothing read).
  rig<> r(12, {.max_running = 4,
               .max_batched_tokens = 21,
               .prefill_chunk = 5,
               .watermark_blocks = 0,
               .preemption = kvkit::preemption_mode::swap,
               .host_blocks = 16});
  REQUIRE(r.sched.add_request({1, prompt_of(7, 100), 7, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(20, 100), 6, 0}).ok());
  REQUIRE(r.sched.add_request({3, prompt_of(18, 300), 6, 0}).ok()); // U
  bool back_at_once = false;
  const auto arrive = [&](int step) {
    if (step == 1) {
      REQUIRE(r.sched.add_request({4, prompt_of(16, 300), 5, 0}).ok()); // T
    }
  };
  const auto done = r.run_steps(50, arrive, [&](int step, const kvkit::step_plan& plan) {
    const bool t_out =
        std::find(plan.preempted.begin(), plan.preempted.end(), 4) != plan.preempted.end();
    const bool t_runs = std::any_of(plan.batch.begin(), plan.batch.end(),
                                    [](const kvkit::scheduled_sequence& s) { return s.id == 4; });
    if (t_out && t_runs) {
      back_at_once = true;
      INFO("step " << step);
      CHECK(plan.preempted.size() == 1);
      REQUIRE(plan.swap_out.size() == 1);
      REQUIRE(plan.swap_in.size() == 1);
      CHECK(plan.swap_in[0].src == plan.swap_out[0].dst);
      CHECK(r.sched.host_blocks_used() == 1);
    }
  });
  REQUIRE(back_at_once);
  CHECK(done.size() == 4);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("a request back in the step of its swap-out leaves the shared blocks' host copies to the "
          "other",
          "[scheduler]") {
  // 8 blocks of 4 tokens. S and T (19-token prompts, the same but for T's last token) are swapped
  // out in one step as they decode, S with 20 tokens (5 whole blocks). They share blocks 1-3; T's
  // block 0 is that of request 1 (S's first 5 tokens, computed beside S and cached first), which
  // runs on. S comes back in the same step, all 5 blocks from the cache; T stays out, and the
  // copies of its 5 blocks are the step's only swap-outs: 3 it shares with S, 1 with request 1.
  // S's own 2 blocks, which it takes back from the cache, used to be copied too (7 swap-outs).
  // Where T comes back, it reads its own last block's copy.
  rig<> r(8, {.max_running = 4,
              .max_batched_tokens = 20,
              .prefill_chunk = 8,
              .watermark_blocks = 0,
              .preemption = kvkit::preemption_mode::swap,
              .host_blocks = 16});
  REQUIRE(r.sched.add_request({1, prompt_of(5, 100), 6, 0}).ok());
  REQUIRE(r.sched.add_request({2, prompt_of(19, 100), 6, 0}).ok()); // S
  std::vector<token_id> t_prompt = prompt_of(19, 100);
  t_prompt.back() = 999;
  bool split = false;
  std::vector<kvkit::block_id> t_copies; // the host blocks T's swap-outs wrote
  bool t_back = false;
  bool t_read_back = false;
  const auto arrive = [&](int step) {
    if (step == 2) {
      REQUIRE(r.sched.add_request({3, t_prompt, 5, 0}).ok()); // T
    }
  };
  const auto done = r.run_steps(50, arrive, [&](int step, const kvkit::step_plan& plan) {
    const auto runs = [&](seq_id id) {
      return std::any_of(plan.batch.begin(), plan.batch.end(),
                         [&](const kvkit::scheduled_sequence& s) { return s.id == id; });
    };
    if (plan.preempted.size() == 2) {
      split = true;
      INFO("step " << step);
      CHECK(runs(2));
      CHECK_FALSE(runs(3));
      CHECK(plan.swap_in.empty());
      CHECK(plan.swap_out.size() == 5);
      CHECK(r.sched.host_blocks_used() == 5);
      for (const auto& c : plan.swap_out) {
        t_copies.push_back(c.dst);
      }
    } else if (split && !t_back && runs(3)) {
      t_back = true; // the step T comes back in: it reads its own block's copy
      for (const auto& c : plan.swap_in) {
        t_read_back =
            t_read_back || std::find(t_copies.begin(), t_copies.end(), c.src) != t_copies.end();
      }
    }
  });
  REQUIRE(split);
  CHECK(t_read_back);
  CHECK(done.size() == 3);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("a request that fills the pool runs with lookahead: no draft slots past its last token",
          "[scheduler]") {
  // 8 prompt tokens and 9 new ones: all but the last new one (sampled, never computed) fill 4
  // blocks of 4, the pool's 5 less the spare; its decodes near the end take fewer draft slots,
  // so lookahead needs no room of its own.
  rig r(5, {.max_running = 2, .max_batched_tokens = 64, .prefill_chunk = 64, .lookahead = 3});
  REQUIRE(r.sched.add_request({1, prompt_of(8), 9, 0}).ok());
  CHECK(r.sched.add_request({2, prompt_of(8), 10, 0}).error() == errc::out_of_blocks);
  const auto out = r.run(100);
  REQUIRE(out.contains(1));
  CHECK(out.at(1).size() == 9);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.pool.num_used() == 0);
}

namespace {

// Whether some block id occurs twice in `ids`.
bool any_twice(std::vector<kvkit::block_id> ids) {
  std::sort(ids.begin(), ids.end());
  return std::adjacent_find(ids.begin(), ids.end()) != ids.end();
}

// S (id 2, a 17-token prompt) and T (id 3: S's first 16 tokens, then its own), in 4-token blocks
// of a 16-block pool; T shares S's 4 prompt blocks through the prefix cache. A (id 1, priority 1,
// a 48-token prompt in chunks of 16) arrives while both decode, and its third chunk needs 4
// blocks where 1 is free: T is preempted, which frees its one block of its own (the others are
// S's too), then S. With `host_blocks` 5, T is swapped out (5 blocks) and S, whose 2 blocks of its
// own no longer fit the tier, is preempted by recompute; with 16 both are swapped out.
rig<kvkit::priority_first> shared_prefix_rig(std::int32_t host_blocks) {
  return rig<kvkit::priority_first>(16, {.max_running = 3,
                                         .max_batched_tokens = 64,
                                         .prefill_chunk = 16,
                                         .watermark_blocks = 0,
                                         .preemption = kvkit::preemption_mode::swap,
                                         .host_blocks = host_blocks});
}

// Runs `r` (from shared_prefix_rig) to its end, adding T at step 2 and A at step 4, and calls
// on_step(step, plan) for each step's plan. Returns the outputs by id.
template <class F>
std::map<seq_id, std::vector<token_id>> run_shared_prefix(rig<kvkit::priority_first>& r,
                                                          F on_step) {
  REQUIRE(r.sched.add_request({2, prompt_of(17), 8, 0}).ok());
  std::vector<token_id> t_prompt = prompt_of(16);
  t_prompt.push_back(77);
  const auto arrive = [&](int step) {
    if (step == 2) {
      REQUIRE(r.sched.add_request({3, t_prompt, 8, 0}).ok());
    }
    if (step == 4) {
      REQUIRE(r.sched.add_request({1, prompt_of(48, 500), 4, 1}).ok());
    }
  };
  return r.run_steps(200, arrive, on_step);
}

} // namespace

TEST_CASE("requests preempted together copy a block they share to the host once", "[scheduler]") {
  rig<kvkit::priority_first> r = shared_prefix_rig(16);
  bool both_out = false;
  bool shared_read_back = false;
  const auto done = run_shared_prefix(r, [&](int /*step*/, const kvkit::step_plan& plan) {
    // Coming back, both copy the shared block (not in the cache any more) from its one host copy.
    std::vector<kvkit::block_id> read;
    for (const auto& c : plan.swap_in) {
      read.push_back(c.src);
    }
    shared_read_back = shared_read_back || any_twice(read);
    if (plan.preempted.size() == 2) {
      // T's 5 blocks and S's 6, of which 4 are the same: 7 copies, 7 host blocks.
      both_out = true;
      CHECK(plan.swap_out.size() == 7);
      std::vector<kvkit::block_id> from;
      std::vector<kvkit::block_id> to;
      for (const auto& c : plan.swap_out) {
        from.push_back(c.src);
        to.push_back(c.dst);
      }
      CHECK_FALSE(any_twice(from));
      CHECK_FALSE(any_twice(to));
      CHECK(r.sched.host_blocks_used() == 7);
    }
  });
  REQUIRE(both_out);
  CHECK(shared_read_back);
  CHECK(done.size() == 3);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}

TEST_CASE("a request preempted by recompute comes back before a newer swapped-out one",
          "[scheduler]") {
  // T (newer) is swapped out, S (older) preempted by recompute as the tier is full: they come back
  // in policy order, S first (swap-ins used to go before every waiting request).
  rig<kvkit::priority_first> r = shared_prefix_rig(5);
  bool preempted = false;
  std::vector<seq_id> back; // S and T in the order they came back
  const auto done = run_shared_prefix(r, [&](int /*step*/, const kvkit::step_plan& plan) {
    if (plan.preempted.size() == 2) {
      preempted = true;
      CHECK(plan.swap_out.size() == 5); // T's blocks alone
      CHECK(r.sched.num_swapped() == 1);
      CHECK(r.sched.num_waiting() == 1);
    } else if (preempted) {
      for (const auto& s : plan.batch) {
        if (s.id != 1 && std::find(back.begin(), back.end(), s.id) == back.end()) {
          back.push_back(s.id); // the batch lists the requests that come back in that order
        }
      }
    }
  });
  REQUIRE(preempted);
  CHECK(back == std::vector<seq_id>{2, 3});
  CHECK(done.size() == 3);
  CHECK_FALSE(r.sched.has_work());
  CHECK(r.sched.host_blocks_used() == 0);
  CHECK(r.pool.num_used() == 0);
}
