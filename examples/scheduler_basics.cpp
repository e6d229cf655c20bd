// The scheduler on its own: three requests under a small token budget and sequence limit. Each
// step prints the plan an engine would run (prefill chunks, decodes, copy-on-write copies,
// preemptions); a stand-in model "samples" one token per sampling sequence; finished requests
// leave and waiting ones join. The third request shares the first one's system prompt and finds
// it in the prefix cache.
#include <cstdio>
#include <map>
#include <vector>

#include <kvkit/block/block_pool.hpp>
#include <kvkit/block/block_table.hpp>
#include <kvkit/prefix/prefix_cache.hpp>
#include <kvkit/sched/scheduler.hpp>

namespace {

std::vector<kvkit::token_id> tokens(kvkit::token_id first, std::int32_t n) {
  std::vector<kvkit::token_id> t;
  for (std::int32_t i = 0; i < n; ++i) {
    t.push_back(first + i);
  }
  return t;
}

std::vector<kvkit::token_id> concat(std::vector<kvkit::token_id> a,
                                    const std::vector<kvkit::token_id>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

} // namespace

int main() {
  constexpr std::int32_t block_size = 4;
  kvkit::block_pool pool(12);
  kvkit::block_table table(pool, block_size);
  kvkit::prefix_cache<> cache(pool, block_size);
  kvkit::scheduler sched(table, cache, pool,
                         {.max_running = 2, .max_batched_tokens = 8, .prefill_chunk = 6});

  const auto system = tokens(100, 8); // a system prompt of two full blocks
  const std::map<kvkit::seq_id, std::int32_t> max_new{{1, 3}, {2, 2}, {3, 3}};
  bool ok = sched.add_request({1, concat(system, tokens(200, 2)), max_new.at(1), 0}).ok();
  ok = sched.add_request({2, tokens(300, 5), max_new.at(2), 0}).ok() && ok;
  // Request 3 arrives later (step 2), once request 1's prompt is computed and published.

  std::map<kvkit::seq_id, std::vector<kvkit::token_id>> outputs;
  std::int32_t step = 0;
  for (; sched.has_work() && step < 100; ++step) {
    if (step == 2) {
      ok = sched.add_request({3, concat(system, tokens(400, 3)), max_new.at(3), 0}).ok() && ok;
    }
    const kvkit::step_plan& plan = sched.step();
    std::printf("step %d:", step);
    for (const auto& s : plan.batch) {
      std::printf(" [%d %s %d..%d]", static_cast<int>(s.id), s.decode ? "decode" : "prefill",
                  s.first_position, s.first_position + s.num_tokens - 1);
    }
    for (const auto& c : plan.copies) {
      std::printf(" copy %d->%d", c.src, c.dst);
    }
    for (const auto id : plan.preempted) {
      std::printf(" preempted %d", static_cast<int>(id));
    }
    std::printf(" computes %d tokens\n", plan.num_tokens);

    // The engine would run the copies and the forward pass here, then sample. The stand-in model
    // samples 1000 + the position after the sequence's last computed token.
    std::vector<std::vector<kvkit::token_id>> sampled;
    sampled.reserve(plan.batch.size());
    std::vector<kvkit::sample_result> results;
    for (const auto& s : plan.batch) {
      if (s.samples) {
        sampled.push_back({1000 + s.first_position + s.num_tokens});
        results.push_back({s.id, sampled.back(), false});
      }
    }
    const auto finished = sched.complete_step(results);
    if (!finished) {
      std::printf("complete_step -> %s\n", kvkit::to_string(finished.error()).data());
      return 1;
    }
    for (const auto& f : *finished) {
      outputs[f.id] = f.generated;
      std::printf("  request %d finished:", static_cast<int>(f.id));
      for (const auto t : f.generated) {
        std::printf(" %d", static_cast<int>(t));
      }
      std::printf("\n");
    }
  }
  std::printf("%d steps; prefix cache hit rate %.2f; blocks in use %d, cached %d\n", step,
              cache.stats().hit_rate(), pool.num_used(), cache.num_entries());

  // Bad input is an error value, and nothing changes.
  std::printf("add_request with an empty prompt -> %s\n",
              kvkit::to_string(sched.add_request({9, {}, 1, 0}).error()).data());

  // Every request generated exactly its max_new_tokens, request 3 found the system prompt, and
  // no block is held once all are done.
  for (const auto& [id, n] : max_new) {
    ok = ok && outputs.contains(id) && outputs.at(id).size() == static_cast<std::size_t>(n);
  }
  ok = ok && cache.stats().hit_tokens >= 8 && pool.num_used() == 0;
  return ok ? 0 : 1;
}
