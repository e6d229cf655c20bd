#pragma once
//! scheduler: continuous batching over a paged KV cache. Every step it decides which sequences
//! run and how many tokens each computes, under a token and a sequence budget, with chunked
//! prefill, prefix-cache-aware admission, preemption (recompute or swap to a host tier) and
//! speculative-decoding lookahead.

#include <algorithm>
#include <cassert>
#include <concepts>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_allocator.hpp"
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/concepts/prefix_index.hpp"
#include "kvkit/concepts/scheduling_policy.hpp"
#include "kvkit/error.hpp"
#include "kvkit/sched/policies.hpp"

namespace kvkit {

//! What happens to a running request when its next tokens find no free block.
enum class preemption_mode : std::uint8_t {
  recompute, //!< give its blocks back (computed ones stay in the prefix cache); prefill again later
  swap,      //!< copy its blocks to a host tier of bounded size; copy them back later
};

//! The scheduler's knobs.
struct scheduler_config {
  std::int32_t max_running = 256;         //!< sequences computed in one step
  std::int32_t max_batched_tokens = 8192; //!< tokens computed in one step, all sequences together
  std::int32_t prefill_chunk = 2048;      //!< most prompt tokens one sequence computes per step
  //! Free blocks admission and swap-in leave for the running sequences to grow into; none while
  //! no sequence runs, so a request that fits the allocator alone is never held back by it.
  std::int32_t watermark_blocks = 0;
  std::int32_t lookahead = 0; //!< speculative tokens reserved per decode step
  preemption_mode preemption = preemption_mode::recompute;
  std::int32_t host_blocks = 0; //!< capacity of the swap tier, in blocks

  //! bad_argument for zero or negative budgets, a negative watermark, lookahead or host tier,
  //! or swap preemption without a host tier.
  [[nodiscard]] status validate() const noexcept {
    if (max_running <= 0 || max_batched_tokens <= 0 || prefill_chunk <= 0 || watermark_blocks < 0 ||
        lookahead < 0 || host_blocks < 0 || max_batched_tokens <= lookahead ||
        (preemption == preemption_mode::swap && host_blocks == 0)) {
      return errc::bad_argument;
    }
    return {};
  }
};

//! A request as the engine submits it.
struct request {
  seq_id id = 0;
  std::vector<token_id> prompt;
  std::int32_t max_new_tokens = 1;
  std::int32_t priority = 0; //!< higher first under priority_first
};

//! One sequence of a step's batch.
struct scheduled_sequence {
  seq_id id = 0;
  std::int32_t first_position = 0; //!< position of its first token computed this step
  //! Tokens computed: a prefill chunk, or for a decode 1 + lookahead, fewer where the request may
  //! generate fewer tokens than that before its max_new_tokens (no slots for drafts it could not
  //! keep); but 1 (no lookahead slots) where the step that admits a request has only its last
  //! known token left to compute (a one-token prompt, or tokens all cached but the last, as a
  //! prompt seen before may be).
  std::int32_t num_tokens = 0;
  bool decode = false;  //!< its last known token is computed (then the lookahead slots, if any)
  bool samples = false; //!< the engine samples a token for it this step
};

//! What the engine does this step, in this order: swap_out, swap_in, copies, then the forward
//! pass over `batch` (write K/V into the slots `block_table` exports, attention), then sampling.
struct step_plan {
  std::vector<scheduled_sequence> batch;
  std::vector<block_copy> swap_out; //!< {device block, host block}
  std::vector<block_copy> swap_in;  //!< {host block, device block}
  std::vector<block_copy> copies;   //!< copy-on-write, device to device
  //! Requests that lost (or swapped out) their blocks. One may come back in the same step, from
  //! the prefix cache (preempted by recompute, or swapped out mid-prefill where the cache holds
  //! more of its prompt than it had computed) or swapped back in, and then is in `batch` as well:
  //! drop its old state before running the batch.
  std::vector<seq_id> preempted;
  std::int32_t num_tokens = 0; //!< tokens computed in this step
};

//! The engine's result for one sequence that sampled this step.
struct sample_result {
  seq_id id = 0;
  //! New tokens: one after a prefill; after a decode with lookahead k, the j accepted draft tokens
  //! then the token sampled after them (1 .. k + 1 tokens).
  std::span<const token_id> tokens;
  bool end_of_sequence = false; //!< the request ends here even if max_new_tokens is not reached
};

//! A request that completed, with what it generated.
struct finished_request {
  seq_id id = 0;
  std::vector<token_id> generated;
};

//! Continuous batching over a block_mapping, a prefix_index and a block_allocator, in the order of
//! a scheduling_policy. Deterministic: the same calls give the same plans. Not thread-safe.
//!
//! Each step: running sequences in policy order get their next tokens (a prefill chunk, or one
//! token plus `lookahead` slots); when blocks run out, the running sequence that comes last in
//! policy order is preempted. Then swapped-out requests come back and waiting requests are
//! admitted, in one policy order, while the budgets and the free blocks (beyond the watermark,
//! while others run) allow; an admission first takes the longest cached prefix. The engine runs the
//! plan and reports the sampled tokens to `complete_step`.
template <block_mapping Mapping, prefix_index Index, block_allocator Allocator,
          scheduling_policy Policy = fcfs>
class scheduler {
public:
  //! A scheduler over `table`, `cache` and `allocator`, which must outlive it. `config` must pass
  //! `scheduler_config::validate` (checked by assert; without asserts `add_request` refuses every
  //! request with bad_argument).
  scheduler(Mapping& table, Index& cache, Allocator& allocator, scheduler_config config,
            Policy policy = {})
      : table_(&table), cache_(&cache), allocator_(&allocator), config_(config),
        policy_(std::move(policy)), host_(config.host_blocks) {
    assert(config_.validate().ok());
  }

