// A serving simulation over a paged KV cache, driven by kvkit's scheduler.
//
// A synthetic trace of chat requests (shared system prompts, multi-turn conversations, one-off
// prompts) arrives over time and runs twice:
//  - kvkit: scheduler + block_pool + block_table + prefix_cache. Continuous batching: every step
//    finished requests leave and new ones join, under a token budget (chunked prefill mixes long
//    prompts with decodes) and a sequence limit; prompt blocks already cached (a shared system
//    prompt, the earlier turns of a conversation) are reused instead of recomputed; when blocks
//    run out the newest request is preempted and recomputed later (mostly from cache), or with
//    --preempt swap copied out to a host tier and back in later.
//  - baseline: static batching with max_len contiguous slots reserved per request: a batch runs
//    until its longest request ends before the next one starts, and every prompt is computed.
// Both get the same KV memory. The summary compares steps, tokens per step, batch size, prompt
// tokens computed, prefix hit rate, preemptions and memory utilization: the share of reserved KV
// memory that holds live tokens.
//
// The loop plays the engine: it runs the scheduler's plans and "samples" the trace's output
// tokens; each step the model engine (sim_attention.hpp) executes the swaps and copy-on-write
// copies, writes every computed token's K/V into its slot and runs decode attention and prefill
// attention (each prompt chunk's tokens over their sequence's pages) over the page tables: on a GPU
// with kvkit's kernels over a model-shaped layer, else with the CPU reference at a reduced size.
// Decode and prefill outputs are checked against a dense recomputation from the tokens.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <kvkit/kvkit.hpp>
#include <kvkit/sched/scheduler.hpp>
#include <kvkit/testing/prefix_index_archetype.hpp>

#include "sim_attention.hpp"

namespace {

using kvkit::token_id;

struct options {
  std::int32_t requests = 2000;
  std::uint64_t seed = 1;
  std::int32_t block_size = 16;
  std::int32_t kv_tokens = 65536;         // KV memory, in tokens, shared by all running requests
  std::int32_t max_len = 4096;            // model context length: the baseline's reservation
  std::int32_t max_running = 256;         // batch limit
  std::int32_t max_batched_tokens = 8192; // tokens per step
  std::int32_t prefill_chunk = 2048;      // chunked prefill
  double arrivals_per_step = 1.0;         // Poisson arrivals
  double message_median = 120;            // log-normal user message lengths
  double output_median = 160;             // log-normal output lengths
  double follow_up_share = 0.3;           // requests that continue an earlier conversation
  double system_prompt_share = 0.8; // new conversations that start with a shared system prompt
  bool prefix_cache = true;
  bool check_pages = false; // the GPU kernels in their debug mode (page ids checked on the device)
  std::string preempt = "recompute"; // or swap: preempted requests go to a host tier
  std::int32_t host_tokens = 0;      // the host tier, in tokens (swap; 0: half the KV memory)
  bool quiet = false;
  std::string engine = "auto"; // auto: the GPU when there is one; gpu; cpu
  std::string csv;             // per-step series of both runs, for plots
};

// Per-step series: system, step, running, waiting, reserved tokens, stored tokens, tokens computed.
void csv_row(std::FILE* f, const char* system, std::int64_t step, std::size_t running,
             std::size_t waiting, double reserved, double stored, std::int64_t computed) {
  if (f != nullptr) {
    std::fprintf(f, "%s,%lld,%zu,%zu,%.0f,%.0f,%lld\n", system, static_cast<long long>(step),
                 running, waiting, reserved, stored, static_cast<long long>(computed));
  }
}

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
  std::int64_t swapped_out = 0; // pages
  std::int64_t swapped_in = 0;
  bool drained = false;
  sim::engine_stats engine;
};

void report_progress(const char* name, const options& o, std::size_t finished, std::size_t total,
                     std::size_t& next_report, std::int64_t step, std::size_t running,
                     std::size_t waiting) {
  if (!o.quiet && finished >= next_report && next_report > 0) {
    std::printf("  [%s] %3zu%% of requests done at step %lld, %zu running, %zu waiting\n", name,
                finished * 100 / total, static_cast<long long>(step), running, waiting);
    next_report += total / 10;
  }
}

