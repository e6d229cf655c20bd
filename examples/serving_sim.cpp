// A serving simulation over a paged KV cache.
//
// Requests arrive over time, are admitted first come first served, prefill their prompt, then
// grow one token per step until they finish. The same trace runs twice:
//  - kvkit: block_pool + block_table; a request holds only the blocks its tokens fill, and when
//    blocks run out the most recently admitted request is preempted (freed, recomputed later).
//  - baseline: each running request reserves max_len contiguous token slots up front.
// Both get the same KV memory. The summary compares steps, batch size and memory utilization:
// the share of reserved KV memory that holds live tokens.
//
// This simulation runs on the CPU: it drives the block allocator and page tables exactly as an
// engine would (including the per-step page-table export) but computes no attention.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include <kvkit/kvkit.hpp>

namespace {

struct options {
  std::int32_t requests = 2000;
  std::uint64_t seed = 1;
  std::int32_t block_size = 16;
  std::int32_t kv_tokens = 65536; // KV memory, in tokens, shared by all running requests
  std::int32_t max_len = 4096;    // model context length: the baseline's reservation
  std::int32_t max_running = 256; // batch limit
  double arrivals_per_step = 1.0; // Poisson arrivals
  double prompt_median = 512;     // log-normal prompt lengths
  double output_median = 160;     // log-normal output lengths
  bool quiet = false;
};

struct request {
  std::int32_t arrival = 0;
  std::int32_t prompt = 0;
  std::int32_t output = 0;
};

// Poisson arrivals; log-normal prompt and output lengths (sigma 0.9 and 1.0), the shape of
// public chat traces: most requests short, a long tail of long ones.
std::vector<request> make_trace(const options& o) {
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(o.arrivals_per_step);
  std::lognormal_distribution<double> prompt(std::log(o.prompt_median), 0.9);
  std::lognormal_distribution<double> output(std::log(o.output_median), 1.0);
  std::vector<request> trace(static_cast<std::size_t>(o.requests));
  double t = 0;
  for (auto& r : trace) {
    t += gap(rng);
    r.arrival = static_cast<std::int32_t>(t);
    r.prompt = std::clamp(static_cast<std::int32_t>(prompt(rng)), 8, o.max_len * 3 / 4);
    r.output = std::clamp(static_cast<std::int32_t>(output(rng)), 1, o.max_len - r.prompt);
  }
  return trace;
}

// KV memory managed by kvkit: blocks on demand.
class paged_memory {
public:
  explicit paged_memory(const options& o)
      : block_size_(o.block_size), pool_(o.kv_tokens / o.block_size), table_(pool_, o.block_size),
        watermark_(std::max(1, pool_.capacity() / 100)) {}

  static constexpr const char* name = "kvkit paged";

  // Admission keeps a 1% watermark of free blocks so running requests can still grow.
  bool admit(kvkit::seq_id id, std::int32_t prompt) {
    const std::int32_t need = kvkit::blocks_for_tokens(prompt + 1, block_size_);
    if (need > pool_.num_free() - watermark_ || !table_.add_sequence(id).ok()) {
      return false;
    }
    return table_.append_tokens(id, prompt, {}).ok();
  }
  bool grow(kvkit::seq_id id) { return table_.append_tokens(id, 1, slot_).ok(); }
  void release(kvkit::seq_id id) { (void)table_.free(id); }
  [[nodiscard]] std::int64_t reserved_tokens() const {
    return static_cast<std::int64_t>(pool_.num_used()) * block_size_;
  }
  // What an engine does every step before attention: the batch's page table in CSR form.
  void export_page_table(const std::vector<kvkit::seq_id>& batch) {
    indptr_.resize(batch.size() + 1);
    last_.resize(batch.size());
    indices_.resize(static_cast<std::size_t>(pool_.capacity()));
    if (!table_.export_csr(batch, indptr_, indices_, last_).ok()) {
      std::fprintf(stderr, "page-table export failed\n");
      std::exit(1);
    }
  }
  [[nodiscard]] bool drained() const { return pool_.num_free() == pool_.capacity(); }

private:
  std::int32_t block_size_;
  kvkit::block_pool pool_;
  kvkit::block_table<kvkit::block_pool> table_;
  std::int32_t watermark_;
  std::array<kvkit::token_slot, 1> slot_{};
  std::vector<std::int32_t> indptr_, indices_, last_;
};

// The baseline: max_len contiguous slots reserved per request at admission.
class contiguous_memory {
public:
  explicit contiguous_memory(const options& o)
      : max_len_(o.max_len), slots_free_(o.kv_tokens / o.max_len) {}

  static constexpr const char* name = "max_len reservation";