  [[nodiscard]] const scheduler_config& config() const noexcept { return config_; }
  [[nodiscard]] std::size_t num_waiting() const noexcept { return waiting_.size(); }
  [[nodiscard]] std::size_t num_running() const noexcept { return running_.size(); }
  [[nodiscard]] std::size_t num_swapped() const noexcept { return swapped_.size(); }
  [[nodiscard]] bool has_work() const noexcept { return !requests_.empty(); }
  [[nodiscard]] std::int64_t num_preemptions() const noexcept { return preemptions_; }
  //! Host-tier blocks in use by swapped-out requests.
  [[nodiscard]] std::int32_t host_blocks_used() const noexcept { return host_.num_used(); }

  //! Queues a request. Errors: bad_argument (invalid config, the table's and the prefix index's
  //! block sizes differ, a table (where it names its allocator) or a prefix cache (where it names
  //! its pool) over another allocator than the scheduler's, a prefix cache not attached to its
  //! pool (prefix_cache::attached), empty prompt, max_new_tokens < 1), duplicate_sequence (the id
  //! is queued, running, in the block table, or tracked by the prefix index), out_of_blocks (its
  //! prompt and its output but the last token could never fit in the allocator, even alone).
  [[nodiscard]] status add_request(request r) {
    if (!config_.validate().ok() || table_->block_size() != cache_->block_size() ||
        r.prompt.empty() || r.max_new_tokens < 1) {
      return errc::bad_argument;
    }
    if constexpr (requires(const Index& c) {
                    { c.attached() } -> std::convertible_to<bool>;
                  }) {
      // A detached cache admits nothing: the request would wait forever.
      if (!cache_->attached()) {
        return errc::bad_argument;
      }
    }
    if constexpr (requires(const Mapping& t) { t.allocator(); }) {
      // Admission counts the scheduler's allocator's free blocks; the table must take from it.
      if (static_cast<const void*>(&table_->allocator()) != static_cast<const void*>(allocator_)) {
        return errc::bad_argument;
      }
    }
    if constexpr (requires(const Index& c) { c.pool(); }) {
      // The blocks a match hands out are the cache's pool's; the table must hold them in that.
      if (static_cast<const void*>(&cache_->pool()) != static_cast<const void*>(allocator_)) {
        return errc::bad_argument;
      }
    }
    if (requests_.contains(r.id) || table_->contains(r.id)) {
      return errc::duplicate_sequence;
    }
    if constexpr (requires(const Index& c) {
                    { c.tracks(r.id) } -> std::convertible_to<bool>;
                  }) {
      // Its admission starts tracking the id in the cache; one tracked already would refuse it.
      if (cache_->tracks(r.id)) {
        return errc::duplicate_sequence;
      }
    }
    // Its table's longest: the prompt and every generated token but the last, which is sampled
    // and never computed (a decode takes no draft slots past the tokens it may still generate).
    const std::int64_t longest = static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens - 1;
    if (longest > std::int64_t{1} << 30 ||
        blocks_for_tokens(static_cast<std::int32_t>(longest), table_->block_size()) + 1 >
            allocator_->capacity()) {
      return errc::out_of_blocks;
    }
    entry e;
    e.order = {r.id, next_arrival_++, r.priority};
    e.prompt_len = static_cast<std::int32_t>(r.prompt.size());
    e.max_new = r.max_new_tokens;
    e.tokens = std::move(r.prompt);
    requests_.emplace(r.id, std::move(e));
    insert_sorted(waiting_, r.id);
    return {};
  }

