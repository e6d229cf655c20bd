// A serving simulation over a paged KV cache with prefix caching.
//
// A synthetic trace of chat requests (shared system prompts, multi-turn conversations, one-off
// prompts) arrives over time. Requests are admitted first come first served, prefill their prompt,
// then grow one token per step until they finish. The same trace runs twice:
//  - kvkit: block_pool + block_table + prefix_cache. A request holds only the blocks its tokens
//    fill; prompt blocks already in the cache (a shared system prompt, the earlier turns of a
//    conversation) are reused instead of recomputed; when blocks run out the most recently
//    admitted request is preempted (its computed blocks stay cached, so its recompute is cheap).
//  - baseline: each running request reserves max_len contiguous token slots up front and
//    computes its whole prompt.
// Both get the same KV memory. The summary compares steps, tokens per step, batch size, prompt
// tokens computed, prefix hit rate, preemptions and memory utilization: the share of reserved KV
// memory that holds live tokens.
//
// This simulation runs on the CPU: it drives the allocator, page tables and prefix cache exactly as
// an engine would (including the per-step page-table export) but computes no attention.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <kvkit/kvkit.hpp>

namespace {

using kvkit::token_id;

struct options {
  std::int32_t requests = 2000;
  std::uint64_t seed = 1;
  std::int32_t block_size = 16;
  std::int32_t kv_tokens = 65536;   // KV memory, in tokens, shared by all running requests
  std::int32_t max_len = 4096;      // model context length: the baseline's reservation
  std::int32_t max_running = 256;   // batch limit
  double arrivals_per_step = 1.0;   // Poisson arrivals
  double message_median = 120;      // log-normal user message lengths
  double output_median = 160;       // log-normal output lengths
  double follow_up_share = 0.3;     // requests that continue an earlier conversation
  double system_prompt_share = 0.8; // new conversations that start with a shared system prompt
  bool prefix_cache = true;
  bool quiet = false;
};

struct request {
  std::int32_t arrival = 0;
  std::vector<token_id> prompt;
  std::vector<token_id> output; // what the model will generate (decided by the trace)
};

std::vector<token_id> random_tokens(std::mt19937_64& rng, std::int32_t n) {
  std::vector<token_id> t(static_cast<std::size_t>(n));
  for (auto& x : t) {
    x = static_cast<token_id>(rng() % 128000);
  }
  return t;
}

// The trace. Four system prompts of 180, 430, 950 and 1500 tokens (none block aligned); a new
// conversation starts with one of them (system_prompt_share) and a user message; a follow-up turn
// repeats an earlier request's prompt and answer and adds a new message, arriving after that
// answer could have been read. Poisson arrivals; log-normal message and output lengths (sigma 0.8
// and 1.0), the shape of public chat traces: most short, a long tail.
std::vector<request> make_trace(const options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<token_id>> systems;
  for (const std::int32_t len : {180, 430, 950, 1500}) {
    systems.push_back(random_tokens(rng, len));
  }
  std::exponential_distribution<double> gap(o.arrivals_per_step);
  std::lognormal_distribution<double> message(std::log(o.message_median), 0.8);
  std::lognormal_distribution<double> output(std::log(o.output_median), 1.0);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<request> trace(static_cast<std::size_t>(o.requests));
  double t = 0;
  for (std::size_t i = 0; i < trace.size(); ++i) {
    request& r = trace[i];
    t += gap(rng);
    r.arrival = static_cast<std::int32_t>(t);
    const auto msg =
        random_tokens(rng, std::clamp(static_cast<std::int32_t>(message(rng)), 4, o.max_len / 4));
    if (i > 0 && coin(rng) < o.follow_up_share) {
      const request& earlier = trace[static_cast<std::size_t>(rng() % i)];
      r.prompt = earlier.prompt;
      r.prompt.insert(r.prompt.end(), earlier.output.begin(), earlier.output.end());
      const auto ready = earlier.arrival + static_cast<std::int32_t>(earlier.output.size()) + 50;
      r.arrival = std::max(r.arrival, ready);
    } else if (coin(rng) < o.system_prompt_share) {
      r.prompt = systems[static_cast<std::size_t>(rng() % systems.size())];
    }
    r.prompt.insert(r.prompt.end(), msg.begin(), msg.end());
    if (static_cast<std::int32_t>(r.prompt.size()) > o.max_len * 3 / 4) {
      r.prompt.erase(r.prompt.begin(), r.prompt.end() - o.max_len / 4); // conversation truncated
    }
    const auto room = o.max_len - static_cast<std::int32_t>(r.prompt.size());
    r.output = random_tokens(rng, std::clamp(static_cast<std::int32_t>(output(rng)), 1, room));
  }
  std::stable_sort(trace.begin(), trace.end(),
                   [](const request& a, const request& b) { return a.arrival < b.arrival; });
  return trace;
}

// KV memory managed by kvkit: blocks on demand, prompts served from the prefix cache.
class paged_memory {
public:
  explicit paged_memory(const options& o)
      : block_size_(o.block_size), use_cache_(o.prefix_cache), pool_(o.kv_tokens / o.block_size),
        table_(pool_, o.block_size), cache_(pool_, o.block_size, {.share_partial_blocks = true}),
        watermark_(std::max(1, pool_.capacity() / 100)),
        filled_(static_cast<std::size_t>(pool_.capacity()), 0) {}

