// Property test: the scheduler over random workloads, with the engine simulated completely.
//
// A simulated device memory (a token per slot) and host tier run every swap-out, swap-in and
// copy-on-write of each plan, in the documented order, and every scheduled token is written
// through the slot mapping the block table exports (speculative drafts included, rejected ones
// too). After every step: the budgets held; every running sequence reads exactly its own tokens;
// every prefix-cache entry's block holds the tokens it claims; reference counts match the
// table's references; nothing leaks. Every request finishes with exactly the output it asked for
// (or up to its end-of-sequence), preempted ones included, within a bounded number of steps.
// A failure prints the seed and step; KVKIT_TEST_SEED replays it.

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/prefix/prefix_cache.hpp"
#include "kvkit/sched/scheduler.hpp"

namespace {

using kvkit::block_id;
using kvkit::seq_id;
using kvkit::token_id;
using table_t = kvkit::block_table<kvkit::block_pool>;
using cache_t = kvkit::prefix_cache<>;

struct setup {
  std::int32_t blocks;
  std::int32_t block_size;
  kvkit::scheduler_config cfg;
  bool partial;
  std::int32_t requests;
};

template <class Policy>
class harness {
public:
  harness(const setup& s, std::uint64_t seed)
      : s_(s), rng_(seed), pool_(s.blocks), table_(pool_, s.block_size),
        cache_(pool_, s.block_size, {.share_partial_blocks = s.partial}),
        sched_(table_, cache_, pool_, s.cfg),
        device_(static_cast<std::size_t>(s.blocks * s.block_size), -1),
        host_(static_cast<std::size_t>(std::max(1, s.cfg.host_blocks) * s.block_size), -1) {}

  std::string run() {
    std::int32_t added = 0;
    for (std::int64_t step = 0; step < 200000; ++step) {
      while (added < s_.requests && pick(0, 2) == 0) {
        add(added++);
      }
      if (!sched_.has_work()) {
        if (added == s_.requests) {
          break;
        }
        continue;
      }
      // Now and then a request is aborted between steps, wherever it is (waiting, running or
      // swapped out).
      if (!expected_.empty() && pick(0, 40) == 0) {
        auto victim = expected_.begin();
        std::advance(victim, pick(0, static_cast<std::int32_t>(expected_.size()) - 1));
        if (!finished_.contains(victim->first)) {
          if (!sched_.abort(victim->first).ok()) {
            return "step " + std::to_string(step) + ": abort failed";
          }
          expected_.erase(victim);
          continue;
        }
      }
      std::string broken = one_step();
      if (broken.empty()) {
        broken = check();
      }
      if (!broken.empty()) {
        return "step " + std::to_string(step) + ": " + broken;
      }
    }
    if (sched_.has_work() || added != s_.requests) {
      return "requests left unfinished (starvation?)";
    }
    for (const auto& [id, want] : expected_) {
      if (!finished_.contains(id)) {
        return "request " + std::to_string(id) + " never finished";
      }
    }
    if (sched_.host_blocks_used() != 0) {
      return "host blocks leaked at the end";
    }
    cache_.clear();
    return pool_.num_used() == 0 && pool_.num_evictable() == 0 ? std::string{}
                                                               : "blocks leaked at the end";
  }

  std::int64_t preemptions() const { return sched_.num_preemptions(); }
  std::int64_t aborts_in_flight() const { return aborts_in_flight_; }
  std::int64_t shared_swap_outs() const { return shared_swap_outs_; }

private:
  struct model {
    std::vector<token_id> tokens; // prompt + accepted output
    std::int32_t prompt_len;
    std::int32_t max_new;
  };

  std::int32_t pick(std::int32_t lo, std::int32_t hi) {
    return std::uniform_int_distribution<std::int32_t>(lo, hi)(rng_);
  }