  //! Removes a request wherever it is, giving back its blocks (a swapped-out request's host
  //! blocks at once between steps; during a step, at its complete_step, as this step's swap-out
  //! may be copying into them). unknown_sequence if there is none.
  //! Also between step() and complete_step(), once the engine has exported the step's inputs from
  //! the block table (the sequence leaves the table, so an export that names it fails: drop it
  //! from the batch first): a request of the step in flight then has no result to report
  //! (complete_step takes the others' and rejects one for it as unknown_sequence), and its blocks
  //! are free again at once, but for a copy-on-write destination of the step, which the block
  //! table holds until complete_step releases the step's copies. The step's kernels may still
  //! write them, which does no harm: nothing allocates them before the next step(), whose work the
  //! engine queues after this step's.
  [[nodiscard]] status abort(seq_id id) {
    const auto it = requests_.find(id);
    if (it == requests_.end()) {
      return errc::unknown_sequence;
    }
    entry& e = it->second;
    if (e.step_epoch == step_epoch_ && plan_.batch[e.batch_index].samples) {
      --num_sampling_; // its result is no longer awaited
    }
    if (e.where == place::running) {
      (void)cache_->forget(id);
      (void)table_->free(id);
      erase_from(running_, id);
    } else if (e.where == place::swapped) {
      for (const block_id b : e.host) {
        if (in_flight_) {
          host_release_.push_back(b); // this step's swap-out may still be copying into it
        } else {
          [[maybe_unused]] const status released = host_.release(b);
          assert(released.ok());
        }
      }
      erase_from(swapped_, id);
    } else {
      erase_from(waiting_, id);
    }
    requests_.erase(it);
    return {};
  }

  //! Decides the next step. Call `complete_step` with its results before the next `step`: until
  //! then, `step` returns the step in flight again and changes nothing. An empty plan (nothing to
  //! run, copy, swap or preempt) is no step in flight: the next `step` plans anew.
  [[nodiscard]] const step_plan& step() {
    if (in_flight_) {
      return plan_;
    }
    plan_.batch.clear();
    plan_.swap_out.clear();
    plan_.swap_in.clear();
    plan_.copies.clear();
    plan_.preempted.clear();
    if (!swap_copies_.empty()) {
      swap_copies_.clear();
    }
    plan_.num_tokens = 0;
    ++step_epoch_;
    num_sampling_ = 0;
    std::int32_t budget = config_.max_batched_tokens;
    // 1. Running requests, in policy order; preempt from the back when blocks run out.
    for (std::size_t i = 0; i < running_.size() && budget > 0;) {
      const seq_id id = running_[i];
      entry& e = requests_.at(id);
      const std::int32_t n = tokens_for(e, budget);
      if (n == 0) {
        ++i; // a decode whose draft slots the budget left cannot hold: later requests may fit it
        continue;
      }
      bool placed = false;
      while (!placed) {
        const auto need = table_->blocks_needed(id, n);
        if (need.ok() && *need <= allocator_->num_free()) {
          placed = true;
          break;
        }
        const seq_id victim = running_.back();
        preempt(victim);
        if (victim == id) {
          break;
        }
      }
      if (!placed) {
        break; // the sequence itself was preempted, and it was the last one
      }
      schedule(id, e, n);
      budget -= n;
      ++i;
    }
    // 2. Swapped-out and waiting requests in one policy order (a request preempted by recompute
    // waits among the new ones, and must not fall behind a swapped-out one that came after it):
    // each swapped back in or admitted, head-of-line.
    while (budget > 0 && static_cast<std::int32_t>(running_.size()) < config_.max_running &&
           (!swapped_.empty() || !waiting_.empty())) {
      const bool swapped_first =
          !swapped_.empty() &&
          (waiting_.empty() || !policy_.before(requests_.at(waiting_.front()).order,
                                               requests_.at(swapped_.front()).order));
      if (swapped_first ? !swap_in(swapped_.front(), budget) : !admit(waiting_.front(), budget)) {
        break; // later requests wait their turn (no starvation under fcfs)
      }
    }
    in_flight_ = !plan_.batch.empty() || !plan_.swap_out.empty() || !plan_.swap_in.empty() ||
                 !plan_.copies.empty() || !plan_.preempted.empty();
    return plan_;
  }