  static constexpr const char* name = "kvkit paged";

  // Admits `tokens` (a prompt, or a preempted request's prompt and output so far). Returns the
  // prompt tokens that must be computed, or -1 when it does not fit now. Admission keeps a 1%
  // watermark of free blocks so running requests can still grow.
  std::int32_t admit(kvkit::seq_id id, const std::vector<token_id>& tokens) {
    const auto len = static_cast<std::int32_t>(tokens.size());
    const kvkit::prefix_match hit = use_cache_ ? cache_.probe(tokens) : kvkit::prefix_match{};
    const std::int32_t need = kvkit::blocks_for_tokens(len + 1, block_size_) - hit.num_blocks + 1;
    if (need > pool_.num_free() - hit.num_evictable - watermark_) {
      return -1;
    }
    if (!use_cache_) {
      return table_.add_sequence(id).ok() && table_.append_tokens(id, len, {}).ok() ? len : -1;
    }
    const auto a = cache_.admit(table_, id, tokens);
    if (!a) {
      return -1;
    }
    copies_ += a->append.copied ? 1 : 0;
    (void)cache_.publish(id, *table_.blocks(id), tokens);
    return len - a->hit.num_tokens;
  }
  // Appends the K/V of the request's newest token and publishes any block that filled.
  bool grow(kvkit::seq_id id, const std::vector<token_id>& tokens) {
    const auto info = table_.append_tokens(id, 1, slot_);
    if (!info) {
      return false;
    }
    copies_ += info->copied ? 1 : 0;
    if (use_cache_ && static_cast<std::int32_t>(tokens.size()) % block_size_ == 0) {
      (void)cache_.publish(id, *table_.blocks(id), tokens);
    }
    return true;
  }
  // Finished or preempted: computed blocks stay cached for later turns and recomputes.
  void release(kvkit::seq_id id, const std::vector<token_id>& tokens) {
    if (use_cache_) {
      (void)cache_.finish(id, *table_.blocks(id), tokens);
    }
    (void)table_.free(id);
  }
  [[nodiscard]] std::int64_t reserved_tokens() const {
    return static_cast<std::int64_t>(pool_.num_used()) * block_size_;
  }
  // Tokens stored in blocks held by the batch, each shared block counted once.
  [[nodiscard]] std::int64_t stored_tokens(const std::vector<kvkit::seq_id>& batch) {
    std::int64_t total = 0;
    touched_.clear();
    for (const auto id : batch) {
      const auto blocks = *table_.blocks(id);
      const std::int32_t len = *table_.num_tokens(id);
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::int32_t in_block =
            i + 1 < blocks.size() ? block_size_ : kvkit::last_block_len(len, block_size_);
        auto& f = filled_[static_cast<std::size_t>(blocks[i])];
        if (f == 0) {
          touched_.push_back(blocks[i]);
        }
        total += std::max(0, in_block - f);
        f = std::max(f, in_block);
      }
    }
    for (const auto b : touched_) {
      filled_[static_cast<std::size_t>(b)] = 0;
    }
    return total;
  }
  // What an engine does every step before attention: the batch's page table in CSR form.
  void export_page_table(const std::vector<kvkit::seq_id>& batch) {
    indptr_.resize(batch.size() + 1);
    last_.resize(batch.size());
    indices_.resize(static_cast<std::size_t>(*table_.csr_size(batch)));
    if (!table_.export_csr(batch, indptr_, indices_, last_).ok()) {
      std::fprintf(stderr, "page-table export failed\n");
      std::exit(1);
    }
  }
  // The step's copy-on-write copies have run (an engine runs them before attention).
  void end_step() { table_.release_copy_sources(); }
  [[nodiscard]] double hit_rate() const { return cache_.stats().hit_rate(); }
  [[nodiscard]] std::int64_t copies() const { return copies_; }
  [[nodiscard]] bool drained() const {
    return pool_.num_used() == 0 && table_.num_sequences() == 0;
  }

private:
  std::int32_t block_size_;
  bool use_cache_;
  kvkit::block_pool pool_;
  kvkit::block_table<kvkit::block_pool> table_;
  kvkit::prefix_cache<> cache_;
  std::int32_t watermark_;
  std::array<kvkit::token_slot, 1> slot_{};
  std::vector<std::int32_t> indptr_, indices_, last_;
  std::vector<std::int32_t> filled_;
  std::vector<kvkit::block_id> touched_;
  std::int64_t copies_ = 0;
};