  void add(std::int32_t i) {
    const seq_id id = static_cast<seq_id>(i + 1);
    std::vector<token_id> prompt;
    if (pick(0, 2) != 0) { // a shared, unaligned system prompt
      const std::int32_t which = pick(0, 1);
      for (std::int32_t t = 0; t < 7 + 6 * which; ++t) {
        prompt.push_back(500 + 50 * which + t);
      }
    }
    for (std::int32_t t = pick(1, 12); t > 0; --t) {
      prompt.push_back(pick(0, 3));
    }
    const std::int32_t max_new = pick(1, 14);
    expected_[id] = {prompt, static_cast<std::int32_t>(prompt.size()), max_new};
    REQUIRE(sched_.add_request({id, prompt, max_new, pick(0, 3)}).ok());
  }

  void copy_block(std::vector<token_id>& from, block_id f, std::vector<token_id>& to, block_id t) {
    const auto bs = static_cast<std::size_t>(s_.block_size);
    std::copy_n(from.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(f) * bs), bs,
                to.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t) * bs));
  }

  std::string one_step() {
    // Each sequence's blocks before the step, to find those its preempted ones shared.
    std::map<seq_id, std::vector<block_id>> before;
    for (const auto& [id, m] : expected_) {
      if (table_.contains(id)) {
        const auto blocks = *table_.blocks(id);
        before[id].assign(blocks.begin(), blocks.end());
      }
    }
    const kvkit::step_plan& plan = sched_.step();
    // Steps whose swap-outs include a block two of the step's victims held: copied once, read
    // back below by each (the contents checked after every step).
    std::map<block_id, std::int32_t> holders;
    for (const seq_id id : plan.preempted) {
      for (const block_id b : before[id]) {
        ++holders[b];
      }
    }
    if (std::any_of(plan.swap_out.begin(), plan.swap_out.end(),
                    [&](const kvkit::block_copy& c) { return holders[c.src] > 1; })) {
      ++shared_swap_outs_;
    }
    // Each device block copied out once, each host block written once.
    std::set<block_id> sources;
    std::set<block_id> targets;
    for (const auto& c : plan.swap_out) {
      if (!sources.insert(c.src).second || !targets.insert(c.dst).second) {
        return "a block swapped out twice in one step";
      }
    }
    std::int32_t sum = 0;
    for (const auto& b : plan.batch) {
      sum += b.num_tokens;
    }
    if (sum != plan.num_tokens || plan.num_tokens > s_.cfg.max_batched_tokens ||
        static_cast<std::int32_t>(plan.batch.size()) > s_.cfg.max_running) {
      return "budget exceeded";
    }
    // Called only with work left; every request fits the pool alone, so a step that computes
    // nothing is a stall (random aborts would only hide it later).
    if (plan.batch.empty()) {
      return "a step computed nothing with requests left";
    }
    for (const auto& m : plan.swap_out) {
      copy_block(device_, m.src, host_, m.dst);
    }
    for (const auto& m : plan.swap_in) {
      copy_block(host_, m.src, device_, m.dst);
    }
    for (const auto& c : plan.copies) {
      copy_block(device_, c.src, device_, c.dst);
    }
    std::vector<std::vector<token_id>> storage;
    std::vector<kvkit::sample_result> samples;
    storage.reserve(plan.batch.size());
    for (const auto& b : plan.batch) {
      model& m = expected_.at(b.id);
      // What the forward pass writes: known tokens, then draft tokens in the lookahead slots.
      std::vector<token_id> written;
      for (std::int32_t p = b.first_position; p < b.first_position + b.num_tokens; ++p) {
        written.push_back(p < static_cast<std::int32_t>(m.tokens.size())
                              ? m.tokens[static_cast<std::size_t>(p)]
                              : pick(0, 3));
      }
      const std::array<seq_id, 1> batch{b.id};
      const std::array<std::int32_t, 1> q{b.num_tokens};
      std::vector<std::int64_t> slots(static_cast<std::size_t>(b.num_tokens));
      if (!table_.export_slot_mapping(batch, q, slots).ok()) {
        return "slot mapping export failed";
      }
      if (*table_.num_tokens(b.id) != b.first_position + b.num_tokens) {
        return "table length disagrees with the plan";
      }
      for (std::size_t i = 0; i < slots.size(); ++i) {
        device_[static_cast<std::size_t>(slots[i])] = written[i];
      }
      if (!b.samples) {
        continue;
      }
      std::vector<token_id> out;
      if (b.decode) {
        const std::int32_t accepted_drafts = pick(0, b.num_tokens - 1);
        for (std::int32_t j = 0; j < accepted_drafts; ++j) {
          out.push_back(written[static_cast<std::size_t>(1 + j)]);
        }
      }
      out.push_back(pick(0, 3)); // the sampled token
      storage.push_back(out);
      const bool eos = pick(0, 40) == 0;
      samples.push_back({b.id, storage.back(), eos});
      const std::int32_t room =
          m.max_new - (static_cast<std::int32_t>(m.tokens.size()) - m.prompt_len);
      const auto keep = std::min<std::size_t>(static_cast<std::size_t>(room), out.size());
      m.tokens.insert(m.tokens.end(), out.begin(), out.begin() + static_cast<std::ptrdiff_t>(keep));
      if (eos) {
        m.max_new = static_cast<std::int32_t>(m.tokens.size()) - m.prompt_len;
      }
    }
    // Now and then a request of this step is aborted before its results come back (its client
    // is gone): the step completes for the others.
    if (!plan.batch.empty() && pick(0, 12) == 0) {
      const seq_id gone = plan.batch[static_cast<std::size_t>(
                                         pick(0, static_cast<std::int32_t>(plan.batch.size()) - 1))]
                              .id;
      if (!sched_.abort(gone).ok()) {
        return "abort of a request in flight failed";
      }
      expected_.erase(gone);
      ++aborts_in_flight_;
      std::erase_if(samples, [&](const kvkit::sample_result& r) { return r.id == gone; });
    }
    const auto done = sched_.complete_step(samples);
    if (!done.ok()) {
      return "complete_step failed: " + std::string(kvkit::to_string(done.error()));
    }
    for (const auto& f : *done) {
      const model& m = expected_.at(f.id);
      const std::vector<token_id> want(m.tokens.begin() + m.prompt_len, m.tokens.end());
      if (f.generated != want || static_cast<std::int32_t>(f.generated.size()) != m.max_new) {
        return "request " + std::to_string(f.id) + " finished with the wrong output";
      }
      finished_[f.id] = true;
    }
    return {};
  }

  std::string check() const {
    const auto bs = static_cast<std::size_t>(s_.block_size);
    std::vector<std::int32_t> refs(static_cast<std::size_t>(s_.blocks), 0);
    for (const auto& [id, m] : expected_) {
      if (!table_.contains(id)) {
        continue;
      }
      const auto blocks = *table_.blocks(id);
      const auto len = static_cast<std::size_t>(*table_.num_tokens(id));
      for (const block_id b : blocks) {
        ++refs[static_cast<std::size_t>(b)];
      }
      for (std::size_t t = 0; t < len; ++t) {
        if (t >= m.tokens.size() ||
            device_[static_cast<std::size_t>(blocks[t / bs]) * bs + t % bs] != m.tokens[t]) {
          return "sequence " + std::to_string(id) + " reads a wrong token at " + std::to_string(t);
        }
      }
    }
    for (block_id b = 0; b < s_.blocks; ++b) {
      if (pool_.ref_count(b) != refs[static_cast<std::size_t>(b)]) {
        return "ref count of block " + std::to_string(b);
      }
    }
    std::string bad;
    cache_.for_each_entry([&](block_id b, std::span<const token_id> toks, const kvkit::block_key&) {
      for (std::size_t i = 0; i < toks.size() && bad.empty(); ++i) {
        if (device_[static_cast<std::size_t>(b) * bs + i] != toks[i]) {
          bad = "cache entry of block " + std::to_string(b) + " lost its tokens";
        }
      }
    });
    if (!bad.empty()) {
      return bad;
    }
    // Every live request is in exactly one queue; the cache tracks just those in the table; the
    // host tier holds no more than its blocks.
    std::size_t live = 0;
    for (const auto& [id, m] : expected_) {
      if (finished_.contains(id)) {
        continue;
      }
      ++live;
      if (cache_.tracks(id) != table_.contains(id)) {
        return "request " + std::to_string(id) + ": the cache tracks it " +
               (cache_.tracks(id) ? "outside" : "not inside") + " the table";
      }
    }
    if (sched_.num_waiting() + sched_.num_running() + sched_.num_swapped() != live) {
      return "queues hold " +
             std::to_string(sched_.num_waiting() + sched_.num_running() + sched_.num_swapped()) +
             " requests, " + std::to_string(live) + " live";
    }
    if (sched_.host_blocks_used() < 0 || sched_.host_blocks_used() > s_.cfg.host_blocks) {
      return "host tier over its blocks";
    }
    return pool_.check_consistency() ? std::string{} : "pool inconsistent";
  }

  setup s_;
  std::mt19937_64 rng_;
  kvkit::block_pool pool_;
  table_t table_;
  cache_t cache_;
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool, Policy> sched_;
  std::vector<token_id> device_;
  std::vector<token_id> host_;
  std::map<seq_id, model> expected_;
  std::map<seq_id, bool> finished_;
  std::int64_t aborts_in_flight_ = 0;
  std::int64_t shared_swap_outs_ = 0;
};