  //! Applies the engine's results of the last step: `samples` holds one entry for every scheduled
  //! sequence whose `samples` flag was set (others may be absent). Returns the requests that
  //! finished. Errors (nothing applied): unknown_sequence (an id not sampled this step),
  //! bad_argument (no tokens, more than it computed, or a sampling sequence without a result).
  [[nodiscard]] result<std::vector<finished_request>>
  complete_step(std::span<const sample_result> samples) {
    ++epoch_; // marks which requests got a result in this call
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const sample_result& s = samples[i];
      const auto it = requests_.find(s.id);
      if (it == requests_.end() || it->second.step_epoch != step_epoch_ ||
          !plan_.batch[it->second.batch_index].samples) {
        return errc::unknown_sequence;
      }
      const scheduled_sequence& sched = plan_.batch[it->second.batch_index];
      if (s.tokens.empty() || s.tokens.size() > static_cast<std::size_t>(sched.num_tokens) ||
          (!sched.decode && s.tokens.size() != 1) || it->second.sample_epoch == epoch_) {
        return errc::bad_argument;
      }
      it->second.sample_epoch = epoch_;
      it->second.sample_index = i;
    }
    if (samples.size() != num_sampling_) {
      return errc::bad_argument;
    }
    std::vector<finished_request> done;
    const std::int32_t bs = table_->block_size();
    for (const scheduled_sequence& sched : plan_.batch) {
      const auto found = requests_.find(sched.id);
      if (found == requests_.end() || found->second.step_epoch != step_epoch_) {
        continue; // aborted since step() (its id may have been queued again)
      }
      entry& e = found->second;
      const std::int32_t before = e.computed;
      if (e.sample_epoch != epoch_) {
        e.computed += sched.num_tokens; // a prefill chunk
        if (e.computed / bs > before / bs) {
          (void)cache_->publish(sched.id, *table_->blocks(sched.id), cached_tokens(e));
        }
        continue;
      }
      const sample_result& s = samples[e.sample_index];
      // Tokens whose K/V is now valid: a whole prefill chunk, or the decode input and the
      // accepted draft tokens (all sampled tokens but the last); never more than it keeps.
      const auto sampled = static_cast<std::int32_t>(s.tokens.size());
      const std::int32_t keep = std::min(room(e), sampled);
      e.tokens.insert(e.tokens.end(), s.tokens.begin(), s.tokens.begin() + keep);
      e.computed = std::min(e.computed + (sched.decode ? sampled : sched.num_tokens),
                            static_cast<std::int32_t>(e.tokens.size()));
      if (*table_->num_tokens(sched.id) != e.computed) {
        (void)table_->truncate(sched.id, e.computed); // rejected drafts roll back
        (void)cache_->truncate(sched.id, e.computed);
      }
      const bool finished = s.end_of_sequence ||
                            static_cast<std::int32_t>(e.tokens.size()) - e.prompt_len >= e.max_new;
      if (finished) {
        end_tracking(sched.id, *table_->blocks(sched.id), e);
        (void)table_->free(sched.id);
        erase_from(running_, sched.id);
        done.push_back(
            {sched.id, std::vector<token_id>(e.tokens.begin() + e.prompt_len, e.tokens.end())});
        requests_.erase(sched.id);
      } else if (e.computed / bs > before / bs) {
        (void)cache_->publish(sched.id, *table_->blocks(sched.id), cached_tokens(e));
      }
    }
    table_->release_copy_sources();
    for (const block_id b : host_release_) {
      [[maybe_unused]] const status released = host_.release(b);
      assert(released.ok());
    }
    host_release_.clear();
    plan_.batch.clear();
    ++step_epoch_; // nothing of the old plan can be sampled any more
    num_sampling_ = 0;
    in_flight_ = false;
    return done;
  }

private:
  enum class place : std::uint8_t { waiting, running, swapped };