// The baseline: max_len contiguous slots reserved per request at admission, no reuse.
class contiguous_memory {
public:
  explicit contiguous_memory(const options& o)
      : max_len_(o.max_len), slots_free_(o.kv_tokens / o.max_len) {}

  static constexpr const char* name = "max_len reservation";

  std::int32_t admit(kvkit::seq_id /*id*/, const std::vector<token_id>& tokens) {
    if (slots_free_ == 0) {
      return -1;
    }
    --slots_free_;
    ++slots_used_;
    return static_cast<std::int32_t>(tokens.size());
  }
  bool grow(kvkit::seq_id /*id*/, const std::vector<token_id>& /*tokens*/) { return true; }
  void release(kvkit::seq_id /*id*/, const std::vector<token_id>& /*tokens*/) {
    ++slots_free_;
    --slots_used_;
  }
  [[nodiscard]] std::int64_t reserved_tokens() const {
    return static_cast<std::int64_t>(slots_used_) * max_len_;
  }
  [[nodiscard]] std::int64_t stored_tokens(const std::vector<kvkit::seq_id>& /*batch*/) const {
    return stored_;
  }
  void set_stored(std::int64_t n) { stored_ = n; }
  void export_page_table(const std::vector<kvkit::seq_id>& /*batch*/) {}
  void end_step() {}
  [[nodiscard]] double hit_rate() const { return 0; }
  [[nodiscard]] std::int64_t copies() const { return 0; }
  [[nodiscard]] bool drained() const { return slots_used_ == 0; }

private:
  std::int32_t max_len_;
  std::int32_t slots_free_;
  std::int32_t slots_used_ = 0;
  std::int64_t stored_ = 0;
};

struct stats {
  std::int64_t steps = 0;
  std::int64_t decode_tokens = 0;
  std::int64_t prompt_tokens = 0;   // prompt tokens admitted (recomputes included)
  std::int64_t computed_prompt = 0; // of those, computed (not served from cache)
  std::int64_t preemptions = 0;
  double stored_token_steps = 0;   // sum over steps of tokens held in reserved KV memory
  double reserved_token_steps = 0; // sum over steps of KV slots reserved
  double running_sum = 0;
  std::int32_t max_running = 0;
  double hit_rate = 0;
  std::int64_t copies = 0;
  bool drained = false;
};