// The prefix cache, or for --no-prefix-cache the archetype, which caches nothing.
template <class Cache>
Cache make_cache(kvkit::block_pool& pool, std::int32_t block_size) {
  if constexpr (std::is_same_v<Cache, kvkit::prefix_cache<>>) {
    return Cache(pool, block_size, {.share_partial_blocks = true});
  } else {
    return Cache(block_size);
  }
}

// kvkit: the scheduler decides every step (continuous batching, chunked prefill, prefix-cache
// admission, preemption by recompute); this loop plays the engine. The model's "samples" are the
// trace's output tokens, so a preempted and recomputed request produces the same tokens.
#if !defined(KVKIT_SIM_GPU)
} // namespace
namespace sim {
std::unique_ptr<engine> make_gpu_engine(std::int32_t, std::int32_t, std::int32_t, model_shape,
                                        std::int32_t, bool, std::string& why) {
  why = "this build has no CUDA";
  return nullptr;
}
} // namespace sim
namespace {
#endif

// The model engine: GPU kernels on a Llama-3-8B-shaped layer when a GPU is there (unless --engine
// cpu), else the CPU reference on 2 KV heads x 32 channels, two decode sequences a step.
std::unique_ptr<sim::engine> make_engine(const options& o, std::int32_t capacity,
                                         std::int32_t host_capacity) {
  std::string why = "--engine cpu";
  if (o.engine != "cpu") {
    auto gpu = sim::make_gpu_engine(capacity, host_capacity, o.block_size, {8, 4, 128},
                                    o.max_running, o.check_pages, why);
    if (gpu != nullptr) {
      return gpu;
    }
    if (o.engine == "gpu") {
      std::fprintf(stderr, "no GPU engine: %s\n", why.c_str());
      std::exit(2);
    }
  }
  if (!o.quiet) {
    std::printf("model engine: CPU reference (%s)\n", why.c_str());
  }
  return std::make_unique<sim::cpu_engine>(capacity, host_capacity, o.block_size,
                                           sim::model_shape{2, 2, 32}, 2);
}

template <class Cache>
stats simulate_kvkit(const options& o, const std::vector<request>& trace, std::FILE* csv) {
  using table_t = kvkit::block_table<kvkit::block_pool>;
  using cache_t = Cache;
  kvkit::block_pool pool(o.kv_tokens / o.block_size);
  table_t table(pool, o.block_size);
  cache_t cache = make_cache<Cache>(pool, o.block_size);
  const kvkit::scheduler_config cfg{.max_running = o.max_running,
                                    .max_batched_tokens = o.max_batched_tokens,
                                    .prefill_chunk = o.prefill_chunk,
                                    .watermark_blocks = std::max(1, pool.capacity() / 100),
                                    .preemption = o.preempt == "swap"
                                                      ? kvkit::preemption_mode::swap
                                                      : kvkit::preemption_mode::recompute,
                                    .host_blocks = o.host_tokens / o.block_size};
  kvkit::scheduler<table_t, cache_t, kvkit::block_pool> sched(table, cache, pool, cfg);
  stats st;
  std::vector<std::int32_t> produced(trace.size(), 0);
  std::vector<std::int32_t> filled(static_cast<std::size_t>(pool.capacity()), 0);
  std::vector<kvkit::block_id> touched;
  std::vector<kvkit::seq_id> batch;
  std::vector<std::int32_t> indptr, indices, last;
  std::vector<std::array<token_id, 1>> sampled;
  std::vector<kvkit::sample_result> samples;
  auto engine = make_engine(o, pool.capacity(), cfg.host_blocks);
  // What the engine needs per step: token history per request, slots, decode page table.
  std::vector<std::vector<token_id>> history(trace.size());
  std::vector<std::int64_t> slots;
  std::vector<std::int32_t> query_lens, positions, d_indptr, d_indices, d_last, q_positions;
  std::vector<token_id> tokens, q_tokens, p_tokens;
  std::vector<std::int32_t> p_positions;
  std::vector<kvkit::seq_id> decoding, prefilling;
  std::vector<const std::vector<token_id>*> histories, p_histories;
  std::vector<std::int32_t> p_indptr, p_indices, p_last, p_qo;
  std::size_t next_arrival = 0;
  std::size_t finished = 0;
  std::size_t next_report = trace.size() / 10;
  for (std::int64_t step = 0; finished < trace.size(); ++step) {
    while (next_arrival < trace.size() && trace[next_arrival].arrival <= step) {
      const request& r = trace[next_arrival];
      const kvkit::status added = sched.add_request(
          {next_arrival, r.prompt, static_cast<std::int32_t>(r.output.size()), 0});
      if (!added) {
        std::fprintf(stderr, "request %zu rejected: %s\n", next_arrival,
                     std::string(kvkit::to_string(added.error())).c_str());
        ++finished;
      } else {
        history[next_arrival] = r.prompt;
      }
      ++next_arrival;
    }
    const kvkit::step_plan& plan = sched.step();
    // The engine (the model engine below runs the copies): export the page table, compute, sample.
    batch.clear();
    sampled.resize(plan.batch.size());
    samples.clear();
    for (std::size_t i = 0; i < plan.batch.size(); ++i) {
      const auto& b = plan.batch[i];
      batch.push_back(b.id);
      if (b.decode) {
        ++st.decode_tokens;
      } else {
        st.prompt_tokens += b.num_tokens;
        st.computed_prompt += b.num_tokens;
      }
      if (b.samples) {
        const auto idx = static_cast<std::size_t>(b.id);
        sampled[i][0] = trace[idx].output[static_cast<std::size_t>(produced[idx]++)];
        samples.push_back({b.id, sampled[i], false});
      }
    }
    // The model: copies, K/V of every computed token, decode attention.
    query_lens.clear();
    tokens.clear();
    positions.clear();
    decoding.clear();
    q_tokens.clear();
    q_positions.clear();
    histories.clear();
    prefilling.clear();
    p_histories.clear();
    p_tokens.clear();
    p_positions.clear();
    p_qo.assign(1, 0);
    for (const auto& b : plan.batch) {
      const auto& h = history[static_cast<std::size_t>(b.id)];
      query_lens.push_back(b.num_tokens);
      for (std::int32_t p = b.first_position; p < b.first_position + b.num_tokens; ++p) {
        tokens.push_back(h[static_cast<std::size_t>(p)]);
        positions.push_back(p);
      }
      if (b.decode) {
        decoding.push_back(b.id);
        q_tokens.push_back(h[static_cast<std::size_t>(b.first_position)]);
        q_positions.push_back(b.first_position);
        histories.push_back(&h);
      } else if (b.num_tokens > 0) {
        // A prompt chunk: its tokens (just added to the computed ones) are the prefill's queries,
        // the last tokens of its table.
        if (*table.num_tokens(b.id) != b.first_position + b.num_tokens) {
          std::fprintf(stderr, "a prompt chunk that does not end the sequence's table\n");
          std::exit(1);
        }
        prefilling.push_back(b.id);
        p_qo.push_back(p_qo.back() + b.num_tokens);
        p_tokens.insert(p_tokens.end(), tokens.end() - b.num_tokens, tokens.end());
        p_positions.insert(p_positions.end(), positions.end() - b.num_tokens, positions.end());
        p_histories.push_back(&h);
      }
    }
    slots.resize(tokens.size());
    d_indptr.resize(decoding.size() + 1);
    d_last.resize(decoding.size());
    d_indices.resize(static_cast<std::size_t>(*table.csr_size(decoding)));
    p_indptr.resize(prefilling.size() + 1);
    p_last.resize(prefilling.size());
    p_indices.resize(static_cast<std::size_t>(*table.csr_size(prefilling)));
    if (!table.export_slot_mapping(batch, query_lens, slots).ok() ||
        !table.export_csr(decoding, d_indptr, d_indices, d_last).ok() ||
        !table.export_csr(prefilling, p_indptr, p_indices, p_last).ok()) {
      std::fprintf(stderr, "slot mapping or page-table export failed\n");
      std::exit(1);
    }
    engine->step({plan.swap_out, plan.swap_in, plan.copies, slots, tokens, positions, d_indptr,
                  d_indices, d_last, q_tokens, q_positions, histories, p_indptr, p_indices, p_last,
                  p_qo, p_tokens, p_positions, p_histories});
    indptr.resize(batch.size() + 1);
    last.resize(batch.size());
    indices.resize(static_cast<std::size_t>(*table.csr_size(batch)));
    if (!table.export_csr(batch, indptr, indices, last).ok()) {
      std::fprintf(stderr, "page-table export failed\n");
      std::exit(1);
    }
    // Memory held by the batch: tokens stored in its blocks (each shared block once).
    std::int64_t stored = 0;
    touched.clear();
    for (const auto id : batch) {
      const auto blocks = *table.blocks(id);
      const std::int32_t len = *table.num_tokens(id);
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        const std::int32_t in_block =
            i + 1 < blocks.size() ? o.block_size : kvkit::last_block_len(len, o.block_size);
        auto& f = filled[static_cast<std::size_t>(blocks[i])];
        if (f == 0) {
          touched.push_back(blocks[i]);
        }
        stored += std::max(0, in_block - f);
        f = std::max(f, in_block);
      }
    }
    for (const auto b : touched) {
      filled[static_cast<std::size_t>(b)] = 0;
    }
    st.stored_token_steps += static_cast<double>(stored);
    st.reserved_token_steps += static_cast<double>(pool.num_used()) * o.block_size;
    csv_row(csv, "kvkit", step, plan.batch.size(), sched.num_waiting(),
            static_cast<double>(pool.num_used()) * o.block_size, static_cast<double>(stored),
            plan.num_tokens);
    st.running_sum += static_cast<double>(plan.batch.size());
    st.max_running = std::max(st.max_running, static_cast<std::int32_t>(plan.batch.size()));
    st.copies += static_cast<std::int64_t>(plan.copies.size());
    st.swapped_out += static_cast<std::int64_t>(plan.swap_out.size());
    st.swapped_in += static_cast<std::int64_t>(plan.swap_in.size());
    const auto done = sched.complete_step(samples);
    if (!done) {
      std::fprintf(stderr, "complete_step failed: %s\n",
                   std::string(kvkit::to_string(done.error())).c_str());
      std::exit(1);
    }
    finished += done->size();
    for (const auto& s : samples) {
      history[static_cast<std::size_t>(s.id)].push_back(s.tokens[0]);
    }
    for (const auto& f : *done) {
      history[static_cast<std::size_t>(f.id)] = {}; // finished: free its history
    }
    st.steps = step + 1;
    report_progress("kvkit paged", o, finished, trace.size(), next_report, step,
                    sched.num_running(), sched.num_waiting());
  }
  // Prompt tokens served from cache: everything admitted minus what was computed.
  if constexpr (requires { cache.stats(); }) {
    st.prompt_tokens += cache.stats().hit_tokens;
    st.hit_rate = cache.stats().hit_rate();
  }
  st.preemptions = sched.num_preemptions();
  st.drained = pool.num_used() == 0 && table.num_sequences() == 0;
  st.engine = engine->stats();
  return st;
}