  struct entry {
    request_order_info order;
    std::vector<token_id> tokens; // prompt, then generated tokens
    std::int32_t prompt_len = 0;
    std::int32_t max_new = 0;
    std::int32_t computed = 0; // leading tokens whose K/V is in the cache
    place where = place::waiting;
    std::vector<block_id> host;   // swapped-out copies of its blocks, by logical index
    std::int64_t step_epoch = -1; // the step it was last scheduled in
    std::size_t batch_index = 0;  // its place in that step's batch
    std::int64_t sample_epoch = -1;
    std::size_t sample_index = 0;
  };

  [[nodiscard]] std::span<const token_id> cached_tokens(const entry& e) const {
    return std::span<const token_id>(e.tokens).first(static_cast<std::size_t>(e.computed));
  }

  // Tokens request `e` may still generate.
  [[nodiscard]] static std::int32_t room(const entry& e) noexcept {
    return e.max_new - (static_cast<std::int32_t>(e.tokens.size()) - e.prompt_len);
  }

  // Tokens a running request computes next: the rest of its prefill (chunked), or a decode with
  // its draft slots, but none for drafts past the tokens it may still generate (it could not keep
  // them); 0 where the budget cannot hold that decode.
  [[nodiscard]] std::int32_t tokens_for(const entry& e, std::int32_t budget) const {
    const auto pending = static_cast<std::int32_t>(e.tokens.size()) - e.computed;
    if (pending == 1) {
      const std::int32_t n = std::clamp(room(e), 1, 1 + config_.lookahead);
      return n <= budget ? n : 0;
    }
    return std::min({pending, config_.prefill_chunk, budget});
  }

  void schedule(seq_id id, entry& e, std::int32_t n) {
    const auto pending = static_cast<std::int32_t>(e.tokens.size()) - e.computed;
    const auto info = table_->append_tokens(id, n, {});
    assert(info.ok());
    if (info->copied) {
      plan_.copies.push_back(info->copy);
    }
    const scheduled_sequence s{id, e.computed, n, pending == 1, pending <= n};
    e.step_epoch = step_epoch_;
    e.batch_index = plan_.batch.size();
    plan_.batch.push_back(s);
    plan_.num_tokens += n;
    num_sampling_ += s.samples ? 1 : 0;
  }