struct run_counts {
  std::int64_t preemptions = 0;
  std::int64_t shared_swap_outs = 0;
};

// Setup `k` of a run whose base seed is `base` (the seed KVKIT_TEST_SEED replays) uses seed base +
// k.
template <class Policy>
run_counts run(const setup& s, std::uint64_t base, std::uint64_t k) {
  const std::uint64_t seed = base + k;
  harness<Policy> h(s, seed);
  const std::string broken = h.run();
  INFO("setup " << k << ", seed " << seed << " (replay: KVKIT_TEST_SEED=" << base << ")");
  if (!broken.empty()) {
    FAIL(broken);
  }
  // Requests aborted while their step was in flight: the path must have been taken.
  CHECK(h.aborts_in_flight() > 0);
  return {h.preemptions(), h.shared_swap_outs()};
}

} // namespace

TEST_CASE("random workloads: budgets, contents, exact outputs, no leaks, no starvation",
          "[property][scheduler]") {
  const std::uint64_t seed = kvkit_test::test_seed(6);
  using kvkit::preemption_mode;
  // Tight memory so preemption is routine: recompute, swap (with a small host tier), chunked
  // prefill with lookahead, priorities, partial prefix sharing.
  std::int64_t preempted = 0;
  std::int64_t shared = 0;
  const auto add = [&](run_counts c) {
    preempted += c.preemptions;
    shared += c.shared_swap_outs;
  };
  add(run<kvkit::fcfs>(
      {14, 4, {.max_running = 6, .max_batched_tokens = 24, .prefill_chunk = 7}, false, 400}, seed,
      0));
  add(run<kvkit::fcfs>({14,
                        4,
                        {.max_running = 6,
                         .max_batched_tokens = 24,
                         .prefill_chunk = 7,
                         .preemption = preemption_mode::swap,
                         .host_blocks = 10},
                        true,
                        400},
                       seed, 1));
  // A watermark of 8 of 14 blocks: a request swapped out with more than 6 blocks' worth of
  // tokens (a request takes up to 11) must still come back once the others are done.
  add(run<kvkit::fcfs>({14,
                        4,
                        {.max_running = 6,
                         .max_batched_tokens = 24,
                         .prefill_chunk = 7,
                         .watermark_blocks = 8,
                         .preemption = preemption_mode::swap,
                         .host_blocks = 12},
                        true,
                        400},
                       seed, 4));
  add(run<kvkit::priority_first>({16,
                                  3,
                                  {.max_running = 5,
                                   .max_batched_tokens = 20,
                                   .prefill_chunk = 5,
                                   .watermark_blocks = 1,
                                   .lookahead = 3},
                                  true,
                                  400},
                                 seed, 2));
  add(run<kvkit::fcfs>({20,
                        4,
                        {.max_running = 8,
                         .max_batched_tokens = 32,
                         .prefill_chunk = 32,
                         .lookahead = 2,
                         .preemption = preemption_mode::swap,
                         .host_blocks = 6},
                        false,
                        400},
                       seed, 3));
  INFO("KVKIT_TEST_SEED=" << seed);
  CHECK(preempted > 0);
  // Victims of one step that shared a block (a common prompt) had it swapped out once.
  CHECK(shared > 0);
}