  bool admit(kvkit::seq_id /*id*/, std::int32_t /*prompt*/) {
    if (slots_free_ == 0) {
      return false;
    }
    --slots_free_;
    ++slots_used_;
    return true;
  }
  bool grow(kvkit::seq_id /*id*/) { return true; } // never runs out: it reserved max_len
  void release(kvkit::seq_id /*id*/) {
    ++slots_free_;
    --slots_used_;
  }
  [[nodiscard]] std::int64_t reserved_tokens() const {
    return static_cast<std::int64_t>(slots_used_) * max_len_;
  }
  void export_page_table(const std::vector<kvkit::seq_id>& /*batch*/) {}
  [[nodiscard]] bool drained() const { return slots_used_ == 0; }

private:
  std::int32_t max_len_;
  std::int32_t slots_free_;
  std::int32_t slots_used_ = 0;
};

struct stats {
  std::int64_t steps = 0;
  std::int64_t decode_tokens = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t preemptions = 0;
  double live_token_steps = 0;     // sum over steps of tokens held by running requests
  double reserved_token_steps = 0; // sum over steps of KV slots reserved
  double running_sum = 0;
  std::int32_t max_running = 0;
  bool drained = false;
};

template <class Memory>
stats simulate(const options& o, const std::vector<request>& trace) {
  Memory mem(o);
  stats st;
  struct live {
    std::size_t req;
    std::int32_t generated;
    bool fresh;
  };
  std::deque<std::size_t> waiting;
  std::vector<live> running;
  std::vector<kvkit::seq_id> batch;
  std::size_t next_arrival = 0;
  std::size_t finished = 0;
  std::size_t next_report = trace.size() / 10;

  const auto preempt_newest = [&] {
    const live victim = running.back();
    running.pop_back();
    mem.release(victim.req);
    waiting.push_front(victim.req); // recompute: it starts over when blocks free up
    ++st.preemptions;
  };

  for (std::int64_t step = 0; finished < trace.size(); ++step) {
    while (next_arrival < trace.size() && trace[next_arrival].arrival <= step) {
      waiting.push_back(next_arrival++);
    }
    // Admit first come first served; an admitted request prefills its prompt this step and
    // produces its first token.
    while (!waiting.empty() && static_cast<std::int32_t>(running.size()) < o.max_running &&
           mem.admit(waiting.front(), trace[waiting.front()].prompt)) {
      st.prompt_tokens += trace[waiting.front()].prompt;
      running.push_back({waiting.front(), 1, true});
      waiting.pop_front();
    }
    // Decode: every other running request appends the K/V of its last token.
    for (std::size_t i = 0; i < running.size(); ++i) {
      if (running[i].fresh) {
        running[i].fresh = false; // prefilled this step
        continue;
      }
      while (!mem.grow(running[i].req)) {
        preempt_newest();
        if (i >= running.size()) {
          break;
        }
      }
      if (i < running.size()) {
        ++running[i].generated;
        ++st.decode_tokens;
      }
    }
    batch.clear();
    double live_tokens = 0;
    for (const auto& r : running) {
      batch.push_back(r.req);
      live_tokens += trace[r.req].prompt + r.generated;
    }
    mem.export_page_table(batch);
    st.live_token_steps += live_tokens;
    st.reserved_token_steps += static_cast<double>(mem.reserved_tokens());
    st.running_sum += static_cast<double>(running.size());
    st.max_running = std::max(st.max_running, static_cast<std::int32_t>(running.size()));
    // Finished requests leave at the end of the step.
    const auto done = [&](const live& r) {
      if (r.generated < trace[r.req].output) {
        return false;
      }
      mem.release(r.req);
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
  st.drained = mem.drained();
  return st;
}

bool parse(int argc, char** argv, options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> const char* {
      return i + 1 < argc ? argv[++i] : nullptr;
    };
    const char* v = nullptr;
    if (a == "--quiet") {
      o.quiet = true;
      continue;
    }
    if (a == "--help" || a == "-h" || (v = value()) == nullptr) {
      return false;
    }
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
    } else {
      return false;
    }
  }
  return o.requests > 0 && o.block_size > 0 && o.max_len > 8 && o.kv_tokens >= 2 * o.max_len &&
         o.max_running > 0 && o.arrivals_per_step > 0;
}

} // namespace

int main(int argc, char** argv) {
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: serving_sim [--requests N] [--seed S] [--block-size B] [--kv-tokens T]\n"
                 "                   [--max-len L] [--max-running R] [--arrival-rate A] [--quiet]\n"
                 "  kv-tokens must be at least 2 x max-len; all values positive\n");
    return 2;
  }
  const auto trace = make_trace(o);
  double mean_prompt = 0;
  double mean_output = 0;
  for (const auto& r : trace) {
    mean_prompt += r.prompt;
    mean_output += r.output;
  }
  mean_prompt /= static_cast<double>(trace.size());
  mean_output /= static_cast<double>(trace.size());
  std::printf("kvkit serving simulation (CPU; no attention is computed)\n");
  std::printf("trace: %d requests, seed %llu, %.2f arrivals/step, mean prompt %.0f, mean output "
              "%.0f tokens\n",
              o.requests, static_cast<unsigned long long>(o.seed), o.arrivals_per_step, mean_prompt,
              mean_output);
  std::printf("KV memory: %d tokens (%d blocks of %d), max_len %d, batch limit %d\n\n", o.kv_tokens,
              o.kv_tokens / o.block_size, o.block_size, o.max_len, o.max_running);

  const stats paged = simulate<paged_memory>(o, trace);
  const stats base = simulate<contiguous_memory>(o, trace);

  const auto row = [](const char* label, const stats& s) {
    std::printf(
        "%-22s %8lld %10.1f %10.1f %8d %12.1f%% %12lld\n", label, static_cast<long long>(s.steps),
        static_cast<double>(s.decode_tokens + s.prompt_tokens) / static_cast<double>(s.steps),
        s.running_sum / static_cast<double>(s.steps), s.max_running,
        100.0 * s.live_token_steps / std::max(1.0, s.reserved_token_steps),
        static_cast<long long>(s.preemptions));
  };
  std::printf("\n%-22s %8s %10s %10s %8s %13s %12s\n", "KV memory", "steps", "tokens/st",
              "mean batch", "max", "utilization", "preemptions");
  row(paged_memory::name, paged);
  row(contiguous_memory::name, base);
  std::printf("\nkvkit finished the trace in %.2fx fewer steps; utilization = live tokens / "
              "reserved KV slots, averaged over steps\n",
              static_cast<double>(base.steps) / static_cast<double>(paged.steps));
  if (!paged.drained || !base.drained) {
    std::fprintf(stderr, "error: KV memory not fully returned at the end\n");
    return 1;
  }
  return 0;
}