template <class Memory>
stats simulate(const options& o, const std::vector<request>& trace) {
  Memory mem(o);
  stats st;
  struct live {
    std::size_t req;
    std::vector<token_id> tokens; // prompt, then generated tokens
    std::size_t kv = 0;           // leading tokens whose K/V is in the cache
    bool fresh = false;           // prefilled this step
    [[nodiscard]] std::vector<token_id> cached() const {
      return {tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(kv)};
    }
  };
  std::deque<live> waiting;
  std::vector<live> running;
  std::vector<kvkit::seq_id> batch;
  std::size_t next_arrival = 0;
  std::size_t finished = 0;
  std::size_t next_report = trace.size() / 10;

  const auto preempt_newest = [&] {
    live victim = std::move(running.back());
    running.pop_back();
    mem.release(victim.req, victim.cached());
    waiting.push_front(std::move(victim)); // recomputed when blocks free up
    ++st.preemptions;
  };

  for (std::int64_t step = 0; finished < trace.size(); ++step) {
    while (next_arrival < trace.size() && trace[next_arrival].arrival <= step) {
      waiting.push_back({next_arrival, trace[next_arrival].prompt});
      ++next_arrival;
    }
    // Admit first come first served; an admitted request prefills this step and produces a token.
    while (!waiting.empty() && static_cast<std::int32_t>(running.size()) < o.max_running) {
      live& w = waiting.front();
      const std::int32_t computed = mem.admit(w.req, w.tokens);
      if (computed < 0) {
        break;
      }
      st.prompt_tokens += static_cast<std::int64_t>(w.tokens.size());
      st.computed_prompt += computed;
      w.kv = w.tokens.size();
      const auto& r = trace[w.req];
      const std::size_t produced = w.tokens.size() - r.prompt.size();
      if (produced < r.output.size()) {
        w.tokens.push_back(r.output[produced]); // the prefill's token
      }
      w.fresh = true;
      running.push_back(std::move(w));
      waiting.pop_front();
    }
    // Decode: every other running request appends the K/V of its newest token.
    for (std::size_t i = 0; i < running.size(); ++i) {
      if (running[i].fresh) {
        running[i].fresh = false;
        continue;
      }
      bool grown = false;
      while (i < running.size() && !(grown = mem.grow(running[i].req, running[i].tokens))) {
        preempt_newest();
      }
      if (!grown) {
        break;
      }
      ++st.decode_tokens;
      running[i].kv = running[i].tokens.size();
      const auto& r = trace[running[i].req];
      const std::size_t produced = running[i].tokens.size() - r.prompt.size();
      if (produced < r.output.size()) {
        running[i].tokens.push_back(r.output[produced]);
      }
    }
    batch.clear();
    std::int64_t live_tokens = 0;
    for (const auto& r : running) {
      batch.push_back(r.req);
      live_tokens += static_cast<std::int64_t>(r.kv);
    }
    if constexpr (requires { mem.set_stored(0); }) {
      mem.set_stored(live_tokens);
    }
    mem.export_page_table(batch);
    mem.end_step();
    st.stored_token_steps += static_cast<double>(mem.stored_tokens(batch));
    st.reserved_token_steps += static_cast<double>(mem.reserved_tokens());
    st.running_sum += static_cast<double>(running.size());
    st.max_running = std::max(st.max_running, static_cast<std::int32_t>(running.size()));
    // A request that has produced its last output token finishes at the end of the step
    // (the K/V of its last token is never needed).
    const auto done = [&](const live& r) {
      const auto& req = trace[r.req];
      if (r.tokens.size() < req.prompt.size() + req.output.size()) {
        return false;
      }
      mem.release(r.req, r.cached());
      ++finished;
      return true;
    };
    running.erase(std::remove_if(running.begin(), running.end(), done), running.end());
    st.steps = step + 1;
    if (!o.quiet && finished >= next_report && next_report > 0) {
      std::printf("  [%s] %3zu%% of requests done at step %lld, %zu running, %zu waiting\n",
                  Memory::name, finished * 100 / trace.size(), static_cast<long long>(step),
                  running.size(), waiting.size());
      next_report += trace.size() / 10;
    }
  }
  st.hit_rate = mem.hit_rate();
  st.copies = mem.copies();
  st.drained = mem.drained();
  return st;
}