// The baseline: static batching with max_len contiguous slots reserved per request. A batch of
// as many requests as fit is formed, prefilled, and decoded until its longest request finishes;
// only then is the next batch formed. No reuse of shared prompts.
stats simulate_static(const options& o, const std::vector<request>& trace, std::FILE* csv) {
  stats st;
  const auto slots = static_cast<std::size_t>(std::min(o.kv_tokens / o.max_len, o.max_running));
  std::size_t next = 0;
  std::size_t next_report = trace.size() / 10;
  std::int64_t step = 0;
  while (next < trace.size()) {
    // Wait for the first request of the batch, then take every request that has arrived.
    step = std::max<std::int64_t>(step, trace[next].arrival);
    std::size_t end = next;
    while (end < trace.size() && end - next < slots && trace[end].arrival <= step) {
      ++end;
    }
    std::int32_t longest = 0;
    std::int64_t batch_prompt = 0;
    for (std::size_t i = next; i < end; ++i) {
      batch_prompt += static_cast<std::int64_t>(trace[i].prompt.size());
      st.prompt_tokens += static_cast<std::int64_t>(trace[i].prompt.size());
      longest = std::max(longest, static_cast<std::int32_t>(trace[i].output.size()));
    }
    st.computed_prompt = st.prompt_tokens;
    // Step 0 of the batch prefills every prompt; then one token per unfinished request per step.
    for (std::int32_t t = 0; t < longest; ++t) {
      double live = 0;
      std::int32_t active = 0;
      for (std::size_t i = next; i < end; ++i) {
        const auto out = static_cast<std::int32_t>(trace[i].output.size());
        if (t < out) {
          ++active;
          st.decode_tokens += t > 0 ? 1 : 0;
        }
        live += static_cast<double>(trace[i].prompt.size()) + std::min(t, out);
      }
      st.stored_token_steps += live;
      st.reserved_token_steps += static_cast<double>(end - next) * o.max_len;
      csv_row(csv, "static", step, static_cast<std::size_t>(active), trace.size() - end,
              static_cast<double>(end - next) * o.max_len, live, t == 0 ? batch_prompt : active);
      st.running_sum += active;
      st.max_running = std::max(st.max_running, static_cast<std::int32_t>(end - next));
      ++step;
    }
    next = end;
    report_progress("static batching", o, next, trace.size(), next_report, step, 0,
                    trace.size() - next);
  }
  st.steps = step;
  st.drained = true;
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
    if (a == "--check-pages") {
      o.check_pages = true;
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
    } else if (a == "--csv") {
      o.csv = v;
    } else if (a == "--max-batched-tokens") {
      o.max_batched_tokens = std::atoi(v);
    } else if (a == "--prefill-chunk") {
      o.prefill_chunk = std::atoi(v);
    } else if (a == "--follow-ups") {
      o.follow_up_share = std::atof(v);
    } else if (a == "--engine") {
      o.engine = v;
    } else if (a == "--preempt") {
      o.preempt = v;
    } else if (a == "--host-tokens") {
      o.host_tokens = std::atoi(v);
    } else {
      return false;
    }
  }
  if (o.preempt == "swap" && o.host_tokens == 0) {
    o.host_tokens = o.kv_tokens / 2;
  }
  return (o.engine == "auto" || o.engine == "gpu" || o.engine == "cpu") &&
         (o.preempt == "recompute" || o.preempt == "swap") &&
         (o.preempt == "recompute" || o.host_tokens >= o.block_size) && o.host_tokens >= 0 &&
         o.requests > 0 && o.block_size > 0 && o.max_len >= 64 && o.kv_tokens >= 2 * o.max_len &&
         o.max_running > 0 && o.max_batched_tokens > 0 && o.prefill_chunk > 0 &&
         o.arrivals_per_step > 0 && o.follow_up_share >= 0 && o.follow_up_share <= 1;
}

} // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0); // progress lines show as they happen, piped or not
  options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: serving_sim [--requests N] [--seed S] [--block-size B] [--kv-tokens T]\n"
                 "                   [--max-len L] [--max-running R] [--arrival-rate A]\n"
                 "                   [--max-batched-tokens T] [--prefill-chunk C]\n"
                 "                   [--follow-ups F] [--no-prefix-cache] [--csv FILE] [--quiet]\n"
                 "                   [--engine auto|gpu|cpu] [--check-pages]\n"
                 "                   [--preempt recompute|swap] [--host-tokens H]\n"
                 "  kv-tokens >= 2 x max-len, max-len >= 64, 0 <= follow-ups <= 1\n"
                 "  --check-pages: the GPU kernels in their debug mode, every page id checked\n"
                 "  --preempt swap: preempted requests go to a host tier of H tokens (default\n"
                 "    half the KV memory) and come back from it\n");
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
  std::printf("kvkit serving simulation\n");
  std::printf("trace: %d requests, seed %llu, %.2f arrivals/step, %.0f%% follow-up turns, mean "
              "prompt %.0f, mean output %.0f tokens\n",
              o.requests, static_cast<unsigned long long>(o.seed), o.arrivals_per_step,
              100 * o.follow_up_share, mean_prompt, mean_output);
  std::printf("KV memory: %d tokens (%d blocks of %d), max_len %d, batch limit %d, prefix cache "
              "%s\n",
              o.kv_tokens, o.kv_tokens / o.block_size, o.block_size, o.max_len, o.max_running,
              o.prefix_cache ? "on" : "off");
  if (o.preempt == "swap") {
    std::printf("preemption: swap to a host tier of %d tokens (%d blocks)\n\n", o.host_tokens,
                o.host_tokens / o.block_size);
  } else {
    std::printf("preemption: recompute\n\n");
  }

  std::FILE* csv = o.csv.empty() ? nullptr : std::fopen(o.csv.c_str(), "w");
  if (!o.csv.empty() && csv == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", o.csv.c_str());
    return 2;
  }
  if (csv != nullptr) {
    std::fprintf(csv,
                 "system,step,running,waiting,reserved_tokens,stored_tokens,computed_tokens\n");
  }
  const stats paged = o.prefix_cache
                          ? simulate_kvkit<kvkit::prefix_cache<>>(o, trace, csv)
                          : simulate_kvkit<kvkit::testing::prefix_index_archetype>(o, trace, csv);
  const stats base = simulate_static(o, trace, csv);
  if (csv != nullptr) {
    std::fclose(csv);
  }

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
  row("kvkit scheduler", paged);
  row("static, max_len", base);
  std::printf("\nkvkit finished the trace in %.2fx fewer steps and computed %.1f%% of the prompt "
              "tokens the baseline did.\n",
              static_cast<double>(base.steps) / static_cast<double>(paged.steps),
              100.0 * static_cast<double>(paged.computed_prompt) /
                  static_cast<double>(base.computed_prompt));
  std::printf("utilization = tokens held in reserved KV memory / reserved KV slots, averaged over "
              "steps (a shared block counts once); %lld copy-on-write page copies.\n",
              static_cast<long long>(paged.copies));
  if (o.preempt == "swap") {
    std::printf("swaps: %lld pages out to the host tier, %lld back in.\n",
                static_cast<long long>(paged.swapped_out),
                static_cast<long long>(paged.swapped_in));
  }
  const sim::engine_stats& e = paged.engine;
  std::printf("\nmodel engine: %s\n", e.name.c_str());
  std::printf("  K/V written for %lld tokens, decode attention for %lld, prefill attention for "
              "%lld queries; %lld decode and %lld prefill outputs checked against a dense float64 "
              "recomputation from the tokens: max relative error %.2e\n",
              static_cast<long long>(e.written_tokens), static_cast<long long>(e.decode_tokens),
              static_cast<long long>(e.prefill_tokens), static_cast<long long>(e.checked),
              static_cast<long long>(e.prefill_checked), e.max_rel_error);
  if (o.preempt == "swap") {
    std::printf("  %lld of the checked outputs were of a sequence with a page swapped in that "
                "step\n",
                static_cast<long long>(e.swap_checked));
  }
  if (e.kernel_seconds > 0) {
    std::printf(
        "  device time: %.1f ms in all (swaps, copies, K/V writes, decode, prefill); decode %.1f "
        "ms, %.2f TB/s of K/V read; prefill %.1f ms, %.1f TFLOP/s\n",
        e.kernel_seconds * 1e3, e.decode_seconds * 1e3,
        e.decode_bytes / std::max(e.decode_seconds, 1e-12) / 1e12, e.prefill_seconds * 1e3,
        e.prefill_flops / std::max(e.prefill_seconds, 1e-12) / 1e12);
  }
  if (!paged.drained || !base.drained) {
    std::fprintf(stderr, "error: KV memory not fully returned at the end\n");
    return 1;
  }
  if (!e.failure.empty()) {
    std::fprintf(stderr, "error: the model engine failed: %s\n", e.failure.c_str());
    return 1;
  }
  if (paged.swapped_in > 0 && e.decode_tokens > 0 && e.swap_checked == 0) {
    std::fprintf(stderr, "error: no output of a sequence just swapped in was checked\n");
    return 1;
  }
  if (e.swapped_pages != paged.swapped_out + paged.swapped_in) {
    std::fprintf(stderr, "error: the model engine swapped %lld pages of the plans' %lld\n",
                 static_cast<long long>(e.swapped_pages),
                 static_cast<long long>(paged.swapped_out + paged.swapped_in));
    return 1;
  }
  if (!(e.max_rel_error < 2e-2) || (e.decode_tokens > 0 && e.checked == 0) ||
      (e.prefill_tokens > 0 && e.prefill_checked == 0)) {
    std::fprintf(stderr, "error: attention disagrees with the dense recomputation (or none of "
                         "its outputs was checked)\n");
    return 1;
  }
  return 0;
}