  void preempt(seq_id id) {
    entry& e = requests_.at(id);
    ++preemptions_;
    plan_.preempted.push_back(id);
    erase_from(running_, id);
    const auto blocks = *table_->blocks(id);
    // A block that another request swapped out in this step (one they share: a common prefix)
    // is copied once; its host copy is shared too. It holds the same tokens for both: both held
    // it from before the step (a victim was not scheduled in it), and the step's swap-outs run
    // before anything of the step writes a device block.
    const auto fresh = [&] {
      return static_cast<std::int32_t>(std::count_if(
          blocks.begin(), blocks.end(), [&](block_id b) { return !swap_copies_.contains(b); }));
    };
    if (config_.preemption == preemption_mode::swap && host_.num_free() >= fresh()) {
      e.host.resize(blocks.size());
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const auto [at, added] = swap_copies_.try_emplace(blocks[i], block_id{});
        if (added) {
          at->second = *host_.allocate();
          plan_.swap_out.push_back({blocks[i], at->second});
        } else {
          [[maybe_unused]] const status retained = host_.retain(at->second);
          assert(retained.ok());
        }
        e.host[i] = at->second;
      }
      end_tracking(id, blocks, e);
      (void)table_->free(id);
      e.where = place::swapped;
      insert_sorted(swapped_, id);
      return;
    }
    // Recompute: computed blocks stay in the prefix cache, so the redo is mostly cache hits.
    end_tracking(id, blocks, e);
    (void)table_->free(id);
    e.computed = 0;
    e.where = place::waiting;
    insert_sorted(waiting_, id);
  }

  // Publishes what sequence `id` computed and stops the prefix index tracking it, before the
  // table frees it. Should the index refuse (a table and an index out of step), it still stops
  // tracking the id, which would otherwise never match again.
  void end_tracking(seq_id id, std::span<const block_id> blocks, const entry& e) {
    if (!cache_->finish(id, blocks, cached_tokens(e))) {
      (void)cache_->forget(id);
    }
  }

  // The free blocks admission and swap-in leave (scheduler_config::watermark_blocks): none while
  // no sequence runs, or a request that fits the allocator alone but not beside the watermark
  // would hold every request behind it back for good.
  [[nodiscard]] std::int32_t watermark() const noexcept {
    return running_.empty() ? 0 : config_.watermark_blocks;
  }

  // Starts request `id` (waiting) with its cached prefix and a first chunk. False when it does not
  // fit now.
  bool admit(seq_id id, std::int32_t& budget) {
    entry& e = requests_.at(id);
    return start_from_cache(id, e, cache_->probe(e.tokens, {}), waiting_, budget);
  }

  // Starts request `id` (in `from`) with its cached prefix, as `p` probed it, and a first chunk;
  // what it had computed before is not used. False when it does not fit now.
  bool start_from_cache(seq_id id, entry& e, const prefix_match& p, std::vector<seq_id>& from,
                        std::int32_t& budget) {
    const auto len = static_cast<std::int32_t>(e.tokens.size());
    const std::int32_t n = std::min({len - p.num_tokens, config_.prefill_chunk, budget});
    const std::int32_t bs = table_->block_size();
    const std::int32_t need =
        blocks_for_tokens(p.num_tokens + n, bs) - p.num_blocks + (p.num_tokens % bs != 0 ? 1 : 0);
    if (need > allocator_->num_free() - p.num_evictable - watermark()) {
      return false;
    }
    const auto m = match_prefix(id, e);
    if (!m) {
      return false;
    }
    [[maybe_unused]] const status adopted = table_->adopt_sequence(
        id, std::span<const block_id>(match_.data(), static_cast<std::size_t>(m->num_blocks)),
        m->num_tokens);
    assert(adopted.ok());
    e.computed = m->num_tokens;
    start_running(id, e, from, n, budget);
    return true;
  }

  // Brings request `id` back from the host tier: cached blocks first, the rest copied back.
  bool swap_in(seq_id id, std::int32_t& budget) {
    entry& e = requests_.at(id);
    const std::int32_t n = tokens_for(e, budget);
    if (n == 0) {
      return false;
    }
    const prefix_match p = cache_->probe(e.tokens, {});
    if (p.num_tokens > e.computed && start_from_cache(id, e, p, swapped_, budget)) {
      // The cache holds more of its prompt than it had computed (a request that shares that
      // prefix computed it since): it starts from the cache as an admission does, and its host
      // copies go unused. Where that does not fit now (the cache's evictable blocks count
      // against it), it comes back as below, which may need fewer blocks.
      release_host_copies(e, e.host.size());
      return true;
    }
    const std::int32_t bs = table_->block_size();
    // New blocks: all but the whole blocks of its computed tokens that the cache still holds
    // (`full`, taken below; no copy-on-write follows, as the blocks after them are fresh). Those
    // in use cost nothing; evictable ones come out of the free count. The probe counts the
    // evictable blocks of the whole match, whose blocks past `full` are given back at once: at
    // most `full` of them are kept.
    const std::int32_t full = std::min(p.num_tokens / bs, e.computed / bs);
    const std::int32_t need = blocks_for_tokens(e.computed + n, bs) - full;
    if (need > allocator_->num_free() - std::min(p.num_evictable, full) - watermark()) {
      return false;
    }
    const auto m = match_prefix(id, e);
    if (!m) {
      return false;
    }
    assert(m->num_tokens == p.num_tokens); // nothing changed the cache since the probe
    // Use whole cached blocks of what it had computed; copy the rest back from the host.
    for (std::int32_t i = m->num_blocks; i-- > full;) {
      [[maybe_unused]] const status released =
          allocator_->release(match_[static_cast<std::size_t>(i)]);
    }
    [[maybe_unused]] const status adopted = table_->adopt_sequence(
        id, std::span<const block_id>(match_.data(), static_cast<std::size_t>(full)), full * bs);
    assert(adopted.ok());
    (void)cache_->truncate(id, full * bs);
    const auto rest = table_->append_tokens(id, e.computed - full * bs, {});
    assert(rest.ok());
    const auto blocks = *table_->blocks(id);
    for (std::size_t i = static_cast<std::size_t>(full); i < blocks.size(); ++i) {
      plan_.swap_in.push_back({e.host[i], blocks[i]});
    }
    release_host_copies(e, static_cast<std::size_t>(full));
    start_running(id, e, swapped_, n, budget);
    return true;
  }

  // Gives back the host copies of request `e`, back on the device. The first `unread` (of the
  // blocks it took from the cache, whose copies it does not read) at once, and the swap-outs of
  // this step into those that no other request holds leave the plan (where `e` was swapped out in
  // this step, they would be copies nothing reads). Safe during a step: only its phase 1
  // allocates host blocks, and a block another request reads in this step stays held by that
  // request until complete_step. The rest at complete_step, after the engine has copied them
  // back.
  void release_host_copies(entry& e, std::size_t unread) {
    for (std::size_t i = 0; i < unread; ++i) {
      [[maybe_unused]] const status released = host_.release(e.host[i]);
      assert(released.ok());
    }
    host_release_.insert(host_release_.end(), e.host.begin() + static_cast<std::ptrdiff_t>(unread),
                         e.host.end());
    e.host.clear();
    if (unread > 0) {
      std::erase_if(plan_.swap_out,
                    [&](const block_copy& c) { return host_.ref_count(c.dst) == 0; });
    }
  }

  // The longest cached prefix of a request's tokens, with a reference to each block for the
  // caller; starts the cache tracking `id`.
  [[nodiscard]] result<prefix_match> match_prefix(seq_id id, const entry& e) {
    match_.resize(static_cast<std::size_t>(
        blocks_for_tokens(static_cast<std::int32_t>(e.tokens.size()), table_->block_size())));
    return cache_->match(id, e.tokens, {}, match_, retention{});
  }

  // Moves a request from `from` (waiting or swapped) to running and schedules its first `n` tokens.
  void start_running(seq_id id, entry& e, std::vector<seq_id>& from, std::int32_t n,
                     std::int32_t& budget) {
    e.where = place::running;
    erase_from(from, id);
    insert_sorted(running_, id);
    schedule(id, e, n);
    budget -= n;
  }

  void insert_sorted(std::vector<seq_id>& list, seq_id id) {
    const request_order_info& key = requests_.at(id).order;
    const auto at = std::upper_bound(list.begin(), list.end(), key,
                                     [&](const request_order_info& k, seq_id other) {
                                       return policy_.before(k, requests_.at(other).order);
                                     });
    list.insert(at, id);
  }

  static void erase_from(std::vector<seq_id>& list, seq_id id) {
    const auto it = std::find(list.begin(), list.end(), id);
    if (it != list.end()) {
      list.erase(it);
    }
  }

  Mapping* table_;
  Index* cache_;
  Allocator* allocator_;
  scheduler_config config_;
  Policy policy_;
  block_pool host_; // the swap tier's block ids
  std::unordered_map<seq_id, entry> requests_;
  std::vector<seq_id> waiting_;  // policy order
  std::vector<seq_id> running_;  // policy order
  std::vector<seq_id> swapped_;  // policy order
  std::int64_t step_epoch_ = 0;  // counts step() calls
  std::int64_t epoch_ = 0;       // counts complete_step() calls
  std::size_t num_sampling_ = 0; // sequences of the current plan that sample
  bool in_flight_ = false;       // between step() and its complete_step()
  std::vector<block_id> host_release_;
  // This step's swap-outs: device block -> its host copy (a block two victims share is copied
  // once).
  std::unordered_map<block_id, block_id> swap_copies_;
  std::vector<block_id> match_;
  step_plan plan_;
  std::int64_t next_arrival_ = 0;
  std::int64_t preemptions_ = 0;
};

} // namespace kvkit