bool parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quiet") {
      o.quiet = true;
      continue;
    }
    if (a == "--no-prefix-cache") {
      o.prefix_cache = false;
      continue;
    }
    if (a == "--help" || a == "-h" || i + 1 >= argc) {
      return false;
    }
    const char* v = argv[++i];
    if (a == "--requests") {
      o.requests = std::atoi(v);
    } else if (a == "--seed") {
      o.seed = std::strtoull(v, nullptr, 10);
    } else if (a == "--block-size") {
      o.block_size = std::atoi(v);
    } else if (a == "--kv-tokens") {
      o.kv_tokens = std::atoi(v);
    } else if (a == "--max-len") {
      o.max_len = std::atoi(v);
    } else if (a == "--max-running") {
      o.max_running = std::atoi(v);
    } else if (a == "--arrival-rate") {
      o.arrivals_per_step = std::atof(v);
    } else if (a == "--follow-ups") {
      o.follow_up_share = std::atof(v);
    } else {
      return false;
    }
  }
  return o.requests > 0 && o.block_size > 0 && o.max_len >= 64 && o.kv_tokens >= 2 * o.max_len &&
         o.max_running > 0 && o.arrivals_per_step > 0 && o.follow_up_share >= 0 &&
         o.follow_up_share <= 1;
}

} // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0); // progress lines show as they happen, piped or not
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: serving_sim [--requests N] [--seed S] [--block-size B] [--kv-tokens T]\n"
                 "                   [--max-len L] [--max-running R] [--arrival-rate A]\n"
                 "                   [--follow-ups F] [--no-prefix-cache] [--quiet]\n"
                 "  kv-tokens >= 2 x max-len, max-len >= 64, 0 <= follow-ups <= 1\n");
    return 2;
  }
  const auto trace = make_trace(o);
  double mean_prompt = 0;
  double mean_output = 0;
  for (const auto& r : trace) {
    mean_prompt += static_cast<double>(r.prompt.size());
    mean_output += static_cast<double>(r.output.size());
  }
  mean_prompt /= static_cast<double>(trace.size());
  mean_output /= static_cast<double>(trace.size());
  std::printf("kvkit serving simulation (CPU; no attention is computed)\n");
  std::printf("trace: %d requests, seed %llu, %.2f arrivals/step, %.0f%% follow-up turns, mean "
              "prompt %.0f, mean output %.0f tokens\n",
              o.requests, static_cast<unsigned long long>(o.seed), o.arrivals_per_step,
              100 * o.follow_up_share, mean_prompt, mean_output);
  std::printf("KV memory: %d tokens (%d blocks of %d), max_len %d, batch limit %d, prefix cache "
              "%s\n\n",
              o.kv_tokens, o.kv_tokens / o.block_size, o.block_size, o.max_len, o.max_running,
              o.prefix_cache ? "on" : "off");

  const stats paged = simulate<paged_memory>(o, trace);
  const stats base = simulate<contiguous_memory>(o, trace);

  const auto row = [](const char* label, const stats& s) {
    std::printf(
        "%-20s %7lld %9.1f %6.1f %5d %14.1f%% %9.1f%% %10.1f%% %6lld\n", label,
        static_cast<long long>(s.steps),
        static_cast<double>(s.decode_tokens + s.prompt_tokens) / static_cast<double>(s.steps),
        s.running_sum / static_cast<double>(s.steps), s.max_running,
        100.0 * static_cast<double>(s.computed_prompt) /
            static_cast<double>(std::max<std::int64_t>(1, s.prompt_tokens)),
        100.0 * s.hit_rate, 100.0 * s.stored_token_steps / std::max(1.0, s.reserved_token_steps),
        static_cast<long long>(s.preemptions));
  };
  std::printf("\n%-20s %7s %9s %6s %5s %13s %10s %11s %6s\n", "KV memory", "steps", "tokens/st",
              "batch", "max", "prompt computed", "prefix hit", "utilization", "preempt");
  row(paged_memory::name, paged);
  row(contiguous_memory::name, base);
  std::printf("\nkvkit finished the trace in %.2fx fewer steps and computed %.1f%% of the prompt "
              "tokens the baseline did.\n",
              static_cast<double>(base.steps) / static_cast<double>(paged.steps),
              100.0 * static_cast<double>(paged.computed_prompt) /
                  static_cast<double>(base.computed_prompt));
  std::printf("utilization = tokens held in reserved KV memory / reserved KV slots, averaged over "
              "steps (a shared block counts once); %lld copy-on-write page copies.\n",
              static_cast<long long>(paged.copies));
  if (!paged.drained || !base.drained) {
    std::fprintf(stderr, "error: KV memory not fully returned at the end\n");
    return 1;
  }
  return 0;
}
